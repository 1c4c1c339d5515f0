#!/usr/bin/env bash
# Everything the GPU must show, in one run on the device machine (see docs/CONTRIBUTING.md):
#   scripts/gpu_check.sh [tests] [ops] [attention] [e2e] [parity]     (default: all of them)
# Full logs and JSONL rows go under $OUT (or ./gpu_out); the short table is printed last.
# Carried wheels (.whl/, e.g. liger-kernel from ../shared/tools/peer-wheels.sh) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
what=${*:-tests ops attention e2e parity}
has() { [[ " $what " == *" $1 "* ]]; }
summary=()
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if has tests; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
if has ops; then
  for op in rms_norm qk_norm_rope swiglu rope linear_cross_entropy; do
    timeout 300 python3 bench/bench_$op.py --results "$OUT/ops.jsonl" 2>&1 | tee "$OUT/bench_$op.log" | tail -n 12
    summary+=("bench_$op: exit ${PIPESTATUS[0]}")
  done
fi
if has attention; then
  timeout 300 python3 bench/bench_attention.py --results "$OUT/attention.jsonl" 2>&1 | tee "$OUT/bench_attention.log" | tail -n 15
  summary+=("bench_attention: exit ${PIPESTATUS[0]}")
fi
if has parity; then
  # smaller real architectures: loss parity stock vs novatune (and speed), random init
  for arch in llama-3.2-1b qwen2.5-0.5b; do
    timeout 400 python3 bench/e2e.py --arch $arch --stacks hf_sdpa,novatune --steps 3 --results "$OUT/e2e.jsonl" \
      2>&1 | tee "$OUT/parity_$arch.log" | tail -n 4
  done
fi
if has e2e; then
  timeout 580 python3 bench/e2e.py --stacks ${E2E_STACKS:-hf_sdpa,varlen_liger,novatune} --results "$OUT/e2e.jsonl" \
    2>&1 | tee "$OUT/e2e.log" | tail -n 6
fi
echo; echo "=== summary ==="
for s in "${summary[@]}"; do echo "$s"; done
[ -f "$OUT/ops.jsonl" ] && python3 - "$OUT/ops.jsonl" <<'PY'
import json, sys
print(f"{'op':26s} {'impl':16s} {'kernel us':>10s} {'wall us':>9s} {'floor frac':>10s}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{str(r.get('op', r.get('shape', '?')))[:26]:26s} {str(r.get('impl', r.get('candidate', '?')))[:16]:16s} "
          f"{r.get('kernel_us', 0) or 0:10.1f} {r.get('wall_us', 0) or 0:9.1f} {r.get('frac_of_floor', r.get('kernel_frac_of_floor', 0)) or 0:10.3f}")
PY
[ -f "$OUT/e2e.jsonl" ] && python3 - "$OUT/e2e.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"e2e {r['arch']:13s} {r['stack']:13s} {r['tok_s']:8.0f} tok/s  x{r.get('x_stock') or 0:.3f} stock  "
          f"x{r.get('x_best_peer') or 0:.3f} peer  {r['peak_gib']:6.2f} GiB  loss {r['losses'][-1]}")
PY
# at most 8 files come back from the device machine: logs go into one archive, JSONL rows stay plain files
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log gpu.txt 2>/dev/null)
exit 0
