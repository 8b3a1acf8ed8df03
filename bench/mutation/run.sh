#!/usr/bin/env bash
# Mutation testing of fsm/ with mutmut 2.x (mutates in place; mutmut 3 would copy the sources
# to mutants/, which the setuptools package-dir mapping kvtier.fsm -> fsm/ does not import).
# Usage: bench/mutation/run.sh [fsm/file.py ...]   (default: every path in files.txt)
# One mutmut cache per source file (bench/mutation/cache/<name>.sqlite) and one raw result
# file (bench/mutation/results/<name>.xml; <name>: the path under fsm/, dotted, e.g.
# request.fence for fsm/request/fence.py), so files can be run in separate clones at the
# same time and a run resumes where it stopped (killed mutants are not re-run).
# The whole configuration is on this command line; no setup.cfg is needed.
# Do not run `mutmut show`/`results` while a run is in progress: they rewrite the line
# table of the cache and the running mutmut then crashes (and hangs).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p bench/mutation/cache bench/mutation/results
if [ -d .venv/bin ]; then export PATH="$PWD/.venv/bin:$PATH"; fi
# the per-test coverage map the runner selects tests from (select_tests.py): built once,
# rebuilt with `python bench/mutation/covermap.py` after fsm/ or the tests change
[ -f bench/mutation/covermap.json ] || python bench/mutation/covermap.py
export HYPOTHESIS_PROFILE=kvtier-ci NUMBA_ENABLE_CUDASIM=1 PYTHONDONTWRITEBYTECODE=1
# the fork server (forkserver.py) that runner.sh hands its pytest runs to; stopped on exit
sock=bench/mutation/.forkserver.sock
python bench/mutation/forkserver.py serve "$sock" &
server=$!
trap 'kill "$server" 2>/dev/null; rm -f "$sock"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.2; done
RUNNER="bash bench/mutation/runner.sh"
if [ "$#" -gt 0 ]; then files=("$@"); else mapfile -t files < <(grep -v '^\s*#' bench/mutation/files.txt | grep -v '^\s*$'); fi
for f in "${files[@]}"; do
  stem=${f#fsm/}; stem=${stem%.py}; stem=${stem//\//.}  # fsm/request/fence.py -> request.fence
  cache=bench/mutation/cache/$stem.sqlite
  # a new file's cache starts from seed.sqlite (no mutants, only the baseline time and the
  # hash of the tests), so mutmut does not rerun the unmutated baseline for every file
  if [ -f "$cache" ]; then cp "$cache" .mutmut-cache
  elif [ -f bench/mutation/cache/seed.sqlite ]; then cp bench/mutation/cache/seed.sqlite .mutmut-cache
  else rm -f .mutmut-cache; fi
  id_args=(); if [ -n "${MUTANT_ID:-}" ]; then id_args=("$MUTANT_ID"); fi
  echo "=== $f $(date -u +%FT%TZ)"
  # per-mutant timeout = baseline * 2.0 + 5 s (mutmut 2: -m / -b)
  mutmut run --paths-to-mutate "$f" --tests-dir tests --runner "$RUNNER" \
    -m 2.0 -b 5.0 --simple-output --no-progress "${id_args[@]}" || true
  cp .mutmut-cache "$cache"
  cp .mutmut-cache bench/mutation/cache/seed.sqlite
  python - <<'PY'
import sqlite3
db = sqlite3.connect("bench/mutation/cache/seed.sqlite")
for table in ("Mutant", "Line", "SourceFile"):
    db.execute(f"DELETE FROM {table}")
db.commit()
db.execute("VACUUM")
PY
  mutmut junitxml --untested-policy=skipped > "bench/mutation/results/$stem.xml"
done
git diff --stat -- fsm/
