#!/usr/bin/env bash
# One device call for the fused CUDA engine: build, fused-kernel tests, session tests, synthetic
# Flash q2 GGUF in /dev/shm, session benchmark (with kernels per token). Logs to $OUT.
# Usage: bash engine/gpu/device_fused.sh [ctx...]
# Env: KERNEL_TESTS, SESSION_TESTS (none: skip), BENCH=0 (tests only; the synthetic GGUF stays in /dev/shm for the
#      next call while the machine is warm), PREFILL (prefill lengths), PREFILL_CHUNK, PROFILE_PREFILL (tokens: kernels of one prefill),
#      PREFILL_RUNS (timed prefills per length), GAPS (tokens: where one prefill leaves the device idle, by section),
#      PREFILL_AB (prefill GEMM modes to compare), MV_AB (batch-1 Q8_0 kernels to compare),
#      ENV_AB (runs with other kernel switches, e.g. "DS4_GPU_HC_ONE=0 DS4_GPU_PDL=0": decode at AB_CTX, default
#      2048, and prefill of AB_PREFILL tokens, default none; AB_COUNT=regex: kernels of one step matching it;
#      every run's whole output goes to env_ab.log), *_TIMEOUT (KERNEL_TIMEOUT: the kernel tests, default 150 s).
set -u
source engine/gpu/device_env.sh
start_synth
echo "== build $(( $(date +%s) - T0 ))s"; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== fused tests $(( $(date +%s) - T0 ))s"
[ "${KERNEL_TESTS:-}" = none ] || timeout ${KERNEL_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -W ignore ${KERNEL_TESTS:-tests/test_gpu_prefill.py tests/test_gpu_fused.py tests/test_gpu_kernels.py} 2>&1 | tee "$OUT/tests_fused.log" | grep -E "passed|failed|Error|assert" | head -30
echo "== session tests $(( $(date +%s) - T0 ))s"
[ "${SESSION_TESTS:-}" = none ] || timeout ${SESSION_TIMEOUT:-180} python3 -m pytest -q -s -p no:cacheprovider -W ignore ${SESSION_TESTS:-tests/test_gpu_session_cuda.py} 2>&1 | tee "$OUT/tests.log" | grep -E "rel|greedy|chunked|passed|failed|Error|error" | head -30
[ -z "$SYN" ] || wait $SYN; cat "$OUT/synth.log"
[ "${BENCH:-1}" = 0 ] && { stamp "done (BENCH=0: no benchmark)"; exit 0; }
echo "== bench $(( $(date +%s) - T0 ))s"
timeout ${BENCH_TIMEOUT:-200} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx ${*:-2048 32768} --decode 64 --prefill ${PREFILL:-512} --prefill-chunk ${PREFILL_CHUNK:-8192} --prefill-runs ${PREFILL_RUNS:-1} --profile-prefill ${PROFILE_PREFILL:-0} --gaps ${GAPS:-0} --gaps-trace "$OUT/gaps.json.gz" --count-kernels --trace "$OUT/trace.json" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | tail -${BENCH_TAIL:-24}
gzip -f "$OUT/trace.json" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/bench.log" 2>&1
for mv in ${MV_AB:-}; do  # A/B of the batch-1 Q8_0 matvec kernels: kernel table and the session at 2k
  stamp "mv=$mv"
  DS4_GPU_MV=$mv timeout 120 python3 -m ds4.speed_bench.gpu_kernels --batch 1 --quick --json "$OUT/kernels_mv$mv.json" 2>&1 | grep -v -i warn > "$OUT/kernels_mv$mv.log"
  grep -E "attn_q_b|attn_output|ffn_gate_shexp|attn_q_a|head|layer" "$OUT/kernels_mv$mv.log" | head -12
  DS4_GPU_MV=$mv timeout 150 python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx 2048 --decode 64 --prefill \
    --json "$OUT/bench_mv$mv.json" 2>&1 | grep -E "decode|floor"
done
for envs in ${ENV_AB:-}; do  # A/B of switches read by the kernels: "VAR=v[,VAR2=w]" per run, decode at 2k + prefill
  stamp "env $envs"; echo "== env $envs" >> "$OUT/env_ab.log"
  env ${envs//,/ } timeout 150 python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx ${AB_CTX:-2048} --decode 64 \
    --prefill ${AB_PREFILL:-} --prefill-chunk ${PREFILL_CHUNK:-8192} --prefill-runs ${PREFILL_RUNS:-1} ${AB_COUNT:+--count-kernels} 2>&1 | tee -a "$OUT/env_ab.log" \
    | grep -E "prefill|decode|summed|${AB_COUNT:-^$}"
done
for mode in ${PREFILL_AB:-}; do  # prefill GEMM precision modes (weights.py): exact (hi/lo) or f16
  stamp "prefill gemm=$mode"
  DS4_GPU_PREFILL_GEMM=$mode timeout 150 python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx --prefill ${PREFILL:-512} \
    --prefill-chunk ${PREFILL_CHUNK:-8192} --json "$OUT/bench_prefill_$mode.json" 2>&1 | grep -E "prefill|floor"
done
echo "== done $(( $(date +%s) - T0 ))s"
