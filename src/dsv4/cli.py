"""The ``dsv4`` command (also ``python -m dsv4``)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from dsv4.model.checkpoint import default_model_dir
from dsv4.model.commands import add_commands as add_model_commands


def _cmd_demo(args: argparse.Namespace) -> int:
    from dsv4.demo import format_demo, run_demo
    from dsv4.model.commands import run_model_eval

    # First the end-to-end signal: the shipped tiny LM on every CPU platform x fusion.
    if (args.model / "config.json").is_file():
        model_rc = run_model_eval(args.model, None, "cpu", args.problems, "bf16", None)
    else:
        print(f"no trained model at {args.model}: skipping the end-to-end evaluation")
        model_rc = 0
    print()
    t0 = time.perf_counter()
    rows = run_demo(tokens=args.tokens, chunk=args.chunk, seed=args.seed,
                    checkpoint=args.checkpoint)
    print(format_demo(rows, args.tokens))
    worst64 = max(r.err_f64 for r in rows)
    worst16 = max(r.err_bf16 for r in rows)
    ok = worst64 <= 1e-10 and worst16 <= 1e-2
    print(f"\nworst error: float64 {worst64:.2e} (bound 1e-10), bf16 {worst16:.2e} (bound 1e-2) "
          f"-> {'OK' if ok else 'FAIL'}; {time.perf_counter() - t0:.1f} s")
    return 0 if ok and model_rc == 0 else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    from dsv4.verify import run_verify

    ok, report = run_verify(args.platform or None, args.device, args.tokens, args.seed)
    print(report)
    return 0 if ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if args.suite == "pooled-decode":  # any device
        from dsv4.bench.pooled_decode import main as run
    elif not torch.cuda.is_available():
        print(f"dsv4 bench {args.suite} needs a CUDA GPU (the results of the last H200 run are "
              "in benchmarks/results/h200/)", file=sys.stderr)
        return 2
    elif args.suite == "input-proj":
        from dsv4.bench.input_proj import main as run
    elif args.suite == "attention-kernels":
        from dsv4.bench.attention_kernels import main as run
    else:
        from dsv4.bench.decode_step import main as run
    return int(run(["--out", str(args.out), *args.extra]) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log info lines")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the tiny LM's accuracy on every CPU platform, then every "
                       "layer type: prefill, chunked prefill and decode against a float64 "
                       "evaluation")
    d.add_argument("--tokens", type=int, default=300)
    d.add_argument("--chunk", type=int, default=37)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--checkpoint", type=Path, default=None,
                   help="a checkpoint folder (config.json + safetensors) instead of random weights")
    d.add_argument("--model", type=Path, default=default_model_dir(),
                   help="the tiny LM folder evaluated first (default: models/tiny-arith)")
    d.add_argument("--problems", type=int, default=400, help="held-out problems it answers")
    d.set_defaults(func=_cmd_demo)
    v = sub.add_parser("verify", help="conformance of every platform against reference, and the "
                       "override contract; exits non-zero on any failure")
    v.add_argument("--platform", action="append", help="platform(s) to check (default: all "
                   "available here)")
    v.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    v.add_argument("--tokens", type=int, default=300)
    v.add_argument("--seed", type=int, default=0)
    v.set_defaults(func=_cmd_verify)
    b = sub.add_parser("bench", help="benchmarks (JSON, markdown, PNG): input projections per "
                       "strategy and the full-layer decode step (GPU), per-sequence vs pooled "
                       "caches in decode (any device), sparse MQA and fp8 GEMM kernels (GPU)")
    b.add_argument("suite", choices=["input-proj", "decode-step", "pooled-decode",
                                     "attention-kernels"])
    b.add_argument("--out", type=Path, required=True)
    b.epilog = "Other options go to the suite (python -m dsv4.bench.input_proj --help)."
    b.set_defaults(func=_cmd_bench)
    add_model_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
