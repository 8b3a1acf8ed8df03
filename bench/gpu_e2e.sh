#!/usr/bin/env bash
# One device call for issue 17 on the H200: measured TTFT with real forward passes
# (bench/e2e_ttft.py) for the Llama 3.2 1B and Llama 3 8B shapes and the 1B shape with
# alternating sliding-window layers, three configurations each. Needs .whl/ carried
# (kvtier + transitions, six, graphviz wheels for Python 3.12). Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NUMBA_DISABLE_PERFORMANCE_WARNINGS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/e2e_nvidia_smi.txt"
run() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo "== $name"
  timeout "$t" python3 bench/e2e_ttft.py --commit "$COMMIT" --out "$OUT/e2e-$name.json" "$@" > "$OUT/e2e-$name.log" 2>&1
  echo "exit $?"; tail -n 22 "$OUT/e2e-$name.log"
}
run llama-1b ${T1B:-40} --model llama-1b --tokens ${TOK1B:-400000} --time-scale ${TS1B:-0.0106} --max-output 8 --attention-probe
run llama-8b ${T8B:-65} --model llama-8b --tokens ${TOK8B:-200000} --max-prompt 16384 --time-scale ${TS8B:-0.032} --max-output 4 --no-reuse-samples 3 --attention-probe
run llama-1b-swa ${TSWA:-25} --model llama-1b-swa --tokens ${TOKSWA:-200000} --max-prompt 16384 --time-scale ${TSSWA:-0.0064} --max-output 8
