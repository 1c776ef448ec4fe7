"""FSDP1 (``FullyShardedDataParallel``) around a transformers causal LM.

logitless calls the head module to compute the fused op (``logitless.sharded_head``), so a head in the
root unit (unsharded for the root's whole forward) and a head in its own unit (an ``auto_wrap_policy``
that wraps ``nn.Linear``: its wrapper's call unshards it) both work. A *tied* head whose weight is held
by the input embedding's own unit does not: that unit reshards after the embedding's forward, before the
head runs, and FSDP1 gives the head no hook to gather it again. That case is refused by name.
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
    """ValueError naming FSDP when a unit nested inside the causal LM ``core`` owns the input embedding
    that holds a tied head's weight."""
    nested = fsdp_units(core)
    if not nested:
        return
    get_out = getattr(core, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    get_in = getattr(core, "get_input_embeddings", None)
    embed = get_in() if callable(get_in) else None
    cfg = getattr(core, "config", None)
    tied = getattr(cfg, "tie_word_embeddings", False) or (
        head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0))
    if not tied or embed is None:
        return
    for unit in nested:
        inside = set(map(id, unit.modules()))
        if id(embed) in inside and (head is None or id(head) not in inside):
            raise ValueError(
                f"{type(core).__name__}'s input embedding, which holds lm_head's tied weight, is in its own FSDP "
                "(FullyShardedDataParallel) unit: that unit reshards the weight after the embedding's forward, "
                "before the head runs. Keep the tied embedding in the root FSDP unit (leave nn.Embedding out of "
                "auto_wrap_policy), or wrap it together with lm_head.")
