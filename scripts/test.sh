#!/usr/bin/env bash
# Run the whole kvtier test suite, installing what the tests need first.
# Kernels run under the Numba CUDA simulator (set before Python starts).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q -c .ci/constraints.txt torch==2.13.0
pip install -q -c .ci/constraints.txt -e '.[test,testing,l3,mooncake]' build
# the L3 tests start their own redis-server on a free loopback port (nothing global)
command -v redis-server >/dev/null || { (apt-get install -y -qq --no-install-recommends redis-server \
  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server)) >/dev/null 2>&1 \
  || echo "note: redis-server not installed; the L3 store tests will fail (KVTIER_REQUIRE_REDIS)"; }
# the Mooncake Store client needs libibverbs1 even over TCP; the tests start the wheel's mooncake_master
dpkg -s libibverbs1 >/dev/null 2>&1 || { (apt-get install -y -qq --no-install-recommends libibverbs1 \
  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1)) >/dev/null 2>&1 \
  || echo "note: libibverbs1 not installed; the Mooncake store tests will fail (KVTIER_REQUIRE_MOONCAKE)"; }
command -v dot >/dev/null || { (apt-get install -y -qq --no-install-recommends graphviz \
  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends graphviz)) >/dev/null 2>&1 \
  || echo "note: Graphviz 'dot' not installed; svg/png rendering tests will be skipped"; }
export NUMBA_ENABLE_CUDASIM=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-kvtier-ci}
python -m pytest -q -p no:cacheprovider --timeout=900 -m "not gpu and not kernelcompile" "$@"
