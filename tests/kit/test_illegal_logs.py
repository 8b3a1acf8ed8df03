"""Illegal event logs made from legal ones (kvtier.testing.log_mutants): ``kvtier check``
rejects each mutant of a recorded run by the rule its mutation breaks, and a checker that
lets one through fails the recorded examples of the kit's machines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from broken_support import REGRESSIONS

from kvtier.cli import check
from kvtier.eventlog import recording
from kvtier.testing.log_mutants import MUTATIONS, check_mutants, check_mutants_or_fail, mutants
from kvtier.testing.logged import LogCheck
from kvtier.testing.models import ModelViolation
from kvtier.testing.sequence import EventSequence, replay

Records = list[dict[str, Any]]


def _logs(tmp_path: Path) -> list[Records]:
    """The logs of the regression sequences, each run on the correct product."""
    out = []
    for path in sorted(REGRESSIONS.glob("*.json")):
        log = tmp_path / f"{path.stem}.kvlog"
        with recording(log):
            assert replay(EventSequence.load(path)).outcome == "pass"
        out.append([json.loads(line) for line in log.read_text().splitlines() if line.strip()])
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> list[Records]:
    return _logs(tmp_path_factory.mktemp("logs"))


def test_every_mutation_of_the_recorded_runs_is_rejected_by_the_rule_it_breaks(logs: list[Records]) -> None:
    seen: set[str] = set()
    for recs in logs:
        assert check.check_records(enumerate(recs, 1)).ok
        seen.update(check_mutants(recs))
    # the regression runs offer a site for these (the others need a tensor-parallel run,
    # a poison or an abort while a pass is out, which the fuzz's examples reach)
    assert {"failed_settles_ok", "settles_twice", "issued_twice", "ack_without_command", "wrong_destination",
            "wrong_source", "flipped_guard", "host_with_device", "loading_unpinned"} <= seen <= set(MUTATIONS)


def test_a_mutant_is_cut_a_few_records_past_its_mutation(logs: list[Records]) -> None:
    for recs in logs:
        for m in mutants(recs):
            assert m.at < len(m.records) <= m.at + 6 and m.records[:m.at] == recs[:m.at]


def test_a_checker_that_takes_a_completion_never_handed_out_is_caught(logs: list[Records],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    orig = check._Checker._completion

    def lenient(self: Any, rec: dict[str, Any]) -> None:  # the planted bug: any op id is in flight
        self._op(rec["op"]).issued = True
        orig(self, rec)

    monkeypatch.setattr(check._Checker, "_completion", lenient)
    with pytest.raises(ModelViolation, match="ack_without_command") as e:
        for recs in logs:
            check_mutants_or_fail(recs)
    assert e.value.invariant == "model_log_checker"


def test_a_checker_that_lets_a_failed_operation_settle_ok_is_caught(logs: list[Records],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    orig = check._Checker._record

    def lenient(self: Any, rec: dict[str, Any]) -> None:  # the planted bug: a settle's verdict is not checked
        if rec.get("k") == "settled":
            self._op(rec["op"]).failed = False
            self._op(rec["op"]).expired = False
            rec = dict(rec, expired=False)
        orig(self, rec)

    monkeypatch.setattr(check._Checker, "_record", lenient)
    with pytest.raises(AssertionError, match="failed_settles_ok"):
        for recs in logs:
            check_mutants(recs)


def test_a_recorded_example_fails_when_the_checker_accepts_a_mutant(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.testing.core_machine import CoreMachine
    orig = check._Checker._completion

    def lenient(self: Any, rec: dict[str, Any]) -> None:
        self._op(rec["op"]).issued = True
        orig(self, rec)

    seq = EventSequence.load(REGRESSIONS / "07-operation-ends-once.json")
    assert seq.machine == "core"
    m = CoreMachine()
    log = None
    for step in seq.steps:
        if step.rule == "setup":
            getattr(m, step.rule)(**dict(step.args, logged=True))
            log = m.log
        else:
            getattr(m, step.rule)(**step.args)
    assert isinstance(log, LogCheck)
    monkeypatch.setattr(check._Checker, "_completion", lenient)
    with pytest.raises(ModelViolation, match="ack_without_command"):
        log.finish()
