#!/usr/bin/env bash
# One device call for the CUDA engine: build, smoke, session tests, synthetic Flash q2 GGUF in
# /dev/shm, session benchmark. Logs to $OUT. Usage: bash engine/gpu/device_session.sh [ctx...]
set -u
source engine/gpu/device_env.sh
echo "== build $(( $(date +%s) - T0 ))s"; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== flash synth (background) $(( $(date +%s) - T0 ))s"
df -h /dev/shm | tail -1; mount -o remount,size=120G /dev/shm 2>/dev/null; df -h /dev/shm | tail -1
( python3 -m ds4.gguf_tools.quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2 --jobs 8 --quiet > "$OUT/synth.log" 2>&1 ) &
SYN=$!
echo "== tests $(( $(date +%s) - T0 ))s"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/test_gpu_session_cuda.py 2>&1 | tee "$OUT/tests.log" | grep -E "rel|greedy|passed|failed|Error|error" | head -40
wait $SYN; cat "$OUT/synth.log"
echo "== bench $(( $(date +%s) - T0 ))s"
timeout 250 python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf --ctx ${*:-2048 8192} --decode 64 --prefill 512 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/bench.log" 2>&1
echo "== done $(( $(date +%s) - T0 ))s"
