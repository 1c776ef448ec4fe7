"""One GRPO policy-gradient step on a tiny Qwen2 model: logitless (fused) against the usual path
that builds the logits (unfused). Same loss, same gradients; the fused path never holds a
[tokens x vocab] tensor.

    python examples/grpo_step.py                 # CPU, or CUDA when available
    python examples/grpo_step.py --vocab 32768 --device cpu

The step: sample G completions per prompt from the policy, score them with a toy reward,
normalise the rewards within each group (the GRPO advantage), then minimise the clipped
policy-gradient loss minus an entropy bonus over the completion tokens. Prints the loss and the
peak memory of each path and their agreement; exits with status 1 if they disagree.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import time
from pathlib import Path

import torch

import logitless
from logitless.transformers import fused_forward
from transformers import Qwen2Config, Qwen2ForCausalLM

# Absolute on the loss; relative norm on each parameter's gradient. Against float64 the fused path
# must be within 1e-4. Two float32 paths disagree by the sum of their rounding errors, and the usual
# one's float32 softmax over a large vocabulary is the larger part (reported below), hence 1e-3.
LOSS_TOL, GRAD_TOL, FP32_PAIR_TOL = 1e-5, 1e-4, 1e-3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=None,
                   help="default: Qwen2's real 151936 on CUDA, 32768 on CPU (seconds)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4, help="completions sampled per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.9, help="rollout sampling temperature")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args()


def build_policy(args, device) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.prompt_len + args.completion_len, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random weights; a wider head gives a policy that is not uniform
        model.lm_head.weight.normal_(0.0, 2.0 / args.hidden ** 0.5)
    return model.to(device)


@torch.no_grad()
def sample_completions(model, prompts, args):
    """Sample ``completion_len`` tokens per row at ``args.temperature`` (Gumbel-max: exact sampling,
    and much faster than torch.multinomial over a large vocabulary on CPU)."""
    seqs = prompts
    for _ in range(args.completion_len):
        logits = model(input_ids=seqs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp_min(1e-20)))
        seqs = torch.cat([seqs, (logits / args.temperature + gumbel).argmax(-1, keepdim=True)], 1)
    return seqs


@torch.no_grad()
def rollout(model, args, device):
    """Prompts + sampled completions, right-padded: input_ids, attention_mask [B, P + C], and the
    labels of the completion tokens (position t scored against token t+1; -100 elsewhere)."""
    prompts = torch.randint(2, args.vocab, (args.prompts, args.prompt_len), device=device)
    seqs = sample_completions(model, prompts.repeat_interleave(args.group_size, 0), args)
    b, s = seqs.shape
    # completions end at a random length (as if the policy had emitted EOS there): right padding
    ends = args.prompt_len + torch.randint(args.completion_len // 2, args.completion_len + 1, (b,), device=device)
    pos = torch.arange(s, device=device)
    attention_mask = (pos[None] < ends[:, None]).long()
    input_ids = torch.where(attention_mask.bool(), seqs, torch.zeros_like(seqs))
    labels = torch.full_like(input_ids, -100)
    scored = (pos[None, :-1] + 1 >= args.prompt_len) & (pos[None, :-1] + 1 < ends[:, None])
    labels[:, :-1] = torch.where(scored, input_ids[:, 1:], labels[:, :-1])
    return input_ids, attention_mask, labels


def group_advantages(labels, args):
    """A toy reward (share of even token ids in the completion), normalised within each group."""
    mask = labels != -100
    reward = ((labels % 2 == 0) & mask).sum(1) / mask.sum(1)
    grouped = reward.view(args.prompts, args.group_size)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def grpo_loss(lp, ent, old_lp, adv, mask, args):
    """Clipped surrogate, mean over each completion's tokens then over completions, minus the
    entropy bonus. lp, ent, old_lp, mask [B, S]; adv [B]."""
    ratio = torch.exp(lp - old_lp)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
    per_seq = -(surrogate * mask).sum(1) / mask.sum(1)
    entropy = (ent * mask).sum() / mask.sum()
    return per_seq.mean() - args.entropy_coef * entropy


def fused_logprobs_entropy(model, input_ids, attention_mask, labels, args):
    out = fused_forward(model, input_ids, attention_mask, shift_labels=labels, temperature=args.temperature)
    return out.logprobs, out.entropy


def unfused_logprobs_entropy(model, input_ids, attention_mask, labels, args, dtype=torch.float32):
    """What trainers do without logitless: full logits, log-softmax over the vocabulary in
    ``dtype`` (float32 as usual; float64 makes the accuracy reference)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp = torch.log_softmax(logits.to(dtype) / args.temperature, dim=-1)
    valid = labels != -100
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def float64_logprobs_entropy(model, input_ids, attention_mask, labels, args):
    return unfused_logprobs_entropy(model, input_ids, attention_mask, labels, args, dtype=torch.float64)


class PeakMemory:
    """Peak memory allocated above the starting point of a block: CUDA allocator statistics, or on
    CPU the process's resident-set high-water mark (Linux VmHWM, reset at the start)."""

    def __init__(self, device):
        self.device, self.peak = torch.device(device), None

    @staticmethod
    def _kib(key):
        return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif Path("/proc/self/clear_refs").exists():
            try:  # hand freed heap back to the OS so earlier work does not hide this block's peak
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            Path("/proc/self/clear_refs").write_text("5")
            self.start = self._kib("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        elif Path("/proc/self/clear_refs").exists():
            self.peak = self._kib("VmHWM") - self.start

    def __str__(self):
        return "n/a" if self.peak is None else f"{self.peak / 2**20:8.1f} MiB"


def step(name, scorer, model, batch, old_lp, adv, args):
    input_ids, attention_mask, labels = batch
    mask = (labels != -100).float()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with PeakMemory(input_ids.device) as mem:
        lp, ent = scorer(model, input_ids, attention_mask, labels, args)
        loss = grpo_loss(lp, ent, old_lp, adv, mask, args)
        loss.backward()
    seconds = time.perf_counter() - t0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    print(f"{name:<22} loss={loss.item():+.8f}  time {seconds:6.2f} s  peak memory {mem}")
    return loss.detach(), grads


def main():
    args = parse_args()
    if args.vocab is None:
        args.vocab = 151936 if args.device.startswith("cuda") else 32768
    if args.seed is not None:
        torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_policy(args, device)
    batch = rollout(model, args, device)
    input_ids, attention_mask, labels = batch
    n_scored = int((labels != -100).sum())
    adv = group_advantages(labels, args)
    with torch.no_grad():
        # the behaviour policy's log-probs; perturbed to stand for a policy one update behind, so
        # that some ratios leave [1 - clip, 1 + clip] and the clipping is exercised
        old_lp, _ = fused_logprobs_entropy(model, *batch, args)
        old_lp = torch.where(labels != -100, old_lp + 0.3 * torch.randn_like(old_lp), 0.0)

    b, s = input_ids.shape
    print(f"GRPO step: tiny Qwen2 (vocab {args.vocab}, hidden {args.hidden}, 2 layers) on {device}, "
          f"{args.prompts} prompts x {args.group_size} completions, {b * s} tokens ({n_scored} scored)")
    print(f"one float32 logits tensor [{b * s} x {args.vocab}] = {b * s * args.vocab * 4 / 2**20:.1f} MiB")
    if device.type == "cuda":  # compile the triton kernels and warm cuBLAS outside the timed steps
        for scorer in (fused_logprobs_entropy, unfused_logprobs_entropy):
            lp, ent = scorer(model, *batch, args)
            grpo_loss(lp, ent, old_lp, adv, (labels != -100).float(), args).backward()
    loss_f, grads_f = step("fused (logitless)", fused_logprobs_entropy, model, batch, old_lp, adv, args)
    backend = logitless.last_backend()
    loss_u, grads_u = step("unfused (fp32 logits)", unfused_logprobs_entropy, model, batch, old_lp, adv, args)
    loss_r, grads_r = step("float64 reference", float64_logprobs_entropy, model, batch, old_lp, adv, args)
    print(f"fused backend: {backend}")

    agree = compare("agreement fused vs unfused", loss_f, grads_f, loss_u, grads_u, LOSS_TOL, FP32_PAIR_TOL)
    exact = compare("accuracy fused vs float64", loss_f, grads_f, loss_r, grads_r, LOSS_TOL, GRAD_TOL)
    compare("accuracy unfused vs float64", loss_u, grads_u, loss_r, grads_r, None, None)
    print("What this shows: the three paths compute the same loss and gradients (the agreement and accuracy\n"
          "lines, with their tolerances). Peak memory is what each step allocated above its start:\n"
          "the unfused path holds [tokens x vocab] float32 logits and their log-softmax at once, the fused path\n"
          "only small tiles of them. Times are one cold step each, so they vary from run to run.")
    return 0 if agree and exact else 1


def compare(what, loss_a, grads_a, loss_b, grads_b, loss_tol, grad_tol):
    """Print |loss_a - loss_b| and the worst per-parameter gradient relative error; True when
    within the tolerances (None: report only)."""
    assert grads_a.keys() == grads_b.keys()
    loss_diff = abs(loss_a.item() - loss_b.item())
    errors = {n: float((grads_a[n].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30))
              for n, g in grads_b.items()}
    worst = max(errors, key=errors.get)
    ok = loss_tol is None or (loss_diff <= loss_tol and errors[worst] <= grad_tol)
    verdict = "" if loss_tol is None else (" -> OK" if ok else " -> MISMATCH")
    print(f"{what}: loss_abs_diff={loss_diff:.3e} max_grad_rel_err={errors[worst]:.3e} "
          f"({worst}, {len(errors)} parameters){verdict}")
    return ok

if __name__ == "__main__":
    raise SystemExit(main())
