"""logitless for verl: ``logitless.verl.install()`` and verl's fused-kernel paths compute per-token
log-probs and entropy with logitless instead of its own kernels, with verl's own options
(``use_fused_kernels``, temperature, THD / remove-padding) unchanged.

Replaced (see ``sites()``; ``uninstall()`` puts every original back):
- Megatron engine: the fused head (``linear_cross_entropy``) of ``verl.models.mcore.model_forward_fused``,
  which its output processor (hook mode, megatron-core 0.18+), its legacy forward patch and the
  gen / engine forward factories call; the same global of ``model_forward_1f1b_overlap``.
- FSDP engine: ``FusedLinearForPPO.forward`` (backends "torch" / "liger") and the Triton kernel's
  ``linear_cross_entropy`` (backend "triton").
- The actor's policy loss (``install(fused_loss=True)``): the FSDP engine's ``forward_step``
  (``fused_loss``); the Megatron engine's ``forward_step`` and verl's ``fused_output_processor``
  (``megatron_loss``; on megatron-core < 0.18, logitless' legacy patch in place of verl's legacy forward
  for the fused micro-batches, ``megatron_legacy``).
- Strict mode (``install(strict=True)`` or LOGITLESS_STRICT=1): verl's silent fallbacks to the
  non-fused path raise ``logitless.megatron.FusedPathUnavailable``.

The record of what ran: ``logitless.megatron.last_path()`` (path "hook" or "legacy", entry "verl")
after a Megatron call, ``logitless.last_backend()`` after any call.

Modules: ``install`` (sites, install / uninstall), ``core`` (verl's contracts on logitless), ``megatron`` and
``fsdp`` (the sites of each engine), ``distill`` (verl's distillation loss on the FSDP engine's fused head),
``fused_loss`` and ``megatron_loss`` (the fused policy loss on each engine, ``megatron_legacy`` its route on
older megatron-core; ``policy`` and ``tokens`` map verl's settings and batches onto it).
"""
from ..record import FusedPathUnavailable, last_backend, last_path
from .install import install, is_installed, sites, uninstall
from .sites import strict_mode

__all__ = ["install", "uninstall", "is_installed", "sites", "strict_mode", "last_path", "last_backend",
           "FusedPathUnavailable"]
