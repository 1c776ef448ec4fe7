"""verl's FSDP engine (``use_fused_kernels=True``) on logitless.

verl's ``apply_monkey_patch`` gives the model's class a forward (``forward_with_torch_backend`` or
``forward_with_triton_backend`` of ``verl.models.transformers.*``) that runs the backbone and then
the fused head on the final hidden states, with verl's labels (rolled input ids, or the engine's
``shift_labels`` under remove-padding / Ulysses) and temperature:
- backends "torch" and "liger": ``FusedLinearForPPO.forward`` (verl.utils.experimental.torch_functional),
- backend "triton": ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (CUDA only).
Both are looked up when the forward runs, so replacing them moves every model verl patched,
before or after ``install``, onto logitless. Shapes and dtypes are verl's: log-probs float32; the
entropy in the hidden states' dtype for "torch" (as its own kernel returns it), float32 otherwise.

Strict mode: ``patch_forward_with_backends`` with ``use_fused_kernels=True`` and a backend verl does
not know (e.g. none configured) prints "Skipping monkey patch ..." and leaves the unfused forward;
under strict it raises ``FusedPathUnavailable``.
"""
from __future__ import annotations

import functools

from ..record import FusedPathUnavailable
from .core import fused_linear_for_ppo, linear_cross_entropy
from .sites import Site, strict_mode

TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
MONKEY_PATCH = "verl.models.transformers.monkey_patch"
BACKENDS = ("triton", "torch", "liger")


def _make_forward(original):
    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        """logitless in place of verl's FusedLinearForPPO.forward: (log_probs float32, entropy)
        shaped like input_ids, without the [tokens x vocab] logits."""
        backend = getattr(self, "impl_backend", "torch")
        out = fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature,
                                   entropy_dtype=hidden_states.dtype if backend == "torch" else None)
        return out.logprobs, out.entropy

    return forward


def _make_kernel(original):
    def linear_cross_entropy_logitless(hidden, weight, labels, temperature=1.0, reduction="none",
                                       dist_process_group=None):
        """logitless in place of verl's Triton ``linear_cross_entropy`` (same arguments and outputs)."""
        return linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group,
                                    reduce_grad_hidden=True)

    return linear_cross_entropy_logitless


def _make_patch_forward_with_backends(original):
    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels: bool = False, fused_kernels_backend: str = None):
        if use_fused_kernels and fused_kernels_backend not in BACKENDS and strict_mode():
            raise FusedPathUnavailable(
                f"verl would skip the fused forward for {type(model).__name__}: use_fused_kernels=True but "
                f"fused_kernels_backend={fused_kernels_backend!r} is not one of {BACKENDS} (set "
                "model.fused_kernel_options.impl_backend) (logitless.verl strict mode: install(strict=True) or "
                "LOGITLESS_STRICT=1)")
        return original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)

    return patch_forward_with_backends


SITES = (
    Site("fsdp.FusedLinearForPPO.forward", TORCH_FUNCTIONAL, "FusedLinearForPPO", "forward", _make_forward,
         "the fused head of forward_with_torch_backend (backends 'torch' and 'liger')"),
    Site("fsdp.kernel.linear_cross_entropy", KERNEL, None, "linear_cross_entropy", _make_kernel,
         "the fused head of forward_with_triton_backend (backend 'triton')"),
    Site("fsdp.patch_forward_with_backends", MONKEY_PATCH, None, "patch_forward_with_backends",
         _make_patch_forward_with_backends, "strict check: verl skipping the fused forward"),
)
