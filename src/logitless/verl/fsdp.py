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

FSDP2: verl's ``apply_fsdp2`` puts an untied ``lm_head`` in its own unit, and verl's forward passes
``self.lm_head.weight`` without calling ``lm_head``: a sharded DTensor (verl's own fused head then fails,
"aten.mm.default got mixed torch.Tensor and DTensor"). Given a DTensor weight, logitless finds the model in
verl's forward (the caller's ``self``), checks that its ``lm_head.weight`` is that tensor, and runs the fused
op *as* ``lm_head``'s forward (``logitless.sharded_head.call_head``): FSDP2 gathers the head for the call and
reduce-scatters its gradient exactly as for the unfused head.

Strict mode: ``patch_forward_with_backends`` with ``use_fused_kernels=True`` and a backend verl does
not know (e.g. none configured) prints "Skipping monkey patch ..." and leaves the unfused forward;
under strict it raises ``FusedPathUnavailable``.
"""
from __future__ import annotations

import functools
import sys

from ..record import FusedPathUnavailable, serial_now, write_step
from ..sharded_head import call_head, is_dtensor
from . import distill, fused_loss
from .core import fused_linear_for_ppo, linear_cross_entropy
from .sites import Site, strict_mode

TORCH_FUNCTIONAL = "verl.utils.experimental.torch_functional"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
MONKEY_PATCH = "verl.models.transformers.monkey_patch"
BACKENDS = ("triton", "torch", "liger")


def _head_in_caller(weight, depth: int):
    """The LM head module of the model whose verl forward passed ``weight`` (``self.lm_head.weight``): the
    ``self`` of the frame ``depth`` levels up. ValueError when it is not found there."""
    frame = sys._getframe(depth + 1)
    model = frame.f_locals.get("self")
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else getattr(model, "lm_head", None)
    if head is None or getattr(head, "weight", None) is not weight:
        raise ValueError(
            f"the head weight verl passed is a sharded DTensor ({tuple(weight.placements)}), and the model it belongs "
            f"to was not found in verl's forward ({frame.f_code.co_name}): logitless gathers a sharded head by "
            "calling its module. Keep lm_head unsharded at forward time (tie it, or leave it out of its own unit)")
    return model, head


def _run_as_head(weight, hidden, depth: int, compute):
    """``compute(hidden, weight)`` on the head gathered by its own call (FSDP2 unit of an untied lm_head)."""
    model, head = _head_in_caller(weight, depth + 1)

    def as_head(x, w, tp_group):
        if tp_group is not None:
            raise ValueError("verl's FSDP forward with a tensor-parallel (ColwiseParallel) lm_head is not supported: "
                             "verl's FSDP engine does not shard the head over the vocabulary")
        return tuple(compute(x, w))

    return call_head(head, hidden, as_head, owner=model)


def _make_forward(original):
    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        """logitless in place of verl's FusedLinearForPPO.forward: (log_probs float32, entropy)
        shaped like input_ids, without the [tokens x vocab] logits."""
        backend = getattr(self, "impl_backend", "torch")

        def compute(h, w):
            fused = fused_loss.head(h, w, input_ids, temperature)
            if fused is None:        # a top-k distillation micro-batch: the divergence alongside (distill.py)
                fused = distill.head(h, w, input_ids, temperature,
                                     entropy_dtype=hidden_states.dtype if backend == "torch" else None)
            if fused is not None:     # install(fused_loss=True): the policy loss was computed with them
                lp, ent = fused
                return lp, (ent.to(hidden_states.dtype) if backend == "torch" else ent)
            since = serial_now()
            out = fused_linear_for_ppo(h, w, input_ids, temperature,
                                       entropy_dtype=hidden_states.dtype if backend == "torch" else None)
            write_step("verl.fused_kernels", since)
            return out.logprobs, out.entropy

        if is_dtensor(vocab_weights):   # an FSDP2 unit of its own (verl's apply_fsdp2, untied head)
            return _run_as_head(vocab_weights, hidden_states, 1, compute)
        return compute(hidden_states, vocab_weights)

    return forward


def _make_kernel(original):
    def linear_cross_entropy_logitless(hidden, weight, labels, temperature=1.0, reduction="none",
                                       dist_process_group=None):
        """logitless in place of verl's Triton ``linear_cross_entropy`` (same arguments and outputs)."""
        def compute(h, w):
            if reduction == "none":
                fused = fused_loss.head(h, w, labels, temperature, flat=True)
                if fused is None:
                    fused = distill.head(h, w, labels, temperature, flat=True)
                if fused is not None:     # install(fused_loss=True): the policy loss was computed with them
                    return fused
            since = serial_now()
            out = linear_cross_entropy(h, w, labels, temperature, reduction, dist_process_group,
                                       reduce_grad_hidden=True)
            write_step("verl.fused_kernels", since)
            return out

        if is_dtensor(weight):   # an FSDP2 unit of its own (verl's apply_fsdp2, untied head)
            return _run_as_head(weight, hidden, 1, compute)
        return compute(hidden, weight)

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
