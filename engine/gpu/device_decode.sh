#!/usr/bin/env bash
# One device call for decode work: build, GPU tests, a CUPTI trace of graph-replayed decode steps (decode_trace), and
# decode A/B runs of bench_session on the synthetic Flash q2 GGUF. Logs to $OUT (at most ~8 files come back).
# Usage: bash engine/gpu/device_decode.sh
# Env: TESTS (pytest files/args; default the v16 decode tests; "" none), TRACE (decode_trace contexts, default "2048";
#      "" none), TRACE_SETS (switch sets of the traces, "-" = the defaults; default "-"), TRACE_STEPS, TRACE_ARGS, AB (switch sets, "VAR=v[,VAR2=w]" per run, "-" = the defaults; default
#      "- DS4_GPU_ARGMAX=0,DS4_GPU_EARLY_XQ=0,DS4_GPU_COMPRESS_REGS=0"), CTX (decode contexts
#      of the A/B runs, default "2048 8192"), AB_ARGS (bench_session arguments of the A/B runs instead of CTX and DECODE,
#      e.g. "--ctx 2048 --decode 64 --prefill 8192"), KBENCH (when set: the batch-1 kernel bench with these extra arguments,
#      e.g. "--quick", before the A/B runs), NCU (device_ncu.sh specs, under the switches NCU_ENV "A=1,B=2"), DECODE (tokens, default 64), RECORD (bench_session arguments of one last
#      run under the defaults), *_TIMEOUT.
set -u
source engine/gpu/device_env.sh
start_synth
stamp build; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
TESTS=${TESTS-tests/test_gpu_decode_latency.py}
if [ -n "$TESTS" ]; then
  stamp "tests $TESTS"
  timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -s -p no:cacheprovider -W ignore $TESTS 2>&1 | tee "$OUT/tests.log" \
    | grep -E "^tiny|^small|greedy|chunked|passed|failed|Error|error" | head -30
fi
if [ -n "${NCU:-}" ]; then  # Nsight Compute of single kernels (device_ncu.sh OP:KERNEL_REGEX ...; NCU_ENV: switches)
  ne=${NCU_ENV:-}; env ${ne//,/ } bash engine/gpu/device_ncu.sh $NCU
fi
if [ -n "${KBENCH:-}" ]; then  # the kernel bench (batch 1) while the GGUF is written
  stamp "kernel bench $KBENCH"
  timeout ${KBENCH_TIMEOUT:-200} python3 -m ds4.engine.gpu.bench --batch 1 $KBENCH --json "$OUT/kbench.json" 2>&1 \
    | grep -v -i warn | tee "$OUT/kbench.log" | grep -E "o_a|o_b|shexp|attn_q|layer"
fi
[ -z "$SYN" ] || wait $SYN; tail -1 "$OUT/synth.log"
i=0
for envs in ${TRACE_SETS:--}; do
  [ "$envs" = - ] && envs=""
  for ctx in ${TRACE-2048}; do
    i=$((i + 1))
    stamp "trace $ctx ${envs:-defaults}"
    env ${envs//,/ } timeout ${TRACE_TIMEOUT:-150} python3 -m ds4.engine.gpu.decode_trace /dev/shm/flash-q2.gguf \
      --ctx $ctx --steps ${TRACE_STEPS:-8} ${TRACE_ARGS:-} 2>&1 | grep -v -i warn > "$OUT/trace_$i.log"
    echo "== ${envs:-defaults}" >> "$OUT/trace_$i.log"
    head -${TRACE_HEAD:-3} "$OUT/trace_$i.log"
  done
done
for envs in ${AB-- DS4_GPU_ARGMAX=0,DS4_GPU_EARLY_XQ=0,DS4_GPU_COMPRESS_REGS=0}; do
  [ "$envs" = - ] && envs=""
  stamp "decode ${envs:-defaults}"; echo "== ${envs:-defaults}" >> "$OUT/decode_ab.log"
  env ${envs//,/ } timeout ${BENCH_TIMEOUT:-150} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf \
    ${AB_ARGS:---ctx ${CTX:-2048 8192} --decode ${DECODE:-64} --prefill} 2>&1 | tee -a "$OUT/decode_ab.log" \
    | grep -E "^decode|^prefill|floor"
done
if [ -n "${RECORD:-}" ]; then
  stamp "record $RECORD"
  timeout ${RECORD_TIMEOUT:-300} python3 -m ds4.engine.gpu.bench_session /dev/shm/flash-q2.gguf $RECORD \
    --json "$OUT/record.json" 2>&1 | tee "$OUT/record.log" | grep -E "^prefill|^decode|floor|copy"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/record.log" 2>&1
fi
rm -f "$OUT/build.log"
stamp done
