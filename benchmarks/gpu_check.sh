#!/usr/bin/env bash
# The GPU checks of this repository, one case per call (each fits a 10-minute call on a cold
# machine). Run from the repository root on a CUDA machine:
#
#   bash benchmarks/gpu_check.sh suite    # the whole pytest suite, $WORKERS (8) workers, then
#                                         # dsv4 verify --platform cuda and the tiny LM's GPU
#                                         # eval; LEFT=FILE: only the test ids in FILE
#                                         # (benchmarks/pytest_remaining.py), no verify
#   bash benchmarks/gpu_check.sh decode   # the decode step's default rows: Flash / Pro C4,
#                                         # M = 1 / 16 / 64, contexts 512 (profiled) and 64K;
#                                         # DRAFTS=0,1,3,7: verify steps of 1 + k tokens instead;
#                                         # STAGGER=1: sequence i at context + i (--stagger)
#   bash benchmarks/gpu_check.sh timeline # where a verify step's time goes: Flash / Pro C4,
#                                         # 16 sequences of 1 and 1 + 3 tokens (staggered), 512
#                                         # and 64K, profiled: kernel tables and each replay's
#                                         # timeline (streams, idle gaps, overlap)
#   bash benchmarks/gpu_check.sh prefill  # one C4 layer prefilling 16K / 64K tokens
#   bash benchmarks/gpu_check.sh kernels  # attention kernels, fp8 GEMMs, input projections alone
#   bash benchmarks/gpu_check.sh topk     # the indexer's top-k alone (benchmarks/topk_probe.py):
#                                         # the defaults and TOPK_VARIANTS; with BASELINE, that
#                                         # tree's kernel as `baseline`
#   bash benchmarks/gpu_check.sh score    # the indexer's score launch alone (benchmarks/
#                                         # score_probe.py): gathered against page-copied
#                                         # (tma) loads, one query and groups of 4 a program,
#                                         # the page copies' fp8 MMA (tma f8);
#                                         # SCORE_VARIANTS overrides
#   bash benchmarks/gpu_check.sh routes   # where the fp8 GEMMs stop streaming: the GEMM probe's
#                                         # kernels against the long calls' route at 128-1024
#                                         # tokens, then verify steps of 64 sequences x (1 + k)
#                                         # with --plan fp8_gemm_max_tokens=128 (the limit
#                                         # before 2026-12-07) and ROUTE_LIMITS (default 256
#                                         # 512 1024; the table has 512)
#   bash benchmarks/gpu_check.sh tiles    # the fp8 GEMMs' tile sweep (benchmarks/gemm_tiles.py)
#                                         # at TILE_MS tokens (default "16 64"; the table's
#                                         # other evidence: TILE_MS="4 32 128"); TILE_PAIR=1:
#                                         # the q heads' and the indexer's wq_b on two side
#                                         # streams at once, over the indexer's tiles
#   bash benchmarks/gpu_check.sh models   # attention stacks (model-decode: the first 8 layers
#                                         # of Flash's, then Pro's, schedule: eager, one plan
#                                         # per step, the decode runner);
#                                         # transformers-decode (the transformers wheels in .whl/)
#
# FlashMLA: put the `sgl-flash-mla` wheel in .whl/ (ignored by git); it is installed into
# /tmp/fm with --no-deps. Without it the FlashMLA rows skip and `auto` runs our kernel.
# Results go to $OUT/<kind>/ (default OUT=/tmp/out), each step's log beside them, the card in
# $OUT/gpu.txt. Every step has its own time limit, so a slow one cannot take the rest of the
# call with it, and a failing step does not stop the next. PACK=FILE.tgz rewrites one archive of
# $OUT after every step (a call cut short still returns what ran):
#   R=$OUT; OUT=/tmp/o PACK=$R/all.tgz bash benchmarks/gpu_check.sh decode
# The whole suite: 16 workers on an H100 ran it in 288 s (2026-12-08, 0635fb4; each worker's
# PyTorch takes its share of the cores, tests/conftest.py; the tensor-parallel tests share one
# worker, --dist loadgroup, and so do the command-line usage cases since 2026-12-08, both
# collected first: conftest.FIRST_GROUPS). Finish a cut run with LEFT=FILE in the next call.
# Each test's duration and each failure's traceback are written to gpu-tests/durations.txt and
# failures.txt as they happen (DSV4_REPORT_DIR, tests/conftest.py): a cut run keeps them;
# pytest prints both only at the end.
# Options: WORKERS and SUITE_SECS (suite: pytest workers, its time limit, default 380), LAYERS
# (decode, default C4; e.g. C4,C128,SWA), TOKENS (prefill, default 16384,65536), CACHES
# (prefill; unset: the bench's default, bf16; bf16,fp8 adds the serving caches, where FlashMLA
# runs its decode kernel on the fp8 store in place; a BASELINE tree from before 2026-12-08 has
# no --caches), DSV4_PDL=0 (every case without programmatic dependent launch).
# BASELINE=DIR (decode, prefill): first the same rows of the tree whose source is DIR/src (e.g.
# `git archive OLD src | tar -x -C DIR`, carried as an ignored folder), into
# $OUT/<kind>-baseline/, then this tree's - a before/after on one card in one call (topk: that
# tree's kernel is timed as the probe's `baseline` variant, beside this tree's, in one table);
# BASELINE_STRATEGY is that tree's decode-step strategy (default `default`; trees before
# 2026-12-05 name it ours_auto_act8_pdl). Where these results live in the tree and what they
# mean: benchmarks/results/README.md, docs/performance.md.
set -u
case "${1:-}" in
suite | decode | timeline | prefill | kernels | topk | score | routes | tiles | models) ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh suite|decode|timeline|prefill|kernels|topk|score|routes|tiles|models" >&2
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the wheels this case needs, from .whl/: FlashMLA's kernels and pytest-xdist (with execnet)
# always; transformers and its hub client for `models` only (the suite skips what needs them)
WHEELS=(.whl/sgl_flash_mla-*.whl .whl/pytest_xdist-*.whl .whl/execnet-*.whl)
if [ "$1" = models ]; then
    WHEELS+=(.whl/transformers-*.whl .whl/huggingface_hub-*.whl .whl/httpx2-*.whl
             .whl/httpcore2-*.whl .whl/truststore-*.whl)
fi
for w in "${WHEELS[@]}"; do
    [ -f "$w" ] || echo "$w: not in .whl/ (what needs it skips)"
done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm \
    $(ls "${WHEELS[@]}" 2>/dev/null) >/dev/null 2>&1 || echo "wheels from .whl/ not installed"
export PYTHONPATH=src:/tmp/fm PYTHONUNBUFFERED=1 DSV4_REPORT_DIR=$OUT/gpu-tests
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD >"$OUT/commit.txt" 2>/dev/null || true

step() {  # step LOG SECONDS COMMAND...: run under a time limit, log to $OUT/LOG
    local log=$1 secs=$2
    shift 2
    mkdir -p "$(dirname "$OUT/$log")"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    echo "$log: rc=$rc in $((SECONDS - t0)) s; $(tail -n 1 "$OUT/$log")"
    if [ -n "${PACK:-}" ]; then
        tar czf "$PACK" -C "$OUT" .
    fi
}
PYTEST=(python3 -m pytest -q -p no:cacheprovider)
# the suite's CPU-side tests that need the CPU machine's packages (README runner, transformers)
SKIP=(--deselect tests/test_readme.py --ignore=tests/integrations
      --deselect tests/test_transformers_dialect.py)
DECODE=(python3 -m dsv4 bench decode-step --models flash,pro --layers "${LAYERS:-C4}"
        --ms 1,16,64)
MODEL=(python3 -m dsv4 bench model-decode --layers 8 --ms 1,16,64 --contexts 512,16384,65536)
PREFILL=(python3 -m dsv4 bench prefill --only layer --models flash,pro --layers C4
         --tokens "${TOKENS:-16384,65536}" --attention-backend flashmla --reps 2 --max-case-seconds 30
         ${CACHES:+--caches "$CACHES"})
BASE_PATH=${BASELINE:+$BASELINE/src:/tmp/fm}

case "${1:-}" in
suite)  # -vv: one line per test as it ends, so a cut run names what passed and failed;
    # `python3 benchmarks/pytest_remaining.py $OUT/gpu-tests/pytest_all.txt` lists the rest
    XDIST=()
    python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${WORKERS:-8}" --dist loadgroup)
    if [ -n "${LEFT:-}" ]; then
        mapfile -t IDS < <(grep -v '^#' "$LEFT")
        step gpu-tests/pytest_left.txt 570 "${PYTEST[@]}" "${XDIST[@]}" -vv -rf "${IDS[@]}"
    else
        # the suite first: its workers fill Triton's on-disk cache, so verify and eval after it
        # compile little (run first on a cold machine, verify took more than its 150 s)
        step gpu-tests/pytest_all.txt "${SUITE_SECS:-380}" "${PYTEST[@]}" "${XDIST[@]}" -vv -rf "${SKIP[@]}"
        step verify/verify_cuda.txt 150 python3 -m dsv4 verify --platform cuda
        step verify/eval_cuda.txt 60 python3 -m dsv4 eval --device cuda --platform cuda \
            --cache-format fp8_ds_mla/fp8 --json "$OUT/verify/eval_cuda.json"
    fi
    ;;
decode)  # with BASELINE both trees share the call: shorter limits, no profile
    S512=300 S64=240 PROFILE=(--profile) KIND=decode-step EXTRA=()
    if [ -n "${DRAFTS:-}" ]; then
        S512=280 S64=280 PROFILE=() KIND=decode-step-verify EXTRA=(--draft-tokens "$DRAFTS")
    fi
    if [ -n "${STAGGER:-}" ]; then
        EXTRA+=(--stagger)
    fi
    ROWS=(--strategies default "${EXTRA[@]}")
    if [ -n "$BASE_PATH" ]; then
        S512=140 S64=120 PROFILE=()
        PYTHONPATH=$BASE_PATH step $KIND-baseline/512/log.txt $S512 "${DECODE[@]}" \
            --strategies "${BASELINE_STRATEGY:-default}" "${EXTRA[@]}" \
            --out "$OUT/$KIND-baseline/512" --contexts 512 --reps 5
        PYTHONPATH=$BASE_PATH step $KIND-baseline/64k/log.txt $S64 "${DECODE[@]}" \
            --strategies "${BASELINE_STRATEGY:-default}" "${EXTRA[@]}" \
            --out "$OUT/$KIND-baseline/64k" --contexts 65536 --reps 3
    fi
    step $KIND/512/log.txt $S512 "${DECODE[@]}" "${ROWS[@]}" \
        --out "$OUT/$KIND/512" --contexts 512 --reps 5 "${PROFILE[@]}"
    step $KIND/64k/log.txt $S64 "${DECODE[@]}" "${ROWS[@]}" \
        --out "$OUT/$KIND/64k" --contexts 65536 --reps 3
    ;;
timeline)
    step decode-step-verify/timeline/log.txt 240 python3 -m dsv4 bench decode-step \
        --models flash,pro --layers C4 --ms 16 --contexts 512,65536 --strategies default \
        --reps 2 --draft-tokens 0,3 --stagger --profile --out "$OUT/decode-step-verify/timeline"
    ;;
prefill)
    SECS=540
    if [ -n "$BASE_PATH" ]; then
        SECS=270
        PYTHONPATH=$BASE_PATH step prefill-baseline/log.txt $SECS "${PREFILL[@]}" \
            --out "$OUT/prefill-baseline"
    fi
    step prefill/log.txt $SECS "${PREFILL[@]}" --out "$OUT/prefill"
    ;;
kernels)
    step attention-kernels/log.txt 240 python3 -m dsv4.bench.attention_kernels \
        --out "$OUT/attention-kernels" --only attention --quick
    step gemm-probes/log.txt 150 python3 -m dsv4.bench.attention_kernels \
        --out "$OUT/gemm-probes" --only gemm --quick
    step input-projections/log.txt 180 python3 -m dsv4 bench input-proj \
        --out "$OUT/input-projections" --quick
    ;;
topk)  # a few variants: every one of the probe's would not finish in one call
    BASE_TOPK=()
    if [ -n "${BASELINE:-}" ]; then
        BASE_TOPK=(--baseline "$BASELINE/src/dsv4/kernels/indexer_topk.py")
    fi
    step topk-probe/log.txt 300 python3 benchmarks/topk_probe.py --out "$OUT/topk-probe" \
        --variants "${TOPK_VARIANTS:-auto,auto b4,8p 8192x16 b4}${BASELINE:+,baseline}" \
        "${BASE_TOPK[@]}"
    ;;
score)
    step score-probe/log.txt 200 python3 benchmarks/score_probe.py --out "$OUT/score-probe" \
        --widths 16384,65536 --seqs 16,64 --tokens-per-seq 1,4 \
        --variants "${SCORE_VARIANTS:-default,group 4,tma,tma f8,tma group 4,tma f8 group 4}"
    ;;
routes)
    step gemm-routes/log.txt 200 python3 -m dsv4.bench.attention_kernels \
        --out "$OUT/gemm-routes" --only gemm --no-variants --gemm-ms 128,256,512,1024
    for lim in 128 ${ROUTE_LIMITS:-256 512 1024}; do
        step decode-step-routes/$lim/log.txt 150 python3 -m dsv4 bench decode-step \
            --models flash,pro --layers C4 --ms 64 --contexts 512 --strategies default \
            --reps 3 --draft-tokens 0,1,3,7 --stagger --plan "fp8_gemm_max_tokens=$lim" \
            --out "$OUT/decode-step-routes/$lim"
    done
    ;;
tiles)  # the fp8 GEMMs' tile sweep: Triton's compiles in 14 processes first, then the timing
    MS=(${TILE_MS:-16 64})
    mkdir -p "$OUT/gemm-tiles"
    for i in $(seq 0 13); do
        timeout 200 python3 benchmarks/gemm_tiles.py compile 14 "$i" "${MS[@]}" \
            >"$OUT/gemm-tiles/compile$i.log" 2>&1 &
    done
    wait
    if [ -n "${TILE_PAIR:-}" ]; then  # the heads' and the indexer's wq_b at once (stage 2)
        step gemm-tiles/pair-log.txt 300 python3 benchmarks/gemm_tiles.py pair \
            "$OUT/gemm-tiles/pair.json" "${MS[@]}"
    else
        step gemm-tiles/log.txt 300 python3 benchmarks/gemm_tiles.py time \
            "$OUT/gemm-tiles/sweep.json" "${MS[@]}"
    fi
    ;;
models)
    step model-decode/flash/log.txt 220 "${MODEL[@]}" --models flash --out "$OUT/model-decode/flash"
    step model-decode/pro/log.txt 200 "${MODEL[@]}" --models pro --out "$OUT/model-decode/pro"
    # capped at 24 GiB (a smaller card): transformers' cache of the 4-layer cut (~5 KB a token)
    # outgrows it at 16 x 128K, which a few minutes prefill; dsv4's (~0.2 KB a token) does not
    step transformers-decode/log.txt 400 python3 -m dsv4 bench transformers-decode \
        --out "$OUT/transformers-decode" --batches 1,16 --contexts 4096,32768,131072 \
        --memory-limit-gib 24
    ;;
esac
