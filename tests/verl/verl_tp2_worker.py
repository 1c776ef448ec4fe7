"""One rank of the two-process verl check (gloo, CPU, tensor parallelism 2): verl's fused
generation forward with logitless installed against verl's unfused forward, without and with
sequence parallelism, hook mode. Writes {case: [ok, message]} as JSON.

    python verl_tp2_worker.py RANK WORLD INIT_FILE SEED OUT_JSON
"""
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "megatron"), os.path.dirname(HERE)]   # tests/: ranks.py

CASES = ("tp2-nosp", "tp2-sp")


def main():
    rank, world, init_file, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    import torch

    import mcore_env
    torch.set_num_threads(1)
    mcore_env.init_cpu_megatron(rank=rank, world_size=world, tp=2, init_file=init_file)
    import verl_mcore
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    import logitless.verl as lv
    results = {}
    for case in CASES:
        try:
            gen = torch.Generator().manual_seed(seed)          # the same batch on both ranks
            model = verl_mcore.build_rope_gpt(seed, tp=2, sequence_parallel=case.endswith("-sp"))
            patch_fused_forward(model)
            batch = verl_mcore.padded_batch(gen, b=3, s=12)
            lv.install()
            rec = verl_mcore.compare(model, model, lambda m, f, b=batch: verl_mcore.run_gen(m, *b, 0.8, f), gen)
            assert rec.path == "hook" and rec.entry == "verl", rec
            results[case] = [True, ""]
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[case] = [False, traceback.format_exc()[-3000:]]
        finally:
            lv.uninstall()
    with open(out, "w") as f:
        json.dump(results, f)
    mcore_env.teardown_cpu_megatron()


if __name__ == "__main__":
    main()
