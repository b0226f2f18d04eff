#!/usr/bin/env bash
# One device call that ends a session: build, the switch's own tests, the batch-1 kernel bench, a decode A/B of the
# defaults against candidate switch sets, then the correctness tests and the record run under the fastest at 2k
# (a candidate only where it beats the defaults and the candidates before it by more than PICK_MARGIN ms). Logs to $OUT.
# Usage: PICK="VAR=v[,VAR2=w] [VAR3=u ...]" bash engine/gpu/device_pick.sh
# Env: PICK (required: candidate switch sets, space-separated), PICK_TESTS (tests of the switches, run first),
#      CHECK_TESTS (run under the pick; default the session and decode tests; "" none), KBENCH (kernel bench
#      arguments; "" none; default "--quick"), PICK_MARGIN (0.02 ms), RECORD (bench_session arguments of the record
#      run), *_TIMEOUT.
set -u
source engine/gpu/device_env.sh
start_synth
stamp build; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if [ -n "${PICK_TESTS:-}" ]; then
  stamp "tests $PICK_TESTS"
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -W ignore $PICK_TESTS 2>&1 | tail -15 \
    > "$OUT/pick_tests.log"; tail -3 "$OUT/pick_tests.log"
fi
if [ -n "${KBENCH---quick}" ]; then
  stamp "kernel bench ${KBENCH---quick}"
  timeout ${KBENCH_TIMEOUT:-200} python3 -m ds4.engine.gpu.bench --batch 1 ${KBENCH---quick} --json "$OUT/kbench.json" 2>&1 \
    | grep -v -i warn > "$OUT/kbench.log"; grep -E "copy|layer" "$OUT/kbench.log" | head -4
fi
[ -z "$SYN" ] || wait $SYN; tail -1 "$OUT/synth.log"
ms() { grep -E "^decode @2048" "$1" | sed -E 's/.*: ([0-9.]+) ms.*/\1/'; }
i=0
for envs in - $PICK; do  # the defaults, then each candidate switch set
  [ "$envs" = - ] && envs=""
  stamp "decode ${envs:-defaults}"; log="/tmp/ab_$i.log"; i=$((i + 1))  # one log per run; all in $OUT/ab.log
  echo "== ${envs:-defaults}" > "$log"
  env ${envs//,/ } timeout ${BENCH_TIMEOUT:-150} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf \
    --ctx 2048 8192 --decode 64 --prefill 2>&1 | grep -E "^decode|floor" | tee -a "$log"
  cat "$log" >> "$OUT/ab.log"
done
base=$(ms /tmp/ab_0.log); best=$base; use=""; i=1
for envs in $PICK; do
  t=$(ms "/tmp/ab_$i.log"); i=$((i + 1))
  if [ -n "$t" ] && [ -n "$best" ] && python3 -c "import sys; sys.exit(0 if $t < $best - ${PICK_MARGIN:-0.02} else 1)"; then
    best=$t; use=$envs
  fi
done
echo "picked: ${use:-defaults} ($best ms at 2k; defaults $base ms)" | tee "$OUT/picked.log"
CHECK_TESTS=${CHECK_TESTS-tests/test_gpu_session_cuda.py tests/test_gpu_decode_latency.py}
if [ -n "$CHECK_TESTS" ]; then
  stamp "tests under ${use:-defaults}"
  env ${use//,/ } timeout ${CHECK_TIMEOUT:-400} python3 -m pytest -q -s -p no:cacheprovider -W ignore $CHECK_TESTS 2>&1 \
    | tee "$OUT/tests.log" | grep -E "^tiny|^small|greedy|chunked|passed|failed|Error" | head -30
fi
stamp "record under ${use:-defaults}"
env ${use//,/ } timeout ${RECORD_TIMEOUT:-300} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf \
  ${RECORD:---ctx 2048 8192 32768 --decode 64 --prefill 2048 8192 32768 --prefill-runs 2} --json "$OUT/record.json" \
  2>&1 | tee "$OUT/record.log" | grep -E "^prefill|^decode|floor|copy"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/record.log" 2>&1
rm -f "$OUT/build.log"
stamp done
