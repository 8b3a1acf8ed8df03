"""``kvtier verify`` to a fixpoint (issue 12): the canonical state merges enough for the
small bounds to be explored completely, and not so much that it hides bugs.

Soundness is tested two ways: ``check_merges`` compares the successors of every merged
state with those of the state it was merged into (and a deliberately too coarse canonical
state is caught by it), and the coarse verify, run on deliberately broken variants
(``tests/broken/``), still finds each with the invariant it breaks. The time figures live
in ``bench/RESULTS.md`` (verify fixpoint), not here.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest

from broken_support import BROKEN, patched_tree, run_python
from kvtier.testing.machines import FacadeMachine
from kvtier.testing.verify import verify

#: the CI bound: one request (prompt 'a' plus one token), 2 device and 2 host units
ONE_REQUEST = ["--requests", "1", "--tail", "--device-units", "2", "--host-units", "2", "--depth", "80"]


class OneRequest(FacadeMachine):
    verify_prompts = (("a",),)
    verify_max_units = 1
    verify_tail = True


class TooCoarse(OneRequest):
    """Forgets the tree: states with different nodes are merged."""

    def kit_canonical(self) -> Hashable:
        value = super().kit_canonical()
        assert isinstance(value, tuple)
        return value[1:]


def test_one_request_reaches_a_fixpoint_with_every_merge_checked() -> None:
    res = verify(80, machine=OneRequest, setup=OneRequest.verify_setup(dev_units=2, host_units=2), check_merges=1)
    assert res.ok and res.fixpoint and not res.stopped, res.report()
    # 2,580 states before the coarser canonical state (bench/RESULTS.md), 316 with it
    assert 100 < res.states < 1000 and res.depth < 40
    assert res.merges_checked == res.transitions - res.states + 1
    assert "merges checked" in res.report()


def test_check_merges_catches_a_canonical_state_that_merges_too_much() -> None:
    res = verify(80, machine=TooCoarse, setup=OneRequest.verify_setup(dev_units=2, host_units=2), check_merges=1)
    assert not res.ok and res.merge_mismatch is not None and res.violation is None
    first, merged = res.merge_mismatch
    assert first.steps[0].rule == merged.steps[0].rule == "setup"
    assert first.steps != merged.steps
    assert res.stopped.startswith("merge mismatch") and "MERGE MISMATCH" in res.report()


@pytest.mark.parametrize(("patch", "invariant"), [
    ("12-loaded-equals-written.patch", "loaded_equals_written"),  # page content
    ("semantic/s12-layer-ready-off-by-one.patch", "model_layer_ready"),  # the layer model
    ("10-failure-not-success.patch", "loaded_equals_written"),
    ("semantic/s09-load-refusal-leaks-pin.patch", "atomic_admission"),
])
def test_the_coarse_verify_still_finds_broken_variants(patch: str, invariant: str, tmp_path: Path) -> None:
    pythonpath = patched_tree(BROKEN / patch, tmp_path)
    saved = tmp_path / "violation.json"
    done = run_python(pythonpath, ["-m", "kvtier", "verify", *ONE_REQUEST, "--quiet", "--save", str(saved)], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"VIOLATION of {invariant}" in done.stdout and saved.exists()
