"""Fine-tuning the last blocks on cached activations (the CPU continuation of a GPU run).

A CPU cannot afford many full training steps of the tiny LM (seconds each on 2 cores), but the
first blocks can stay frozen: their output for a pool of training problems is computed once
(under the checkpoint numerics the shipped model runs with), and the blocks from ``from_layer``
on, the final norm and the head train on it for several epochs, the last block with queries only
at the answer rows (its keys and compressed entries still come from every position).
Quant-aware throughout (:data:`dsv4.model.train.QAT`).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.model.task import TaskSpec, heldout_problems, make_problem
from dsv4.model.train import EVAL_QUANT, QAT, accuracy, encode_batch, greedy_answers
from dsv4.model.train_lm import TrainLM


@dataclass
class FinetuneSettings:
    problems: int = 6144
    batch: int = 32
    epochs: int = 6
    lr: float = 2e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    seconds: float = 1800.0
    """Stop the epochs after this many seconds of training (the cache is not counted)."""
    seed: int = 11
    eval_problems: int = 400
    eval_every_steps: int = 400
    indexer_loss_weight: float = 1.0
    from_layer: int = -1
    """First block that trains (-1: the last one)."""


def _answer_rows(y: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, width] whose targets are answer tokens (padded with the last one, whose
    target is then ignored) and the targets there."""
    rows = torch.zeros(y.shape[0], width, dtype=torch.long)
    tgt = torch.full((y.shape[0], width), -100, dtype=torch.long)
    for b in range(y.shape[0]):
        pos = (y[b] != -100).nonzero().flatten()
        rows[b, :len(pos)] = pos
        rows[b, len(pos):] = pos[-1]
        tgt[b, :len(pos)] = y[b, pos]
    return rows, tgt


def finetune_tail(model: TrainLM, settings: FinetuneSettings, task: TaskSpec,
                  log: Any = print) -> dict[str, Any]:
    n_layers = len(model.layers)
    first = settings.from_layer % n_layers
    trainable = tuple(f"layers.{i}." for i in range(first, n_layers)) + ("norm.", "head.")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trainable))
    tok = model.cfg.tokenizer
    rng = random.Random(settings.seed)  # not the held-out seed
    heldout = heldout_problems(settings.eval_problems, task)
    t0 = time.perf_counter()
    cache = []
    width = task.max_answer_tokens
    model.eval()
    for _ in range(settings.problems // settings.batch):
        probs = sorted((make_problem(rng, task) for _ in range(settings.batch)),
                       key=lambda p: len(p.prompt))
        x, y, lens = encode_batch(probs, tok, "cpu")
        h = model.hidden_before(x, first, EVAL_QUANT).to(torch.bfloat16)
        cache.append((h, *_answer_rows(y, width), lens))
    cache_seconds = time.perf_counter() - t0
    log(f"cached the input of block {first} for {len(cache) * settings.batch} problems in "
        f"{cache_seconds:.0f}s")
    before = accuracy(greedy_answers(model, heldout, tok), heldout)
    log(f"held-out accuracy before: {before:.3f}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.01)
    total = settings.epochs * len(cache)
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = [{"step": 0, "seconds": 0.0, "accuracy": before}]
    step = 0
    t1 = time.perf_counter()
    model.train()
    for _epoch in range(settings.epochs):
        order = list(range(len(cache)))
        rng.shuffle(order)
        for i in order:
            if time.perf_counter() - t1 > settings.seconds:
                break
            h, rows, tgt, lens = cache[i]
            frac = step / total
            warm = min(1.0, (step + 1) / settings.warmup_steps)
            cos = 0.5 * (1 + torch.cos(torch.tensor(torch.pi * frac))).item()
            lr = settings.lr * warm * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cos)
            for g in opt.param_groups:
                g["lr"] = lr
            logits, kl = model.forward_tail(h.float(), first, rows, quant=QAT,
                                            indexer_loss=True, valid_len=lens)
            ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
            loss = ce + settings.indexer_loss_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 10 == 0:
                curve.append({"step": step, "seconds": time.perf_counter() - t1,
                              "ce": float(ce.detach()), "indexer_kl": float(kl.detach()),
                              "lr": lr, "phase_id": 2})
            if step % settings.eval_every_steps == 0:
                model.eval()
                acc = accuracy(greedy_answers(model, heldout, tok), heldout)
                model.train()
                evals.append({"step": step, "seconds": time.perf_counter() - t1,
                              "accuracy": acc})
                log(f"step {step} ce {float(ce.detach()):.4f} lr {lr:.2e} held-out acc "
                    f"{acc:.3f}")
    train_seconds = time.perf_counter() - t1
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    final = accuracy(greedy_answers(model, heldout, tok), heldout)
    evals.append({"step": step, "seconds": train_seconds, "accuracy": final})
    log(f"fine-tune done: {step} steps in {train_seconds:.0f}s; held-out accuracy {before:.3f} "
        f"-> {final:.3f}")
    return {"settings": asdict(settings), "task": asdict(task), "steps": step,
            "train_seconds": train_seconds, "cache_seconds": cache_seconds,
            "heldout_accuracy_before": before, "heldout_accuracy_checkpoint_numerics": final,
            "curve": curve, "evals": evals, "device": "cpu", "device_name": "cpu",
            "torch": torch.__version__}
