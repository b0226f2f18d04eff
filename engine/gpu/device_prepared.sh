#!/usr/bin/env bash
# One device call for what a session prepared without a GPU (NOTES.md, "Prepared for the next session"): build, the
# GPU test files that cover the prepared items and the code rewritten since the last run, the kernel A/Bs, then the
# session A/Bs on the synthetic Flash q2 GGUF (written to /dev/shm in the background meanwhile). Logs to $OUT; each
# step is time-boxed so the call ends inside the device's 10 minutes (~7 minutes on a cold machine).
# Usage: bash engine/gpu/device_prepared.sh
set -u
source engine/gpu/device_env.sh
start_synth
stamp build; $PY engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
stamp tests
timeout 240 $PY -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_fused.py tests/test_gpu_topk.py \
  tests/test_gpu_indexer.py tests/test_gpu_bench_hc.py tests/test_gpu_prefill.py tests/test_gpu_session_cuda.py \
  > "$OUT/tests.log" 2>&1
grep -E "passed|failed|error" "$OUT/tests.log" | tail -5; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
stamp hc_mix ring A/B
for e in 0 1; do
  echo "DS4_GPU_HC_MIX_RING=$e"
  for t in 8192 2048; do DS4_GPU_HC_MIX_RING=$e timeout 60 $PY -m ds4.engine.gpu.bench_hc --prefill-mix $t 2>&1 | tail -3; done
done | tee "$OUT/hc_mix_ring.log"
stamp synth; [ -z "$SYN" ] || wait $SYN; tail -2 "$OUT/synth.log"
G=/dev/shm/flash-q2.gguf
stamp session A/B: FOLD_SWIGLU, HC_MIX_RING
for v in "0 0" "1 0" "0 1" "1 1"; do
  set -- $v
  echo "DS4_GPU_FOLD_SWIGLU=$1 DS4_GPU_HC_MIX_RING=$2"
  DS4_GPU_FOLD_SWIGLU=$1 DS4_GPU_HC_MIX_RING=$2 timeout 90 $PY -m ds4.engine.gpu.bench_session $G --ctx \
    --prefill 8192 --prefill-runs 3 2>&1 | grep -E "prefill|copy|floor" | tail -4
done | tee "$OUT/session_ab.log"
stamp 32k prompt: chunk 8192 / 16384 with the peak memory
for c in 8192 16384; do
  timeout 120 $PY -m ds4.engine.gpu.bench_session $G --ctx --prefill 32768 --prefill-runs 2 --prefill-chunk $c 2>&1 \
    | grep -E "prefill|GiB" | tail -3
done | tee "$OUT/chunk32k.log"
stamp done
