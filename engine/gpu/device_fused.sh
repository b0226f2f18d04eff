#!/usr/bin/env bash
# One device call for the fused CUDA engine: build, fused-kernel tests, session tests, synthetic
# Flash q2 GGUF in /dev/shm, session benchmark (with kernels per token). Logs to $OUT.
# Usage: bash engine/gpu/device_fused.sh [ctx...]
set -u
OUT=${OUT:-/tmp/ds4-out}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 - <<'PYEOF'
import os, tomllib
root = os.getcwd()
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
pkg = "/tmp/site/ds4"
os.makedirs(pkg, exist_ok=True)
for f in os.listdir(os.path.join(root, dirs["ds4"])):
    if f.endswith(".py") and not os.path.exists(os.path.join(pkg, f)):
        os.symlink(os.path.join(root, dirs["ds4"], f), os.path.join(pkg, f))
for name, d in dirs.items():
    parts = name.split(".")
    if len(parts) == 2 and not os.path.exists(os.path.join(pkg, parts[1])):
        os.symlink(os.path.join(root, d), os.path.join(pkg, parts[1]))
PYEOF
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
