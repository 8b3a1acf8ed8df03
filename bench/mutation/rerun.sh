#!/usr/bin/env bash
# Re-run single mutants by mutmut id (survivors, timeouts, stale rows) with the runner of
# run.sh; used after adding tests. Usage: bench/mutation/rerun.sh ID [ID ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export HYPOTHESIS_PROFILE=kvtier-ci NUMBA_ENABLE_CUDASIM=1 PYTHONDONTWRITEBYTECODE=1
RUNNER="$(sed -n 's/^RUNNER="\(.*\)"$/\1/p' bench/mutation/run.sh)"
for id in "$@"; do
  f=$(python3 -c "import sqlite3,sys; print(sqlite3.connect('.mutmut-cache').execute('select sf.filename from Mutant m join Line l on m.line=l.id join SourceFile sf on l.sourcefile=sf.id where m.id=?',(int(sys.argv[1]),)).fetchone()[0])" "$id")
  mutmut run --paths-to-mutate "$f" --tests-dir tests --runner "$RUNNER" -m 2.0 -b 5.0 --simple-output --no-progress "$id" >/dev/null 2>&1 || true
done
cp .mutmut-cache bench/mutation/mutmut-cache.sqlite
git diff --stat -- fsm/
