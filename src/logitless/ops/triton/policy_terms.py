"""Policy loss, stage 2b: the per-token terms of one chunk and their derivatives, in one kernel.

The same formulas as ``logitless/ops/policy_terms.py`` (which defines them, and which the tests hold this kernel
to: values, clip counts and gradients, every setting), with the derivatives written out instead of taken by
torch.autograd: there, a chunk's float64 terms and their autograd backward were about 100 kernels of a few
microseconds each, 0.3 ms per chunk on the H200 during which the GPU did nothing else.

Per token, in float64, with d = lp - old (0 on-policy) and c the ratio's log clamp (verl's 20; TRL: none, c = inf):
    ratio = exp(clamp(d, -c, c)),                     dratio = ratio where -c <= d <= c, else 0
    pg1 = -A ratio,  pg2 = -A clamp(ratio, lo, hi),   clipped = pg2 > pg1
    pg  = max(pg1, pg2)                                (a tie passes half the gradient each way, as torch does)
    delta (TRL's two-sided clip): pg1 = -A min(ratio, delta) after the clip count
    dual clip (A < 0): pg = min(pg, -A c)              (again half the gradient on a tie)
    rollout weights rho: pg = rho pg
    kl_ratio: kl = kl ratio,  dkl = dkl ratio + kl dratio; for k3_unclamped (policy_terms.kl_times_ratio), with
              x = ref - lp: kl = exp(x + log ratio) - (x + 1) ratio, dkl = [clamp binds] (-exp(x + log ratio))
              + ratio - (x + 1) dratio
    f   = pg + kl_coef kl,  loss = sum w f - entropy_coef sum u H,   g_lp = w df/dlp,   g_ent = -u entropy_coef
    (u: the entropy bonus's own weights when given, else w; with the KL term's own weights v, f = pg and
    loss += kl_coef sum v kl, g_lp += v kl_coef dkl/dlp)
and a clamp passes the gradient where its input lies inside its bounds, ends included (torch.clamp).
Each program writes its block's sums (the loss, clipped count, v kl) to one row of ``partial``; the caller adds
the rows up in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import policy_terms as terms
from .common import INTERPRETING, on_device

BLOCK = 64 if INTERPRETING else 1024
# the clamps of the definition (k3's), as compile-time constants of the kernel; the policy ratio's own clamp
# (``TermSpec.ratio_log_clamp``) is a setting: params[6], inf for none
RATIO_LOG_CLAMP = tl.constexpr(terms.RATIO_LOG_CLAMP)
K3_CLAMP = tl.constexpr(terms.K3_CLAMP)
# the canonical KL names of terms.KL_TYPES, "+" stripped
KL_CODES = {"k1": 0, "abs": 1, "k2": 2, "k3": 3, "k3_unclamped": 4}


@triton.jit
def _inside(x, lo, hi):
    return (x >= lo) & (x <= hi)


@triton.jit
def _tie_split(a, b, da, db, TAKE_MAX: tl.constexpr):
    """d max(a, b) (TAKE_MAX) or d min(a, b) from da, db: the winner's, or half of each on a tie."""
    if TAKE_MAX:
        a_wins = a > b
        b_wins = b > a
    else:
        a_wins = a < b
        b_wins = b < a
    return tl.where(a_wins, da, tl.where(b_wins, db, 0.5 * da + 0.5 * db))


@triton.jit
def _kl(lp, ref, KL_TYPE: tl.constexpr, STRAIGHT: tl.constexpr):
    """(kl, dkl/dlp) of the estimator KL_TYPE (0 k1, 1 abs, 2 k2, 3 k3); STRAIGHT: k2's gradient."""
    x = lp - ref
    if KL_TYPE == 0:
        kl = x
        dkl = tl.full(x.shape, 1.0, tl.float64)
    elif KL_TYPE == 1:
        kl = tl.abs(x)
        dkl = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(tl.float64)
    elif KL_TYPE == 2:
        kl = 0.5 * (x * x)
        dkl = x
    elif KL_TYPE == 4:
        er = tl.exp(ref - lp)
        kl = er - (ref - lp) - 1.0
        dkl = 1.0 - er
    else:
        r = tl.minimum(tl.maximum(ref - lp, -RATIO_LOG_CLAMP), RATIO_LOG_CLAMP)
        er = tl.exp(r)
        v = er - r - 1.0
        kl = tl.minimum(tl.maximum(v, -K3_CLAMP), K3_CLAMP)
        # d r / d lp = -1 inside r's clamp; outside it |r| = 20 puts v >= 19 beyond K3_CLAMP, whose own
        # clamp then passes no gradient either
        dkl = tl.where(_inside(v, -K3_CLAMP, K3_CLAMP), 1.0 - er, 0.0)
    if STRAIGHT:
        dkl = x
    return kl, dkl


@triton.jit
def _terms_kernel(lp_ptr, ent_ptr, adv_ptr, old_ptr, ref_ptr, w_ptr, rho_ptr, u_ptr, v_ptr, params_ptr, g_lp_ptr,
                  g_ent_ptr, partial_ptr, n, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_TYPE: tl.constexpr,
                  STRAIGHT: tl.constexpr, USE_KL: tl.constexpr, DUAL: tl.constexpr, WITH_ENT: tl.constexpr,
                  DELTA: tl.constexpr, KL_RATIO: tl.constexpr, HAS_RHO: tl.constexpr, HAS_U: tl.constexpr,
                  HAS_V: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    lo = tl.load(params_ptr)                # float64 settings: 1 - clip_low, 1 + clip_high, dual_clip,
    hi = tl.load(params_ptr + 1)            # kl_coef, entropy_coef, delta, ratio log clamp (as the torch terms
                                            # see them)
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float64)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    if HAS_OLD:
        d = lp - tl.load(old_ptr + offs, mask=ok, other=0.0)
        c = tl.load(params_ptr + 6)
        log_ratio = tl.minimum(tl.maximum(d, -c), c)
        moves = _inside(d, -c, c)           # d log r / d lp = 1 (else 0)
        ratio = tl.exp(log_ratio)
        dratio = tl.where(moves, ratio, 0.0)
    else:                                   # old = lp, detached: ratio 1, d ratio / d lp = 1
        log_ratio = tl.zeros((BLOCK,), tl.float64)
        moves = offs >= 0
        ratio = tl.full((BLOCK,), 1.0, tl.float64)
        dratio = ratio
    neg_adv = -adv
    pg1 = neg_adv * ratio
    pg2 = neg_adv * tl.minimum(tl.maximum(ratio, lo), hi)
    dpg1 = neg_adv * dratio
    dpg2 = neg_adv * tl.where(_inside(ratio, lo, hi), dratio, 0.0)
    clipped = (pg2 > pg1) & ok
    if DELTA:
        delta = tl.load(params_ptr + 5)
        pg1 = neg_adv * tl.minimum(ratio, delta)
        dpg1 = neg_adv * tl.where(ratio <= delta, dratio, 0.0)
    f = tl.maximum(pg1, pg2)
    df = _tie_split(pg1, pg2, dpg1, dpg2, True)
    if DUAL:
        cap = neg_adv * tl.load(params_ptr + 2)
        zero = tl.zeros_like(df)
        f_dual = tl.minimum(f, cap)
        df_dual = _tie_split(f, cap, df, zero, False)
        f = tl.where(adv < 0, f_dual, f)
        df = tl.where(adv < 0, df_dual, df)
    if HAS_RHO:
        rho = tl.load(rho_ptr + offs, mask=ok, other=0.0)
        f = f * rho
        df = df * rho
    kl_sum = 0.0
    loss = tl.zeros_like(f)
    g_lp = tl.zeros_like(f)
    if HAS_REF:
        ref = tl.load(ref_ptr + offs, mask=ok, other=0.0)
        kl, dkl = _kl(lp, ref, KL_TYPE, STRAIGHT)
        if KL_RATIO:
            if KL_TYPE == 4 and not STRAIGHT:
                # policy_terms.kl_times_ratio: exp(x + log r) - (x + 1) r, x = ref - lp, the first part's
                # gradient 0 where log r moves with lp (not the difference of two exp(x) r)
                x = ref - lp
                big = tl.exp(x + log_ratio)
                kl = big - (x + 1.0) * ratio
                dkl = tl.where(moves, 0.0, -big) + ratio - (x + 1.0) * dratio
            else:
                dkl = dkl * ratio + kl * dratio
                kl = kl * ratio
        if HAS_V:
            v = tl.load(v_ptr + offs, mask=ok, other=0.0)
        else:
            v = w
        if USE_KL:
            kl_coef = tl.load(params_ptr + 3)
            if HAS_V:
                loss = v * (kl_coef * kl)
                g_lp = v * (kl_coef * dkl)
            else:
                f = f + kl_coef * kl
                df = df + kl_coef * dkl
        kl_sum = tl.sum(tl.where(ok, v * kl, 0.0), axis=0)
    loss = loss + w * f
    g_lp = g_lp + w * df
    if WITH_ENT:
        ent_coef = tl.load(params_ptr + 4)
        if HAS_U:
            u = tl.load(u_ptr + offs, mask=ok, other=0.0)
        else:
            u = w
        loss = loss - u * ent_coef * tl.load(ent_ptr + offs, mask=ok, other=0.0).to(tl.float64)
        tl.store(g_ent_ptr + offs, (-(u * ent_coef)).to(tl.float32), mask=ok)
    tl.store(g_lp_ptr + offs, g_lp.to(tl.float32), mask=ok)
    row = partial_ptr + pid * 3
    tl.store(row, tl.sum(tl.where(ok, loss, 0.0), axis=0))
    tl.store(row + 1, tl.sum(clipped.to(tl.float64), axis=0))
    tl.store(row + 2, kl_sum)


def supports(spec: terms.TermSpec) -> bool:
    """Whether this kernel computes ``spec``'s terms: the clipped surrogate at token level (dual clip, TRL's
    delta cap), every KL estimator (with TRL's kl_ratio), rollout weights, the entropy bonus and the KL term
    with weights of their own. Other settings (the other surrogates, coupled losses, the rejection mask,
    current_is) take the torch derivatives of ``policy_terms.py`` instead (the same definition, exact)."""
    return (spec.surrogate == "ppo" and spec.ratio_level == "token" and not spec.coupled
            and not spec.rejects and spec.current_is is None and spec.kl_type.rstrip("+") in KL_CODES)


@dataclass(frozen=True)
class TermSettings:
    """The scalar settings of the terms, once per loss call: the float64 values on the device (read by the
    kernel: no float32 rounding of 1 - clip_low and the rest) and the compile-time switches."""
    params: Tensor
    switches: dict

    @classmethod
    def make(cls, spec: terms.TermSpec, device) -> "TermSettings":
        clamp = math.inf if spec.ratio_log_clamp is None else spec.ratio_log_clamp
        values = [1.0 - spec.clip_low, 1.0 + spec.clip_high, spec.dual_clip or 0.0, spec.kl_coef, spec.entropy_coef,
                  spec.delta or 0.0, clamp]
        params = torch.tensor(values, dtype=torch.float64)
        if torch.device(device).type == "cuda":
            # from pinned memory without waiting: a copy from pageable memory would hold the host until the
            # GPU has run everything queued before it (the fused pass makes these during its first chunk)
            params = params.pin_memory().to(device, non_blocking=True)
        else:
            params = params.to(device)
        switches = dict(HAS_OLD=spec.has_old, HAS_REF=spec.has_ref, KL_TYPE=KL_CODES[spec.kl_type.rstrip("+")],
                        STRAIGHT=spec.kl_type.endswith("+"), USE_KL=spec.has_ref and spec.kl_coef != 0.0,
                        DUAL=spec.dual_clip is not None, WITH_ENT=spec.entropy_coef != 0.0,
                        DELTA=spec.delta is not None, KL_RATIO=spec.has_ref and spec.kl_ratio,
                        HAS_RHO=spec.has_rollout_weights)
        return cls(params, switches)


def chunk_terms(lp: Tensor, ent: Tensor, tokens: terms.TokenInputs, settings: TermSettings, sums: Tensor
                ) -> tuple[Tensor, Optional[Tensor]]:
    """What ``terms.chunk_gradients`` returns, from this kernel: (g_lp, g_ent or None) float32 [n] of the
    tokens' terms (lp, ent float32 [n]; ``tokens`` the same n tokens' float64 inputs), and adds (the loss,
    clipped count, sum v kl) into ``sums`` (float64 [3], in place; kl 0 without ref)."""
    n = lp.shape[0]
    dev = lp.device
    sw = settings.switches
    g_lp = torch.empty(n, dtype=torch.float32, device=dev)
    g_ent = torch.empty(n, dtype=torch.float32, device=dev) if sw["WITH_ENT"] else None
    if n == 0:
        return g_lp, g_ent
    grid = triton.cdiv(n, BLOCK)
    partial = torch.empty((grid, 3), dtype=torch.float64, device=dev)
    adv = tokens.advantages
    u, v = tokens.ent_weights, tokens.kl_weights
    with on_device(lp):
        _terms_kernel[(grid,)](
            lp, ent, adv, tokens.old_logprobs if sw["HAS_OLD"] else adv, tokens.ref_logprobs if sw["HAS_REF"] else adv,
            tokens.weights, tokens.rollout_weights if sw["HAS_RHO"] else adv, adv if u is None else u,
            adv if v is None else v, settings.params, g_lp, g_ent if g_ent is not None else g_lp, partial, n, **sw,
            HAS_U=u is not None, HAS_V=v is not None, BLOCK=BLOCK, num_warps=4)
    sums += partial.sum(dim=0)
    return g_lp, g_ent
