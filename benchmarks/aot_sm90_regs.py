"""Compile the fp8 GEMM and sparse-MQA Triton kernels for sm_90 on a machine WITHOUT a GPU and print
each configuration's registers / spill stack (ptxas via Triton's bundled cuobjdump) and MMA kind.

    PYTHONPATH=src python benchmarks/aot_sm90_regs.py [gemm|mqa|all]

Catches compile errors and register spills before a GPU run. Integer arguments that are multiples
of 16 at run time (strides, K, block strides, H, rows per block) get Triton's divisibility hint,
as the JIT's specialisation would give them; pointers are 16-byte aligned. Uses Triton internals
(ASTSource, triton.compile with a GPUTarget): written against Triton 3.6.
"""

from __future__ import annotations

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

from dsv4.kernels import fp8_linear as fl
from dsv4.kernels import sparse_mqa as sm

TARGET = GPUTarget("cuda", 90, 32)
DIV16 = {"sxm", "sxg", "sym", "syg", "R", "Kg", "sqt", "sqh", "sot", "soh", "swi", "w_blk", "sci",
         "c_blk", "H", "B"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def compile_one(fn, types: dict, consts: dict, opts: dict) -> str:
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
    return f"{use} {mma} smem={k.metadata.shared} ({time.time() - t0:.1f}s)"


def gemm() -> None:
    types = dict(x_ptr="*bf16", sxm="i32", sxg="i32", w_ptr="*fp8e4nv", sc_ptr="*u8",
                 stride_sc="i32", y_ptr="*bf16", sym="i32", syg="i32", ws_ptr="*fp32",
                 cnt_ptr="*i32", M="i32", R="i32", Kg="i32", m_ws="i32", n_tiles="i32",
                 m_tiles="i32", G="i32")
    seen = set()
    for M in (1, 16, 32, 64, 100):
        for n, k in ((32768, 1024), (4096, 8192), (7168, 16384), (8192, 4096)):
            c = fl.choose_fp8_config(M, n, k)
            key = (c.block_m, c.block_n, c.split_k > 1, c.swap, c.num_warps, c.num_stages)
            if key in seen:
                continue
            seen.add(key)
            consts = dict(BM=c.block_m, BN=c.block_n, SPLIT_K=c.split_k, SWAP=c.swap,
                          SCALE_F32=False, FENCE=True, DOT_DT=tl.bfloat16, DOT_PREC="tf32")
            try:
                r = compile_one(fl._fp8_gemm_kernel, types, consts,
                                dict(num_warps=c.num_warps, num_stages=c.num_stages))
                print(f"fp8_gemm M={M} {c}: {r}", flush=True)
            except Exception:
                traceback.print_exc()
                print(f"FAIL fp8_gemm {c}", flush=True)


def mqa() -> None:
    base = dict(q_ptr="*bf16", sqt="i32", sqh="i32", o_ptr="*bf16", sot="i32", soh="i32",
                sink_ptr="*fp32", ws_acc="*fp32", ws_ml="*fp32", widx_ptr="*i32", swi="i32",
                w_blk="i32", cidx_ptr="*i32", sci="i32", c_blk="i32", T="i32", H="i32",
                W="i32", KC="i32", B="i32", chunk="i32", n_split="i32", qk_scale="fp32")
    for fmt in ("fp8_ds_mla", "bf16"):
        st = "*u8" if fmt == "fp8_ds_mla" else "*bf16"
        types = {**base, "win_ptr": st, "cmp_ptr": st}
        for H, d in ((64, 512), (128, 512), (4, 128)):
            c = sm.choose_sparse_config(64, H, d, 640, fmt=fmt)
            n = d - 64
            fp8 = fmt == "fp8_ds_mla"
            for split in (False, True):
                consts = dict(D=d, BH=c.block_h, BN=c.block_n, SPLIT=split, FP8=fp8, NOPE=n,
                              DR=(n + 128) if fp8 else 0, SR=8 if fp8 else 0,
                              DOT_DT=tl.bfloat16, DOT_PREC="tf32")
                try:
                    r = compile_one(sm._sparse_mqa_kernel, types, consts,
                                    dict(num_warps=c.num_warps, num_stages=c.num_stages))
                    print(f"sparse_mqa {fmt} H={H} d={d} split={split} {c}: {r}", flush=True)
                except Exception:
                    traceback.print_exc()
                    print(f"FAIL sparse_mqa {fmt} {c}", flush=True)
    ctypes = dict(ws_acc="*fp32", ws_ml="*fp32", sink_ptr="*fp32", o_ptr="*bf16", sot="i32",
                  soh="i32", T="i32", H="i32", n_split="i32")
    for d, bh in ((512, 16), (128, 32)):
        r = compile_one(sm._combine_kernel, ctypes, dict(D=d, BH=bh), dict(num_warps=4))
        print(f"combine d={d} BH={bh}: {r}", flush=True)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("gemm", "all"):
        gemm()
    if which in ("mqa", "all"):
        mqa()
