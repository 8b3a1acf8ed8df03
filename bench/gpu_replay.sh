#!/usr/bin/env bash
# One device call for the main job on the H200: kvtier replay with the given transfer
# backends (BACKENDS, default "hybrid numba"; also "torch") at full DeepSeek V4 page
# geometry (byte scale 1) and a reduced layer count, recording measured against modeled
# transfer time. "hybrid" runs through bench/replay_backend.py (the replay command line
# does not list it yet; "hybrid:page" runs it with a page-major host pool, the staging
# path). Needs .whl/ carried (kvtier + transitions, six, graphviz wheels
# for Python 3.12). Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-300}
LAYERS=${LAYERS:-8}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/replay_nvidia_smi.txt" 2>&1
REPEAT=${REPEAT:-1}  # repeated runs catch ordering races between streams (every page is fingerprint-checked)
for i in $(seq 1 "$REPEAT"); do
  for backend in ${BACKENDS:-hybrid numba}; do
    name="replay_${backend//:/-}"; [ "$i" -gt 1 ] && name="replay_${backend//:/-}_r$i"
    echo "== replay --backend $backend (run $i)"
    if [ "${backend%%:*}" = hybrid ]; then run=(python3 bench/replay_backend.py "$backend"); else
      run=(python3 -m kvtier replay --backend "$backend"); fi
    /usr/bin/time -v timeout "${REPLAY_TIMEOUT:-240}" "${run[@]}" --byte-scale 1 --layers "$LAYERS" \
      --limit "$LIMIT" --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "exit $?"; grep -E "Error|Mismatch|Elapsed" "$OUT/$name.err" | tail -n 3
  done
done
