#!/usr/bin/env bash
# Re-run single mutants of one file by mutmut id (survivors, timeouts) with the runner of
# run.sh; used after adding tests. Usage: bench/mutation/rerun.sh fsm/file.py ID [ID ...]
set -euo pipefail
here="$(dirname "$0")"
f="$1"; shift
for id in "$@"; do MUTANT_ID="$id" "$here/run.sh" "$f" >/dev/null 2>&1 || true; done
git -C "$here/../.." diff --stat -- fsm/
