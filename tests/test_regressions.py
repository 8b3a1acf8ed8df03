"""The regression corpus (tests/regressions/*.json) and its deliberately broken variants
(tests/broken/*.patch).

Each sequence is a named, deterministic kvtier event sequence guarding one invariant of
tests/fsm/lifecycle/reference_invariants.md (a copy of the reference list); it passes on the
code as it is. Its patch breaks the rule
that invariant rests on; applied to a temporary copy of the package, the same sequence
must then fail. For one planted bug, ``kvtier fuzz`` (bounded, fixed seed) and
``kvtier verify`` (small bound) must find it and print a minimal sequence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from broken_support import BROKEN, REGRESSIONS, REPLAY_SCRIPT, patched_tree, run_python
from kvtier.fsm.lifecycle.spec import load_spec
from kvtier.testing.sequence import EventSequence, replay

SEQUENCES = sorted(REGRESSIONS.glob("*.json"))
PATCHES = sorted(BROKEN.glob("*.patch"))
#: invariants.md, in its order (numbered 1..16), by their spec names
INVARIANTS_MD = ("root_closed_host", "host_means_acked", "writeback_source_immutable", "loadback_source_pinned",
                 "counts_with_receipts", "split_preserves_ownership", "operation_ends_once",
                 "release_once_after_fence", "host_evict_leaves", "failure_not_success", "atomic_admission",
                 "loaded_equals_written", "conservation", "borrowed_pages_stay", "exact_continuation_state",
                 "forward_fence")
PLANTED = "07-operation-ends-once"


def _load(path: Path) -> EventSequence:
    return EventSequence.load(path)


def test_every_invariant_has_a_sequence_and_a_broken_variant() -> None:
    assert set(INVARIANTS_MD) <= set(load_spec().invariants)
    # the reference list (a verbatim copy shipped beside the spec's tests) numbers exactly these
    reference = Path(__file__).resolve().parent / "fsm" / "lifecycle" / "reference_invariants.md"
    assert len(re.findall(r"(?m)^\d+\. \*\*", reference.read_text(encoding="utf-8"))) == len(INVARIANTS_MD)
    guarded: dict[str, list[str]] = {}
    for path in SEQUENCES:
        seq = _load(path)
        assert seq.extra.get("invariant") in INVARIANTS_MD, path.name
        assert (BROKEN / seq.extra["broken"]).exists(), f"{path.name}: no {seq.extra['broken']}"
        guarded.setdefault(seq.extra["invariant"], []).append(path.name)
    assert set(guarded) == set(INVARIANTS_MD), f"no sequence for {sorted(set(INVARIANTS_MD) - set(guarded))}"
    used = {_load(p).extra["broken"] for p in SEQUENCES}
    assert used == {p.name for p in PATCHES}, "every patch is caught by some sequence"


@pytest.mark.parametrize("path", SEQUENCES, ids=lambda p: p.stem)
def test_sequence_has_its_expected_outcome(path: Path) -> None:
    seq = _load(path)
    result = replay(seq)
    assert result.matches(seq.expect), result.describe() + "\n" + result.detail


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_broken_variant_makes_its_sequences_fail(patch: Path, tmp_path: Path) -> None:
    mine = [p for p in SEQUENCES if _load(p).extra["broken"] == patch.name]
    assert mine
    pythonpath = patched_tree(patch, tmp_path)
    done = run_python(pythonpath, ["-c", REPLAY_SCRIPT, *map(str, mine)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(mine)
    for res in results:
        assert res["kvtier"].startswith(str(pythonpath)), "the patched copy was not the one imported"
        assert res["outcome"] == "violation", f"{res['path']} still passes with {patch.name}"
        want = _load(Path(res["path"])).extra.get("broken_fails_with")
        assert want is None or res["invariant"] == want, res


def test_planted_bug_is_found_and_minimized_by_fuzz_and_verify(tmp_path: Path) -> None:
    pythonpath = patched_tree(BROKEN / f"{PLANTED}.patch", tmp_path)
    saved = tmp_path / "fuzz.json"
    # the facade machine alone (where the planted duplicate completion shows): in the mixed
    # campaign 2,000 steps give it a handful of examples, found or not by the seed's luck
    fuzz = run_python(pythonpath, ["-m", "kvtier", "fuzz", "--steps", "2000", "--seed", "0", "--machine", "facade",
                                   "--no-progress", "--save", str(saved)], tmp_path)
    assert fuzz.returncode == 1, fuzz.stdout[-2000:] + fuzz.stderr[-2000:]
    assert "VIOLATION of operation_ends_once" in fuzz.stdout and "minimal failing sequence" in fuzz.stdout
    found = EventSequence.load(saved)
    # (1-minimal; 4 or 5 steps depending on the facade machine's rule mix, e.g. setup, admit,
    # quiesce, preempt, deliver)
    assert len(found.steps) <= 5 and found.expect == {"outcome": "violation", "invariant": "operation_ends_once"}
    again = run_python(pythonpath, ["-m", "kvtier", "fuzz", "--replay", str(saved)], tmp_path)
    assert again.returncode == 1 and "as expected" in again.stdout
    assert replay(found).outcome == "pass"  # the correct code refuses the duplicate
    trace = tmp_path / "verify.json"
    ver = run_python(pythonpath, ["-m", "kvtier", "verify", "--depth", "6", "--world-size", "2", "--quiet",
                                  "--save", str(trace)], tmp_path)
    assert ver.returncode == 1, ver.stdout[-2000:] + ver.stderr[-2000:]
    assert "VIOLATION of operation_ends_once" in ver.stdout and "shortest violating trace" in ver.stdout
    shortest = EventSequence.load(trace)
    assert 3 <= len(shortest.steps) <= 6 and shortest.steps[0].rule == "setup"
