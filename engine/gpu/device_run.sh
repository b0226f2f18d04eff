#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool): make ds4 importable by the image's python3
# without installing it, build the extension, run the GPU tests and the kernel benchmark.
# Logs go to $OUT (build.log, tests.log, bench.log, bench.json). Usage: bash engine/gpu/device_run.sh [bench args]
set -u
source engine/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
echo "== build" && $PY engine/gpu/build.py --ptxas-info > "$OUT/build.log" 2>&1; rc=$?; tail -3 "$OUT/build.log"
[ $rc -ne 0 ] && { grep -m20 -i error "$OUT/build.log"; exit 1; }
echo "== smoke" && CUDA_LAUNCH_BLOCKING=1 $PY -X faulthandler -m ds4.engine.gpu.smoke 2>&1 | tee "$OUT/smoke.log" | tail -12
if ! grep -q "Q8_0 rel err" "$OUT/smoke.log"; then
  echo "== smoke failed: native backtrace" && CUDA_LAUNCH_BLOCKING=1 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" \
    --args $PY -m ds4.engine.gpu.smoke > "$OUT/gdb.log" 2>&1; grep -E -A25 "SIGSEGV|signal" "$OUT/gdb.log" | head -40
  g++ --version | head -1; gcc --version | head -1; echo "CXX=${CXX:-} CC=${CC:-}"; which -a g++ gcc; exit 1
fi
echo "== tests" && $PY -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_build.py 2>&1 | tee "$OUT/tests.log" | tail -25
echo "== bench" && $PY -m ds4.speed_bench.gpu_kernels --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
