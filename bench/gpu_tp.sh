#!/usr/bin/env bash
# One device call for issue 21 (the lead runs it; under 4 minutes): tensor-parallel serving
# through kvtier's rank-parallel mode (bench/gpu_tp.py) for the Llama 3.2 1B shape, device
# only and device + host, 1 rank (baseline) and 2 rank processes. On the single H200 the 2
# ranks share the GPU: a 2-rank NCCL probe records NCCL's answer first, and the ranks then
# use gloo (sums through host memory) if NCCL refuses. On a multi-GPU kind, RANKS="1,2,4"
# runs NCCL with one GPU per rank. Needs .whl/ carried (kvtier + transitions, six, graphviz
# wheels for Python 3.12), as bench/gpu_e2e.sh. Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-out}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NUMBA_DISABLE_PERFORMANCE_WARNINGS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
# NVLink multicast stays off (device notes), in every rank process too (inherited)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/tp_nvidia_smi.txt"
timeout ${TTP:-200} python3 bench/gpu_tp.py --commit "$COMMIT" --out "$OUT/tp-llama-1b.json" \
  --model ${MODEL:-llama-1b} --ranks ${RANKS:-1,2} --tokens ${TOK:-40000} --max-prompt ${MAXP:-8192} \
  --max-output ${MAXO:-4} --token-budget ${BUDGET:-4096} --time-scale ${TS:-0.01} --timeout 120 \
  > "$OUT/tp-llama-1b.log" 2>&1
echo "exit $?"; tail -n 30 "$OUT/tp-llama-1b.log"
