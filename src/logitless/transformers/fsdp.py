"""FSDP1 (``FullyShardedDataParallel``) around a transformers causal LM.

logitless reads ``lm_head.weight`` inside the causal LM's forward, but never calls the head module
itself. FSDP1 unshards a unit's parameters around *that unit's* forward, so the head weight is whole
only when it belongs to the root unit (whose forward is running); in a nested unit (e.g. an
``auto_wrap_policy`` that wraps ``nn.Linear`` or the embedding of a tied head) it stays a shard,
and reading it would score against a shard or freed storage. That case is refused by name.
"""
from __future__ import annotations

from typing import List

from torch import nn


def fsdp_units(model: nn.Module) -> List[nn.Module]:
    """Every FSDP1 unit in ``model`` (itself included), outermost first; [] without FSDP."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed support
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def check_head_in_root_unit(core: nn.Module) -> None:
    """ValueError naming FSDP when a unit nested inside the causal LM ``core`` owns the output
    embedding (or, for a tied head, the input embedding that holds its weight)."""
    nested = fsdp_units(core)
    if not nested:
        return
    get_out = getattr(core, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    owners = [("output embedding (lm_head)", head)] if head is not None else []
    get_in = getattr(core, "get_input_embeddings", None)
    embed = get_in() if callable(get_in) else None
    cfg = getattr(core, "config", None)
    tied = getattr(cfg, "tie_word_embeddings", False) or (
        head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0))
    if tied and embed is not None:
        owners.append(("input embedding (holding lm_head's tied weight)", embed))
    for unit in nested:
        inside = set(map(id, unit.modules()))
        for what, owner in owners:
            if id(owner) in inside:
                raise ValueError(
                    f"{type(core).__name__}'s {what} is in its own FSDP (FullyShardedDataParallel) unit; "
                    "logitless reads the head weight without calling that unit, so it would stay sharded. "
                    "Keep lm_head (and a tied embedding) in the root FSDP unit, e.g. leave nn.Linear / "
                    "nn.Embedding out of auto_wrap_policy.")
