#!/usr/bin/env bash
# One device call for the int8 prefill products (mmq.cu) and the one-kernel prefill attention: build, the mmq GPU
# tests, the kernel benchmarks against their peers (bench_mmq: dequant + three float16 GEMMs; bench_attn: the torch
# products), then prefill of 2048 and 8192 tokens on the synthetic Flash q2 GGUF under each switch set. Logs to $OUT.
# Usage: bash engine/gpu/device_mmq.sh
# Env: MMQ_TESTS (pytest -k expression; default all), AB (switch sets, "VAR=v[,VAR2=w]" per run; default: the
#      current defaults, mmq dense, mmq experts, both, fused attention, all three), SESSION=0 (kernels only),
#      *_TIMEOUT.
set -u
source engine/gpu/device_env.sh
mount -o remount,size=120G /dev/shm 2>/dev/null
SYN=
if [ "${SESSION:-1}" != 0 ]; then
  if [ -s /dev/shm/flash-q2.gguf ] && [ -f /dev/shm/flash-q2.ok ]; then
    echo "reusing /dev/shm/flash-q2.gguf" > "$OUT/synth.log"
  else
    ( python3 -m ds4.gguf_tools.quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2 --quiet \
      > "$OUT/synth.log" 2>&1 && touch /dev/shm/flash-q2.ok ) &
    SYN=$!
  fi
fi
stamp build; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
stamp "mmq tests"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -s -p no:cacheprovider -W ignore tests/test_gpu_mmq.py ${MMQ_TESTS:+-k "$MMQ_TESTS"} \
  2>&1 | tee "$OUT/tests_mmq.log" | grep -E "passed|failed|rel err|mmq prefill|Error|assert" | head -20
stamp bench_mmq; timeout ${KBENCH_TIMEOUT:-120} python3 -m ds4.engine.gpu.bench_mmq 2>&1 | grep -v -i warn | tee "$OUT/bench_mmq.log"
stamp bench_attn; timeout ${KBENCH_TIMEOUT:-120} python3 -m ds4.engine.gpu.bench_attn 2>&1 | grep -v -i warn | tee "$OUT/bench_attn.log"
[ "${SESSION:-1}" = 0 ] && { stamp "done (SESSION=0)"; exit 0; }
[ -z "$SYN" ] || wait $SYN; cat "$OUT/synth.log"
AB_DEFAULT="DS4_GPU_PREFILL_ATTN=f32 DS4_GPU_PREFILL_GEMM=mmq DS4_GPU_MOE_GEMM=mmq DS4_GPU_PREFILL_GEMM=mmq,DS4_GPU_MOE_GEMM=mmq \
DS4_GPU_PREFILL_ATTN=fused DS4_GPU_PREFILL_GEMM=mmq,DS4_GPU_MOE_GEMM=mmq,DS4_GPU_PREFILL_ATTN=fused"
for envs in ${AB:-$AB_DEFAULT}; do
  stamp "prefill $envs"; echo "== $envs" >> "$OUT/prefill_ab.log"
  env ${envs//,/ } timeout ${BENCH_TIMEOUT:-90} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx \
    --prefill 2048 8192 --prefill-runs ${PREFILL_RUNS:-2} 2>&1 | tee -a "$OUT/prefill_ab.log" | grep -E "^prefill"
done
stamp done
