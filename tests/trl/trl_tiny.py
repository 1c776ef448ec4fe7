"""A real trl.GRPOTrainer on CPU with nothing from the Hub: a tiny Qwen2 built from a config (saved to
a local folder, so TRL can load the reference model from it too), a word-level tokenizer made in
code, a small in-memory prompt dataset and a rule-based reward."""
from __future__ import annotations

import copy
import os

import torch

N_WORDS = 509            # vocabulary: 3 special tokens + these words


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for i in range(N_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def save_tiny_qwen2(folder: str, seed: int, hidden_size: int = 32, layers: int = 2) -> str:
    """A random tiny Qwen2 and its tokenizer, saved to ``folder`` (returned)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)      # spread the logits: log-probs and entropies vary per token
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompts(n: int = 8):
    return [" ".join(f"w{(7 * i + j) % N_WORDS}" for j in range(2 + i % 3)) for i in range(n)]


def reward_even_words(completions, **_):
    """Rule-based reward: the share of even-numbered words in the completion (0 for an empty one)."""
    def share(text):
        words = [w for w in text.split() if w[1:].isdigit()]
        return sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)
    return [share(c) for c in completions]


def trainer_state(trainer) -> dict:
    """Copies of the trainer's state a loss call may change (the adaptive entropy controller's), to restore
    between TRL's own call and the fused one."""
    return {k: copy.deepcopy(getattr(trainer, k)) for k in ("entropy_coef", "_last_world_entropy",
                                                            "_entropy_window_stats")}


def grpo_trainer(folder: str, out_dir: str, seed: int = 0, **overrides):
    """A GRPOTrainer on the saved tiny model: 4 prompts x 4 generations per step, completions of at
    most 8 tokens, float32 on CPU. ``overrides`` go to GRPOConfig."""
    from datasets import Dataset

    from trl import GRPOConfig, GRPOTrainer
    kw = dict(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
              max_steps=3, use_cpu=True, logging_steps=1, report_to="none", learning_rate=5e-3,
              save_strategy="no", temperature=0.9, seed=seed, bf16=False, disable_tqdm=True)
    kw.update(overrides)
    args = GRPOConfig(**kw)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return GRPOTrainer(model=folder, reward_funcs=reward_even_words, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts()}), processing_class=tokenizer())


def distillation_trainer(student: str, teacher: str, out_dir: str, seed: int = 0, **overrides):
    """A DistillationTrainer: the saved tiny ``student`` (its folder) trained toward the saved ``teacher`` (a folder
    too; same vocabulary, other width), 8 prompts a step, completions of at most 8 tokens sampled from the student,
    float32 on CPU. ``overrides`` go to DistillationConfig."""
    from datasets import Dataset

    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer
    kw = dict(output_dir=out_dir, per_device_train_batch_size=8, max_completion_length=8, max_steps=3, use_cpu=True,
              logging_steps=1, report_to="none", learning_rate=5e-3, save_strategy="no", temperature=0.9, seed=seed,
              bf16=False, disable_tqdm=True)
    kw.update(overrides)
    args = DistillationConfig(**kw)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return DistillationTrainer(model=AutoModelForCausalLM.from_pretrained(student),
                               teacher_model=AutoModelForCausalLM.from_pretrained(teacher), args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts()}), processing_class=tokenizer())


# a chat template for the word-level tokenizer: each message's words, space-separated (GKD's and GOLD's collator
# splits prompt and completion with it)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def conversations(n: int = 8):
    """n prompt / answer conversations of the tiny vocabulary's words, answers of 3 to 6 words."""
    return [[{"role": "user", "content": p},
             {"role": "assistant", "content": " ".join(f"w{(11 * i + 5 * j + 3) % N_WORDS}" for j in range(3 + i % 4))}]
            for i, p in enumerate(prompts(n))]


def experimental_distillation_trainer(kind: str, student: str, teacher: str, out_dir: str, seed: int = 0,
                                      **overrides):
    """A GKDTrainer (kind "gkd") or GOLDTrainer ("gold") of trl.experimental on the saved tiny ``student`` and
    ``teacher`` folders, 8 conversations a step, completions of at most 6 sampled tokens, float32 on CPU.
    ``overrides`` go to GKDConfig / GOLDConfig."""
    from datasets import Dataset

    from transformers import AutoModelForCausalLM
    tok = tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    kw = dict(output_dir=out_dir, per_device_train_batch_size=8, use_cpu=True, logging_steps=1, report_to="none",
              learning_rate=5e-3, save_strategy="no", seed=seed, bf16=False, disable_tqdm=True, max_length=64)
    if kind == "gkd":
        from trl.experimental.gkd import GKDConfig as Config
        from trl.experimental.gkd import GKDTrainer as Trainer
        kw.update(max_new_tokens=6)
    else:
        from trl.experimental.gold import GOLDConfig as Config
        from trl.experimental.gold import GOLDTrainer as Trainer
        # the byte offsets of extended ULD need a byte-level BPE tokenizer; without ULD they are not read
        kw.update(max_completion_length=6, use_extended_uld=False)
    kw.update(overrides)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Trainer(model=AutoModelForCausalLM.from_pretrained(student),
                   teacher_model=AutoModelForCausalLM.from_pretrained(teacher), args=Config(**kw),
                   train_dataset=Dataset.from_dict({"messages": conversations()}), processing_class=tok)


def save_tiny(folder: str, model_type: str, seed: int, hidden_size: int = 32, **config) -> str:
    """A random tiny causal LM of ``model_type`` on the tokenizer's vocabulary (``config`` overrides its config),
    saved with the tokenizer to ``folder`` (returned)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tok = tokenizer()
    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=64,
              pad_token_id=0, eos_token_id=1, bos_token_id=1)
    kw.update(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)      # spread the logits
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def assert_enable_refuses(trainer, match: str, **attrs) -> None:
    """logitless.trl.enable(trainer) with ``attrs`` set on it is a ValueError matching ``match`` and leaves it
    not enabled; the attributes are put back after."""
    import pytest

    import logitless.trl as lt
    saved = {k: getattr(trainer, k) for k in attrs}
    for k, v in attrs.items():
        setattr(trainer, k, v)
    try:
        with pytest.raises(ValueError, match=match):
            lt.enable(trainer)
        assert not lt.is_enabled(trainer)
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)


def assert_step_record(since: int, entry: str) -> None:
    """The enabled trainer's step left its record (``logitless.record.last_path()``), written after ``since``
    (``logitless.record.serial_now()`` before the step): path "fused", ``entry``, the backend and precision of the
    op it ran (after a TRL distillation run the record was None)."""
    from logitless.record import last_path
    rec = last_path()
    assert rec is not None and rec.serial > since, rec
    assert (rec.path, rec.entry) == ("fused", entry), rec
    assert rec.backend in ("chunked", "triton") and rec.precision is not None, rec


def theirs_and_ours(trainer, call, method: str):
    """(call(trainer) with the trainer class's own loss, call(trainer) with logitless' on the same trainer):
    logitless.trl.disable / enable around each, ``method`` the loss method enable() replaces on the instance."""
    import logitless.trl as lt
    lt.disable(trainer)
    assert not lt.is_enabled(trainer)
    theirs = call(trainer)
    lt.enable(trainer)
    assert lt.is_enabled(trainer) and method in trainer.__dict__
    ours = call(trainer)
    lt.disable(trainer)
    return theirs, ours
