"""Backends: each computes per-token statistics (forward) and gradients (backward) of
z = (hidden @ weight.T) * inv_temp (optionally tanh-softcapped first) without keeping anything of
size [tokens x vocab].

- ``contract.py``: the interface a backend implements (``stats`` and ``grads``) and their formulas.
- ``maths.py``: the torch maths the backends share.
- ``registry.py``: the backends by name and the ``"auto"`` choice.
- ``reference.py``, ``chunked.py``, ``triton/``: the backends.
- ``function.py``: the one autograd Function that glues a backend (and the tensor-parallel combine).
"""
