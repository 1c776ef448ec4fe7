"""``enable(trainer, truncation=True)``: GRPOTrainer's log-probs (current, old, reference) and its fused loss
computed under the truncation its rollout sampled with, read from the trainer's own settings (GRPOConfig's top_k /
top_p / min_p, ``generation_kwargs`` overriding them as TRL lets them), so that the importance ratio against the
sampler's log-probs carries no log(kept mass) bias.

TRL's conventions mapped: top_k 0 (TRL's default) or None is off, as -1 is in vLLM; top_p 1.0 or None is off; min_p
None (TRL's default) or 0.0 is off. Refused by name (ValueError): nothing truncated; a sampling setting that changes
the distribution and that logitless does not reproduce (repetition_penalty != 1, a temperature override other than
the trainer's, any ``generation_kwargs`` key outside the neutral ones below); on the transformers-generate path
top_p < 1 with min_p > 0 (transformers applies min_p after top_p, vLLM before: logitless follows vLLM)."""
from __future__ import annotations

import json
from numbers import Real

from ..truncation import Truncation
from .names import STATE

# generation_kwargs keys that do not change the distribution a token is sampled from (lengths, stopping, ids,
# output format, caching, seeding); any other key is refused rather than ignored
NEUTRAL_KEYS = frozenset({
    "max_tokens", "max_new_tokens", "n", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "logprobs", "output_kind",
    "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "use_cache", "disable_compile",
    "return_dict_in_generate", "output_scores", "output_logits",
})
# the keys whose values are read (they override the trainer's settings, as TRL merges them)
READ_KEYS = ("top_k", "top_p", "min_p", "repetition_penalty", "temperature", "do_sample")


def _generation_kwargs(trainer) -> dict:
    given = getattr(trainer.args, "generation_kwargs", None)
    if given is None:
        return {}
    if isinstance(given, str):
        given = json.loads(given)
    if not isinstance(given, dict):
        raise ValueError(f"generation_kwargs={given!r}: logitless.trl reads a dict")
    return dict(given)


def _number(value, name: str):
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}={value!r}: logitless.trl's truncation reads a number here")
    return value


def rollout_truncation(trainer) -> Truncation:
    """The ``Truncation`` of ``trainer``'s rollout sampler (a GRPOTrainer), or ValueError naming the setting that
    logitless cannot reproduce."""
    kwargs = _generation_kwargs(trainer)
    unknown = sorted(k for k in kwargs if k not in NEUTRAL_KEYS and k not in READ_KEYS)
    if unknown:
        raise ValueError(f"truncation=True: generation_kwargs[{unknown[0]!r}] may change the distribution the "
                         f"rollout samples from, which logitless does not reproduce (it reads {', '.join(READ_KEYS)} "
                         f"and takes {', '.join(sorted(NEUTRAL_KEYS))} as neutral)")
    top_k = kwargs.get("top_k", trainer.top_k)
    top_p = kwargs.get("top_p", trainer.top_p)
    min_p = kwargs.get("min_p", trainer.min_p)
    penalty = kwargs.get("repetition_penalty", getattr(trainer, "repetition_penalty", 1.0))
    if penalty is not None and _number(penalty, "repetition_penalty") != 1.0:
        raise ValueError(f"truncation=True: repetition_penalty={penalty} changes each token's distribution by the "
                         "text before it, which logitless does not reproduce; set repetition_penalty=1.0")
    temperature = kwargs.get("temperature", trainer.temperature)
    if _number(temperature, "temperature") != trainer.temperature:
        raise ValueError(f"truncation=True: generation_kwargs['temperature']={temperature} samples at another "
                         f"temperature than the trainer scores at ({trainer.temperature})")
    if kwargs.get("do_sample", True) is not True:
        raise ValueError(f"truncation=True: generation_kwargs['do_sample']={kwargs['do_sample']!r} (greedy decoding "
                         "samples no truncated distribution)")
    if top_k is not None and _number(top_k, "top_k") in (0, -1):
        top_k = None                           # TRL's 0 and vLLM's -1: off
    elif top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ValueError(f"truncation=True: top_k={top_k} (TRL's 0 is off, else an int >= 1)")
    if top_p is not None and _number(top_p, "top_p") == 1.0:
        top_p = None
    if min_p is not None and _number(min_p, "min_p") == 0.0:
        min_p = None                           # TRL's None and vLLM's 0.0: off
    if top_k is None and top_p is None and min_p is None:
        raise ValueError("truncation=True, but the rollout's sampler truncates nothing (top_k 0, top_p 1.0, min_p "
                         "None in GRPOConfig and generation_kwargs): leave truncation False")
    if not trainer.use_vllm and top_p is not None and min_p is not None:
        raise ValueError(f"truncation=True: top_p={top_p} with min_p={min_p} on the transformers-generate path: "
                         "transformers applies min_p after top_p, vLLM (whose order logitless reproduces) before; "
                         "use one of them, or vLLM")
    return Truncation(top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
                      min_p=None if min_p is None else float(min_p)).check()


def rollout_truncation_of(trainer):
    """The Truncation that ``enable(trainer, truncation=True)`` read from the trainer, else None."""
    return trainer.__dict__.get(STATE, {}).get("truncation")
