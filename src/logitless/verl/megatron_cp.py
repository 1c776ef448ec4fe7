"""The fused policy loss on verl's Megatron engine under context parallelism (``context_parallel_size`` > 1,
verl's static zigzag split; ``megatron_loss.py`` calls in here).

What verl 0.9 does under CP: every CP rank holds the whole micro-batch, runs the model on its slice of each
packed sequence (``preprocess_thd_engine``: sequence i padded to a multiple of 2 * cp * tp, cut into 2 * cp
chunks of h rows, rank r holding chunks r and 2cp-1-r, back to back, at rows [cu_i / cp, cu_{i+1} / cp)), and
``postprocess_thd_engine`` all-gathers the per-token log-probs / entropies over the CP group, this rank's part
keeping its gradient. ``ppo_loss`` then computes the *whole* micro-batch's loss L on every rank; the gradient
each rank's model receives is dL / d(its own log-probs).

The fused path: each rank runs ``fused_policy_loss`` on its own rows only (``local_rows``), with the whole
micro-batch's normalisation. For a token-local loss (each token's term reads that token only) aggregated by a
fixed weight per token -- verl's token-mean, token-sum, seq-mean-token-sum(-norm): the fused "token-sum"
times ``Plan.scale``, computed from the whole micro-batch's counts -- L = sum over CP ranks of this rank's
share F_r, and dF_r / d(own rows) = dL / d(own rows). ``carry`` returns F_r's gradient with the summed value
(all-reduced over the CP group), so loss value, gradients and verl's metrics (its ``ppo_loss`` on the
gathered outputs) are verl's.

Sequence-coupled losses need per-sequence sums across the CP ranks and are not wired: gspo (sequence ratio),
geo_mean (sequence mean), sapo and loss_agg_mode=seq-mean-token-mean (per-sequence token counts), clip_cov /
kl_cov (token choice over the whole batch's covariance). ``refusals`` names them (strict: raised; otherwise
verl's own loss runs, recorded).
"""
from __future__ import annotations

import torch

from ..losses import PolicyLoss
from ..losses.policy import reads_rollout_logprobs
from .tokens import IGNORE, Rows

# fused surrogates whose per-token term reads only that token (with ratio_level "token")
TOKEN_LOCAL = ("ppo", "gpg", "cispo", "dro", "dppo_tv", "dppo_kl")


def refusals(settings: dict, micro_batch_mean: bool, *, mode: str, agg: str, tensor_parallel: int) -> list:
    """Why the fused loss with these ``PolicyLoss`` settings (``Plan.settings``) cannot run under context
    parallelism, as "setting (why)"; [] when it can. mode / agg: verl's loss_mode and loss_agg_mode."""
    bad = []
    coupled = (settings.get("surrogate") not in TOKEN_LOCAL or settings.get("ratio_level", "token") != "token"
               or micro_batch_mean or _couples_tokens(settings))
    if coupled:
        bad.append(f"policy_loss.loss_mode={mode!r} under context parallelism (its policy term couples a "
                   "sequence's or the batch's tokens across the CP ranks; not wired)")
    elif settings.get("loss_agg") != "token-sum":
        bad.append(f"loss_agg_mode={agg!r} under context parallelism (per-sequence token counts across the CP "
                   "ranks; not wired)")
    if tensor_parallel > 1:
        bad.append(f"tensor_model_parallel_size={tensor_parallel} with context parallelism (not tested with the "
                   "fused loss)")
    return bad


def _couples_tokens(settings: dict) -> bool:
    """Whether the loss's terms read other tokens, as the loss itself says (``TermSpec.coupled``: sequence-level
    IS weights or rejection of this pass's log-probs, the off-policy mask, ... whatever the mode maps to)."""
    t = torch.zeros(1, 2)
    rollout = t if reads_rollout_logprobs(settings) else None      # given where nothing reads it: refused
    return PolicyLoss(advantages=t, old_logprobs=t, ref_logprobs=t, rollout_logprobs=rollout,
                      **settings).term_spec().coupled


def local_positions(cu_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """int64 [cu_padded[-1] / cp]: the global padded THD row of each of CP rank ``rank``'s rows, in its order
    (verl's zigzag split, see the module docstring). ValueError when a sequence's padded length is not a
    multiple of 2 * cp."""
    cu = [int(c) for c in cu_padded.tolist()]
    out = []
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if (b - a) % (2 * cp):
            raise ValueError(f"cu_seqlens_q_padded {cu} has a sequence not split in {2 * cp} equal chunks")
        h = (b - a) // (2 * cp)
        out.append(torch.arange(a + rank * h, a + (rank + 1) * h))
        out.append(torch.arange(b - (rank + 1) * h, b - rank * h))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def local_rows(whole: Rows, labels: torch.Tensor, cu_padded: torch.Tensor, cp: int, rank: int) -> Rows:
    """This CP rank's rows: ``whole`` (the micro-batch laid out like verl's global padded THD rows, labels
    IGNORE where not scored) at ``local_positions``, with this rank's own next-token ``labels`` [1, n]
    (verl rolls the labels before it splits them). ValueError when n is not this rank's share."""
    idx = local_positions(cu_padded, cp, rank).to(whole.labels.device)
    if labels.dim() != 2 or labels.shape[0] != 1 or labels.shape[1] != idx.numel():
        raise ValueError(f"this context-parallel rank's labels {tuple(labels.shape)} are not its "
                         f"{idx.numel()} rows of cu_seqlens_q_padded {cu_padded.tolist()}")

    def pick(t):
        return None if t is None else t.index_select(0, idx)
    scored = whole.labels.index_select(0, idx) != IGNORE
    cu = cu_padded.to(whole.labels.device, torch.long) // cp
    return Rows(labels=torch.where(scored, labels.reshape(-1), IGNORE), advantages=pick(whole.advantages),
                old_logprobs=pick(whole.old_logprobs), ref_logprobs=pick(whole.ref_logprobs),
                rollout_weights=pick(whole.rollout_weights), cu_seqlens=cu)


def carry(loss: torch.Tensor, group) -> torch.Tensor:
    """This rank's share ``loss`` (0-d) with its own gradient and, as value, the sum over the CP ``group``
    (the whole micro-batch's loss, as verl's loss has on every rank)."""
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=group)
    return loss + (total - loss.detach())
