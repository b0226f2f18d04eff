#!/usr/bin/env bash
# One device call that measures a kernel change against its baseline in the same call: build the working tree, the
# named GPU tests, a bench command, ds4-bench once in full (the record), then ds4-bench in turn with the baseline's
# files (.base/*, copied over engine/gpu/ and rebuilt) and the new ones (.base/new/*). Carry .whl and .base.
#   TESTS="tests/test_gpu_prefill_attn.py" KBENCH="python3 -m ds4.engine.gpu.bench_attn" bash engine/gpu/device_ab_files.sh
# Env: AB_CTX (the A/B runs' --ctx-max, 8192), ROUNDS (A/B pairs, 1), GEN (64), RECORD=0 (no full run).
# BUILD_AB="DS4_GPU_L2_EVICT_FIRST=0 DS4_GPU_L2_EVICT_FIRST=1": the variants are build switches (build.py's
#   environment; a change rebuilds everything, ~40 s) instead of file sets; no .base needed. TESTS, KBENCH and the
#   record run first, on the build the call's own environment makes (export a switch before the call to test it).
#   AB_KBENCH="python3 -m ds4.engine.gpu.bench --batch 1 --quick": also run for each variant (its last lines).
set -u
source engine/gpu/device_env.sh
start_synth
stamp build; $PY engine/gpu/build.py --jobs 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if [ -n "${TESTS:-}" ]; then
  stamp tests; timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider -W ignore $TESTS 2>&1 | tee "$OUT/tests.log" | tail -4
fi
if [ -n "${KBENCH:-}" ]; then stamp kbench; timeout 120 $KBENCH 2>&1 | grep -vi warn | tail -${KBENCH_LINES:-12}; fi
[ -n "$SYN" ] && wait "$SYN"; tail -1 "$OUT/synth.log"
bench() {  # label ctx_max
  stamp "ds4-bench $1 (ctx-max $2)"
  timeout 240 $PY -m ds4.speed_bench.cli -m /dev/shm/flash-q2.gguf --backend cuda --ctx-start 2048 --ctx-max "$2" \
    --step-mul 4 --gen-tokens "${GEN:-64}" --prompt-file .whl/promessi_sposi.txt --csv "$OUT/bench_$1.csv" > "$OUT/bench_$1.log" 2>&1
  grep -v '^#' "$OUT/bench_$1.csv" 2>/dev/null | sed "s/^/$1 /" || tail -5 "$OUT/bench_$1.log"
  grep -iE 'floor|memory|copy|gpu_device|evict' "$OUT/bench_$1.csv" | head -6
}
[ "${RECORD:-1}" = 1 ] && bench record 32768
swap() { cp "$1"/*.cu* engine/gpu/ && $PY engine/gpu/build.py --jobs 16 > "$OUT/build_$2.log" 2>&1 || tail -20 "$OUT/build_$2.log"; }
variant() {  # label: after the build, the kernel bench's last lines (AB_KBENCH) and ds4-bench
  if [ -n "${AB_KBENCH:-}" ]; then stamp "kbench $1"; timeout 120 $AB_KBENCH 2>&1 | grep -vi warn | tail -${KBENCH_LINES:-12} | sed "s/^/$1 /"; fi
  bench "$1" "${AB_CTX:-8192}"
}
for r in $(seq "${ROUNDS:-1}"); do
  if [ -n "${BUILD_AB:-}" ]; then
    for v in $BUILD_AB; do
      local_label=$(echo "${v#DS4_GPU_}" | tr 'A-Z=' 'a-z_')  # DS4_GPU_L2_EVICT_FIRST=1 -> l2_evict_first_1
      stamp "build $v"; env "$v" $PY engine/gpu/build.py --jobs 16 > "$OUT/build_$local_label.log" 2>&1 ||
        tail -20 "$OUT/build_$local_label.log"
      variant "${local_label}_r$r"
    done
  else
    swap .base base; variant "base$r"
    swap .base/new new; variant "new$r"
  fi
done
stamp done
