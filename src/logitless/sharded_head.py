"""Running a fused op *as* the LM head module, so whatever shards the head gathers it.

FSDP1, FSDP2 and DeepSpeed ZeRO-3 gather a module's parameters in hooks around that module's call
and reduce (or partition) its gradient through hooks set up during that call (on its inputs, its
outputs and its parameters' gradient accumulators). Reading ``lm_head.weight`` without calling
``lm_head`` sees a shard, or a freed placeholder, whenever the head is not in the unit that is running.
:func:`call_head` calls the head through its own ``__call__`` with its ``forward`` replaced, on this
instance and for this one call, by a function that runs the fused computation on the weight the
hooks have just gathered and returns the fused outputs. The head is then gathered before, and its
gradient reduced after, exactly as for the unfused head; nothing else about the module changes.

Tensor parallelism is the exception. A head whose weight is a DTensor sharded over the vocabulary
(torch's ``parallelize_module`` with ``ColwiseParallel``: ``Shard(0)`` on a 1-D mesh, shards may be
uneven) is not gathered by anyone: its module hooks only convert layouts (they would hand the op a
DTensor and expect [.., V/tp] logits back). There the fused computation runs on the local shard with
``tp_group`` = the mesh's process group (logitless' vocab-parallel op), without calling the module.
Any other placement raises ValueError naming it (see :func:`tensor_parallel_shard`).
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Optional, Sequence, Tuple

from torch import Tensor, nn

__all__ = ["call_head", "check_layout", "inner_head", "head_shape", "is_dtensor", "tensor_parallel_shard", "replicated",
           "whole_weight"]

# compute(hidden, weight, tp_group) -> a tuple of tensors (or None): the fused outputs
Compute = Callable[[Tensor, Tensor, object], tuple]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a torch DTensor (FSDP2 shard, tensor-parallel shard, ...)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(t, DTensor)


def _fsdp2_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_fsdp2_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (its call unshards the parameters it manages)."""
    cls = _fsdp2_module_class()
    return cls is not None and isinstance(module, cls)


def inner_head(head: nn.Module) -> nn.Module:
    """The head module itself: ``head`` unless it is an FSDP1 wrapper (``FullyShardedDataParallel``
    put around the head by an ``auto_wrap_policy``), whose wrapped module is returned."""
    while isinstance(getattr(head, "_fsdp_wrapped_module", None), nn.Module):
        head = head._fsdp_wrapped_module
    return head


def head_shape(weight: Tensor) -> Optional[Tuple[int, ...]]:
    """The shape of the whole head weight, also while it is sharded: a DTensor's global shape, a
    ZeRO-3 parameter's ``ds_shape``; None for a flat FSDP1 shard (whose shape says nothing)."""
    ds_shape = getattr(weight, "ds_shape", None)
    if ds_shape is not None:
        return tuple(ds_shape)
    if is_dtensor(weight) or weight.dim() == 2:
        return tuple(weight.shape)
    return None


def _describe(weight: Tensor) -> str:
    mesh = weight.device_mesh
    names = getattr(mesh, "mesh_dim_names", None)
    return (f"placements {tuple(weight.placements)} on a {mesh.ndim}-D device mesh"
            + (f" {tuple(names)}" if names else "") + f" of {mesh.size()} ranks")


def tensor_parallel_shard(weight: Tensor, what: str = "lm_head.weight"):
    """(this rank's [V_local, H] shard as a differentiable plain tensor, the process group it is
    sharded over, or None when it is replicated) of a tensor-parallel DTensor head weight.

    Supported: ``Shard(0)`` (vocabulary rows, contiguous in rank order, uneven allowed) on a 1-D mesh,
    and ``Replicate()`` on any mesh. Anything else (``Shard(1)``: the hidden dimension, as
    ``RowwiseParallel`` gives; ``Partial``; strided shards; a vocabulary sharded over several mesh
    dimensions) raises ValueError naming the placement and what logitless supports instead.
    """
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), None
    if weight.device_mesh.ndim == 1 and len(placements) == 1 and type(placements[0]) is Shard \
            and placements[0].dim == 0:
        # to_local is differentiable: the shard's gradient becomes the DTensor parameter's, Shard(0)
        return weight.to_local(), weight.device_mesh.get_group()
    # on a mesh of several dimensions (data x tensor parallel, say) the head belongs to its 1-D tensor-parallel
    # submesh: a copy per data-parallel rank as a Replicate() placement would leave its gradient unreduced here
    submesh = (" On a mesh of several dimensions, parallelize the head over its 1-D tensor-parallel submesh "
               "(parallelize_module(model, mesh['tp'], ...))." if weight.device_mesh.ndim > 1 else "")
    raise ValueError(
        f"{what} is a DTensor with {_describe(weight)}: logitless computes a head sharded over the vocabulary "
        "only (Shard(0) of the [V, H] weight on a 1-D mesh, what torch's ColwiseParallel gives), or replicated. "
        "Shard the head with ColwiseParallel (or leave it out of the tensor-parallel plan) to use logitless, "
        f"or use the model's own logits.{submesh}")


def replicated(hidden: Tensor) -> Tensor:
    """``hidden`` as a plain tensor holding the whole of it on every rank (differentiably): a DTensor
    (e.g. the sequence-parallel output of a tensor-parallel model) is gathered; anything else is returned."""
    return hidden.full_tensor() if is_dtensor(hidden) else hidden


def is_zero3_partitioned(weight: Tensor) -> bool:
    """Whether ``weight`` is a parameter DeepSpeed ZeRO-3 partitions (it carries ZeRO's ``ds_*`` attributes)."""
    return getattr(weight, "ds_numel", None) is not None and hasattr(weight, "ds_status")


@contextlib.contextmanager
def whole_weight(head: nn.Module):
    """The whole [V, H] weight of a head that is read here but not trained (a distillation teacher's), as a plain
    tensor for the duration of the context, without gradient: an FSDP2 DTensor gathered (``full_tensor``), a
    DeepSpeed ZeRO-3 partition gathered (``GatheredParameters``, released again on exit), anything else as it is.
    Use it inside the op's call: a ZeRO-3 weight read after the context is a freed placeholder."""
    weight = inner_head(head).weight
    if is_zero3_partitioned(weight):
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield weight.detach()
        return
    yield replicated(weight).detach()


def _fsdp2_units_holding(owner: Optional[nn.Module], weight: Tensor) -> Sequence[nn.Module]:
    """The FSDP2 units inside ``owner`` (itself included) that hold ``weight``, outermost first."""
    if owner is None or _fsdp2_module_class() is None:
        return []
    return [m for m in owner.modules() if is_fsdp2_unit(m) and any(p is weight for p in m.parameters())]


def _refuse_fsdp2_shard(head_name: str, weight: Tensor, units: Sequence[nn.Module], owner: nn.Module) -> None:
    """ValueError for a head weight that FSDP2 holds but that is still a DTensor when the head runs."""
    unit = units[-1]   # the innermost unit holding it: the one that gathers it
    if unit is owner:
        # the model's own unit is gathered for its whole forward: a DTensor now is a tensor-parallel one
        raise ValueError(
            f"{head_name} is a DTensor ({_describe(weight)}) inside the running FSDP2 unit of the model: tensor "
            "parallelism shards the head as well, and logitless does not combine FSDP2 and tensor parallelism on the "
            "head. Shard the head with one of them: FSDP2 alone, or ColwiseParallel alone.")
    name = {id(m): n for n, m in owner.named_modules()}.get(id(unit), "?")
    raise ValueError(
        f"{head_name} is still sharded ({_describe(weight)}) when the head runs: it is held by the FSDP2 unit {name!r} "
        f"({type(unit).__name__}), which is not the head's own unit and resharded it after its own forward (a tied "
        "input embedding in its own unit with reshard_after_forward=True: the unfused head cannot run like this "
        "either). Keep the embedding and the tied head in one unit (the root, or fully_shard([embedding, head])), or "
        "fully_shard the embedding with reshard_after_forward=False.")


def check_layout(model: nn.Module, weight: Tensor, head_name: str = "lm_head.weight") -> None:
    """At set-up time: ValueError for a tensor-parallel head weight in a placement logitless does not
    compute (see :func:`tensor_parallel_shard`). A weight held by FSDP2 (a unit in ``model``) is a
    shard that the head's call gathers, and is not checked here."""
    if is_dtensor(weight) and not _fsdp2_units_holding(model, weight):
        tensor_parallel_shard(weight, head_name)


def call_head(head: nn.Module, hidden: Tensor, compute: Compute, *, owner: Optional[nn.Module] = None,
              head_name: str = "lm_head.weight") -> tuple:
    """``compute(hidden, weight, tp_group)`` run as the head's forward (see the module docstring).

    head: the output embedding as the model holds it (an FSDP1 wrapper, an FSDP2 / ZeRO-3 managed
        module, a tensor-parallel module, or a plain ``nn.Linear`` / ``nn.Embedding``).
    hidden: the head's input, the only argument the hooks see (they may cast it, e.g. FSDP2's mixed
        precision, exactly as for the unfused head); everything else ``compute`` needs is in its closure.
    compute: called once with (hidden as the head receives it, the gathered weight [V or V_local, H]
        as a plain tensor, the tensor-parallel group or None); returns a tuple of tensors / None.
    owner: the model holding the head, to name the FSDP2 unit in errors.
    Returns compute's tuple.
    """
    inner = inner_head(head)
    weight = inner.weight
    if inner is head and not is_fsdp2_unit(inner) and is_dtensor(weight):
        # Nobody will gather this weight when the head is called: a tensor-parallel shard, or a weight
        # held (and resharded) by another FSDP2 unit.
        units = _fsdp2_units_holding(owner, weight)
        if units:
            _refuse_fsdp2_shard(head_name, weight, units, owner)
        local, group = tensor_parallel_shard(weight, head_name)
        return tuple(compute(replicated(hidden), local, group))

    def forward(module, x):
        w = module.weight
        if is_dtensor(w):   # e.g. FSDP2 and tensor parallelism both on the head
            raise ValueError(f"{head_name} is a DTensor ({_describe(w)}) even inside the head's own call: "
                             "FSDP2 combined with tensor parallelism on the head is not supported by logitless. "
                             "Shard the head with one of them: FSDP2 alone, or ColwiseParallel alone.")
        if w.dim() != 2 or w.numel() == 0:
            raise ValueError(f"{head_name} has shape {tuple(w.shape)} inside the head's own call: whatever shards it "
                             "did not gather it for this call (logitless supports FSDP1, FSDP2, DeepSpeed ZeRO-3 "
                             "and tensor parallelism by ColwiseParallel)")
        return tuple(compute(x, w, None))

    had = "forward" in inner.__dict__
    previous = inner.__dict__.get("forward")
    inner.__dict__["forward"] = types.MethodType(forward, inner)
    try:
        return tuple(head(hidden))
    finally:
        if had:
            inner.__dict__["forward"] = previous
        else:
            del inner.__dict__["forward"]
