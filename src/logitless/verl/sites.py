"""The registry of verl sites logitless replaces: what a site is, what is installed now, and strict mode.

A leaf module: ``install.py`` (which replaces the sites) and the site lists of ``fsdp.py`` and
``megatron.py`` (whose replacements read ``strict_mode()`` and ``original()``) all import it, and it
imports none of them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..record import strict_enabled

MARK = "__logitless_verl__"
LOCK = threading.RLock()


@dataclass(frozen=True)
class Site:
    """One replaced attribute: ``module[.owner].attr``; ``make(original)`` builds the replacement."""
    name: str
    module: str
    owner: Optional[str]
    attr: str
    make: Callable
    what: str


class SiteState:
    installed: Dict[str, Tuple[object, object, object]] = {}   # name -> (owner, original, replacement)
    skipped: Dict[str, str] = {}
    strict: bool = False
    fused_loss: bool = False      # install(fused_loss=True): the engines' forward steps fuse the policy loss
    truncation: bool = False      # install(truncation=True): the actor's log-probs under the rollout's truncation


def strict_mode() -> bool:
    """Whether a verl fallback to its non-fused path raises: ``install(strict=True)`` or
    LOGITLESS_STRICT=1 (read at the time verl would fall back)."""
    return SiteState.strict or strict_enabled()


def original(name: str):
    """The verl function that site ``name`` replaced (while installed)."""
    return SiteState.installed[name][1]
