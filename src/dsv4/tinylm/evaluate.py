"""``dsv4 eval``: the shipped model answers the held-out problems on every platform x compressor
fusion on/off, through the full load -> post-load passes -> prefill -> decode path.

Accuracy is exact-match of the greedy answer; token agreement is the share of ``reference``
(fusion off) generated tokens that the run reproduced at the same position. A platform whose
weights went through a wrong GEMM (the upstream regression) answers garbage: accuracy collapses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsv4.checkpoint import CheckpointError
from dsv4.config import ConfigError
from dsv4.platforms import available, get_platform
from dsv4.platforms.registry import platform_spec
from dsv4.tinylm.checkpoint import check_model_folder, load_tiny_lm
from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.generate import DecodeStats, generate_ids
from dsv4.tinylm.task import Problem, heldout_problems


@dataclass
class EvalRun:
    platform: str
    fusion: bool
    device: str
    mode: str
    """"graph": decode steps through the decode runner's CUDA graphs and the platform's own
    (platforms that have them); "eager": both off."""
    n: int
    correct: int
    token_agreement: float
    """Share of the baseline's generated tokens reproduced at the same position."""
    load_seconds: float
    answer_seconds: float
    passes: list[str]
    error: str = ""
    cache: str = "auto/auto"
    """Stored formats of the caches, ``kv_cache_dtype/index_cache_dtype``."""
    decode_tokens_per_s: float = 0.0
    """Decode steps' tokens per second (prefill excluded)."""
    answers: list[str] = field(default_factory=list, repr=False)
    tokens: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def passes_with_fusion(platform: str, fusion: bool) -> list[str]:
    """The platform's post-load passes with the compressor fusion on or off (as
    :func:`dsv4.testing.verify.passes_for`, without building a layer first)."""
    names = [p for p in platform_spec(platform).pass_names if p != "compressor_fusion"]
    return ["compressor_fusion", *names] if fusion else names


def token_agreement(runs: Sequence[list[int]], base: Sequence[list[int]]) -> float:
    total = sum(len(b) for b in base)
    same = sum(sum(1 for i, t in enumerate(b) if i < len(r) and r[i] == t)
               for r, b in zip(runs, base, strict=True))
    return same / max(1, total)


def graph_modes(platform: str, device: str) -> tuple[str, ...]:
    """("graph", "eager") for a platform whose layers run CUDA graphs (``use_cuda_graphs``),
    else ("eager",)."""
    cls = get_platform(platform, device).attention_cls
    return ("graph", "eager") if hasattr(cls, "use_cuda_graphs") else ("eager",)


EXACT_CACHE = ("auto", "auto")


def run_label(platform: str, fusion: bool, mode: str, cache: str) -> str:
    """A run's name in progress lines and verdicts (the cache only when it is not exact)."""
    name = f"{platform} fusion {'on' if fusion else 'off'} {mode}"
    return name if cache == "/".join(EXACT_CACHE) else f"{name} cache {cache}"


def parse_cache_format(text: str) -> tuple[str, str]:
    """``KV/INDEX`` (e.g. ``fp8_ds_mla/fp4``) -> (kv_cache_dtype, index_cache_dtype), checked
    against the formats the cache knows."""
    from dsv4.cache.formats import INDEX_FORMATS, KV_FORMATS

    kv, sep, idx = text.partition("/")
    if not sep or kv not in KV_FORMATS or idx not in INDEX_FORMATS:
        raise ValueError(f"cache format {text!r}: expected KV/INDEX with KV one of "
                         f"{list(KV_FORMATS)} and INDEX one of {list(INDEX_FORMATS)}, e.g. "
                         "fp8_ds_mla/fp8")
    return kv, idx


def default_decode_batch(device: str) -> int | None:
    """On a GPU, decode 16 sequences per forward (a decode server's batch; the ``cuda``
    platform's one-launch path); on the CPU all unfinished sequences at once (fastest)."""
    return 16 if str(device).startswith("cuda") else None


def answer_problems(model_dir: str | Path, problems: Sequence[Problem], platform: str,
                    fusion: bool, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                    mode: str = "graph", decode_batch: int | None = None,
                    cache: tuple[str, str] = EXACT_CACHE, act_quant: bool = False) -> EvalRun:
    passes = passes_with_fusion(platform, fusion)
    t0 = time.perf_counter()
    model = load_tiny_lm(model_dir, platform=platform, device=device, dtype=dtype, passes=passes,
                         kv_cache_dtype=cache[0], index_cache_dtype=cache[1],
                         act_quant=act_quant)
    if mode not in graph_modes(platform, device):
        mode = "eager"
    for block in model.layers:
        switch = getattr(block.attn, "use_cuda_graphs", None)
        if callable(switch):
            switch(mode == "graph")
    t1 = time.perf_counter()
    tok = model.cfg.tokenizer
    prompts = [tok.encode(p.prompt, bos=True) for p in problems]
    max_new = model.cfg.task.max_answer_tokens
    stats = DecodeStats()
    runner = model.decode_runner(mode="auto" if mode == "graph" else "eager")
    outs = generate_ids(model, prompts, max_new, decode_batch=decode_batch, runner=runner,
                        stats=stats)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    answers = [tok.decode(o) for o in outs]
    correct = sum(a == p.answer for a, p in zip(answers, problems, strict=True))
    return EvalRun(platform, fusion, device, mode, len(problems), correct, 1.0, t1 - t0,
                   t2 - t1, passes, cache="/".join(cache),
                   decode_tokens_per_s=stats.tokens_per_second, answers=answers, tokens=outs)


def evaluate(model_dir: str | Path, platforms: Sequence[str] | None = None,
             device: str = "cpu", n: int = 400, fusions: Sequence[bool] = (False, True),
             dtype: torch.dtype = torch.bfloat16, log: Any = None,
             decode_batch: int | None = -1, on_start: Any = None,
             cache_formats: Sequence[tuple[str, str]] = (EXACT_CACHE,),
             act_quant: bool = False) -> list[EvalRun]:
    """Every platform x fusion setting (x CUDA graphs on / off where the platform has them)
    x stored cache format (``(kv_cache_dtype, index_cache_dtype)`` pairs); token agreement
    against ``reference`` without fusion with exact storage (always run first). A run that
    raises is reported with its error, never aborts the rest. ``decode_batch``: sequences per
    decode forward (-1: :func:`default_decode_batch`, None: all at once). ``act_quant``: every
    run, the baseline too, with the official fp8 activation quantisation (docs/spec.md §6.3).
    ``on_start(k, total, name)`` and ``log(row)`` are called before and after each run."""
    if decode_batch == -1:
        decode_batch = default_decode_batch(device)
    names = list(dict.fromkeys(platforms)) if platforms else available(device)  # once each
    for name in names:
        get_platform(name, device)  # unknown / unavailable: a clear error before any work
    check_model_folder(Path(model_dir))
    try:
        task = TinyLMConfig.from_pretrained(model_dir).task
    except ConfigError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    problems = heldout_problems(n, task)
    base_combo = ("reference", False, "eager", EXACT_CACHE)
    combos = [base_combo] + [
        (p, f, m, c) for p in names for f in fusions for m in graph_modes(p, device)
        for c in cache_formats if (p, f, c) != ("reference", False, EXACT_CACHE)]
    runs: list[EvalRun] = []
    base: list[list[int]] | None = None
    for k, (platform, fusion, mode, cache) in enumerate(combos, 1):
        if on_start is not None:
            on_start(k, len(combos), run_label(platform, fusion, mode, "/".join(cache)))
        try:
            run = answer_problems(model_dir, problems, platform, fusion, device, dtype, mode,
                                  decode_batch, cache, act_quant)
        except Exception as e:  # noqa: BLE001 - a broken platform is a row, not a crash
            if base is None:
                raise
            run = EvalRun(platform, fusion, device, mode, len(problems), 0, 0.0, 0.0, 0.0, [],
                          error=f"{type(e).__name__}: {e}", cache="/".join(cache))
        if base is None:
            base = run.tokens
        elif not run.error:
            run.token_agreement = token_agreement(run.tokens, base)
        runs.append(run)
        if log is not None:
            log(format_row(run))
    return runs


def format_row(r: EvalRun) -> str:
    if r.error:
        return (f"| {r.platform} | {'on' if r.fusion else 'off'} | {r.mode} | {r.cache} | "
                f"ERROR: {r.error} | | | | |")
    return (f"| {r.platform} | {'on' if r.fusion else 'off'} | {r.mode} | {r.cache} | "
            f"{r.accuracy:.3f} "
            f"({r.correct}/{r.n}) | {100 * r.token_agreement:.2f} % | {r.answer_seconds:.1f} | "
            f"{r.decode_tokens_per_s:.0f} | {'+'.join(r.passes) or '-'} |")


def format_table(runs: Sequence[EvalRun]) -> str:
    head = ["| platform | compressor fusion | mode | cache (kv/index keys) | accuracy "
            "| tokens = reference | s (400 answers) | decode tokens/s | post-load passes |",
            "|---|---|---|---|---|---|---|---|---|"]
    if runs:
        head[0] = head[0].replace("400", str(runs[0].n))
    return "\n".join(head + [format_row(r) for r in runs])


def runs_to_json(runs: Sequence[EvalRun], path: str | Path, extra: dict[str, Any] | None = None
                 ) -> None:
    rows = []
    for r in runs:
        d = asdict(r)
        d["accuracy"] = r.accuracy
        rows.append(d)
    Path(path).write_text(json.dumps({"runs": rows, **(extra or {})}, indent=1))
