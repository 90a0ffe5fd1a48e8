"""Compile the Triton kernels for sm_90 on a machine WITHOUT a GPU and print each
configuration's registers / spill stack (ptxas via Triton's bundled cuobjdump) and MMA kind.

    PYTHONPATH=src python benchmarks/aot_sm90_regs.py MODE   # gemm, mqa, mqa-tiles, steps,
                                                             # stages, fused, all (default), pdl

``gemm``: the fp8 weight-streaming GEMM's configurations and the one-pass dequantisation;
``mqa``: the sparse MQA kernel at the tiles it picks; ``mqa-tiles``: its 64-head tiles at 8 and
16 warps (not part of ``all``);

``steps``: the decode step's small kernels (cache writes, flat rows, raw rows, ring rows, the
indexer's scoring and top-k at decode and prefill, the split-KV combine) at Flash / Pro
shapes;
``stages``: the RoPE /
norm / quantisation kernels and the compressed entries; ``fused``: the one-launch input kernel
at Flash / Pro C4 decode configurations, with and without ``act_quant``; ``pdl``: all of them
with programmatic dependent launch on (``dsv4.kernels.launch``), each PTX checked for
``griddepcontrol.wait`` and ``launch_dependents`` (and the other modes for neither). The CPU
interpreter accepts code the compiler refuses (an annotated constexpr reassigned in an unrolled
loop, once); this compiles what a GPU would.

Catches compile errors and register spills before a GPU run. Integer arguments that are multiples
of 16 at run time (strides, K, block strides, H, rows per block) get Triton's divisibility hint,
as the JIT's specialisation would give them; pointers are 16-byte aligned. Uses Triton internals
(ASTSource, triton.compile with a GPUTarget): written against Triton 3.6.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
import traceback

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.kernels import compress_entries as ce
from dsv4.kernels import decode_metadata as dm
from dsv4.kernels import fp8_linear as fl
from dsv4.kernels import fused_input_proj as fip
from dsv4.kernels import indexer_prefill as ip
from dsv4.kernels import indexer_topk as it
from dsv4.kernels import paged_rows as pr
from dsv4.kernels import rope_norm as rn
from dsv4.kernels import sparse_mqa as sm
from dsv4.kernels import store_rows as sr

TARGET = GPUTarget("cuda", 90, 32)
DIV16 = {"sxm", "sxg", "sym", "syg", "R", "Kg", "K", "sqt", "sqh", "sot", "soh", "swi", "w_blk",
         "sci", "c_blk", "H", "B"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


AOT_PDL = False
"""Compile the kernels with their ``PDL`` constexpr set (``pdl`` mode: dsv4.kernels.launch)."""


def compile_one(fn, types: dict, consts: dict, opts: dict) -> str:
    if "PDL" in fn.arg_names and "PDL" not in consts:
        consts = {**consts, "PDL": AOT_PDL}
    # constexprs left out take the kernel's defaults (a launch that does not pass them)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
              **consts}
    if "USE_PDL" in consts and AOT_PDL:
        consts = {**consts, "USE_PDL": True}
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    t0 = time.time()
    k = triton.compile(src, target=TARGET, options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    use = " ".join(w for line in out.splitlines() if "REG" in line for w in line.split()
                   if w.startswith(("REG", "STACK")))
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no-mma"
    if "e4m3.e4m3" in ptx:
        mma += "(fp8)"
    gdc = ("griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
    if AOT_PDL and not all(gdc):
        raise RuntimeError(f"PDL on but the PTX has (wait, launch_dependents) = {gdc}")
    if not AOT_PDL and any(gdc):
        raise RuntimeError("PDL off but the PTX has griddepcontrol instructions")
    pdl = " pdl" if AOT_PDL else ""
    if "cp.async" in ptx:  # loads staged through shared memory: a software-pipelined loop
        mma += " cp.async"
    return f"{use} {mma}{pdl} smem={k.metadata.shared} ({time.time() - t0:.1f}s)"


GEMM_TYPES = dict(x_ptr="*bf16", sxm="i32", sxg="i32", w_ptr="*fp8e4nv", sc_ptr="*u8",
                  stride_sc="i32", y_ptr="*bf16", sym="i32", syg="i32", ws_ptr="*fp32",
                  cnt_ptr="*i32", M="i32", R="i32", Kg="i32", m_ws="i32", n_tiles="i32",
                  m_tiles="i32", G="i32", xs_ptr="*fp32", sxs="i32")
"""The fp8 GEMM kernel's runtime arguments."""


def _gemm_config(label: str, c, act: bool, x_fp8: bool = False) -> bool:
    """Compile the fp8 GEMM at config ``c``: fp8 x fp8 MMAs under ``act`` (x quantised in the
    loop, or with ``x_fp8`` read as e4m3 bytes quantised before), else bf16 MMAs on the
    widened weight."""
    consts = dict(BM=c.block_m, BN=c.block_n, SPLIT_K=c.split_k, SWAP=c.swap, SCALE_F32=False,
                  FENCE=True, DOT_DT=tl.bfloat16, DOT_PREC="tf32", ACT_FP8=act, X_FP8=x_fp8,
                  INTERP=False)
    types = {**GEMM_TYPES, "x_ptr": "*u8"} if x_fp8 else GEMM_TYPES
    return _try(f"{label} {c}", fl._fp8_gemm_kernel, types, consts,
                dict(num_warps=c.num_warps, num_stages=c.num_stages))


def gemm() -> None:
    seen = set()
    for M in (1, 16, 32, 64, 100):
        for n, k in ((32768, 1024), (4096, 8192), (7168, 16384), (8192, 4096)):
            # bf16 MMAs on the widened weight / fp8 x fp8 MMAs (x quantised in the loop)
            for act in (False, True):
                c = fl.choose_fp8_config(M, n, k, act_fp8=act)
                key = (c.block_m, c.block_n, c.split_k > 1, c.swap, c.num_warps, c.num_stages,
                       act)
                if key not in seen:
                    seen.add(key)
                    _gemm_config(f"fp8_gemm M={M} act_fp8={act}", c, act)
                    if act:  # the same tiles on activations quantised before the launch
                        _gemm_config(f"fp8_gemm M={M} x_fp8", c, True, x_fp8=True)


def dequant() -> None:
    """The one-pass fp8 -> bf16 weight copy of long calls (``fp8_dequantize``) and the
    activations' quantising launch."""
    types = dict(w_ptr="*fp8e4nv", sc_ptr="*u8", stride_sc="i32", o_ptr="*bf16", K="i32")
    for f32 in (False, True):
        t = {**types, "sc_ptr": "*fp32"} if f32 else types
        r = compile_one(fl._dequant_kernel, t, dict(BN=32, BK=128, SCALE_F32=f32),
                        dict(num_warps=4))
        print(f"fp8 dequant scale_f32={f32}: {r}", flush=True)
    # the activations' quantisation: e4m3 bytes and scales (quantize_activations), or the
    # values scaled back into bf16 (simulate_activations, SIM)
    types = dict(x_ptr="*bf16", sxm="i32", q_ptr="*u8", s_ptr="*fp32", M="i32", K="i32")
    for sim in (False, True):
        t = {**types, "q_ptr": "*bf16", "s_ptr": "*bf16"} if sim else types
        r = compile_one(fl._act_quant_kernel, t, dict(BM=16, SIM=sim), dict(num_warps=4))
        print(f"activation quantisation sim={sim}: {r}", flush=True)


MQA_TYPES = dict(q_ptr="*bf16", sqt="i32", sqh="i32", o_ptr="*bf16", sot="i32", soh="i32",
                 sink_ptr="*fp32", ws_acc="*fp32", ws_ml="*fp32", widx_ptr="*i32", swi="i32",
                 w_blk="i32", cidx_ptr="*i32", sci="i32", c_blk="i32", T="i32", H="i32",
                 W="i32", KC="i32", B="i32", chunk="i32", n_split="i32", qk_scale="fp32",
                 pos_ptr="*i64", freq_ptr="*fp32")
"""The sparse MQA kernel's runtime arguments (its stores' pointer types added per format)."""


def mqa() -> None:
    for fmt in ("fp8_ds_mla", "bf16"):
        st = "*u8" if fmt == "fp8_ds_mla" else "*bf16"
        types = {**MQA_TYPES, "win_ptr": st, "cmp_ptr": st}
        for H, d in ((64, 512), (128, 512), (4, 128)):
            c = sm.choose_sparse_config(64, H, d, 640, fmt=fmt)
            n = d - 64
            fp8 = fmt == "fp8_ds_mla"
            # the last: no split, the output's inverse RoPE in the store (ROPE_NOPE2)
            for split, rope in ((False, -1), (True, -1), (False, n // 2)):
                consts = dict(D=d, DV=d, BH=c.block_h, BN=c.block_n, SPLIT=split, FP8=fp8, NOPE=n,
                              DR=(n + 128) if fp8 else 0, SR=8 if fp8 else 0,
                              DOT_DT=tl.bfloat16, DOT_PREC="tf32", ROPE_NOPE2=rope)
                try:
                    r = compile_one(sm._sparse_mqa_kernel, types, consts,
                                    dict(num_warps=c.num_warps, num_stages=c.num_stages))
                    print(f"sparse_mqa {fmt} H={H} d={d} split={split} "
                          f"rope_nope2={rope} {c}: {r}", flush=True)
                except Exception:
                    traceback.print_exc()
                    print(f"FAIL sparse_mqa {fmt} {c}", flush=True)
    combine()


MQA_TILES = ((64, 16, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 16, 2), (64, 32, 16, 1),
             (64, 32, 16, 2), (64, 64, 16, 1), (64, 64, 16, 2))
"""(heads, rows, warps, stages) that ``mqa-tiles`` compiles: the 64-head tiles Hopper's wgmma
takes, whole 512-column accumulators, at 8 warps (the default from 16 queries; 32 and 64 rows:
the prefill bench's probes) and 16."""


def mqa_tiles() -> bool:
    """The sparse MQA kernel's 64-head tiles at d = 512 over both store formats: registers and
    spill stack. With 16 warps the [64, 512] fp32 accumulator is 64 registers a thread, but
    each warpgroup then takes a slice of the output columns and holds the whole query tile as
    its register operand (Triton's ``tl.dot`` keeps a loaded operand in registers)."""
    ok = True
    for fmt in ("bf16", "fp8_ds_mla"):
        fp8 = fmt == "fp8_ds_mla"
        st = "*u8" if fp8 else "*bf16"
        for bh, bn, warps, stages in MQA_TILES:
            consts = dict(D=512, DV=512, BH=bh, BN=bn, SPLIT=False, FP8=fp8, NOPE=448,
                          DR=576 if fp8 else 0, SR=8 if fp8 else 0, DOT_DT=tl.bfloat16,
                          DOT_PREC="tf32", ROPE_NOPE2=-1)
            ok &= _try(f"sparse_mqa {fmt} {bh} heads x {bn} rows, {warps} warps, {stages} "
                       "stage(s)", sm._sparse_mqa_kernel,
                       {**MQA_TYPES, "win_ptr": st, "cmp_ptr": st}, consts,
                       dict(num_warps=warps, num_stages=stages))
    return ok


def combine() -> bool:
    """The split-KV merge at the tiles ``sparse_mqa`` picks (splits padded to SP, BD columns)."""
    ok = True
    t = dict(ws_acc="*fp32", ws_ml="*fp32", sink_ptr="*fp32", o_ptr="*bf16", sot="i32",
             soh="i32", T="i32", H="i32", n_split="i32", pos_ptr="*i64", freq_ptr="*fp32")
    for d, sp in ((512, 2), (512, 64), (512, sm.MAX_SPLIT), (128, 4)):
        bd = max(16, min(d, sm.COMBINE_TILE // sp))
        for rope in (-1, (d - 64) // 2):  # with the output's inverse RoPE in the store
            ok &= _try(f"combine d={d} SP={sp} BD={bd} rope_nope2={rope}", sm._combine_kernel,
                       t, dict(D=d, SP=sp, BD=bd, ROPE_NOPE2=rope), dict(num_warps=4))
    return ok


FUSED_TYPES = dict(x_ptr="*bf16", stride_xm="i32", M="i32", K="i32", w_ptr="*bf16", n16="i32",
                   w8_ptr="*fp8e4nv", sc_ptr="*fp32", stride_sc="i32", n8="i32",
                   ws_ptr="*fp32", cnt_ptr="*i32", m_ws="i32", o0="*bf16", s0="i32",
                   o1="*fp32", s1="i32", o2="*fp32", s2="i32", o3="*bf16", s3="i32",
                   o4="*fp32", s4="i32", e0="i32", e1="i32", e2="i32", e3="i32", e4="i32",
                   m_tiles="i32", g16="i32", g8="i32")
"""The one-launch input kernel's runtime arguments (the DSV4 C4 slot order)."""


def fused() -> bool:
    """The one-launch input kernel at the configurations choose_config gives a Flash / Pro C4
    pack (fp8 fused_wqa_wkv, power-of-two scales) for decode M, with and without act_quant."""
    import torch

    ok, seen = True, set()
    for hidden, n_fp8 in ((4096, 1536), (7168, 2048)):
        segs = [("qr_kv", (torch.zeros(n_fp8, hidden, dtype=torch.float8_e4m3fn),
                           torch.ones(n_fp8 // 128, hidden // 128)), torch.bfloat16)]
        segs += [(n, torch.zeros(r, hidden, dtype=torch.bfloat16), dt) for n, r, dt in
                 (("kv_score", 2048, torch.float32), ("idx_kv_score", 512, torch.float32),
                  ("idx_weights", 64, torch.bfloat16))]
        pack = fip.pack_input_weights(segs)
        for M in (1, 16, 64):
            c = fip.choose_config(M, pack)
            if c.cublas:
                continue
            bn8 = c.block_n8 or 2 * c.block_n
            g8 = -(-pack.n_fp8 // bn8)
            fold = 128 % bn8 == 0 and pack.n_fp8 == g8 * bn8
            pf = min(c.prefetch, (hidden // c.split_k) * 2) // 32 * 32 if c.pdl else 0
            for act in (False, True):
                key = (c, fold, pf, act)
                if key in seen:
                    continue
                seen.add(key)
                consts = dict(BM=c.block_m, BN=c.block_n, BN8=bn8, BK=c.block_k,
                              SPLIT_K=c.split_k, SWAP=c.swap, HAS_FP8=True, FOLD=fold,
                              USE_PDL=c.pdl, PREFETCH=pf, FENCE=True, ACT=act, INTERP=False,
                              DOT_DT=tl.bfloat16, DOT_PREC="tf32")
                ok &= _try(f"fused_input_proj hidden={hidden} M={M} act={act} {c}",
                           fip.fused_input_proj_kernel, FUSED_TYPES, consts,
                           dict(num_warps=c.num_warps, num_stages=c.num_stages))
    return ok


def _try(name: str, fn, types: dict, consts: dict, opts: dict) -> bool:
    try:
        print(f"{name}: {compile_one(fn, types, consts, opts)}", flush=True)
        return True
    except Exception:
        traceback.print_exc()
        print(f"FAIL {name}", flush=True)
        return False


def steps() -> bool:
    ok = True
    # a padded decode step's metadata from its seed: buckets 1 / 16 / 100 (not a power of two) /
    # 128, C4 sections (8 sources) and C128 ones (128)
    for b, src in ((1, 128), (16, 8), (100, 128), (128, 128)):
        kb = dm.source_block(b, src)
        ok &= _try(f"decode_metadata B={b} sources={src} KB={kb}", dm._expand_kernel,
                   dict(buf="*i64", seed_at="i32", table_at="i32"),
                   dict(B=dm._pow2(b), REAL_B=b, KB=kb), dict(num_warps=4))
    t = dict(pos_ptr="*i64", slot_ptr="*i64", rows_ptr="*i64", rows_stride="i32",
             table_ptr="*i32", table_stride="i32", out_ptr="*i64", out_stride="i32", K="i32",
             B="i32", MAX_LOGICAL="i32")
    t = {**t, "table2_ptr": "*i32", "table2_stride": "i32", "out2_ptr": "*i64",
         "out2_stride": "i32", "K2": "i32", "B2": "i32", "MAX_LOGICAL2": "i32"}
    alone = dict(WIN2=False, BLOCK2=0)
    for window in (True, False):
        ok &= _try(f"paged_rows window={window}", pr._flat_rows_kernel, t,
                   dict(WINDOW=window, BLOCK=128 if window else 256, RATIO=0, **alone),
                   dict(num_warps=4))
    # the int32 rows the attention kernels read; every visible entry and its rows (RATIO);
    # the entry rows with the kv store's window rows (WIN2)
    t32 = {**t, "out_ptr": "*i32", "out2_ptr": "*i32"}
    ok &= _try("paged_rows window=True int32", pr._flat_rows_kernel, t32,
               dict(WINDOW=True, BLOCK=128, RATIO=0, **alone), dict(num_warps=4))
    for ratio in (0, 4, 128):
        ok &= _try(f"paged_rows entries ratio={ratio} + window int32", pr._flat_rows_kernel,
                   t32, dict(WINDOW=False, BLOCK=128 if ratio else 256, RATIO=ratio,
                             WIN2=True, BLOCK2=128), dict(num_warps=4))
    t = dict(ks_ptr="*fp32", s_ks="i32", pos_ptr="*i64", ape_ptr="*fp32", out_ptr="*fp32",
             s_out="i32")
    t = {**t, "ks2_ptr": "*fp32", "s_ks2": "i32", "ape2_ptr": "*fp32", "out2_ptr": "*fp32",
         "s_out2": "i32", "v_ptr": "*i16", "s_v": "i32", "slot_ptr": "*i64", "row_ptr": "*i64",
         "st_ptr": "*u8", "tab_ptr": "*i32", "st_tab": "i32", "n_seqs": "i32",
         "max_logical": "i32", "B": "i32", "BLK": "i32"}
    # the pointers a launch leaves out are None there: constexpr None here, as Triton
    # specialises them (a branch that reads one must not be compiled)
    no_store = dict(v_ptr=None, slot_ptr=None, row_ptr=None, st_ptr=None, tab_ptr=None)
    no_second = dict(ks2_ptr=None, ape2_ptr=None, out2_ptr=None)
    for r, width in ((4, 1024), (128, 512), (4, 256)):
        ok &= _try(f"raw_rows R={r} WIDTH={width}", ce._raw_rows_kernel, t,
                   dict(R=r, WIDTH=width, BLOCK=min(1024, 2 * width), WIDTH2=0, BLOCK2=0,
                        **no_store, **no_second), dict(num_warps=4))
    # a C4 layer's main (Flash 2 x 512) and indexer (2 x 128) compressor in one launch
    ok &= _try("raw_rows pair R=4 WIDTH=1024 WIDTH2=256", ce._raw_rows_kernel, t,
               dict(R=4, WIDTH=1024, BLOCK=1024, WIDTH2=256, BLOCK2=512, **no_store),
               dict(num_warps=4))
    # ... with the window rows' store (fp8_ds_mla, d = 512) in programs (t, 2) / (t, 1)
    kv = dict(FMT=2, D=512, DP=512, NOPE=448, NT=7, TP=8, ROPE=64, RP=64, SB=8, PADP=1,
              IN_BF16=True)
    ok &= _try("raw_rows pair + window store", ce._raw_rows_kernel, t,
               dict(R=4, WIDTH=1024, BLOCK=1024, WIDTH2=256, BLOCK2=512, STORE_COL=2, **kv),
               dict(num_warps=4))
    ok &= _try("raw_rows R=128 + window store", ce._raw_rows_kernel, t,
               dict(R=128, WIDTH=512, BLOCK=1024, WIDTH2=0, BLOCK2=0, STORE_COL=1, **kv,
                    **no_second),
               dict(num_warps=4))
    t = dict(ring_ptr="*fp32", rows_ptr="*fp32", s_rows="i32", dst_ptr="*i64", src_ptr="*i64",
             K1="i32", ring2_ptr="*fp32", rows2_ptr="*fp32", s_rows2="i32", dst2_ptr="*i64",
             src2_ptr="*i64", K2="i32")
    for width in (2048, 1024, 512):
        ok &= _try(f"keep_ring_rows WIDTH={width}", ce._keep_rows_kernel, t,
                   dict(WIDTH=width, BLOCK=min(1024, width), WIDTH2=0, BLOCK2=0),
                   dict(num_warps=4))
    # both rings of a Flash C4 layer (main 2048 wide, indexer 512) in one launch
    ok &= _try("keep_ring_rows pair WIDTH=2048 WIDTH2=512", ce._keep_rows_kernel, t,
               dict(WIDTH=2048, BLOCK=1024, WIDTH2=512, BLOCK2=512), dict(num_warps=4))
    # store_rows: Flash kv rows (512, rope 64) in bf16 / fp8_ds_mla, index keys (128) fp8 / fp4
    base = dict(v_ptr="*i16", sv="i32", slot_ptr="*i64", row_ptr="*i64", tab_ptr="*i32",
                st_tab="i32", n_seqs="i32", max_logical="i32", B="i32", BLK="i32")
    cases = [("bf16 512", "*i16", dict(FMT=0, D=512, DP=512, NOPE=512, NT=1, TP=1, ROPE=0, RP=1,
                                       SB=0, PADP=1)),
             ("fp8_ds_mla 512", "*u8", dict(FMT=2, D=512, DP=512, NOPE=448, NT=7, TP=8, ROPE=64,
                                            RP=64, SB=8, PADP=1)),
             ("index fp8 128", "*u8", dict(FMT=3, D=128, DP=128, NOPE=128, NT=1, TP=1, ROPE=0,
                                           RP=1, SB=0, PADP=1)),
             ("index fp4 128", "*u8", dict(FMT=4, D=128, DP=128, NOPE=128, NT=4, TP=4, ROPE=0,
                                           RP=1, SB=0, PADP=1))]
    for name, st, c in cases:
        ok &= _try(f"store_rows {name}", sr._store_rows_kernel, {**base, "st_ptr": st},
                   {**c, "IN_BF16": True}, dict(num_warps=4 if c["D"] > 256 else 2))
    # the indexer at decode (score + top-k) and prefill, 64 heads x 128, bf16 / fp8 / fp4 keys
    t = dict(q_ptr="*bf16", sqt="i32", sqh="i32", w_ptr="*bf16", swt="i32", s_ptr="*fp32",
             sst="i32", blk_stride="i32", tab_ptr="*i32", stab="i32", max_logical="i32",
             slot_ptr="*i64", pos_ptr="*i64", width="i32", tiles="i32", B="i32",
             weight_scale="fp32", z_ptr="*i32", T="i32")
    for fmt, kt in (("bf16", "*bf16"), ("fp8", "*u8"), ("fp4", "*u8")):
        for zero in (False, True):
            ok &= _try(f"indexer score {fmt} zero={zero}", it._score_kernel,
                       {**t, "keys_ptr": kt},
                       dict(H=64, HP=64, D=128, BN=it.SCORE_BLOCK, FMT=it.FMTS.index(fmt),
                            DT=tl.bfloat16, PREC="tf32", ZERO=zero, PIPE=0),
                       dict(num_warps=4))
        # score_probe.py's variants (128-entry tiles at 4 warps: 255 registers and 112-1904
        # bytes of stack, not probed)
        for bn, pipe in ((64, 2), (64, 3), (32, 0)):
            ok &= _try(f"indexer score {fmt} block={bn} stages={pipe}", it._score_kernel,
                       {**t, "keys_ptr": kt},
                       dict(H=64, HP=64, D=128, BN=bn, FMT=it.FMTS.index(fmt),
                            DT=tl.bfloat16, PREC="tf32", ZERO=True, PIPE=pipe),
                       dict(num_warps=4))
        # score_probe.py's 8-warp variant (one query a program; 128-entry tiles spill there)
        for bn in (64,):
            ok &= _try(f"indexer score {fmt} block={bn} warps=8", it._score_kernel,
                       {**t, "keys_ptr": kt},
                       dict(H=64, HP=64, D=128, BN=bn, FMT=it.FMTS.index(fmt),
                            DT=tl.bfloat16, PREC="tf32", ZERO=True, PIPE=0),
                       dict(num_warps=8))
        # scoring groups (a verify step's queries of one sequence a program), their warps
        for qg, warps, pipe in ((4, 8, 0), (4, 8, 2)):
            ok &= _try(f"indexer score {fmt} group={qg} warps={warps} stages={pipe}",
                       it._score_kernel, {**t, "keys_ptr": kt},
                       dict(H=64, HP=64, D=128, BN=it.SCORE_BLOCK, FMT=it.FMTS.index(fmt),
                            DT=tl.bfloat16, PREC="tf32", ZERO=True, PIPE=pipe, QG=qg),
                       dict(num_warps=warps))
    # the page-copying score loop (indexer_scores(tma=True)): fp8 pages of 64 rows, one query a
    # program (4 warps) and groups of 4 (8 warps), at PAGE_STAGES; one query a program with the
    # fp8 MMA (F8) too
    tp = {**t, "keys_ptr": "*u8", "vals": "tensordesc<u8[1, 64, 128]>",
          "scales": "tensordesc<fp32[1, 64]>"}
    for qg, warps in ((1, 4), (4, 8)):
        for f8 in (False, True) if qg == 1 else (False,):
            # the fp8 MMA's pages typed as e4m3 (_page_descriptors(fp8_values=True))
            tf8 = {**tp, "vals": "tensordesc<fp8e4nv[1, 64, 128]>"} if f8 else tp
            ok &= _try(f"indexer page score group={qg} warps={warps} f8={f8}",
                       it._page_score_kernel, tf8,
                       dict(H=64, HP=64, D=128, BN=64, DT=tl.bfloat16, PREC="tf32",
                            ZERO=True, QG=qg, STAGES=it.PAGE_STAGES, F8=f8),
                       dict(num_warps=warps))
    t = dict(s_ptr="*fp32", sst="i32", pos_ptr="*i64", o_ptr="*i64", sot="i32", width="i32")
    for k in (512, 1024):
        for sort in (True, False):
            for block in (it.SCAN_BLOCK, it.WIDE_SCAN_BLOCK):
                ok &= _try(f"indexer top-k K={k} sort={sort} block={block}", it._topk_kernel, t,
                           dict(K=k, KP=k, BLOCK=block, SORT=sort, DB=it.DIGIT_BITS),
                           dict(num_warps=it.SCAN_WARPS))
            for p in (2, 4, 8, it.MAX_SPLIT):  # the split kernel: chunk scan, merge scan
                for block in (it.SCAN_BLOCK, it.WIDE_SCAN_BLOCK):
                    mblock = it.choose_merge_block(p * k)  # spills at 4096 / 4096: faster
                    ok &= _try(f"indexer top-k split={p} K={k} sort={sort} block={block} "
                               f"merge={mblock}", it._topk_split_kernel,
                               {**t, "c_ptr": "*i32", "sct": "i32", "arr_ptr": "*i32",
                                "chunk": "i32"},
                               dict(K=k, KP=k, P=p, BLOCK=block, MBLOCK=mblock, SORT=sort,
                                    DB=it.DIGIT_BITS),
                               dict(num_warps=it.SCAN_WARPS))
    for db in (4, 2):  # topk_probe.py's narrower radix digits (digit_bits)
        ok &= _try(f"indexer top-k K=512 digits={db}", it._topk_kernel, t,
                   dict(K=512, KP=512, BLOCK=it.WIDE_SCAN_BLOCK, SORT=True, DB=db),
                   dict(num_warps=it.SCAN_WARPS))
        ok &= _try(f"indexer top-k split=8 K=512 digits={db}", it._topk_split_kernel,
                   {**t, "c_ptr": "*i32", "sct": "i32", "arr_ptr": "*i32", "chunk": "i32"},
                   dict(K=512, KP=512, P=8, BLOCK=it.SCAN_BLOCK,
                        MBLOCK=it.choose_merge_block(8 * 512), SORT=True, DB=db),
                   dict(num_warps=it.SCAN_WARPS))
    # a row or chunk that fits its block, held in registers (HELD): one program on 4K entries;
    # split rows' chunks of 2048 / 4096 / 8192 (topk_probe.py's held variants)
    for k in (512, 1024):
        ok &= _try(f"indexer top-k held K={k} block=4096", it._topk_kernel, t,
                   dict(K=k, KP=k, BLOCK=it.WIDE_SCAN_BLOCK, SORT=True, DB=it.DIGIT_BITS,
                        HELD=True), dict(num_warps=it.SCAN_WARPS))
    for p, block, warps in ((8, 2048, 8), (4, 4096, 8), (8, 8192, 16)):
        for db in (4, 8):
            ok &= _try(f"indexer top-k split={p} K=512 held block={block} digits={db}",
                       it._topk_split_kernel,
                       {**t, "c_ptr": "*i32", "sct": "i32", "arr_ptr": "*i32", "chunk": "i32"},
                       dict(K=512, KP=512, P=p, BLOCK=block,
                            MBLOCK=it.choose_merge_block(p * 512), SORT=True, DB=db,
                            HELD=True), dict(num_warps=warps))
    t = dict(q_ptr="*bf16", sqt="i32", sqh="i32", w_ptr="*bf16", swt="i32", swh="i32",
             s_ptr="*fp32", sst="i32", blk_stride="i32", tab_ptr="*i32", stab="i32",
             max_logical="i32", tiles_ptr="*i32", pos_ptr="*i64", width="i32", row0="i32",
             B="i32", weight_scale="fp32")
    for fmt, kt in (("bf16", "*bf16"), ("fp8", "*u8"), ("fp4", "*u8")):
        ok &= _try(f"indexer prefill score {fmt}", ip._prefill_score_kernel,
                   {**t, "keys_ptr": kt},
                   dict(H=64, D=128, BQ=ip.BLOCK_Q, BN=ip.BLOCK_N, FMT=it.FMTS.index(fmt),
                        DT=tl.bfloat16, PREC="tf32"),
                   dict(num_warps=ip.NUM_WARPS, num_stages=ip.NUM_STAGES))
    ok &= combine()
    return ok


def stages() -> bool:
    """The quantising stages that share ``dsv4.kernels._float_bits`` (their 32-40 bytes of stack
    are libdevice's cos / sin / exp frames, there before the helpers were shared)."""
    ok = True
    # the quantising stages that share dsv4.kernels._float_bits: kv rows (fp8 block-64 of the
    # 448 nope dims), query heads (RMS, no quant), the indexer's Hadamard + FP4, and the
    # compressors' entries in every numerics mode
    t = dict(x_ptr="*bf16", sxt="i32", sxh="i32", o_ptr="*bf16", sot="i32", soh="i32",
             pos_ptr="*i64", freq_ptr="*fp32", H="i32", eps="fp32")
    t = {**t, "x2_ptr": "*bf16", "sx2t": "i32", "o2_ptr": "*bf16", "so2t": "i32"}
    alone = dict(ROW=False, QPAIRS2=0, QBLOCK2=0)
    for name, c in (("kv rows fp8", dict(BH=1, NORM=False, QPAIRS=224, QBLOCK=32, **alone)),
                    ("query heads", dict(BH=8, NORM=True, QPAIRS=0, QBLOCK=0, **alone)),
                    # the query heads with the kv rows in one launch (their fp8 simulation)
                    ("query heads + kv rows fp8", dict(BH=8, NORM=True, QPAIRS=0, QBLOCK=0,
                                                       ROW=True, QPAIRS2=224, QBLOCK2=32))):
        ok &= _try(f"rope_heads {name}", rn._rope_heads_kernel, t,
                   dict(D2=256, NOPE2=224, BD2=256, SIGN=1, **c), dict(num_warps=4))
    ok &= _try("rope_hadamard_fp4", rn._rope_hadamard_fp4_kernel,
               {k: v for k, v in t.items() if k != "eps"},
               dict(D2=64, NOPE2=32, BH=16, HSCALE=128 ** -0.5, DOT_DT=tl.bfloat16,
                    DOT_PREC="tf32"), dict(num_warps=4))
    # the latent norms (q_norm + kv_norm), Flash / Pro ranks
    t = dict(x_ptr="*bf16", sxt="i32", wq_ptr="*bf16", wkv_ptr="*bf16", q_ptr="*bf16",
             sqt="i32", kv_ptr="*bf16", skt="i32", eps_q="fp32", eps_kv="fp32")
    for qr_rank in (1024, 1536):
        bq = triton.next_power_of_2(qr_rank)
        ok &= _try(f"latent_norms qr={qr_rank}", rn._latent_norms_kernel, t,
                   dict(QR=qr_rank, KV=512, BQ=bq, BKV=512),
                   dict(num_warps=8 if bq >= 2048 else 4))
    t = dict(ring_ptr="*fp32", rows_ptr="*fp32", rsrc_ptr="*i64", csrc_ptr="*i64", s_src="i32",
             ent_ptr="*i64", w_ptr="*bf16", freq_ptr="*fp32", out_ptr="*bf16", s_out="i32",
             eps="fp32", v_ptr="*i16", slot_ptr="*i64", st_ptr="*u8", tab_ptr="*i32",
             st_tab="i32", n_seqs="i32", max_logical="i32", B="i32", BLK="i32",
             skip_slot="i64")
    for name, r, coff, d, sim, store in (
            ("C4 main fp8", 4, 2, 512, ce.SIM_KV_FP8, "fp8_ds_mla"),
            ("C128 main fp8", 128, 1, 512, ce.SIM_KV_FP8, "fp8_ds_mla"),
            ("indexer fp8", 4, 2, 128, ce.SIM_INDEX_FP8, "fp8"),
            ("indexer fp4", 4, 2, 128, ce.SIM_INDEX_FP4, "fp4")):
        for stores in (False, True):  # the entries alone, and stored in the same launch
            ok &= _try(f"compress_entries {name} store={store if stores else None}",
                       ce._compress_entries_kernel, t,
                       dict(R=r, COFF=coff, D=d, ROPE=64, BC=min(coff * r, 16), SIM=sim,
                            LOG2D=d.bit_length() - 1, HSCALE=d ** -0.5, LIBDEVICE=True,
                            **(entry_store_constants(store, d) if stores else {}),
                            SKIP=stores),
                       dict(num_warps=4 if d <= 128 else 8))
    # a C4 layer's two compressors in one launch (compress_entries_pair), stored, at the main
    # part's 8 warps: Flash's main fp8 into fp8_ds_mla beside the indexer's fp4
    second = {(k[:-4] + "2_ptr" if k.endswith("_ptr") else k + "2"): v for k, v in t.items()}
    pair_t = {**t, "E": "i32", **second, "E2": "i32"}
    parts = []
    for r, coff, d, sim, store in ((4, 2, 512, ce.SIM_KV_FP8, "fp8_ds_mla"),
                                   (4, 2, 128, ce.SIM_INDEX_FP4, "fp4")):
        parts.append(dict(R=r, COFF=coff, D=d, ROPE=64, BC=min(coff * r, 16), SIM=sim,
                          LOG2D=d.bit_length() - 1, HSCALE=d ** -0.5,
                          **entry_store_constants(store, d), SKIP=True))
    ok &= _try("compress_entries_pair C4 main fp8 + indexer fp4, stored",
               ce._compress_entries_pair_kernel, pair_t,
               dict(**parts[0], **{f"{k}2": v for k, v in parts[1].items()}, LIBDEVICE=True),
               dict(num_warps=8))
    return ok


def entry_store_constants(fmt_name: str, d: int) -> dict:
    """The compress kernel's constants for entries of ``d`` bf16 values stored in format
    ``fmt_name`` (``fp8_ds_mla``: 64 rope dims), as ``compress_entries`` passes them."""
    import torch

    from dsv4.cache.formats import index_format, kv_format
    from dsv4.cache.store import PagedStore
    from dsv4.kernels import store_rows as sr

    fmt = (kv_format(fmt_name, d, 64, torch.bfloat16) if fmt_name == "fp8_ds_mla"
           else index_format(fmt_name, d, torch.bfloat16))
    store = PagedStore("entries", fmt, 64, 1, 1, 1, torch.device("cpu"))
    # the store's constants without the device check (no GPU here)
    return ce.store_constants(sr._row_target(store, torch.bfloat16)[1], torch.bfloat16)


def pdl() -> bool:
    """Every step kernel compiled with PDL on: each PTX waits (``griddepcontrol.wait``) and
    lets the next kernel launch (``launch_dependents``); compile_one checks both, and that the
    PDL-off builds of the other modes have neither."""
    global AOT_PDL
    AOT_PDL = True
    try:
        ok = True
        for fn in (gemm, dequant, mqa):
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    fn()
            except Exception:
                traceback.print_exc()
                ok = False
            sys.stdout.write(out.getvalue())
            ok &= "FAIL" not in out.getvalue()
        return ok and steps() and stages() and fused()
    finally:
        AOT_PDL = False


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which == "pdl" and not pdl():
        raise SystemExit(1)
    if which in ("gemm", "all"):
        gemm()
        dequant()
    if which in ("mqa", "all"):
        mqa()
    if which == "mqa-tiles" and not mqa_tiles():
        raise SystemExit(1)
    if which in ("steps", "all") and not steps():
        raise SystemExit(1)
    if which in ("fused", "all") and not fused():
        raise SystemExit(1)
    if which in ("stages", "all") and not stages():
        raise SystemExit(1)
