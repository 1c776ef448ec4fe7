"""The public top-k op: the k most probable ids per token, their log-probs and the mass outside them (what a
teacher sends a student in top-k distillation), from hidden states and the LM head, without the logits."""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import checks
from .api import check_head, inv_temperature, tp_group_name, vocab_layout
from .ops import label_set_function
from .ops.precision import resolve
from .ops.registry import choose_backend

__all__ = ["fused_topk", "TopKLogProbs"]


class TopKLogProbs(NamedTuple):
    """ids [..., k] int64 (descending probability, ties to the lower id), logprobs [..., k] float32 (normalised
    over the whole vocabulary), tail_logprob [...] float32 (log of the mass outside the k ids)."""
    ids: Tensor
    logprobs: Tensor
    tail_logprob: Tensor


def fused_topk(hidden: Tensor, weight: Tensor, k: int, *, temperature: Union[float, Tensor] = 1.0,
               mask: Optional[Tensor] = None, tp_group=None, reduce_grad_hidden: bool = True,
               backend: str = "auto", softcap: Optional[float] = None, precision: Optional[str] = None,
               grad_precision: Optional[str] = None, check_inputs: bool = True) -> TopKLogProbs:
    """The top-k of softmax(z), z = hidden @ weight.T / temperature (softcapped first with ``softcap``, as in
    ``fused_logprobs``), per token, in one pass over the vocabulary and without the [tokens x vocab] logits.

    Args:
        hidden: [..., H] float32 / bfloat16 / float16. weight: [V, H] (under ``tp_group`` this rank's shard).
        k: 1 <= k <= V (the global V under ``tp_group``).
        temperature: a number or a tensor broadcastable to hidden's leading shape (per sequence / per token).
        mask: None (every token) or a bool tensor of hidden's leading shape: tokens where it is False cost
            nothing and get ids -1, logprobs 0 and tail_logprob 0.
        tp_group: vocabulary-parallel group: the top-k is global (every rank's candidates merged, ties to the
            lower global id), identical on every rank.
        reduce_grad_hidden, softcap: as in ``fused_logprobs``.
        backend: "triton" ("auto" on CUDA) selects in the statistics pass's kernels (``ops/triton/topk_select``:
            k <= 2048 with k < V and check_inputs; otherwise the torch pass, ``last_backend()`` says which ran);
            "reference" or "chunked" run the selection in torch (the reference on one [tokens x V] tile, the
            chunked backend in its tiles). The backward runs the chosen backend's kernels.
        precision, grad_precision: how float32 operands are multiplied, as in ``fused_logprobs``
            (docs/precision.md; default: the three-product bfloat16 split on CUDA, IEEE float32 elsewhere): the
            selection, the log-probs and the tail are those of the precision's logits. Half-precision operands
            take only None / "auto". ``last_precision()`` says what ran.
        check_inputs: True (default): the temperatures are checked (ValueError) and only the rows where mask is
            True are computed: host reads, inside the op. False: none at all (CUDA-graph capture): every row is
            computed, the masked ones at temperature 1 and then given ids -1, logprobs 0, tail 0 (a non-finite
            hidden state there reaches d_weight), as in ``fused_logprobs``.

    Returns:
        TopKLogProbs(ids, logprobs, tail_logprob). ``logprobs`` and ``tail_logprob`` are differentiable w.r.t.
        hidden and weight. ``tail_logprob`` = log(1 - sum of the k probabilities), summed directly over the ids
        outside the top-k (never as 1 minus the sum: exact when the top-k hold 1 - 1e-9 of the mass); -inf when
        k == V.
    """
    hidden, weight, _ = check_head(hidden, weight, None)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    _, vocab = vocab_layout(weight, tp_group)
    if not 1 <= k <= vocab:
        raise ValueError(f"k must lie in [1, V={vocab}], got k={k}")
    checks.reduce_grad_hidden(reduce_grad_hidden, tp_group)
    checks.boolean(check_inputs, "check_inputs")
    softcap = checks.softcap(softcap)
    precision, grad_precision = resolve(precision, grad_precision, hidden.dtype, hidden.device)
    lead = hidden.shape[:-1]
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=hidden.device)
    else:
        mask = checks.tensor(mask, "mask")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        if mask.shape != lead:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal hidden's leading shape {tuple(lead)}")
        if mask.device != hidden.device:
            raise ValueError(f"mask is on {mask.device}, hidden on {hidden.device}")
    mod, _ = choose_backend(hidden, weight, backend)
    inv_temp = inv_temperature(temperature, mask, check_values=False)
    ids, lp, tail = label_set_function.fused_topk(hidden.reshape(-1, hidden.shape[-1]), weight, inv_temp,
                                                  mask.reshape(-1), k, mod.name, softcap, tp_group_name(tp_group),
                                                  reduce_grad_hidden, precision, grad_precision, check_inputs)
    return TopKLogProbs(ids.view(lead + (k,)), lp.view(lead + (k,)), tail.view(lead))
