"""Every ```python block of README.md and docs/*.md runs, as written, on fresh random inputs.

A block runs in its own namespace in this process. A marker line right before the fence says what else it
needs, and the block runs where the suite has it or is skipped with that reason:

    <!-- requires: cuda -->          a CUDA GPU
    <!-- requires: megatron -->      megatron-core (importable)
    <!-- requires: verl -->          verl (importable)
    <!-- requires: trl -->           trl (importable)
    <!-- requires: multiprocess -->  run as a script by 2 processes (torchrun-style environment: RANK,
                                     WORLD_SIZE, MASTER_ADDR, MASTER_PORT); gloo on CPU

Several markers may be given, comma-separated (``<!-- requires: megatron, multiprocess -->``).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from required import import_or_skip

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*requires:\s*([\w ,-]+?)\s*-->\s*$")
KNOWN = {"cuda", "megatron", "verl", "trl", "multiprocess"}


def blocks():
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            needs = {n.strip() for n in marker.group(1).split(",")} if marker else set()
            found.append(pytest.param(m.group(1), needs, id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def missing(needs: set[str]) -> str | None:
    """Why a block cannot run here (None: it can). A missing integration package is a skip, except under
    LOGITLESS_REQUIRE_INTEGRATIONS=1 (what `make test` sets), where it fails like the integration suites."""
    unknown = needs - KNOWN
    assert not unknown, f"unknown requires marker {unknown}; known: {sorted(KNOWN)}"
    if "cuda" in needs and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    for module, name in (("megatron.core", "megatron"), ("verl", "verl"), ("trl", "trl")):
        if name in needs:
            import_or_skip(module, f"the block needs {name}")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a port taken between free_port() and the ranks' bind (other processes on the machine): start again, new port
PORT_TAKEN = ("address already in use", "EADDRINUSE")


def run_ranks(code: str, tmp_path: Path, world: int = 2, attempts: int = 3) -> None:
    script = tmp_path / "block.py"
    # a fresh seed per run, the same on every rank (a block may rely on ranks building the same model)
    # The block's last line destroys its group; the rank then leaves without interpreter finalization. A
    # block's module globals (a DeviceMesh, an FSDP2 model) hold gloo process groups; freed during
    # finalization, their worker threads aborted the process about 1 exit in 30 ("terminate called without an
    # active exception", no Python frame left: torch's teardown after every assertion had passed).
    exit_now = "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"
    script.write_text(f"import torch\ntorch.manual_seed({int.from_bytes(os.urandom(4), 'little')})\n" + code
                      + exit_now)
    for attempt in range(attempts):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        failed = [(r, p.returncode, out) for r, (p, out) in enumerate(zip(procs, outs, strict=True)) if p.returncode]
        if not failed:
            return
        if attempt + 1 < attempts and any(m in out for _, _, out in failed for m in PORT_TAKEN):
            continue
        r, code_, out = failed[0]
        others = "".join(f"\n--- rank {q} (exit {c}):\n{o[-1500:]}" for q, c, o in failed[1:])
        raise AssertionError(f"rank {r} exited with {code_}:\n{out[-3000:]}{others}")


def test_every_page_has_blocks():
    # a reader that found nothing would pass everything
    assert len(blocks()) >= 10
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024, "README.md is over 15 KB: move detail into docs/"


@pytest.mark.parametrize("code, needs", blocks())
def test_block_runs(code, needs, tmp_path, monkeypatch):
    reason = missing(needs)
    if reason:
        pytest.skip(reason)
    if "multiprocess" in needs:
        run_ranks(code, tmp_path)
        return
    monkeypatch.chdir(tmp_path)         # a block that writes files writes them here
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    printed = run_block(code)
    check_printed_numbers(printed)


# a printed number with a fraction or an exponent (a loss, a metric), or a non-finite one
PRINTED_FLOAT = re.compile(r"(?<![\w.])-?(?:\d+\.\d*(?:e[-+]?\d+)?|\d+e[-+]?\d+|nan|inf)(?![\w.])", re.I)


def run_block(code: str, namespace: dict | None = None) -> str:
    """Run a block in ``namespace`` (a fresh one by default); return what it printed (also echoed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"} if namespace is None else namespace)
    sys.stdout.write(out.getvalue())
    return out.getvalue()


def check_printed_numbers(printed: str) -> None:
    """What a page shows must mean something: every number a block prints is finite and of a sensible size (a
    loss of 6.6e7 from mismatched temperatures printed without a word once)."""
    for text in PRINTED_FLOAT.findall(printed):
        value = float(text)
        assert math.isfinite(value) and abs(value) < 1e3, f"a block printed {text}:\n{printed}"


def test_readme_quick_start_prints_the_loss_it_computes():
    """The quick start's printed loss is the policy loss of its inputs recomputed through fused_logprobs and
    autograd, and its clip fraction 0 (its old log-probs are this policy's, at the same temperature)."""
    from logitless.losses import policy_loss_reference
    code = next(c for c, _ in (p.values[:2] for p in blocks()) if "fused_policy_loss(hidden, weight" in c)
    ns = {"__name__": "__doc_block__"}
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    printed = run_block(code, ns).strip().splitlines()[-1].split()
    loss, clip_fraction = float(printed[0]), float(printed[1])
    want = policy_loss_reference(ns["hidden"].detach(), ns["weight"].detach(), ns["labels"], ns["advantages"],
                                 ns["out"].logprobs.detach(), entropy_coef=0.01, temperature=0.7)
    assert abs(loss - float(want.loss)) <= 1e-5 * max(1.0, abs(float(want.loss)))
    assert clip_fraction == 0.0 and abs(loss) < 10.0


def _readme_block(marker: str) -> str:
    return next(p.values[0] for p in blocks() if marker in p.values[0] and p.id.startswith("README.md:"))


def test_readme_distillation_block_prints_the_loss_of_its_inputs():
    """The front page's full-vocabulary distillation block prints the JSD loss and the student's mean entropy of
    its inputs, recomputed in float64 from the definitions (tests/distill64.py)."""
    from distill64 import divergence64, head_logits64
    ns = {"__name__": "__doc_block__"}
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    loss, entropy = map(float, run_block(_readme_block("divergence=\"jsd\""), ns).split())
    valid = ns["labels"] != -100
    inv_t = torch.full(ns["labels"].shape, 1 / 0.9, dtype=torch.float64)
    ls = torch.log_softmax(head_logits64(ns["student_hidden"].detach(), ns["student_weight"].detach(), inv_t), -1)
    lt = torch.log_softmax(head_logits64(ns["teacher_hidden"], ns["teacher_weight"], inv_t), -1)
    want = divergence64(ls, lt, "jsd", 0.5)[valid].mean()
    want_entropy = -(ls.exp() * ls).sum(-1)[valid].mean()
    assert 0.0 < want < math.log(2)
    assert abs(loss - float(want)) <= 1e-5 * float(want) + 1e-7
    assert abs(entropy - float(want_entropy)) <= 1e-5 * float(want_entropy)
    assert ns["student_hidden"].grad is not None and ns["student_weight"].grad is not None


def test_readme_topk_block_prints_the_teachers_top_k_and_the_loss():
    """The front page's top-k block: fused_topk's ids are the float64 top-k, the printed top-k mass is theirs, mass
    plus tail is 1, and the printed loss is verl's forward_kl_topk of the inputs (float64, no clamp)."""
    ns = {"__name__": "__doc_block__"}
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    code = _readme_block("fused_topk(")
    # the teacher's head, kept: the block builds it inline
    code = code.replace("fused_topk(torch.randn(2, 7, 64), torch.randn(V, 64) / 8, 8)",
                        "fused_topk(t_hidden := torch.randn(2, 7, 64), t_weight := torch.randn(V, 64) / 8, 8)")
    assert "t_hidden :=" in code, "the README's top-k block changed: update this test"
    mass, total, loss = map(float, run_block(code, ns).split())
    lt = torch.log_softmax(ns["t_hidden"].double() @ ns["t_weight"].double().t(), -1)
    top, ids = lt.topk(8, dim=-1)
    assert torch.equal(ns["teacher"].ids, ids)
    assert abs(mass - float(top.exp().sum(-1).mean())) <= 1e-5
    assert abs(total - 1.0) <= 1e-5
    ls = torch.log_softmax(ns["hidden"].detach().double() @ ns["weight"].detach().double().t(), -1)
    q = ns["teacher"].logprobs.double()
    want = (q.exp() * (q - ls.gather(-1, ids))).sum(-1).clamp_min(0).mean()
    assert abs(loss - float(want)) <= 1e-5 * max(1.0, float(want))


# README's API section: each function's signature in a ```text block and its argument table
SIGNATURE = re.compile(r"^```text\n(logitless[\w.]*)\.(\w+)(\(.*?)\n```", re.M | re.S)


def readme_api():
    import importlib
    text = (ROOT / "README.md").read_text()
    found = {}
    for m in SIGNATURE.finditer(text):
        module, name, written = m.group(1), m.group(2), m.group(3)
        section = text[m.end():].split("\n### ", 1)[0].split("\n## ", 1)[0]
        found[name] = (getattr(importlib.import_module(module), name), written, section)
    return found


@pytest.mark.parametrize("name", ["fused_logprobs", "fused_policy_loss"])
def test_readme_signature_and_table_match_the_code(name):
    import ast
    import inspect
    api = readme_api()
    assert name in api, f"README.md has no ```text signature block for {name}"
    fn, written, section = api[name]
    node = ast.parse(f"def {name}{written}: pass").body[0]
    args = node.args
    # what README.md writes: (name, kind, default) in order, and the return type
    wrote = [(a.arg, "positional", None) for a in args.posonlyargs + args.args]
    defaults = [ast.literal_eval(d) for d in args.defaults]
    for i, value in enumerate(defaults):
        wrote[len(wrote) - len(defaults) + i] = (wrote[len(wrote) - len(defaults) + i][0], "positional", value)
    wrote += [(a.arg, "keyword", None if d is None else ast.literal_eval(d))
              for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        wrote.append((args.kwarg.arg, "**", None))
    sig = inspect.signature(fn)
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional", inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "**"}
    real = [(p.name, kinds[p.kind], None if p.default is inspect.Parameter.empty else p.default)
            for p in sig.parameters.values()]
    assert wrote == real, f"README.md's signature of {name} differs from the code:\n{wrote}\n{real}"
    assert ast.unparse(node.returns) == str(sig.return_annotation)
    # every argument has its row in the table that follows
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    missing = [p for p, kind, _ in real if f"`{'**' if kind == '**' else ''}{p}`" not in table]
    assert not missing, f"README.md's table for {name} has no row for {missing}"


def test_knobs_page_lists_every_environment_variable():
    """docs/knobs.md names every LOGITLESS_* variable the library reads (all in knobs.py, the tile knobs by stage
    name) and none that nothing reads."""
    knobs = (ROOT / "src" / "logitless" / "knobs.py").read_text()
    stages = set(re.findall(r'(?:choose_tiles|triton_tiles)\("(\w+)"', "\n".join(
        p.read_text() for p in (ROOT / "src" / "logitless" / "ops" / "triton").glob("*.py"))))
    assert stages >= {"FWD", "BWD", "POLICY", "TOPK", "ABOVE"}, stages
    # whole names only (not the f-string prefix of the tile knobs)
    read = set(re.findall(r"LOGITLESS_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_{])", knobs))
    read |= {f"LOGITLESS_TRITON_{s}" for s in stages}
    elsewhere = [p for p in (ROOT / "src").rglob("*.py") if p.name != "knobs.py"
                 and re.search(r"environ[^\n]*LOGITLESS_|getenv\([^)]*LOGITLESS_|_ints?\(\s*\"LOGITLESS_",
                               p.read_text())]
    assert not elsewhere, f"LOGITLESS_* read outside knobs.py: {elsewhere}"
    page = (ROOT / "docs" / "knobs.md").read_text()
    documented = set(re.findall(r"LOGITLESS_[A-Z0-9_]*[A-Z0-9]", page))
    assert read - documented == set(), f"docs/knobs.md does not list {sorted(read - documented)}"
    test_only = {"LOGITLESS_REQUIRE_INTEGRATIONS", "LOGITLESS_SEED"}      # read by the test suite, said so there
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    assert all(name in tests_text for name in test_only)
    assert documented - read - test_only == set(), f"docs/knobs.md lists {sorted(documented - read - test_only)}, " \
                                                   "which nothing reads"
