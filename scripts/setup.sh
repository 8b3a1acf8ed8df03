#!/usr/bin/env bash
# Set up kvtier from nothing in ./.venv: Python venv, the CPU build of torch, the project.
# The README's first command then runs the main job: .venv/bin/kvtier replay
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: the local CPU wheel (otherwise pip would fetch a multi-GB CUDA build)
pip install -q -c .ci/constraints.txt torch==2.13.0
pip install -q -c .ci/constraints.txt -e '.[testing]'
