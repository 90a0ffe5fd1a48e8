#!/usr/bin/env bash
# A/B of the decode step: this tree (new) against .baseline/src (base), alternating new/base/new
# on one card. Env: MODELS (flash,pro), MS (1,16), CTX (512,65536), DRAFTS (0,3), REPS (5), ROUNDS
# (new base new), DEST ($OUT/ab)
set -u
DEST=${DEST:-$OUT/ab}; mkdir -p "$DEST"
python3 -c "import flash_mla" 2>/dev/null || pip install -q --no-deps --target /tmp/fm .whl/sgl_flash_mla-*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$DEST/gpu.txt"
i=0
for r in ${ROUNDS:-new base new}; do
  i=$((i+1))
  if [ "$r" = base ]; then P=.baseline/src:/tmp/fm; else P=src:/tmp/fm; fi
  t0=$SECONDS
  PYTHONPATH=$P timeout ${SECS:-200} python3 -m dsv4 bench decode-step --models ${MODELS:-flash,pro} --layers C4 \
    --ms ${MS:-1,16} --contexts ${CTX:-512,65536} --strategies default --draft-tokens ${DRAFTS:-0,3} \
    --stagger --reps ${REPS:-5} --out "$DEST/$i-$r" > "$DEST/$i-$r.log" 2>&1
  echo "== $i $r rc=$? $((SECONDS-t0)) s"
  grep -E 'default:' "$DEST/$i-$r.log" | sed -E 's/ +/ /g; s/\(floor.*launches,/,/; s/err.*//'
done
