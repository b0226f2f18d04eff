# Sourced (from the repository root) by the device scripts: engine/gpu/device_*.sh and
# engine/dist/device_dist.sh. Sets OUT, PY, T0 and stamp(); installs the carried wheels (.whl/,
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
