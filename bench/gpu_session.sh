#!/usr/bin/env bash
# One device call for the transfer engine (H200). Steps (STEPS, default all, in this order):
#   serving    the serving-path table (bench/transfer.py --serving): old path (hybrid, layer-first
#              host pool) and staging path (hybrid, page-major host pool), each way and both at
#              once, new page lists every flush, with the same run's ceilings and calibration
#   tests      the GPU tests (tests/transfer/test_transfer_gpu.py)
#   sanitizer  compute-sanitizer memcheck on the small workload (staging included)
#   replay     the GPU replay (hybrid with a layer-first and a page-major host pool)
#   e2e        bench/gpu_e2e.sh (TTFT with real forward passes)
#   profile    a cProfile of warm submit->ack
# Needs .whl/ carried (kvtier + transitions, six, graphviz wheels for Python 3.12), and COMMIT set
# to the commit under test. Everything lands in $OUT; each step has its own timeout.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
STEPS=${STEPS:-serving tests sanitizer replay e2e profile}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NUMBA_DISABLE_PERFORMANCE_WARNINGS=1
if ! python3 -c "import hypothesis" 2>/dev/null && ls .whl/opt/*.whl >/dev/null 2>&1; then  # the GPU tests need it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/opt/*.whl
fi
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/nvidia_smi.txt" 2>&1
cat "$OUT/nvidia_smi.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has serving; then
  echo "== serving table"
  timeout "${T_SERVING:-200}" python3 bench/transfer.py --serving --out "$OUT/serving.json" --commit "$COMMIT" \
    --command "COMMIT=$COMMIT STEPS=serving bash bench/gpu_session.sh" 2>&1 | grep -v "^WARNING" | tee "$OUT/serving.log"
fi
if has tests; then
  echo "== gpu tests"
  timeout "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/transfer/test_transfer_gpu.py \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"; tail -n 25 "$OUT/gpu_tests.log"
fi
if has sanitizer; then
  echo "== compute-sanitizer"
  timeout "${T_SANITIZER:-90}" compute-sanitizer --tool memcheck --report-api-errors no --leak-check no --target-processes all \
    python3 bench/transfer.py --sanitize > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer exit $?" | tee -a "$OUT/sanitizer.log"; tail -n 4 "$OUT/sanitizer.log"
fi
if has replay; then
  echo "== replay"
  REPLAY_TIMEOUT=${T_REPLAY:-80} BACKENDS=${REPLAY_BACKENDS:-hybrid hybrid:page} OUT="$OUT" bash bench/gpu_replay.sh 2>&1 | grep -v "^WARNING"
  for f in "$OUT"/replay_*.json; do
    [ -s "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); c=d['configurations'][1]; \
print(sys.argv[1].split('/')[-1], d['setup']['backend'], 'measured', round(c['transfer_s_measured'],4), 'modeled', \
round(c['transfer_s_modeled'],4), 'ratio', round(c['transfer_s_measured']/c['transfer_s_modeled'],2) if c['transfer_s_modeled'] else None, \
'pages checked', c.get('fingerprint_pages_checked'))" "$f"
  done
fi
if has e2e; then
  echo "== e2e"
  OUT="$OUT" COMMIT="$COMMIT" bash bench/gpu_e2e.sh 2>&1 | grep -v "^WARNING"
fi
if has profile; then
  echo "== profile"
  timeout "${T_PROFILE:-45}" python3 bench/transfer.py --profile > "$OUT/profile.txt" 2>&1
  echo "profile exit $?"; grep -E "^== profile" "$OUT/profile.txt"
fi
