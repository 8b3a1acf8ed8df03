"""Exact values of the request lifecycle in fsm/ that the mutation run (bench/mutation,
issue 12) found unchecked: error messages naming the request, its state, the call and the
accepted states; the guard named alone when every candidate row shares it; the request
records' views and accounting."""

from __future__ import annotations

import pytest
from core_helpers import h1
from test_facade import ack, seeded

from kvtier.fsm import GuardRejected, UsageError
from kvtier.fsm.request import Request
from kvtier.tiered import TieredCache


def finished() -> TieredCache:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.finish("a")
    return c


# ----------------------------------------------------------------------------- request_table
def test_unknown_request_is_named() -> None:
    c = TieredCache(h1(), 12, None)
    with pytest.raises(UsageError) as exc:
        c.table.get("nope")
    assert str(exc.value) == "unknown request 'nope'"
    with pytest.raises(UsageError) as exc:
        c.table.get(5)
    assert str(exc.value) == "unknown request 5"


def test_a_call_refused_in_a_state_names_the_accepted_states() -> None:
    c = finished()
    with pytest.raises(UsageError) as exc:
        c.reserve("a", 1)
    assert str(exc.value) == "request 'a': reserve in state 'finished' (accepted in loading, running)"
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 1)
    assert str(exc.value) == ("request 'a': step_done in state 'finished' "
                              "(accepted in aborting, fenced, loading, running)")


def test_a_guard_of_a_single_row_is_named_as_the_lifecycle_names_it() -> None:
    """``abort`` in ``loading`` has one row ([!settled]); a settled record is refused with it."""
    t = TieredCache(h1(), 12, None).table
    r = Request("x", ["a"], 3)
    r.state = "loading"
    with pytest.raises(GuardRejected) as exc:
        t.check(r, "abort")
    assert exc.value.guards == ("!settled",)
    assert str(exc.value) == "request 'x': event 'abort' refused in state 'loading': guard '!settled' rejected it"
    r.ops.add(7)
    assert t.check(r, "abort") == "aborting"
    assert r.state == "loading"


def test_a_guard_shared_by_every_row_is_named_alone() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    with pytest.raises(GuardRejected) as exc:
        c.retract("a")
    assert exc.value.guards == ("settled",)
    assert str(exc.value) == "request 'a': event 'retract' refused in state 'running': guard 'settled' rejected it"
    assert c.state("a") == "running"


# ----------------------------------------------------------------------------- request
def test_views_of_an_overlapped_request_and_a_settled_one() -> None:
    """``b`` reserved pass 2 before pass 1 returned: its copies of ``a``'s published pages
    wait in its deferred frees; ``a`` is settled."""
    from kvtier.fsm.request import RequestView

    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    assert c.request("b") == RequestView("b", "running", 9, 10, 0, 1, (), None, False, {"kv": [9]},
                                         {"kv": [5, 6, 7, 8]}, (3,), 4)
    assert c.request("a") == RequestView("a", "running", 9, 9, 0, 0, (), None, True, {"kv": [4]}, {}, (2,), 4)
    r = c.table.get("b")
    assert (r.label, r.owed_forward, r.settled) == ("'b'", 1, False)
    c.step_done("b", 1)
    assert c.request("b").deferred_pages == {}
    assert (r.owed_forward, r.settled) == (0, True)


def test_reserve_adds_pages_only_to_the_groups_that_need_them() -> None:
    """h2: ``a`` 2 tokens per page, ``b`` 4; 5 tokens reserved hold 3 ``a`` and 2 ``b``
    pages (room 6 tokens); 7 tokens need one more ``a`` page and no ``b`` page."""
    from core_helpers import h2

    c = TieredCache(h2(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=5, chunk_tokens=5)
    c.step_done("a", 5)
    assert c.table.get("a").room == 6
    assert c.reserve("a", 2) == {"a": [3]}
    assert c.page_table("a") == {"a": [0, 1, 2, 3], "b": [0, 1]}
    assert c.table.get("a").room == 8
    assert c.reserve("a", 2) == {"a": [4], "b": [2]}


def test_request_records_crossing_the_facade_are_frozen() -> None:
    from dataclasses import FrozenInstanceError

    from kvtier.fsm.request import Admission, PollResult, RequestEvent, RequestView

    c = TieredCache(h1(), 12, None)
    adm = c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert isinstance(adm, Admission)
    poll = c.poll()
    records = [adm, poll, poll.events[0], c.request("a")]
    assert [type(x) for x in records] == [Admission, PollResult, RequestEvent, RequestView]
    for rec in records:
        # frozen and slotted: CPython 3.11 raises TypeError from the frozen __setattr__ of a
        # slotted class (its super() has no class cell), later versions FrozenInstanceError
        with pytest.raises((FrozenInstanceError, TypeError)):
            rec.commands = ()  # type: ignore[misc]
        assert not hasattr(rec, "__dict__")
    assert poll.commands == () and adm.request_id == "a"


# ----------------------------------------------------------------------------- fence
def _violation(c: TieredCache) -> tuple[str, str]:
    from kvtier.fsm import InvariantViolation

    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    return exc.value.invariant, str(exc.value)


def borrowing() -> TieredCache:
    """src(): ``a`` published 2 units with the checkpoint at 8 tokens; ``b`` hit them and
    owes its first pass, which copies that checkpoint (borrowed)."""
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("a")
    adm = c.admit("b", list("abcd"), prompt_tokens=12, chunk_tokens=4)
    assert adm is not None and adm.checkpoint_pages == {"swa": [4, 5, 6, 7]}
    r = c.table.get("b")
    assert (r.canon, r.own, r.ckpt_pages) == ({"fh": [0, 1]}, {"fh": [2], "swa": [3, 2, 1, 0]}, {"swa": [4, 5, 6, 7]})
    c.check_invariants()
    return c


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


def test_a_retracted_request_holds_no_own_page_and_no_room() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    r = c.table.get("a")
    assert (r.room, r.own) == (10, {"kv": [4]})
    c.retract("a")
    assert (r.state, r.room, r.own, r.reserved) == ("retracted", 0, {"kv": []}, 9)


def test_the_borrowed_checkpoint_is_let_go_when_the_pass_that_copies_it_returns() -> None:
    c = borrowing()
    r = c.table.get("b")
    borrow = r.ckpt_borrow
    c.step_done("b", 4)
    assert (r.ckpt_borrow, r.ckpt_pages, borrow.released) == (None, {}, True)
    c.check_invariants()


def test_release_frees_deferred_pages_too_exactly_once() -> None:
    """Releasing an overlapped request (as every path into a state that owns nothing does)
    gives back its deferred copies with its own pages."""
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    r = c.table.get("b")
    assert (r.deferred_pages(), r.own) == ({"kv": [5, 6, 7, 8]}, {"kv": [9]})
    before = c.core.external_pages("kv")
    assert {5, 6, 7, 8, 9} <= before
    c.table.release(r)
    assert (list(r.deferred), r.own, r.lock, r.pins) == ([], {"kv": []}, None, [])
    assert c.core.external_pages("kv") == before - {5, 6, 7, 8, 9}


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


# ----------------------------------------------------------------------------- admission
def test_too_few_unit_keys_are_refused_with_the_counts() -> None:
    c = TieredCache(h1(), 12, None)
    with pytest.raises(UsageError) as exc:
        c.admit("a", list("ab"), prompt_tokens=9, chunk_tokens=9)
    assert str(exc.value) == "request 'a': 9 prompt tokens need 4 unit keys, got 2"
    assert c.requests() == []


def test_resume_after_a_retract_mid_prefill_hits_its_own_terminal() -> None:
    """4 of 9 prompt tokens computed, then retracted: resuming matches exactly the 2 units
    it published (not the prompt's 4 unit keys) and continues from token 4."""
    from kvtier.fsm.request import Admission

    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=4)
    c.step_done("a", 4)
    assert c.retract("a") == {}
    assert c.resume("a", 5) == Admission("a", 4, 5, 4, 4, {"kv": [0, 1, 2, 3, 4]}, None, (), 0, 4, {})
    assert c.request("a").own_pages == {"kv": [2, 3, 4]}


# ----------------------------------------------------------------------------- completions
@pytest.mark.parametrize(("warm", "canon_after"), [(("a", "ab"), [3, 2]), (("a",), [3])])
def test_a_failed_loadback_keeps_only_the_device_prefix_its_lock_holds(warm: tuple[str, ...],
                                                                        canon_after: list[int]) -> None:
    """``abcd`` lives on the host; earlier requests loaded ``a`` (and ``b``) back as nodes of
    their own. ``z``'s loadback of the rest fails while its first pass is out: it is
    fenced, and its table keeps the canonical pages of every device node before the
    failed ones (their sum, not the last node's), no layer reads as ready, and its own
    page stays until the pass returns."""
    c = seeded(device=12)
    for rid in warm:
        adm = c.admit(rid, list(rid), prompt_tokens=2 * len(rid) + 1, chunk_tokens=2 * len(rid) + 1)
        assert adm is not None and adm.loadback_op is not None
        c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
        ack(c, adm.loadback_op)
        c.step_done(rid, adm.chunk_tokens)
        c.finish(rid)
    z = c.admit("z", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert z is not None and z.loadback_op is not None
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    r = c.table.get("z")
    assert len(r.canon["kv"]) == 4
    ack(c, z.loadback_op, ok=False)
    assert (c.state("z"), r.canon, r.own) == ("fenced", {"kv": canon_after}, {"kv": [4]})
    assert [c.layer_ready("z", i) for i in range(2)] == [False, False]
    c.step_done("z", 0)
    assert c.state("z") == "waiting" and c.request("z").own_pages == {}
    c.check_invariants()


def test_a_loadback_ack_publishes_no_second_checkpoint() -> None:
    """src(): ``ab`` with its checkpoint lives on the host only; ``b``'s loadback brings both
    back. Its acknowledgement publishes nothing new: no checkpoint pages are allocated for
    the hit terminal (which has one), so none wait in b's deferred frees."""
    from core_helpers import src
    from test_facade import prefill

    c = TieredCache(src(), 16, 16, policy="write_back", finish_writeback=True)
    prefill(c, "seed", "abcd", 9, checkpoint=True)
    c.finish("seed")
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id)
    assert c.core.evict_device({"fh": 100, "swa": 100}) == {"fh": 2, "swa": 4}
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None and b.checkpoint_pages == {"swa": [7, 6, 5, 4]}
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    free = {g: a.free for g, a in c.core.device.items()}
    ack(c, b.loadback_op)
    v = c.request("b")
    assert (v.state, v.own_pages, v.deferred_pages, v.owed_forward) == (
        "running", {"fh": [2], "swa": [3, 2, 1, 0]}, {}, 1)
    assert {g: a.free for g, a in c.core.device.items()} == free


@pytest.mark.parametrize("n", [1, 2])
def test_every_failed_retract_writeback_counts_as_a_scheduler_abort(n: int) -> None:
    c = TieredCache(h1(), 12, 12, policy="write_back")
    rids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        c.admit(rid, [f"{rid}{u}" for u in range(2)], prompt_tokens=5, chunk_tokens=5)
        c.step_done(rid, 5)
        c.retract(rid)
    cmds = c.poll().commands
    assert len(cmds) == n
    for cmd in cmds:
        ack(c, cmd.op_id, ok=False)
    assert [c.request(rid).reason for rid in rids] == ["retract writeback failed"] * n
    assert c.aborted_by_scheduler == n


def test_a_pass_that_computed_less_than_reserved_is_continued_from_its_tokens() -> None:
    """No pass out: the next reservation starts at the tokens computed (10), not at the
    end of the last reservation (13), so 2 more tokens need nothing new."""
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcdef"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.reserve("a", 4) == {"kv": [5, 6]}
    c.step_done("a", 1)
    assert (c.request("a").tokens, c.request("a").reserved_tokens) == (10, 13)
    assert c.reserve("a", 2) == {}
    assert c.request("a").reserved_tokens == 13


# ----------------------------------------------------------------------------- request_ends
def test_finish_without_finish_writeback_issues_none_and_returns_no_checkpoint() -> None:
    c = TieredCache(h1(), 12, 12, policy="write_back", finish_writeback=False)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.finish("a") == {}
    assert c.state("a") == "finished"
    assert c.poll().commands == ()


def test_retract_publishes_the_exact_continuation_state_at_its_terminal() -> None:
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.retract("a") == {"swa": [4, 5, 6, 7]}
    assert c.state("a") == "retracted"


@pytest.mark.parametrize("end", ["finish", "retract"])
def test_the_checkpoint_a_request_ends_with_survives_a_deeper_one(end: str) -> None:
    """The checkpoint published when a request finishes or retracts is a final one, not a
    chunk checkpoint: a deeper checkpoint published later by another request leaves it."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9, checkpoint=end == "finish")
    adopted = c.finish("a") if end == "finish" else c.retract("a")
    assert adopted == ({} if end == "finish" else {"swa": [4, 5, 6, 7]})
    b = c.admit("b", list("abcdefgh"), prompt_tokens=25, chunk_tokens=8)
    assert b is not None and (b.start_token, b.checkpoint_pages) == (8, {"swa": [4, 5, 6, 7]})
    deeper = c.step_done("b", 8, checkpoint=True)
    assert sorted(deeper["swa"]) == [8, 9, 10, 11]
    ckpts = {n.key: n.dev_ckpt for n in c.core.nodes()}
    assert ckpts == {("a", "b"): {"swa": [4, 5, 6, 7]}, ("c", "d"): deeper}


def test_an_aborted_request_is_marked_poisoned() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    r = c.table.get("a")
    assert r.poisoned is False
    c.abort("a", "gone")
    assert (r.state, r.reason, r.poisoned) == ("aborting", "gone", True)


# ----------------------------------------------------------------------------- forward
def test_step_done_refusals_name_what_is_owed_and_reserved() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=4)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 5)
    assert str(exc.value) == "request 'a': 5 tokens computed but only 4 reserved (state 'running')"
    c.step_done("a", 3)
    c.reserve("a", 2)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 4)
    assert str(exc.value) == "request 'a': 4 tokens computed but only 2 reserved (state 'running')"
    c.step_done("a", 2)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 1)
    assert str(exc.value) == "request 'a' (state 'running') owes no forward result"
    assert (c.request("a").tokens, c.request("a").reserved_tokens) == (5, 5)


def test_a_short_pass_after_a_checkpoint_hit_still_lets_go_of_the_checkpoint() -> None:
    c = borrowing()
    r = c.table.get("b")
    c.step_done("b", 1)  # no unit completes: the checkpoint copy is done all the same
    assert (r.ckpt_borrow, r.ckpt_pages, r.tokens) == (None, {}, 9)
    c.check_invariants()


def test_a_decode_step_that_completes_a_unit_publishes_it() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    c.step_done("a", 5)
    r = c.table.get("a")
    assert (r.published, r.tokens) == (2, 5)
    c.reserve("a", 1)
    c.step_done("a", 1, new_units=["c"])
    assert (r.published, r.tokens, r.units) == (3, 6, ["a", "b", "c"])
    assert sorted(n.key for n in c.core.nodes()) == [("a", "b"), ("c",)]


def test_a_decode_step_inside_a_unit_counts_its_tokens_and_drops_the_retract_checkpoint() -> None:
    """After the prompt (9 tokens, 4 units published) a one-token step completes no unit
    (the step_done fast path): tokens grow by one, and the continuation-state checkpoint
    asked for by the previous result no longer matches, so none is published at retract."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    r = c.table.get("a")
    assert (r.tokens, r.published, r.retract_ckpt) == (9, 2, True)
    c.reserve("a", 1)
    assert c.step_done("a", 1) == {}
    assert (r.tokens, r.published, r.retract_ckpt, r.results) == (10, 2, False, 2)
    c.reserve("a", 1)
    assert c.step_done("a", 1) == {}
    assert c.request("a").tokens == 11


def test_a_result_while_loading_returns_no_checkpoint() -> None:
    c = seeded()
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and c.state("b") == "loading"
    assert c.step_done("b", 1) == {}
    assert (c.state("b"), c.request("b").tokens) == ("loading", 9)


def test_request_records_defaults() -> None:
    """The optional fields of the public records default to "nothing": engines and tests
    build them with the required fields only."""
    from kvtier.fsm.request import Admission, RequestEvent, RequestView

    adm = Admission("a", 0, 4, 0, 0, {"kv": [1, 2]}, None, ())
    assert (adm.recompute_tokens, adm.history_hit_tokens, adm.checkpoint_pages) == (0, 0, {})
    assert RequestEvent("a", "finished").reason is None
    v = RequestView("a", "running", 4, 4, 0, 0, (), None)
    assert (v.settled, v.own_pages, v.deferred_pages, v.receipts, v.units) == (True, {}, {}, (), 0)
    other = Admission("b", 0, 4, 0, 0, {}, None, ())
    assert other.checkpoint_pages == {} and other.checkpoint_pages is not adm.checkpoint_pages


def test_the_checkpoint_at_the_prompts_last_full_unit_is_kept() -> None:
    """src() (4-token units): a 9-token prompt's chunk of 8 tokens ends at its last full
    unit; the checkpoint there is kept for later turns (even after ``a`` is aborted), not
    given way to a deeper one."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=8)
    assert c.step_done("a", 8, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.abort("a")
    assert c.state("a") == "aborted"
    b = c.admit("b", list("abcdefgh"), prompt_tokens=25, chunk_tokens=8)
    assert b is not None and (b.start_token, b.checkpoint_pages) == (8, {"swa": [4, 5, 6, 7]})
    deeper = c.step_done("b", 8, checkpoint=True)
    assert sorted(deeper["swa"]) == [8, 9, 10, 11]
    assert {n.key: n.dev_ckpt for n in c.core.nodes()} == {("a", "b"): {"swa": [4, 5, 6, 7]}, ("c", "d"): deeper}


def test_retract_adds_the_checkpoint_to_a_unit_published_without_one() -> None:
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    assert c.step_done("a", 5) == {}
    assert c.table.get("a").published == 1
    assert c.retract("a") == {"swa": [4, 5, 6, 7]}
    assert {n.key: n.dev_ckpt for n in c.core.nodes()} == {("a",): {"swa": [4, 5, 6, 7]}}


def test_a_new_request_record_holds_and_owes_nothing() -> None:
    r = Request("x", ["a", "b"], 5)
    assert (r.request_id, r.state, r.units, r.prompt_tokens) == ("x", "waiting", ["a", "b"], 5)
    assert (r.tokens, r.reserved, r.published, r.hit_tokens, r.room, r.passes, r.results) == (0, 0, 0, 0, 0, 0, 0)
    assert (r.canon, r.own, r.lock, r.pins, r.ops, r.layers, r.ckpt_borrow, r.ckpt_pages, list(r.deferred)) == (
        {}, {}, None, [], set(), {}, None, {}, [])
    assert (r.reason, r.has_loadback, r.has_own_writeback, r.layers_failed, r.poisoned, r.retract_ckpt) == (
        None, False, False, False, False, False)
    assert (r.settled, r.owed_forward, r.receipts(), r.deferred_pages()) == (True, 0, (), {})


def test_the_quiescence_report_counts_a_borrowed_checkpoint_and_the_lock_beside_it() -> None:
    """outstanding(): request 'b' holds one lock and one borrow (its hit's checkpoint, until
    its pass returns); no pin (a device hit); once the pass returns, the borrow is gone."""
    c = borrowing()
    out = c.outstanding()
    assert (out.locks, out.pins, out.borrows) == (len(c.core.receipts.locks()), 0, 1)
    c.step_done("b", 4)
    assert c.outstanding().borrows == 0
