"""The implementations `logitless bench` compares, behind one calling convention.

Every entry turns (hidden [N, H], weight [V, H], labels [N] int64, temperature float) into
(logprobs [N] float32, entropy [N] float32 or None), differentiable w.r.t. hidden and weight.
Entries are logitless's own backends (through the public ``fused_logprobs``), the naive torch
path, ``torch.compile`` of it, and the installed peer libraries, each called through its public
entry point (TRL's fused head, ``trl.kernels.ChunkedLogProbFunction``, as its GRPOTrainer calls it; TRL's
distillation kernel is ``trl_divergence``, for a benchmark of its own). A peer that is missing or cannot
run here raises ``Unavailable`` with the reason, so the bench keeps its row and says why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .machine import package_version

Output = tuple[Tensor, Optional[Tensor]]
Fn = Callable[[Tensor, Tensor, Tensor, float], Output]


class Unavailable(RuntimeError):
    """This implementation cannot run here; the message says why."""


@dataclass(frozen=True)
class Impl:
    """One row of the bench.

    name: the key given to ``--backends``; label: what the table shows; kind: "logitless", "peer",
    "policy" (a policy-loss row: build returns a ``PolicyRun``, see tools/bench_policy.py), "distill" or
    "truncation" (build returns a ``ModuleRun``); entropy:
    whether it computes the entropy too; package: the distribution whose version the bench records
    (None for torch-only paths); build(device): returns the callable or raises ``Unavailable``;
    triton_kernel: it runs a triton GPU kernel, so on CPU it fails (the bench says so next to the error).
    """
    name: str
    label: str
    kind: str
    entropy: bool
    package: Optional[str]
    build: Callable[[torch.device], Fn]
    triton_kernel: bool = False      # a triton GPU kernel: on CPU its failure is expected


def _require(dist: str) -> None:
    if package_version(dist) is None:
        raise Unavailable(f"{dist} is not installed (pip install {dist})")


def _interpreting(device: torch.device) -> bool:
    # Under TRITON_INTERPRET=1 a triton kernel on CPU runs in triton's Python interpreter:
    # correct but thousands of times slower, so timing it would only measure the interpreter.
    return device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"


def _needs_gpu_triton(device: torch.device, what: str) -> None:
    if _interpreting(device):
        raise Unavailable(f"{what} is a triton kernel; on {device.type} it would run in triton's "
                          "interpreter (TRITON_INTERPRET=1), which is not worth timing")


# --- logitless -------------------------------------------------------------------------------

def _logitless(backend: str) -> Callable[[torch.device], Fn]:
    def build(device: torch.device) -> Fn:
        import logitless as api
        probe = torch.empty(1, 1, device=device)
        try:
            api.choose_backend(probe, probe, backend)
        except (RuntimeError, ValueError) as exc:
            raise Unavailable(str(exc)) from None
        if backend == "triton":
            _needs_gpu_triton(device, "the triton backend")

        def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
            out = api.fused_logprobs(h, w, y, temperature=t, backend=backend)
            # prove that the row measured the backend it is named after
            if api.last_backend() != backend:
                raise RuntimeError(f"asked for {backend!r} but {api.last_backend()!r} ran")
            return out.logprobs, out.entropy
        return run
    return build


# --- the naive torch path --------------------------------------------------------------------

def naive(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
    """What RL trainers write by hand: logits in the input dtype (bf16 logits for bf16 inputs),
    then float32 log_softmax, gather and entropy. Materialises [N, V] several times."""
    z = (h @ w.t()).float() / t
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(1, y.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return lp, ent


def _naive(device: torch.device) -> Fn:
    return naive


def _naive_compiled(device: torch.device) -> Fn:
    if not hasattr(torch, "compile"):
        raise Unavailable("this torch has no torch.compile")
    # one compiled object per bench run, so its first call (the warm-up) pays for the compile
    return torch.compile(naive, dynamic=False)


# --- liger-kernel ----------------------------------------------------------------------------

def _liger_scaled(device: torch.device) -> Fn:
    _require("liger-kernel")
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction as Scaled,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure is the row's reason
        raise Unavailable(f"liger-kernel scaled CE does not import: {type(exc).__name__}: {exc}") from None

    def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
        nll, ent = Scaled.apply(h, w, y, temperature=t, return_entropy=True)
        return -nll.float(), ent.float()
    return run


def _liger_flce(device: torch.device) -> Fn:
    _require("liger-kernel")
    _needs_gpu_triton(device, "liger fused linear cross entropy")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as flce
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"liger-kernel does not import: {type(exc).__name__}: {exc}") from None

    def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
        # no temperature argument: scaling hidden by 1/T scales the logits by 1/T
        loss = flce(h * (1.0 / t), w, y, reduction="none")
        return -loss.float(), None
    return run


# --- cut-cross-entropy -----------------------------------------------------------------------

def _cce(impl: str) -> Callable[[torch.device], Fn]:
    def build(device: torch.device) -> Fn:
        _require("cut-cross-entropy")
        if impl == "cce":
            _needs_gpu_triton(device, "cut-cross-entropy's cce kernel")
        try:
            from cut_cross_entropy import linear_cross_entropy
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"cut-cross-entropy does not import: {type(exc).__name__}: {exc}") from None

        def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
            loss = linear_cross_entropy(h * (1.0 / t), w, y, reduction="none", impl=impl)
            return -loss.float(), None
        return run
    return build


# --- TRL's own fused head -------------------------------------------------------------------

def _trl_import(module: str, what: str):
    """Import ``module`` of trl, or raise Unavailable with the import error (on a machine where trl was installed
    without its dependencies, trl.kernels needs transformers and packaging; TRL's head's backward and its
    divergence kernel import trl.trainer.utils, which needs accelerate, datasets, pandas and more)."""
    _require("trl")
    import importlib
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the row's reason
        raise Unavailable(f"{what} does not import ({module}): {type(exc).__name__}: {exc}") from None


def trl_head(device: torch.device) -> Fn:
    """TRL's fused LM head as GRPOTrainer runs it with ``fused_lm_head=True`` (TRL >= 1.16): its
    ``ChunkedLogProbFunction`` with the vocabulary tile GRPOTrainer passes, log-probs and entropy (its
    ``outputs=("log_probs", "entropy")``), no bias, softcap or logit scale. On CUDA its tiles are cuBLAS GEMMs in
    the inputs' dtype folded by a triton kernel; elsewhere TRL folds them in torch (so it runs on CPU)."""
    kernels = _trl_import("trl.kernels.chunked_logprob", "trl.kernels")
    utils = _trl_import("trl.trainer.utils", "TRL's fused head's backward (it imports trl.trainer.utils)")
    fn = kernels.ChunkedLogProbFunction
    chunk = int(getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768))

    def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
        lp, ent = fn.apply(h, w, None, y, t, chunk, None, 1.0, ("log_probs", "entropy"))[:2]
        return lp, ent
    return run


def trl_divergence(device: torch.device):
    """TRL's distillation kernel (``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``, what its
    DistillationTrainer runs), for a distillation benchmark: a callable (student_hidden [N, H_s], student_weight
    [V, H_s], teacher_hidden [N, H_t], teacher_weight [V, H_t], beta, temperature) -> (divergence [N], student
    entropy [N]) float32, differentiable w.r.t. the student's tensors (beta 0: forward KL(teacher || student),
    1: reverse KL, between: the generalised JSD). Unavailable, with the reason, where it does not import."""
    module = _trl_import("trl.kernels.chunked_divergence", "TRL's chunked divergence (it imports trl.trainer.utils)")
    fn = module.ChunkedDivergenceFunction

    def run(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
            beta: float, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        return fn.apply(student_hidden, student_weight, None, teacher_hidden, teacher_weight, None, float(beta),
                        float(temperature))
    return run


def liger_jsd(device: torch.device, beta: float):
    """Liger's ``LigerFusedLinearJSD`` (its fused linear generalised JSD), for the distillation rows: a callable
    (student_hidden, student_weight, teacher_hidden, teacher_weight, temperature) -> the mean JSD over the tokens.
    A Triton GPU kernel: Unavailable without CUDA."""
    _require("liger-kernel")
    if device.type != "cuda":
        raise Unavailable("a triton GPU kernel: needs CUDA")
    from liger_kernel.transformers import LigerFusedLinearJSD
    modules: dict = {}

    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, temperature: float = 1.0) -> Tensor:
        if temperature not in modules:
            modules[temperature] = LigerFusedLinearJSD(jsd_beta=float(beta), temperature=float(temperature))
        return modules[temperature](student_hidden, student_weight, teacher_hidden, teacher_weight, None)
    return run


def _fp32_head(device: torch.device) -> Fn:
    """logitless on a float32 head (the operands cast to float32 first, gradients flowing back through the cast)
    at its default precision: the three-product bfloat16 split on CUDA, IEEE float32 on a CPU."""
    import logitless as api

    def run(h: Tensor, w: Tensor, y: Tensor, t: float) -> Output:
        out = api.fused_logprobs(h.float(), w.float(), y, temperature=t)
        return out.logprobs, out.entropy
    return run


# --- the distillation and top-k rows (tools/bench_distill.py) ------------------------------

@dataclass(frozen=True)
class ModuleRun:
    """What a row of another bench module runs (bench_distill's, bench_truncation's): ``name`` (the module's row)
    on a ``backend`` (a logitless backend, or the peer's name)."""
    name: str
    backend: str


def _auto_backend(device: torch.device) -> str:
    """The backend "auto" picks on ``device``; Unavailable where it is the triton backend in the interpreter."""
    import logitless as api
    probe = torch.empty(1, 1, device=device)
    backend = api.choose_backend(probe, probe, "auto")[0].name
    if backend == "triton":
        _needs_gpu_triton(device, "the triton backend")
    return backend


def _distill(name: str) -> Callable[[torch.device], ModuleRun]:
    def build(device: torch.device) -> ModuleRun:
        if name == "trl-divergence":
            trl_divergence(device)          # Unavailable, with the reason, where it does not import
            return ModuleRun(name, "trl")
        if name == "liger-jsd":
            liger_jsd(device, 0.5)
            return ModuleRun(name, "liger")
        return ModuleRun(name, _auto_backend(device))
    return build


# --- the fused policy loss ------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyRun:
    """What a policy-loss row runs (see tools/bench_policy.py): the fused loss or the reference path on a
    logitless backend, or (backend ``TRL_HEAD``) TRL's loss in torch on TRL's fused head."""
    fused: bool
    backend: str


TRL_HEAD = "trl head"


def _policy(fused: bool) -> Callable[[torch.device], PolicyRun]:
    def build(device: torch.device) -> PolicyRun:
        return PolicyRun(fused, _auto_backend(device))
    return build


def _policy_trl(device: torch.device) -> PolicyRun:
    trl_head(device)            # Unavailable, with the reason, where TRL's head cannot run
    return PolicyRun(False, TRL_HEAD)


# --- the truncation rows (tools/bench_truncation.py) ----------------------------------------------

def _truncation(name: str) -> Callable[[torch.device], ModuleRun]:
    def build(device: torch.device) -> ModuleRun:
        return ModuleRun(name, "torch" if name == "naive-truncation" else _auto_backend(device))
    return build


IMPLS: tuple[Impl, ...] = (
    Impl("reference", "logitless reference (fp32 logits)", "logitless", True, None, _logitless("reference")),
    Impl("chunked", "logitless chunked", "logitless", True, None, _logitless("chunked")),
    Impl("triton", "logitless triton", "logitless", True, None, _logitless("triton"), True),
    Impl("naive", "naive torch (eager)", "peer", True, None, _naive),
    Impl("naive-compile", "torch.compile(naive)", "peer", True, None, _naive_compiled),
    Impl("liger-scaled-ce", "liger fused scaled CE", "peer", True, "liger-kernel", _liger_scaled),
    Impl("liger-flce", "liger fused linear CE", "peer", False, "liger-kernel", _liger_flce, True),
    Impl("cce", "cut-cross-entropy (cce)", "peer", False, "cut-cross-entropy", _cce("cce"), True),
    Impl("cce-compile", "cut-cross-entropy (torch_compile)", "peer", False, "cut-cross-entropy",
         _cce("torch_compile")),
    Impl("trl-head", "TRL fused head (ChunkedLogProbFunction)", "peer", True, "trl", trl_head),
    Impl("policy-loss", "logitless fused policy loss (3 GEMMs)", "policy", True, None, _policy(True)),
    Impl("policy-loss-reference", "policy_loss_reference (fused_logprobs + autograd)", "policy", True, None,
         _policy(False)),
    Impl("trl-policy-loss", "TRL's GRPO loss in torch on TRL's fused head", "policy", True, "trl", _policy_trl),
    Impl("fp32-head", "logitless float32 head (default precision)", "logitless", True, None, _fp32_head),
    Impl("distill", "logitless fused_distillation_loss (JSD)", "distill", True, None, _distill("distill")),
    Impl("distill-topk", "logitless fused_distillation_loss (forward_kl_topk)", "distill", False, None,
         _distill("distill-topk")),
    Impl("fused-topk", "logitless fused_topk", "distill", False, None, _distill("fused-topk")),
    Impl("trl-divergence", "TRL ChunkedDivergenceFunction (JSD)", "distill", True, "trl", _distill("trl-divergence")),
    Impl("liger-jsd", "Liger LigerFusedLinearJSD", "distill", False, "liger-kernel", _distill("liger-jsd"), True),
    Impl("truncation", "logitless fused_logprobs, top_p 0.95", "truncation", True, None, _truncation("truncation")),
    Impl("naive-truncation", "naive torch, top_p 0.95 (logits, sort)", "truncation", True, None,
         _truncation("naive-truncation")),
)
NAMES = tuple(i.name for i in IMPLS)


def get(name: str) -> Impl:
    for impl in IMPLS:
        if impl.name == name:
            return impl
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(NAMES)}")
