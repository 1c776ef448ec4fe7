"""Which backend's fused policy-loss pass and per-token term kernel run (the pass's contract and the
pieces its backends share: ``policy_parts.py``; the term definitions: ``policy_terms.py``)."""
from __future__ import annotations


def policy_pass_for(backend_name: str):
    """The ``policy_pass`` function of the backend called ``backend_name`` (as resolved by
    ``registry.choose_backend``). Import statements, not importlib: torch.compile traces them."""
    if backend_name == "triton":
        from .triton import policy_backend
        return policy_backend.policy_pass
    from . import policy_chunked
    return policy_chunked.policy_pass_whole if backend_name == "reference" else policy_chunked.policy_pass


def policy_terms_for(backend_name: str, spec=None):
    """The backend's own kernel for the per-token loss terms and their derivatives (a module with
    ``TermSettings`` and ``chunk_terms``, held to ``policy_terms.py`` by the tests), or None: the fused pass
    then takes the derivatives of ``policy_terms.py`` with torch.autograd (exact, float64 on [n] vectors).
    spec: the loss's TermSpec; a kernel that does not cover its settings (``supports``) is not used."""
    if backend_name == "triton":
        from .triton import policy_terms
        if spec is None or policy_terms.supports(spec):
            return policy_terms
    return None


def max_chunk_rows_for(backend_name: str):
    """The backend's ``max_chunk_rows(n, plan_vocab, dtype, device, longest=1)``: the most token rows one chunk of
    its pass may hold when the longest group of tokens that must stay whole has ``longest`` rows, to which a caller
    cuts the ``bounds`` it passes (chunks that keep groups of tokens whole; the triton pass's chunk grows to the
    longest group within a bounded workspace)."""
    if backend_name == "triton":
        from .triton import policy_backend
        return policy_backend.max_chunk_rows
    from . import policy_chunked
    return policy_chunked.max_chunk_rows_whole if backend_name == "reference" else policy_chunked.max_chunk_rows
