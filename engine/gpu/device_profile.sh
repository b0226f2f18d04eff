#!/usr/bin/env bash
# One device call that profiles the CUDA engine: build, synthetic Flash q2 GGUF in /dev/shm, one
# decode benchmark with the kernels of one eager step (chrome trace: order, grids, durations) and
# Nsight Compute sections of the routed-MoE and matvec kernels at Flash shapes. Logs to $OUT.
# Usage: bash engine/gpu/device_profile.sh [ctx...]
set -u
source engine/gpu/device_env.sh
mount -o remount,size=120G /dev/shm 2>/dev/null
( python3 -m ds4.gguf_tools.quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2 --jobs 8 --quiet > "$OUT/synth.log" 2>&1 ) &
SYN=$!
stamp build; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
stamp ncu
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for k in moe_gateup_kernel moe_down_kernel; do
  timeout 100 ncu --clock-control none --kernel-name regex:$k --launch-skip 2 --launch-count 1 $SECTIONS \
    python3 -m ds4.speed_bench.gpu_kernels --batch 1 --quick > "$OUT/ncu_$k.log" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Issue Slots|No Eligible|Stall|Registers|Grid Size|Block Size" "$OUT/ncu_$k.log" | head -20
done
wait $SYN; cat "$OUT/synth.log"
stamp bench
timeout ${BENCH_TIMEOUT:-200} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx ${*:-2048} --decode 32 --prefill 512 \
  --count-kernels --trace "$OUT/trace.json" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v Warn | tail -40
gzip -f "$OUT/trace.json" 2>/dev/null
stamp done
