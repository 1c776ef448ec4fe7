"""Every Triton / Gluon kernel the library launches builds for sm_90 (H100 / H200), checked on a CPU.

The rest of the suite runs the kernels in triton's interpreter, which accepts code that triton's compiler refuses
(a name annotated ``tl.constexpr`` bound again in a ``tl.static_range`` loop ran there, while every bf16x3 / bf16x6
product failed to compile on an H100). Here a child process (``sm90_launches``, without TRITON_INTERPRET) drives the
public ops with the host code's GPU choices (block sizes, bulk-copy descriptors, the Gluon kernel, compile-time
switches; ``sm90_drive`` lists the calls: dtypes, precisions, softcap, policy-loss settings, distillation, k labels,
model-sized heads), records each launch's build as triton's launcher keys it for sm_90, and builds every distinct one
through the nvidia backend's TTIR and TTGIR passes (the Hopper layouts, wgmma and pipelining). Deeper stages (LLVM IR,
PTX, cubin with ptxas, and each build's shared memory) take minutes more:
``cd tests/ops && env -u TRITON_INTERPRET python -m sm90_launches --stage cubin``.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")

import triton  # noqa: E402

from logitless.ops.triton import policy_stats_gluon  # noqa: E402

GLUON = "logitless.ops.triton.policy_stats_gluon._policy_stats_gluon_kernel"
# The Gluon kernel is launched only on the triton releases it was checked with on a GPU (CHECKED_TRITON; Gluon's
# API changes between releases): on any other (triton 3.8 with torch 2.14) the ops keep the Triton kernel and never
# launch it, so the drive cannot either
GLUON_IN_USE = triton.__version__.startswith(policy_stats_gluon.CHECKED_TRITON)

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src" / "logitless"
STAGE = "ttgir"      # llir, ptx, cubin: minutes more (run sm90_launches by hand, see above)
SHARED_PER_BLOCK = 232448     # bytes, H100 and H200


def _child(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *sys.path])
    out = subprocess.run([sys.executable, "-m", "sm90_launches", "--stage", STAGE, *args], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def launches() -> dict:
    found = _child()
    print(f"{len(found['builds'])} builds; drive {found['drive_s']:.0f} s, total {found['seconds']:.0f} s")
    return found


def test_every_launch_builds_for_sm90(launches):
    failed = [f"{b['kernel']} {b['constexprs']} {b['signature']} (from {b['cases'][0]}):\n{b['error']}"
              for b in launches["builds"] if b["error"]]
    assert not failed, f"{len(failed)} of {len(launches['builds'])} builds fail for sm_90:\n" + "\n\n".join(failed)
    if STAGE in ("llir", "ptx", "cubin"):
        # by hand only (STAGE above; minutes): from LLVM IR on each build fits one block's shared memory on an
        # H100 / H200. At CI's ttgir no build has a shared-memory size yet, so CI does not run this check
        assert all(b["shared"] is not None for b in launches["builds"])
        too_big = [(b["kernel"], b["constexprs"], b["shared"]) for b in launches["builds"]
                   if b["shared"] > SHARED_PER_BLOCK]
        assert not too_big, too_big


def _jit_functions() -> dict:
    """{module.function: the names its body reads} of every @triton.jit / @gluon.jit function under src/."""
    found = {}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if ".jit" not in text:
            continue
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).split("(")[0].endswith(".jit") for d in node.decorator_list):
                found[f"{module}.{node.name}"] = {n.id for stmt in node.body for n in ast.walk(stmt)
                                                  if isinstance(n, ast.Name)}
    return found


def test_every_kernel_in_src_is_launched(launches):
    """A kernel (a jit function no other jit function calls or hands to a warp partition) that the drive never
    launches is not checked: add the call that launches it to ``sm90_drive``."""
    functions = _jit_functions()
    used = {name for name in functions for other, reads in functions.items()
            if other != name and name.rsplit(".", 1)[1] in reads}
    kernels = set(functions) - used
    if not GLUON_IN_USE:
        assert GLUON in kernels
        kernels.discard(GLUON)
    launched = {b["kernel"] for b in launches["builds"]}
    assert kernels - launched == set(), "kernels the drive never launches"
    assert launched <= kernels, launched - kernels
    assert len(kernels) >= (14 if GLUON_IN_USE else 13)


# compile-time values and argument types each kernel must have been built with: the GPU's choices (Hopper tiles,
# descriptors), every switch both ways; the drive must not silently lose a case
REQUIRED = {
    "forward_stats._tile_stats_kernel": dict(SOFTCAP={"True", "False"}, WITH_ENTROPY={"True", "False"},
                                             USE_TMA={"True", "False"}, IEEE={"True", "False"}, UPCAST={"False"},
                                             BLOCK_N={"256", "64", "128"}, EVEN_K={"True", "False"},
                                             SPLIT={"0", "2", "3", "4"}),
    "policy_stats._policy_stats_kernel": dict(STORE_E={"True", "False"}, E_DTYPE={"fp16", "fp32"},
                                              USE_TMA={"True", "False"}, BLOCK_N={"256", "64", "128"},
                                              SPLIT={"0", "2", "3", "4"}),
    "policy_stats_gluon._policy_stats_gluon_kernel": dict(STORE_E={"True", "False"}, WITH_T={"True", "False"}),
    "combine._combine_kernel": dict(WITH_T={"True", "False"}, TILE_ROWS={"512"}, TOKENS={"8"}),
    "backward._dlogits_kernel": dict(SOFTCAP={"True", "False"}, WITH_ENTROPY={"True", "False"},
                                     MEMBER={"True", "False"},
                                     USE_TMA={"True", "False"}, OUT_DTYPE={"bf16", "fp16", "fp32"},
                                     SPLIT={"0", "2", "3", "4"}),
    "policy_dlogits._policy_dlogits_kernel": dict(FAST_LOG2_={"True"}, OUT_DTYPE={"bf16", "fp16", "fp32"},
                                                  WITH_ENTROPY={"True", "False"}),
    "policy_terms._terms_kernel": dict(HAS_OLD={"True", "False"}, HAS_REF={"True", "False"},
                                       KL_TYPE={"0", "1", "2", "3", "4"}, STRAIGHT={"True", "False"},
                                       USE_KL={"True", "False"}, DUAL={"True", "False"}, WITH_ENT={"True", "False"},
                                       DELTA={"True", "False"}, KL_RATIO={"True", "False"},
                                       HAS_RHO={"True", "False"}, HAS_U={"True", "False"}, HAS_V={"True", "False"},
                                       BLOCK={"1024"}),
    "split._split_kernel": dict(BLOCKS={"3", "6"}, BLOCK_R={"8"}, BLOCK_C={"512"}),
    "exact._low_bits_kernel": dict(BLOCK_R={"16"}, BLOCK_C={"256"}),
    "scale._scale_kernel": dict(BLOCK={"4096"}, UNROLL={"16"}),
    "set_products._set_products_kernel": dict(BLOCK={"128"}),
    "pair_products._products_kernel": dict(BLOCK_P={"16"}, BLOCK_H={"128"}, H_TILES={"1"}),
    "pair_products._dh_kernel": dict(BLOCK_P={"16"}, BLOCK_H={"128"}, WHILE_LOOP_={"False"}),
    "pair_products._dw_kernel": dict(BLOCK_P={"16"}, BLOCK_H={"128"}, WHILE_LOOP_={"False"}, BF16_BITS={"False"}),
    "tail_dlogits._tail_dlogits_kernel": dict(SOFTCAP={"True", "False"}, TAIL_GRAD={"True", "False"},
                                              USE_TMA={"True", "False"}, OUT_DTYPE={"bf16", "fp16", "fp32"},
                                              SPLIT={"0", "2", "3", "4"}, N_IDS={"3", "32", "128"},
                                              BLOCK_N={"256", "64", "128"}),
    "topk_select._candidates_kernel": dict(C={"1", "4", "8", "16"}, SOFTCAP={"True", "False"},
                                           BLOCK_N={"256", "64"}, IEEE={"True", "False"}, GIVEN={"True", "False"}),
    "topk_select._finish_kernel": dict(K={"3", "32", "128", "2048"}),
    "above_select._above_kernel": dict(SOFTCAP={"True", "False"}),
    "given_set._given_kernel": dict(SOFTCAP={"True", "False"}, IEEE={"True", "False"}, N_IDS={"3"}),
    "distill_chunk._stats_kernel": dict(KIND={"0", "1", "2"}, S_CAP={"True", "False"}, T_CAP={"True", "False"},
                                        STEPS={"8"}),
    "distill_chunk._sums_kernel": dict(S_CAP={"True", "False"}, T_CAP={"True", "False"}),   # jsd's only
    "distill_chunk._dlogits_kernel": dict(KIND={"0", "1", "2"}, S_CAP={"True", "False"}, T_CAP={"True", "False"}),
}
# operand types: bfloat16, float16 and float32 heads through the tile kernels (pointers or descriptors)
OPERANDS = {"forward_stats._tile_stats_kernel": ("bf16", "fp16", "fp32"),
            "policy_stats._policy_stats_kernel": ("bf16", "fp16", "fp32"),
            "backward._dlogits_kernel": ("bf16", "fp16", "fp32"),
            "tail_dlogits._tail_dlogits_kernel": ("bf16", "fp16", "fp32"),
            "policy_stats_gluon._policy_stats_gluon_kernel": ("bf16", "fp16"),
            "set_products._set_products_kernel": ("bf16", "fp32"),
            "pair_products._products_kernel": ("bf16", "fp16", "fp32"),
            "pair_products._dw_kernel": ("bf16", "fp16", "fp32"),
            "topk_select._candidates_kernel": ("bf16", "fp32"),
            "above_select._above_kernel": ("bf16", "fp16"),
            "given_set._given_kernel": ("bf16", "fp32")}


def test_launches_cover_the_gpu_specialisations(launches):
    seen: dict = {}
    operands: dict = {}
    for b in launches["builds"]:
        kernel = b["kernel"].split(".", 3)[-1]
        for name, value in b["constexprs"].items():
            seen.setdefault(kernel, {}).setdefault(name, set()).add(value)
        h = b["signature"].get("h_ptr") or b["signature"].get("h_desc")
        operands.setdefault(kernel, set()).update(t for t in ("bf16", "fp16", "fp32") if h and t in h)
    required = {k: v for k, v in REQUIRED.items() if GLUON_IN_USE or not GLUON.endswith(k)}
    operand_kernels = {k: v for k, v in OPERANDS.items() if GLUON_IN_USE or not GLUON.endswith(k)}
    missing = {k: {n: want - seen.get(k, {}).get(n, set()) for n, want in names.items()
                   if want - seen.get(k, {}).get(n, set())} for k, names in required.items()}
    assert not {k: v for k, v in missing.items() if v}, missing
    for kernel, dtypes in operand_kernels.items():
        assert set(dtypes) <= operands[kernel], (kernel, operands[kernel])


def test_the_check_catches_a_constexpr_rebound_in_a_static_range():
    """The split kernel as it was (``sm90_old_split``): the interpreter runs it with the right numbers, the sm_90
    build refuses it. Without this failure the test above could pass however the kernels are written."""
    found = _child("--drive", "sm90_old_split")
    [build] = found["builds"]
    assert build["kernel"] == "sm90_old_split._old_split_kernel"
    assert build["error"] is not None and "constexpr cannot be reassigned" in build["error"], build["error"]
