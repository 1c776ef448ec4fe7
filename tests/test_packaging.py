"""The extras admit only the versions the suite runs: for triton, transformers and trl, the test extra's pinned
version (what CI runs: triton's kernels under its interpreter, logitless.transformers and logitless.trl against
the real packages) satisfies every extra that names the package, and each bounds it to that minor release on both
sides, so a fresh install does not resolve to a version nothing tested (a fresh `pip install .[transformers]`
resolved transformers 5.25.0 while CI ran 5.24.0, and >=4.57 admitted releases nothing ran). README.md's extras
table says the same bounds."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def extra(name: str) -> dict:
    return {r.name: r for r in map(Requirement, EXTRAS[name])}


# package -> the extras that name it (every one is held to the tested minor release)
BOUNDED = {"triton": ["triton"], "transformers": ["transformers", "trl", "verl"], "trl": ["trl"]}


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
    assert f"`{written}`" in (ROOT / "README.md").read_text(), f"README.md's extras table does not say `{written}`"


def test_triton_extra_brings_numpy():
    assert "numpy" in extra("triton"), "triton's interpreter needs numpy"
