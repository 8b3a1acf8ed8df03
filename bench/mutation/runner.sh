#!/usr/bin/env bash
# The test command mutmut runs for every mutant (bench/mutation/run.sh passes it as --runner).
# mutmut 2.x counts only exit status 1 as "killed": a mutant that breaks the import of
# kvtier.fsm makes pytest stop at collection with status 2 (or 4/5), which mutmut would
# report as a survivor. Every failing status is mapped to 1 here; a pass stays 0.
# A mutant that makes a test hang (an eviction or tree walk that never ends) is stopped by
# pytest-timeout after 15 s per test (the slowest test here takes about 1.5 s) and fails
# the run, so it counts as killed. (mutmut's own timeout, 10 x the baseline, kills only this
# shell and races with the exit status: a hang could be recorded as a survivor, with the
# pytest process left running.) The outer `timeout` is a backstop for a hang outside a test.
# A fast, deterministic subset (hypothesis profile kvtier-ci is derandomized).
timeout -s KILL 45 pytest -x -q -p no:cacheprovider --timeout=15 \
  tests/test_errors.py \
  tests/test_node_ops.py \
  tests/test_pages.py \
  tests/test_machines.py \
  tests/test_records_details.py \
  tests/test_records.py \
  tests/test_spec.py \
  tests/test_cache_results.py \
  tests/test_core_refusals.py \
  tests/test_core_stats.py \
  tests/test_core_presets.py \
  tests/test_core_completions.py \
  tests/test_core_eviction.py \
  tests/test_core_invariants.py \
  tests/test_core_loadback.py \
  tests/test_core_match_insert.py \
  tests/test_core_split.py \
  tests/test_core_writeback.py \
  tests/test_conformance.py \
  tests/test_bad_input.py::test_facade_and_core_reject_bad_values \
  tests/test_regressions.py::test_sequence_has_its_expected_outcome \
  tests/test_facade.py \
  tests/test_core_stateful.py \
  tests/test_kit.py
rc=$?
[ "$rc" -eq 0 ] && exit 0
exit 1
