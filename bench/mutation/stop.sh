#!/usr/bin/env bash
# Stop a bench/mutation/run.sh in progress and put back the file mutmut had mutated.
# mutmut 2.x keeps the original as fsm/.../<file>.py.bak while a mutant is applied; SIGINT does
# not reach its worker process reliably, so the workers are ended and the backup restored
# (only when the backup is byte-identical to the committed file). Usage: stop.sh RUN_SH_PID
set -u
cd "$(dirname "$0")/../.."
[ -n "${1:-}" ] && kill "$1" 2>/dev/null
for p in $(pgrep -f "mutmut run --paths-to-mutate"); do
  kill $(pgrep -P "$p") "$p" 2>/dev/null
done
sleep 2
shopt -s globstar
for b in fsm/**/*.py.bak; do
  [ -e "$b" ] || continue
  f="${b%.bak}"
  if git show "HEAD:$f" | cmp -s - "$b"; then mv "$b" "$f"; echo "restored $f"; else echo "NOT restoring $f: backup differs from HEAD"; fi
done
git diff --stat -- fsm/
