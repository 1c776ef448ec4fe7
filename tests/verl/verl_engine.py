"""verl 0.9.1's actor update, run for real in one CPU process: ``TrainingWorker.train_mini_batch`` ->
``FSDPEngineWithLMHead.train_batch`` (strategy fsdp2, or fsdp) with ``verl.workers.utils.losses.ppo_loss``,
built the way ``ActorRolloutRefWorker.init_model`` builds it, on a tiny Qwen2 saved to a temp dir.

What CPU needs (verl targets accelerators): a CPU platform through verl's own platform registry, a
1-rank gloo process group, stand-ins for uvicorn / fastapi when they are not installed (only verl's
rollout server imports them; the update never calls them), trl's value-head patch turned off (trl 1.16
no longer has the class verl imports for critics), eager attention. Strategy fsdp2 by default; strategy fsdp
(FSDP1) needs ``cpu_fsdp1``: verl wraps with ``sync_module_states=True`` and FSDP1 refuses any CPU tensor then
(NCCL's broadcast wants GPU ones), while gloo broadcasts CPU tensors. verl patches the model class's forward
and never restores it: ``Actor`` puts it back.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import types
from functools import partial

import torch

VOCAB = 263
HIDDEN = 40

P = "actor_rollout_ref.actor."
D = "distillation."
DL = "distillation.distillation_loss."
K = 6          # the teacher's top-k in the distillation batches
# every verl policy-loss mode the fused loss runs, with settings that make its own terms bind
FUSED_MODES = {
    "vanilla": [f"{P}clip_ratio_c=1.2"],
    "gspo": [f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"],
    "sapo": [f"{P}tau_pos=1.3", f"{P}tau_neg=0.8"],
    "gpg": [],
    "cispo": [f"{P}clip_ratio_low=0.1", f"{P}clip_ratio_high=0.2"],
    "dro": [f"{P}policy_loss.dro_beta=0.3"],
    "dppo_tv": [f"{P}clip_ratio_low=0.05", f"{P}clip_ratio_high=0.08", f"{P}clip_ratio_c=1.3"],
    "dppo_kl": [f"{P}clip_ratio_low=0.01", f"{P}clip_ratio_high=0.02"],
    "clip_cov": [f"{P}policy_loss.clip_cov_ratio=0.3", f"{P}policy_loss.clip_cov_lb=0.05",
                 f"{P}policy_loss.clip_cov_ub=3.0"],
    "kl_cov": [f"{P}policy_loss.kl_cov_ratio=0.2", f"{P}policy_loss.ppo_kl_coef=0.5"],
}


def _stub_missing(name: str) -> None:
    try:
        __import__(name)
    except ImportError:
        mod = types.ModuleType(name)

        def attr(n):
            if n.startswith("__"):
                raise AttributeError(n)
            return type(n, (), {"__init__": lambda self, *a, **k: None})
        mod.__getattr__ = attr
        sys.modules[name] = mod


def _cpu_platform():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def nvtx_range(self, msg): return contextlib.nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None
    return PlatformCPU()


_READY = False


@contextlib.contextmanager
def cpu_fsdp1():
    """While verl builds an FSDP1 engine: FSDP1's check that ``sync_module_states=True`` sees no CPU tensor
    (``torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states``, there for NCCL's
    broadcast) is lifted; the broadcast itself runs, over gloo, which takes CPU tensors. Nothing else of
    FSDP1 or verl changes."""
    from torch.distributed.fsdp import _init_utils
    check = _init_utils._check_module_states_for_sync_module_states
    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    try:
        yield
    finally:
        _init_utils._check_module_states_for_sync_module_states = check


def stub_server_modules() -> None:
    """Stand-ins for uvicorn / fastapi when not installed (before importing verl's engine workers)."""
    for name in ("uvicorn", "fastapi", "fastapi.responses"):
        _stub_missing(name)


# the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) this process's gloo group was started
# with: verl's Worker reads them, so setup() puts them back in the environment on every call, since
# tests/verl/conftest.py restores the environment after each test module (left set, they reach the processes a
# later test starts, whose init_process_group then meets this process's store on MASTER_PORT)
_GROUP_ENV: dict[str, str] = {}


def start_group(rank: int = 0, world: int = 1, init_file: str | None = None) -> None:
    """The gloo group, unless one is up (another test module's): 1 rank on a free port, or a worker's rank of
    ``world`` meeting the others at ``init_file``; its launcher's variables put (back) in the environment."""
    import torch.distributed as dist
    if not dist.is_initialized():
        env = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1")
        if init_file is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                env["MASTER_PORT"] = str(s.getsockname()[1])
            os.environ.update(env)
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            env["MASTER_PORT"] = os.environ.get("MASTER_PORT", "0")   # verl's Worker reads it; ranks meet at the file
            os.environ.update(env)
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        _GROUP_ENV.update(env)
    os.environ.update(_GROUP_ENV)


def setup() -> None:
    """The gloo group (start_group: 1 rank unless a worker started its own), the CPU platform and the import
    workarounds (once per process); the environment they need, on every call."""
    global _READY
    start_group()
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")    # the engine registry's key for its FSDP engine
    if _READY:
        return
    stub_server_modules()
    from verl.plugin.platform import platform_manager
    platform_manager.set_platform(_cpu_platform())
    for cpu_module in (torch.cpu,):
        for fn in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
                   "reset_peak_memory_stats", "empty_cache"):
            if not hasattr(cpu_module, fn):
                setattr(cpu_module, fn, lambda *a, **k: 0)
    import verl.models.transformers.monkey_patch as mp
    mp.is_trl_available = lambda: False
    _READY = True


def save_tiny_qwen2(path: str, seed: int, tied: bool = True, layers: int = 2) -> None:
    """A Qwen2 of ``layers`` layers with random weights (logits spread so log-probs and entropies vary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
        if not tied:
            model.model.embed_tokens.weight.mul_(15.0)
    model.save_pretrained(path)


def compose(model_dir: str, overrides=()):
    """verl's ppo_trainer config with command-line style overrides (as the trainer's hydra main)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.optim.optimizer=SGD",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr=0.5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.clip_grad=1000.0",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.model.use_remove_padding=False",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose("ppo_trainer", overrides=base + list(overrides))


def actor_config(model_dir: str, overrides=()):
    """verl's ActorConfig from the composed config, as ActorRolloutRefWorker.init_model makes it."""
    from verl.utils.config import omega_conf_to_dataclass
    cfg = compose(model_dir, overrides)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    config.model_config = model_config
    return cfg, config


def training_config(cfg, config):
    """The TrainingWorkerConfig ActorRolloutRefWorker.init_model builds from the composed ``cfg`` and the actor
    ``config`` (``actor_config``'s pair), with the actor's micro-batch settings on the engine's config."""
    from verl.workers.config import TrainingWorkerConfig
    training = TrainingWorkerConfig(model_type="language_model", model_config=config.model_config,
                                    engine_config=config.engine, optimizer_config=config.optim,
                                    checkpoint_config=config.checkpoint, profiler_config=None)
    actor = cfg.actor_rollout_ref.actor
    training.engine_config.use_dynamic_bsz = actor.use_dynamic_bsz
    training.engine_config.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    training.engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    return training


class Actor:
    """A built actor (``TrainingWorker``) whose update can be run repeatedly from the same starting
    parameters with another loss config (``set_loss_fn``, as init_model does) and other engine settings
    (passed in the batch, where ``TrainingWorker.train_batch`` reads them first).

    verl patches the model *class*'s forward for its fused kernels (``use_fused_kernels``): each Actor
    keeps the class forward its build left and sets it around its own updates, so actors built with and
    without fused kernels live side by side in one process."""

    def __init__(self, model_dir: str, overrides=()):
        setup()
        from verl.workers.engine_workers import TrainingWorker

        from transformers import Qwen2ForCausalLM
        plain = Qwen2ForCausalLM.forward
        self.model_dir = model_dir
        try:
            cfg, config = actor_config(model_dir, overrides)
            training = training_config(cfg, config)
            training.engine_config.use_remove_padding = config.model_config.get("use_remove_padding", False)
            self.worker = TrainingWorker(config=training)
            with cpu_fsdp1():
                self.worker.reset()
            self.forward = Qwen2ForCausalLM.forward
        finally:
            Qwen2ForCausalLM.forward = plain
        self.initial = [p.detach().clone() for p in self.worker.engine.module.parameters()]

    def initial_full(self):
        """The initial parameters, whole (an FSDP2 shard's full tensor)."""
        return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.initial]

    def update(self, tensors, meta, overrides=(), *, calculate_entropy: bool, mini_batch_size: int, engine=None):
        """One ``train_mini_batch`` from the initial parameters with verl's ``ppo_loss`` of the actor config
        ``overrides`` (or, when they enable ``distillation``, verl's ``distillation_ppo_loss`` with its
        distillation config and the batch flags ``RayPPOTrainer._update_actor`` sets); engine settings
        (use_remove_padding, micro_batch_size_per_gpu, use_dynamic_bsz, max_token_len_per_gpu) from ``engine``.
        Returns (metrics, {name: parameter after the step})."""
        from verl.utils import tensordict_utils as tu

        from transformers import Qwen2ForCausalLM
        cfg, config = actor_config(self.model_dir, overrides)
        module = self.worker.engine.module
        with torch.no_grad():
            for p, p0 in zip(module.parameters(), self.initial, strict=True):
                p.copy_(p0)
        flags = set_loss_fn(self.worker, cfg, config)
        torch.manual_seed(2024)        # every update draws the same random numbers (clip_cov's token choice)
        data = to_actor_input(tensors, meta, calculate_entropy=calculate_entropy, mini_batch_size=mini_batch_size)
        tu.assign_non_tensor(data, **flags, **(engine or {}))
        plain = Qwen2ForCausalLM.forward
        Qwen2ForCausalLM.forward = self.forward
        try:
            out = self.worker.train_mini_batch(data)
        finally:
            Qwen2ForCausalLM.forward = plain
        params = {}
        for name, p in module.named_parameters():
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[name] = p.detach().clone()
        # under Ulysses only the first rank of each sp group collects the output (the others: None)
        return (tu.get(out, "metrics") if out is not None else None), params


def set_loss_fn(worker, cfg, config) -> dict:
    """The actor's loss set on ``worker`` as the trainer sets it: verl's ``ppo_loss`` of the actor ``config``, or,
    when the composed ``cfg`` enables ``distillation``, verl's ``distillation_ppo_loss`` with its distillation
    config. Returns the batch flags ``RayPPOTrainer._update_actor`` sets with it."""
    from verl.workers.utils.losses import ppo_loss
    if not cfg.distillation.enabled:
        worker.set_loss_fn(partial(ppo_loss, config=config))
        return {}
    from verl.trainer.distillation import distillation_ppo_loss
    from verl.utils.config import omega_conf_to_dataclass
    dcfg = omega_conf_to_dataclass(cfg.distillation)
    loss_cfg = dcfg.distillation_loss
    topk = loss_cfg.loss_settings.use_topk
    worker.set_loss_fn(partial(distillation_ppo_loss, config=config, distillation_config=dcfg))
    return {"distillation_use_topk": topk,
            "distillation_only": topk and not loss_cfg.use_task_rewards and not loss_cfg.use_policy_gradient}


def run(actor, tensors, meta, overrides, *, fused, strict=False, calculate_entropy=True, engine=None):
    """``actor.update`` on the batch, with logitless' fused loss installed for it (``fused``) or not."""
    import logitless.verl as lv
    if fused:
        lv.install(fused_loss=True, strict=strict)
    try:
        return actor.update(tensors, meta, overrides, calculate_entropy=calculate_entropy, mini_batch_size=6,
                            engine=engine)
    finally:
        lv.uninstall()


def infer_logprobs(actor: "Actor", tensors, meta):
    """verl's compute_log_prob on the actor (``TrainingWorker.infer_batch``, no loss): (log-probs, entropy)
    of every position but each sequence's last (whose label verl's fused and unfused paths take from
    different places: the padded row's next column or the next sequence; no loss reads it)."""
    from verl.utils import tensordict_utils as tu

    from transformers import Qwen2ForCausalLM
    data = to_actor_input(tensors, meta, calculate_entropy=True, mini_batch_size=len(tensors["input_ids"]))
    tu.assign_non_tensor(data, compute_loss=False, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
    plain = Qwen2ForCausalLM.forward
    Qwen2ForCausalLM.forward = actor.forward
    try:
        out = actor.worker.infer_batch(data)
    finally:
        Qwen2ForCausalLM.forward = plain
    offsets = out["log_probs"].offsets()
    keep = torch.ones(int(offsets[-1]), dtype=torch.bool)
    keep[offsets[1:] - 1] = False
    return out["log_probs"].values()[keep], out["entropy"].values()[keep]


def current_logprobs(model_dir: str, input_ids, attention_mask, position_ids, response: int, temperature: float):
    """The saved model's log-probs of the response tokens [b, response] (plain transformers, float64 softmax)."""
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits.double() / temperature, -1)[:, -response - 1:-1]
    return logp.gather(-1, input_ids[:, -response:, None]).squeeze(-1).float()


def greedy_responses(model_dir: str, prompts, responses, attention_mask, position_ids):
    """responses [b, r] replaced by the saved model's greedy continuation of the prompts (masked
    positions kept), so their probabilities are large, as sampled responses' are."""
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    p = prompts.shape[1]
    responses = responses.clone()
    with torch.no_grad():
        for j in range(responses.shape[1]):
            ids = torch.cat([prompts, responses], 1)
            logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
            keep = attention_mask[:, p + j].bool()
            responses[:, j] = torch.where(keep, logits[:, p + j - 1].argmax(-1), responses[:, j])
    return responses


def rollout_batch(gen: torch.Generator, model_dir: str, b: int = 6, prompt: int = 5, response: int = 7, *,
                  ref: bool = True, is_weights: bool = False, temperature: float = 0.9, spread: float = 0.3,
                  greedy: bool = False):
    """A rollout batch as ``RayPPOTrainer._update_actor`` hands it to the actor, before its
    left_right_2_no_padding: prompts left-padded, responses right-padded, a response mask with a hole
    (a tool token) and one fully masked sequence; old / ref log-probs the current policy's plus noise of
    ``spread`` (so ratios both inside and outside the clip range). Random response tokens, or (greedy) the
    model's greedy continuation."""
    prompt_len = torch.randint(2, prompt + 1, (b,), generator=gen)
    resp_len = torch.randint(2, response + 1, (b,), generator=gen)
    resp_len[0] = response
    prompts = torch.randint(1, VOCAB, (b, prompt), generator=gen)
    responses = torch.randint(1, VOCAB, (b, response), generator=gen)
    cols_p, cols_r = torch.arange(prompt), torch.arange(response)
    pmask = cols_p[None] >= prompt - prompt_len[:, None]
    rmask = cols_r[None] < resp_len[:, None]
    prompts = prompts.masked_fill(~pmask, 0)
    responses = responses.masked_fill(~rmask, 0)
    attention = torch.cat([pmask, rmask], 1).long()
    response_mask = rmask.clone()
    response_mask[1, 1] = False                     # a tool token inside a response
    response_mask[b - 1] = False                    # a sequence with no scored token
    position = (attention.cumsum(-1) - 1).clamp_min(0)
    if greedy:
        responses = greedy_responses(model_dir, prompts, responses, attention, position)
    input_ids = torch.cat([prompts, responses], 1)
    lp = current_logprobs(model_dir, input_ids, attention, position, response, temperature)
    adv = torch.randn(b, response, generator=gen)
    old = (lp + spread * torch.randn(b, response, generator=gen)).clamp(max=-1e-3)     # log-probs stay < 0
    tensors = {"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
               "position_ids": position, "response_mask": response_mask.long(), "old_log_probs": old,
               "advantages": adv}
    if ref:
        tensors["ref_log_prob"] = (lp + spread * torch.randn(b, response, generator=gen)).clamp(max=-1e-3)
    if is_weights:
        tensors["rollout_is_weights"] = 0.5 + torch.rand(b, response, generator=gen)
    return tensors, {"temperature": temperature}


def to_actor_input(tensors, meta, *, calculate_entropy: bool, mini_batch_size: int, epochs: int = 1):
    """What _update_actor sends to update_actor: the no-padding TensorDict and its settings."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    td = tu.get_tensordict(tensor_dict={k: v.clone() for k, v in tensors.items()}, non_tensor_dict=dict(meta))
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=calculate_entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size, epochs=epochs, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return td


def distillation_enabled(model_dir, mode, *settings):
    """The hydra overrides that enable verl's distillation with ``mode`` (a teacher whose config verl accepts:
    it is never started here)."""
    return [f"{D}enabled=True", f"{D}n_gpus_per_node=2", f"{D}nnodes=1", "actor_rollout_ref.rollout.name=vllm",
            f"{D}teacher_models.teacher_model.model_path={model_dir}", f"{DL}loss_mode={mode}", f"{DL}topk={K}",
            *settings]


def clamp_binds(model_dir, seed: int, clamp: float) -> tuple:
    """Whether a log-prob clamp at ``clamp`` binds on teacher_batch(seed)'s top-k batch: (some student log-prob at
    the teacher's ids below it, some teacher log-prob below it), at valid positions, the student being the saved
    model at temperature 0.9 in float64."""
    tensors, _ = teacher_batch(torch.Generator().manual_seed(seed), model_dir, topk=True)
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       position_ids=tensors["position_ids"]).logits
    s_lp = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, tensors["teacher_ids"])
    valid = tensors["attention_mask"].bool()[..., None]
    return bool(((s_lp < clamp) & valid).any()), bool(((tensors["teacher_logprobs"] < clamp) & valid).any())


def teacher_batch(gen, model_dir, *, topk: bool, noise: float = 1.5, **batch):
    """verl_engine.rollout_batch plus the teacher's tensors: top-k ``teacher_ids`` / ``teacher_logprobs``
    [b, seq, K] (topk) or the sampled token's id and log-prob [b, seq, 1] (estimator modes), per position the
    teacher's distribution of the next token; padding positions hold id 0 and log-prob 0, as verl's padding."""
    from transformers import Qwen2ForCausalLM
    tensors, meta = rollout_batch(gen, model_dir, **batch)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       position_ids=tensors["position_ids"]).logits.double()
    logits = logits + noise * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)
    valid = tensors["attention_mask"].bool()
    if topk:
        lp, ids = logp.topk(K, dim=-1)
        tensors["teacher_ids"] = torch.where(valid[..., None], ids, 0)
        tensors["teacher_logprobs"] = torch.where(valid[..., None], lp, 0.0).float()
    else:
        nxt = torch.roll(tensors["input_ids"], -1, dims=1)
        lp = logp.gather(-1, nxt[..., None])
        tensors["teacher_logprobs"] = torch.where(valid[..., None], lp, 0.0).float()
        tensors["teacher_ids"] = torch.where(valid[..., None], nxt[..., None], 0)   # verl converts the pair
    return tensors, meta


def check_distillation_case(metrics, mode, dsettings):
    """The reference run's ``metrics`` exercise what a distillation case names: the top-k metrics present with a
    partial overlap of the teacher's and the student's top-k, ``loss_max_clamp`` (in ``dsettings``) binding."""
    if mode == "forward_kl_topk":
        for key in ("distillation/student_mass", "distillation/teacher_mass", "distillation/overlap_ratio",
                    "distillation/overlap_token_advantage", "distillation/loss_min", "distillation/loss_max"):
            assert key in metrics, key
        assert 0 < max(metrics["distillation/overlap_ratio"]) < 1, "the top-k sets never (or always) overlap"
    clamp = next((float(s.split("=")[1]) for s in dsettings if "loss_max_clamp" in s), None)
    if clamp is not None:
        assert max(metrics["distillation/loss_max"]) > clamp, "loss_max_clamp never binds: the case tests nothing"


def case_batch(gen, model_dir, loss, **batch):
    """A multi-rank worker's case: ``loss`` is the actor overrides (verl's ``ppo_loss``; a rollout batch) or
    (distillation mode, its settings) (verl's ``distillation_ppo_loss``; a batch with the teacher's tensors);
    ``batch``: rollout_batch's settings. Returns (tensors, meta, overrides, the entry ``last_path()`` records,
    check(metrics) of the reference run)."""
    if not isinstance(loss, tuple):
        tensors, meta = rollout_batch(gen, model_dir, **batch)
        return tensors, meta, loss, "verl.policy_loss", lambda metrics: None
    mode, dsettings = loss
    tensors, meta = teacher_batch(gen, model_dir, topk=mode == "forward_kl_topk", **batch)
    return (tensors, meta, distillation_enabled(model_dir, mode, *dsettings), "verl.distillation",
            lambda metrics: check_distillation_case(metrics, mode, dsettings))
