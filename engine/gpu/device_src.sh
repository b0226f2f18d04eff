#!/usr/bin/env bash
# One device call: Nsight Compute's source view (sampled stalls per SASS instruction, summarized by ncu_source.py) of
# the prefill attention's session launches (a ratio-128 layer with the split output and with float32 rows, a top-k
# layer) and of mmq's routed gate and down (bench_mmq --experts, the defaults). CSVs to $OUT.
# Usage: bash engine/gpu/device_src.sh    Env: TOP (instructions listed per kernel, 25), NCU_TIMEOUT (150),
#   DECODE="q_b:matvec_stream gateup:moe_gateup ..." (instead: decode kernels launched by probe_kernel OP, the kernel
#   regex after the colon; v41's question: how many of their samples are "no instruction" stalls, their code being
#   77-146 KB of mostly straight-line SASS run once per launch); NCU_ARGS: more ncu options (e.g. --cache-control none,
#   so the instruction caches are not flushed before the profiled launch)
set -u
source engine/gpu/device_env.sh
stamp build; $PY engine/gpu/build.py --jobs 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
SRC="--section SourceCounters --page source --csv --print-source sass"
prof() {  # name kernel-regex launch-skip program...
  local name=$1 k=$2 skip=$3; shift 3
  stamp "ncu $name"
  timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none ${NCU_ARGS:-} --kernel-name "regex:$k" --launch-skip "$skip" --launch-count 1 \
    $SRC "$@" > "$OUT/$name.csv" 2> "$OUT/$name.err" || tail -3 "$OUT/$name.err"
  $PY -m ds4.engine.gpu.ncu_source "$OUT/$name.csv" --top "${TOP:-25}"
}
if [ -n "${DECODE:-}" ]; then
  for spec in $DECODE; do prof "decode_${spec%%:*}" "${spec#*:}" 2 $PY -m ds4.engine.gpu.probe_kernel "${spec%%:*}"; done
  stamp done; exit 0
fi
stamp bench_attn; timeout 90 $PY -m ds4.engine.gpu.bench_attn 2>&1 | grep 'form 3,'
for v in "128 split" "128 float" "4 split"; do
  set -- $v
  prof "attn_$1_$2" prefill_attn_bf16 1 $PY -m ds4.engine.gpu.bench_attn --tokens 2048 --session-launches 2 \
    --session-ratio "$1" --session-output "$2"
done
prof mmq_down mmq_kernel 11 $PY -m ds4.engine.gpu.bench_mmq --experts --tokens 6144 --reps 1
prof mmq_gate mmq_kernel 9 $PY -m ds4.engine.gpu.bench_mmq --experts --tokens 6144 --reps 1
stamp done
