"""TRL's GRPOTrainer with logitless: three GRPO steps on CPU, end to end, nothing from the Hub.

    python examples/trl_grpo.py
    python examples/trl_grpo.py --steps 5 --vocab 8192

A tiny Qwen2 is built from a config with random weights, a word-level tokenizer is made in code, the
prompts are a small in-memory dataset and the reward is a rule (the share of even-numbered words in
the completion). ``logitless.trl.enable(trainer)`` is the one line that moves the trainer's per-token
log-probs and entropies (policy, old and reference) onto logitless: no [tokens x vocab] logits.

Prints, per step, the loss, its KL part and the mean reward, then why the loss looks as it does. This is
on-policy GRPO (one update per batch), so the ratio is exactly 1 and the policy-gradient part of the loss
is minus the token-weighted mean advantage. Advantages are normalised to zero mean within each group, so
that part is 0 whenever a group's completions have the same length (here the untrained model never samples
EOS, so every completion is max_completion_length long). Its gradient is not 0: the model still learns. At
step 1 the policy also equals the reference model, so the KL part is 0 too and the loss is exactly 0; from
step 2 on the loss is beta * KL.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch

import logitless
import logitless.trl


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size of the tiny model")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_tokenizer(vocab_size: int):
    """Words "w0", "w1", ... after <pad>, <eos>, <unk> (ids 0, 1, 2), split on white space; left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for i in range(vocab_size - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def build_model(folder: str, vocab_size: int, seed: int) -> str:
    """A random tiny Qwen2 and its tokenizer, saved locally (TRL loads a reference model from the same folder)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = build_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reward_even_words(completions, **_):
    """The share of even-numbered words in each completion."""
    def share(text):
        words = [w for w in text.split() if w[1:].isdigit()]
        return sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)
    return [share(c) for c in completions]


def quiet_known_warnings():
    """TRL 1.16 calls transformers' gradient_checkpointing* names, which transformers 5 deprecates in favour of
    activation_checkpointing*: a FutureWarning about TRL's code, not this script's settings. And DeepSpeed's
    warning that it found no GPU, on a CPU."""
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                            category=FutureWarning)
    # DeepSpeed, where it is installed, is imported by accelerate and logs a WARNING when it finds no GPU;
    # naming the device it should use (its own DS_ACCELERATOR setting) is all it needs
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main():
    args = parse_args()
    quiet_known_warnings()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.disable_progress_bar()

    n_words = args.vocab - 3
    prompts = [" ".join(f"w{(7 * i + j) % n_words}" for j in range(2 + i % 3)) for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(os.path.join(tmp, "tiny-qwen2"), args.vocab, args.seed)
        config = GRPOConfig(output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=8, max_steps=args.steps, beta=0.04, temperature=0.9,
                            learning_rate=5e-3, use_cpu=True, bf16=False, logging_steps=1, report_to="none",
                            save_strategy="no", disable_tqdm=True, seed=args.seed)
        trainer = GRPOTrainer(model=folder, reward_funcs=reward_even_words, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=build_tokenizer(args.vocab))
        trainer.remove_callback(PrinterCallback)   # one line per step below instead of the raw log dicts

        logitless.trl.enable(trainer)          # the one line: per-token log-probs / entropies without logits

        trainer.train()
    for h in trainer.state.log_history:
        if "loss" in h and "reward" in h:
            print(f"step {h['step']}: loss={h['loss']:.6f} reward={h['reward']:.4f} kl={h.get('kl', 0.0):.6f} "
                  f"completion lengths {h['completions/min_length']:.0f}-{h['completions/max_length']:.0f}")
    print(f"logitless enabled: {logitless.trl.is_enabled(trainer)}, backend: {logitless.last_backend()}")
    print("Why the loss is 0 at step 1: on-policy GRPO has ratio 1, so its policy-gradient part is minus the\n"
          "token-weighted mean advantage, which is 0 because advantages have zero mean within each group and\n"
          "the completions have equal lengths; the gradient is not 0. The policy also equals the reference\n"
          f"model at step 1, so the KL part (beta={config.beta}) is 0 too. Later steps' loss is beta * kl.")


if __name__ == "__main__":
    main()
