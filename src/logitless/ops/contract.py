"""The contract every backend implements (the maths they share is in ``maths.py``).

Shapes and dtypes (N tokens, H hidden, V vocabulary rows held by this process):
- hidden  [N, H]  float32 / bfloat16 / float16, any strides
- weight  [V, H]  same dtype and device as hidden, any strides
- labels  [N]     int64, the label's row in *this* weight, or -1 when the row holds no label
                  (ignored token, or under tensor parallelism a label owned by another rank)
- inv_temp [N]    float32, 1 / temperature per token
- softcap         None, or a positive float c: the logits are tanh-softcapped before the temperature

With raw = hidden @ weight.T (float32), the logits are
  z = raw * inv_temp[:, None]                          (softcap None)
  z = tanh(raw / c) * (c * inv_temp)[:, None]          (softcap c; Gemma 2's final_logit_softcapping)
Forward statistics, all float32 [N], of z:
- lse = logsumexp_j z_j
- ent = -sum_j p_j * log p_j, p = softmax(z)   (None when with_entropy is False)
- zy  = z_label, 0.0 where labels == -1

Then logprob = zy - lse. The entropy is returned directly, not as lse - sum_j p_j z_j: both terms are of
the logits' magnitude and their difference loses ~1e-5 in float32 when every logit is large (say -60).
Accumulate it relative to the running max instead: with m the max and s = sum_j exp(z_j - m),
  ent = log s - (sum_j exp(z_j - m) * (z_j - m)) / s.

Backward, given g_lp and g_ent (float32 [N]; g_ent may be None) and the *global* lse and ent:
  x = z - lse   (log p), p = exp(x)
  dz = g_lp * (onehot(label) - p) - g_ent * p * (x + ent)        [since z - sum p z = x + ent]
  dlogits = dz * inv_temp                    (softcap None)
  dlogits = dz * inv_temp * (1 - t^2)        (softcap c, t = tanh(raw / c): the chain rule through the cap)
  dh = dlogits @ weight      -> float32 [N, H] (the caller casts and reduces)
  dw = dlogits.T @ hidden    -> weight.dtype [V, H]
Each is None when not requested. With ``dw_acc`` (float32 [V, H]) the backend adds its d_weight into it
instead and returns None for dw: that is how d_weight accumulates across token chunks.

Precision (``precision.py``): for float32 operands the op may hand a backend a precision's *statistics
operands* as hidden / weight (e.g. bfloat16 [N, 3H] / [V, 3H] for the three-product split: their product is
the split's logits) and, to ``grads``, ``grad_operands`` (a ``precision.GradOperands``): then dlogits are written
in ``grad_operands.dl_dtype`` and d_hidden / d_weight are the sums of its products (``products``) instead of
dlogits @ weight and dlogits.T @ hidden; d_weight is ``grad_operands.out_dtype`` [V, grad_operands.hidden_size].
Products of float32 operands inside ``maths.tf32_products`` may run as TF32 dots (the op's "tf32").

An op with a tail output (k ids per token and the mass outside them, ``tail_backward.py``) needs another dz,
whose terms at the ids and outside them differ: a backend that forms it (the triton backend) takes ``tail``
(a ``tail_backward.TailTerms``) in ``grads``, with labels all -1, g_lp = G and no entropy; the op runs
``tail_backward``'s torch pass on the others.

Token chunks: ``token_rows(stage, hidden, weight, with_entropy)`` is the most tokens one call of ``stats``
(stage "forward") or ``grads`` ("backward") takes; its workspace is bounded by that. The caller
(``ops/token_chunks.py``) feeds larger inputs to it in chunks of that many rows. The backward's value must
depend only on hidden's shape, dtype and device (never on weight's rows): under tensor parallelism every
rank must walk the same chunks, as each chunk's d_hidden is all-reduced.
"""
from __future__ import annotations

from typing import Optional, Protocol

from torch import Tensor


class Backend(Protocol):
    name: str

    def unavailable_reason(self, hidden: Tensor, weight: Tensor) -> Optional[str]: ...

    def stats(self, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor,
              with_entropy: bool, softcap: Optional[float] = None
              ) -> tuple[Tensor, Optional[Tensor], Tensor]: ...  # lse, ent, zy

    def grads(self, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor,
              lse: Tensor, ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor],
              need_dh: bool, need_dw: bool, softcap: Optional[float] = None,
              dw_acc: Optional[Tensor] = None, grad_operands=None) -> tuple[Optional[Tensor], Optional[Tensor]]: ...

    def token_rows(self, stage: str, hidden: Tensor, weight: Tensor, with_entropy: bool) -> int: ...
