"""Does GRPO still learn with logitless' fused loss? TRL's GRPOTrainer, the same seed, three losses.

    python examples/trl_grpo_learning.py --out runs/cpu --plot                 # CPU: 3 runs, 2-4 min each
    python examples/trl_grpo_learning.py --size gpu --out runs/gpu --plot      # CUDA: bf16, V = 151936
    python examples/trl_grpo_learning.py --mode fused --steps 3 --out runs/x   # one run, in this process
    python examples/trl_grpo_learning.py --plot-only --out runs/cpu            # plot runs already made

A tiny Qwen2 with random weights is built from a config (nothing from the Hub) with a word-level tokenizer
made in code ("w0", "w1", ...); the prompts are random words. The reward is a rule a random policy can
improve on quickly at any vocabulary size: the share of completion words in a fixed target set, the 1/8 of the
words (``--target-fraction``) whose row of the initial LM head has the largest projection on one random
direction of the hidden space (drawn from ``--model-seed``, so every mode rewards the same words). A random
policy scores about 0.12; moving its last hidden state along that direction raises every target word's logit
at once, so every completion teaches the policy about all the target words. (The earlier set, the words whose
number is a multiple of 8, has no such structure: it is learnt word by word, and at V = 151936 a run samples
each word about twice; on an H200 it stayed at 0.12 for 50 steps.)

Modes (each run a fresh trainer from the same model weights and, for the same ``--seed``, the same sampling):
  trl    TRL's own GRPOTrainer: its log-probs and its ``_compute_loss``.
  fused  ``logitless.trl.enable(trainer, fused_loss=True)``: log-probs and the loss from logitless' fused
         policy loss (no [tokens x vocab] logits).
  liger  Liger-Kernel's ``LigerFusedLinearGRPOLoss`` as the trainer's loss. TRL 1.16's GRPOConfig has no
         ``use_liger_loss`` (only ``use_liger_kernel``, Liger's layer kernels, not its loss), so this mode
         puts Liger's loss into the trainer's ``_compute_loss`` the way TRL's ``use_liger_loss`` did (the
         backbone's last hidden state and the LM head's weight into Liger's chunked loss; TRL's old and
         reference log-probs). Needs liger-kernel and a CUDA GPU; elsewhere it says so and is skipped
         (``--liger-on-cpu`` runs it on CPU anyway, uncompiled, to check the mode, not its speed).

The loss settings are a common GRPO (DAPO-style) configuration: loss_type "dapo", clip 0.2 / 0.28, a k3 KL to
the reference model with beta 0.04 (TRL's bias-corrected KL, its default), two optimizer steps per generation
batch (``steps_per_generation=2``: the second step is off-policy, so the ratio and the clipping act).

Each run writes OUT/<mode>-seed<seed>.json: per step the loss, grad norm, KL, entropy, clip ratio, the mean
reward of the generation batch (logged on the steps that generate), the step's wall time and its peak memory
(CUDA: torch.cuda.max_memory_allocated during the step, and its rise over the step's start; CPU: the process's
resident-set high-water mark, Linux VmHWM reset at each step's start, and its rise over the step's start).
With several modes each run is a fresh process (so memory is the run's own). ``--noise-seeds`` adds runs of
``trl`` with other sampling seeds (same model weights): their spread is the run-to-run noise the trl / fused
difference is judged against. ``--plot`` draws every run's reward curve into OUT/reward_curves.png (or
``--png``) and prints a markdown table and the curve distances.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the tokenizer, the step meter, the run records, the table and the plot, shared with trl_distillation_learning.py
import learning_runs as runs_common  # noqa: E402
from learning_runs import build_tokenizer  # noqa: E402

MODES = ("trl", "fused", "liger")
WORD_IDS = 3              # the tokenizer's ids before the words: <pad>, <eos>, <unk>
# the std of the initial logits (the final norm keeps the last hidden state's RMS near 1): with the hidden state
# all along the reward's direction, the target words take a share Phi(HEAD_SCALE - 1.15) of the samples (1.15:
# the normal's upper 1/8 quantile), 0.44 at a scale of 1, 0.80 at 2 (target_words)
HEAD_SCALE = 2.0
# per-size defaults; every one can be overridden by its flag
SIZES = {
    "cpu": dict(vocab=2053, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, prompts=8, generations=8,
                completion_length=8, prompt_words=4, lr=5e-3, steps=100, dtype="float32"),
    # CUDA, bf16: 16384 completion tokens a step (their float32 logits would be 9.3 GiB), 100 steps. Not yet run
    # with this reward and shape (16 prompts x 8 x 96 tokens, 6144 a step, ran 0.21 s a step on an H200)
    "gpu": dict(vocab=151936, hidden=1024, layers=4, heads=16, kv_heads=4, intermediate=2816, prompts=32,
                generations=8, completion_length=128, prompt_words=16, lr=1e-3, steps=100, dtype="bfloat16"),
    # what the test runs: the smallest shapes that still make a GRPO step
    "tiny": dict(vocab=509, hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, prompts=4, generations=4,
                 completion_length=6, prompt_words=3, lr=3e-3, steps=3, dtype="float32"),
}
LOGGED = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean",
          "completions/mean_length", "learning_rate")


def parse_args(argv=None):
    p = runs_common.argument_parser(__doc__, MODES, SIZES, out="the JSON of each run (and the plot)", noise_seeds="1",
                                    weights="the model's random weights", png_name="reward_curves.png")
    p.add_argument("--target-fraction", type=float, default=0.125, help="the share of the words that are targets")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps-per-generation", type=int, default=2)
    p.add_argument("--liger-on-cpu", action="store_true", help="run the liger mode without CUDA (a check only)")
    p.add_argument("--liger-uncompiled", action="store_true", help="Liger's loss without torch.compile")
    args = runs_common.parse_sized(p, argv, SIZES)
    if not 0.0 < args.target_fraction < 1.0:
        p.error(f"--target-fraction must be between 0 and 1 (exclusive), got {args.target_fraction}")
    return args


# ---------------------------------------------------------------- model, tokenizer, prompts, reward

def build_model(folder: str, args) -> tuple[str, frozenset]:
    """A random tiny Qwen2 and its tokenizer saved to ``folder`` (TRL loads the reference model from it too), and
    the target words of the reward (``target_words``). The same ``--model-seed`` gives the same weights and the
    same target words in every mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(args.model_seed)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4 * (
                             args.prompt_words + args.completion_length) + 64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # logits of std HEAD_SCALE rather than ~0.02 x sqrt(H): a policy with preferences to move (target_words)
        model.lm_head.weight.normal_(0.0, HEAD_SCALE / math.sqrt(args.hidden))
    model.to(getattr(torch, args.dtype)).save_pretrained(folder)
    build_tokenizer(args.vocab).save_pretrained(folder)
    return folder, target_words(model.lm_head.weight, args)


def target_words(head_weight, args) -> frozenset:
    """The numbers of the target words: the ``--target-fraction`` of the words whose LM-head row, as saved, has
    the largest projection on a random direction of the hidden space drawn from ``--model-seed`` (shared
    structure: moving the last hidden state along it raises all of their logits at once)."""
    direction = torch.randn(args.hidden, generator=torch.Generator().manual_seed(args.model_seed))
    words = head_weight.detach()[WORD_IDS:].float() @ direction      # word "w<i>" is token WORD_IDS + i
    count = max(1, round(args.target_fraction * words.numel()))
    return frozenset(torch.topk(words, count).indices.tolist())


def build_prompts(args, n: int = 256):
    """``n`` prompts of ``--prompt-words`` random words (a fixed draw, the same in every run)."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, args.vocab - 3, (n, args.prompt_words), generator=gen)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def target_share(targets: frozenset):
    """The rule: the share of a completion's words that are target words (``target_words``; 0 when empty)."""
    def reward(completions, **_):
        out = []
        for text in completions:
            words = [w for w in text.split() if w[:1] == "w" and w[1:].isdigit()]
            out.append(sum(int(w[1:]) in targets for w in words) / max(len(words), 1))
        return out
    reward.__name__ = "target_share"
    return reward


# ---------------------------------------------------------------- the liger mode

def liger_compute_loss(self, model, inputs):
    """Liger's ``LigerFusedLinearGRPOLoss`` in place of GRPOTrainer._compute_loss, as TRL's use_liger_loss
    ran it: the backbone's last hidden state at the positions that predict the completion, the LM head's
    weight, TRL's advantages and old / reference log-probs. Logs TRL's names for what Liger returns (kl,
    clip_ratio/region_mean). TRL's scaling for gradient accumulation and its dapo normaliser are kept."""
    unwrapped = self.accelerator.unwrap_model(model)
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    completion_mask = inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    keep = completion_ids.size(1)
    with self.accelerator.autocast():
        hidden = unwrapped.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    hidden = hidden[:, -keep - 1:-1, :]                     # position t predicts token t + 1
    mode = "train" if self.model.training else "eval"
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = None
    if self.loss_type in ("dapo", "cispo", "vespo"):
        # TRL: num_items_in_batch spans the generation batch; one accumulation window's share of it
        num_items = inputs["num_items_in_batch"].float()
        if mode == "train":
            num_items = num_items * accumulation / self.args.steps_per_generation
    loss, metrics = self._liger_grpo_loss(
        _input=hidden, lin_weight=unwrapped.lm_head.weight, selected_token_ids=completion_ids,
        attention_mask=completion_mask, advantages=inputs["advantages"], bias=unwrapped.lm_head.bias,
        old_per_token_logps=inputs.get("old_per_token_logps"), ref_per_token_logps=inputs.get("ref_per_token_logps"),
        num_items_in_batch=num_items)
    if num_items is None:
        loss = loss / accumulation
    if self.beta != 0.0:
        self._metrics[mode]["kl"].append(self.accelerator.gather(metrics[0]).mean().item())
    self._metrics[mode]["clip_ratio/region_mean"].append(self.accelerator.gather(metrics[-1]).mean().item())
    return loss


def enable_liger(trainer, compiled: bool):
    import types

    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    a = trainer.args
    trainer._liger_grpo_loss = LigerFusedLinearGRPOLoss(
        beta=trainer.beta, compiled=compiled, use_ref_model=trainer.beta != 0.0, epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high, loss_type=trainer.loss_type, max_completion_length=a.max_completion_length,
        importance_sampling_level=trainer.importance_sampling_level, temperature=trainer.temperature,
        delta=a.delta, use_bias_correction_kl=bool(a.use_bias_correction_kl))
    trainer.__dict__["_compute_loss"] = types.MethodType(liger_compute_loss, trainer)


def liger_unavailable(args) -> str | None:
    """Why the liger mode cannot run here (None: it can)."""
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means it is not usable here
        return f"liger-kernel is not installed ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available() and not args.liger_on_cpu:
        return "no CUDA GPU here (Liger's GRPO loss is a GPU loss; --liger-on-cpu runs it anyway, as a check)"
    return None


# ---------------------------------------------------------------- one run

def run_one(args, mode: str, seed: int) -> dict:
    """Train one mode from ``seed`` and write OUT/<mode>-seed<seed>.json (returned)."""
    runs_common.quiet_trainer()
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    hf_logging.disable_progress_bar()
    path = os.path.join(args.out, f"{mode}-seed{seed}.json")
    record = runs_common.new_record(args, mode, seed)
    if mode == "liger":
        why = liger_unavailable(args)
        if why:
            print(f"liger mode skipped: {why}")
            record["skipped"] = why
            runs_common.write_record(path, record)
            return record
    use_cpu = not torch.cuda.is_available()
    bf16 = args.dtype == "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        folder, targets = build_model(os.path.join(tmp, "model"), args)
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), seed=seed, max_steps=args.steps, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            per_device_train_batch_size=args.prompts * args.generations // args.steps_per_generation,
            steps_per_generation=args.steps_per_generation, gradient_accumulation_steps=1,
            num_generations=args.generations, max_completion_length=args.completion_length, temperature=1.0,
            loss_type=args.loss_type, beta=args.beta, epsilon=0.2, epsilon_high=0.28,
            model_init_kwargs={"dtype": args.dtype}, bf16=bf16, use_cpu=use_cpu,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=folder, reward_funcs=target_share(targets), args=config,
                              train_dataset=Dataset.from_dict({"prompt": build_prompts(args)}),
                              processing_class=build_tokenizer(args.vocab))
        trainer.remove_callback(PrinterCallback)
        if mode == "fused":
            import logitless.trl
            logitless.trl.enable(trainer, fused_loss=True)
        elif mode == "liger":
            enable_liger(trainer, compiled=torch.cuda.is_available() and not args.liger_uncompiled)
        meter = runs_common.StepMeter(trainer.accelerator.device)
        trainer.add_callback(meter.callback())
        t0 = time.perf_counter()
        trainer.train()
        record["train_s"] = time.perf_counter() - t0
    s = runs_common.close_record(path, record, runs_common.step_rows(meter, trainer, LOGGED), summarise)
    print(f"{mode} seed {seed}: reward {s['first_reward']:.3f} -> {s['final_reward']:.3f}, "
          f"step {s['median_step_s']:.3f} s (median), peak {s['peak_mib']:.1f} MiB "
          f"(+{s['rise_median_mib']:.1f} over a step's start, median); {path}")
    return record


def summarise(steps, window: int = 10) -> dict:
    """Rewards of the generation batches in the first / last ``window`` steps; the first step whose batch
    reached a reward of 0.5 and of 0.9; the step time and memory (learning_runs.step_summary)."""
    rewards = [(s["step"], s["reward"]) for s in steps if "reward" in s]
    last = steps[-1]["step"] if steps else 0
    first = [r for st, r in rewards if st <= window]
    final = [r for st, r in rewards if st > last - window]
    return {"first_reward": statistics.fmean(first) if first else float("nan"),
            "final_reward": statistics.fmean(final) if final else float("nan"),
            "step_to_0.5": next((st for st, r in rewards if r >= 0.5), None),
            "step_to_0.9": next((st for st, r in rewards if r >= 0.9), None),
            **runs_common.step_summary(steps)}


# ---------------------------------------------------------------- the table, the distances, the plot

def table(runs) -> str:
    def cells(r):
        if "skipped" in r:
            return f"skipped: {r['skipped']}"
        s = summarise(r["steps"])
        return [f"{s['first_reward']:.3f}", f"{s['final_reward']:.3f}", f"{s['step_to_0.5']} / {s['step_to_0.9']}"]
    return runs_common.table(runs, ["reward, first 10 steps", "reward, last 10 steps", "first step >= 0.5 / 0.9"],
                             cells)


def distances(runs) -> list[str]:
    """The trl / fused (and liger) distance against the trl seed-to-seed distance (the noise)."""
    out = []
    for r, ref in runs_common.against_first_trl(runs):
        ca, cb = runs_common.curve(r, "reward"), runs_common.curve(ref, "reward")
        apart = next((st for st in sorted(set(ca) & set(cb)) if ca[st] != cb[st]), None)
        out.append(f"{r['mode']} seed {r['seed']} vs trl seed {ref['seed']}: mean |reward difference| per generation "
                   f"{runs_common.distance(r, ref, 'reward'):.4f}, final rewards "
                   f"{summarise(r['steps'])['final_reward']:.3f} vs {summarise(ref['steps'])['final_reward']:.3f}, "
                   f"first generation whose reward differs: step {apart}")
    return out


def plot(runs, png):
    done = [r for r in runs if "skipped" not in r]
    s = done[0]["settings"] if done else {}
    runs_common.plot(
        runs, png, [("mean reward of the generation batch", lambda r: runs_common.curve(r, "reward"))],
        {"trl": "TRL's loss", "fused": "logitless fused_loss=True", "liger": "Liger's GRPO loss"},
        f"TRL GRPOTrainer, loss_type {s.get('loss_type')}, beta {s.get('beta')}, V={s.get('vocab')}, "
        f"{s.get('dtype')}, {runs_common.where(runs)}", (6.4, 3.8))


def main(argv=None):
    runs_common.main(sys.argv[1:] if argv is None else argv, __file__, MODES, parse_args, run_one,
                    (plot, table, distances), "reward_curves.png")


if __name__ == "__main__":
    main()
