"""Backends: each computes per-token statistics (forward) and gradients (backward) of
z = (hidden @ weight.T) * inv_temp (optionally tanh-softcapped first) without keeping anything of size [tokens x vocab].

A backend is a module-level object with this interface (see ``ops/backend.py``):

- ``unavailable_reason(hidden, weight) -> str | None``
- ``stats(hidden, weight, labels, inv_temp, with_entropy, softcap=None) -> (lse, ent, zy)``
  (entropy returned directly, see backend.py)
- ``grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap=None) -> (dh, dw)``

``ops/function.py`` glues them (and the tensor-parallel combine) into one autograd Function.
"""
