#!/usr/bin/env bash
# One device call with its results bundled into one file: bench/gpu_session.sh (STEPS,
# its T_* timeouts) writes into a scratch folder, which is packed into $OUT/results.tgz
# every 15 s and at the end (the device tool returns at most 8 files, and a call cut
# short at its limit still returns what it had). With HOSTAB set, then the host work of
# a serving flush (bench/transfer_host.py, CPU pools under the simulator) of the kvtier
# wheel in .whl/old/ and of the one in .whl/, back to back on the same host.
#   COMMIT=<sha> STEPS="serving tests replay e2e" HOSTAB=1 bash bench/gpu_call.sh
set -uo pipefail
DEST=${OUT:-/tmp/kvtier-out}
WORK=/tmp/kvtier-run
rm -rf "$WORK" && mkdir -p "$WORK" "$DEST"
pack() { tar -C "$WORK" -czf "$DEST/partial.tgz" . 2>/dev/null && mv "$DEST/partial.tgz" "$DEST/results.tgz"; }
( while sleep 15; do pack; done ) &
PACKER=$!
OUT="$WORK" bash bench/gpu_session.sh 2>&1 | tee "$WORK/session.log"
if [ -n "${HOSTAB:-}" ] && ls .whl/old/*.whl >/dev/null 2>&1; then
  echo "== host work per serving flush (old wheel, then this one)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_old .whl/old/*.whl
  for side in old new; do
    path=/tmp/site; [ "$side" = old ] && path=/tmp/site_old:/tmp/site
    PYTHONPATH=$path timeout "${T_HOSTAB:-60}" python3 bench/transfer_host.py --reps "${HOSTAB_REPS:-10}" \
      --configs "4 KiB,DeepSeek V4 mix,1 KiB" --json "$WORK/hostcpu-$side.json" 2>&1 | grep -v "^WARNING" \
      | tee "$WORK/hostcpu-$side.log"
  done
fi
kill "$PACKER" 2>/dev/null
pack
ls -la "$DEST"
