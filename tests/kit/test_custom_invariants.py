"""An engine's own ``@invariant()`` on a kit machine (issue 13): a failure it finds is saved
naming that invariant, ``kvtier fuzz --replay`` fails the same way (exit status 1), and
``kvtier verify`` checks it in every state too.

``TwoRequests`` is the facade machine plus one invariant of an imagined engine that never
runs two requests at once: it fails as soon as a second request is admitted.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis.stateful import invariant

from kvtier.cli import main
from kvtier.cli.exitcodes import ExitCode
from kvtier.testing.fuzz import campaign, replay_file
from kvtier.testing.machines import FacadeMachine
from kvtier.testing.sequence import EventSequence, Step, check_all, classify, custom_invariants, replay
from kvtier.testing.verify import verify


class TwoRequests(FacadeMachine):
    @invariant()
    def one_request_at_a_time(self) -> None:
        if hasattr(self, "cache"):
            assert len(self.cache.table) < 2, f"{len(self.cache.table)} requests tracked"


def _two_admissions() -> EventSequence:
    return EventSequence(f"{__name__}:TwoRequests", [
        FacadeMachine.verify_setup(),
        Step.of("admit", {"req": 0, "key": ["a"], "chunk": 1, "tail": False}),
        Step.of("admit", {"req": 1, "key": ["b"], "chunk": 1, "tail": False}),
    ], "two-admissions")


def test_own_invariants_are_found_and_the_kits_are_not() -> None:
    assert [name for name, _ in custom_invariants(TwoRequests)] == ["one_request_at_a_time"]
    assert custom_invariants(FacadeMachine) == ()


def test_replay_runs_the_own_invariant_and_names_it() -> None:
    res = replay(_two_admissions())
    assert (res.outcome, res.invariant, res.failed_step) == ("violation", "one_request_at_a_time", 3)
    assert res.message == "2 requests tracked"
    m = TwoRequests()
    m.setup(**FacadeMachine.verify_setup().args)
    check_all(m)  # one machine, no request: holds
    m.admit(req=0, key=["a"], chunk=1, tail=False)
    m.admit(req=1, key=["b"], chunk=1, tail=False)
    with pytest.raises(AssertionError) as info:
        check_all(m)
    assert classify(info.value) == ("one_request_at_a_time", "2 requests tracked")


def test_campaign_saves_the_failed_invariant_and_replay_fails_the_same_way(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "failure.json"
    res = campaign(steps=5000, seed_value=1, mix={"custom": 1.0}, machines={"custom": TwoRequests},
                   save=path, progress=False)
    assert res.failure is not None and res.saved == path
    # the first failure is reported apart from the shrinking that followed it
    assert res.first_failure_step is not None and res.first_failure_seconds is not None
    assert 2 <= res.first_failure_step < res.steps and 0 < res.first_failure_seconds <= res.seconds
    assert f"first failure at step {res.first_failure_step:,} of the campaign" in res.report()
    saved = json.loads(path.read_text())
    assert saved["expect"] == {"outcome": "violation", "invariant": "one_request_at_a_time"}
    assert saved["machine"] == f"{__name__}:TwoRequests"
    buf = io.StringIO()
    again = replay_file(path, buf)
    assert (again.outcome, again.invariant) == ("violation", "one_request_at_a_time")
    assert "violation of one_request_at_a_time" in buf.getvalue()
    assert main(["fuzz", "--replay", str(path)]) == ExitCode.FAILED
    assert "violation of one_request_at_a_time" in capsys.readouterr().out


def test_campaign_failure_that_does_not_replay_is_never_saved_as_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A failure the replay cannot reproduce (here: an invariant that fails only in the
    campaign's first machine) is saved expecting that violation: the replay passes, which
    is reported as NOT as expected (``--replay``'s status is 1 only when the violation
    reproduces), instead of "as expected"."""
    path = tmp_path / "flaky.json"
    res = campaign(steps=2000, seed_value=0, mix={"flaky": 1.0}, machines={"flaky": FailsOnce},
                   save=path, progress=False)
    assert res.failure is not None
    saved = json.loads(path.read_text())
    assert saved["expect"] == {"outcome": "violation", "invariant": "fails_in_the_campaign_only"}
    assert "did not reproduce" in saved["description"]
    assert main(["fuzz", "--replay", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "expected violation of fails_in_the_campaign_only: NOT as expected" in out


class FailsOnce(FacadeMachine):
    armed = [True]

    @invariant()
    def fails_in_the_campaign_only(self) -> None:
        if self.armed[0] and hasattr(self, "cache") and len(self.cache.table):
            self.armed[0] = False
            raise AssertionError("fails_in_the_campaign_only: once")


def test_verify_checks_the_own_invariant_in_every_state() -> None:
    res = verify(4, machine=TwoRequests)
    assert not res.ok and res.invariant == "one_request_at_a_time"
    assert res.violation is not None and res.violation.expect["invariant"] == "one_request_at_a_time"
    assert replay(res.violation).invariant == "one_request_at_a_time"


def test_cli_fuzzes_an_engines_own_machine_and_prints_the_failure_last(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtier fuzz --machine module:Class``: the failure (violation, minimal sequence, where
    it was saved) ends the output, after the never-exercised items, counted on one line
    (listed with --verbose)."""
    path = tmp_path / "failure.json"
    args = ["fuzz", "--machine", f"{__name__}:TwoRequests", "--steps", "5000", "--seed", "1", "--no-progress",
            "--save", str(path)]
    assert main(args) == ExitCode.FAILED
    lines = capsys.readouterr().out.splitlines()
    never = [i for i, line in enumerate(lines) if line.startswith("never exercised")]
    assert len(never) == 1 and lines[never[0]].endswith("items (kvtier fuzz --verbose lists them)")
    assert not any(line.startswith("  - ") for line in lines)
    violation = next(i for i, line in enumerate(lines) if line.startswith("VIOLATION of one_request_at_a_time"))
    assert violation > never[0] and lines[violation + 1].startswith("minimal failing sequence (3 steps")
    assert lines[-1] == f"saved as {path} (reproduce: kvtier fuzz --replay {path})"
    assert main([*args, "--verbose"]) == ExitCode.FAILED
    verbose = capsys.readouterr().out.splitlines()
    listed = [line for line in verbose if line.startswith("  - ")]
    assert verbose[-1] == lines[-1] and len(listed) == int(lines[never[0]].split()[2])
