"""``install()`` / ``uninstall()``: which verl functions logitless replaces, and how they are put back.

Every replacement is one attribute of a verl module or class (a *site*). ``install`` imports the
module, keeps the attribute's current value and sets logitless' function in its place;
``uninstall`` puts every kept value back. Sites whose module does not import (megatron-core not
installed, say) are skipped and listed with the reason by ``sites()``.

Every site is looked up by verl at call time (a module global, a class attribute, or a module
attribute imported inside the calling function), so ``install`` takes effect for models verl has
already built as well as for later ones. The strict checks act where verl decides on the fused
path, i.e. when it builds or patches a model: install before that for them to apply.
"""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

from .. import checks
from .sites import LOCK, MARK, Site, SiteState


def _all_sites() -> Tuple[Site, ...]:
    from . import fsdp, fused_loss, megatron, megatron_loss, truncation
    return fsdp.SITES + fused_loss.SITES + megatron.SITES + megatron_loss.SITES + truncation.SITES


def _owner(site: Site):
    module = importlib.import_module(site.module)
    owner = module if site.owner is None else getattr(module, site.owner)
    if site.attr not in vars(owner):
        raise AttributeError(f"{site.module}.{site.owner + '.' if site.owner else ''}{site.attr} does not exist "
                             "in this verl release")
    return owner


def install(strict: bool = False, fused_loss: bool = False, truncation: bool = False) -> Tuple[str, ...]:
    """Route verl's fused-kernel paths through logitless. Idempotent; calling it again only updates
    ``strict``, ``fused_loss`` and ``truncation``. Returns the names of the replaced sites (see ``sites()``).

    strict: True makes verl's silent fallbacks to its non-fused path raise
        ``logitless.FusedPathUnavailable`` (so does LOGITLESS_STRICT=1).
    fused_loss: True makes the actor's policy loss (with its KL loss and entropy bonus) run as one
        ``fused_policy_loss`` inside the model's forward (see ``logitless.verl.fused_loss``); False
        leaves verl's loss on the log-probs logitless computes.
    truncation: True makes the actor's log-probs (old, reference and the update's current ones) those of the
        rollout's truncated distribution: ``actor_rollout_ref.rollout.top_k`` / ``top_p``, read from each
        worker's config when it computes them (see ``logitless.verl.truncation``; docs/verl.md). With
        ``fused_loss`` on verl's FSDP engine the fused loss is the truncated distribution's; verl's Megatron
        engine refuses that pair at its first training micro-batch (ValueError).
    """
    checks.boolean(strict, "strict")
    checks.boolean(fused_loss, "fused_loss")
    checks.boolean(truncation, "truncation")
    try:
        importlib.import_module("verl")
    except Exception as exc:  # noqa: BLE001 - any failure means verl cannot be used here
        raise ImportError(f"logitless.verl.install: verl does not import ({type(exc).__name__}: {exc})") from exc
    with LOCK:
        SiteState.strict = strict
        SiteState.fused_loss = fused_loss
        # Import every site's module before replacing anything: a module that imports a replaced
        # function by name (model_forward_fused imports the kernel's linear_cross_entropy) must bind
        # verl's original, not logitless' replacement.
        owners = {}
        for site in _all_sites():
            if site.name in SiteState.installed:
                continue
            try:
                owners[site.name] = _owner(site)
            except Exception as exc:  # noqa: BLE001 - e.g. megatron-core missing: that site cannot be used
                SiteState.skipped[site.name] = f"{type(exc).__name__}: {exc}"
        for site in _all_sites():
            owner = owners.get(site.name)
            if owner is None:
                continue
            original = vars(owner)[site.attr]
            if getattr(original, MARK, None) in SiteState.installed:
                # bound by name to another site's replacement: keep verl's own function as the original
                original = SiteState.installed[getattr(original, MARK)][1]
            replacement = site.make(original)
            setattr(replacement, MARK, site.name)
            setattr(owner, site.attr, replacement)
            SiteState.installed[site.name] = (owner, original, replacement)
            SiteState.skipped.pop(site.name, None)
        if truncation:
            missing = [name for name in _truncation_sites() if name not in SiteState.installed]
            if missing:
                SiteState.truncation = False
                raise ImportError(f"install(truncation=True): {', '.join(missing)} could not be replaced "
                                  f"({SiteState.skipped.get(missing[0], 'not installed')})")
        SiteState.truncation = truncation
        return tuple(SiteState.installed)


def _truncation_sites() -> Tuple[str, ...]:
    from . import truncation
    return tuple(site.name for site in truncation.SITES)


def uninstall() -> None:
    """Put back every original verl function that ``install`` replaced (a no-op when not installed)."""
    with LOCK:
        for name in list(SiteState.installed)[::-1]:
            owner, original, _ = SiteState.installed.pop(name)
            setattr(owner, _site_attr(name), original)
        SiteState.skipped.clear()
        SiteState.strict = False
        SiteState.fused_loss = False
        SiteState.truncation = False


def _site_attr(name: str) -> str:
    return next(s.attr for s in _all_sites() if s.name == name)


def is_installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(SiteState.installed)


def sites() -> Dict[str, str]:
    """Every site logitless knows, with its state: "installed: <what it replaces>", "skipped: <why>"
    (its module did not import) or "not installed"."""
    out = {}
    for site in _all_sites():
        if site.name in SiteState.installed:
            out[site.name] = f"installed: {site.what}"
        elif site.name in SiteState.skipped:
            out[site.name] = f"skipped: {SiteState.skipped[site.name]}"
        else:
            out[site.name] = "not installed"
    return out
