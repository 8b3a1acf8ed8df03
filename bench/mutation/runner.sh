#!/usr/bin/env bash
# The test command mutmut runs for every mutant (bench/mutation/run.sh passes it as --runner).
# Tests: the deterministic, fast subset in tests.txt (Hypothesis profile kvtier-ci is
# derandomized, so every mutant sees the same examples), narrowed per mutant by
# select_tests.py to the tests that enter the mutated function (per-test coverage,
# covermap.json), fastest first, stopping at the first failure (-x). A mutant at module or
# class level runs the whole subset; one in a function no test enters survives unrun.
# pytest runs in a child forked by forkserver.py when run.sh started it (saves its start-up,
# about 2 s of CPU per mutant), else as its own process.
# MUTATION_FULL=1 runs the whole subset for every mutant (used to confirm survivors).
# mutmut 2.x counts only exit status 1 as "killed": a mutant that breaks the import of
# kvtier.fsm makes pytest stop at collection with status 2 (or 4/5), which mutmut would
# report as a survivor. Every failing status is mapped to 1 here; a pass stays 0.
# A mutant that makes a test hang (an eviction or tree walk that never ends) is stopped by
# pytest-timeout after 60 s per test (the slowest test here takes about 8 s on a loaded
# machine) and fails the run, so it counts as killed. (mutmut's own timeout, 10 x the
# baseline, kills only this shell and races with the exit status.) The outer `timeout` is
# a backstop for a hang outside a test.
here="$(cd "$(dirname "$0")" && pwd)"
sel="$(mktemp)"
trap 'rm -f "$sel"' EXIT
mode=all
if [ -z "${MUTATION_FULL:-}" ] && [ -f "$here/covermap.json" ] && [ -n "$(find fsm -name '*.py.bak')" ]; then
  mode=$(python "$here/select_tests.py" "$sel") || mode=all
fi
case "$mode" in
  none) exit 0 ;;
  some) args=("@$sel") ;;
  *) [ -s "$sel" ] || grep -v '^\s*#' "$here/tests.txt" | grep -v '^\s*$' > "$sel"; args=("@$sel") ;;
esac
opts=(-x -q -p no:cacheprovider -p no:pytest_cov --timeout=60)
rc=99
if [ -S "$here/.forkserver.sock" ]; then  # run.sh's fork server: pytest already imported
  timeout -s KILL 700 python "$here/forkserver.py" client "$here/.forkserver.sock" "${opts[@]}" "${args[@]}"
  rc=$?
fi
if [ "$rc" -eq 99 ]; then
  timeout -s KILL 600 pytest "${opts[@]}" "${args[@]}" >/dev/null 2>&1
  rc=$?
fi
[ "$rc" -eq 0 ] && exit 0
exit 1
