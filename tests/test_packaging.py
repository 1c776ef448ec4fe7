"""The ``triton`` extra admits only the triton versions the suite runs: the test extra's pinned triton (what CI
runs the kernels on, under the interpreter) satisfies it, and it has an upper bound, so a fresh install does not
resolve to a newer triton nothing tested. README.md's extras table says the same bound."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def extra(name: str) -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["optional-dependencies"][name])}


def test_triton_extra_is_bounded_to_the_tested_version():
    admitted = extra("triton")["triton"].specifier
    pinned = [s for s in extra("test")["triton"].specifier if s.operator == "=="]
    assert len(pinned) == 1, "the test extra pins one triton version (the one CI runs)"
    tested = Version(pinned[0].version)
    assert admitted.contains(tested), f"the triton extra ({admitted}) refuses the tested triton {tested}"
    upper = [s for s in admitted if s.operator in ("<", "<=")]
    assert upper, f"the triton extra ({admitted}) has no upper bound: it would resolve to untested versions"
    next_minor = Version(f"{tested.major}.{tested.minor + 1}")
    assert not admitted.contains(next_minor), f"the triton extra admits {next_minor}, which nothing tests"
    assert "numpy" in extra("triton"), "triton's interpreter needs numpy"
    written = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                   ["triton"] if r.startswith("triton"))
    assert f"`{written}`" in (ROOT / "README.md").read_text(), f"README.md's extras table does not say `{written}`"
