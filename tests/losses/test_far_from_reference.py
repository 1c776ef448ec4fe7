"""The policy far from the reference (and from the old policy): the fused loss's gradients are no further from
float64 than the trainer's own float32 evaluation (float32 logits, its formula in float32, autograd) on the same
batch, for every KL estimator, with and without the importance ratio on the KL (TRL's use_bias_correction_kl),
at large positive and negative log ratios to the reference and to the old policy.

TRL's bias-corrected k3, (exp(ref - lp) - (ref - lp) - 1) r, is where float32 loses it: its gradient (lp - ref) r
is the difference of two parts of size exp(ref - lp) r, so at ref - lp = 25 (exp = 7e10) float32's rounding of
them exceeds it by far; ``policy_terms.kl_times_ratio`` forms it without that difference. The float64 ground
truth: materialised float64 logits, the trainers' formulas (verl's own ``kl_penalty``; TRL's k3 and ratio as
its ``_compute_loss`` writes them), autograd; at these offsets float64 itself still resolves the difference
(exp(25) * 1e-16 against 25)."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.losses import fused_policy_loss
from logitless.ops.triton.common import INTERPRETING
from reference64 import rel_err
from required import import_or_skip

core = import_or_skip("verl.trainer.ppo.core_algos", "make setup installs verl (the verl integration's tests)")

TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETING, reason="CPU tensors: the triton backend needs its interpreter (TRITON_INTERPRET=1)"))
B, S, H, V = 2, 7, 48, 263
KL_COEF = 0.1
# float32's own resolution of these gradients (both evaluations round the same log-probs to float32 first):
# below it, which of the two is closer to float64 is chance
FLOOR = 2e-5
# one float32 ulp relative, doubled (ulp(x) <= 2^-23 |x|)
ULP = 2.0 ** -23
# the trainers' names: verl's kl_penalty for k1 / k2 / k3 (its clamped low_var_kl), TRL's unclamped k3
VERL_NAMES = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}


def trainer_kl(lp, ref, kl_type):
    if kl_type == "k3_unclamped":          # TRL's _compute_loss
        return torch.exp(ref - lp) - (ref - lp) - 1
    return core.kl_penalty(lp, ref, VERL_NAMES[kl_type])


def trainer_terms(lp, adv, old, ref, mask, kl_type, kl_ratio):
    """TRL's dapo loss with beta (0.2 / 0.28 clip) per token, in the dtype of lp (its token sum is the loss); old
    None: on-policy."""
    old = lp.detach() if old is None else old
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    pg = -torch.min(coef_1 * adv, coef_2 * adv)
    kl = trainer_kl(lp, ref, kl_type)
    if kl_ratio:
        kl = kl * coef_1
    return (pg + KL_COEF * kl) * mask


def evaluate(hidden, weight, labels, adv, old, ref, kl_type, kl_ratio, dtype):
    """(loss, d_hidden, d_weight, the sum of the terms' magnitudes) of the trainer's loss on logits in ``dtype``
    (float64: the ground truth; float32: the trainer's own evaluation), and its gradient with respect to the
    chosen tokens' log-probs with the log-softmax (for ``lse_resolution``)."""
    h = hidden.detach().to(dtype, copy=True).requires_grad_(True)
    w = weight.detach().to(dtype, copy=True).requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    valid = labels != -100
    lp = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    lp.retain_grad()
    zero = torch.zeros_like(lp)
    mask = valid.to(dtype)
    adv, ref = (torch.where(valid, t.to(dtype), zero) for t in (adv, ref))
    old = None if old is None else torch.where(valid, old.to(dtype), zero)
    terms = trainer_terms(lp, adv, old, ref, mask, kl_type, kl_ratio)
    loss = terms.sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad, terms.detach().abs().sum(), (lp.grad * mask, logp.detach())


def lse_resolution(hidden, weight, g_lp, logp, dh64, dw64):
    """The relative error (of d_hidden, of d_weight) that float32 log-sum-exps alone may cause, from float64's
    gradient g of the loss in each token's log-prob and its log-softmax. The fused loss keeps one float32
    lse = max + log(sum) a token (as every fused head does) and forms p = exp(z - lse) from it, so each p is off by
    up to ulp(lse) relative: |d dlogits[t, j]| <= |g_t| p_tj ulp(lse_t). At a confident token (p of the label near
    1, its gradient (1 - p) small) that is all of the row's error, where the trainer's log_softmax forms z - max
    first (exact at the max) and resolves 1 - p to float32 of 1 - p: on such a draw the trainer's float32 lands
    nearer float64 than any evaluation from a stored lse can (seen: 2.8e-5 against 1.9e-6)."""
    h, w = hidden.double(), weight.double()
    p = logp.exp()
    lse = (h @ w.t() - logp)[:, :, 0]                 # logits - log-probs: the lse of each token
    err = g_lp.abs() * ULP * lse.abs()                 # [B, S]: |g| ulp(lse)
    dh = (err.unsqueeze(-1) * (p @ w.abs())).norm()
    dw = torch.einsum("bs,bsv,bsh->vh", err, p, h.abs()).norm()
    return (dh / dh64.norm()).item(), (dw / dw64.norm()).item()


def far_batch(ref_offset, old_offset):
    """hidden, weight, labels (two ignored), advantages, old log-probs (None: on-policy) and reference log-probs:
    at the scored tokens of the first sequence and the first 4 of the second, ref - lp = ref_offset + U(0, 1)
    and lp - old = old_offset + U(0, 1) (the policy that far from each); elsewhere within N(0, 0.3)."""
    far = torch.zeros(B, S, dtype=torch.bool)
    far[0] = True
    far[1, :4] = True
    # the far tokens: the token of a sharper row whose log-prob is nearest -28, so that reference and old log-probs
    # up to 26 above it are still log-probs (<= 0: above 0 they are refused); a draw where some far row has no token
    # below -26.1 (its nearest was -25.9 once in a full run) is drawn again
    for _ in range(20):
        hidden = torch.randn(B, S, H)
        hidden[far] *= 2.0
        weight = torch.randn(V, H) * (4.0 / math.sqrt(H))
        with torch.no_grad():
            logp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
            labels = torch.multinomial(logp.exp().reshape(-1, V), 1).reshape(B, S)
            labels = torch.where(far, (logp + 28.0).abs().argmin(-1), labels)
            lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if (lp[far] < -26.1).all():
            break
    assert (lp[far] < -26.1).all()
    labels[1, 5] = labels[0, 2] = -100
    near = 0.3 * torch.randn(2, B, S, dtype=torch.float64)
    ref = torch.where(far, lp + ref_offset + torch.rand(B, S, dtype=torch.float64), (lp + near[0]).clamp(max=0.0))
    old = None
    if old_offset is not None:
        old = torch.where(far, lp - old_offset - torch.rand(B, S, dtype=torch.float64), (lp + near[1]).clamp(max=0.0))
        old = old.float()
    adv = torch.randn(B, S)
    return hidden, weight, labels, adv, old, ref.float()


REGIMES = {   # (ref - lp at the far tokens, lp - old there; None: on-policy)
    "far_below_ref-on_policy": (25.0, None),
    "far_below_ref-ratio_up": (25.0, 12.0),
    "far_below_ref-ratio_down": (25.0, -12.0),
    "far_above_ref-on_policy": (-25.0, None),
    "far_above_ref-ratio_up": (-25.0, 12.0),
    "far_above_ref-ratio_down": (-25.0, -12.0),
}


@pytest.mark.parametrize("backend", ["chunked", TRITON])
@pytest.mark.parametrize("kl_ratio", [True, False])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "k3_unclamped"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_gradient_no_further_from_float64_than_the_trainers_float32(regime, kl_type, kl_ratio, backend):
    inputs = far_batch(*REGIMES[regime])
    hidden, weight, labels, adv, old, ref = inputs
    loss64, dh64, dw64, scale, (g_lp, logp) = evaluate(*inputs, kl_type, kl_ratio, torch.float64)
    loss32, dh32, dw32, _, _ = evaluate(*inputs, kl_type, kl_ratio, torch.float32)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    # the ratio's settings only with old log-probs: on-policy they have no effect, which is refused
    ratio = {} if old is None else dict(clip_low=0.2, clip_high=0.28, ratio_log_clamp=None)
    out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, kl_coef=KL_COEF, kl_type=kl_type,
                            kl_ratio=kl_ratio, loss_agg="token-sum", backend=backend, **ratio)
    out.loss.backward()
    valid = labels != -100
    errors = {"fused": (rel_err(h.grad[valid], dh64[valid]), rel_err(w.grad, dw64)),
              "float32": (rel_err(dh32[valid], dh64[valid]), rel_err(dw32, dw64))}
    print(f"{regime} {kl_type} kl_ratio={kl_ratio} {backend}: loss {out.loss.item():.6g} (float64 "
          f"{loss64.item():.6g}); d_hidden, d_weight relative errors {errors}")
    # the loss too: no further from float64 than the trainer's float32, or within 1e-5 of the sum of its terms'
    # magnitudes. A loss that nearly cancels (-0.021 from 12 terms of order 1) is off by a few 1e-6 in any float32
    # evaluation, and which of two float32 evaluations lands nearer float64 there is chance (seen: 1.8e-6 against
    # 1.5e-6); a lost or wrong term is off by far more than 1e-5 of the terms
    assert abs(out.loss.item() - loss64.item()) <= max(abs(loss32.item() - loss64.item()), 1e-5 * scale.item())
    resolution = lse_resolution(hidden, weight, g_lp, logp, dh64, dw64)
    for fused, trainer, lse in zip(errors["fused"], errors["float32"], resolution, strict=True):
        assert fused <= max(trainer, FLOOR, lse)


def test_float32_loses_the_bias_corrected_k3_far_below_the_reference():
    """The regime above is one where the trainer's float32 evaluation is far off (so the fused loss is held to
    more than float32's resolution there): TRL's bias-corrected k3, on-policy, 25 nats below the reference."""
    inputs = far_batch(25.0, None)
    _, dh64, dw64, _, _ = evaluate(*inputs, "k3_unclamped", True, torch.float64)
    _, dh32, dw32, _, _ = evaluate(*inputs, "k3_unclamped", True, torch.float32)
    assert rel_err(dw32, dw64) > 1e-2
