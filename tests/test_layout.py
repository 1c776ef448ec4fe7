"""The import structure of the package: no circles, and nothing imports upward.

Every ``import`` / ``from ... import`` in src/logitless is read with ``ast`` (module level, inside functions
and under ``TYPE_CHECKING`` alike: a lazy import still ties two modules together), resolved to a module of
the package, and checked against the layers below. docs/development.md draws the same graph.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "logitless"

# lowest first; a module may import from its own layer or any layer below, never from above
LAYERS = [
    ["logitless.checks", "logitless.knobs", "logitless.record"],
    ["logitless.parallel", "logitless.sharded_head"],   # torch.distributed layouts: vocab shards, sharded heads
    ["logitless.ops"],
    ["logitless.api", "logitless.topk", "logitless.truncation"],
    ["logitless.losses"],
    ["logitless.transformers", "logitless.megatron"],
    ["logitless.trl", "logitless.verl"],
    ["logitless.tools", "logitless"],       # the package's face (__init__) and the command-line tools
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (``from . import x`` resolves to the submodule x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:     # `import logitless.ops.maths as m` -> that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer_of(name: str) -> int:
    best, where = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    assert where is not None, f"{name} is in no layer of tests/test_layout.py"
    return where


def test_the_graph_is_read():
    g = graph()
    # a reader that found nothing would pass everything: pin a few known edges
    assert "logitless.ops.function" in g["logitless.api"]
    assert "logitless.record" in g["logitless.ops.function"]
    assert "logitless.ops.policy_terms" in g["logitless.ops.triton.policy_terms"]
    assert len(g) > 50


def test_no_import_circles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_nothing_imports_upward():
    g = graph()
    upward = [f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})"
              for a, targets in sorted(g.items()) for b in sorted(targets)
              if b != "logitless" and layer_of(b) > layer_of(a)]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, expected", [
    ("from ..record import last_backend", {"logitless.record"}),
    ("from . import checks", {"logitless.checks"}),
    ("from .ops import function", {"logitless.ops.function"}),
    ("import logitless.ops.maths as m", {"logitless.ops.maths"}),
])
def test_import_resolution(tmp_path, source, expected):
    mods = modules()
    fake = tmp_path / "x.py"
    fake.write_text(source)
    name = "logitless.losses.x" if source.startswith("from ..") else "logitless.x"
    assert imports_of(name, fake, set(mods) | {name}) == expected


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def private_uses(path: Path) -> list[str]:
    """What a benchmark script takes from logitless beyond its stable surface: a kernel module other than
    ``ops/triton/stages.py``, or a name with a leading underscore (imported, or read off an imported module)."""
    tree = ast.parse(path.read_text(), str(path))
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("logitless"):
                    bound.add(alias.asname or alias.name.split(".")[0])
                    if alias.name.startswith("logitless.ops.triton.") and alias.name != "logitless.ops.triton.stages":
                        found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logitless"):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                full = f"{node.module}.{alias.name}"
                kernel = full.startswith("logitless.ops.triton.") and not full.startswith("logitless.ops.triton.stages")
                if alias.name.startswith("_") or kernel:
                    found.append(f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in bound):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_benchmarks_use_the_stable_surface():
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) > 5
    used = {p.name: private_uses(p) for p in scripts}
    assert not {k: v for k, v in used.items() if v}, f"benchmark scripts reach past the stable surface: {used}"


@pytest.mark.parametrize("source", [
    "from logitless.ops.triton import policy_stats_gluon",
    "import logitless.ops.triton.combine",
    "from logitless.losses.api import _reference",
    "import logitless.losses.api as api\napi._reference = None",
])
def test_private_uses_are_seen(tmp_path, source):
    script = tmp_path / "bench.py"
    script.write_text(source)
    assert private_uses(script)


def drawn_graphs() -> list[dict[str, set[str]]]:
    """The ```text drawings under docs/development.md's "The import graph", as {node: its arrows}."""
    text = (SRC.parent / "docs" / "development.md").read_text()
    section = text.split("## The import graph", 1)[1].split("\n## ", 1)[0]
    drawings = []
    for block in section.split("```text\n")[1:]:
        drawn: dict[str, set[str]] = {}
        for line in block.split("```", 1)[0].splitlines():
            line = line.split("  (", 1)[0].strip()          # a comment in parentheses after two spaces
            left, _, right = line.partition("->")
            names = [n.strip() for n in left.split(",") if n.strip()]
            for name in names:
                drawn.setdefault(name, set()).update(n.strip() for n in right.split(",") if n.strip())
        drawings.append(drawn)
    return drawings


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "logitless"


def test_the_drawings_in_development_md_are_the_code():
    g = graph()
    packages, ops_edges = drawn_graphs()
    real: dict[str, set[str]] = {package_of(m): set() for m in g}
    for a, targets in g.items():
        for b in targets:
            if package_of(a) != package_of(b):
                real[package_of(a)].add(package_of(b))
    assert packages == real, f"docs/development.md's package graph is not the code's:\ndrawn {packages}\ncode  {real}"
    # inside ops/: every import between the triton subpackage and the rest of ops/, module by module
    crossing: dict[str, set[str]] = {}
    for a, targets in g.items():
        for b in targets:
            if a.startswith("logitless.ops.") and b.startswith("logitless.ops."):
                if a.startswith("logitless.ops.triton.") != b.startswith("logitless.ops.triton."):
                    crossing.setdefault(a.removeprefix("logitless."), set()).add(b.removeprefix("logitless."))
    assert ops_edges == crossing, f"docs/development.md's ops/ drawing is not the code's:\ndrawn {ops_edges}\n" \
                                  f"code  {crossing}"
