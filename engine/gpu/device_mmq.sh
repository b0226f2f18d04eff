#!/usr/bin/env bash
# One device call for the int8 prefill products (mmq.cu) and the one-kernel prefill attention: build, the mmq GPU
# tests and bench_mmq (peer: dequant + three float16 GEMMs) at each tile size, Nsight Compute sections of one mmq
# launch, the session tests under a switch set, then prefill of 2048 and 8192 tokens on the synthetic Flash q2 GGUF
# under each switch set. Logs to $OUT.
# Usage: bash engine/gpu/device_mmq.sh
# Env: MMQ_TESTS (pytest -k expression; default all), ROWS (DS4_GPU_MMQ_ROWS values; default "64 128"; the first runs
#      every test, the others the kernel tests), NCU ("bench_mmq launch indices" to profile, 2 per shape in SHAPES
#      order; default "6": the IQ2_XXS expert gate; "" for none; NCU_KERNEL: the kernel, default mmq_kernel, or
#      mmf_kernel: 3 launches per expert shape, 0 = the IQ2_XXS gate, 3 = the Q2_K down; NCU_BENCH: the profiled
#      program, default bench_mmq, or bench_attn), SESSION_ENV ("VAR=v,..."
#      for the session tests;
#      default none: no session tests), AB (switch sets, "VAR=v[,VAR2=w]" per run; unset: the v11 A/B sets, "": none), SESSION=0 (kernels only),
#      BENCH_ATTN=1 (bench_attn too), TESTS (more GPU test files, run once under the defaults), RECORD (bench_session
#      arguments of one last run under the defaults, e.g. "--ctx 2048 --decode 64 --prefill 32768"), BENCH_BARRIER=1
#      (bench_barrier: grid-wide barriers against a graph-launched kernel), *_TIMEOUT.
set -u
source engine/gpu/device_env.sh
SYN=
[ "${SESSION:-1}" != 0 ] && start_synth
stamp build; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
first=1
for rows in ${ROWS:-64 128}; do
  stamp "mmq tests rows=$rows"
  k=${MMQ_TESTS:-}; [ $first = 1 ] || k=${k:-"not session"}
  DS4_GPU_MMQ_ROWS=$rows timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -s -p no:cacheprovider -W ignore tests/test_gpu_mmq.py ${k:+-k "$k"} \
    2>&1 | tee "$OUT/tests_mmq_$rows.log" | grep -E "passed|failed|rel err|mmq prefill|Error|assert" | head -20
  stamp "bench_mmq rows=$rows"
  DS4_GPU_MMQ_ROWS=$rows timeout ${KBENCH_TIMEOUT:-120} python3 -m ds4.engine.gpu.bench_mmq 2>&1 | grep -v -i warn | tee "$OUT/bench_mmq_$rows.log"
  first=0
done
if [ -n "${TESTS:-}" ]; then
  stamp "tests $TESTS"
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider -W ignore $TESTS 2>&1 | tee "$OUT/tests_more.log" \
    | grep -E "^tiny|^small|greedy|chunked|passed|failed|Error|error" | head -30
fi
[ "${BENCH_BARRIER:-0}" = 1 ] && { stamp bench_barrier; timeout 60 python3 -m ds4.engine.gpu.bench_barrier 2>&1 | grep -v -i warn | tee "$OUT/bench_barrier.log"; }
[ "${BENCH_ATTN:-0}" = 1 ] && { stamp bench_attn; timeout ${KBENCH_TIMEOUT:-120} python3 -m ds4.engine.gpu.bench_attn 2>&1 | grep -v -i warn | tee "$OUT/bench_attn.log"; }
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats --section LaunchStats"
for skip in ${NCU-6}; do
  kern=${NCU_KERNEL:-mmq_kernel}
  stamp "ncu $kern launch $skip"
  # NCU_BENCH: the program whose launch is profiled (bench_mmq, or bench_attn with NCU_KERNEL=prefill_attn_kernel:
  # launch 0 = the top-k layer); --print-details all adds the warp stall reasons to WarpStateStats
  timeout ${NCU_TIMEOUT:-100} ncu --clock-control none --kernel-name regex:$kern --launch-skip $skip --launch-count 1 $SECTIONS \
    --print-details all python3 -m ds4.engine.gpu.${NCU_BENCH:-bench_mmq} --reps 1 > "$OUT/ncu_${kern}_$skip.log" 2>&1
  grep -E "$kern|Duration|Compute \(SM\)|Issue Slots|Issued Ipc|No Eligible|Eligible Warps|Active Warps|Warp Cycles Per Issued|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Executed Instructions  |Stall|stall" "$OUT/ncu_${kern}_$skip.log" | head -40
done
[ "${SESSION:-1}" = 0 ] && { stamp "done (SESSION=0)"; exit 0; }
if [ -n "${SESSION_ENV:-}" ]; then
  stamp "session tests $SESSION_ENV"
  env ${SESSION_ENV//,/ } timeout ${SESSION_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/test_gpu_session_cuda.py \
    2>&1 | tee "$OUT/tests_session.log" | grep -E "rel|greedy|chunked|passed|failed|Error|error" | head -30
fi
[ -z "$SYN" ] || wait $SYN; cat "$OUT/synth.log"
AB_DEFAULT="DS4_GPU_PREFILL_GEMM=exact DS4_GPU_MOE_GEMM=buckets,DS4_GPU_PREFILL_ATTN=f32 DS4_GPU_MMQ_ROWS=128 \
DS4_GPU_PREFILL_GEMM=mmq"
for envs in ${AB-$AB_DEFAULT}; do
  stamp "prefill $envs"; echo "== $envs" >> "$OUT/prefill_ab.log"
  env ${envs//,/ } timeout ${BENCH_TIMEOUT:-90} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx \
    --prefill 2048 8192 --prefill-runs ${PREFILL_RUNS:-2} 2>&1 | tee -a "$OUT/prefill_ab.log" | grep -E "^prefill"
done
if [ -n "${RECORD:-}" ]; then
  stamp "record $RECORD"
  timeout ${BENCH_TIMEOUT:-150} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf $RECORD --json "$OUT/record.json" 2>&1 \
    | tee "$OUT/record.log" | grep -E "^prefill|^decode|floor|copy"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/record.log" 2>&1
fi
stamp done
