"""Completion routing (kvtier.fsm.request.completions): a failed retract writeback aborts the request
with a reason once the owed forward result is in
(FailedWriteBackAbortsAfterOutstandingForwardResult, source_system.md section 5); a
loadback failure or deadline fences the pages until the pass returns (at once back to
waiting with no pass out; late completions absorbed), one of two requests joined on a
loadback aborted while the other proceeds, layer readiness per layer and rank, a failed
loadback keeping only the device prefix its lock holds, and a loadback acknowledgement
publishing no second checkpoint.

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint)."""

from __future__ import annotations

import pytest
from core_helpers import h1
from facade_helpers import ack, free, fsnap, held, layer, only_node, prefill, seeded

from kvtier.fsm import Completion, KvtierError
from kvtier.fsm.errors import GuardRejected, IllegalTransition, UsageError
from kvtier.tiered import RequestEvent, TieredCache


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
    from facade_helpers import prefill

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


# ---------------------------------------------------------------------------- retract writeback failure
@pytest.mark.parametrize("owed", [False, True])
def test_failed_retract_writeback_aborts_with_reason(owed: bool) -> None:
    """FailedWriteBackAbortsAfterOutstandingForwardResult: a failed retract writeback
    aborts the request with a reason instead of resuming on missing data. With a forward
    result owed the retract is refused first (guard ``settled``), changing nothing."""
    c = TieredCache(h1(), 8, 8, policy="write_back")
    prefill(c, "a", "abcd", 8)
    if owed:
        assert c.reserve("a", 1) == {"kv": [4]}  # a decode step in flight, into a new page
        before = fsnap(c)
        with pytest.raises(GuardRejected) as exc:
            c.retract("a")
        assert exc.value.guards == ("settled",) and exc.value.event == "retract"
        assert str(exc.value) == "request 'a': event 'retract' refused in state 'running': guard 'settled' rejected it"
        assert fsnap(c) == before and c.page_table("a") == {"kv": [0, 1, 2, 3, 4]}
        c.step_done("a", 1)
    c.retract("a")
    assert c.state("a") == "retracting"
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id, ok=False)
    node = only_node(c)
    assert (node.state, node.host) == ("device", {}) and free(c, "host") == {"kv": 8}
    c.check_invariants()
    assert c.state("a") == "aborted" and node.lock_ref == 0 and held(c) == {"kv": 0}
    assert c.poll().events[-1] == RequestEvent("a", "aborted", "retract writeback failed")
    assert c.stats()["scheduler_aborts"] == 1 and c.requests() == []


def test_joined_request_aborted_other_proceeds() -> None:
    c = seeded()
    node = only_node(c)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    d = c.admit("d", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and d is not None and b.loadback_op is not None and d.loadback_op is None
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    c.abort("d")
    assert c.state("d") == "aborting"
    c.step_done("d", 0)
    assert c.state("d") == "aborting"  # still waits for the joined loadback
    ack(c, b.loadback_op)
    assert (c.state("b"), c.state("d")) == ("running", "aborted")
    assert (node.host_pin, node.lock_ref) == (0, 1)


def test_loadback_failure_fences_the_pages_until_the_pass_returns() -> None:
    """A loadback fails while the first chunk's pass (run layer by layer) is out: the
    request goes to ``fenced``, unpins, keeps its own page and reports no layer ready; the
    page is freed only by the pass's step_done, which sends it back to waiting."""
    c = seeded(world=2)
    node = only_node(c)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None and b.page_table == {"kv": [3, 2, 1, 0, 4]}
    c.poll()
    layer(c, b.loadback_op, 1)
    assert c.layer_ready("b", 0) and c.layer_ready("b", 1)
    c.complete(Completion(b.loadback_op, 0, True))
    c.complete(Completion(b.loadback_op, 1, False))
    c.check_invariants()
    v = c.request("b")
    assert (v.state, v.owed_forward, v.ops, v.own_pages) == ("fenced", 1, (), {"kv": [4]})
    assert c.page_table("b") == {"kv": [4]}  # the failed destination pages left its table
    assert (node.state, node.host_pin, node.lock_ref) == ("host", 0, 1) and held(c) == {"kv": 1}
    assert [c.layer_ready("b", k) for k in range(2)] == [False, False]
    # nobody can be handed its page while the pass is out
    other = c.admit("o", list("xyz"), prompt_tokens=7, chunk_tokens=7)
    assert other is not None and 4 not in other.page_table["kv"]
    before = fsnap(c)
    with pytest.raises(UsageError, match="'b' is already admitted: admit in state 'fenced'"):
        c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    with pytest.raises(UsageError, match="'b': reserve in state 'fenced'"):
        c.reserve("b", 1)
    with pytest.raises(IllegalTransition, match="'retract' refused in state 'fenced'"):
        c.retract("b")
    assert fsnap(c) == before
    assert [e.state for e in c.poll().events] == ["fenced", "running"]
    c.step_done("b", 1)  # the result is discarded
    c.check_invariants()
    v = c.request("b")
    assert (v.state, v.tokens, v.reserved_tokens, v.owed_forward, v.own_pages) == ("waiting", 0, 0, 0, {})
    assert node.lock_ref == 0 and held(c) == {"kv": 4} and [e.state for e in c.poll().events] == ["waiting"]
    assert [c.layer_ready("b", k) for k in range(2)] == [False, False]
    c.step_done("o", 7)
    c.abort("o")
    again = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert again is not None and again.loadback_op is not None and c.state("b") == "loading"
    assert c.layer_ready("b", 0) is False


def test_loadback_failure_with_no_pass_out_goes_back_to_waiting_at_once() -> None:
    c = seeded()
    node = only_node(c)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    c.step_done("b", 1)  # the pass returned before the loadback ended
    ack(c, b.loadback_op, ok=False)
    v = c.request("b")
    assert (v.state, v.tokens, v.owed_forward, v.own_pages) == ("waiting", 0, 0, {})
    assert (node.state, node.host_pin, node.lock_ref) == ("host", 0, 0) and held(c) == {"kv": 0}
    assert [c.layer_ready("b", k) for k in range(2)] == [False, False]


def test_loadback_deadline_fences_then_late_completions_are_absorbed() -> None:
    c = seeded(op_deadline_steps=2)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    c.poll()
    layer(c, b.loadback_op, 0)
    c.advance_step(2)
    assert c.state("b") == "loading" and c.layer_ready("b", 0)
    c.advance_step(1)
    c.check_invariants()
    # the request let go of its pin; the operation's own pin stays: its copy may still read the host pages
    assert c.state("b") == "fenced" and only_node(c).host_pin == 1 and held(c) == {"kv": 1}
    assert c.outstanding().fenced == (b.loadback_op,)
    assert not c.layer_ready("b", 0)  # the layer it had is no longer readable
    c.complete(Completion(b.loadback_op, 0, True))  # late: absorbed, and the copy ended: the fence goes
    assert c.core.stats.absorbed_late_completions == 1 and c.state("b") == "fenced"
    assert (only_node(c).host_pin, c.core.stats.fences_released, c.outstanding().fenced) == (0, 1, ())
    c.step_done("b", 0)
    assert c.state("b") == "waiting" and held(c) == {"kv": 0}
    c.check_invariants()


# ---------------------------------------------------------------------------- layer readiness
def test_layer_ready_gating() -> None:
    """A loading request's forward pass reads layer i only after layer i is complete on
    every rank; running requests read everything; the state changes only at the ack."""
    c = seeded(world=2)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    op = b.loadback_op
    assert not c.layer_ready("b", 0) and not c.layer_ready("b", 1)
    c.poll()
    layer(c, op, 1, ranks=[0])
    assert not c.layer_ready("b", 0)
    layer(c, op, 0, ranks=[1])
    assert c.layer_ready("b", 0) and not c.layer_ready("b", 1)
    layer(c, op, 1, ranks=[1])
    assert c.layer_ready("b", 1) and c.state("b") == "loading"
    c.step_done("b", 1)  # the forward pass may complete before the acknowledgement
    assert c.state("b") == "loading" and c.request("b").tokens == 9
    ack(c, op)
    assert c.state("b") == "running" and c.layer_ready("b", 1)
    prefill(c, "r", "xy", 5)
    assert c.layer_ready("r", 0) and c.layer_ready("r", 1)
    with pytest.raises(KvtierError, match="'nope'"):
        c.layer_ready("nope", 0)


def test_loadback_deadline_while_aborting_keeps_only_what_the_lock_holds() -> None:
    """An aborted request still owes its pass when its loadback expires: its table drops
    the failed destination pages (back in the pool) and keeps its own page until the pass
    returns (forward_fence; found by the stateful facade test)."""
    c = seeded(op_deadline_steps=2)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    c.abort("b", "gone")
    c.advance_step(3)
    c.check_invariants()
    v = c.request("b")
    assert (v.state, v.owed_forward, v.ops, v.own_pages) == ("aborting", 1, (), {"kv": [4]})
    assert c.page_table("b") == {"kv": [4]} and not c.layer_ready("b", 0)
    c.step_done("b", 0)
    assert c.state("b") == "aborted" and held(c) == {"kv": 0}
    c.check_invariants()
