#!/usr/bin/env bash
# Device calls for what a session prepared without a GPU (NOTES.md, "Prepared for the next session"). Logs to $OUT;
# each step is time-boxed so a call stays well inside the device's 10 minutes. Run the phases in order, each within
# 30 s of the last (a warm machine keeps the build and the GGUF in /dev/shm):
#   bash engine/gpu/device_prepared.sh kernels   build; the kernel-level GPU tests of the prepared items; the A/Bs of
#                                                bench_mmq --experts and bench_hc; the synthetic Flash q2 GGUF written
#                                                meanwhile
#   bash engine/gpu/device_prepared.sh session   the session-level GPU tests; the session A/Bs at 8192 tokens, one
#                                                switch at a time and all together
#   bash engine/gpu/device_prepared.sh chunk     the 32k prompt at chunks of 8192 and 16384, with the peak memory
# Switches under test (v29's three, run in v30 and on by default, so the A/Bs below set 0 against 1):
# DS4_GPU_MMQ_XPTR, DS4_GPU_HC_MIX_PTRS, DS4_GPU_FOLD_SWIGLU, and v30's DS4_GPU_MMQ_PAIRS (on, measured only by
# bench_mmq: the session A/B is its first session-level run). Each gives the other setting's bits; the tests check that.
set -u
PHASE=${1:-kernels}
case "$PHASE" in kernels|session|chunk) ;; *) echo "usage: $0 kernels|session|chunk" >&2; exit 2 ;; esac
source engine/gpu/device_env.sh
start_synth
stamp build; $PY engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
G=/dev/shm/flash-q2.gguf
tests() {  # tests LOG SECONDS FILES...: pytest under a time box, its summary and failures printed
  local log=$1 secs=$2; shift 2
  timeout "$secs" $PY -m pytest -q -p no:cacheprovider -W ignore "$@" > "$OUT/$log" 2>&1
  grep -E "passed|failed|error" "$OUT/$log" | tail -2; grep -E "^FAILED|^ERROR" "$OUT/$log" | head -20
}
if [ "$PHASE" = kernels ]; then
  stamp kernel tests
  tests tests_kernels.log 220 tests/test_gpu_mmq.py tests/test_gpu_fused.py tests/test_gpu_topk.py \
    tests/test_gpu_indexer.py tests/test_gpu_bench_hc.py
  stamp mmq A/B: the routed experts as the session launches them, XPTR off and on in one process
  timeout 120 $PY -m ds4.engine.gpu.bench_mmq --experts 2>&1 | tee "$OUT/mmq_xptr.log"
  stamp hc_mix A/B: pointer loads
  for p in 0 1; do
    echo "DS4_GPU_HC_MIX_PTRS=$p"
    for t in 8192 2048; do DS4_GPU_HC_MIX_PTRS=$p timeout 40 $PY -m ds4.engine.gpu.bench_hc --prefill-mix $t 2>&1 \
      | tail -3; done
  done | tee "$OUT/hc_mix.log"
  stamp synth; [ -z "$SYN" ] || wait $SYN; tail -2 "$OUT/synth.log"
elif [ "$PHASE" = session ]; then
  stamp session tests
  tests tests_session.log 200 tests/test_gpu_prefill.py tests/test_gpu_session_cuda.py
  stamp synth; [ -z "$SYN" ] || wait $SYN; tail -2 "$OUT/synth.log"
  stamp session A/B at 8192 tokens
  for v in "1 1 1 0" "1 1 1 1" "0 1 1 1" "1 0 1 1" "1 1 0 1"; do
    set -- $v
    echo "DS4_GPU_MMQ_XPTR=$1 DS4_GPU_HC_MIX_PTRS=$2 DS4_GPU_FOLD_SWIGLU=$3 DS4_GPU_MMQ_PAIRS=$4"
    DS4_GPU_MMQ_XPTR=$1 DS4_GPU_HC_MIX_PTRS=$2 DS4_GPU_FOLD_SWIGLU=$3 DS4_GPU_MMQ_PAIRS=$4 timeout 70 $PY -m \
      ds4.engine.gpu.bench_session $G --ctx --prefill 8192 --prefill-runs 3 2>&1 | grep -E "^prefill|copy" | cut -c1-200
  done | tee "$OUT/session_ab.log"
else
  stamp synth; [ -z "$SYN" ] || wait $SYN; tail -2 "$OUT/synth.log"
  stamp 32k prompt: chunks of 8192 and 16384
  for c in 8192 16384; do
    timeout 150 $PY -m ds4.engine.gpu.bench_session $G --ctx --prefill 32768 --prefill-runs 2 --prefill-chunk $c 2>&1 \
      | grep -E "^prefill" | cut -c1-250
  done | tee "$OUT/chunk32k.log"
fi
stamp done
