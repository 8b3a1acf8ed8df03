"""The testing kit itself (kvtier.testing): event sequences, coverage from the spec,
the fuzz campaign, bounded verification and the command line (the kit example of
docs/testing.md, an engine plugging its scheduler and transfer backend into the facade
machine, runs in tests/docs/test_kit_example.py)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from kvtier.cli import main
from kvtier.fsm.lifecycle.spec import load_spec
from kvtier.testing import fuzz
from kvtier.testing.coverage import LifecycleCoverage
from kvtier.testing.fuzz import campaign, replay_file
from kvtier.testing.machines import CoreMachine, FacadeMachine
from kvtier.testing.sequence import EventSequence, SequenceError, Step, replay
from kvtier.testing.verify import clone, verify


def _facade_finish() -> EventSequence:
    return EventSequence("facade", [
        FacadeMachine.verify_setup(),
        Step.of("admit", dict(req=0, key=["a", "b"], chunk=2, tail=False)),
        Step.of("step_done", dict(req=0, checkpoint=False, discard=False)),
        Step.of("finish", dict(req=0)),
        Step.of("poll", {}),
        Step.of("deliver", dict(i=0, ok=False)),
    ], name="finish-writeback-fails")


def test_sequence_round_trips_and_renders(tmp_path: Path) -> None:
    seq = _facade_finish()
    path = seq.save(tmp_path / "s.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "kvtier-sequence" and raw["version"] == 1 and raw["machine"] == "facade"
    back = EventSequence.load(path)
    assert back.steps == seq.steps and back.name == seq.name
    assert "3. step_done(req=0, checkpoint=False, discard=False)" in back.render()
    assert "admit(req=0, key='ab', chunk=2, tail=False)" in back.render()
    raw["version"] = 99
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(SequenceError, match="version"):
        EventSequence.load(tmp_path / "bad.json")


_HEAD = '{"format": "kvtier-sequence", "version": 1, "machine": "facade", '


@pytest.mark.parametrize(("text", "fragment"), [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than MAX_SEQUENCE_DEPTH = 32"),
    (_HEAD + '"steps": [{"rule": "setup", "args": {"a": ' + "[" * 40 + "]" * 40 + "}}]}",
     "nested deeper than MAX_SEQUENCE_DEPTH = 32"),
    (_HEAD + '"steps": [{"rule": "setup", "args": {"a": ' + "9" * 5000 + "}}]}", "not JSON"),
    (_HEAD + '"steps": 5}', '"steps" is int, expected a list'),
    (_HEAD + '"steps": [3]}', "step 1 is '3', expected an object with a string \"rule\""),
    (_HEAD + '"steps": [{"rule": "setup", "args": [[1, 2]]}]}', 'an object "args"'),
    (_HEAD + '"steps": [], "expect": 5}', '"expect" is \'5\', expected an object'),
])
def test_hostile_sequence_files_exit_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       text: str, fragment: str) -> None:
    path = tmp_path / "hostile.json"
    path.write_text(text)
    with pytest.raises(SequenceError, match="hostile.json") as info:
        EventSequence.load(path)
    assert fragment in str(info.value)
    assert main(["fuzz", "--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier fuzz: {path}: ") and fragment in err and "Traceback" not in err


def test_sequence_files_larger_than_the_bound_are_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.testing import steps

    path = _facade_finish().save(tmp_path / "s.json")
    monkeypatch.setattr(steps, "MAX_SEQUENCE_BYTES", path.stat().st_size - 1)
    with pytest.raises(SequenceError, match=f"larger than MAX_SEQUENCE_BYTES = {path.stat().st_size - 1:,} bytes"):
        EventSequence.load(path)
    monkeypatch.setattr(steps, "MAX_SEQUENCE_BYTES", path.stat().st_size)
    assert EventSequence.load(path).steps == _facade_finish().steps


def test_replay_checks_every_step_and_names_the_invariant() -> None:
    res = replay(_facade_finish())
    assert res.outcome == "pass" and res.steps_run == 6
    bad = EventSequence("facade", [FacadeMachine.verify_setup(), Step.of("no_such_rule", {})])
    with pytest.raises(SequenceError, match="no rule"):
        replay(bad)


@pytest.mark.parametrize(("args", "fragment"), [
    (dict(req=0, key=["a"], chunk=2, tail=False, bogus=1), "unexpected keyword argument 'bogus'"),
    (dict(req=0, key=["a"], chunk=2), "missing a required argument: 'tail'"),
])
def test_a_step_whose_arguments_do_not_fit_its_rule_is_bad_input_not_a_violation(
        args: dict[str, object], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seq = EventSequence("facade", [FacadeMachine.verify_setup(), Step.of("admit", args)])
    with pytest.raises(SequenceError, match=r"step 2: rule 'admit' of machine 'facade' takes \['req', 'key', 'chunk'"):
        replay(seq)
    path = seq.save(tmp_path / "s.json")
    assert main(["fuzz", "--replay", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_coverage_items_come_from_the_spec() -> None:
    spec = load_spec()
    cov = LifecycleCoverage(spec)
    totals = cov.totals()
    assert totals["transition"][1] == sum(len(lc.transitions) for lc in spec.lifecycles)
    assert totals["guard"][1] == 2 * sum(len(lc.guards) for lc in spec.lifecycles)
    pairs = sum(len(lc.state_names) * len(lc.events) for lc in spec.lifecycles)
    allowed = sum(len({(t.source, t.event) for t in lc.transitions}) for lc in spec.lifecycles)
    assert totals["rejection"][1] == pairs - allowed
    with cov.recording(), cov.attributed("facade"):
        assert replay(_facade_finish()).outcome == "pass"
    done = {i.label for i in cov.covered("transition", {"facade"})}
    assert "request: running --finish [has_own_writeback, settled]--> finishing" in done
    assert "request: finishing --writeback_fail--> finished" in done
    assert "node: writing --writeback_fail--> device" in done
    assert not cov.complete and cov.missing("rejection")


def test_campaign_runs_reproducibly_and_reports() -> None:
    runs = [campaign(steps=1500, seed_value=3, progress=False) for _ in range(2)]
    a, b = runs
    # the adapters' machines join where their engine imports (vLLM installed in this venv or not)
    adapters = {name for name in fuzz.ADAPTER_MACHINES if importlib.util.find_spec(name) is not None}
    adapters |= {name for name in fuzz.CHILD_MACHINES if importlib.util.find_spec(name) is not None}
    assert a.ok and a.steps >= 1500 and a.checks > 0 and set(a.steps_by_machine) == {
        "core", "facade", "engine", "node", "request", "l3", "transfer", "l3tier", "misuse", "reference",
        "scheduler"} | adapters
    assert a.steps_by_machine == b.steps_by_machine  # same seed, same campaign
    text = a.report()
    assert "steps run:" in text and "invariants checked:" in text and "coverage (from the spec)" in text
    assert "result: no violation" in text
    product = ", ".join(sorted({"core", "engine", "facade", "l3tier", "reference", "scheduler"} | adapters))
    assert f"driven by the product ({product}):" in text and "raw machines only" in text


def test_verify_small_bound_and_clone_independence() -> None:
    res = verify(4)
    assert res.ok and res.depth == 4 and res.states > 50 and not res.fixpoint
    assert res.per_depth[0] >= 1 and "states explored" in res.report()
    m = FacadeMachine()
    m.setup(**FacadeMachine.verify_setup().args)
    c = clone(m)
    c.admit(req=0, key=["a"], chunk=1, tail=False)
    assert len(m.cache.table) == 0 and len(c.cache.table) == 1
    assert m.kit_canonical() != c.kit_canonical()


def test_cli_fuzz_verify_and_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--steps", "800", "--seed", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "steps run:" in out and "never exercised" in out
    assert main(["verify", "--depth", "3", "--quiet"]) == 0
    assert "states explored" in capsys.readouterr().out
    path = _facade_finish().save(tmp_path / "s.json")
    assert main(["fuzz", "--replay", str(path)]) == 0
    assert "as expected" in capsys.readouterr().out
    buf = io.StringIO()
    assert replay_file(path, buf).outcome == "pass"


def test_cli_without_hypothesis_names_the_extra() -> None:
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "from kvtier.cli import main\n"
            "sys.exit(main(['fuzz', '--steps', '10']) * 10 + main(['verify', '--depth', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 22, done.stderr
    assert "kvtier fuzz needs the testing extra" in done.stderr and "kvtier verify needs the testing extra" in done.stderr
    assert "pip install 'kvtier[testing]'" in done.stderr


def test_core_machine_subclass_records_a_replayable_run() -> None:
    class Mine(CoreMachine):
        pass

    Mine.TestCase.settings = settings(max_examples=3, stateful_step_count=20, deadline=None, database=None)
    Mine.TestCase().runTest()
    last = Mine.kit_current()
    assert last is not None and last.kit_trace
    seq = last.kit_sequence()
    assert seq.machine.endswith(":test_core_machine_subclass_records_a_replayable_run.<locals>.Mine") or seq.machine
    again = EventSequence("core", seq.steps)
    assert replay(again).outcome == "pass"


def test_cli_fuzz_names_the_default_mix_and_refuses_bad_input_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import FUZZ_DEFAULT_MACHINES
    from kvtier.testing.fuzz import DEFAULT_MIX

    assert FUZZ_DEFAULT_MACHINES == tuple(DEFAULT_MIX)
    with pytest.raises(SystemExit) as done:
        main(["fuzz", "--help"])
    assert done.value.code == 0
    fuzz_help = " ".join(capsys.readouterr().out.split())
    assert "(core, facade, engine, node, request, l3, transfer, l3tier, misuse, reference, scheduler)" in fuzz_help
    # an unknown or unimportable machine: one line on stderr, status 2, and nothing printed before it
    assert main(["fuzz", "--machine", "core", "--machine", "nope", "--steps", "10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "unknown machine 'nope'" in err
    assert main(["fuzz", "--machine", "no_such_module_w17:Engine", "--steps", "10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot be imported" in err and "PYTHONPATH=." in err
    assert main(["fuzz", "--machine", "json:JSONDecoder", "--steps", "10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "not a kvtier.testing state machine" in err
    # --replay: a missing file and a file of another format name the file and what was expected
    missing = tmp_path / "missing.json"
    assert main(["fuzz", "--replay", str(missing)]) == 2
    assert capsys.readouterr().err == f"kvtier fuzz: cannot read sequence file {missing}: No such file or directory\n"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "x", "version": 1, "machine": "core", "steps": []}))
    assert main(["fuzz", "--replay", str(other)]) == 2
    assert capsys.readouterr().err == (f"kvtier fuzz: {other}: not a kvtier event sequence: format 'x', "
                                       f"expected 'kvtier-sequence'\n")
    other.write_text("[1, 2]")
    assert main(["fuzz", "--replay", str(other)]) == 2
    assert "expected an object with \"format\": 'kvtier-sequence'" in capsys.readouterr().err


def test_default_mix_adds_an_adapter_machine_only_where_its_module_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # an engine installed without a dependency it imports (SGLang without triton on a CPU box)
    # must leave its machine out, not make every campaign fail before its first step

    assert "sglang" not in fuzz.ADAPTER_MACHINES  # its modules import only under its marked tests
    monkeypatch.setattr(fuzz, "ADAPTER_MACHINES", {"broken": ("kvtier_no_such_machine_module", 0.04),
                                                   "json": ("json", 0.02)})
    monkeypatch.setattr(fuzz, "CHILD_MACHINES", {})
    mix = fuzz.default_mix()
    assert "broken" not in mix and mix["json"] == 0.02
    assert {k: v for k, v in mix.items() if k != "json"} == fuzz.DEFAULT_MIX
