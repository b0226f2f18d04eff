#!/usr/bin/env bash
# The multi-GPU runs owed by issue 12 (engine/dist/README.md), one device call each. Logs to $OUT.
#   bash engine/dist/device_dist.sh flash   # nvidia-h200-x4 (x2 runs the 1- and 2-GPU half): Flash q2
#   bash engine/dist/device_dist.sh pro     # nvidia-h200-x4: PRO q2, 2k and 8k, on 4 GPUs
#   bash engine/dist/device_dist.sh comm    # any multi-GPU kind: NCCL combine strategies only (seconds)
set -u
WHAT=${1:-flash}
source engine/gpu/device_env.sh
export NCCL_NVLS_ENABLE=0
NG=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
stamp "build ($NG GPUs)"; python3 engine/gpu/build.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
DIST="python3 -m ds4.engine.dist.launch"

if [ "$WHAT" = comm ] || [ "$WHAT" = flash ]; then
  stamp "NCCL combine strategies"
  timeout 120 $DIST --device cuda --nproc "$NG" --bench-comm --iters 50 --json "$OUT/comm-$NG.json" 2>&1 | tee "$OUT/comm-$NG.txt"
  [ "$NG" -ge 4 ] && timeout 120 $DIST --device cuda --nproc 2 --bench-comm --iters 50 --json "$OUT/comm-2.json" 2>&1 | tee "$OUT/comm-2.txt"
fi

if [ "$WHAT" = flash ]; then
  mount -o remount,size=120G /dev/shm 2>/dev/null; df -h /dev/shm | tail -1
  stamp "flash synth"
  python3 -m ds4.gguf_tools.quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2 \
      --split-max-size 8G --jobs 12 --quiet 2>&1 | tee "$OUT/synth.log"
  F=$(ls /dev/shm/flash-q2-00001-of-*.gguf)
  stamp "equality: N GPUs vs the one-GPU engine (small q2 and Flash)"
  DS4_DIST_FLASH=$F timeout 420 python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/test_dist_cuda.py \
      2>&1 | tee "$OUT/tests.log" | grep -E "GPUs|passed|failed|Error" | head -40
  for P in 2048 8192; do
    for n in 1 2 4; do
      [ "$n" -le "$NG" ] || continue
      stamp "flash bench: $n GPUs, prompt $P"
      timeout 300 $DIST -m "$F" --device cuda --nproc "$n" --bench --prompt-tokens "$P" -n 64 --ctx $((P + 512)) \
          --json "$OUT/flash-$n-$P.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/bench.log"
    done
  done
fi

if [ "$WHAT" = pro ]; then
  # 433 GiB of weights: /dev/shm must hold them (the x4 host has 512 GiB); each rank maps its share
  mount -o remount,size=470G /dev/shm 2>/dev/null; df -h /dev/shm | tail -1
  stamp "pro synth"
  python3 -m ds4.gguf_tools.quantize synth --preset pro --gguf /dev/shm/pro-q2.gguf --mix q2 \
      --split-max-size 16G --jobs 24 --quiet 2>&1 | tee "$OUT/synth.log"
  F=$(ls /dev/shm/pro-q2-00001-of-*.gguf)
  for P in 2048 8192; do
    stamp "pro bench: 4 GPUs, prompt $P"
    timeout 500 $DIST -m "$F" --device cuda --nproc 4 --bench --prompt-tokens "$P" -n 32 --ctx $((P + 512)) \
        --json "$OUT/pro-4-$P.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/bench.log"
  done
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >> "$OUT/bench.log" 2>&1
stamp done
