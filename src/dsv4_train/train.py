"""Training of the tiny arithmetic LM (``dsv4 train-tiny`` / ``scripts/train_tiny.py``).

Three phases, by share of the wall-clock budget:

1. *dense*: ratio-4 layers attend to every visible compressed entry while the indexer learns, by
   distillation, which entries the attention uses (its top-k is not good yet);
2. *sparse*: ratio-4 layers attend to the indexer's top-k picks, as at inference;
3. *quant-aware*: as 2, with every weight rounded to its checkpoint dtype (fp8 blocks, bf16), the
   official FP8 / FP4 simulations and (for half the calls) fp8 activations, all straight-through,
   so the shipped fp8 model under the default numerics, and the preshuffle platform's fp8
   activations, answer like the float model.

The loss is cross-entropy on the answer tokens (and ``<eos>``) plus the indexer KL.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.task import Problem, TaskSpec, heldout_problems, make_problem
from dsv4.tinylm.tokenizer import CharTokenizer
from dsv4_train.attention import NO_QUANT, QuantOptions
from dsv4_train.lm import TrainLM

QAT = QuantOptions(checkpoint_weights=True, simulate=True, act_fp8_prob=0.5)
EVAL_QUANT = QuantOptions(checkpoint_weights=True, simulate=True)


@dataclass
class TrainSettings:
    seconds: float = 200.0
    """Wall-clock budget of the training loop (the phases are shares of it)."""
    batch: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    dense_share: float = 0.25
    qat_share: float = 0.2
    indexer_loss_weight: float = 1.0
    seed: int = 0
    device: str = "cpu"
    eval_every_s: float = 30.0
    log_every_s: float = 10.0
    """A progress line (step, loss) at least this often, and after the first step."""
    eval_problems: int = 400
    max_steps: int = 0
    """Stop after this many steps as well (0: only the time budget)."""
    init_from: str = ""
    """Start from this float state dict (``torch.save(model.state_dict())``) instead of a fresh
    initialisation (fine-tuning)."""
    accumulate: int = 1
    """Batches per optimizer step (gradient accumulation: a larger batch on a CPU)."""
    autocast: bool = False
    """bf16 autocast for the forward (CPU fine-tuning: AMX matmuls)."""
    length_buckets: int = 4
    """Batches drawn together from one length-sorted pool (less padding)."""
    data_workers: int = -1
    """Processes generating batches (-1: 3 on CUDA, 0 on the CPU)."""
    task: TaskSpec = field(default_factory=TaskSpec)


def encode_batch(problems: Sequence[Problem], tok: CharTokenizer, device: torch.device | str,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [B, T], targets [B, T] with -100 outside the answer, valid lengths [B]); rows are
    ``<bos> prompt answer <eos>`` shifted by one, right-padded."""
    rows, targets, lens = [], [], []
    for p in problems:
        prompt = tok.encode(p.prompt, bos=True)
        full = prompt + tok.encode(p.answer, eos=True)
        inp, tgt = full[:-1], full[1:]
        tgt = [-100] * (len(prompt) - 1) + tgt[len(prompt) - 1:]
        rows.append(inp)
        targets.append(tgt)
        lens.append(len(inp))
    t = max(lens)
    x = torch.full((len(rows), t), tok.pad_id, dtype=torch.long)
    y = torch.full((len(rows), t), -100, dtype=torch.long)
    for i, (r, g) in enumerate(zip(rows, targets, strict=True)):
        x[i, :len(r)] = torch.tensor(r)
        y[i, :len(g)] = torch.tensor(g)
    return x.to(device), y.to(device), torch.tensor(lens, device=device)


@torch.no_grad()
def greedy_answers(model: TrainLM, problems: Sequence[Problem], tok: CharTokenizer,
                   quant: QuantOptions = EVAL_QUANT, batch: int = 200, max_new: int = 4,
                   dtype: torch.dtype = torch.float32, log: Any = None) -> list[str]:
    """Greedy answers by the training model itself (full re-forward per token, no caches): a
    cheap progress signal during training. The shipped model is scored by :mod:`dsv4.tinylm.eval`
    through the inference layers instead. ``log`` gets a line per batch (on a CPU a batch can
    take a minute)."""
    device = next(model.parameters()).device
    out: list[str] = []
    for s in range(0, len(problems), batch):
        if log is not None:
            log(f"answering held-out problems {s + 1}-{min(s + batch, len(problems))} of "
                f"{len(problems)} ...")
        chunk = problems[s:s + batch]
        seqs = [tok.encode(p.prompt, bos=True) for p in chunk]
        done = [False] * len(seqs)
        answers: list[list[int]] = [[] for _ in seqs]
        for _ in range(max_new):
            t = max(len(q) for q in seqs)
            x = torch.full((len(seqs), t), tok.pad_id, dtype=torch.long)
            for i, q in enumerate(seqs):
                x[i, :len(q)] = torch.tensor(q)
            logits, _ = model(x.to(device), quant=quant, dtype=dtype)
            last = torch.tensor([len(q) - 1 for q in seqs], device=device)
            nxt = logits[torch.arange(len(seqs), device=device), last].argmax(-1).tolist()
            for i, n in enumerate(nxt):
                if not done[i]:
                    answers[i].append(n)
                    seqs[i] = seqs[i] + [n]
                    done[i] = n == tok.eos_id
            if all(done):
                break
        out += [tok.decode(a) for a in answers]
    return out


def accuracy(answers: Sequence[str], problems: Sequence[Problem]) -> float:
    return sum(a == p.answer for a, p in zip(answers, problems, strict=True)) / len(problems)


class _Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Endless training batches; each worker process has its own seeded stream."""

    def __init__(self, settings: TrainSettings, tok: CharTokenizer) -> None:
        self.settings, self.tok = settings, tok

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid = 0 if info is None else info.id
        rng = random.Random(1000 * (self.settings.seed + 1) + wid)  # never the held-out seed
        b, k = self.settings.batch, self.settings.length_buckets
        while True:
            # k batches at a time from one sorted pool: rows of similar length pad little
            pool = sorted((make_problem(rng, self.settings.task) for _ in range(k * b)),
                          key=lambda p: len(p.prompt))
            order = list(range(k))
            rng.shuffle(order)
            for i in order:
                yield encode_batch(pool[i * b:(i + 1) * b], self.tok, "cpu")


def _lr(settings: TrainSettings, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return settings.lr * warm * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cos)


def check_settings(settings: TrainSettings) -> None:
    """The limits that end the training, checked before it starts: a time budget that is not a
    positive number would never be reached (or end it at once)."""
    if not (math.isfinite(settings.seconds) and settings.seconds > 0):
        raise ValueError(f"seconds={settings.seconds}: the time budget must be a positive number")
    if not (math.isfinite(settings.lr) and settings.lr > 0):
        raise ValueError(f"lr={settings.lr}: the learning rate must be a positive number")
    if settings.max_steps < 0:
        raise ValueError(f"max_steps={settings.max_steps}: must be >= 0 (0: no step limit)")
    if settings.batch < 1:
        raise ValueError(f"batch={settings.batch}: must be at least 1")


def train_tiny(settings: TrainSettings, cfg: TinyLMConfig | None = None,
               log: Any = print) -> tuple[TrainLM, dict[str, Any]]:
    """Train for ``settings.seconds`` (and at most ``settings.max_steps`` steps), then score the
    held-out problems; returns the float model and a report (curves, timings). ``log`` gets the
    progress lines."""
    check_settings(settings)
    cfg = dataclasses.replace(cfg or TinyLMConfig.preset(), task=settings.task)
    torch.manual_seed(settings.seed)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tok = cfg.tokenizer
    model = TrainLM(cfg)
    if settings.init_from:
        model.load_state_dict(torch.load(settings.init_from, map_location="cpu"))
    model = model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=settings.lr,
                            betas=(0.9, 0.98))
    heldout = heldout_problems(settings.eval_problems, settings.task)
    workers = settings.data_workers if settings.data_workers >= 0 else (
        3 if device.type == "cuda" else 0)
    batches = iter(torch.utils.data.DataLoader(
        _Batches(settings, tok), batch_size=None, num_workers=workers,
        prefetch_factor=8 if workers else None, pin_memory=device.type == "cuda"))
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    log(f"training on {device} for {settings.seconds:g} s"
        + (f" or {settings.max_steps} steps, whichever comes first" if settings.max_steps
           else "") + f", {settings.batch} problems a step")
    t0 = time.perf_counter()
    last_eval = last_log = t0
    step = 0
    phase = "dense"
    while True:
        elapsed = time.perf_counter() - t0
        frac = elapsed / settings.seconds
        if frac >= 1.0 or (settings.max_steps and step >= settings.max_steps):
            break
        if settings.max_steps:
            frac = max(frac, step / settings.max_steps)
        phase = ("dense" if frac < settings.dense_share else
                 "sparse" if frac < 1 - settings.qat_share else "qat")
        lr = _lr(settings, step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for _ in range(settings.accumulate):  # one optimizer step over `accumulate` batches
            x, y, lens = (t.to(device, non_blocking=True) for t in next(batches))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.autocast):
                logits, kl = model(x, sparse=phase != "dense",
                                   quant=QAT if phase == "qat" else NO_QUANT, indexer_loss=True,
                                   valid_len=lens)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            loss = ce + settings.indexer_loss_weight * kl
            (loss / settings.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            curve.append({"step": step, "seconds": time.perf_counter() - t0,
                          "ce": float(ce.detach()), "indexer_kl": float(kl.detach()), "lr": lr,
                          "phase_id": ["dense", "sparse", "qat"].index(phase)})
        if step == 1 or time.perf_counter() - last_log >= settings.log_every_s:
            last_log = time.perf_counter()  # a heartbeat: a CPU step can take many seconds
            log(f"step {step} {phase} {last_log - t0:.0f}s ce {float(ce.detach()):.4f} "
                f"kl {float(kl.detach()):.4f} lr {lr:.2e}")
        if time.perf_counter() - last_eval >= settings.eval_every_s:
            last_eval = time.perf_counter()
            model.eval()
            acc = accuracy(greedy_answers(model, heldout, tok), heldout)
            model.train()
            evals.append({"step": step, "seconds": last_eval - t0, "accuracy": acc})
            log(f"step {step} {phase} {last_eval - t0:.0f}s ce {float(ce.detach()):.4f} "
                f"kl {float(kl.detach()):.4f} lr {lr:.2e} heldout acc {acc:.3f}")
    train_seconds = time.perf_counter() - t0
    model.eval()
    log(f"trained {step} steps in {train_seconds:.0f}s; held-out accuracy of {len(heldout)} "
        "problems, with checkpoint weights + simulations, then float:")
    final_acc = accuracy(greedy_answers(model, heldout, tok, log=log), heldout)
    float_acc = accuracy(greedy_answers(model, heldout, tok, quant=NO_QUANT, log=log), heldout)
    evals.append({"step": step, "seconds": train_seconds, "accuracy": final_acc})
    log(f"done: {step} steps in {train_seconds:.0f}s; held-out accuracy {final_acc:.3f} with "
        f"checkpoint weights + simulations, {float_acc:.3f} float")
    report = {"settings": {k: v for k, v in asdict(settings).items() if k != "task"},
              "task": asdict(settings.task), "steps": step, "train_seconds": train_seconds,
              "heldout_accuracy_checkpoint_numerics": final_acc,
              "heldout_accuracy_float": float_acc, "curve": curve, "evals": evals,
              "device": str(device), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else f"cpu ({torch.get_num_threads()} threads)"}
    return model, report


def save_report(report: dict[str, Any], folder: Path) -> list[Path]:
    """``train_report.json`` and ``loss_curve.png`` (matplotlib, when installed; a line on
    stderr says when it is not); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train_report.json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("dsv4 train-tiny: warning: matplotlib is not installed (pip install matplotlib), "
              "so loss_curve.png was not written", file=sys.stderr, flush=True)
        return [folder / "train_report.json"]
    curve = report["curve"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [c["step"] for c in curve]
    ax[0].semilogy(steps, [c["ce"] for c in curve], label="answer cross-entropy")
    ax[0].semilogy(steps, [max(c["indexer_kl"], 1e-6) for c in curve], label="indexer KL")
    names = ["dense", "sparse", "qat"]
    for prev, cur in zip(curve, curve[1:], strict=False):
        if cur["phase_id"] != prev["phase_id"]:
            ax[0].axvline(cur["step"], color="gray", ls=":")
            ax[0].text(cur["step"], ax[0].get_ylim()[1], f" {names[int(cur['phase_id'])]}",
                       va="top", fontsize=8)
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[0].set_title("training loss")
    ev = report["evals"]
    ax[1].plot([e["step"] for e in ev], [e["accuracy"] for e in ev], marker="o")
    ax[1].set_ylim(0, 1.02)
    ax[1].set_xlabel("step")
    ax[1].set_title("held-out accuracy (training model, greedy)")
    fig.suptitle(f"tiny-arith: {report['steps']} steps, {report['train_seconds']:.0f} s on "
                 f"{report['device_name']}")
    fig.tight_layout()
    fig.savefig(folder / "loss_curve.png", dpi=110)
    plt.close(fig)
    return [folder / "train_report.json", folder / "loss_curve.png"]
