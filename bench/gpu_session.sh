#!/usr/bin/env bash
# One device call for the transfer engine (H200): GPU tests, compute-sanitizer, the GPU
# replay (hybrid and numba backends), the benchmark (hybrid backend, the numba backend
# beside it, start-up calibration, the same run's ceilings; the replays summarised in its
# JSON) and a cProfile of warm submit->ack. Needs .whl/ carried (kvtier + transitions,
# six, graphviz wheels for Python 3.12), and COMMIT set to the commit under test.
# Everything lands in $OUT; about 5 minutes on an H200 (each step has its own timeout).
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NUMBA_DISABLE_PERFORMANCE_WARNINGS=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/nvidia_smi.txt" 2>&1
cat "$OUT/nvidia_smi.txt"
echo "== gpu tests"
timeout "${T_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/transfer/test_transfer_gpu.py \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; tail -n 25 "$OUT/gpu_tests.log"
echo "== compute-sanitizer"
timeout "${T_SANITIZER:-90}" compute-sanitizer --tool memcheck --report-api-errors no --leak-check no --target-processes all \
  python3 bench/transfer.py --sanitize > "$OUT/sanitizer.log" 2>&1
echo "sanitizer exit $?" | tee -a "$OUT/sanitizer.log"; tail -n 4 "$OUT/sanitizer.log"
echo "== replay"
REPLAY_TIMEOUT=${T_REPLAY:-80} BACKENDS=${REPLAY_BACKENDS:-hybrid numba} OUT="$OUT" bash bench/gpu_replay.sh 2>&1 | grep -v "^WARNING"
replays=()
for f in "$OUT"/replay_*.json; do [ -s "$f" ] && replays+=(--replay-json "$f"); done
echo "== benchmark"
timeout "${T_BENCH:-170}" python3 bench/transfer.py --out "$OUT/transfer.json" --commit "$COMMIT" \
  --gpu-junit "$OUT/gpu_tests.xml" --sanitizer-log "$OUT/sanitizer.log" --no-sweep --no-study --no-baselines \
  "${replays[@]}" --command "COMMIT=$COMMIT bash bench/gpu_session.sh" 2>&1 | tee "$OUT/bench.log"
echo "== profile"
timeout "${T_PROFILE:-45}" python3 bench/transfer.py --profile > "$OUT/profile.txt" 2>&1
echo "profile exit $?"; grep -E "^== profile" "$OUT/profile.txt"
