"""One rank of the two-process Megatron checks (gloo, CPU): tensor parallelism 2 (with and without
sequence parallelism), then context parallelism 2. Spawned twice by test_megatron_tp2.py; runs
every case in one process (spawning is the slow part) and writes {case: [ok, message]} as JSON.

    python tp2_worker.py RANK WORLD INIT_FILE SEED OUT_JSON
"""
import json
import sys
import traceback

import tp2_distill_cases

LP_TOL = ENT_TOL = 2e-5
GRAD_TOL = 1e-4
TP = 2
CP = 2


def _case_names():
    names = []
    for sp in (False, True):
        for tied in (False, True):
            for temp in ("scalar", "per_seq", "per_token"):
                names.append(f"hook-{'sp' if sp else 'nosp'}-{'tied' if tied else 'untied'}-{temp}")
    names += ["hook-nosp-mtp", "legacy-nosp-untied", "legacy-sp-tied", "inference-no-grad",
              "labels-none-sp", "labels-none-legacy-nosp", "hybrid-nosp-untied", "hybrid-sp-tied",
              "hybrid-forward_padded-sp", "mtp-gpt-sp-tied", "mtp-gpt-nosp", "mtp-hybrid-nosp",
              "mtp-hybrid-sp-tied", "labels-none-hybrid-sp",
              "forward_padded-sp-thd", "forward_packed-nosp-thd", "forward_padded-sp-bshd"]
    names += tp2_distill_cases.CASES
    names += ["cp2-forward_packed-grads", "cp2-forward_padded-per_token", "cp2-forward_padded-legacy",
              "cp2-forward_padded-hybrid"]
    return names


CASES = _case_names()


def _temperature(torch, kind, b, s, gen):
    if kind == "scalar":
        return 0.75
    if kind == "per_seq":
        return 0.5 + torch.rand(b, generator=gen)
    return 0.5 + torch.rand(b, s, generator=gen)


def _compare(env, torch, model, temperature, gen, with_labels=False, b=3, s=10):
    """The shared fused-vs-unfused check; on top, the attention weights (before the gathered
    hidden states) must have received a gradient. Returns (record, fused grads, error summary)."""
    fused, rec, msg = env.compare_with_unfused(model, b, s, temperature, gen, with_labels=with_labels)
    qkv = fused["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv is not None and qkv.norm() > 0
    return rec, fused, msg


def run_cp_case(name, env, torch, seed):
    """Context parallelism 2 (TP 1): forward_* split each packed sequence zigzag over the two
    ranks and all-gather the results; compared with every sequence run alone, unpacked."""
    import torch.distributed as dist

    from logitless.megatron import forward_packed, forward_padded, fused_forward_mode, last_path, patch_fused_forward
    gen = torch.Generator().manual_seed(seed)
    kw = dict(packed_attention=True, seed=seed, context_parallel_size=CP)
    if name.endswith("legacy"):
        model = env.build_with_class(env.old_signature_gpt_class(), **kw)
        assert patch_fused_forward(model) == "legacy"
    elif name.endswith("hybrid"):
        model = env.build_hybrid(**kw)
    else:
        model = env.build_gpt(**kw)
    from logitless.megatron.forward import parallel_layout
    layout = parallel_layout(model)
    assert layout.cp_size == CP and layout.cp_rank == dist.get_rank() and layout.align == 2 * CP, layout
    if name == "cp2-forward_packed-grads":
        seqs = [torch.randint(0, model.vocab_size, (n,), generator=gen) for n in (9, 1, 14, 6)]
        temps = 0.6 + torch.rand(len(seqs), generator=gen)
        w = [(torch.randn(q.numel(), generator=gen), torch.randn(q.numel(), generator=gen)) for q in seqs]
        model.zero_grad(set_to_none=True)
        out = forward_packed(model, seqs, temperature=temps, strict=True)
        assert last_path().path in ("hook", "legacy") and last_path().entry == "forward_packed"
        sum((a * lp).sum() + (c * e).sum()
            for (a, c), lp, e in zip(w, out.logprobs, out.entropy, strict=True)).backward()
        fused = env.param_grads(model)
        for g in fused.values():            # Megatron sums gradients over the CP ranks (DDP over dp x cp)
            if g is not None:
                dist.all_reduce(g)
        model.zero_grad(set_to_none=True)
        ref_loss, worst = 0, 0.0
        for i, q in enumerate(seqs):
            lp, ent = env.per_sequence_reference(model, q, temps[i])
            worst = max(worst, float((out.logprobs[i].detach().double() - lp).abs().max()),
                        float((out.entropy[i].detach().double() - ent).abs().max()))
            ref_loss = ref_loss + (w[i][0] * lp).sum() + (w[i][1] * ent).sum()
        assert worst <= LP_TOL, worst
        ref_loss.backward()
        gworst = 0.0
        for n_, g in env.param_grads(model).items():
            if g is not None and g.norm() > 0:
                err = env.rel_err(fused[n_], g)
                assert err <= GRAD_TOL, (n_, err)
                gworst = max(gworst, err)
        return f"lp/ent {worst:.1e} grad {gworst:.1e}"
    ids, mask = env.ragged_batch(gen)
    b, s = ids.shape
    temps = 0.6 + torch.rand(b, s, generator=gen)
    with torch.no_grad():
        out = forward_padded(model, ids, mask, temperature=temps, strict=True)
        assert last_path().path == ("legacy" if name.endswith("legacy") else fused_forward_mode(model))
        worst = 0.0
        for i in range(b):
            lp, ent = env.per_sequence_reference(model, ids[i][mask[i]], temps[i][mask[i]][None, :-1])
            worst = max(worst, float((out.logprobs[i][mask[i]].double() - lp).abs().max()),
                        float((out.entropy[i][mask[i]].double() - ent).abs().max()))
    assert worst <= LP_TOL, worst
    return f"max err {worst:.1e}"


def run_case(name, env, torch, seed):
    from logitless.megatron import forward_packed, forward_padded, last_path
    if name.startswith("cp2"):
        return run_cp_case(name, env, torch, seed)
    if name.startswith("distill"):
        return tp2_distill_cases.run(name, env, torch, seed, TP)
    gen = torch.Generator().manual_seed(seed)
    parts = name.split("-")
    sp = "sp" in parts
    if parts[0] == "hook":
        tied = "tied" in parts
        mtp = "mtp" in parts
        model = env.build_gpt(tp=TP, sequence_parallel=sp, tied=tied, mtp=mtp, seed=seed)
        temp = 0.9 if mtp else _temperature(torch, parts[-1], 3, 10, gen)
        rec, grads, msg = _compare(env, torch, model, temp, gen, with_labels=mtp)
        assert rec.path == "hook" and rec.backend in ("chunked", "triton", "reference"), rec
        if mtp:
            mtp_grads = [g for n, g in grads.items() if n.startswith("mtp.")]
            assert mtp_grads and all(g is not None and g.norm() > 0 for g in mtp_grads)
        return msg
    if parts[0] == "legacy":
        model = env.build_with_class(env.old_signature_gpt_class(), tp=TP, sequence_parallel=sp,
                                     tied="tied" in parts, seed=seed)
        from logitless.megatron import patch_fused_forward
        assert patch_fused_forward(model) == "legacy"
        rec, _, msg = _compare(env, torch, model, 0.8, gen)
        assert rec.path == "legacy", rec
        return msg
    if parts[0] == "mtp":
        # fused MTP losses against megatron-core's own process_mtp_loss (test_megatron_mtp.py's check)
        from logitless.megatron import patch_fused_forward
        from test_megatron_mtp import build, check_grads, run
        model = build(env, parts[1] + ("-tied" if "tied" in parts else ""), seed, tp=TP, sequence_parallel=sp).train()
        patch_fused_forward(model)
        b, s = 2, 10
        ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
        loss_mask = (torch.rand(b, s, generator=gen) > 0.25).float()
        labels[0, 4], labels[1, 8] = -100, -100       # out of range with loss mask 1: megatron scores the lse
        loss_mask[0, 3], loss_mask[1, 7] = 1.0, 1.0
        w = (torch.randn(b, s, generator=gen),)
        mask = env.causal_mask(s)
        want, g_want, t_want, n_want = run(env, model, False, ids, pos, mask, labels, loss_mask, w)
        got, g_got, t_got, n_got = run(env, model, True, ids, pos, mask, labels, loss_mask, w)
        assert n_want == 3 and n_got == 1 and (got - want).abs().max() <= LP_TOL
        check_grads(env, g_got, g_want)
        assert torch.allclose(t_got["loss_values"], t_want["loss_values"], rtol=1e-5, atol=0)
        assert torch.equal(t_got["correct_values"], t_want["correct_values"])
        assert torch.equal(t_got["total_values"], t_want["total_values"])
        return f"mtp loss {t_got['loss_values'].tolist()}"
    if parts[0] == "hybrid":
        from logitless.megatron import patch_fused_forward
        if parts[1] == "forward_padded":           # THD packing through the hybrid model's legacy patch
            model = env.build_hybrid(tp=TP, sequence_parallel=sp, packed_attention=True, seed=seed)
            ids, mask = env.ragged_batch(gen)
            temps = 0.6 + torch.rand(ids.shape[0], generator=gen)
            out = forward_padded(model, ids, mask, temperature=temps, strict=True)
            assert last_path().path == "legacy" and last_path().entry == "forward_padded"
            worst = 0.0
            with torch.no_grad():
                for i in range(ids.shape[0]):
                    seq = ids[i][mask[i]]
                    padded = torch.cat([seq, seq.new_zeros((-seq.numel()) % TP)])
                    m = padded.numel()
                    logits = env.unfused_logits(model, padded[None], torch.arange(m)[None], env.causal_mask(m))
                    lp, ent = env.reference_from_logits(logits[:, :seq.numel() - 1], seq[None, 1:], temps[i])
                    e = max(float((out.logprobs[i][mask[i]][:-1].double() - lp[0]).abs().max()),
                            float((out.entropy[i][mask[i]][:-1].double() - ent[0]).abs().max()))
                    assert e <= LP_TOL, (i, e)
                    worst = max(worst, e)
            return f"max err {worst:.1e}"
        model = env.build_hybrid(tp=TP, sequence_parallel=sp, tied="tied" in parts, seed=seed)
        assert patch_fused_forward(model) == "legacy"
        rec, _, msg = _compare(env, torch, model, _temperature(torch, "per_token", 3, 10, gen), gen)
        assert rec.path == "legacy", rec
        return msg
    if parts[0] == "labels":
        # labels=None through the processor: the model's own (vocab-sharded) logits and gradients
        from logitless.megatron import fused_output_processor, patch_fused_forward
        cls = env.old_signature_gpt_class() if "legacy" in parts else None
        kw = dict(tp=TP, sequence_parallel=sp, tied=True, seed=seed)
        if "hybrid" in parts:                    # the HybridModel's legacy patch (output-layer call intercepted)
            model = env.build_hybrid(**kw)
        else:
            model = env.build_with_class(cls, **kw) if cls else env.build_gpt(**kw)
        patch_fused_forward(model)
        ids, pos, _ = env.random_batch(2, 8, model.vocab_size, gen)
        mask = env.causal_mask(8)
        outs = []
        for proc in (fused_output_processor, None):
            model.zero_grad(set_to_none=True)
            out = model(ids, pos, mask, **({"output_processor": proc} if proc else {}))
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
            (w * out).sum().backward()
            outs.append((out, env.param_grads(model)))
        (a, ga), (b, gb) = outs
        assert a.shape == (2, 8, model.vocab_size // TP) and torch.equal(a, b)
        assert all((g is None and ga[n] is None) or torch.equal(g, ga[n]) for n, g in gb.items())
        assert last_path().backend is None and "labels is None" in last_path().reason
        assert last_path().model == type(model).__name__, last_path()
        return "equal"
    if name == "inference-no-grad":
        from logitless.megatron import FusedOutputProcessorContext, fused_output_processor
        model = env.build_gpt(tp=TP, seed=seed).eval()
        ids, pos, labels = env.random_batch(2, 8, model.vocab_size, gen)
        mask = env.causal_mask(8)
        with torch.no_grad():
            out = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                        output_processor_context=FusedOutputProcessorContext(temperature=1.2))
            lp, ent = env.reference_from_logits(env.unfused_logits(model, ids, pos, mask), labels, 1.2)
        assert not out.logprobs.requires_grad
        assert float((out.logprobs - lp).abs().max()) <= LP_TOL and float((out.entropy - ent).abs().max()) <= ENT_TOL
        return "ok"
    # forward_padded / forward_packed against each sequence run alone through the unfused model
    model = env.build_gpt(tp=TP, sequence_parallel=sp, packed_attention=True, seed=seed)
    b, s = 3, 11
    ids = torch.randint(0, model.vocab_size, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, 7:] = False
    mask[1, :3] = False
    mask[2, 1:] = False
    mask[2, 0] = True
    temps = 0.6 + torch.rand(b, generator=gen)
    if parts[0] == "forward_padded":
        out = forward_padded(model, ids, mask, temperature=temps, packed=parts[-1] == "thd", strict=True)
        lps = [out.logprobs[i][mask[i]] for i in range(b)]
        ents = [out.entropy[i][mask[i]] for i in range(b)]
    else:
        out = forward_packed(model, [ids[i][mask[i]] for i in range(b)], temperature=temps, strict=True)
        lps, ents = out.logprobs, out.entropy
    rec = last_path()
    from logitless.megatron import fused_forward_mode
    assert rec.path == fused_forward_mode(model) != "unfused" and rec.entry == parts[0], rec
    worst = 0.0
    with torch.no_grad():
        for i in range(b):
            seq = ids[i][mask[i]]
            n = seq.numel()
            pad = (-n) % TP                        # sequence parallelism splits s over the TP ranks
            padded = torch.cat([seq, torch.zeros(pad, dtype=seq.dtype)])
            m = n + pad
            logits = env.unfused_logits(model, padded[None], torch.arange(m)[None], env.causal_mask(m))[0, :n]
            lp, ent = env.reference_from_logits(logits[None, :-1], seq[None, 1:], temps[i])
            assert float(lps[i][-1]) == 0.0 and float(ents[i][-1]) == 0.0
            e = max([0.0] + [float(x) for x in (lps[i][:-1].double() - lp[0]).abs()]
                    + [float(x) for x in (ents[i][:-1].double() - ent[0]).abs()])
            assert e <= LP_TOL, (i, e)
            worst = max(worst, e)
    return f"max err {worst:.1e}"


def main():
    rank, world, init_file, seed, out_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                              sys.argv[5])
    import torch

    import mcore_env as env
    env.init_cpu_megatron(rank=rank, world_size=world, tp=TP, init_file=init_file)
    only = sys.argv[6].split(",") if len(sys.argv) > 6 else CASES
    env_is_cp = [False]
    results = {}
    for i, name in enumerate(only):
        if name.startswith("cp2") and not env_is_cp[0]:
            from megatron.core import parallel_state, tensor_parallel
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(1, 1, context_parallel_size=CP)
            tensor_parallel.model_parallel_cuda_manual_seed(123, inference_rng_tracker=True)
            env_is_cp[0] = True
        try:
            results[name] = [True, run_case(name, env, torch, seed + i)]
        except Exception:                           # noqa: BLE001 - reported to the test, per case
            results[name] = [False, traceback.format_exc(limit=6)]
        with open(out_path, "w") as f:
            json.dump(results, f)
    env.teardown_cpu_megatron()


if __name__ == "__main__":
    main()
