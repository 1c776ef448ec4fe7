"""Peak memory of GRPOTrainer's log-prob step, in a fresh process: ``python trl_memory_child.py trl``
(TRL's own computation) or ``... logitless`` (logitless.trl enabled). One forward + backward of the
per-token log-probs and entropies of 16 sequences (8 prompt + 40 completion tokens, left / right
padded) through a tiny Qwen2 with a 32768-token vocabulary. Prints
``extra_bytes=<peak RSS during the step - RSS before - gradient buffers> max_logp_diff=<vs TRL>``."""
import os
import re
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trl_tiny  # noqa: E402

VOCAB_WORDS = 32765          # + 3 special tokens = 32768


def status_kib(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def main():
    mode = sys.argv[1]
    assert mode in ("trl", "logitless"), mode
    trl_tiny.N_WORDS = VOCAB_WORDS
    import logitless.trl as lt
    with tempfile.TemporaryDirectory() as tmp:
        folder = trl_tiny.save_tiny_qwen2(os.path.join(tmp, "m"), seed=0)
        trainer = trl_tiny.grpo_trainer(folder, os.path.join(tmp, "out"), temperature=0.8)
    if mode == "logitless":
        lt.enable(trainer)
    gen = torch.Generator().manual_seed(0)
    b, p, c = 16, 8, 40
    ids = torch.randint(3, VOCAB_WORDS, (b, p + c), generator=gen)
    mask = torch.ones(b, p + c, dtype=torch.long)
    for i in range(b):
        mask[i, : i % 4] = 0                      # left-padded prompts
        mask[i, p + c - (i % 7):] = 0             # right-padded completions
    model = trainer.model
    step = trainer._get_per_token_logps_and_entropies
    # warm up allocator, thread pools and kernels on a small slice
    lp, ent, _ = step(model, ids[:2, :12], mask[:2, :12], 4, compute_entropy=True)
    (lp.sum() + ent.sum()).backward()
    model.zero_grad(set_to_none=False)
    before = status_kib("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")           # reset VmHWM to the current RSS
    lp, ent, _ = step(model, ids, mask, c, compute_entropy=True)
    (lp.sum() + 0.1 * ent.sum()).backward()
    peak = status_kib("VmHWM") * 1024
    with torch.no_grad():
        from trl import GRPOTrainer
        ref = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c)[0]
    print(f"extra_bytes={peak - before} max_logp_diff={float((lp.detach() - ref).abs().max()):.3e}")


if __name__ == "__main__":
    main()
