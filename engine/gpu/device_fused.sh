#!/usr/bin/env bash
# One device call for the fused CUDA engine: build, fused-kernel tests, session tests, synthetic
# Flash q2 GGUF in /dev/shm, session benchmark (with kernels per token). Logs to $OUT.
# Usage: bash engine/gpu/device_fused.sh [ctx...]
set -u
source engine/gpu/device_env.sh
mount -o remount,size=120G /dev/shm 2>/dev/null
( python3 -m ds4.gguf_tools.quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2 --quiet > "$OUT/synth.log" 2>&1 ) &
SYN=$!
echo "== build $(( $(date +%s) - T0 ))s"; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== fused tests $(( $(date +%s) - T0 ))s"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -W ignore tests/test_gpu_fused.py 2>&1 | tee "$OUT/tests_fused.log" | tail -15
echo "== session tests $(( $(date +%s) - T0 ))s"
timeout ${SESSION_TIMEOUT:-180} python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/test_gpu_session_cuda.py 2>&1 | tee "$OUT/tests.log" | grep -E "rel|greedy|chunked|passed|failed|Error|error" | head -30
wait $SYN; cat "$OUT/synth.log"
echo "== bench $(( $(date +%s) - T0 ))s"
timeout ${BENCH_TIMEOUT:-200} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx ${*:-2048 32768} --decode 64 --prefill 512 --count-kernels --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -12
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/bench.log" 2>&1
echo "== done $(( $(date +%s) - T0 ))s"
