"""The dsv4 command (also python -m dsv4): the DeepSeek-V4 attention layer's demo, conformance
check, benchmarks and the tiny LM. Every subcommand has its own --help."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

from dsv4.tinylm.commands import MODEL_HELP, check_model_dir, check_problems, progress, unique
from dsv4.tinylm.commands import add_commands as add_model_commands
from dsv4.tinylm.paths import default_model_dir
from dsv4.usage import (
    OneLineArgumentParser,
    check_at_least,
    resolve_device,
    user_error_message,
)

VERIFY_MIN_TOKENS = 16
"""The pooled mode of ``dsv4 verify`` splits the tokens over 4 sequences of at least 4 each."""

BENCH_SUITES = {
    "input-proj": "dsv4.bench.input_proj",
    "decode-step": "dsv4.bench.decode_step",
    "model-decode": "dsv4.bench.model_decode",
    "pooled-decode": "dsv4.bench.pooled_decode",
    "transformers-decode": "dsv4.bench.transformers_decode",
    "attention-kernels": "dsv4.bench.attention_kernels",
    "prefill": "dsv4.bench.prefill",
    "kv-memory": "dsv4.bench.kv_memory",
}
CPU_SUITES = ("pooled-decode", "transformers-decode", "kv-memory")
"""Suites that run on the CPU (transformers-decode only when told: --device cpu; the others
need a CUDA GPU)."""


def _cmd_demo(args: argparse.Namespace) -> int:
    check_at_least("--tokens", args.tokens, 1)
    check_at_least("--chunk", args.chunk, 1)
    check_problems(args.problems)
    check_model_dir("--model", args.model)  # the end-to-end check was asked for: it must run
    if args.checkpoint is not None:
        check_model_dir("--checkpoint", args.checkpoint)
    from dsv4.demo import format_demo, run_demo
    from dsv4.tinylm.commands import run_model_eval

    # First the end-to-end signal: the shipped tiny LM on every CPU platform x fusion.
    model_rc = run_model_eval(args.model, None, "cpu", args.problems, "bf16", None)
    print()
    t0 = time.perf_counter()
    rows = run_demo(tokens=args.tokens, chunk=args.chunk, seed=args.seed,
                    checkpoint=args.checkpoint, log=progress)
    print(format_demo(rows, args.tokens))
    worst64 = max(r.err_f64 for r in rows)
    worst16 = max(r.err_bf16 for r in rows)
    ok = worst64 <= 1e-10 and worst16 <= 1e-2
    print(f"\nworst error: float64 {worst64:.2e} (bound 1e-10), bf16 {worst16:.2e} (bound 1e-2) "
          f"-> {'OK' if ok else 'FAIL'}; {time.perf_counter() - t0:.1f} s")
    return 0 if ok and model_rc == 0 else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    tokens = args.tokens if args.tokens is not None else (160 if args.tp > 1 else 300)
    check_at_least("--tokens", tokens, VERIFY_MIN_TOKENS,
                   "the pooled mode decodes 4 sequences of at least 4 tokens")
    device = resolve_device(args.device)
    from dsv4.platforms import get_platform
    from dsv4.tp_launch import under_torchrun

    args.platform = unique(args.platform)
    for name in args.platform or []:
        get_platform(name, device)  # unknown / unavailable: one line, before any work
    if args.tp > 1 or under_torchrun():
        from dsv4.testing.verify_tp import run_verify_tp

        ok, report = run_verify_tp(args.tp, args.platform or None, args.device, tokens,
                                   args.seed)
        if not report_here():
            return 0 if ok else 1
    else:
        from dsv4.testing.verify import run_verify

        ok, report = run_verify(args.platform or None, device, tokens, args.seed, log=progress)
    print(report)
    return 0 if ok else 1


def report_here() -> bool:
    """Under torchrun only rank 0 prints (every rank exits with the verdict)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.help or args.suite is None:
        if args.suite is None:
            args.bench_parser.print_help()
            return 0 if args.help else 2
        try:  # the suite's own argparse help (it exits)
            _suite_main(args.suite)(["--help"], prog=f"dsv4 bench {args.suite}")
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    # a GPU suite checks for CUDA itself (dsv4.bench.args.require_cuda) after its arguments and
    # its GPU-free modes (--report-only, decode-step's CPU dry run); its usage errors exit 2
    return int(_suite_main(args.suite)(args.extra, prog=f"dsv4 bench {args.suite}") or 0)


def _suite_main(suite: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(BENCH_SUITES[suite]).main


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    from dsv4 import __version__

    p = OneLineArgumentParser(prog="dsv4", description=__doc__)
    p.add_argument("--version", action="version", version=f"dsv4 {__version__}",
                   help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log info lines")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the tiny LM's accuracy on every CPU platform, then every "
                       "layer type: prefill, chunked prefill and decode against a float64 "
                       "evaluation",
                       description="The end-to-end check (the shipped tiny LM on every CPU "
                       "platform x compressor fusion), then every layer type of the tiny preset "
                       "against the naive float64 evaluation, with timings.")
    d.add_argument("--tokens", type=int, default=300,
                   help="tokens per layer-type run (default 300)")
    d.add_argument("--chunk", type=int, default=37,
                   help="chunk size of the chunked prefill (default 37)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    d.add_argument("--checkpoint", type=Path, default=None,
                   help="a checkpoint folder (config.json + safetensors) instead of random weights")
    d.add_argument("--model", type=Path, default=default_model_dir(),
                   help=f"{MODEL_HELP}; evaluated first, its check is part of the exit code")
    d.add_argument("--problems", type=int, default=400,
                   help="held-out problems it answers (1..400, default 400)")
    d.set_defaults(func=_cmd_demo)
    v = sub.add_parser("verify", help="conformance of every platform against reference, and the "
                       "override contract; exits non-zero on any failure",
                       description="Conformance of every platform x compressor fusion x layer "
                       "type x prefill / decode / pooled decode against reference, and the "
                       "override contract; prints a table, exits 1 on any failure.")
    v.add_argument("--platform", action="append", help="platform to check, repeatable "
                   "(default: all available here)")
    v.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    v.add_argument("--tokens", type=int, default=None,
                   help=f"tokens per run (at least {VERIFY_MIN_TOKENS}; default 300, 160 with "
                   "--tp)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    v.add_argument("--tp", type=_positive_int, default=1,
                   help="tensor parallelism: spawn N ranks (gloo on the CPU, NCCL on CUDA) or "
                   "join torchrun's, and compare every rank with the TP=1 layer")
    v.set_defaults(func=_cmd_verify)
    b = sub.add_parser("bench", add_help=False,
                       help="benchmarks (JSON, markdown, PNG): input projections per "
                       "strategy and the full-layer decode step (GPU), per-sequence vs pooled "
                       "caches in decode (any device)",
                       description="Benchmarks. 'dsv4 bench SUITE --help' lists the suite's "
                       "own options (--out DIR is required by every suite; a folder holding "
                       "an earlier run's results is refused unless --overwrite).")
    b.add_argument("-h", "--help", action="store_true",
                   help="show this help, or with a SUITE the suite's options, and exit")
    b.add_argument("suite", nargs="?", choices=sorted(BENCH_SUITES),
                   help="input-proj, decode-step, attention-kernels, prefill (CUDA GPU), "
                   "model-decode (a GPU, or --dry-run on the CPU), pooled-decode or kv-memory "
                   "(any device), transformers-decode (a GPU, or --device cpu with --tiny for "
                   "a smoke run)")
    b.set_defaults(func=_cmd_bench, bench_parser=b)
    add_model_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = command_prog(args)
    if extra and args.command != "bench":
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)}\n")
    args.extra = extra
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except Exception as e:
        message = user_error_message(e)
        if message is None:
            raise  # an internal error keeps its traceback
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


def command_prog(args: argparse.Namespace) -> str:
    """The name errors start with: ``dsv4 eval``, ``dsv4 bench kv-memory``, ... (as argparse's
    own errors of that subcommand or suite)."""
    suite = getattr(args, "suite", None) if args.command == "bench" else None
    return " ".join(["dsv4", args.command, *([suite] if suite else [])])


if __name__ == "__main__":
    sys.exit(main())
