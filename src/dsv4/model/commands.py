"""The tiny-LM subcommands of ``dsv4``: ``eval``, ``generate``, ``train-tiny``, and the model part
of ``demo``. Registered by :mod:`dsv4.cli`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.model.checkpoint import default_model_dir

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _device(arg: str | None) -> str:
    return arg or ("cuda" if torch.cuda.is_available() else "cpu")


# The goals for the shipped model (reported, not enforced: the shipped model misses them,
# see models/tiny-arith/README.md).
GOAL_ACCURACY, GOAL_WITHIN, GOAL_AGREEMENT = 0.95, 1, 0.999
# The regression check that sets the exit code: what a working path gives with the shipped model,
# with a margin; a broken path (e.g. the upstream preshuffle bug) scores ~0 and fails it.
MIN_ACCURACY, MAX_GAP_SHARE, MIN_AGREEMENT = 0.8, 0.03, 0.9


def eval_verdict(runs: list[Any]) -> tuple[bool, str]:
    """(passed the regression check, a two-line verdict: the check, then the issue's goals)."""
    ref = runs[0]
    gap = max(5, round(MAX_GAP_SHARE * ref.n))
    bad, missed = [], []
    if ref.accuracy < MIN_ACCURACY:
        bad.append(f"reference accuracy {ref.accuracy:.3f} < {MIN_ACCURACY}")
    if ref.accuracy < GOAL_ACCURACY:
        missed.append(f"reference accuracy {ref.accuracy:.3f} < {GOAL_ACCURACY}")
    for r in runs[1:]:
        name = f"{r.platform} fusion {'on' if r.fusion else 'off'}"
        if r.error:
            bad.append(f"{name}: {r.error}")
            continue
        diff = f"{name}: {r.correct} correct vs {ref.correct}, {100 * r.token_agreement:.2f} %"
        if abs(r.correct - ref.correct) > gap or r.token_agreement < MIN_AGREEMENT:
            bad.append(diff)
        if abs(r.correct - ref.correct) > GOAL_WITHIN or r.token_agreement < GOAL_AGREEMENT:
            missed.append(diff)
    check = ("check OK" if not bad else "check FAILED: " + "; ".join(bad)) + (
        f" (reference >= {MIN_ACCURACY}, others within {gap} problems and >= "
        f"{100 * MIN_AGREEMENT:.0f} % token agreement)")
    goals = ("issue goals met" if not missed else "issue goals not met: " + "; ".join(missed)) + (
        f" (reference >= {GOAL_ACCURACY}, others within {GOAL_WITHIN} problem and >= "
        f"{100 * GOAL_AGREEMENT:.1f} % token agreement)")
    return not bad, f"{check}\n{goals}"


def run_model_eval(model: Path, platforms: list[str] | None, device: str, n: int,
                   dtype: str, json_path: Path | None) -> int:
    from dsv4.model.evaluate import evaluate, format_table, runs_to_json

    t0 = time.perf_counter()
    print(f"tiny-arith model {model}: {n} held-out problems (a=..;<filler>b=..;<filler>a+b=), "
          f"greedy batched decoding through the caches, {dtype} on {device}", flush=True)
    runs = evaluate(model, platforms, device, n, dtype=DTYPES[dtype])
    seconds = time.perf_counter() - t0
    print(format_table(runs))
    ok, verdict = eval_verdict(runs)
    print(f"\n{verdict}\n{seconds:.1f} s in all (loads included)")
    if json_path is not None:
        runs_to_json(runs, json_path, {"model": str(model), "device": device, "dtype": dtype,
                                       "seconds": seconds, "ok": ok, "verdict": verdict,
                                       "torch": torch.__version__})
    return 0 if ok else 1


def _user_errors(fn: Any) -> Any:
    """Bad input (model folder, config, prompt, platform name) is one line on stderr, exit 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (ValueError, RuntimeError) as e:  # CheckpointError, PromptError, ConfigError, ...
            print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
            return 2

    return run


@_user_errors
def _cmd_eval(args: argparse.Namespace) -> int:
    return run_model_eval(args.model, args.platform, _device(args.device), args.problems,
                          args.dtype, args.json)


@_user_errors
def _cmd_generate(args: argparse.Namespace) -> int:
    from dsv4.model.checkpoint import load_tiny_lm
    from dsv4.model.generate import generate

    model = load_tiny_lm(args.model, platform=args.platform, device=_device(args.device),
                         dtype=DTYPES[args.dtype])
    for prompt, out in zip(args.prompt, generate(model, args.prompt, args.max_new_tokens),
                           strict=True):
        print(f"{prompt}{out}" if not args.only_answer else out)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from dsv4.model.checkpoint import save_tiny_lm
    from dsv4.model.train import TrainSettings, save_report, train_tiny

    settings = TrainSettings(seconds=args.seconds, batch=args.batch, lr=args.lr, seed=args.seed,
                             device=_device(args.device), max_steps=args.max_steps)
    model, report = train_tiny(settings, log=lambda s: print(s, flush=True))
    report["command"] = " ".join(["dsv4", *sys.argv[1:]]) if args.command_line is None \
        else args.command_line
    files = save_tiny_lm(model.export_tensors(fp8=True), model.cfg, args.out)
    save_report(report, args.out)
    print(json.dumps({"saved": [str(f) for f in files],
                      "accuracy": report["heldout_accuracy_checkpoint_numerics"]}))
    return 0


def add_commands(sub: Any) -> None:
    e = sub.add_parser("eval", help="the shipped tiny LM answers the 400 held-out problems on "
                       "every platform x compressor fusion; accuracy and token agreement")
    e.add_argument("--model", type=Path, default=default_model_dir())
    e.add_argument("--platform", action="append", help="platform(s) (default: all available)")
    e.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    e.add_argument("--problems", type=int, default=400, help="the first N held-out problems")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    e.add_argument("--json", type=Path, default=None, help="also write the results here")
    e.set_defaults(func=_cmd_eval)
    g = sub.add_parser("generate", help="greedy decoding with the tiny LM")
    g.add_argument("--prompt", action="append", required=True, help="repeatable")
    g.add_argument("--model", type=Path, default=default_model_dir())
    g.add_argument("--platform", default="reference")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--max-new-tokens", type=int, default=4)
    g.add_argument("--only-answer", action="store_true", help="print the continuation only")
    g.set_defaults(func=_cmd_generate)
    t = sub.add_parser("train-tiny", help="train the tiny arithmetic LM (a GPU: a few minutes)")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seconds", type=float, default=200.0)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    t.set_defaults(func=_cmd_train)
