# Sourced (from the repository root) by the device scripts: engine/gpu/device_*.sh and
# engine/dist/device_dist.sh. Sets OUT, PY, T0, stamp() and start_synth(); installs the carried wheels (.whl/,
# when present) and makes the working tree importable as `ds4` for the image's python3.
OUT=${OUT:-/tmp/ds4-out}
SITE=${DS4_SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE
T0=$(date +%s)
stamp() { echo "== $* $(( $(date +%s) - T0 ))s"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
$PY engine/gpu/device_site.py "$SITE"

# start_synth: writes the synthetic Flash q2 GGUF to /dev/shm/flash-q2.gguf in the background (SYN: its pid; empty
# when a warm machine kept the last call's file, marked complete by flash-q2.ok, which holds its layer count). Its log
# is $OUT/synth.log. FLASH_LAYERS=N: only Flash's first N layers (20 fit an 80 GB H100 with room for a 32k session).
start_synth() {
  mount -o remount,size=120G /dev/shm 2>/dev/null
  SYN=
  local want=${FLASH_LAYERS:-43}
  if [ -s /dev/shm/flash-q2.gguf ] && [ "$(cat /dev/shm/flash-q2.ok 2>/dev/null)" = "$want" ]; then
    echo "reusing /dev/shm/flash-q2.gguf ($want layers)" > "$OUT/synth.log"
  else
    rm -f /dev/shm/flash-q2.ok
    ( $PY -m ds4.gguf_tools.quantize synth --preset flash --layers "$want" --gguf /dev/shm/flash-q2.gguf --mix q2 --jobs 8 \
      --quiet --overwrite > "$OUT/synth.log" 2>&1 && echo "$want" > /dev/shm/flash-q2.ok ) &
    SYN=$!
  fi
}
