"""The tiny-LM subcommands of ``dsv4``: ``eval``, ``generate``, ``train-tiny``, and the model part
of ``demo``. Registered by :mod:`dsv4.cli`. Imports torch only when a command runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dsv4.tinylm.paths import MODEL_NAME, default_model_dir
from dsv4.tinylm.task import HELDOUT_SIZE, describe_format, format_problem
from dsv4.usage import (
    UsageError,
    check_at_least,
    check_output_dir,
    check_output_file,
    check_positive,
    resolve_device,
)

DTYPE_NAMES = ("bf16", "fp32", "fp64")


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[name]


def _device(arg: str | None) -> str:
    return resolve_device(arg)


def _one_line(table_row: str) -> str:
    return " ".join(table_row.replace("|", " ").split())


def progress(line: str) -> None:
    """A progress line on stderr, flushed (visible on a terminal and in logs as it happens)."""
    print(line, file=sys.stderr, flush=True)


def check_model_dir(option: str, folder: Path) -> None:
    """A tiny-LM folder to read, checked before any work: it exists, is a folder and holds a
    config.json. The shipped model missing is a broken installation, and said so."""
    folder = Path(folder)
    if folder == default_model_dir() and not (folder / "config.json").is_file():
        raise UsageError(f"{option}: the shipped model {MODEL_NAME} is missing from this "
                         f"installation (expected at {folder}); reinstall dsv4, or give "
                         f"{option} FOLDER")
    if not folder.exists():
        raise UsageError(f"{option} {folder}: does not exist")
    if not folder.is_dir():
        raise UsageError(f"{option} {folder}: is a file, not a model folder (give the folder "
                         "that holds config.json and the *.safetensors shards)")
    if not (folder / "config.json").is_file():
        raise UsageError(f"{option} {folder}: holds no config.json (not a model folder)")


def unique(names: list[str] | None) -> list[str] | None:
    """A repeated option's values without repeats (first occurrence kept): ``--platform X
    --platform X`` runs X once."""
    return None if names is None else list(dict.fromkeys(names))


# The end-to-end check that sets the exit code of `dsv4 eval` / `dsv4 demo`: the shipped model's
# goals (dsv4/tinylm/tiny-arith/README.md). A broken platform path (e.g. the upstream preshuffle
# bug) scores ~0 and fails it by far; so does a near-tie flip on more than one problem.
MIN_ACCURACY, MAX_GAP, MIN_AGREEMENT = 0.95, 1, 0.999


def eval_verdict(runs: list[Any]) -> tuple[bool, str]:
    """(passed, a one-line verdict): ``runs[0]`` is ``reference`` without fusion; it must reach
    ``MIN_ACCURACY`` and every other run be within ``MAX_GAP`` problems of it with at least
    ``MIN_AGREEMENT`` token agreement."""
    from dsv4.tinylm.evaluate import run_label

    ref = runs[0]
    bad = []
    if ref.accuracy < MIN_ACCURACY:
        bad.append(f"reference accuracy {ref.accuracy:.3f} < {MIN_ACCURACY}")
    for r in runs[1:]:
        name = run_label(r.platform, r.fusion, r.mode, r.cache)
        if r.error:
            bad.append(f"{name}: {r.error}")
        elif abs(r.correct - ref.correct) > MAX_GAP or r.token_agreement < MIN_AGREEMENT:
            bad.append(f"{name}: {r.correct} correct vs {ref.correct}, "
                       f"{100 * r.token_agreement:.2f} % token agreement")
    rule = (f" (reference >= {MIN_ACCURACY}, every other run within {MAX_GAP} problem of it and "
            f">= {100 * MIN_AGREEMENT:.1f} % token agreement)")
    return not bad, ("check OK" if not bad else "check FAILED: " + "; ".join(bad)) + rule


def run_model_eval(model: Path, platforms: list[str] | None, device: str, n: int,
                   dtype: str, json_path: Path | None, decode_batch: int | None = -1,
                   cache_formats: list[tuple[str, str]] | None = None,
                   act_quant: bool = False) -> int:
    import torch

    from dsv4.tinylm.evaluate import (
        EXACT_CACHE,
        default_decode_batch,
        evaluate,
        format_table,
        runs_to_json,
    )

    formats = cache_formats or [EXACT_CACHE]
    if decode_batch == -1:
        decode_batch = default_decode_batch(device)
    t0 = time.perf_counter()
    print(f"tiny-arith model {model}: {n} held-out problems (a=..;<filler>b=..;<filler>a+b=), "
          f"greedy batched decoding through the caches ({decode_batch or 'all'} sequences per "
          f"decode forward), {dtype} on {device}"
          + (", fp8 activations (act_quant) in every run" if act_quant else ""), flush=True)
    runs = evaluate(model, platforms, device, n, dtype=torch_dtype(dtype),
                    decode_batch=decode_batch, on_start=lambda k, total, name: progress(
                        f"[eval {k}/{total}] {name}: answering {n} problems ..."),
                    log=lambda row: progress(f"[eval] done: {_one_line(row)} "
                                             f"({time.perf_counter() - t0:.0f} s so far)"),
                    cache_formats=formats, act_quant=act_quant)
    seconds = time.perf_counter() - t0
    print(format_table(runs))
    ok, verdict = eval_verdict(runs)
    print(f"\n{verdict}\n{seconds:.1f} s in all (loads included)")
    if json_path is not None:
        runs_to_json(runs, json_path, {"model": str(model), "device": device, "dtype": dtype,
                                       "decode_batch": decode_batch, "seconds": seconds,
                                       "cache_formats": ["/".join(c) for c in formats],
                                       "act_quant": act_quant,
                                       "ok": ok, "verdict": verdict, "torch": torch.__version__})
    return 0 if ok else 1


def _user_errors(fn: Any) -> Any:
    """Bad input (model folder, config, prompt, platform name) is one line on stderr, exit 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (ValueError, RuntimeError) as e:  # CheckpointError, PromptError, ConfigError, ...
            print(f"dsv4 {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2

    return run


def check_problems(n: int) -> None:
    check_at_least("--problems", n, 1)
    if n > HELDOUT_SIZE:
        raise UsageError(f"--problems {n}: the held-out set has {HELDOUT_SIZE} problems")


@_user_errors
def _cmd_eval(args: argparse.Namespace) -> int:
    if args.decode_batch is not None and args.decode_batch < 0:
        raise UsageError(f"--decode-batch {args.decode_batch}: give a positive number, or 0 for "
                         "all sequences in one forward")
    check_problems(args.problems)
    check_model_dir("--model", args.model)
    if args.json is not None:
        check_output_file("--json", args.json)  # before the eval, not after it
    device = _device(args.device)
    batch = -1 if args.decode_batch is None else (args.decode_batch or None)
    from dsv4.tinylm.evaluate import parse_cache_format

    formats = list(dict.fromkeys(parse_cache_format(f)
                                 for f in args.cache_format or ["auto/auto"]))
    return run_model_eval(args.model, unique(args.platform), device, args.problems, args.dtype,
                          args.json, batch, formats, args.act_quant)


@_user_errors
def _cmd_generate(args: argparse.Namespace) -> int:
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_model_dir("--model", args.model)
    device = _device(args.device)
    from dsv4.tinylm.checkpoint import load_tiny_lm
    from dsv4.tinylm.generate import DecodeStats, encode_prompts, generate, prompt_name

    model = load_tiny_lm(args.model, platform=args.platform, device=device,
                         dtype=torch_dtype(args.dtype))
    encode_prompts(model, args.prompt, args.max_new_tokens)  # a prompt's error before warnings
    spec = model.cfg.task
    n = len(args.prompt)
    for i, prompt in enumerate(args.prompt):
        problem = format_problem(prompt, spec)
        if problem is not None:
            print(f"dsv4 generate: warning: {prompt_name(i, n)} is outside the format the model "
                  f"was trained on ({problem}); expect a wrong answer. Trained format: "
                  f"{describe_format(spec)}", file=sys.stderr, flush=True)
    stats = DecodeStats()
    outs = generate(model, args.prompt, args.max_new_tokens, stats=stats)
    for i, (prompt, out) in enumerate(zip(args.prompt, outs, strict=True)):
        if not out:  # one output line per prompt stays; say why this one is empty
            print(f"dsv4 generate: warning: {prompt_name(i, n)}: the model ended its answer at "
                  "once (its first token was <eos>), so the answer is empty", file=sys.stderr,
                  flush=True)
        print(f"{prompt}{out}" if not args.only_answer else out, flush=True)
    runner = ", ".join(f"{k} {v}" for k, v in stats.runner.items() if v)
    progress(f"dsv4 generate: {stats.tokens} decode tokens in {stats.steps} steps, "
             f"{stats.seconds:.2f} s: {stats.tokens_per_second:.0f} tokens/s "
             f"(decode runner: {runner or 'no steps'})")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    # every check before the training: its result must not be lost to a bad --out
    check_positive("--seconds", args.seconds, "the training time budget")
    check_positive("--lr", args.lr, "the peak learning rate")
    check_at_least("--batch", args.batch, 1)
    check_at_least("--max-steps", args.max_steps, 0)
    check_output_dir("--out", args.out)
    device = _device(args.device)
    from dsv4.folder_swap import foreign_entries
    from dsv4.tinylm.checkpoint import is_tiny_lm_file, save_tiny_lm
    from dsv4_train.train import TrainSettings, save_report, train_tiny

    if args.out.is_dir() and foreign_entries(args.out, is_tiny_lm_file):
        raise UsageError(f"--out {args.out}: holds other files than a tiny-LM folder's "
                         f"({', '.join(foreign_entries(args.out, is_tiny_lm_file))}); give an "
                         "empty or new folder (a tiny-LM folder there is replaced)")
    settings = TrainSettings(seconds=args.seconds, batch=args.batch, lr=args.lr, seed=args.seed,
                             device=device, max_steps=args.max_steps)
    model, report = train_tiny(settings, log=lambda s: print(s, flush=True))
    report["command"] = " ".join(["dsv4", *sys.argv[1:]]) if args.command_line is None \
        else args.command_line
    files = save_tiny_lm(model.export_tensors(fp8=True), model.cfg, args.out,
                         extra=lambda folder: save_report(report, folder))
    print(json.dumps({"saved": [str(f) for f in files],
                      "accuracy": report["heldout_accuracy_checkpoint_numerics"]}))
    return 0


DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when available, else cpu)"
MODEL_HELP = f"the tiny LM folder (default: the shipped {MODEL_NAME}, inside the dsv4 package)"


def add_commands(sub: Any) -> None:
    e = sub.add_parser("eval", help="the shipped tiny LM answers the 400 held-out problems on "
                       "every platform x compressor fusion; accuracy and token agreement",
                       description="The shipped tiny LM answers held-out problems on every "
                       "platform x compressor fusion (x CUDA graphs on / off on a GPU); prints "
                       "accuracy and token agreement with reference, exits 1 if the check fails.")
    e.add_argument("--model", type=Path, default=default_model_dir(), help=MODEL_HELP)
    e.add_argument("--platform", action="append", help="platform to evaluate, repeatable "
                   "(default: all available here)")
    e.add_argument("--device", default=None, help=DEVICE_HELP)
    e.add_argument("--problems", type=int, default=HELDOUT_SIZE,
                   help=f"the first N held-out problems (1..{HELDOUT_SIZE}, default "
                        f"{HELDOUT_SIZE})")
    e.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16",
                   help="activation dtype (default bf16)")
    e.add_argument("--json", type=Path, default=None, help="also write the results here")
    e.add_argument("--decode-batch", type=int, default=None,
                   help="sequences per decode forward (0: all at once; default: 16 on a GPU, "
                        "all on the CPU)")
    e.add_argument("--act-quant", action="store_true",
                   help="every run, the reference baseline too, with the official fp8 "
                        "activation quantisation of the fp8 linears (act_quant)")
    e.add_argument("--cache-format", action="append", metavar="KV/INDEX",
                   help="stored cache formats to run, repeatable: kv auto|bf16|fp8_ds_mla / "
                        "indexer keys auto|bf16|fp8|fp4, e.g. fp8_ds_mla/fp4 (default: "
                        "auto/auto, exact storage; the reference run without fusion and with "
                        "exact storage is always the baseline)")
    e.set_defaults(func=_cmd_eval)
    fmt = describe_format()
    g = sub.add_parser("generate", help="greedy decoding with the tiny LM (prompts in its "
                       "trained format: a=<n>;<filler>b=<n>;<filler>a+b=)",
                       description="Greedy decoding with the tiny LM. The shipped model was "
                       f"trained only on prompts of this format: {fmt}. It answers other "
                       "prompts confidently and wrongly; such prompts get a warning on stderr.")
    g.add_argument("--prompt", action="append", required=True,
                   help=f"a prompt, repeatable; trained format: {fmt}".replace("%", "%%"))
    g.add_argument("--model", type=Path, default=default_model_dir(), help=MODEL_HELP)
    g.add_argument("--platform", default="reference", help="platform (default: reference)")
    g.add_argument("--device", default=None, help=DEVICE_HELP)
    g.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16",
                   help="activation dtype (default bf16)")
    g.add_argument("--max-new-tokens", type=int, default=4,
                   help="most tokens generated per prompt (default 4: 3 digits + <eos>)")
    g.add_argument("--only-answer", action="store_true", help="print the continuation only")
    g.set_defaults(func=_cmd_generate)
    t = sub.add_parser("train-tiny", help="train the tiny arithmetic LM (a GPU: a few minutes)",
                       description="Train the tiny arithmetic LM and write its folder. After "
                       "the training, the held-out problems are answered twice (checkpoint "
                       "numerics, float) for the report; on a CPU that takes minutes.")
    t.add_argument("--out", type=Path, required=True,
                   help="folder to write the model into: new, empty, or a tiny-LM folder "
                   "(replaced); checked before the training")
    t.add_argument("--seconds", type=float, default=200.0,
                   help="time budget of the training loop, > 0 (default 200; the held-out "
                   "evaluation after it comes on top)")
    t.add_argument("--batch", type=int, default=256, help="problems per step (default 256)")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, > 0 (default "
                   "2e-3)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--device", default=None, help=DEVICE_HELP)
    t.add_argument("--max-steps", type=int, default=0,
                   help="stop after N steps if the time budget has not run out first (default "
                   "0: no step limit)")
    t.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
    t.set_defaults(func=_cmd_train)
