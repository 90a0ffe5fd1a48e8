"""Decode tokens/s of a transformers DeepSeek-V4 model: its own attention vs dsv4's.

A Flash-shaped ``DeepseekV4ForCausalLM`` cut to a few layers (``--layers``, default 4: SWA, SWA,
C4A, C128A as in Flash; fewer routed experts, ``--experts``, so that it builds quickly) with
random weights is run twice on the same weights: once as transformers ships it (eager attention,
its ``DynamicCache``), once after ``dsv4.integrations.transformers.use_dsv4_attention(model,
platform)``. Before any timing, greedy decoding from the same prompt must give the same tokens
for ``--check-steps`` steps (``--no-strict`` records a disagreement and goes on).

For each batch size and context length, the context is prefilled in chunks (``--prefill-chunk``,
default: transformers' as large as keeps its eager score tensor under ~4 GiB; dsv4's at least
:data:`DSV4_PREFILL_TOKENS` tokens a forward over the batch, its layers bounding their own
memory - the decode steps timed after either prefill are the same) and then ``--steps``
greedy decode steps are timed (after ``--warmup`` untimed ones); tokens/s = batch x steps / time;
the peak of allocated device memory of each cell (prefill and decode) is recorded, and a side
that runs out of memory is a row saying so, and in which phase. ``--memory-limit-gib`` caps
what this process may allocate on the GPU (``torch.cuda.set_per_process_memory_fraction``): a
smaller card, where the side whose cache grows faster runs out at a context that a 10-minute
run can prefill (transformers' cache of the 4-layer cut grows by about 5 KB a token, dsv4's by
about 0.2). Each cell prints a line as it ends. dsv4 decodes through the bridge's decode
runners (each layer's decode step a CUDA graph per batch bucket on a GPU).
Writes ``transformers_decode.json``, ``transformers_decode.md`` and (with matplotlib)
``transformers_decode.png`` under ``--out``.

``--tiny`` swaps in a tiny config (every layer type, hidden 64) for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.args import add_out_options, check_out, int_list, pyplot
from dsv4.usage import OneLineArgumentParser, UsageError, check_at_least, resolve_device

FLASH_SCHEDULE = ["sliding_attention"] * 2 + [
    "compressed_sparse_attention", "heavily_compressed_attention"] * 20 + [
    "compressed_sparse_attention"]


def flash_cut_kwargs(layers: int, experts: int, vocab: int) -> dict[str, Any]:
    """transformers DeepseekV4Config kwargs of V4-Flash, cut to ``layers`` layers."""
    return dict(
        vocab_size=vocab, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
        num_experts_per_tok=min(6, experts), n_routed_experts=experts, n_shared_experts=1,
        max_position_embeddings=1048576, layer_types=FLASH_SCHEDULE[:layers],
        mlp_layer_types=["hash_moe" if i < 3 else "moe" for i in range(layers)],
        hc_mult=4, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
        index_head_dim=128, index_topk=512, partial_rotary_factor=64 / 512,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 65536, "beta_fast": 32.0,
                         "beta_slow": 1.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def tiny_kwargs() -> dict[str, Any]:
    return dict(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, q_lora_rank=32,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=4,
        sliding_window=8, o_groups=2, o_lora_rank=32, index_n_heads=16, index_head_dim=64,
        index_topk=4, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


@torch.no_grad()
def build_model(kwargs: dict[str, Any], device: str, dtype: torch.dtype, seed: int) -> Any:
    """The model with random weights: attention weights of unit-variance outputs, embeddings
    and head of unit scale, so that greedy tokens are not decided by near ties."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(DeepseekV4Config(**kwargs), dtype=dtype)
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    for name, p in model.named_parameters():
        def rand(shape: torch.Size = p.shape) -> torch.Tensor:
            return randn(shape)

        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            p.copy_(rand())
        elif ".self_attn." not in name:
            continue
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * rand())
        elif name.endswith("sinks"):
            p.copy_(rand())
        elif name.endswith("position_bias"):
            p.copy_(0.5 * rand())
        else:
            p.copy_((2.0 if "gate_proj" in name else 1.0) * rand() / p.shape[-1] ** 0.5)
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


DSV4_PREFILL_TOKENS = 8192
"""Tokens per prefill forward (over the batch) that dsv4's side takes at least: its layers run
a forward in steps of at most ``max_step_tokens`` (8192 by default) with no score tensor over
the context, so its prefill need not shrink with the context as transformers' must (at batch
16 and 128K tokens, 16-token chunks: 8192 forwards)."""


def auto_chunk(batch: int, context: int, heads: int, window: int) -> int:
    """Largest power-of-two prefill chunk whose eager score tensor (fp32, every compressed entry
    of the context concatenated, as transformers does) stays under ~4 GiB."""
    chunk = 4096
    while chunk > 16 and batch * heads * chunk * (context // 4 + chunk + window) * 4 > 4 << 30:
        chunk //= 2
    return chunk


@torch.no_grad()
def _prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> torch.Tensor:
    logits = None
    for s in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True,
                    logits_to_keep=1)
        logits = out.logits
    assert logits is not None
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def greedy(model: Any, ids: torch.Tensor, steps: int, cache: Any, chunk: int) -> list[list[int]]:
    tok = _prefill(model, ids, cache, chunk)
    out = [tok]
    for _ in range(steps - 1):
        tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(
            -1, keepdim=True)
        out.append(tok)
    return torch.cat(out, dim=1).tolist()


class PhaseOutOfMemory(Exception):
    """A side ran out of device memory in ``phase`` ("prefill" or "decode")."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"out of device memory during {phase}")
        self.phase = phase


@torch.no_grad()
def time_decode(model: Any, batch: int, context: int, steps: int, warmup: int, cache: Any,
                chunk: int, device: str, seed: int) -> float:
    """Seconds per decode step at ``context`` cached tokens (PhaseOutOfMemory when the device
    runs out of memory)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
    try:
        tok = _prefill(model, ids, cache, chunk)
    except torch.OutOfMemoryError:
        raise PhaseOutOfMemory("prefill") from None
    try:
        for _ in range(warmup):
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(
                -1, keepdim=True)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(
                -1, keepdim=True)
        _sync(device)
    except torch.OutOfMemoryError:
        raise PhaseOutOfMemory("decode") from None
    return (time.perf_counter() - t0) / steps


def _hf_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cap_device_memory(device: str, gib: float) -> None:
    """Cap what this process may allocate on the CUDA ``device`` ("cuda" or "cuda:N") at
    ``gib`` GiB, as on a smaller card."""
    dev = torch.device(device)
    if dev.index is None:  # "cuda": the current device (PyTorch's cap needs an index)
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), dev)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4.integrations.transformers import use_dsv4_attention

    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.memory_limit_gib:
        cap_device_memory(args.device, args.memory_limit_gib)
    kwargs = tiny_kwargs() if args.tiny else flash_cut_kwargs(args.layers, args.experts,
                                                              args.vocab)
    model = build_model(kwargs, args.device, dtype, args.seed)
    cfg = model.config
    batches, contexts = list(args.batches), list(args.contexts)
    # the caches hold the longest timed cell, and the greedy check's prompt and tokens
    need = max(max(contexts) + args.warmup + args.steps + 1, args.check_steps + 1)

    def chunk_for(b: int, c: int) -> int:
        return args.prefill_chunk or auto_chunk(b, c, cfg.num_attention_heads,
                                                cfg.sliding_window)

    def dsv4_chunk_for(b: int, c: int) -> int:
        return args.prefill_chunk or max(chunk_for(b, c), DSV4_PREFILL_TOKENS // b)

    # correctness first: the same greedy tokens from the same prompt
    g = torch.Generator().manual_seed(args.seed + 2)
    prompt_len = min(args.check_prompt, need - args.check_steps)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g).to(args.device)
    ref_tokens = greedy(model, prompt, args.check_steps, _hf_cache(model),
                        chunk_for(1, prompt_len))
    timings: dict[tuple[str, int, int], Measured] = {}
    for b in batches:
        for c in contexts:
            timings[("transformers", b, c)] = measured(lambda b=b, c=c: time_decode(
                model, b, c, args.steps, args.warmup, _hf_cache(model), chunk_for(b, c),
                args.device, args.seed), args.device)
            _progress("transformers", b, c, timings[("transformers", b, c)])
    handle = use_dsv4_attention(model, platform=args.platform, max_seq_len=need)
    try:
        got_tokens = greedy(model, prompt, args.check_steps, handle.new_cache(need),
                            chunk_for(1, prompt_len))
        agree = sum(x == y for x, y in zip(ref_tokens[0], got_tokens[0], strict=True))
        check = {"steps": args.check_steps, "agree": agree, "transformers": ref_tokens[0],
                 "dsv4": got_tokens[0]}
        if agree != args.check_steps and args.strict:
            raise SystemExit(f"greedy tokens disagree before timing: transformers "
                             f"{ref_tokens[0]} vs dsv4 {got_tokens[0]} (use --no-strict to "
                             "time anyway)")
        for b in batches:
            for c in contexts:
                timings[("dsv4", b, c)] = measured(lambda b=b, c=c: time_decode(
                    model, b, c, args.steps, args.warmup, handle.new_cache(need),
                    dsv4_chunk_for(b, c), args.device, args.seed), args.device)
                _progress("dsv4", b, c, timings[("dsv4", b, c)])
    finally:
        handle.restore()
    rows = []
    for b in batches:
        for c in contexts:
            row: dict[str, Any] = {"batch": b, "context": c}
            for side in ("transformers", "dsv4"):
                t, peak, oom = timings[(side, b, c)]
                row[f"{side}_tok_s"] = None if t is None else b / t
                row[f"{side}_ms_step"] = None if t is None else 1e3 * t
                row[f"{side}_peak_gib"] = None if peak is None else peak / 2**30
                row[f"{side}_oom"] = t is None
                row[f"{side}_oom_phase"] = oom
            t_hf, t_ds = timings[("transformers", b, c)][0], timings[("dsv4", b, c)][0]
            row["speedup"] = None if t_hf is None or t_ds is None else t_hf / t_ds
            rows.append(row)
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else "cpu")
    return {"model": "tiny" if args.tiny else f"flash-cut-{args.layers}-layers",
            "layer_types": list(cfg.layer_types), "routed_experts": cfg.n_routed_experts,
            "dtype": args.dtype, "device": device_name, "platform": args.platform,
            "memory_limit_gib": args.memory_limit_gib or None,
            "steps": args.steps, "warmup": args.warmup, "check": check, "rows": rows}


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


Measured = tuple[float | None, int | None, str | None]
"""(seconds per step or None, peak allocated device bytes or None on the CPU, the phase that
ran out of device memory or None)."""


def measured(fn: Any, device: str) -> Measured:
    """(``fn()``'s seconds per step, the peak of allocated device memory during it in bytes,
    None); (None, the peak, the phase) when it ran out of device memory (PhaseOutOfMemory);
    the peak is None on the CPU."""
    cuda = device.startswith("cuda")
    _free(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    phase = None
    try:
        t: float | None = fn()
    except PhaseOutOfMemory as e:
        t, phase = None, e.phase
    peak = torch.cuda.max_memory_allocated() if cuda else None
    _free(device)
    return t, peak, phase


def _progress(side: str, batch: int, context: int, m: Measured) -> None:
    t, peak, phase = m
    what = f"out of memory in {phase}" if phase else f"{1e3 * (t or 0.0):.2f} ms/step"
    mem = "" if peak is None else f", peak {peak / 2**30:.2f} GiB"
    print(f"{side}: batch {batch}, context {context}: {what}{mem}", flush=True)


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# transformers DeepSeek-V4 decode: own attention vs dsv4 (`{result['platform']}`)",
        "",
        f"model {result['model']} ({', '.join(result['layer_types'])}; "
        f"{result['routed_experts']} routed experts), {result['dtype']}, {result['device']}, "
        f"{result['steps']} timed steps after {result['warmup']} warm-up steps"
        + (f"; device memory capped at {result['memory_limit_gib']:g} GiB "
           "(`--memory-limit-gib`)." if result.get("memory_limit_gib") else "."),
        f"Greedy check before timing: {result['check']['agree']} / {result['check']['steps']} "
        "tokens agree.",
        "",
        "| batch | context | transformers tok/s | dsv4 tok/s | transformers ms/step | "
        "dsv4 ms/step | speed-up | transformers peak GiB | dsv4 peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(v: Any, fmt: str, oom: str | None) -> str:
        return (f"out of memory ({oom})" if oom else "-" if v is None else format(v, fmt))

    for r in result["rows"]:
        hf, ds = r["transformers_oom_phase"], r["dsv4_oom_phase"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {cell(r['transformers_tok_s'], '.1f', hf)} | "
            f"{cell(r['dsv4_tok_s'], '.1f', ds)} | {cell(r['transformers_ms_step'], '.2f', hf)} | "
            f"{cell(r['dsv4_ms_step'], '.2f', ds)} | "
            f"{'-' if r['speedup'] is None else format(r['speedup'], '.2f') + 'x'} | "
            f"{cell(r['transformers_peak_gib'], '.2f', None)} | "
            f"{cell(r['dsv4_peak_gib'], '.2f', None)} |")
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False (said on stderr) when matplotlib is missing."""
    plt = pyplot("transformers-decode", path)
    if plt is None:
        return False
    rows = result["rows"]
    labels = [f"B={r['batch']}\nctx={r['context']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows)), 4))
    w = 0.4
    ax.bar([i - w / 2 for i in x], [r["transformers_tok_s"] or 0 for r in rows], w,
           label="transformers attention (0: out of memory)")
    ax.bar([i + w / 2 for i in x], [r["dsv4_tok_s"] or 0 for r in rows], w,
           label=f"dsv4 ({result['platform']})")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode tokens / s")
    ax.set_yscale("log" if any(r["speedup"] is not None and (r["speedup"] > 10
                                                             or r["speedup"] < 0.1)
                               for r in rows) else "linear")
    ax.set_title(f"{result['model']}, {result['dtype']}, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


RESULTS = ("transformers_decode.json", "transformers_decode.md", "transformers_decode.png")
"""The files a run writes into ``--out``."""


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "transformers_decode.json, .md and .png")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or cuda:N (default: cuda; on a machine without a GPU give "
                    "--device cpu, with --tiny for a smoke run)")
    ap.add_argument("--platform", default=None,
                    help="dsv4 platform (dsv4.platforms; default: cuda on a GPU, else reference)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "float32"],
                    help="weights and activations (default bf16)")
    ap.add_argument("--layers", type=int, default=4,
                    help="layers of the Flash-shaped model (default 4: SWA, SWA, C4A, C128A)")
    ap.add_argument("--experts", type=int, default=8,
                    help="routed experts (default 8; Flash: 256)")
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary size (default 129280)")
    ap.add_argument("--batches", default=[1, 16], type=int_list,
                    help="comma-separated sequences per decode step (default 1,16)")
    ap.add_argument("--contexts", default=[4096, 32768, 262144], type=int_list,
                    help="comma-separated cached tokens per sequence (default 4096,32768,262144;"
                    " a side that runs out of device memory is recorded as such)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed decode steps before them (default 4)")
    ap.add_argument("--memory-limit-gib", type=float, default=0.0,
                    help="cap this process's GPU allocations at this many GiB (default 0: no "
                    "cap), as on a smaller card")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="tokens of each sequence per prefill forward, both sides (default 0: "
                    "automatic, see the module docstring)")
    ap.add_argument("--check-steps", type=int, default=8,
                    help="greedy tokens that must agree before timing (default 8)")
    ap.add_argument("--check-prompt", type=int, default=300,
                    help="prompt tokens of that check (default 300)")
    ap.add_argument("--no-strict", dest="strict", action="store_false",
                    help="time even when the greedy check disagrees (default: stop)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke run)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before the model is built (UsageError otherwise)."""
    import importlib.util

    for option in ("layers", "experts", "vocab", "steps", "check_steps", "check_prompt"):
        check_at_least(f"--{option.replace('_', '-')}", getattr(args, option), 1)
    for option in ("warmup", "prefill_chunk"):
        check_at_least(f"--{option.replace('_', '-')}", getattr(args, option), 0)
    if args.device is None and not torch.cuda.is_available():
        raise UsageError("no CUDA GPU here: give --device cpu (with --tiny for a CPU smoke run) "
                         "or run on a GPU")
    args.device = resolve_device(args.device)
    if args.memory_limit_gib < 0 or (args.memory_limit_gib
                                     and torch.device(args.device).type != "cuda"):
        raise UsageError(f"--memory-limit-gib {args.memory_limit_gib:g}: a positive cap on a "
                         "CUDA device (0: none)")
    if args.platform is None:
        args.platform = "cuda" if torch.device(args.device).type == "cuda" else "reference"
    from dsv4.platforms import get_platform
    from dsv4.platforms.registry import PlatformUnavailableError, UnknownPlatformError

    try:
        get_platform(args.platform, args.device)
    except (UnknownPlatformError, PlatformUnavailableError) as e:
        raise UsageError(f"--platform {args.platform}: {e}") from None
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("needs transformers (pip install 'dsv4[transformers]')")
    check_out(args.out, RESULTS, args.overwrite)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        check_args(args)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transformers_decode.json").write_text(json.dumps(result, indent=1))
    md = to_markdown(result)
    (args.out / "transformers_decode.md").write_text(md)
    _plot(result, args.out / "transformers_decode.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
