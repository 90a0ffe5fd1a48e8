"""Continue training a tiny LM on the CPU and write the model folder (report covers all stages).

    # the last block only, on cached activations of the frozen blocks (cheap)
    PYTHONPATH=src python scripts/finetune_tiny.py --mode tail --init float_state.pt \
        --report train_report.json --out OUT/tiny-arith
    # every block, length-bucketed batches, 4 x 32 per step, the last 40 % quant-aware
    PYTHONPATH=src python scripts/finetune_tiny.py --mode full \
        --init OUT/tiny-arith_float_state.pt --report OUT/tiny-arith/train_report.json \
        --out OUT2/tiny-arith

``--init`` is the float state dict the previous stage saved (``scripts/train_tiny.py`` writes
``float_state.pt``, this script ``<out>_float_state.pt``), ``--report`` that stage's
``train_report.json``. See :mod:`dsv4.model.finetune` for the tail mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsv4.model.checkpoint import save_tiny_lm
from dsv4.model.config import TinyLMConfig
from dsv4.model.finetune import FinetuneSettings, finetune_tail
from dsv4.model.train import TrainSettings, combine_reports, save_report, train_tiny
from dsv4.model.train_lm import TrainLM


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["tail", "full"], default="tail")
    p.add_argument("--init", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=1800.0)
    p.add_argument("--lr", type=float, default=None, help="tail: 2e-4, full: 8e-5")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=4, help="full: batches per step")
    p.add_argument("--autocast", action="store_true", help="full: bf16 autocast (AMX)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--problems", type=int, default=8192, help="tail: cached problems")
    p.add_argument("--epochs", type=int, default=8, help="tail: epochs over the cache")
    p.add_argument("--from-layer", type=int, default=-1, help="tail: first block that trains")
    p.add_argument("--seed", type=int, default=None, help="data seed (tail: 11, full: 21)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    command = "PYTHONPATH=src python scripts/finetune_tiny.py " + " ".join(sys.argv[1:])
    first = json.loads(args.report.read_text())
    cfg = TinyLMConfig.preset()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.mode == "tail":
        model = TrainLM(cfg)
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
        settings = FinetuneSettings(problems=args.problems, epochs=args.epochs,
                                    lr=args.lr or 2e-4, seconds=args.seconds,
                                    from_layer=args.from_layer, batch=args.batch,
                                    seed=11 if args.seed is None else args.seed)
        second = finetune_tail(model, settings, cfg.task, log=log)
    else:
        train_settings = TrainSettings(
            seconds=args.seconds, batch=args.batch, device="cpu", eval_every_s=600,
            eval_problems=400, lr=args.lr or 8e-5, warmup_steps=20, dense_share=0.0,
            qat_share=0.4, autocast=args.autocast, accumulate=args.accumulate,
            init_from=str(args.init),
            seed=21 if args.seed is None else args.seed,
            length_buckets=8)
        model, second = train_tiny(train_settings, cfg, log=log)
    second["command"] = command
    report = combine_reports(first, second)
    commands = first["command"] if isinstance(first["command"], list) else [first["command"]]
    report["command"] = [*commands, command]
    save_tiny_lm(model.export_tensors(fp8=True), cfg, args.out)
    save_report(report, args.out)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
               args.out.parent / f"{args.out.name}_float_state.pt")
    print(json.dumps({"accuracy": second["heldout_accuracy_checkpoint_numerics"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
