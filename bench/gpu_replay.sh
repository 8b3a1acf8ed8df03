#!/usr/bin/env bash
# One device call for the main job on the H200: kvtier replay with the numba and torch
# backends at full DeepSeek V4 page geometry (byte scale 1) and a reduced layer count,
# recording measured against modeled transfer time. Needs .whl/ carried (kvtier +
# transitions, six, graphviz wheels for Python 3.12). Everything lands in $OUT.
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
  for backend in numba torch; do
    name="replay_$backend"; [ "$i" -gt 1 ] && name="replay_${backend}_r$i"
    echo "== replay --backend $backend (run $i)"
    /usr/bin/time -v timeout 240 python3 -m kvtier replay --backend "$backend" --byte-scale 1 --layers "$LAYERS" \
      --limit "$LIMIT" --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "exit $?"; grep -E "Error|Mismatch|Elapsed" "$OUT/$name.err" | tail -n 3
  done
done
