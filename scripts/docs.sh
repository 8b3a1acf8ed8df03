#!/usr/bin/env bash
# Build the documentation (the guide pages in docs/ and the API reference from the
# docstrings; MkDocs + mkdocstrings, warnings are errors) into site/.
# Works on a fresh clone: uses ./.venv (made if missing, as scripts/test.sh does) and installs
# the pinned versions of .ci/constraints.txt (mkdocs, mkdocstrings, mkdocstrings-python,
# griffelib); kvtier itself need not be installed: griffe reads the sources.
# Stages the package as the wheel lays it out (build/api-src/kvtier: links to src/kvtier's
# entries plus fsm/, transfer/ and spec/), since griffe does not follow setuptools' package-dir.
# Extra arguments go to mkdocs build (e.g. --quiet); `bash scripts/docs.sh serve` serves it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -c .ci/constraints.txt mkdocs mkdocstrings mkdocstrings-python griffelib
rm -rf build/api-src && mkdir -p build/api-src/kvtier
for f in src/kvtier/*; do ln -s "$ROOT/$f" "build/api-src/kvtier/$(basename "$f")"; done
for d in fsm transfer spec; do ln -s "$ROOT/$d" "build/api-src/kvtier/$d"; done
if [ "${1:-}" = serve ]; then shift; exec mkdocs serve "$@"; fi
exec mkdocs build --strict "$@"
