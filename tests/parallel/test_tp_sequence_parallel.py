"""Sequence-parallel helpers over 2 and 3 gloo processes (gather/scatter and their gradients, the
end-to-end Megatron layout, next-token labels across shards), and next_token_labels alone."""
from __future__ import annotations

import pytest
import torch

import tp_cases
from logitless.parallel import next_token_labels
from test_tp_vocab_parallel import params
from tp_harness import check_outcome


@pytest.mark.parametrize("world,case", params(tp_cases.SEQUENCE_CASES))
def test_sequence_parallel(world, case):
    check_outcome(world, case)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_next_token_labels_rolls_the_sequence(dtype):
    ids = torch.randint(0, 1000, (3, 7), dtype=dtype)
    labels = next_token_labels(ids)
    assert labels.dtype == dtype and labels.shape == ids.shape
    assert torch.equal(labels[:, :-1], ids[:, 1:])
    assert bool((labels[:, -1] == -100).all())
    by_rows = next_token_labels(ids.t().contiguous(), dim=0, ignore_index=-1)
    assert torch.equal(by_rows[:-1], ids.t()[1:]) and bool((by_rows[-1] == -1).all())
    single = next_token_labels(ids[:, :1])
    assert bool((single == -100).all())


def test_next_token_labels_bad_input():
    with pytest.raises(TypeError, match="input_ids"):
        next_token_labels(torch.randn(2, 3))
    with pytest.raises(TypeError, match="input_ids"):
        next_token_labels([[1, 2]])
    with pytest.raises(TypeError, match="ignore_index"):
        next_token_labels(torch.ones(2, 3, dtype=torch.long), ignore_index=1.5)
    with pytest.raises(ValueError, match="dim"):
        next_token_labels(torch.ones(2, 3, dtype=torch.long), dim=2)
    with pytest.raises(ValueError, match="input_ids"):
        next_token_labels(torch.tensor(3))
