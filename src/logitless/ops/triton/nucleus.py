"""A wide kept set decided from its emitted logits as they lie, unsorted: the boundary of a top-p nucleus (over the
min-p survivors where min-p is on) and the kept set's size, mass and entropy, one program per token.

Input: what ``above_select.above`` wrote for r tokens (values float32 [r, slots], ids int32 [r, slots], count
[r]; a token's first count slots, in the tiles' schedule order), each token's lse (z - lse is the full softmax's
log-prob, formed in float32 as the sorting path forms it) and settings. The sorting path (``truncation_wide``)
sorts every emitted id of a token by (value descending, id ascending) and cuts the nucleus in that order; this
kernel finds the same cut without the sort:
  - masses are summed in 2^-60 fixed point (int64): exact and order-free, so a token's result does not depend on the
    schedule that placed its slots (float64 sums in slot order would, in their last bits); each id weighs at least
    one unit (a survivor far below 2^-60 still counts where the target is every survivor's mass);
  - the boundary is the largest value v* with mass(z >= v*) >= top_p x W (W: the survivors' mass under min-p, else
    the whole vocabulary's, 1), searched over the float32 values' ordered bits, 16 ways a pass: 8 passes read the
    token's slots;
  - a tie at v* that the nucleus would split (some of its ids kept, by ascending id, and some not) is left
    undecided, as is a token whose emitted mass does not reach the target: the caller sorts those.

Outputs per token: decided, the kept count (every id at or above v*), the kept mass (fixed point), the kept sum of
q (-log q) (2^-58 fixed point, for the entropy), v* and the largest value below it (the first id left out; -inf
where none was emitted), and whether the token's label is kept.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import on_device

MASS_BITS = 60          # q in [0, 1 + float32 rounding], and a token's masses sum to about 1: below 2^63
ENTROPY_BITS = 58       # q (-log q) <= 1/e each, their sum <= log V < 16
BLOCK = 256
WAYS = 16
LEVELS = 8              # 16^8 = 2^32: every float32 value's ordered bits


@triton.jit
def _ordered(v):
    """int64 keys in the order of the float32 values v (finite), -0.0 taken as +0.0 (equal values, one key: a tie
    ordered by id, as the sorting path's keys have it)."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _fixed(q, ok):
    """q (float64) in 2^-60 units, int64, of the slots ``ok``; at least one unit, so that every emitted id moves the
    mass (a min-p survivor of q < 2^-60 is kept where every survivor is: top_p 1), at most 2^15 units of bias over
    a token's slots."""
    return tl.where(ok, tl.maximum((q * 1152921504606846976.0).to(tl.int64), 1), 0)


@triton.jit
def _mass(v, lse, ok):
    """q = exp(v - lse) in 2^-60 units (``_fixed``) of the slots ``ok``, the difference rounded to float32 first
    (as the sorting path's log-probs)."""
    return _fixed(tl.exp((v - lse).to(tl.float64)), ok)


@triton.jit
def _masses(v, lse, ok):
    """(``_mass``, q (-log q) in 2^-58 units), int64, of the slots ``ok``, from one exponential."""
    lp = (v - lse).to(tl.float64)
    q = tl.exp(lp)
    return _fixed(q, ok), tl.where(ok, (q * -lp * 288230376151711744.0).to(tl.int64), 0)


# row stride and width not specialised; the loops' chunk count is a power of two (one build per power: a handful),
# each chunk past a token's own count skipped (the interpreter cannot bound a loop by a runtime value)
@triton.jit(do_not_specialize=["stride", "width"])
def _nucleus_kernel(vals_ptr, ids_ptr, count_ptr, lse_ptr, top_p_ptr, log_min_p_ptr, complete_ptr, label_ptr,
                    decided_ptr, kept_ptr, mass_ptr, ent_ptr, last_ptr, out_ptr, inside_ptr, stride, width,
                    BLOCK: tl.constexpr, CHUNKS: tl.constexpr, WAYS: tl.constexpr, LEVELS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(count_ptr + row), width)
    base = row * stride
    lse = tl.load(lse_ptr + row)
    offs = tl.arange(0, BLOCK)

    # the largest value: the min-p threshold is relative to its log-prob
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for chunk in range(0, CHUNKS):
        if chunk * BLOCK < n:
            ok = chunk * BLOCK + offs < n
            top = tl.maximum(top, tl.load(vals_ptr + base + chunk * BLOCK + offs, mask=ok, other=float("-inf")))
    vmax = tl.max(top, axis=0)
    log_min_p = tl.load(log_min_p_ptr + row)
    thr = (vmax - lse).to(tl.float64) + log_min_p     # -inf with min-p off

    # the survivors' mass and smallest key, the label's value
    label = tl.load(label_ptr + row)
    mass = tl.zeros([BLOCK], tl.int64)
    low = tl.full([BLOCK], 2 ** 40, tl.int64)
    lab = tl.full([BLOCK], float("-inf"), tl.float32)
    for chunk in range(0, CHUNKS):
        if chunk * BLOCK < n:
            ok = chunk * BLOCK + offs < n
            v = tl.load(vals_ptr + base + chunk * BLOCK + offs, mask=ok, other=0.0)
            alive = ok & ((v - lse).to(tl.float64) >= thr)
            mass += _mass(v, lse, alive)
            low = tl.minimum(low, tl.where(alive, _ordered(v), 2 ** 40))
            ids = tl.load(ids_ptr + base + chunk * BLOCK + offs, mask=ok, other=-1)
            lab = tl.maximum(lab, tl.where(ok & (ids == label), v, float("-inf")))
    survivors = tl.sum(mass, axis=0)
    # the mass the nucleus is a fraction of: the survivors' under min-p, else the vocabulary's (1, or what every id
    # emitted sums to where all were)
    closed = (log_min_p > float("-inf")) | (tl.load(complete_ptr + row) != 0)
    whole = tl.where(closed, survivors, tl.maximum(survivors, 1152921504606846976))
    top_p = tl.load(top_p_ptr + row)
    want = top_p * whole.to(tl.float64)
    target = want.to(tl.int64)
    target += (target.to(tl.float64) < want).to(tl.int64)
    target = tl.where(top_p < 1.0, target, whole)

    # the largest key whose mass at or above it reaches the target: mass(>= lo) >= target > mass(>= hi)
    lo = tl.min(low, axis=0)
    hi = _ordered(vmax) + 1
    ways = tl.arange(0, WAYS).to(tl.int64)
    for _level in tl.static_range(LEVELS):
        step = tl.maximum((hi - lo + WAYS - 1) // WAYS, 1)
        at = lo + ways * step
        reach = tl.zeros([WAYS], tl.int64)
        for chunk in range(0, CHUNKS):
            if chunk * BLOCK < n:
                ok = chunk * BLOCK + offs < n
                v = tl.load(vals_ptr + base + chunk * BLOCK + offs, mask=ok, other=0.0)
                qf = _mass(v, lse, ok)
                above = ok[:, None] & (_ordered(v)[:, None] >= at[None, :])
                reach += tl.sum(tl.where(above, qf[:, None], 0), axis=0)
        climb = tl.sum(((reach >= target) & (at < hi)).to(tl.int64), axis=0) - 1
        lo = lo + tl.maximum(climb, 0) * step
        hi = tl.minimum(hi, lo + step)

    # the kept set: every key >= lo (a tie at lo kept whole, else undecided)
    gt = tl.zeros([BLOCK], tl.int64)
    ties = tl.zeros([BLOCK], tl.int64)
    q_tie = tl.zeros([BLOCK], tl.int64)
    kept_e = tl.zeros([BLOCK], tl.int64)
    kept = tl.zeros([BLOCK], tl.int32)
    last = tl.full([BLOCK], float("-inf"), tl.float32)
    out = tl.full([BLOCK], float("-inf"), tl.float32)
    for chunk in range(0, CHUNKS):
        if chunk * BLOCK < n:
            ok = chunk * BLOCK + offs < n
            v = tl.load(vals_ptr + base + chunk * BLOCK + offs, mask=ok, other=0.0)
            key = _ordered(v)
            qf, ef = _masses(v, lse, ok)
            gt += tl.where(key > lo, qf, 0)
            tie = ok & (key == lo)
            ties += tie.to(tl.int64)
            q_tie = tl.maximum(q_tie, tl.where(tie, qf, 0))
            inset = ok & (key >= lo)
            kept += inset.to(tl.int32)
            kept_e += tl.where(inset, ef, 0)
            last = tl.maximum(last, tl.where(tie, v, float("-inf")))
            out = tl.maximum(out, tl.where(ok & (key < lo), v, float("-inf")))
    above_tie = tl.sum(gt, axis=0)
    n_tie = tl.sum(ties, axis=0)
    q_star = tl.max(q_tie, axis=0)
    # the ties are kept by ascending id while the mass before them is below the target
    tie_kept = (target - above_tie + q_star - 1) // tl.maximum(q_star, 1)
    decided = (survivors >= target) & (n_tie > 0) & (q_star > 0) & (tie_kept >= n_tie)
    lab_v = tl.max(lab, axis=0)
    # a label not emitted lies below the bound, and outside
    inside = (lab_v > float("-inf")) & (_ordered(tl.maximum(lab_v, -3.0e38)) >= lo)
    tl.store(decided_ptr + row, decided.to(tl.int8))
    tl.store(kept_ptr + row, tl.sum(kept, axis=0))
    tl.store(mass_ptr + row, above_tie + n_tie * q_star)
    tl.store(ent_ptr + row, tl.sum(kept_e, axis=0))
    tl.store(last_ptr + row, tl.max(last, axis=0))
    tl.store(out_ptr + row, tl.max(out, axis=0))
    tl.store(inside_ptr + row, inside.to(tl.int8))


def chunks(width: int) -> int:
    """The kernel's chunk count for rows of ``width`` slots: a power of two."""
    return triton.next_power_of_2(triton.cdiv(width, BLOCK))


class Nucleus(NamedTuple):
    """Per token [r]: decided bool; kept int64 (the kept set's size); log_mass float64 (log of its mass under the
    full softmax); entropy float64 (of the truncated distribution); last float32 (the smallest kept value) and
    out float32 (the largest value left out, -inf where none was emitted); inside bool (the label kept)."""
    decided: Tensor
    kept: Tensor
    log_mass: Tensor
    entropy: Tensor
    last: Tensor
    out: Tensor
    inside: Tensor


def nucleus(values: Tensor, ids: Tensor, count: Tensor, lse: Tensor, top_p: Tensor, log_min_p: Tensor,
            complete: Tensor, labels: Tensor) -> Nucleus:
    """The kept sets of r tokens from their emitted slots (values float32 [r, w], ids int32 [r, w], unit stride along
    a row; count [r]: a row's first count slots, those past w not read: only rows with count <= w are decided), lse
    float32 [r], top_p float64 [r] (1: off), log_min_p float64 [r] (-inf: off), complete bool [r] (every vocabulary
    id emitted), labels [r] (-1: none)."""
    r, width = values.shape
    if values.stride(1) != 1 or ids.stride(1) != 1 or values.stride(0) != ids.stride(0):
        raise ValueError("nucleus: values and ids must share a row stride, with unit stride along a row")
    dev = values.device
    decided = torch.zeros(r, dtype=torch.int8, device=dev)
    kept = torch.zeros(r, dtype=torch.int32, device=dev)
    mass = torch.zeros(r, dtype=torch.int64, device=dev)
    ent = torch.zeros(r, dtype=torch.int64, device=dev)
    last = torch.zeros(r, dtype=torch.float32, device=dev)
    out = torch.zeros(r, dtype=torch.float32, device=dev)
    inside = torch.zeros(r, dtype=torch.int8, device=dev)
    if r and width:
        with on_device(values):
            _nucleus_kernel[(r,)](
                values, ids, count.to(torch.int32).contiguous(), lse.float().contiguous(),
                top_p.double().contiguous(), log_min_p.double().contiguous(), complete.to(torch.int8).contiguous(),
                labels.to(torch.int32).contiguous(), decided, kept, mass, ent, last, out, inside, values.stride(0),
                width,
                BLOCK=BLOCK, CHUNKS=chunks(width), WAYS=WAYS, LEVELS=LEVELS, num_warps=4)
    s = mass.double() * 2.0 ** -MASS_BITS
    log_mass = torch.log(s)
    # H = -sum (q / S) log(q / S) = (1 / S) sum q (-log q) + log S
    entropy = ent.double() * 2.0 ** -ENTROPY_BITS / s + log_mass
    ok = decided.bool() & (mass > 0)
    return Nucleus(ok, kept.long(), log_mass, entropy, last, out, inside.bool())
