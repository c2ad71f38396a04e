#!/usr/bin/env bash
# The one prepared device run (tools/gpu_check.py says why). The device call:
#   command: bash tools/gpu_check.sh        carry: [".gpu_kit", ".fi_bundle", "pagedkv"]
# Here, on the CPU, without installing anything: OUT=/tmp/out bash tools/gpu_check.sh --dry-run
# Further arguments go to python -m tools.gpu_check (e.g. --only stack_parity,conformance).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--dry-run" ]; then
  shift
  exec .venv/bin/python -m tools.gpu_check --dry-run --out "${OUT:?set OUT to a folder}" "$@"
fi
: "${OUT:?set OUT to a folder (the device call sets it)}"
mkdir -p "$OUT"
# Set-up output goes to the stages' log: only files under $OUT come back. A failed step does
# not stop the run: the environment stage reports GPU_KIT_SETUP, and the stages say the rest.
failed=""
{
  echo "==== setup: wheels into /tmp/site, the FlashInfer bundle"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .gpu_kit/wheels/*.whl || failed+=" wheels"
  # Unpacked outside .fi_bundle, which must stay as small as it travels.
  rm -rf /tmp/fi_pkg && (cd .fi_bundle &&
    { unzip -q flashinfer_trimmed.zip -d /tmp/fi_pkg ||
      python3 -m zipfile -e flashinfer_trimmed.zip /tmp/fi_pkg; } &&
    python3 -m pip install -q --no-index --no-deps ./*.whl) || failed+=" bundle"
} >>"$OUT/stages.log" 2>&1
setup=${failed:+failed:$failed}
setup=${setup:-ok}
echo "==== setup: $setup" >>"$OUT/stages.log"
echo "setup: $setup"
# The kit's grpcio/protobuf shadow the device's: the stubs in pagedkv/ check their versions.
export PYTHONPATH="/tmp/site:$PWD:/tmp/fi_pkg${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_DISABLE_JIT=1 PYTHONUNBUFFERED=1 GPU_KIT_SITE=/tmp/site GPU_KIT_SETUP="$setup"
exec python3 -m tools.gpu_check --out "$OUT" "$@"
