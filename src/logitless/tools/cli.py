"""The `logitless` command: `logitless bench` and `logitless doctor`."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Optional, Sequence

from . import peers


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--shape must be three positive integers N,H,V, got {text!r}")
    return dims  # type: ignore[return-value]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--temperature must be a finite number > 0, got {text!r}")
    return value


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {text!r}")
        return value
    return parse


def _backends(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    for name in names:
        if name not in peers.NAMES:
            raise argparse.ArgumentTypeError(f"--backends: unknown {name!r}; choose from {', '.join(peers.NAMES)}")
    return names


def _writable(flag: str):
    def check(path: str) -> str:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"{flag}: folder {folder} does not exist")
        return path
    return check


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logitless",
        description="Per-token log-probs and entropy from hidden states and the LM head, without logits.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,doctor}")

    bench = sub.add_parser(
        "bench", help="time logitless, the naive path and installed peers against the GEMM floor",
        description="Times forward and forward+backward of each logitless backend and every installed peer, "
                    "next to the GEMMs of the same shape, and prints one table.")
    bench.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    bench.add_argument("--shape", type=_shape, metavar="N,H,V",
                       help="tokens, hidden size, vocabulary (default: 16384,4096,151936 on cuda; "
                            "a one-minute shape on cpu)")
    bench.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                       help="input dtype (default: bfloat16 on cuda, float32 on cpu)")
    bench.add_argument("--temperature", type=_positive_float, default=1.0)
    bench.add_argument("--backends", type=_backends, nargs="+", metavar="NAME",
                       help=f"rows to run besides the GEMM floor (default: all): {', '.join(peers.NAMES)}")
    bench.add_argument("--repeats", type=_positive_int("--repeats"), default=5,
                       help="timing rounds: each row's time is the median of this many calls, the rows (and the "
                            "GEMM floor) taking turns in each round, in reversed order every other round")
    bench.add_argument("--check-tokens", type=_positive_int("--check-tokens"), default=256,
                       help="tokens whose results are compared with the reference backend")
    bench.add_argument("--seed", type=int, default=0, help="input seed (default 0; printed with the table)")
    bench.add_argument("--json", type=_writable("--json"), metavar="PATH", help="write every number here")
    bench.add_argument("--plot", type=_writable("--plot"), metavar="PATH", help="write a PNG bar chart here")
    bench.add_argument("--md", type=_writable("--md"), metavar="PATH",
                       help="write a markdown report here (command, machine, versions, table)")
    bench.add_argument("--tp", type=_positive_int("--tp"), metavar="N",
                       help="tensor-parallel bench over N ranks (logitless.tools.bench_tp)")

    sub.add_parser("doctor", help="versions, devices, the backend 'auto' picks, megatron-core hook status")
    return parser


def _bench_config(args: argparse.Namespace, parser: argparse.ArgumentParser):
    import torch

    from .bench import CPU_SHAPE, GPU_SHAPE, BenchConfig
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (torch "
                     f"{torch.__version__}); use --device cpu")
    on_gpu = device == "cuda"
    backends = tuple(dict.fromkeys(n for group in args.backends for n in group)) if args.backends else peers.NAMES
    return BenchConfig(device=device, shape=args.shape or (GPU_SHAPE if on_gpu else CPU_SHAPE),
                       dtype=args.dtype or ("bfloat16" if on_gpu else "float32"), temperature=args.temperature,
                       backends=backends, repeats=args.repeats, check_tokens=args.check_tokens,
                       seed=args.seed)


def _run_tp(args: argparse.Namespace, cfg) -> int:
    """`--tp N`: the vocab-parallel bench of logitless.tools.bench_tp (logitless backends only)."""
    try:
        from .bench_tp import format_tp_table, run_tp_bench
    except ImportError as exc:
        print(f"logitless bench --tp: the tensor-parallel bench is not available in this install "
              f"(logitless.tools.bench_tp: {exc})", file=sys.stderr)
        return 2
    if args.plot or args.md:
        print("logitless bench --tp: --plot and --md are not produced for the tensor-parallel bench; "
              "--json is", file=sys.stderr)
    backends = cfg.backends if args.backends else (("chunked", "triton") if cfg.device == "cuda" else ("chunked",))
    try:
        rows = run_tp_bench(args.tp, cfg.shape, dtype=cfg.dtype, device=cfg.device, backends=backends,
                            temperature=cfg.temperature, repeats=cfg.repeats, seed=cfg.seed, json_path=args.json)
    except ValueError as exc:       # e.g. more ranks than GPUs or vocabulary rows
        print(f"logitless bench --tp: {exc}", file=sys.stderr)
        return 2
    print(format_tp_table(rows), end="")
    return 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, command: str) -> int:
    cfg = _bench_config(args, parser)
    if args.tp is not None:
        return _run_tp(args, cfg)
    from .bench import format_report, format_table, run_bench, write_plot
    result = run_bench(cfg, command=command)
    print(format_table(result), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.md:
        with open(args.md, "w") as f:
            f.write(format_report(result))
        print(f"wrote {args.md}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, parser, " ".join(["logitless"] + [shlex.quote(a) for a in argv]))
    from .doctor import report
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
