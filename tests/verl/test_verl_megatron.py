"""verl's Megatron forward helpers (verl.models.mcore.model_forward_fused) on a real GPTModel
(megatron-core 0.19, hook mode) with logitless installed, against verl's own unfused path
(model_forward_gen / gptmodel_forward_model_engine with verl's vocab-parallel log-prob and entropy
functions) on the same weights and batch: values and every parameter gradient."""
import pytest
import torch

import logitless.verl as lv
from logitless.megatron import last_path
from required import import_or_skip


@pytest.fixture(scope="module")
def env():
    # checked here rather than at import, so a run that deselects these tests does not report them as skipped
    import_or_skip("megatron.core", "make setup installs megatron-core")
    import_or_skip("verl.models.mcore.model_forward_fused", "make setup installs verl (--no-deps) and its import deps")
    import verl_mcore

    import mcore_env
    mcore_env.init_cpu_megatron()
    yield verl_mcore
    lv.uninstall()
    mcore_env.teardown_cpu_megatron()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gen_forward_hook_matches_verl_unfused(env, seed, tied):
    from verl.models.mcore.model_forward_fused import patch_fused_forward
    gen = torch.Generator().manual_seed(seed)
    model = env.build_rope_gpt(seed, tied=tied)
    patch_fused_forward(model)                      # what verl's engine does when it builds the model
    assert model._verl_fused_forward_mode == "hook" and "forward" not in model.__dict__
    ids, mask, labels, pos = env.padded_batch(gen)
    lv.install()
    record = env.compare(model, model, lambda m, fused: env.run_gen(m, ids, mask, labels, pos, 0.7, fused), gen)
    assert record.path == "hook" and record.entry == "verl" and record.backend in ("chunked", "triton")
    assert record.model == "GPTModel", record


def test_engine_forward_hook_matches_verl_unfused(env, seed):
    gen = torch.Generator().manual_seed(seed)
    model = env.build_rope_gpt(seed)
    from verl.models.mcore.model_forward_fused import patch_fused_forward
    patch_fused_forward(model)
    ids = env.nested_batch(gen)
    lv.install()
    record = env.compare(model, model, lambda m, fused: env.run_engine(m, ids, 1.3, fused), gen)
    assert record.path == "hook" and record.entry == "verl"


def test_installed_after_verl_built_the_model(env, seed):
    """install() after verl patched the model still routes the next call through logitless;
    uninstall() puts verl's kernel back (which cannot run on CPU)."""
    import verl.models.mcore.model_forward_fused as mff
    from verl.models.mcore.model_forward_fused import patch_fused_forward
    lv.uninstall()
    verl_kernel = mff.linear_cross_entropy
    gen = torch.Generator().manual_seed(seed)
    model = env.build_rope_gpt(seed)
    patch_fused_forward(model)
    ids, mask, labels, pos = env.padded_batch(gen)
    lv.install()
    before = last_path()
    with torch.no_grad():
        env.run_gen(model, ids, mask, labels, pos, 1.0, True)
    assert last_path() is not before and last_path().path == "hook" and last_path().model == "GPTModel"
    lv.uninstall()
    assert mff.linear_cross_entropy is verl_kernel
    with pytest.raises((AssertionError, RuntimeError)), torch.no_grad():   # CUDA-only kernel
        env.run_gen(model, ids, mask, labels, pos, 1.0, True)


def test_tensor_parallel_two_ranks_with_and_without_sequence_parallelism(env):
    """TP=2 over two gloo processes: verl's fused forward on logitless against its unfused forward,
    values and every rank's parameter gradients, with and without sequence parallelism (verl gathers
    the hidden states itself under SP; without SP the full d_hidden must reach the decoder)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    with tempfile.TemporaryDirectory() as tmp:
        init, outs = os.path.join(tmp, "gloo_init"), [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, os.path.join(here, "verl_tp2_worker.py"), str(r), "2", init,
                                   str(seed), outs[r]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        try:
            logs = [p.communicate(timeout=420)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, p in enumerate(procs):
            assert p.returncode == 0 and os.path.exists(outs[r]), f"rank {r}:\n{logs[r][-3000:]}"
        results = [json.load(open(o)) for o in outs]
    for rank, res in enumerate(results):
        for case, (ok, msg) in res.items():
            assert ok, f"{case} rank {rank}: {msg}"
        assert set(res) == {"tp2-nosp", "tp2-sp"}


def test_1f1b_overlap_forward_runs_on_the_schedule_plan(env, seed):
    """verl's combined-1F1B forward (gptmodel_forward_1f1b_overlap) on logitless: a schedule plan with
    logitless' processor, log-probs and entropy (verl's own returns log-probs only), run here without
    overlap on CPU; against verl's fused generation forward (hook mode, logitless) and verl's unfused one
    (its vocab-parallel log-probs and entropy on the model's logits) on the same batch: values and every
    parameter gradient (verl's own overlapped function cannot run on megatron-core 0.19: the plan's
    post-process node passes output_processor to verl's _postprocess replacement, which refuses it).
    megatron-core's plan skips a dense decoder's final layernorm,
    so the model has none (then the plan and the forward compute the same hidden states)."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    from verl.models.mcore import model_forward_1f1b_overlap as overlap

    import mcore_env
    lv.install()
    gen = torch.Generator().manual_seed(seed)
    model = env.build_rope_gpt(seed)
    model.decoder.final_layernorm = None
    ids, mask, labels, pos = env.padded_batch(gen)
    a, c = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)
    model.zero_grad(set_to_none=True)
    with mcore_env.cpu_streams():
        plan = overlap.gptmodel_forward_1f1b_overlap(model, ids, pos, mask, labels=labels, labels_mask=mask,
                                                     temperature=0.8)
        lp, ent = Plan.run(plan, None)
        record = last_path()
        Plan.run(None, plan, b_grad=(a, c))
    got = env.grads(model)
    assert record.path == "schedule-plan" and record.model == "GPTModel", record
    for fused in (True, False):     # verl's fused generation forward (logitless' head) and its unfused one
        from verl.models.mcore.model_forward_fused import patch_fused_forward
        patch_fused_forward(model)                          # verl's mode resolution (hook here)
        model.zero_grad(set_to_none=True)
        want = env.run_gen(model, ids, mask, labels, pos, 0.8, fused)
        m = mask.float()                                    # (the unfused entropy is not zeroed at pads)
        ((a * want["log_probs"] * m).sum() + (c * want["entropy"] * m).sum()).backward()
        assert torch.allclose(lp, want["log_probs"] * m, atol=1e-5, rtol=0)
        assert torch.allclose(ent, want["entropy"] * m, atol=1e-5, rtol=0) and lp[mask].abs().sum() > 0
        for name, g in env.grads(model).items():
            assert float((got[name] - g).norm() / g.norm().clamp_min(1e-30)) <= 1e-4, (fused, name)
    with pytest.raises(AssertionError, match="only support fused kernel"):   # verl's own function, unchanged
        overlap.gptmodel_forward_1f1b_overlap(model, ids, pos, mask, labels=labels, labels_mask=mask,
                                              logits_processor=env.verl_logits_processor)
    with pytest.raises(ValueError, match="labels is None"):       # verl's own would fail in the plan's node
        overlap.gptmodel_forward_1f1b_overlap(model, ids, pos, mask, labels=None, labels_mask=mask)
