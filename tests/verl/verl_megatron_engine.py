"""verl 0.9.1's Megatron actor update, run for real in one CPU process: ``TrainingWorker.train_mini_batch`` ->
``MegatronEngineWithLMHead`` (megatron-core 0.19, TP 1 on a 1-rank gloo group) with
``verl.workers.utils.losses.ppo_loss``, built the way ``ActorRolloutRefWorker.init_model`` builds it, on the tiny
Qwen2 of verl_engine.py loaded through verl's vanilla mbridge bridge (``megatron.vanilla_mbridge=True``: the
``mbridge`` package; verl's default, Megatron-Bridge, needs Python 3.12).

What CPU needs (test-side only, ``cpu_megatron`` below; verl, mbridge and megatron-core target GPUs):
- megatron-core's two CPU workarounds (mcore_env.py): ``torch.cuda.current_device`` -> "cpu" and the
  inference RNG tracker for ``model_parallel_cuda_manual_seed``; its CUDA streams as no-ops while the schedule
  runs (``mcore_env.cpu_streams``: DDP's grad sync asks for the current stream);
- megatron-core's optimizer and grad clipping allocate on ``device='cuda'`` and assert
  ``grad.type() == 'torch.cuda.FloatTensor'``: a torch-function mode puts those tensors on the CPU and reports
  CPU float tensors as CUDA ones; ``Module.cuda`` is a no-op while mbridge builds the model;
- mbridge builds Transformer Engine layers (GPU only): the local layer spec instead, with mcore_env's packed
  (THD) attention (verl's BSHD key mask made the local attention's mask), and mbridge's Qwen2 weight names
  extended to that spec's norms (``input_layernorm`` / ``pre_mlp_layernorm``, which TE fuses into the linear
  layers), a torch RMSNorm for sequence parallelism (``SequenceParallelRMSNorm``); mbridge 0.15.1 tests
  ``ModelType.encoder_and_decoder``, which megatron-core 0.19 no longer has;
- verl's optimizer step calls the device's ``empty_cache`` after a top-k distillation batch: a no-op on
  ``torch.cpu``, which has none;
- float32 parameters: verl's McoreEngineConfig accepts only bfloat16 / float16, so ``dtype`` is set past its
  check; SGD without momentum (``sgd_momentum=0``) so the step is the gradient itself;
- no tokenizer (verl only reads its pad id, 0 here).
The same recipe runs on megatron-core 0.16.1 (verl_megatron_legacy_suite.py, in .venv-legacy), whose release has no
schedule-plan nodes for ``cpu_streams`` to keep.
"""
from __future__ import annotations

import contextlib
import math
import os
import types
from functools import partial

import torch
import verl_engine as ve

import mcore_env

PARAM_TOL = 1e-4       # relative, per parameter, after the step
STEP_TOL = 1e-4        # relative to the whole step's norm, per parameter's step
METRIC_TOL = 1e-5      # relative, or absolute below 1
TIMING = ("perf/", "mfu")


# megatron-core's hard-coded CUDA tensors on the CPU (mcore_env.py: its pipeline schedules need it too)
_CudaOnCpu = mcore_env.CudaOnCpu


def core_attention_class():
    """mcore_env's packed (THD) attention, which also takes verl's padded (BSHD) key mask [b, s] (True: a
    token), turned into the local attention's [b, 1, s, s] (True: masked) with the causal mask."""
    base = mcore_env.packed_attention_class()

    class EngineCoreAttention(base):
        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 2:
                keep = attention_mask.bool()
                s = keep.shape[1]
                causal = torch.ones(s, s, dtype=torch.bool, device=keep.device).triu(1)
                attention_mask = causal[None, None] | ~keep[:, None, None, :]
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return EngineCoreAttention


class SequenceParallelRMSNorm:
    """torch RMSNorm for sequence-parallel models (mbridge turns SP on at TP > 1): Megatron's WrappedTorchNorm
    refuses sequence_parallel=True (its fused norms are GPU-only); this builds the same torch norm and tags its
    weight ``sequence_parallel`` as Megatron's own norms do, so its gradient is all-reduced over TP."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


@contextlib.contextmanager
def cpu_megatron():
    """While open: megatron-core / mbridge / verl's Megatron engine build and train on the CPU (see the module
    docstring); everything is put back on exit."""
    import mbridge.core.llm_bridge as llm_bridge
    import mbridge.core.util as mbridge_util
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(self, vp_stage=None):
        # the stage's layers (vp_stage: a virtual pipeline stage), as mbridge's own method asks for them
        self.has_vp_stage = True
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        # context parallelism: mcore_env's CP attention (K and V all-gathered over the CP group, verl's zigzag
        # split of each packed sequence); TE's ring attention is GPU-only
        attention = (mcore_env.context_parallel_attention_class() if self.config.context_parallel_size > 1
                     else core_attention_class())
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = attention
            if self.config.sequence_parallel:
                layer.submodules.input_layernorm = SequenceParallelRMSNorm
                layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        if self.config.sequence_parallel:
            spec.layer_norm = SequenceParallelRMSNorm
        return spec

    seed = tensor_parallel.model_parallel_cuda_manual_seed
    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (tensor_parallel, "model_parallel_cuda_manual_seed", seed),
             (torch.nn.Module, "cuda", torch.nn.Module.cuda),
             (llm_bridge.LLMBridge, "_get_transformer_layer_spec", llm_bridge.LLMBridge._get_transformer_layer_spec),
             (mbridge_util, "ModelType", mbridge_util.ModelType),
             (Qwen2Bridge, "_OTHER_MAPPING", Qwen2Bridge._OTHER_MAPPING),
             (Qwen2Bridge, "_MLP_MAPPING", Qwen2Bridge._MLP_MAPPING),
             (Qwen2Bridge, "_DIRECT_MAPPING", Qwen2Bridge._DIRECT_MAPPING)]
    torch.cuda.current_device = lambda: "cpu"
    # verl's optimizer step empties the device cache after a top-k distillation batch; torch.cpu has no such call
    had_empty_cache = hasattr(torch.cpu, "empty_cache")
    if not had_empty_cache:
        torch.cpu.empty_cache = lambda: None
    tensor_parallel.model_parallel_cuda_manual_seed = lambda s, *a, **k: seed(s, inference_rng_tracker=True)
    torch.nn.Module.cuda = lambda self, device=None: self
    llm_bridge.LLMBridge._get_transformer_layer_spec = local_spec
    mbridge_util.ModelType = types.SimpleNamespace(encoder_or_decoder=ModelType.encoder_or_decoder,
                                                   encoder_and_decoder=object())
    Qwen2Bridge._OTHER_MAPPING = {**Qwen2Bridge._OTHER_MAPPING,
                                  "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    # mbridge maps a tied output layer by writing into the class's dict: a copy per build, so a tied model
    # built earlier does not leave an untied one mapped to the embedding
    Qwen2Bridge._DIRECT_MAPPING = dict(Qwen2Bridge._DIRECT_MAPPING)
    Qwen2Bridge._MLP_MAPPING = {**Qwen2Bridge._MLP_MAPPING, "pre_mlp_layernorm.weight":
                                ["model.layers.{layer_number}.post_attention_layernorm.weight"]}
    # megatron-core sets Transformer Engine's attention switches in the environment when it builds a model and
    # refuses values another backend left there (a model built earlier in this process): cleared, then put back
    nvte = {k: os.environ.pop(k) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
            if k in os.environ}
    try:
        with _CudaOnCpu(), mcore_env.cpu_streams():
            yield
    finally:
        for owner, name, value in saved[::-1]:
            setattr(owner, name, value)
        if not had_empty_cache:
            del torch.cpu.empty_cache
        for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(k, None)
        os.environ.update(nvte)


def setup(rank: int = 0, world: int = 1, init_file: str | None = None) -> None:
    """A gloo group (1 rank, unless a worker of a multi-rank test passes its rank, the world size and the
    file the ranks meet at; another test module may have torn its own down) and verl's CPU platform
    (verl_engine.start_group and setup)."""
    ve.start_group(rank, world, init_file)
    ve.setup()


def teardown() -> None:
    """Megatron's model-parallel state, built by verl's engine, destroyed (the gloo group stays for the
    other verl test modules)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()


BASE = [
    "model_engine=megatron",
    "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
    "actor_rollout_ref.actor.megatron.sequence_parallel=False",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False",
    "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=local",
    "actor_rollout_ref.actor.optim.optimizer=sgd",
    "+actor_rollout_ref.actor.optim.override_optimizer_config.sgd_momentum=0.0",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.lr=0.5",
    "actor_rollout_ref.actor.optim.total_training_steps=10",
    "actor_rollout_ref.actor.optim.clip_grad=1000.0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=6",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=1",
]


def actor_config(model_dir: str, overrides=()):
    """verl's McoreActorConfig from the composed config (float32 parameters, see the module docstring)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from verl.utils.config import omega_conf_to_dataclass

    import verl
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    base = [f"actor_rollout_ref.model.path={model_dir}", "+actor_rollout_ref.model.load_tokenizer=False", *BASE]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = hydra_compose("ppo_trainer", overrides=base + list(overrides))
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    config.model_config = model_config
    object.__setattr__(config.engine, "dtype", "float32")
    return cfg, config


class Actor:
    """A built Megatron actor (``TrainingWorker``) whose update can be run repeatedly from the same starting
    parameters with another loss config (``set_loss_fn``) and other engine settings (in the batch)."""

    def __init__(self, model_dir: str, overrides=()):
        setup()
        from verl.workers.engine_workers import TrainingWorker
        self.model_dir = model_dir
        training = ve.training_config(*actor_config(model_dir, overrides))
        with cpu_megatron():
            self.worker = TrainingWorker(config=training)
            self.worker.reset()
        self.worker.engine.model_config.tokenizer = types.SimpleNamespace(pad_token_id=0)
        self.initial = {n: p.detach().clone() for n, p in self.params().items()}

    def params(self):
        return {n: p for chunk in self.worker.engine.module for n, p in chunk.named_parameters()}

    def update(self, tensors, meta, overrides=(), *, calculate_entropy: bool, mini_batch_size: int, engine=None):
        """One ``train_mini_batch`` from the initial parameters with verl's ``ppo_loss`` of the actor config
        ``overrides`` (or, when they enable ``distillation``, verl's ``distillation_ppo_loss``: verl_engine's
        ``set_loss_fn``); engine settings (micro_batch_size_per_gpu, use_dynamic_bsz, max_token_len_per_gpu) from
        ``engine``. Returns (metrics, {name: parameter after the step})."""
        from verl.utils import tensordict_utils as tu
        cfg, config = actor_config(self.model_dir, overrides)
        with torch.no_grad():
            for name, p in self.params().items():
                p.copy_(self.initial[name])
        flags = ve.set_loss_fn(self.worker, cfg, config)
        torch.manual_seed(2024)        # every update draws the same random numbers (clip_cov's token choice)
        data = ve.to_actor_input(tensors, meta, calculate_entropy=calculate_entropy, mini_batch_size=mini_batch_size)
        tu.assign_non_tensor(data, **flags, **(engine or {}))
        with cpu_megatron():
            out = self.worker.train_mini_batch(data)
        metrics = None if out is None else tu.get(out, "metrics")      # verl's non-source TP ranks log none
        return metrics, {n: p.detach().clone() for n, p in self.params().items()}


    def infer(self, tensors, meta, overrides=()):
        """verl's compute_log_prob on the actor (``TrainingWorker.infer_batch``, forward only, with verl's loss
        function set, as the trainer's actor has it): (log-probs, entropy) of every position but each sequence's
        last (whose label verl's fused and unfused paths take from different places; no loss reads it)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss
        _, config = actor_config(self.model_dir, overrides)
        self.worker.set_loss_fn(partial(ppo_loss, config=config))
        data = ve.to_actor_input(tensors, meta, calculate_entropy=True, mini_batch_size=len(tensors["input_ids"]))
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
        with cpu_megatron():
            out = self.worker.infer_batch(data)
        offsets = out["log_probs"].offsets()
        keep = torch.ones(int(offsets[-1]), dtype=torch.bool)
        keep[offsets[1:] - 1] = False
        return out["log_probs"].values()[keep], out["entropy"].values()[keep]


def assert_same_update(initial, got, want):
    """Two updates' (metrics, parameters) from the same ``initial`` parameters: every parameter within PARAM_TOL,
    each parameter's step within STEP_TOL of the whole step's norm, the same metric names and values within
    METRIC_TOL (timings aside). ``metrics`` None: a rank that logs none (verl's non-source TP ranks)."""
    (m_got, p_got), (m_want, p_want) = got, want
    step = {n: p - initial[n] for n, p in p_want.items()}
    step_norm = math.sqrt(sum(float(s.square().sum()) for s in step.values()))
    assert step_norm > 1e-3, "the step moved nothing: the comparison would be empty"
    assert p_got.keys() == p_want.keys()
    for n, p in p_want.items():
        assert float((p_got[n] - p).norm()) <= PARAM_TOL * float(p.norm()) + 1e-12, n
        assert float((p_got[n] - initial[n] - step[n]).norm()) <= STEP_TOL * step_norm, n
    if m_want is None or m_got is None:
        assert m_want is None and m_got is None, "one run logged metrics, the other none"
        return
    missing = set(m_want) - set(m_got)
    assert not missing, f"metrics verl logs but the fused run does not: {missing}"
    assert set(m_got) == set(m_want), set(m_got) ^ set(m_want)
    for key, want_v in m_want.items():
        if key.startswith(TIMING):
            continue
        want_l, got_l = (list(v) if isinstance(v, list) else [v] for v in (want_v, m_got[key]))
        assert len(got_l) == len(want_l), key
        tol = STEP_TOL if key == "grad_norm" else METRIC_TOL     # a gradient's norm: the step's tolerance
        for g, w in zip(got_l, want_l, strict=True):
            assert abs(float(g) - float(w)) <= tol * max(1.0, abs(float(w))), (key, g, w)
