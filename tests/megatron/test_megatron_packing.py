"""THD packing, TP x CP x FP8 padding and the zigzag context-parallel split: exact round trips."""

import pytest
import torch

from logitless.megatron.packing import (
    pack_like,
    pack_padded,
    pack_sequences,
    pad_multiple,
    unpack_to_list,
    unpack_to_padded,
    zigzag_index,
    zigzag_merge,
    zigzag_split,
)
from logitless.parallel import next_token_labels

IGNORE = -100


def _ragged(gen, n=5, vocab=1031, max_len=23):
    lengths = torch.randint(1, max_len, (n,), generator=gen).tolist()
    lengths[0] = 1                                       # a one-token sequence has no label at all
    return [torch.randint(0, vocab, (n_,), generator=gen) for n_ in lengths]


@pytest.mark.parametrize("tp,cp,fp8,expected", [(1, 1, None, 1), (2, 1, None, 2), (3, 1, None, 3), (1, 2, None, 4),
                                                (2, 2, None, 8), (2, 3, None, 12), (2, 1, 16, 16),
                                                (1, 2, 16, 32), (4, 2, 32, 64)])
def test_pad_multiple(tp, cp, fp8, expected):
    assert pad_multiple(tp, cp, fp8) == expected
    # each CP rank's FP8 token count stays aligned, and the zigzag chunks are whole
    assert expected % (tp * cp) == 0
    if cp > 1:
        assert expected % (2 * cp) == 0
    if fp8:
        assert (expected // cp) % fp8 == 0


def test_pad_multiple_bad_input():
    with pytest.raises(ValueError, match="tp_size"):
        pad_multiple(0, 1)
    with pytest.raises(TypeError, match="cp_size"):
        pad_multiple(1, 1.5)
    with pytest.raises(ValueError, match="fp8_align"):
        pad_multiple(1, 1, 0)


@pytest.mark.parametrize("align", [1, 2, 3, 8, 16])
def test_pack_sequences_round_trip(seed, align):
    gen = torch.Generator().manual_seed(seed)
    seqs = _ragged(gen)
    batch = pack_sequences(seqs, align=align, ignore_index=IGNORE)
    lengths = [s.numel() for s in seqs]
    padded = batch.padded_lengths.tolist()
    assert all(p % align == 0 and p >= n and p - n < align for p, n in zip(padded, lengths, strict=True))
    assert batch.cu_seqlens.tolist() == [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    assert batch.cu_seqlens_padded.tolist() == [0] + list(torch.tensor(padded).cumsum(0).tolist())
    assert batch.cu_seqlens_padded.dtype == torch.int32 and batch.max_seqlen_padded == max(padded)
    assert batch.total == sum(padded)
    for got, want in zip(unpack_to_list(batch.tokens, batch), seqs, strict=True):
        assert torch.equal(got, want)
    for i, n in enumerate(lengths):
        start, p = int(batch.cu_seqlens_padded[i]), padded[i]
        assert batch.positions[start:start + p].tolist() == list(range(p))
        want = seqs[i][1:].tolist() + [IGNORE] * (p - n + 1)
        assert batch.labels[start:start + p].tolist() == want
        assert batch.real_mask()[start:start + p].tolist() == [True] * n + [False] * (p - n)


def test_pack_padded_any_mask_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s = 6, 17
    ids = torch.randint(1, 1031, (b, s), generator=gen)
    mask = torch.rand(b, s, generator=gen) < 0.7
    mask[0] = False
    mask[0, 3:9] = True                          # left- and right-padded
    mask[1] = True                               # no padding
    mask[2, :] = False
    mask[2, -1] = True                           # a single token at the end
    mask[3] = torch.arange(s) < 5                # right padding only
    batch = pack_padded(ids, mask.int(), align=4, ignore_index=IGNORE)
    back = unpack_to_padded(batch.tokens, mask, batch, fill=0)
    assert torch.equal(back, torch.where(mask, ids, torch.zeros_like(ids)))
    values = torch.randn(b, s, 3, generator=gen)
    packed = pack_like(values, mask, batch, fill=7.0)
    assert torch.equal(unpack_to_padded(packed, mask, batch), torch.where(mask.unsqueeze(-1), values, 0.0))
    assert (packed[~batch.real_mask()] == 7.0).all()
    # labels: the next *real* token of the same row
    labels = unpack_to_padded(batch.labels, mask, batch, fill=IGNORE)
    for i in range(b):
        real = ids[i][mask[i]].tolist()
        assert labels[i][mask[i]].tolist() == real[1:] + [IGNORE] * bool(real)


def test_unpack_is_differentiable(seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = _ragged(gen, n=3)
    batch = pack_sequences(seqs, align=4)
    x = torch.randn(batch.total, generator=gen, requires_grad=True)
    parts = unpack_to_list(x, batch)
    sum(p.sum() * (i + 1) for i, p in enumerate(parts)).backward()
    want = torch.zeros(batch.total)
    for i in range(len(seqs)):
        start = int(batch.cu_seqlens_padded[i])
        want[start:start + seqs[i].numel()] = i + 1
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("cp", [2, 3])
def test_zigzag_split_merge(seed, cp):
    gen = torch.Generator().manual_seed(seed)
    seqs = _ragged(gen, n=4)
    batch = pack_sequences(seqs, align=pad_multiple(1, cp))
    x = torch.randn(batch.total, 5, generator=gen, requires_grad=True)
    parts = [zigzag_split(x, batch.cu_seqlens_padded, cp, r) for r in range(cp)]
    assert all(p.shape == (batch.total // cp, 5) for p in parts)
    # rank r holds chunks r and 2cp-1-r of every sequence, in that order
    for r in range(cp):
        want = []
        for i in range(len(seqs)):
            start, n = int(batch.cu_seqlens_padded[i]), int(batch.padded_lengths[i])
            c = n // (2 * cp)
            want += list(range(start + r * c, start + (r + 1) * c))
            want += list(range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c))
        assert zigzag_index(batch.cu_seqlens_padded, cp, r).tolist() == want
    merged = zigzag_merge(parts, batch.cu_seqlens_padded)
    assert torch.equal(merged, x)
    merged.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_labels_rolled_on_the_global_sequence(seed):
    """The peer bug: rolling labels on a CP shard gives each shard's chunk ends a wrong label."""
    gen = torch.Generator().manual_seed(seed)
    cp = 2
    seqs = [torch.randint(1, 1031, (n,), generator=gen) for n in (16, 9, 13)]
    batch = pack_sequences(seqs, align=pad_multiple(1, cp), ignore_index=IGNORE)
    for r in range(cp):
        idx = zigzag_index(batch.cu_seqlens_padded, cp, r)
        local_labels = zigzag_split(batch.labels, batch.cu_seqlens_padded, cp, r)
        assert torch.equal(local_labels, batch.labels[idx])       # the global labels, carried along
        rolled_locally = next_token_labels(zigzag_split(batch.tokens, batch.cu_seqlens_padded, cp, r),
                                           ignore_index=IGNORE)
        real = local_labels != IGNORE
        assert not torch.equal(rolled_locally[real], local_labels[real])


def test_zigzag_bad_lengths():
    batch = pack_sequences([torch.arange(6)], align=2)
    with pytest.raises(ValueError, match="2 \\* cp"):
        zigzag_split(batch.tokens, batch.cu_seqlens_padded, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_index(batch.cu_seqlens_padded, 2, 2)


def test_pack_bad_input():
    with pytest.raises(TypeError, match="sequences"):
        pack_sequences([])
    with pytest.raises(TypeError, match=r"sequences\[1\]"):
        pack_sequences([torch.arange(3), torch.rand(3)])
    with pytest.raises(ValueError, match="attention_mask"):
        pack_padded(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(TypeError, match="input_ids"):
        pack_padded(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(TypeError, match="attention_mask"):
        pack_padded(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    # the padding multiple: an int >= 1 (0 was a ZeroDivisionError, a float passed through the arithmetic)
    with pytest.raises(ValueError, match="align must be an int >= 1"):
        pack_sequences([torch.arange(3)], align=0)
    with pytest.raises(TypeError, match="align must be an int"):
        pack_padded(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), align=2.0)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        pack_sequences([torch.arange(3)], ignore_index=-100.0)
