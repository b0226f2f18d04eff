#!/usr/bin/env bash
# Nsight Compute sections of single decode kernels at Flash shapes (probe_kernel.py launches them eagerly), all into
# $OUT/ncu.log; a summary of each goes to stdout. Run after a build (device_decode.sh does one).
# Usage: bash engine/gpu/device_ncu.sh [OP:KERNEL_REGEX ...]   default: o_b, q_b and o_a (matvec_stream_kernel) and
#        the routed gate/up (moe_gateup_rows_kernel). Env: NCU_ARGS (extra ncu arguments), NCU_TIMEOUT (per op, 120).
set -u
source engine/gpu/device_env.sh
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
 --section Occupancy --section LaunchStats --section InstructionStats"
for spec in ${*:-o_b:matvec_stream q_b:matvec_stream o_a:matvec_stream gateup:moe_gateup_rows}; do
  op=${spec%%:*} k=${spec#*:}
  stamp "ncu $op ($k)"
  echo "======== $op ($k)" >> "$OUT/ncu.log"
  timeout ${NCU_TIMEOUT:-120} ncu --clock-control none --kernel-name regex:$k --launch-skip 2 --launch-count 1 $SECTIONS \
    --print-details all ${NCU_ARGS:-} $PY -m ds4.engine.gpu.probe_kernel $op 2>&1 | grep -v "^==PROF==" >> "$OUT/ncu.log"
  tail -n 400 "$OUT/ncu.log" | grep -E "^    Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Achieved Occupancy|Registers Per|Grid Size|Stall [A-Z][a-z ]*  " \
    | head -24
done
