"""The distillation target's cases of the two-rank TP 2 check (tp2_worker.py): the processor's
``fused_distillation_loss``, vocab-parallel over the two ranks, with and without sequence parallelism, against
float64 from the model's gathered logits; each rank's own parameter gradients (its shards) compared."""

CASES = ["distill-topk-nosp-untied", "distill-topk-sp-tied", "distill-tail-sp-untied", "distill-head-nosp-tied",
         "distill-head-sp-untied"]
GRAD_TOL = 1e-4
TAIL_GRAD_TOL = 5e-4      # test_megatron_distillation.py's TAIL_GRAD_TOL: the tail term's measured error


def run(name, env, torch, seed, tp):
    from distill64 import divergence64, weights64
    from logitless.losses import DistillationOutput
    from logitless.megatron import DistillationTarget, FusedOutputProcessorContext, fused_output_processor, last_path
    from test_megatron_distillation import K, between, topk64
    gen = torch.Generator().manual_seed(seed)
    parts = name.split("-")
    sp, tied = "sp" in parts, "tied" in parts
    model = env.build_gpt(tp=tp, sequence_parallel=sp, tied=tied, seed=seed)
    b, s = 3, 10
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    labels[:, :3] = -100
    labels[2, 7:] = -100
    mask = env.causal_mask(s)
    valid = labels != -100
    temperature = 1.3 if parts[1] != "head" else 2.5     # see test_megatron_distillation.py's head test
    with torch.no_grad():
        logits = env.unfused_logits(model, ids, pos, mask).double()
    if parts[1] in ("topk", "tail"):
        kind = "forward_kl_topk" if parts[1] == "topk" else "forward_kl_topk_tail"
        noise = 6.0 * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
        t_lp, t_ids = torch.log_softmax(0.5 * logits + noise, -1).topk(K, dim=-1)
        t_lp = t_lp.float()
        ls = torch.log_softmax(logits / temperature, -1)
        clamp = between(torch.cat([ls.gather(-1, t_ids)[valid].flatten(), t_lp.double()[valid].flatten()]), 0.3)
        target = DistillationTarget(kind, teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp,
                                    log_prob_min_clamp=clamp)

        def reference():
            ls = torch.log_softmax(env.unfused_logits(model, ids, pos, mask).double() / temperature, -1)
            return torch.where(valid, topk64(ls, t_lp, t_ids, kind, clamp, None), 0.0)
        tol = GRAD_TOL if kind == "forward_kl_topk" else TAIL_GRAD_TOL
    else:
        teacher = env.build_gpt(tp=tp, sequence_parallel=sp, seed=seed + 1, hidden=40)
        with torch.no_grad():
            t_hidden = teacher(ids, pos, mask, labels=None, output_processor=fused_output_processor,
                               output_processor_context=FusedOutputProcessorContext(without_labels="hidden_states"))
            lt = torch.log_softmax(env.unfused_logits(teacher, ids, pos, mask).double() / temperature, -1)
        assert t_hidden.shape == ((s // tp) if sp else s, b, 40), tuple(t_hidden.shape)
        target = DistillationTarget("jsd", teacher_hidden=t_hidden, teacher_weight=teacher.output_layer.weight,
                                    beta=0.4)

        def reference():
            ls = torch.log_softmax(env.unfused_logits(model, ids, pos, mask).double() / temperature, -1)
            return torch.where(valid, divergence64(ls, lt, "jsd", 0.4), 0.0)
        tol = GRAD_TOL
    model.zero_grad(set_to_none=True)
    ctx = FusedOutputProcessorContext(temperature=temperature, distillation=target)
    out = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor, output_processor_context=ctx)
    assert isinstance(out, DistillationOutput) and last_path().path == "hook"
    out.loss.backward()
    fused = env.param_grads(model)
    model.zero_grad(set_to_none=True)
    d = reference()
    loss64 = (weights64(valid, "token-mean") * d).sum()
    loss64.backward()
    want = env.param_grads(model)
    assert abs(out.loss.item() - loss64.item()) <= 1e-5 * max(1.0, abs(loss64.item())), (out.loss.item(), loss64.item())
    assert float(((out.divergence.double() - d.detach()).abs() / d.detach().abs().clamp_min(1.0)).max()) <= 2e-5
    worst, moved = 0.0, 0
    for n, g in want.items():
        assert (g is None) == (fused[n] is None), n
        if g is not None and g.norm() > 0:
            moved += 1
            e = env.rel_err(fused[n], g)
            assert e <= tol, (n, e)
            worst = max(worst, e)
    assert moved >= 4
    return f"loss {out.loss.item():.4f}, worst grad rel err {worst:.1e}"
