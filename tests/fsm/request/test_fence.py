"""The request-side invariants (kvtier.fsm.request.fence): ``forward_fence`` (invariant 16) is named
when a page a request still needs is let go of behind its back, ``conservation`` when a page
is held twice or by no request, ``release_once_after_fence`` when a settled request is sent
back holding something; the borrowed checkpoint is let go when the pass copying it returns,
and the request records' calls table and terminal states come from the spec."""

from __future__ import annotations

import pytest
from core_helpers import h1
from facade_helpers import borrowing

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


# ----------------------------------------------------------------------------- fence
def _violation(c: TieredCache) -> tuple[str, str]:
    from kvtier.fsm import InvariantViolation

    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    return exc.value.invariant, str(exc.value)


def test_a_page_held_by_two_requests_is_caught() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    c.admit("b", list("cd"), prompt_tokens=5, chunk_tokens=5)
    c.table.get("b").own["kv"].append(c.table.get("a").own["kv"][0])
    assert _violation(c) == ("conservation", "invariant 'conservation' violated by request 'b': "
                                             "page 0 of 'kv' also held by 'a'")


def test_a_caller_page_no_request_holds_is_caught() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    c.core.alloc_device({"kv": 2})
    assert _violation(c) == ("conservation", "invariant 'conservation' violated by the request table: "
                                             "5 caller pages in the core, 3 held by requests")


def test_a_settled_request_sent_back_with_pages_is_caught() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    c.step_done("a", 5)
    c.table.get("a").state = "waiting"
    assert _violation(c) == ("release_once_after_fence", "invariant 'release_once_after_fence' violated by "
                             "request 'a': waiting but still holds pages, locks, pins or borrows")


def test_canonical_pages_off_the_locked_path_are_caught() -> None:
    c = borrowing()
    c.table.get("b").canon["fh"] = [1, 0]
    assert _violation(c) == ("forward_fence", "invariant 'forward_fence' violated by request 'b': "
                                              "canonical pages of 'fh' are no longer its locked path's device pages")


def test_a_live_lock_with_its_pages_passes_and_a_released_one_is_caught() -> None:
    c = borrowing()
    r = c.table.get("b")
    c.core.unlock(r.lock)
    r.lock = None
    assert _violation(c) == ("forward_fence", "invariant 'forward_fence' violated by request 'b': "
                                              "reads canonical pages without a live lock")


def test_a_checkpoint_copied_without_its_borrow_is_caught() -> None:
    c = borrowing()
    r = c.table.get("b")
    c.core.release(r.ckpt_borrow)
    assert _violation(c) == ("forward_fence", "invariant 'forward_fence' violated by request 'b': "
                                              "copies a checkpoint it no longer borrows")
    r.ckpt_borrow = None
    assert _violation(c)[1].endswith("copies a checkpoint it no longer borrows")


def test_a_checkpoint_that_left_the_borrowed_node_is_caught() -> None:
    c = borrowing()
    c.table.get("b").ckpt_pages = {"swa": [4, 5, 6, 8]}
    assert _violation(c) == ("forward_fence", "invariant 'forward_fence' violated by request 'b': "
                                              "the checkpoint it copies left the borrowed node")


def test_a_fenced_request_with_readable_layers_is_caught() -> None:
    c = borrowing()
    r = c.table.get("b")
    r.state = "fenced"
    assert _violation(c) == ("forward_fence", "invariant 'forward_fence' violated by request 'b': "
                                              "fenced after a failed loadback, but layers read as ready")
    r.layers_failed = True
    c.check_invariants()


def test_the_borrowed_checkpoint_is_let_go_when_the_pass_that_copies_it_returns() -> None:
    c = borrowing()
    r = c.table.get("b")
    borrow = r.ckpt_borrow
    c.step_done("b", 4)
    assert (r.ckpt_borrow, r.ckpt_pages, borrow.released) == (None, {}, True)
    c.check_invariants()


def test_a_settled_request_sent_back_with_only_its_lock_is_caught() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.finish("a")
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    c.step_done("b", 1)
    r = c.table.get("b")
    c.table.free_own(r)
    r.state = "waiting"
    assert (r.lock is not None, r.pins, r.ckpt_borrow, r.own) == (True, [], None, {"kv": []})
    assert _violation(c) == ("release_once_after_fence", "invariant 'release_once_after_fence' violated by "
                             "request 'b': waiting but still holds pages, locks, pins or borrows")
