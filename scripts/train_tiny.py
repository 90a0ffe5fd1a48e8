"""Train the tiny arithmetic LM and write the shipped model folder + training report.

    PYTHONPATH=src python scripts/train_tiny.py --out OUT --seconds 180 --device cuda \
        --variants "seed=0,lr=2e-3" --variants "seed=1,lr=1e-3"

Each variant trains in its own process (on one GPU they share it: the steps are launch-bound, so
two processes finish about as many steps each as one alone would); the variant with the best
held-out accuracy under checkpoint numerics (fp8 / bf16 weights, official simulations) is written
to OUT/tiny-arith with its report and loss curve, and OUT/variants.json lists them all.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run_variant(out: Path, seconds: float, device: str, batch: int, spec: str,
                command: str) -> None:
    import torch

    from dsv4.tinylm.checkpoint import save_tiny_lm
    from dsv4_train.train import TrainSettings, save_report, train_tiny

    kw: dict[str, float | int | str] = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        kw[k] = v if k == "init_from" else int(v) if v.lstrip("-").isdigit() else float(v)
    base: dict[str, float | int | str] = {"seconds": seconds, "device": device, "batch": batch}
    settings = TrainSettings(**{**base, **kw})  # type: ignore[arg-type]
    torch.set_num_threads(2)
    model, report = train_tiny(settings, log=lambda s: print(f"[{spec}] {s}", flush=True))
    report["command"] = command
    report["variant"] = spec
    save_tiny_lm(model.export_tensors(fp8=True), model.cfg, out,
                 extra=lambda folder: save_report(report, folder))
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
               out.parent / f"{out.name}_float_state.pt")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--variants", action="append", default=None,
                   help="comma-separated TrainSettings overrides, e.g. 'seed=1,lr=1e-3'")
    p.add_argument("--work", type=Path, default=Path("/tmp/tiny_arith_variants"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    command = args.command or "PYTHONPATH=src python scripts/train_tiny.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    if args.worker is not None:
        run_variant(args.out, args.seconds, args.device, args.batch, args.worker, command)
        return 0
    variants = args.variants or ["seed=0"]
    t0 = time.perf_counter()
    procs = []
    for k, spec in enumerate(variants):
        folder = args.work / f"v{k}"
        shutil.rmtree(folder, ignore_errors=True)
        procs.append((spec, folder, subprocess.Popen(
            [sys.executable, __file__, "--out", str(folder), "--seconds", str(args.seconds),
             "--device", args.device, "--batch", str(args.batch), "--worker", spec,
             "--command", command])))
    results = []
    for spec, folder, proc in procs:
        rc = proc.wait()
        rep = folder / "train_report.json"
        if rc == 0 and rep.is_file():
            r = json.loads(rep.read_text())
            results.append({"variant": spec, "folder": str(folder), "steps": r["steps"],
                            "accuracy": r["heldout_accuracy_checkpoint_numerics"],
                            "accuracy_float": r["heldout_accuracy_float"]})
        else:
            results.append({"variant": spec, "folder": str(folder), "error": f"exit {rc}"})
    ok = [r for r in results if "accuracy" in r]
    summary = {"variants": results, "wall_seconds": time.perf_counter() - t0,
               "command": command}
    args.out.mkdir(parents=True, exist_ok=True)
    if ok:
        best = max(ok, key=lambda r: (r["accuracy"], r["accuracy_float"]))
        summary["chosen"] = best["variant"]
        dest = args.out / "tiny-arith"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(best["folder"], dest)
        state = Path(f"{best['folder']}_float_state.pt")
        if state.is_file():  # the float weights, for fine-tuning later (not shipped)
            shutil.copy(state, args.out / "float_state.pt")
    (args.out / "variants.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
