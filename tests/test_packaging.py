"""What an install admits, held to what runs.

- transformers and trl: the test extra's pinned version (what CI runs logitless.transformers and logitless.trl
  against) satisfies every extra that names the package, and each bounds it to that minor release on both sides,
  so a fresh install does not resolve to a version nothing tested (a fresh `pip install .[transformers]` resolved
  transformers 5.25.0 while CI ran 5.24.0).
- triton: the extra admits the triton of every supported torch (2.11 to 2.15, whose CUDA wheels depend on their
  own triton), so installing logitless[triton] never replaces the user's torch (`triton>=3.6,<3.7` made pip replace
  torch 2.14.1 by 2.13.0). CI runs the oldest and the newest pair it can reach (the Makefile's .venv and
  .venv-newest); README.md says the range and both pairs.
- In the environment the suite runs in, installing logitless[triton]'s requirements changes no package that is
  already there (pip's own resolver, --dry-run).
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
MAKEFILE = (ROOT / "Makefile").read_text()
README = (ROOT / "README.md").read_text()


def extra(name: str) -> dict:
    return {r.name: r for r in map(Requirement, EXTRAS[name])}


# package -> the extras that name it (every one is held to the tested minor release)
BOUNDED = {"transformers": ["transformers", "trl", "verl"], "trl": ["trl"]}


@pytest.mark.parametrize("package", list(BOUNDED))
def test_extras_are_bounded_to_the_tested_version(package):
    pinned = [s for s in extra("test")[package].specifier if s.operator == "=="]
    assert len(pinned) == 1, f"the test extra pins one {package} version (the one CI runs)"
    tested = Version(pinned[0].version)
    below = Version(f"{tested.major}.{tested.minor - 1}") if tested.minor else Version(f"{tested.major - 1}.999")
    next_minor = Version(f"{tested.major}.{tested.minor + 1}")
    for name in BOUNDED[package]:
        admitted = extra(name)[package].specifier
        assert admitted.contains(tested), f"the {name} extra ({admitted}) refuses the tested {package} {tested}"
        assert not admitted.contains(next_minor), f"the {name} extra admits {package} {next_minor}: nothing tests it"
        assert not admitted.contains(below), f"the {name} extra admits {package} {below}: nothing tests it"
    written = next(r for r in EXTRAS[package] if Requirement(r).name == package)
    assert f"`{written}`" in README, f"README.md's extras table does not say `{written}`"


def test_triton_extra_brings_numpy():
    assert "numpy" in extra("triton"), "triton's interpreter needs numpy"


# the triton each supported torch's CUDA wheel depends on (its metadata's Requires-Dist), oldest to newest
TORCH_SHIPS = {"2.11": "3.6.0", "2.13": "3.7.1", "2.14": "3.8.0", "2.15": "3.9.0"}


def make_pin(variable: str) -> Version:
    """The version a Makefile variable pins (``TORCH ?= torch==2.13.0``)."""
    m = re.search(rf"^{variable} \?= \w+==([\w.+]+)$", MAKEFILE, re.M)
    assert m, f"the Makefile pins no {variable}"
    return Version(m.group(1))


def ci_pairs() -> list[tuple[Version, Version]]:
    """(torch, triton) of CI's two environments: .venv (TORCH, the test extra's triton) and .venv-newest."""
    [oldest_triton] = [s for s in extra("test")["triton"].specifier if s.operator == "=="]
    return [(make_pin("TORCH"), Version(oldest_triton.version)),
            (make_pin("NEWEST_TORCH"), make_pin("NEWEST_TRITON"))]


def test_triton_extra_admits_what_every_supported_torch_ships():
    admitted = extra("triton")["triton"].specifier
    torch_needs = {r.name: r for r in map(Requirement, PROJECT["dependencies"])}["torch"].specifier
    for torch_minor, triton in TORCH_SHIPS.items():
        assert torch_needs.contains(f"{torch_minor}.0"), f"torch {torch_minor} is supported: {torch_needs} refuses it"
        assert admitted.contains(triton), f"torch {torch_minor} ships triton {triton}; the extra ({admitted}) " \
                                          "refuses it, so pip would replace the user's torch"
    assert not admitted.contains("3.5.1"), "triton 3.5 is older than any supported torch's"
    assert not admitted.contains("3.10.0"), "no supported torch ships triton 3.10: nothing tests it"
    assert not torch_needs.contains("2.10.0")
    written = next(r for r in EXTRAS["triton"] if Requirement(r).name == "triton")
    assert f"`{written}`" in README, f"README.md's extras table does not say `{written}`"


def test_ci_runs_the_oldest_and_the_newest_pair():
    (old_torch, old_triton), (new_torch, new_triton) = ci_pairs()
    admitted = extra("triton")["triton"].specifier
    assert old_torch < new_torch and old_triton < new_triton
    assert old_triton == Version(min(TORCH_SHIPS.values(), key=Version)), "CI's oldest triton is the oldest shipped"
    # the newest pair is what that torch release ships, not a triton put beside it
    assert new_triton == Version(TORCH_SHIPS[f"{new_torch.major}.{new_torch.minor}"])
    for torch_v, triton_v in ci_pairs():
        assert admitted.contains(triton_v)
        assert f"torch {torch_v.public} + triton {triton_v}" in " ".join(README.split()), \
            f"README.md does not say that CI runs torch {torch_v.public} + triton {triton_v}"
    # CI (`make test`) runs the newest pair's tests after the whole suite
    assert re.search(r"^test: .*\n(\t.*\n)*\t\$\(MAKE\) test-newest$", MAKEFILE, re.M)


def test_installing_the_triton_extra_changes_nothing_installed(tmp_path):
    """pip's resolver, asked for logitless[triton]'s requirements in this environment (CI: torch 2.13.0 + triton
    3.6.0, and torch 2.14.1 with the triton it brought), installs nothing: above all it does not replace torch. With
    everything already satisfied pip needs no package index."""
    import torch
    report = tmp_path / "report.json"
    requirements = [*PROJECT["dependencies"], *EXTRAS["triton"]]
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                          "--report", str(report), *requirements], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    would = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "torch" not in would, f"logitless[triton] would replace torch {torch.__version__} by {would['torch']}"
    if importlib.util.find_spec("triton") is not None:
        assert "triton" not in would, f"logitless[triton] would replace the installed triton by {would['triton']}"
