"""Whole-batch entry points: padded batches (``forward_padded``) and jagged sequences
(``forward_packed``) through a Megatron GPTModel, returning per-token log-probs and entropy.

Both pack to THD, pad each sequence for TP x CP (x FP8), build next-token labels on the global
packed sequence, take this rank's zigzag share under context parallelism, run the model with the
fused processor (hook or legacy patch, from the cached mode), all-gather over CP and unpack to
the caller's layout. Every call writes a ``PathRecord`` (see record.py).

Output convention (as Megatron/verl): position t holds log p(token t+1 | tokens <= t) of the same
sequence, and the entropy of that next-token distribution. A sequence's last real token has no
next token: logprob 0 and entropy 0 there, as at pads.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import checks
from ..api import TokenLogProbs
from ..record import FusedPathUnavailable, last_path, strict_enabled, write_record
from .detect import mode_and_reason, unwrap_gpt_model
from .packing import (
    PackedBatch,
    check_padded,
    pack_like,
    pack_padded,
    pack_sequences,
    pad_multiple,
    unpack_to_list,
    unpack_to_padded,
    zigzag_merge,
    zigzag_split,
)
from .patch import patch_fused_forward
from .processor import FusedOutputProcessorContext, fused_output_processor
from .temperature import check_temperature, temperature_bs

IGNORE = -100


@dataclass
class ParallelLayout:
    """What packing needs from the model's parallel set-up."""
    tp_size: int
    cp_size: int
    cp_rank: int
    cp_group: object
    fp8_align: Optional[int]

    @property
    def align(self) -> int:
        return pad_multiple(self.tp_size, self.cp_size, self.fp8_align)


def parallel_layout(gpt: nn.Module) -> ParallelLayout:
    cfg = gpt.config
    tp = int(getattr(cfg, "tensor_model_parallel_size", 1) or 1)
    cp = int(getattr(cfg, "context_parallel_size", 1) or 1)
    group, rank = None, 0
    if cp > 1:
        pgs = getattr(gpt, "pg_collection", None)
        group = getattr(pgs, "cp", None) if pgs is not None else None
        if group is None:
            from megatron.core import parallel_state
            group = parallel_state.get_context_parallel_group()
        rank = dist.get_rank(group)
    fp8_align = None
    if getattr(cfg, "fp8", None):
        fp8_align = 32 if "mxfp8" in str(getattr(cfg, "fp8_recipe", "")).lower() else 16
    return ParallelLayout(tp, cp, rank, group, fp8_align)


def _packed_seq_params(batch: PackedBatch, layout: ParallelLayout):
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = batch.cu_seqlens_padded
    # Padded boundaries for q and kv: trailing pads belong to their sequence; causally no real
    # token attends to them, and no cross-sequence attention happens.
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
              cu_seqlens_kv_padded=cu, max_seqlen_q=batch.max_seqlen_padded,
              max_seqlen_kv=batch.max_seqlen_padded)
    if layout.cp_group is not None and "cp_group" in {f.name for f in fields(PackedSeqParams)}:
        kw["cp_group"] = layout.cp_group
    return PackedSeqParams(**kw)


def _gather_cp(x: Optional[Tensor], batch: PackedBatch, layout: ParallelLayout) -> Optional[Tensor]:
    """This rank's zigzag share [T / cp] -> the global packed tensor [T]. The gradient flows only
    into this rank's own share (the other shares are gathered as constants), so with Megatron's
    gradient reduction over the CP ranks each token's gradient counts once."""
    if x is None or layout.cp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(parts, x.detach(), group=layout.cp_group)
    parts[layout.cp_rank] = x
    return zigzag_merge(parts, batch.cu_seqlens_padded)


def _unfused(logits: Tensor, labels: Tensor, temperature, with_entropy: bool) -> TokenLogProbs:
    """The materialised reference path: logits [B, S, V] (already scaled by the model), labels
    [B, S]; temperature in any form ``temperature_bs`` takes ([B] is one value per row)."""
    z = logits.float()
    t = temperature_bs(temperature, labels.shape[0], labels.shape[1], z.device)
    z = z / (t.unsqueeze(-1) if isinstance(t, Tensor) else t)
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != IGNORE
    lp = logp.gather(-1, labels.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros_like(lp)
    lp = torch.where(valid, lp, zero)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), zero) if with_entropy else None
    return TokenLogProbs(lp, ent)


def _run(model: nn.Module, gpt: nn.Module, ids: Tensor, pos: Tensor, mask: Optional[Tensor], labels: Tensor,
         temperature, with_entropy: bool, packed_seq_params, strict: Optional[bool], backend: str,
         entry: str) -> TokenLogProbs:
    """One model call, fused when possible; checks from the record that the processor ran."""
    mode, reason = mode_and_reason(gpt)
    if mode == "unfused":
        if strict_enabled(strict):
            raise FusedPathUnavailable(f"{entry}: the fused path cannot run on {type(gpt).__name__}: {reason} "
                                       "(strict mode: LOGITLESS_STRICT=1 or strict=True)")
        logits = model(ids, pos, mask, packed_seq_params=packed_seq_params, runtime_gather_output=True)
        out = _unfused(logits, labels, temperature, with_entropy)
        write_record("unfused", None, entry, reason, type(gpt).__name__)
        return out
    patch_fused_forward(gpt)
    before = last_path()
    ctx = FusedOutputProcessorContext(temperature=temperature, with_entropy=with_entropy, ignore_index=IGNORE,
                                      backend=backend)
    out = model(ids, pos, mask, labels=labels, packed_seq_params=packed_seq_params,
                output_processor=fused_output_processor, output_processor_context=ctx)
    rec = last_path()
    if rec is None or rec is before or rec.entry != "processor" or rec.path != mode:
        raise RuntimeError(f"{entry}: the model returned without running logitless' output processor "
                           f"(mode {mode!r}); its output is not log-probabilities")
    write_record(rec.path, rec.backend, entry, model=rec.model or type(gpt).__name__)
    return TokenLogProbs(*out)   # Float16Module hands back a plain tuple


def _prepare(model, strict):
    strict_enabled(strict)      # validates the argument before any work
    gpt = unwrap_gpt_model(model)
    if not getattr(gpt, "post_process", True):
        raise ValueError("this GPTModel is not the last pipeline stage (post_process=False): it has no output "
                         "layer; run fused_output_processor through Megatron's pipeline schedule instead")
    return gpt, parallel_layout(gpt)


def _forward_batch(model, gpt, layout, batch: PackedBatch, positions: Tensor, temp_packed, with_entropy,
                   strict, backend, entry):
    """Run a packed batch; returns (logprobs, entropy) in the global packed layout [T]."""
    def local(x):
        return zigzag_split(x, batch.cu_seqlens_padded, layout.cp_size, layout.cp_rank)
    ids = local(batch.tokens).unsqueeze(0)
    pos = local(positions).unsqueeze(0)
    labels = local(batch.labels).unsqueeze(0)
    temp = local(temp_packed).unsqueeze(0) if isinstance(temp_packed, Tensor) else temp_packed
    psp = _packed_seq_params(batch, layout)
    out = _run(model, gpt, ids, pos, None, labels, temp, with_entropy, psp, strict, backend, entry)
    lp = _gather_cp(out.logprobs.reshape(-1), batch, layout)
    ent = _gather_cp(out.entropy.reshape(-1), batch, layout) if out.entropy is not None else None
    return lp, ent


def forward_padded(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   position_ids: Optional[Tensor] = None, *, temperature: Union[float, Tensor] = 1.0,
                   with_entropy: bool = True, packed: bool = True, strict: Optional[bool] = None,
                   backend: str = "auto") -> TokenLogProbs:
    """Per-token next-token log-probs and entropy of a padded batch.

    Args:
        model: a GPTModel (last pipeline stage), possibly wrapped (Float16Module, DDP, ...).
        input_ids: [b, s] int token ids. attention_mask: [b, s] bool or int, 1 = real token (any
            padding pattern). position_ids: [b, s] or None (count real tokens from 0 per row).
        temperature: float, or tensor [b] (per sequence) or [b, s] (per token).
        packed: True (default) runs THD with cu_seqlens (needs an attention that takes packed
            sequences, e.g. Transformer Engine's); False runs the [b, s] layout with a causal
            padding mask (no context parallelism).
        strict: raise FusedPathUnavailable instead of falling back to the unfused path
            (default: the env var LOGITLESS_STRICT).
    Returns:
        TokenLogProbs of float32 [b, s] (entropy None when with_entropy is False); 0 at pads and at
        each row's last real token. See ``last_path()`` for the path that ran.
    """
    gpt, layout = _prepare(model, strict)
    mask = check_padded(input_ids, attention_mask)
    temperature = check_temperature(temperature)
    checks.boolean(with_entropy, "with_entropy")
    if position_ids is not None and (not isinstance(position_ids, Tensor) or position_ids.shape != input_ids.shape):
        raise ValueError(f"position_ids must be None or a tensor of input_ids' shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    if isinstance(temperature, Tensor) and temperature.dim() > 0 and tuple(temperature.shape) not in ((b,), (b, s)):
        raise ValueError(f"temperature of shape {tuple(temperature.shape)} must be [b]=[{b}] or [b, s]=[{b}, {s}]")
    batch = pack_padded(input_ids, mask, align=layout.align if packed else 1, ignore_index=IGNORE)
    if not packed:
        return _forward_unpacked(model, gpt, layout, input_ids, mask, position_ids, batch, temperature,
                                 with_entropy, strict, backend)
    positions = batch.positions if position_ids is None else pack_like(position_ids.long(), mask, batch)
    if isinstance(temperature, Tensor) and temperature.dim() == 1:
        temp = temperature.float().to(input_ids.device).repeat_interleave(batch.padded_lengths)
    elif isinstance(temperature, Tensor) and temperature.dim() == 2:
        temp = pack_like(temperature.float().to(input_ids.device), mask, batch, fill=1.0)
    else:
        temp = temperature
    lp, ent = _forward_batch(model, gpt, layout, batch, positions, temp, with_entropy, strict, backend,
                             "forward_padded")
    lp = unpack_to_padded(lp, mask, batch)
    ent = unpack_to_padded(ent, mask, batch) if ent is not None else None
    return TokenLogProbs(lp, ent)


def _forward_unpacked(model, gpt, layout, input_ids, mask, position_ids, batch, temperature, with_entropy,
                      strict, backend) -> TokenLogProbs:
    if layout.cp_size > 1:
        raise ValueError("packed=False does not support context parallelism; use packed=True")
    b, s = input_ids.shape
    labels = unpack_to_padded(batch.labels, mask, batch, fill=IGNORE).long()
    pos = position_ids if position_ids is not None else (mask.long().cumsum(1) - 1).clamp(min=0)
    extra = (-s) % layout.tp_size   # sequence parallelism splits s over the TP ranks
    ids, m, temp = input_ids, mask, temperature
    if extra:
        def grow(x, fill):
            return torch.cat([x, x.new_full((b, extra), fill)], dim=1)
        ids, m, labels, pos = grow(ids, 0), grow(m, False), grow(labels, IGNORE), grow(pos, 0)
        if isinstance(temp, Tensor) and temp.dim() == 2:
            temp = grow(temp, 1.0)
    n = s + extra
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    attn_mask = ~(causal.unsqueeze(0) & m.unsqueeze(1)).unsqueeze(1)      # [b, 1, n, n], True = masked
    out = _run(model, gpt, ids, pos, attn_mask, labels, temp, with_entropy, None, strict, backend,
               "forward_padded")
    lp = out.logprobs[:, :s]
    ent = out.entropy[:, :s] if out.entropy is not None else None
    return TokenLogProbs(lp, ent)


def forward_packed(model: nn.Module, sequences, *, temperature: Union[float, Tensor] = 1.0,
                   with_entropy: bool = True, strict: Optional[bool] = None,
                   backend: str = "auto") -> TokenLogProbs:
    """Per-token next-token log-probs and entropy of jagged sequences, run packed (THD).

    Args:
        sequences: a list of 1-D int token tensors, or a jagged nested tensor (torch.jagged).
        temperature: float, or tensor [n] (one per sequence).
    Returns:
        TokenLogProbs whose fields hold one float32 [length_i] tensor per sequence, as a list (or a
        jagged nested tensor when the input was one); 0 at each sequence's last token.
    """
    gpt, layout = _prepare(model, strict)
    nested = isinstance(sequences, Tensor) and sequences.is_nested
    seqs: Sequence[Tensor] = list(sequences.unbind()) if nested else sequences
    temperature = check_temperature(temperature)
    checks.boolean(with_entropy, "with_entropy")
    batch = pack_sequences(seqs, align=layout.align, ignore_index=IGNORE)
    n = batch.lengths.numel()
    if isinstance(temperature, Tensor) and temperature.dim() > 0:
        if tuple(temperature.shape) != (n,):
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} must be [n]=[{n}] (one per sequence)")
        temp = temperature.float().to(batch.tokens.device).repeat_interleave(batch.padded_lengths)
    else:
        temp = temperature
    lp, ent = _forward_batch(model, gpt, layout, batch, batch.positions, temp, with_entropy, strict, backend,
                             "forward_packed")
    lps = unpack_to_list(lp, batch)
    ents = unpack_to_list(ent, batch) if ent is not None else None
    if nested:
        lps = torch.nested.as_nested_tensor(lps, layout=torch.jagged)
        ents = torch.nested.as_nested_tensor(ents, layout=torch.jagged) if ents is not None else None
    return TokenLogProbs(lps, ents)
