"""Test set-up for a real megatron-core GPTModel on CPU (gloo), shared by the in-process tests,
the spawned TP=2 workers and the legacy-release suite.

The two CPU workarounds live here, never in library code:
1. ``model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)``: the plain call asserts CUDA.
2. ``torch.cuda.current_device = lambda: "cpu"``: megatron-core allocates attention buffers and
   collective outputs on the "current CUDA device".
Plus a test-only core attention that runs packed (THD) sequences on CPU: Megatron's own
DotProductAttention applied to each packed sequence with a causal mask (TE is GPU-only).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from ranks import close_group  # noqa: E402

_saved_current_device = None

# the instance attribute the legacy patch keeps the original forward in (its absence after unpatch is checked)
BACKUP = "_logitless_forward_backup"


class Wrapper(torch.nn.Module):
    """A DDP/FSDP-style wrapper: holds the model as ``.module`` and forwards everything."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class CudaOnCpu(TorchFunctionMode):
    """megatron-core's hard-coded CUDA tensors on the CPU: factory calls with a CUDA device (or an index) get
    device "cpu", ``Tensor.cuda()`` returns the tensor, and ``Tensor.type()`` names CPU tensors as CUDA ones
    (the optimizer's clipping asserts 'torch.cuda.FloatTensor'; the pipeline schedules of megatron-core 0.19
    count tokens in ``torch.zeros([], device="cuda")``)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        dev = kwargs.get("device")
        if (dev == "cuda" or (isinstance(dev, torch.device) and dev.type == "cuda")
                or (isinstance(dev, int) and not isinstance(dev, bool))):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def init_cpu_megatron(rank: int = 0, world_size: int = 1, tp: int = 1, init_file: str | None = None,
                      seed: int = 123, cp: int = 1, pp: int = 1, vpp: int | None = None) -> None:
    """gloo process group + megatron model-parallel state on CPU (pp pipeline stages, vpp virtual ones)."""
    global _saved_current_device
    from megatron.core import parallel_state, tensor_parallel
    if not dist.is_initialized():
        if init_file is None:
            import tempfile
            init_file = tempfile.mktemp(prefix="logitless_gloo_")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    if _saved_current_device is None:
        _saved_current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp,
                                             context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


@contextlib.contextmanager
def megatron_on_gpu():
    """One NCCL process group (world 1) on GPU 0 and megatron's model-parallel state, for the GPU tests."""
    import tempfile

    from megatron.core import parallel_state, tensor_parallel
    init = tempfile.mktemp(prefix="logitless_nccl_")
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if os.path.exists(init):
            os.remove(init)


def teardown_cpu_megatron() -> None:
    global _saved_current_device
    from megatron.core import parallel_state
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()   # every rank done before any group is torn down (see tests/ranks.py)
    parallel_state.destroy_model_parallel()
    close_group()
    if _saved_current_device is not None:
        torch.cuda.current_device = _saved_current_device
        _saved_current_device = None


def packed_attention_class():
    """Megatron's DotProductAttention, extended to packed (THD) input by running each packed
    sequence on its own with the usual causal mask: the same arithmetic as the [s, b] path."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kw):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, **kw)
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu = cu.tolist()
            outs = []
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                n = b - a
                mask = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)
                outs.append(super().forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1),
                                            value[a:b].unsqueeze(1), mask, attn_mask_type=attn_mask_type))
            return torch.cat(outs, dim=0)

    return PackedDotProductAttention


def _zigzag_positions(cu, cp, rank):
    """Global packed positions held by CP rank ``rank`` (chunks rank and 2cp-1-rank of each
    sequence); written out here independently of logitless' own packing code."""
    out = []
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        c = (b - a) // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            out += range(a + k * c, a + (k + 1) * c)
    return torch.tensor(out, dtype=torch.long)


def context_parallel_attention_class():
    """Core attention for packed sequences under context parallelism on CPU (test-only; TE's
    ring attention is GPU-only): all-gathers K and V over the CP group (differentiably), puts them
    back in global order, and lets each local query attend causally within its own sequence.
    Unpacked input runs Megatron's DotProductAttention unchanged."""
    import torch.distributed.nn.functional as dist_fn
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelPackedAttention(DotProductAttention):
        def __init__(self, config, *args, **kwargs):
            cp = config.context_parallel_size
            config.context_parallel_size = 1        # DotProductAttention refuses CP at construction
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                config.context_parallel_size = cp

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kw):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, **kw)
            group = packed_seq_params.cp_group or parallel_state.get_context_parallel_group()
            cp, rank = dist.get_world_size(group), dist.get_rank(group)
            cu = packed_seq_params.cu_seqlens_q_padded.tolist()
            total = cu[-1]
            held = [_zigzag_positions(cu, cp, r) for r in range(cp)]
            order = torch.cat(held)
            keys = torch.empty_like(torch.cat([key] * cp))
            vals = torch.empty_like(keys)
            keys = keys.index_copy(0, order, torch.cat(dist_fn.all_gather(key.contiguous(), group=group)))
            vals = vals.index_copy(0, order, torch.cat(dist_fn.all_gather(value.contiguous(), group=group)))
            if keys.shape[1] != query.shape[1]:          # grouped-query attention: each K/V head serves a group
                keys = keys.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
                vals = vals.repeat_interleave(query.shape[1] // vals.shape[1], dim=1)
            seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
            qpos = held[rank]
            kpos = torch.arange(total)
            allowed = (seq_of[qpos][:, None] == seq_of[kpos][None, :]) & (kpos[None, :] <= qpos[:, None])
            scores = torch.einsum("qhd,khd->hqk", query, keys) * self.softmax_scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
            out = torch.einsum("hqk,khd->qhd", probs, vals)
            return out.reshape(out.shape[0], 1, -1)

    return ContextParallelPackedAttention


class SequenceParallelTorchNorm:
    """torch LayerNorm for sequence-parallel test models. Megatron's WrappedTorchNorm refuses
    sequence_parallel=True (its fused norms are GPU-only); this builds the same torch LayerNorm and
    tags its parameters ``sequence_parallel`` as Megatron's own norms do (test-side only)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def build_gpt(*, vocab: int = 262, hidden: int = 48, heads: int = 4, layers: int = 2, max_seq: int = 64,
              tied: bool = False, mtp: bool = False, tp: int = 1, sequence_parallel: bool = False,
              packed_attention: bool = False, post_process: bool = True, seed: int = 0, moe_experts: int = 0,
              moe_dispatcher: str = "alltoall", pre_process: bool = True, vp_stage: int | None = None, **cfg_kw):
    """A small fp32 GPTModel (local layer spec) with random weights from ``seed``; ``mtp``: False, or
    True / a number of MTP depths. A pipeline stage: pre_process / post_process / vp_stage as megatron-core's
    model builders pass them (``pipeline_model_parallel_size`` and the rest in ``cfg_kw``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    if moe_experts:    # MoE layers with local experts: what the combined 1F1B plan overlaps (the all-to-all
        # dispatcher needs CUDA streams; on CPU use "allgather")
        cfg_kw = dict(num_moe_experts=moe_experts, moe_router_topk=2, moe_token_dispatcher_type=moe_dispatcher,
                      moe_ffn_hidden_size=2 * hidden, add_bias_linear=False, **cfg_kw)
        # (no linear biases: megatron-core's local experts add their bias in place on a view at TP 1,
        # which autograd refuses)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
                            mtp_num_layers=int(mtp) or None, **cfg_kw)
    spec = get_gpt_layer_local_spec(num_experts=moe_experts or None)
    if packed_attention:
        spec.submodules.self_attention.submodules.core_attention = (
            context_parallel_attention_class() if cfg.context_parallel_size > 1 else packed_attention_class())
    kw = {}
    layer_spec = spec
    if sequence_parallel:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        spec.submodules.input_layernorm = SequenceParallelTorchNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        layer_spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelTorchNorm)
    if mtp:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        kw["mtp_block_spec"] = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
        if sequence_parallel:
            for layer in kw["mtp_block_spec"].layer_specs:
                sub = layer.submodules
                sub.enorm = sub.hnorm = sub.layer_norm = SequenceParallelTorchNorm
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=vocab, max_sequence_length=max_seq,
                     share_embeddings_and_output_weights=tied, pre_process=pre_process, post_process=post_process,
                     **({} if vp_stage is None else {"vp_stage": vp_stage}), **kw)
    # small random weights give nearly uniform softmaxes; widen the logits so log-probs vary
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "output_layer" in name or "word_embeddings" in name:
                p.mul_(25.0)
    return model


def causal_mask(s: int):
    """Megatron's bool mask [1, 1, s, s], True = masked out."""
    return torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)


def random_batch(b: int, s: int, vocab: int, gen: torch.Generator | None = None):
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    return ids, pos, labels


def unfused_logits(model, ids, pos, mask, **kw):
    """The model's own logits [b, s, V] (vocab gathered over TP), fp32. At TP=1 nothing is
    gathered: megatron's TP=1 "gather" returns a view that its in-place cross entropy (the MTP
    loss) then trips over in backward."""
    tp = model.config.tensor_model_parallel_size
    return model(ids, pos, mask, runtime_gather_output=True if tp > 1 else None, **kw)


def unfused_logits_with_labels(model, ids, pos, mask, labels, **kw):
    """The model's own logits [b, s, V] for a forward that was given ``labels`` (so an MTP block
    computes its loss from those labels, as in the fused call): megatron's own output layer and
    logit scaling applied at the post-process boundary, exactly what ``_postprocess`` does there."""
    tp = model.config.tensor_model_parallel_size

    def logits(*, hidden_states, output_layer, output_weight, scale_logits=None, **_):
        z, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=True if tp > 1 else None)
        if scale_logits is not None:
            z = scale_logits(z)
        return z.transpose(0, 1)

    return model(ids, pos, mask, labels=labels, output_processor=logits, **kw)


def reference_from_logits(logits, labels, temperature=1.0):
    """(logprobs, entropy) float64 from the model's logits [b, s, V]; differentiable."""
    z = logits.double()
    if torch.is_tensor(temperature):
        t = temperature.double()
        t = t.view(-1, 1, 1) if t.dim() == 1 else t.unsqueeze(-1)
        z = z / t
    else:
        z = z / float(temperature)
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def param_grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def assert_own_output_without_labels(model, call, ids, pos, mask, weights):
    """``call()`` (a forward through logitless' processor with labels=None) gives exactly the model's own forward
    without a processor (logits [b, s, V]) and, for the loss sum(weights * logits), its parameter gradients.
    Returns the PathRecord of the call."""
    from logitless.megatron import last_path
    model.zero_grad(set_to_none=True)
    out = call()
    rec = last_path()
    (weights * out).sum().backward()
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    want = model(ids, pos, mask)
    (weights * want).sum().backward()
    assert out.shape == weights.shape and torch.equal(out, want)
    for name, g in param_grads(model).items():
        assert (g is None) == (got[name] is None) and (g is None or torch.equal(g, got[name])), name
    return rec


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def old_signature_gpt_class():
    """A GPTModel whose forward has the pre-0.18 signature (no output_processor parameters) but
    still routes through ``_postprocess``, as megatron-core 0.13-0.17 do: the legacy path's
    target inside the current release (the real older release is tested in its own venv)."""
    from megatron.core.models.gpt import GPTModel

    class OldSignatureGPTModel(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                    runtime_gather_output=None, *, loss_mask=None, padding_mask=None):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                   inference_context, packed_seq_params, extra_block_kwargs,
                                   runtime_gather_output, loss_mask=loss_mask, padding_mask=padding_mask)

    return OldSignatureGPTModel


def no_postprocess_gpt_class():
    """A GPTModel whose forward neither has the hook nor goes through ``_postprocess`` (the
    shape of releases older than 0.13): only the unfused path can serve it."""
    from megatron.core.models.gpt import GPTModel

    class NoPostprocessGPTModel(GPTModel):
        _postprocess = None

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                    runtime_gather_output=None, **_):
            hidden = self.embedding(input_ids=input_ids, position_ids=position_ids)
            hidden = self.decoder(hidden_states=hidden, attention_mask=attention_mask,
                                  packed_seq_params=packed_seq_params)
            logits, _ = self.output_layer(hidden, runtime_gather_output=runtime_gather_output)
            if labels is None:
                return logits.transpose(0, 1).contiguous()
            return self.compute_language_model_loss(labels, logits)

    return NoPostprocessGPTModel


def build_with_class(cls, **kw):
    """build_gpt, then the same weights in a model of class ``cls`` (a GPTModel subclass)."""
    model = build_gpt(**kw)
    model.__class__ = cls
    return model


LP_TOL = ENT_TOL = 2e-5
GRAD_TOL = 1e-4


def temperature_of_kind(kind, b, s, gen):
    if kind == "one":
        return 1.0
    if kind == "scalar":
        return 0.7
    if kind == "per_seq":
        return 0.5 + torch.rand(b, generator=gen) * 1.5
    return 0.5 + torch.rand(b, s, generator=gen) * 1.5


def run_fused(model, ids, pos, mask, labels, temperature, with_entropy=True):
    from logitless.megatron import FusedOutputProcessorContext, fused_output_processor
    ctx = FusedOutputProcessorContext(temperature=temperature, with_entropy=with_entropy)
    return model(ids, pos, mask, labels=labels, output_processor=fused_output_processor, output_processor_context=ctx)


def compare_with_unfused(model, b, s, temperature, gen, with_labels=False):
    """Fused vs unfused: values and every parameter gradient. Returns (fused grads, record, a short
    summary of the largest errors)."""
    from logitless.megatron import last_path
    ids, pos, labels = random_batch(b, s, model.vocab_size, gen)
    mask = causal_mask(s)
    a, c = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)

    model.zero_grad(set_to_none=True)
    out = run_fused(model, ids, pos, mask, labels, temperature)
    record = last_path()
    assert out.logprobs.shape == (b, s) and out.entropy.shape == (b, s)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    ((a * out.logprobs).sum() + (c * out.entropy).sum()).backward()
    fused_grads = param_grads(model)

    model.zero_grad(set_to_none=True)
    if with_labels:
        logits = unfused_logits_with_labels(model, ids, pos, mask, labels)
    else:
        logits = unfused_logits(model, ids, pos, mask)
    assert logits.shape[-1] == model.vocab_size           # the reference saw the whole vocabulary
    lp, ent = reference_from_logits(logits, labels, temperature)
    ((a * lp).sum() + (c * ent).sum()).backward()
    ref_grads = param_grads(model)

    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropy).all()
    e_lp = float((out.logprobs.double() - lp).abs().max())
    e_ent = float((out.entropy.double() - ent).abs().max())
    assert e_lp <= LP_TOL and e_ent <= ENT_TOL, (e_lp, e_ent)
    assert (out.logprobs <= 0).all() and (out.entropy >= 0).all()
    if not torch.is_tensor(temperature) and temperature == 1.0:
        ce = model(ids, pos, mask, labels=labels)          # the model's own per-token CE [b, s]
        assert (out.logprobs.detach() + ce.detach()).abs().max() <= LP_TOL
    worst = 0.0
    for name, g in ref_grads.items():
        assert (g is None) == (fused_grads[name] is None), name
        if g is not None and g.norm() > 0:
            err = rel_err(fused_grads[name], g)
            assert err <= GRAD_TOL, (name, err)
            worst = max(worst, err)
    return fused_grads, record, f"lp {e_lp:.1e} ent {e_ent:.1e} grad {worst:.1e}"


def per_sequence_reference(model, seq, temperature):
    """(logprobs, entropy) float64 [n] of one sequence run alone through the model ([1, n], causal
    mask), from its own logits: position t scores token t + 1; the last position is 0."""
    n = seq.numel()
    logits = unfused_logits(model, seq[None], torch.arange(n)[None], causal_mask(n))[0]
    lp, ent = reference_from_logits(logits[None, :-1], seq[None, 1:], temperature)
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([lp[0], zero]), torch.cat([ent[0], zero])


def ragged_batch(gen, b=4, s=15, vocab=262):
    """input_ids [b, s] and an attention mask with right, left+right and heavy padding."""
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, 10:] = False
    mask[1, :4] = False
    mask[1, 13:] = False
    mask[3, :] = False
    mask[3, 2:4] = True
    return ids, mask


def spawn_two(python: str, seed: int, cases=None, timeout: int = 420):
    """Run tp2_worker.py as ranks 0 and 1 under ``python``; returns each rank's {case: [ok, msg]}."""
    import json
    import subprocess
    import sys
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "gloo_init")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]
                                              + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        extra = [",".join(cases)] if cases else []
        procs = [subprocess.Popen([python or sys.executable, os.path.join(here, "tp2_worker.py"), str(r), "2", init,
                                   str(seed), outs[r]] + extra, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results = []
        for r in range(2):
            assert os.path.exists(outs[r]), f"rank {r} wrote nothing:\n{logs[r][-3000:]}"
            with open(outs[r]) as f:
                results.append(json.load(f))
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-3000:]}"
    return results


def hybrid_local_stack_spec(sequence_parallel: bool = False, mtp: bool = False, packed_attention: bool = False,
                            context_parallel: bool = False):
    """A HybridStack spec without Transformer Engine: attention layers ("*") and MLP layers ("-") from
    Megatron's local GPT layer spec (Mamba layers need CUDA kernels, so none here); with ``mtp``, the
    MTP block spec of the same local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    local = get_gpt_layer_local_spec()
    if packed_attention:
        local.submodules.self_attention.submodules.core_attention = (
            context_parallel_attention_class() if context_parallel else packed_attention_class())
    if sequence_parallel:
        local.submodules.input_layernorm = SequenceParallelTorchNorm
        local.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    sub = local.submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=sub.input_layernorm, self_attention=sub.self_attention, self_attn_bda=sub.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda))
    mtp_spec = None
    if mtp:
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.multi_token_prediction import (
            MultiTokenPredictionBlock,
            MultiTokenPredictionBlockSubmodules,
            MultiTokenPredictionLayer,
            MultiTokenPredictionLayerSubmodules,
        )
        norm = sub.input_layernorm
        mtp_spec = ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
                enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm))]))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mlp_layer=mlp, mtp_block_spec=mtp_spec))


class _final_norm_without_te:
    """HybridStack builds its final norm with TENorm (Transformer Engine, GPU-only): while a test
    model is built, the same LayerNorm from torch (tagged sequence_parallel under SP, as Megatron's
    own norms are). Test-side only."""

    def __init__(self, sequence_parallel: bool):
        self.sp = sequence_parallel

    def __enter__(self):
        from megatron.core.models.hybrid import hybrid_block
        self.module, self.saved = hybrid_block, hybrid_block.TENorm
        sp = self.sp

        def torch_norm(config, hidden_size, eps=1e-5, **_):
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
            for p in norm.parameters():
                p.sequence_parallel = sp
            return norm

        hybrid_block.TENorm = torch_norm
        return self

    def __exit__(self, *exc):
        self.module.TENorm = self.saved


def build_hybrid(*, pattern: str = "*-*-", vocab: int = 262, hidden: int = 48, heads: int = 4, max_seq: int = 64,
                 tied: bool = False, tp: int = 1, sequence_parallel: bool = False, packed_attention: bool = False,
                 post_process: bool = True, seed: int = 0, cls=None, **cfg_kw):
    """A small fp32 HybridModel (attention "*" and MLP "-" layers, local modules, learned absolute
    positions) with random weights from ``seed``. ``pattern`` may carry MTP depths ("*-*-/*-")."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    main, *mtp_parts = pattern.split("/")
    cfg = TransformerConfig(num_layers=len(main), hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
                            mtp_num_layers=len(mtp_parts) or None, **cfg_kw)
    spec = hybrid_local_stack_spec(sequence_parallel, mtp=bool(mtp_parts), packed_attention=packed_attention,
                                   context_parallel=cfg.context_parallel_size > 1)
    with _final_norm_without_te(sequence_parallel):
        model = (cls or HybridModel)(config=cfg, hybrid_stack_spec=spec, vocab_size=vocab, max_sequence_length=max_seq,
                                     hybrid_layer_pattern=pattern, position_embedding_type="learned_absolute",
                                     share_embeddings_and_output_weights=tied, post_process=post_process)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "output_layer" in name or "word_embeddings" in name:
                p.mul_(25.0)
    return model


class cpu_streams:
    """While open, megatron-core's schedule plans run on CPU: torch.cuda.Event, current_stream, stream
    and Tensor.record_stream become no-ops (test-side only; one stream, nothing overlaps), and so do
    torch.cuda.nvtx's range markers (megatron-core 0.16's schedule nodes call them directly) and
    torch.cuda.synchronize (its pipeline p2p calls it after gloo's batched isend / irecv, which have completed
    by then: their requests were waited on). The
    overlapped run needs CUDA streams and is a GPU test."""

    class _Event:
        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

    def __enter__(self):
        import contextlib
        cuda = torch.cuda
        self.saved = (cuda.Event, cuda.current_stream, cuda.stream, torch.Tensor.record_stream, cuda.synchronize)
        self.nvtx = (cuda.nvtx.range_push, cuda.nvtx.range_pop)
        cuda.nvtx.range_push = cuda.nvtx.range_pop = lambda *a, **k: None
        self.free = keep_schedule_node_inputs().__enter__()
        cuda.Event = lambda *a, **k: cpu_streams._Event()
        cuda.current_stream = lambda *a, **k: None
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.Tensor.record_stream = lambda self, stream: None
        cuda.synchronize = lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        cuda = torch.cuda
        cuda.Event, cuda.current_stream, cuda.stream, torch.Tensor.record_stream, cuda.synchronize = self.saved
        cuda.nvtx.range_push, cuda.nvtx.range_pop = self.nvtx
        self.free.__exit__(*exc)


class keep_schedule_node_inputs:
    """While open, megatron-core's schedule-plan nodes keep their inputs (``should_free_input`` -> False).
    With one expert-parallel rank (a single process) the MoE dispatch returns tokens that share its input's
    storage, which the node would free right after (megatron-core's own overlap config requires EP > 1).
    Test-side only: the values are the same, only the memory saving is lost."""

    def __enter__(self):
        try:
            from megatron.core.models.common import utils
        except ImportError:       # releases without schedule plans (0.16): nothing to keep
            self.module = None
            return self
        self.module, self.saved = utils, utils.should_free_input
        utils.should_free_input = lambda *a, **k: False
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.should_free_input = self.saved
