#!/usr/bin/env bash
# Everything the GPU must show, in one run on the device machine (see docs/CONTRIBUTING.md):
#   scripts/gpu_check.sh [tests] [ops] [attention] [e2e] [parity] [proof]   (default: all but proof)
#   tests: every test marked gpu or taking the `device` fixture (the kernel and op tests, compiled on CUDA), < 10 min:
#   the tests marked timing one at a time (< 250 s), then the rest in TEST_WORKERS (8) pytest-xdist workers where
#   pytest-xdist is installed (< 330 s; the device image has it).
#   proof: `novatune bench` + `novatune validate` + `novatune report` on the headline config (issue 4), ~6 min
#   (timeouts 280 + 210 + 60 s). e2e: `novatune bench` on the headline config, E2E_STACKS (default
#   stock,liger-peer,unsloth,novatune), rows in $OUT/e2e.jsonl.
#   eval: `novatune eval` decoding speed on a random Qwen2.5-0.5B (< 2 min; not in the default list).
#   tune: the kernel engine (issue 5): GPU tests of tests/tune (CUDA extension build + validation), then
#   `novatune tune examples/qwen3-4b-seed.yaml` (< 5 min); < 6 min in all; not in the default list.
#   qlora: issue 6's QLoRA (not in the default list; needs the bitsandbytes wheel in .whl/): the NF4 / QLoRA-patch /
#   merged-export GPU tests, then `novatune bench examples/qlora.yaml` (Qwen3-8B architecture, 2048-token rows,
#   PEFT + bnb stock vs novatune) and the acceptance figures (peak <= 7 GiB, >= 2x stock tok/s, loss parity); < 6 min.
#   memory: issue 15's memory policies (not in the default list): the GPU tests of tests/memory, then `novatune bench
#   examples/qwen3-4b-seed.yaml` with MEM_STACKS (default stock,novatune,novatune_offload,novatune_keep,novatune_auto:
#   checkpointing, offload on top of it, no recompute, the planner's choice), every row with the planner's
#   predicted peak beside the measured one; < 9 min (timeouts 150 + 400 s).
#   lowmem: issue 15's items 3-5 (not in the default list; bitsandbytes wheel in .whl/): the tests of the low-memory
#   build (the 8 GiB one included), the tiled MLP and the optimizers (CUDA kernel), then
#   bench/experiments/exp_lowmem.py (QLoRA 8B capped at 8 GiB vs uncapped, LoRA r16 seed peak, a 65k-token row
#   tiled vs untiled; LOWMEM_BLOCKS adds optimizer-4b: adamw vs adamw_kahan, or lora-8g: the seed LoRA r16 run
#   under an 8 GiB cap with frozen-weight streaming beside PEFT stock, ~6 min, LOWMEM_TIMEOUT=600); < 8 min.
#   moe: issue 14's MoE path (not in the default list): the MoE GPU tests (one layer under CUDA sync-debug mode, values
#   vs HF grouped_mm), bench/bench_moe.py (one layer at Qwen3-30B-A3B shapes), bench/bench_moe_wgrad.py (the
#   experts' weight gradients accumulated into .grad: grouped_mm + add, column slices, the kernel's tile configs),
#   then `novatune bench
#   examples/qwen3-30b-a3b-moe.yaml` (8-layer cut; stock, hf-varlen, unsloth, novatune), and with MOE_VARIANT
#   ("key=value ...") the novatune stack once more with those settings; < 8 min (+3 with MOE_VARIANT).
#   gemma: issue 18's Gemma GPU tests (not in the default list): patched tiny Gemma 2/3 in bf16 against stock's own
#   bf16 error, soft-capped flex attention at Gemma 2's shapes, the new kernels; < 4 min. The benches: `families`.
#   families: issue 18's family benches (not in the default list), one GPU call per pair of families: the peer's
#   varlen wiring on the GPU (tests/bench/test_peer_families.py), then `novatune bench examples/<arch>.yaml` for each
#   of FAMILIES (default "gemma-3-4b gemma-2-2b"; the other call: FAMILIES="phi-4-mini olmo-2-7b") with
#   FAMILY_STACKS (default stock,liger-peer,novatune), rows in $OUT/families.jsonl, and the acceptance lines
#   (novatune >= 1.5x stock and >= 1.1x the Liger peer, losses within bf16 noise of stock's); < 9 min (timeouts 60 +
#   2 x 255 s; each bench ~2.5-4 min: 2 warm-up + 4 timed steps per stack, model build and compiles included).
#   multigpu: issue 17's multi-GPU run (not in the default list; a machine of 2+ GPUs): the GPU tests of tests/parallel
#   (2 GPUs against one, kill and resume), then `novatune bench examples/qwen3-4b-seed.yaml --nproc N` for N in
#   MULTI_NPROC (default "2 4", skipped above the GPUs present) with MULTI_STACKS (default
#   novatune,novatune_ddp,novatune_fsdp2: one process at the same global batch beside DDP and FSDP2 on N GPUs),
#   MULTI_ROUNDS (default 1; 2 alternates the stacks A B, B A: each row its stack's slower round),
#   MULTI_VARIANT ("key=value ..."): novatune_fsdp2 on 2 GPUs once more with those settings; then Qwen3-8B full
#   fine-tuning on 8192-token rows under FSDP2 on MULTI_8B GPUs (default 2; empty: not run); MULTI_TESTS=0 skips
#   the tests; rows in $OUT/multigpu.jsonl; < 10 min on 4 GPUs.
#   optim: novatune's AdamW kernel (train.adamw_kernel; not in the default list): its GPU tests (bit-equal to the fp32
#   reference, one step beside torch's fused AdamW), then `novatune bench --rounds 2` of novatune beside
#   novatune_torch_adamw on the seed and on the MoE cut (memory.policy auto); < 9 min (timeouts 90 + 2 x 230 s).
#   cudnn: issue 19's cuDNN attention backend (not in the default list; its fast path is the nvidia-cudnn-frontend
#   wheel in .whl/): its GPU tests (values vs the fp32 reference, document isolation, frontend and aten paths),
#   bench/bench_attention.py with varlen / cudnn / cudnn_aten / cudnn_exact at the headline shapes, then `novatune
#   bench` on the headline config twice, novatune with attention auto (varlen) and with attention=cudnn; < 7 min
#   (timeouts 120 + 150 + 2 x 170 s).
# Full logs and JSONL rows go under $OUT (or ./gpu_out); the short table is printed last.
# Carried wheels (.whl/, e.g. liger-kernel; scripts/fetch_wheels.sh downloads the set) are installed into /tmp/site
# first.
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
  # every test that needs CUDA or runs its kernels on it (-m "gpu or on_device"), at one sha in one call. The tests
  # that assert a speed or a time (marker `timing`) run first, one at a time on an otherwise idle GPU; the rest run
  # in TEST_WORKERS xdist processes (a test that crashes takes its worker down, not the run). SIGINT at the time
  # limit lets pytest print its summary.
  timeout -s INT ${TESTS_ALONE_TIMEOUT:-250} python3 -m pytest -q -rfEs -p no:cacheprovider -m timing tests 2>&1 \
    | tee "$OUT/gpu_tests_alone.log" | tail -n 15
  summary+=("gpu tests that time, one at a time: $(tail -n 1 "$OUT/gpu_tests_alone.log")")
  workers=(-n "${TEST_WORKERS:-8}"); python3 -c "import xdist" 2>/dev/null || workers=()  # pytest-xdist, if present
  timeout -s INT ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rfEs -p no:cacheprovider "${workers[@]}" \
    -m "(gpu or on_device) and not timing" --durations 12 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  summary+=("gpu tests, ${workers[*]:-one process}: $(tail -n 1 "$OUT/gpu_tests.log")")
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
  # GPT-OSS's attention (64 / 8 heads, d 64, window 128): plain varlen beside varlen with per-head sinks
  timeout 240 python3 bench/bench_attention.py --hq 64 --hkv 8 --d 64 --window 128 --candidates varlen \
    --results "$OUT/attention.jsonl" 2>&1 | tee "$OUT/bench_attention_gptoss.log" | tail -n 3
  timeout 240 python3 bench/bench_attention.py --hq 64 --hkv 8 --d 64 --window 128 --sinks --candidates varlen \
    --results "$OUT/attention.jsonl" 2>&1 | tee -a "$OUT/bench_attention_gptoss.log" | tail -n 3
  summary+=("bench_attention gpt_oss (sinks): exit ${PIPESTATUS[0]}")
fi
if has cudnn; then
  timeout 120 python3 -m pytest -q -rs -m gpu tests/attention/test_cudnn.py 2>&1 | tee "$OUT/cudnn_tests.log" | tail -n 15
  summary+=("cudnn gpu tests: $(tail -n 1 "$OUT/cudnn_tests.log")")
  timeout 150 python3 bench/bench_attention.py --candidates varlen,cudnn,cudnn_aten,cudnn_exact --results "$OUT/attention.jsonl" \
    2>&1 | tee "$OUT/bench_attention_cudnn.log" | tail -n 6
  summary+=("bench_attention cudnn: exit ${PIPESTATUS[0]}")
  for attn in auto cudnn; do
    timeout 170 python3 -m novatune bench examples/qwen3-4b-seed.yaml --stacks novatune --steps 4 --timeout 160 \
      --set model.patch_options.attention=$attn --results "$OUT/e2e.jsonl" --run-dir "$OUT/runs/cudnn_$attn" 2>&1 \
      | tee "$OUT/e2e_attention_$attn.log" | tail -n 6
    summary+=("novatune bench attention=$attn: exit ${PIPESTATUS[0]}")
  done
fi
if has optim; then
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_adamw.py 2>&1 | tee "$OUT/optim_tests.log" \
    | tail -n 6
  summary+=("adamw kernel tests: $(tail -n 1 "$OUT/optim_tests.log")")
  for cfg in "examples/qwen3-4b-seed.yaml" "examples/qwen3-30b-a3b-moe.yaml --set memory.policy=auto"; do
    name=$(basename ${cfg%% *} .yaml)
    timeout 230 python3 -m novatune bench $cfg --stacks novatune,novatune_torch_adamw --rounds 2 --timeout 110 \
      --results "$OUT/optim.jsonl" --run-dir "$OUT/runs/optim_$name" 2>&1 | tee "$OUT/optim_$name.log" | tail -n 6
    summary+=("novatune bench $name kernel vs torch AdamW: exit ${PIPESTATUS[0]}")
  done
fi
if has parity; then
  # smaller real architectures: loss parity stock vs novatune (and speed), random init
  for arch in llama-3.2-1b qwen2.5-0.5b; do
    timeout 400 python3 -m novatune bench examples/qwen3-4b-seed.yaml --set model.arch=$arch --stacks stock,novatune \
      --steps 3 --results "$OUT/e2e.jsonl" --run-dir "$OUT/runs/parity_$arch" 2>&1 | tee "$OUT/parity_$arch.log" | tail -n 4
  done
fi
if has e2e; then
  timeout 580 python3 -m novatune bench examples/qwen3-4b-seed.yaml --stacks ${E2E_STACKS:-stock,liger-peer,unsloth,novatune} \
    --steps ${E2E_STEPS:-6} --results "$OUT/e2e.jsonl" --run-dir "$OUT/runs/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -n 12
fi
if has moe; then
  timeout 150 python3 -m pytest -q -m gpu tests/ops/test_moe_gpu.py tests/ops/test_moe_wgrad.py \
    tests/kernels/test_moe_wgrad_gemm.py 2>&1 | tee "$OUT/moe_gpu_tests.log" | tail -n 8
  summary+=("moe gpu tests: $(tail -n 1 "$OUT/moe_gpu_tests.log")")
  timeout 120 python3 bench/bench_moe.py --results "$OUT/ops.jsonl" 2>&1 | tee "$OUT/bench_moe.log" | tail -n 6
  summary+=("bench_moe: exit ${PIPESTATUS[0]}")
  timeout 90 python3 bench/bench_moe_wgrad.py --quick --results "$OUT/ops.jsonl" 2>&1 | tee "$OUT/bench_moe_wgrad.log" \
    | tail -n 20
  summary+=("bench_moe_wgrad: exit ${PIPESTATUS[0]}")
  timeout 330 python3 -m novatune bench examples/qwen3-30b-a3b-moe.yaml --stacks ${MOE_STACKS:-stock,hf-varlen,unsloth,novatune} \
    --steps ${MOE_STEPS:-4} --results "$OUT/moe.jsonl" --run-dir "$OUT/runs/moe" 2>&1 | tee "$OUT/moe_e2e.log" | tail -n 14
  summary+=("novatune bench examples/qwen3-30b-a3b-moe.yaml: exit ${PIPESTATUS[0]}")
  if [ -n "${MOE_VARIANT:-}" ]; then  # e.g. MOE_VARIANT="memory.policy=auto model.patch_options.moe_wgrad_in_place=true"
    sets=(); for kv in $MOE_VARIANT; do sets+=(--set "$kv"); done
    timeout 200 python3 -m novatune bench examples/qwen3-30b-a3b-moe.yaml --stacks novatune "${sets[@]}" \
      --steps ${MOE_STEPS:-4} --results "$OUT/moe.jsonl" --run-dir "$OUT/runs/moe_variant" 2>&1 \
      | tee "$OUT/moe_variant.log" | tail -n 6
    summary+=("novatune bench MoE with $MOE_VARIANT: exit ${PIPESTATUS[0]}")
  fi
fi
if has gemma; then
  timeout 240 python3 -m pytest -q -m gpu tests/patch/test_gemma.py tests/attention/test_softcap.py \
    tests/kernels/test_offset_rms_norm.py tests/kernels/test_geglu.py tests/kernels/test_linear_cross_entropy_softcap.py \
    tests/ops/test_offset_rms_norm.py tests/ops/test_geglu.py 2>&1 | tee "$OUT/gemma_gpu_tests.log" | tail -n 8
  summary+=("gemma gpu tests: $(tail -n 1 "$OUT/gemma_gpu_tests.log")")
fi
if has families; then
  timeout 60 python3 -m pytest -q -m gpu tests/bench/test_peer_families.py 2>&1 | tee "$OUT/families_gpu_tests.log" | tail -n 4
  summary+=("families gpu tests: $(tail -n 1 "$OUT/families_gpu_tests.log")")
  for arch in ${FAMILIES:-gemma-3-4b gemma-2-2b}; do
    timeout 255 python3 -m novatune bench examples/$arch.yaml --stacks ${FAMILY_STACKS:-stock,liger-peer,novatune} \
      --timeout 150 --results "$OUT/families.jsonl" --run-dir "$OUT/runs/$arch" 2>&1 | tee "$OUT/family_$arch.log" | tail -n 9
    summary+=("novatune bench examples/$arch.yaml: exit ${PIPESTATUS[0]}")
  done
  [ -f "$OUT/families.jsonl" ] && python3 - "$OUT/families.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if r.get("status") != "ok":
        print(f"family {r.get('config', '?')[9:]:18s} {r['stack']:11s} {r.get('status')}: {str(r.get('reason'))[:110]}")
        continue
    print(f"family {r['model_type']:11s} {r['stack']:11s} {r['tok_s']:8.0f} tok/s  x{r.get('x_stock') or 0:.3f} stock  "
          f"x{r.get('x_peer') or 0:.3f} peer  {r['peak_gib']:6.2f} GiB  loss vs stock "
          f"{r.get('loss_max_rel_diff_vs_stock') or 0:.1e}  hf_attention {r.get('hf_attention')}  "
          f"{r.get('applied') or r.get('attention_backend') or ''}")
ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
for config in dict.fromkeys(r.get("config") for r in rows):
    by = {r["stack"]: r for r in rows if r.get("config") == config and r.get("status") == "ok"}
    nt, st, lg = by.get("novatune"), by.get("stock"), by.get("liger-peer")
    if not (nt and st):
        print(f"acceptance {config}: novatune or stock did not run"); continue
    line = (f"acceptance {config}: x{nt['x_stock']:.3f} stock >= 1.5 {ok(nt['x_stock'] >= 1.5)}; loss max rel diff "
            f"{nt['loss_max_rel_diff_vs_stock']:.1e} (bf16 noise: < 1e-2) {ok(nt['loss_max_rel_diff_vs_stock'] < 1e-2)}")
    line += (f"; x{nt['tok_s'] / lg['tok_s']:.3f} Liger >= 1.1 {ok(nt['tok_s'] >= 1.1 * lg['tok_s'])}" if lg else
             "; Liger peer did not run")
    print(line)
PY
fi
if has eval; then
  # `novatune eval` decoding speed (issue 4): Qwen2.5-0.5B architecture, random init (it never stops early, so every
  # request decodes all 256 tokens), the bundled 22-problem sample x3 = 66 requests in one batch, greedy, KV cache
  timeout 170 python3 -m novatune eval --arch qwen2.5-0.5b --max-new-tokens 256 --batch-size 66 --repeat 3 \
    --label "qwen2.5-0.5b random (speed)" --output "$OUT/eval.json" --results "$OUT/eval.jsonl" 2>&1 \
    | tee "$OUT/eval.log" | tail -n 14
  summary+=("novatune eval: exit ${PIPESTATUS[0]}, $(python3 -c "import json; r = json.load(open('$OUT/eval.json')); \
print(f\"{r['gen_tokens_per_s']:,.0f} generated tok/s ({r['gen_tokens']} tokens, {r['requests']} requests, batch \
{r['batch_size']}, {r['avg_latency_s']:.2f} s/request)\")" 2>/dev/null || echo 'no eval.json')")
fi
if has proof; then
  # the headline workload through the CLI: each stack in its own process (bench), then parity and the adversarial
  # checks (validate); run directories go into one archive below ($OUT returns few files, two folders deep)
  P="$OUT/proof"; rm -rf "$P"; mkdir -p "$P"
  # --profile: one extra step per stack under torch.profiler after the timed ones (the report's op breakdown)
  timeout 280 python3 -m novatune bench examples/qwen3-4b-seed.yaml --stacks stock,liger-peer,novatune \
    --warm 2 --steps ${PROOF_STEPS:-5} --timeout 150 --profile --run-dir "$P/bench" 2>&1 | tee "$OUT/proof_bench.log" | tail -n 12
  summary+=("novatune bench: exit ${PIPESTATUS[0]}")
  timeout 210 python3 -m novatune validate examples/qwen3-4b-seed.yaml --steps 4 --run-dir "$P/validate" \
    2>&1 | tee "$OUT/proof_validate.log" | tail -n 12
  summary+=("novatune validate: exit ${PIPESTATUS[0]}")
  ev=(); [ -f "$OUT/eval.json" ] && ev=(--eval "$OUT/eval.json")  # `eval` ran first in this call: its table too
  timeout 60 python3 -m novatune report "$P/bench" "$P/validate" "${ev[@]}" -o "$P/report" 2>&1 | tee "$OUT/proof_report.log" | tail -n 2
  summary+=("novatune report: exit ${PIPESTATUS[0]}")
fi
if has tune; then
  # the kernel engine: GPU tests (CUDA extension build + validation of its candidates), then the headline tune run
  # (< 5 min). The CUDA build lands in ~/.cache/novatune/cuda and is reused by the tune run; the cache JSON, rows,
  # traces and report go under $OUT (traces/report in tune.tgz).
  timeout 240 python3 -m pytest -q -s -m gpu tests/tune 2>&1 | tee "$OUT/tune_tests.log" | grep -E "^(rms_norm|swiglu|CUDA)|passed|failed|error" | tail -n 30
  summary+=("tune gpu tests: $(tail -n 1 "$OUT/tune_tests.log")")
  t0=$(date +%s)
  NOVATUNE_TUNE_CACHE="$OUT/tune_cache.json" timeout 330 python3 -m novatune tune examples/qwen3-4b-seed.yaml \
    --out "$OUT/tune" --results "$OUT/tune.jsonl" 2>&1 | tee "$OUT/tune.log" | tail -n 25
  summary+=("novatune tune: exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s (process wall, incl. model build)")
  (cd "$OUT" && tar czf tune.tgz tune 2>/dev/null && rm -rf tune)
fi
if has qlora; then
  python3 -c "import bitsandbytes, peft; print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)" \
    2>&1 | tail -n 1 | tee -a "$OUT/gpu.txt"
  # no -m gpu: these files carry no gpu marker; on the GPU their `device` fixture runs every test on CUDA
  timeout 120 python3 -m pytest -q tests/kernels/test_nf4.py tests/patch/test_qlora_patch.py \
    tests/train/test_merge_export.py 2>&1 | tee "$OUT/qlora_tests.log" | tail -n 15
  summary+=("qlora gpu tests: $(tail -n 1 "$OUT/qlora_tests.log")")
  timeout 230 python3 -m novatune bench examples/qlora.yaml --stacks stock,novatune --steps 3 \
    --results "$OUT/qlora.jsonl" --run-dir "$OUT/runs/qlora" 2>&1 | tee "$OUT/qlora_e2e.log" | tail -n 5
  summary+=("novatune bench examples/qlora.yaml: exit ${PIPESTATUS[0]}")
  [ -f "$OUT/qlora.jsonl" ] && python3 - "$OUT/qlora.jsonl" <<'PY'
import json, sys
rows = {r["stack"]: r for r in map(json.loads, open(sys.argv[1])) if r.get("method") == "qlora" and r["status"] == "ok"}
for r in rows.values():
    print(f"qlora {r['model_type']} seq {r['seq']} {r['stack']:9s} {r['tok_s']:8.0f} tok/s  "
          f"x{r.get('x_stock') or 0:.3f} stock  peak {r['peak_gib']:6.2f} GiB  weights {r['weights_gib']:5.2f} GiB  "
          f"losses {r['losses']}")
st, nt = rows.get("stock"), rows.get("novatune")
if st and nt:
    rel = max(abs(a - b) / abs(b) for a, b in zip(nt["losses"], st["losses"]))
    ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
    print(f"qlora acceptance: peak {nt['peak_gib']:.2f} GiB <= 7 {ok(nt['peak_gib'] <= 7)}; "
          f"tok/s x{nt['tok_s'] / st['tok_s']:.3f} stock >= 2 {ok(nt['tok_s'] >= 2 * st['tok_s'])}; "
          f"loss max rel diff {rel:.1e} (bf16 noise: < 1e-2) {ok(rel < 1e-2)}")
PY
fi
if has memory; then
  timeout 240 python3 -m pytest -q -s -m gpu tests/memory 2>&1 | tee "$OUT/memory_tests.log" | grep -E "held|streamed|passed|failed|rror" | tail -n 8
  summary+=("memory gpu tests: $(tail -n 1 "$OUT/memory_tests.log")")
  timeout 400 python3 -m novatune bench examples/qwen3-4b-seed.yaml \
    --stacks ${MEM_STACKS:-stock,novatune,novatune_offload,novatune_keep,novatune_auto} --steps ${MEM_STEPS:-4} \
    --timeout 150 --results "$OUT/memory.jsonl" --run-dir "$OUT/runs/memory" 2>&1 | tee "$OUT/memory_bench.log" | tail -n 14
  summary+=("novatune bench (memory policies): exit ${PIPESTATUS[0]}")
  [ -f "$OUT/memory.jsonl" ] && python3 - "$OUT/memory.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("status") == "ok"]
for r in rows:
    pred = r.get("predicted_peak_gib")
    off = f"{100 * (r['peak_gib'] / pred - 1):+.1f}%" if pred and r.get("peak_gib") else "-"
    print(f"memory {r['stack']:18s} {r['tok_s']:8.0f} tok/s  x{r.get('x_stock') or 0:.3f} stock  peak "
          f"{r['peak_gib']:6.2f} GiB  planned {pred or 0:6.2f} ({off})  {r.get('memory_policy', '-')}: "
          f"{r.get('memory_layers', '-')}  offloaded {r.get('offloaded_gib')} GiB  loss {r['losses'][-1]}")
PY
fi
if has lowmem; then
  timeout 150 python3 -m pytest -q tests/train/test_load.py tests/kernels/test_adamw_kahan.py \
    tests/train/test_optim.py tests/patch/test_tiled_mlp.py 2>&1 | tee "$OUT/lowmem_tests.log" | tail -n 8
  summary+=("lowmem gpu tests: $(tail -n 1 "$OUT/lowmem_tests.log")")
  timeout ${LOWMEM_TIMEOUT:-330} python3 bench/experiments/exp_lowmem.py --results "$OUT/lowmem.jsonl" \
    --blocks ${LOWMEM_BLOCKS:-qlora-8b,lora-r16,long-4b} 2>&1 | tee "$OUT/lowmem.log" | grep -v "^\[" | tail -n 12
  summary+=("exp_lowmem: exit ${PIPESTATUS[0]}")
fi
if has multigpu; then
  # NVLink multicast stays off in every process (the machines' rule; torchrun passes the environment on)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "${MULTI_TESTS:-1}" = 1 ]; then
    timeout 200 python3 -m pytest -q -m gpu tests/parallel 2>&1 | tee "$OUT/multigpu_tests.log" | tail -n 6
    summary+=("multigpu tests: $(tail -n 1 "$OUT/multigpu_tests.log")")
  fi
  for n in ${MULTI_NPROC:-2 4}; do
    [ "$n" -gt "$ngpu" ] && { summary+=("multigpu: $n GPUs asked, $ngpu here: not run"); continue; }
    timeout ${MULTI_TIMEOUT:-300} python3 -m novatune bench examples/qwen3-4b-seed.yaml --nproc "$n" \
      --stacks ${MULTI_STACKS:-novatune,novatune_ddp,novatune_fsdp2} --steps ${MULTI_STEPS:-6} --timeout 150 \
      --rounds ${MULTI_ROUNDS:-1} \
      --set data.sources.0.num_docs=$((600 * n)) --results "$OUT/multigpu.jsonl" --run-dir "$OUT/runs/seed_x$n" 2>&1 \
      | tee "$OUT/multigpu_seed_x$n.log" | tail -n 12
    summary+=("multigpu seed on $n GPUs: exit ${PIPESTATUS[0]}")
  done
  if [ -n "${MULTI_8B-2}" ] && [ "${MULTI_8B-2}" -le "$ngpu" ]; then  # Qwen3-8B full fine-tuning at 8k
    timeout 240 python3 -m novatune bench examples/qwen3-4b-seed.yaml --nproc "${MULTI_8B-2}" --stacks novatune_fsdp2 \
      --steps 4 --timeout 200 --set model.arch=qwen3-8b --set data.max_length=8192 \
      --set data.sources.0.num_docs=1200 --results "$OUT/multigpu.jsonl" --run-dir "$OUT/runs/8b_8k" 2>&1 \
      | tee "$OUT/multigpu_8b.log" | tail -n 8
    summary+=("multigpu qwen3-8b 8k on ${MULTI_8B-2} GPUs: exit ${PIPESTATUS[0]}")
  fi
  if [ -n "${MULTI_VARIANT:-}" ]; then  # e.g. "parallel.gradient_sync=step parallel.reshard_after_forward=false"
    sets=(); for kv in $MULTI_VARIANT; do sets+=(--set "$kv"); done
    timeout 150 python3 -m novatune bench examples/qwen3-4b-seed.yaml --nproc 2 --stacks novatune_fsdp2 \
      --steps ${MULTI_STEPS:-6} --set data.sources.0.num_docs=1200 "${sets[@]}" --results "$OUT/multigpu.jsonl" \
      --run-dir "$OUT/runs/variant" 2>&1 | tee "$OUT/multigpu_variant.log" | tail -n 6
    summary+=("multigpu fsdp2 variant ($MULTI_VARIANT) on 2 GPUs: exit ${PIPESTATUS[0]}")
  fi
  [ -f "$OUT/multigpu.jsonl" ] && python3 - "$OUT/multigpu.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r.get("status") != "ok":
        print(f"multigpu {r['stack']:15s} {r.get('status')}: {str(r.get('reason'))[:160]}")
        continue
    sc = r.get("scaling")
    print(f"multigpu {r['model_type']} seq {r['seq']} {r['stack']:15s} x{r.get('nproc', 1)} ga {r['grad_accum']:2d} "
          f"{r['tok_s']:9.0f} tok/s ({r.get('tok_s_per_proc', r['tok_s']):7.0f}/GPU) scaling "
          f"{'-' if sc is None else f'{sc:.3f}'} peak {r['peak_gib']} GiB/rank {r.get('peak_gib_per_rank')} "
          f"planned {r.get('predicted_peak_gib')} loss vs 1 proc {r.get('loss_max_rel_diff_vs_one_process')}")
PY
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
    if r.get("status") != "ok":
        print(f"e2e {r['stack']:14s} {r.get('status')}: {str(r.get('reason'))[:100]}")
        continue
    print(f"e2e {r['model_type']:8s} {r['stack']:14s} {r['tok_s']:8.0f} tok/s  x{r.get('x_stock') or 0:.3f} stock  "
          f"x{r.get('x_peer') or 0:.3f} peer  {r['peak_gib']:6.2f} GiB  loss {r['losses'][-1]}")
PY
[ -d "$OUT/proof" ] && python3 - "$OUT/proof" <<'PY'
import json, os, sys
p = sys.argv[1]
bench = os.path.join(p, "bench", "summary.json")
if os.path.exists(bench):
    s = json.load(open(bench))
    for r in s["rows"]:
        if r["status"] != "ok":
            print(f"proof bench    {r['stack']:11s} {r['status']}: {str(r.get('reason'))[:100]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        print(f"proof bench    {r['stack']:11s} {r['tok_s']:8.0f} tok/s  x{r.get('x_stock') or 0:.3f} stock  "
              f"MFU {mfu}  {r.get('peak_gib') or 0:6.2f} GiB  loss vs stock {r.get('loss_max_rel_diff_vs_stock') or 0:.1e}")
else:
    print("proof bench    no summary.json (see proof_bench.log in logs.tgz)")
val = os.path.join(p, "validate", "validate.json")
if os.path.exists(val):
    v = json.load(open(val))
    print(f"proof validate {'PASSED' if v['passed'] else 'FAILED'} ({v['dtype']}, {v['steps']} steps, layers {v['layers']})")
    for c in v["checks"]:
        print(f"  {'PASS' if c['passed'] else 'FAIL'} {c['name']:22s} {c['message'][:150]}")
else:
    print("proof validate no validate.json (see proof_validate.log in logs.tgz)")
PY
# Chrome traces of a 4B optimizer step are tens of MB (a returned file may hold 16 MiB): the report keeps their
# op-time table; the traces themselves stay on the machine
[ -d "$OUT/proof" ] && (cd "$OUT" && tar czf proof.tgz --exclude=traces proof && rm -rf proof)
[ -d "$OUT/runs" ] && (cd "$OUT" && tar czf runs.tgz --exclude=traces runs && rm -rf runs)
[ -f "$OUT/tune.jsonl" ] && python3 - "$OUT/tune.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
summ = [r for r in rows if r.get("bench") == "tune_summary"]
if not summ:
    print("tune: no summary row (the run failed before the end; see tune.log)"); sys.exit()
s = summ[-1]
print(f"tune ({s.get('device')}): {s['tune_s']} s tune wall (acceptance < 300 s: {'PASS' if s['tune_s'] < 300 else 'FAIL'})")
print(f"{'op':9s} {'shape':>12s} {'default us':>10s} {'chosen':>18s} {'chosen us':>10s} {'kernel us':>10s} {'floor frac':>10s} {'x HF eager':>10s}")
for o in s["ops"]:
    k = o.get("kernel_us", {}).get(o["choice"])
    print(f"{o['op']:9s} {o['shape']:>12s} {o['default_us'] or 0:10.1f} {o['choice'][:18]:>18s} {o['chosen_us']:10.1f} "
          f"{k or 0:10.1f} {o['floor_frac'] or 0:10.3f} {o['x_hf_eager'] or 0:10.2f}")
    if o["op"] == "rms_norm" and o["shape"] == "4096x2560":
        ok = (o["x_hf_eager"] or 0) >= 5 and (o["floor_frac"] or 0) >= 0.85
        kfrac = o["floor_us"] / k if k and o.get("floor_us") else 0
        print(f"  RMSNorm 4096x2560 bar (>= 5x HF eager, >= 0.85 floor, on graph-replay time incl. gaps): "
              f"{'PASS' if ok else 'FAIL'}; on kernel time (profiler sum, no gaps): {kfrac:.3f}")
c = s.get("step_check")
if c:
    print(f"step: default {c['default_s'] * 1e3:.1f} ms, tuned {c['tuned_s'] * 1e3:.1f} ms ({'kept' if c['kept'] else 'dropped'}; "
          f"tuned <= default: {'PASS' if c['tuned_s'] <= c['default_s'] or not c['kept'] else 'FAIL'})")
else:
    print("step: no non-default choice, nothing to check")
bad = [r for r in rows if r.get("bench") == "tune" and r.get("family") == "cuda" and r["status"] not in ("timed", "chosen")]
print(f"cuda candidates: {sum(1 for r in rows if r.get('bench') == 'tune' and r.get('family') == 'cuda') - len(bad)} validated+timed, "
      f"{len(bad)} not: " + "; ".join(f"{r['op']} {r['candidate']} [{r['check']}] {str(r['reason'])[:80]}" for r in bad[:4]))
PY
# at most 8 files come back from the device machine: logs go into one archive, JSONL rows stay plain files
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log gpu.txt 2>/dev/null)
exit 0
