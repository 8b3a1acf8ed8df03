"""Invariant 16 (``forward_fence``): the checker in kvtier.fsm.fence names it when a page a
request still needs is let go of behind its back, and the request records' calls table
and terminal states come from the spec."""

from __future__ import annotations

import pytest
from core_helpers import h1

from kvtier.fsm import InvariantViolation, UsageError
from kvtier.fsm.request import CALLS, TERMINAL
from kvtier.tiered import TieredCache


def overlapped() -> TieredCache:
    """``b`` owes pass 2 and holds deferred copies of the pages ``a`` published."""
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    c.check_invariants()
    return c


def test_a_deferred_page_freed_behind_the_requests_back_is_caught() -> None:
    c = overlapped()
    r = c.table.get("b")
    assert r.deferred_pages() == {"kv": [5, 6, 7, 8]}
    c.core.free_device({"kv": [5]})  # as a free at step_done without the fence would
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "conservation"
    assert str(exc.value) == ("invariant 'conservation' violated by request 'b': "
                              "page 5 of 'kv' is not held by a caller")


def test_canonical_pages_without_a_live_lock_are_caught() -> None:
    c = overlapped()
    r = c.table.get("b")
    assert r.lock is not None and r.canon == {"kv": [0, 1, 2, 3]}
    c.core.unlock(r.lock)  # its lock let go while pass 2 is out
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "forward_fence"
    assert "reads canonical pages without a live lock" in str(exc.value)


def test_a_waiting_request_that_owes_a_pass_is_caught() -> None:
    c = TieredCache(h1(), 8, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    r = c.table.get("a")
    c.table.release(r)  # everything given back while its first pass is out
    r.state = "waiting"
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "forward_fence"
    assert str(exc.value) == ("invariant 'forward_fence' violated by request 'a': "
                              "waiting but owes 1 forward result(s) and ops []")


def test_calls_and_terminal_states_come_from_the_spec() -> None:
    assert TERMINAL == {"finished", "aborted"}
    assert CALLS["reserve"] == {"running", "loading"}
    c = TieredCache(h1(), 8, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    assert [c.allows("a", k) for k in ("admit", "reserve", "step_done", "layer_ready")] == [False, True, True, True]
    with pytest.raises(UsageError, match="allows: call must be one of"):
        c.allows("a", "finish")
    c.step_done("a", 5)
    c.finish("a")
    assert [c.allows("a", k) for k in ("admit", "reserve", "step_done", "layer_ready")] == [True, False, False, False]


def test_every_invariant_check_and_failure_is_counted() -> None:
    """``check_all`` counts each call in ``invariant_checks`` and each raising call in
    ``invariant_failures`` (what the metrics export as kvtier:invariant_checks_total)."""
    c = overlapped()  # overlapped() already made one check
    assert (c.stats()["facade"]["invariant_checks"], c.stats()["facade"]["invariant_failures"]) == (1, 0)
    c.check_invariants()
    c.check_invariants()
    assert (c.stats()["facade"]["invariant_checks"], c.stats()["facade"]["invariant_failures"]) == (3, 0)
    c.core.free_device({"kv": [5]})  # a deferred page of b freed behind its back
    for _ in range(2):
        with pytest.raises(InvariantViolation):
            c.check_invariants()
    assert (c.stats()["facade"]["invariant_checks"], c.stats()["facade"]["invariant_failures"]) == (5, 2)
