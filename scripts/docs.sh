#!/usr/bin/env bash
# Build the API reference (MkDocs + mkdocstrings, warnings are errors) into site/.
# Stages the package as the wheel lays it out (build/api-src/kvtier: links to src/kvtier's
# files plus fsm/, transfer/ and spec/), since griffe does not follow setuptools' package-dir.
# Needs the docs extra: pip install -e '.[docs]'. Extra arguments go to mkdocs build; `bash scripts/docs.sh serve` serves it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
rm -rf build/api-src && mkdir -p build/api-src/kvtier
for f in src/kvtier/*; do ln -s "$ROOT/$f" "build/api-src/kvtier/$(basename "$f")"; done
for d in fsm transfer spec; do ln -s "$ROOT/$d" "build/api-src/kvtier/$d"; done
if [ "${1:-}" = serve ]; then shift; exec mkdocs serve "$@"; fi
exec mkdocs build --strict "$@"
