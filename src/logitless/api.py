"""The public operation: validation and backend choice (``record.py`` keeps the record of which backend ran)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import checks
from .ops import function, label_set_function
from .ops import truncation as truncation_op
from .ops.precision import GRAD_PRECISIONS, PRECISIONS, resolve
from .ops.registry import BACKENDS, choose_backend
from .record import last_backend, last_precision, write_record
from .truncation import TruncatedLogProbs, Truncation

if TYPE_CHECKING:
    from .parallel import VocabParallel

__all__ = ["fused_logprobs", "TokenLogProbs", "last_backend", "last_precision", "choose_backend", "BACKENDS",
           "PRECISIONS", "GRAD_PRECISIONS"]


class TokenLogProbs(NamedTuple):
    """Per-token results, float32, in the labels' shape. ``entropy`` is None when not asked for."""
    logprobs: Tensor
    entropy: Optional[Tensor]


def inv_temperature(temperature, labels: Tensor, check_values: bool = True) -> Tensor:
    """float32 [N] of 1/temperature, from a number or a tensor broadcastable to labels (the range rule:
    ``checks.temperature``). ``check_values=False`` skips the check of a tensor's values (its one host
    synchronisation): the op checks them (``checks.inverse_temperature_ok``), as out-of-range values
    come out NaN here. A number is always checked."""
    t = checks.temperature(temperature, device=labels.device, check_values=check_values)
    if isinstance(t, Tensor):
        t = checks.precise(temperature, t)
    else:
        return torch.full((labels.numel(),), checks.inverse_temperature_of(t), dtype=torch.float32,
                          device=labels.device)
    if t.dim() == 1 and t.numel() > 1 and labels.dim() >= 2:
        # broadcasting would line [k] up with the *last* (sequence) axis: a per-sequence [b] would
        # silently become per-position whenever b == s
        raise ValueError(f"temperature of shape {tuple(t.shape)} is ambiguous for labels of shape "
                         f"{tuple(labels.shape)}: pass [b, 1] for one per sequence or the labels' full "
                         f"shape for one per token")
    try:
        t = torch.broadcast_to(t, labels.shape)
    except RuntimeError:
        raise ValueError(f"temperature of shape {tuple(t.shape)} does not broadcast to the "
                         f"labels' shape {tuple(labels.shape)}") from None
    return checks.inverse_temperature(t.reshape(-1))


def autocast_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden, weight) as ``F.linear`` would take them under the autocast of hidden's device type, if it is
    enabled: float32 / bfloat16 / float16 operands cast (differentiably) to the autocast dtype, others left
    alone; unchanged outside autocast. The fused ops then compute exactly on what this returns (float32
    logits, never rounded), with autocast disabled inside (``ops.maths.no_autocast``)."""
    kind = hidden.device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except RuntimeError:     # a device type without autocast (meta): nothing to do
        return hidden, weight
    if not enabled:
        return hidden, weight
    dtype = torch.get_autocast_dtype(kind)

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.dtype in checks.FLOAT_DTYPES and t.dtype != dtype else t
    return cast(hidden), cast(weight)


def head_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden, weight) as a model's LM head multiplies them: ``autocast_operands`` under autocast; outside it,
    hidden cast to the weight's dtype (hidden states that reach the head in another dtype). The integrations
    call this before the fused ops, which refuse mixed dtypes outside autocast."""
    hidden, weight = autocast_operands(hidden, weight)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden, weight


def check_head(hidden, weight, labels, label_sets: bool = False, labels_name: str = "labels"
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The checks every fused entry point makes on (hidden [..., H], weight [V, H], labels [...]).
    With ``label_sets`` labels may also be [..., k] (k ids per token: one more dimension than hidden's
    leading shape). ``labels=None`` checks hidden and weight only. Under autocast hidden and weight come back
    as ``autocast_operands`` makes them."""
    hidden = checks.tensor(hidden, "hidden")
    weight = checks.tensor(weight, "weight")
    if labels is not None:
        labels = checks.index_tensor(labels, labels_name)
    hidden, weight = autocast_operands(hidden, weight)
    if hidden.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype} (mixed dtypes are "
                        f"taken under torch.autocast only, cast as F.linear casts them)")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V == 0)")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has H={weight.shape[1]} but hidden has H={hidden.shape[-1]}")
    if weight.shape[1] == 0:
        raise ValueError("hidden and weight have no features (H == 0): every logit would be 0")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden on {hidden.device}")
    if labels is None:
        return hidden, weight, labels
    sets = label_sets and labels.dim() == hidden.dim() and labels.shape[:-1] == hidden.shape[:-1]
    if labels.shape != hidden.shape[:-1] and not sets:
        also = " or that shape + [k] (k ids per token)" if label_sets else ""
        raise ValueError(f"{labels_name} shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}{also}")
    if sets and labels.shape[-1] == 0:
        raise ValueError(f"{labels_name} of shape {tuple(labels.shape)} hold no id per token (k == 0)")
    if labels.device != hidden.device:
        raise ValueError(f"{labels_name} are on {labels.device}, hidden on {hidden.device}")
    return hidden, weight, labels


def vocab_layout(weight: Tensor, tp_group) -> tuple[Optional["VocabParallel"], int]:
    """(the vocab-parallel layout or None, the global vocabulary size)."""
    if tp_group is None:
        return None, weight.shape[0]
    from .parallel import VocabParallel
    tp = VocabParallel.for_group(tp_group, weight)
    return tp, tp.vocab_size


def tp_group_name(tp_group) -> Optional[str]:
    """The registered name of a process group (what the custom op takes), after the group checks of
    ``logitless.parallel`` (RuntimeError / TypeError / ValueError); None for None."""
    if tp_group is None:
        return None
    from .parallel import _check_group
    _check_group(tp_group)
    return tp_group.group_name


def fused_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                   temperature: Union[float, Tensor] = 1.0, with_entropy: bool = True,
                   ignore_index: int = -100, tp_group=None, reduce_grad_hidden: bool = True,
                   backend: str = "auto", softcap: Optional[float] = None,
                   check_inputs: bool = True, precision: Optional[str] = None,
                   grad_precision: Optional[str] = None, bf16_exact: Optional[str] = None,
                   truncation: Optional[Truncation] = None) -> TokenLogProbs | TruncatedLogProbs:
    """Log-probability of each label and entropy of softmax(z), z = hidden @ weight.T / temperature
    (or, with ``softcap``, z = softcap * tanh(hidden @ weight.T / softcap) / temperature),
    without materialising the [tokens x vocab] logits.

    Args:
        hidden: [..., H] float32, bfloat16 or float16; any strides; H >= 1.
        weight: [V, H], same dtype and device as ``hidden`` (the LM head / output embedding).
            Under ``tp_group`` this rank's contiguous shard of vocabulary rows. Under ``torch.autocast``
            both are cast to the autocast dtype as ``F.linear`` casts them (so mixed dtypes are accepted
            there), then computed on exactly: float32 logits, never rounded (docs/contexts.md).
        labels: [...] int32 or int64, the leading shape of ``hidden``; values in [0, V) (global ids
            under tensor parallelism) or ``ignore_index``. Or [..., k]: k distinct ids per token (a
            teacher's top-k), whose log-probs come back as [..., k]; a token is ignored when all k equal
            ``ignore_index`` (some but not all is a ValueError, as is an id repeated within a token).
        temperature: a number, or a tensor broadcastable to ``labels.shape`` (per sequence or per
            token), finite and >= 1e-30 (1 / temperature scales float32 logits; any larger finite value
            is exact). Not differentiated.
        with_entropy: compute the entropy too (False does less work and returns ``entropy=None``).
        ignore_index: label value whose rows get logprob 0, entropy 0 and no gradient.
        tp_group: a torch.distributed process group over which ``weight`` is sharded by vocab rows.
        reduce_grad_hidden: under ``tp_group``, all-reduce d_hidden inside backward (default), so
            every rank gets the full gradient. False leaves it partial for callers whose own
            region ops reduce it (Megatron's copy-to-tensor-parallel region, or
            ``logitless.parallel.gather_sequence``, whose backward reduce-scatters it); never both.
        backend: "auto", "reference", "chunked" or "triton"; see ``logitless.last_backend()``.
        softcap: None, or a number c in [1e-6, 1e6]: the logits are capped to (-c, c) by c * tanh(logit / c)
            before the temperature divides them (Gemma 2's ``final_logit_softcapping``). Exact in value
            and gradient; not differentiated itself.
        check_inputs: True (default): labels outside [0, V) and temperature values outside the range
            above raise ValueError, and rows whose label is ignore_index are skipped (they cost nothing,
            and a non-finite hidden state there stays out of every gradient); this takes host
            synchronisations (inside the op: ``torch.compile`` sees none). False: none at all, so the
            call can be captured in a CUDA graph; the values are not checked, and ignored rows are
            computed with no label and their outputs and gradients set to 0 (a NaN / inf hidden state
            on an ignored row then reaches d_weight). Under ``tp_group`` the first call per group and
            shard shape exchanges the shard sizes (a host synchronisation): make it outside capture.
        precision: how float32 operands are multiplied (``PRECISIONS``; docs/precision.md): None / "auto"
            (default): "split" on CUDA, "ieee" elsewhere. "split": each operand as two bfloat16 parts on the
            tensor cores, with as few products as the operands allow: one ("bf16x1", exact) when both hold
            bfloat16 values only (a head just cast up from bfloat16), two ("bf16x2") when one does (hidden
            states of a bfloat16 backbone cast to float32: TRL's cast_lm_head_to_fp32), three ("bf16x3",
            ~1e-5 from float64, ~3x a bfloat16 GEMM) otherwise, decided per call (``bf16_exact``).
            "bf16x3" forces the three products, "bf16x6" (six products, float32-exact), "tf32", "ieee"
            (IEEE float32 products). Half-precision operands take only None / "auto" (any other value is a
            ValueError: it would have no effect).
        grad_precision: the gradient products' precision (``GRAD_PRECISIONS``): None / "auto" (default):
            "bf16" for the split and TF32 precisions (bfloat16 dlogits and operand parts: a bfloat16 head's
            gradient error, ~2e-3 relative), "ieee" for "ieee"; "bf16x3" / "bf16x6" split the float32
            dlogits too (float32-exact gradients, three or six products each); "ieee". ``last_precision()``
            says what ran.
        bf16_exact: None (default), "hidden", "weight" or "both": which float32 operands the caller knows to
            hold bfloat16 values only, for the adaptive split (precision None / "auto" / "split"). With
            check_inputs the op tests both operands anyway (one pass over each, read with the checks'
            host synchronisation) and a claim the test refutes is a ValueError. With check_inputs=False
            (no host read) the claim alone chooses the products (None: the general three), and a false
            claim turns the outputs and gradients into NaN (tested on the device), never a wrong number.
            Half-precision operands, or another precision, refuse it (it would have no effect).
        truncation: None, or a ``Truncation``: the rollout sampler's top_k / top_p / min_p (numbers or per-token
            tensors, applied in vLLM's order after the temperature) or the kept ids it logged (``kept_ids``). The
            log-prob and entropy are then those of the truncated, renormalised distribution, differentiable with
            the kept set fixed (docs/truncation.md). One label per token; needs check_inputs (it reads the kept
            sets' sizes on the host).

    Returns:
        TokenLogProbs(logprobs, entropy), float32, each of ``labels.shape`` (with k ids per token:
        logprobs [..., k], entropy [...]). With ``truncation``: TruncatedLogProbs(logprobs, entropy, inside,
        kept_count, kept_logprob), each of ``labels.shape``.

    Gradients flow to ``hidden`` and ``weight`` (only those that require grad) from any loss on
    logprobs and/or entropy; nothing of size [tokens x vocab] is kept for backward. Any number of
    tokens: they are processed in chunks of bounded workspace (see ``logitless.ops.token_chunks``).

    The computation is the custom op ``torch.ops.logitless.fused_logprobs`` (``logitless.ops.function``),
    so a function calling this compiles under ``torch.compile(fullgraph=True)``.
    """
    hidden, weight, labels = check_head(hidden, weight, labels, label_sets=True)
    checks.boolean(with_entropy, "with_entropy")
    ignore_index = checks.ignore_index(ignore_index)
    checks.reduce_grad_hidden(reduce_grad_hidden, tp_group)
    softcap = checks.softcap(softcap)
    checks.boolean(check_inputs, "check_inputs")
    precision, grad_precision = resolve(precision, grad_precision, hidden.dtype, hidden.device, bf16_exact)

    mod, _ = choose_backend(hidden, weight, backend)
    sets = labels.dim() == hidden.dim()
    if truncation is not None:
        _check_truncation(truncation, sets, check_inputs)
    tokens = labels[..., 0] if sets else labels
    # the values of a temperature tensor, like the labels' range, are checked inside the op (check_inputs)
    inv_temp = inv_temperature(temperature, tokens, check_values=False)
    options = function.OpOptions(backend=mod.name, with_entropy=with_entropy, ignore_index=ignore_index,
                                 softcap=softcap, tp_group=tp_group_name(tp_group),
                                 reduce_grad_hidden=reduce_grad_hidden, check_inputs=check_inputs,
                                 precision=precision, grad_precision=grad_precision)
    # reshape outside the op so autograd links the caller's tensors to ours
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if truncation is not None:
        return _truncated(h2, weight, labels, inv_temp, options, truncation, tp_group)
    if sets:
        k = labels.shape[-1]
        lp, ent, _, _ = label_set_function.fused_logprobs_k(h2, weight, labels.reshape(-1, k).long(), inv_temp,
                                                            options)
        if lp.shape != labels.shape:
            lp = lp.view(labels.shape)
            ent = None if ent is None else ent.view(tokens.shape)
        return TokenLogProbs(lp, ent)
    lp, ent = function.fused_logprobs(h2, weight, labels.reshape(-1).long(), inv_temp, options)
    if lp.shape != labels.shape:   # no view when the shape is already right: FSDP2 warns on a module returning views
        lp = lp.view(labels.shape)
        ent = None if ent is None else ent.view(labels.shape)
    return TokenLogProbs(lp, ent if with_entropy else None)


def _check_truncation(truncation, sets: bool, check_inputs: bool) -> None:
    if not isinstance(truncation, Truncation):
        raise TypeError(f"truncation must be a logitless.Truncation or None, got {type(truncation).__name__}")
    truncation.check()
    if sets:
        raise ValueError("truncation takes one label per token: labels [..., k] (k ids per token) cannot be truncated")
    if not check_inputs:
        raise ValueError("truncation needs check_inputs=True: the kept sets' sizes are read on the host, which "
                         "check_inputs=False (CUDA-graph capture) forbids")


def _truncated(h2: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, options, truncation: Truncation,
               tp_group) -> TruncatedLogProbs:
    flat = labels.reshape(-1).long()
    settings = kept_ids = None
    if truncation.replay():
        _, vocab = vocab_layout(weight, tp_group)
        kept_ids = truncation.replay_ids(labels, vocab, flat != options.ignore_index)
    else:
        settings = truncation.row_settings(labels)
    out = truncation_op.truncated_logprobs(h2, weight, flat, inv_temp, options, settings, kept_ids)
    write_record("op", last_backend(), "fused_logprobs.truncation", truncation=truncation.describe())
    shape = labels.shape
    return TruncatedLogProbs(out.logprobs.view(shape), None if out.entropy is None else out.entropy.view(shape),
                             out.inside.view(shape), out.kept_count.view(shape),
                             None if out.kept_logprob is None else out.kept_logprob.view(shape))
