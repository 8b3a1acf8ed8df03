#!/usr/bin/env bash
# One device call for the transfer engine (H200): GPU tests, compute-sanitizer, benchmark.
# Needs .whl/ carried (kvtier + transitions, six, graphviz wheels for Python 3.12), and
# COMMIT set to the commit under test. Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NUMBA_DISABLE_PERFORMANCE_WARNINGS=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/nvidia_smi.txt" 2>&1
cat "$OUT/nvidia_smi.txt"
echo "== gpu tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/transfer/test_transfer_gpu.py \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; tail -n 25 "$OUT/gpu_tests.log"
echo "== compute-sanitizer"
timeout 140 compute-sanitizer --tool memcheck --report-api-errors no --leak-check no --target-processes all \
  python3 bench/transfer.py --sanitize > "$OUT/sanitizer.log" 2>&1
echo "sanitizer exit $?" | tee -a "$OUT/sanitizer.log"; tail -n 4 "$OUT/sanitizer.log"
echo "== benchmark"
timeout 280 python3 bench/transfer.py --out "$OUT/transfer.json" --commit "$COMMIT" \
  --gpu-junit "$OUT/gpu_tests.xml" --sanitizer-log "$OUT/sanitizer.log" \
  --command "COMMIT=$COMMIT bash bench/gpu_session.sh" 2>&1 | tee "$OUT/bench.log"
