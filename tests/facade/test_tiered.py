"""Deterministic unit tests of the facade, :class:`kvtier.tiered.TieredCache` (issue 4).

Scenarios from source_system.md sections 2.3-2.4 and 5: abort during a loadback waits for
the acknowledgement (AbortDuringLoadbackWaitsForAck); abort during a retract or finish
writeback discards it (AbortDuringWriteBackWaitsForAckAndDiscardsHostState); the
deterministic victim abort (AbortsOneDeterministicVictimAndSurvivorAdvancesNextRound); a
failed retract writeback aborts with a reason once the owed forward result is in
(FailedWriteBackAbortsAfterOutstandingForwardResult); a second request joining a loadback
in flight; all-or-nothing admission; layer readiness; bad calls; poll's writeback bound;
retract releasing the request's device pages and resume by state recovery.

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint).
"""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import h1, snapshot, src
from facade_helpers import ack, free, fsnap, held, layer, only_node, prefill, seeded

from kvtier.fsm import Completion, ConfigError, Direction, KvtierError
from kvtier.fsm.errors import GuardRejected, IllegalTransition, UsageError
from kvtier.tiered import RequestEvent, TieredCache


# ---------------------------------------------------------------------------- abort vs loadback
@pytest.mark.parametrize("ack_first", [False, True])
def test_abort_during_loadback_waits_for_ack(ack_first: bool) -> None:
    """Source test 19: a client abort while the request's loadback is in flight keeps it
    (aborting), submits nothing new, and releases everything exactly once after both the
    acknowledgement and the owed forward result; no scheduler abort is reported."""
    c = seeded()
    node = only_node(c)
    adm = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None and c.state("b") == "loading"
    op = adm.loadback_op
    assert (adm.start_token, adm.hit_tokens, adm.device_hit_tokens, adm.wait_ops) == (8, 8, 0, (op,))
    assert [cmd.op_id for cmd in c.poll().commands] == [adm.loadback_op]  # handed out by poll only
    assert (node.state, node.host_pin, node.lock_ref) == ("loading", 2, 1)  # the op's pin and b's
    assert held(c) == {"kv": 1}  # b's own page for token 8
    c.abort("b", "client went away")
    c.check_invariants()
    assert c.request("b").state == "aborting" and c.request("b").reason == "client went away"
    assert (node.host_pin, node.lock_ref, held(c)) == (2, 1, {"kv": 1})  # nothing released yet
    out = c.poll()
    assert out.commands == () and out.events[-1] == RequestEvent("b", "aborting", None)
    layer(c, op, 1)  # every layer arrived: still waiting for the acknowledgement
    assert c.state("b") == "aborting"
    if ack_first:
        ack(c, op)
        assert c.state("b") == "aborting"  # the forward result is still owed
        assert (node.state, node.host_pin, node.lock_ref, held(c)) == ("backed", 1, 1, {"kv": 1})
        c.step_done("b", 0)
    else:
        c.step_done("b", 0)
        assert c.state("b") == "aborting"  # the loadback is still in flight
        assert node.host_pin == 2
        ack(c, op)
    c.check_invariants()
    assert c.state("b") == "aborted"
    # released exactly once: the loaded node stays in the tree (both copies), nothing held
    assert (node.state, node.host_pin, node.lock_ref, node.borrow_ref) == ("backed", 0, 0, 0)
    assert held(c) == {"kv": 0} and free(c) == {"kv": 4}
    assert not c.core.receipts.locks() and not c.core.receipts.node_receipts()
    out = c.poll()
    assert out.events == (RequestEvent("b", "aborted", "client went away"),)
    assert c.requests() == [] and c.stats()["scheduler_aborts"] == 0
    # the loaded pages are a device hit for the next request
    assert c.core.match(list("abc")).device_units == 3


# ---------------------------------------------------------------------------- abort vs own writeback
@pytest.mark.parametrize("how", ["retract", "finish"])
def test_abort_during_own_writeback_discards_it(how: str) -> None:
    """B10 / AbortDuringWriteBackWaitsForAckAndDiscardsHostState: an abort during the
    request's own writeback (retract or finish) waits for the ack on every rank and treats
    it as failed: no host copy is published, the host reservation is freed, the device copy
    stays in the tree."""
    c = TieredCache(h1(), 8, 8, policy="write_back", world_size=2, finish_writeback=True)
    prefill(c, "a", "abcd", 9)
    node = only_node(c)
    getattr(c, how)("a")
    c.check_invariants()
    assert c.state("a") == ("retracting" if how == "retract" else "finishing")
    (cmd,) = c.poll().commands
    assert (cmd.direction, cmd.request_id, cmd.node_ids) == (Direction.WRITEBACK, "a", (node.node_id,))
    assert free(c, "host") == {"kv": 4} and node.state == "writing"
    c.abort("a")
    c.check_invariants()
    assert c.state("a") == "aborting"
    c.complete(Completion(cmd.op_id, 0, True))
    assert c.state("a") == "aborting" and node.state == "writing"  # waits for every rank
    c.complete(Completion(cmd.op_id, 1, True))
    c.check_invariants()
    assert c.state("a") == "aborted"
    assert (node.state, node.host, node.pending, node.lock_ref) == ("device", {}, {}, 0)
    assert free(c, "host") == {"kv": 8} and c.core.stats.writeback_failures == 1
    assert held(c) == {"kv": 0} and free(c) == {"kv": 4}
    m = c.core.match(list("abcd"))
    assert (m.device_units, m.host_units) == (4, 4)  # a device hit, never a host one
    events = c.poll().events
    assert events[-1] == RequestEvent("a", "aborted", "aborted by client")
    assert c.requests() == [] and c.stats()["scheduler_aborts"] == 0


def test_abort_neither_waits_for_nor_poisons_tree_write_through() -> None:
    """Write-through of pages already published belongs to the tree: an abort of the
    request that published them ends at once and the writeback still succeeds."""
    c = TieredCache(h1(), 8, 8, policy="write_through", finish_writeback=False)
    prefill(c, "a", "abcd", 9)
    (cmd,) = c.poll().commands
    assert (cmd.direction, cmd.request_id) == (Direction.WRITEBACK, None)
    c.abort("a")
    assert c.state("a") == "aborted" and held(c) == {"kv": 0}
    ack(c, cmd.op_id)
    assert only_node(c).state == "backed" and c.core.stats.writeback_failures == 0
    assert c.poll().events[-1] == RequestEvent("a", "aborted", "aborted by client")
    assert c.requests() == []


# ---------------------------------------------------------------------------- victim abort
def two_blocked(z_prompt: int = 4, a_prompt: int = 4) -> TieredCache:
    """h1 with 4 device pages, no host: ``z-request`` and ``a-request`` prefilled, their
    pages published and locked, the device full: neither can reserve a decode page."""
    c = TieredCache(h1(), 4, None)
    prefill(c, "z-request", "zz"[: z_prompt // 2], z_prompt)
    prefill(c, "a-request", "aa"[: a_prompt // 2], a_prompt)
    assert free(c) == {"kv": 0}
    assert c.reserve("z-request", 1) is None and c.reserve("a-request", 1) is None
    c.check_invariants()
    return c


def test_victim_abort_deterministic_and_survivor_advances() -> None:
    """Source test 2: equal token counts, ties go to the smallest id: exactly
    ``a-request`` is aborted with the capacity reason; next round ``z-request`` decodes."""
    c = two_blocked()
    c.poll()
    assert c.abort_victim(["z-request", "a-request"]) == "a-request"
    c.check_invariants()
    assert (c.state("a-request"), c.state("z-request")) == ("aborted", "running")
    assert c.poll().events == (RequestEvent("a-request", "aborted", "cache capacity exhausted"),)
    assert c.stats()["scheduler_aborts"] == 1
    # the survivor advances: the victim's published pages are unlocked, so evictable
    pages = c.reserve("z-request", 1)
    assert pages is not None and len(pages["kv"]) == 1
    assert c.request("z-request").owed_forward == 1 and c.core.stats.device_evictions == 1
    c.check_invariants()


def test_victim_abort_prefers_the_largest_request() -> None:
    c = TieredCache(h1(), 4, None)
    prefill(c, "z-request", "z", 3)  # 3 tokens: 2 pages
    prefill(c, "a-request", "a", 2)  # 2 tokens: 1 page
    c.admit("b-request", list("bb"), prompt_tokens=5, chunk_tokens=5)  # blocked, 5 tokens
    assert c.state("b-request") == "waiting"
    assert c.abort_victim(["a-request", "z-request", "b-request"]) == "b-request"
    assert c.abort_victim(["a-request", "z-request"]) == "z-request"


def test_victim_abort_refused_while_anything_is_in_flight() -> None:
    c = two_blocked()
    # a forward result owed
    c2 = TieredCache(h1(), 4, None)
    c2.admit("x", list("xx"), prompt_tokens=4, chunk_tokens=4)
    before = fsnap(c2)
    assert c2.abort_victim(["x"]) is None and fsnap(c2) == before
    # an operation in flight (a tree writeback)
    c3 = TieredCache(h1(), 8, 8, policy="write_through", finish_writeback=False)
    prefill(c3, "x", "xx", 5)
    c3.poll()
    assert c3.core.operations()
    before = fsnap(c3)
    assert c3.abort_victim(["x"]) is None and fsnap(c3) == before
    # nothing blocked
    assert c.abort_victim([]) is None


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


def test_retract_writeback_success_then_resume() -> None:
    c = TieredCache(h1(), 8, 8, policy="write_back")
    prefill(c, "a", "abcd", 9)
    assert held(c) == {"kv": 1}  # the partial tail page
    c.retract("a")
    assert held(c) == {"kv": 0}  # released at once, before the ack
    (cmd,) = c.poll().commands
    node = only_node(c)
    assert node.lock_ref == 1
    ack(c, cmd.op_id)
    assert c.state("a") == "retracted" and node.state == "backed" and node.lock_ref == 0
    adm = c.resume("a", chunk_tokens=4)
    assert adm is not None and (adm.start_token, adm.chunk_tokens, adm.loadback_op) == (8, 1, None)
    assert c.state("a") == "running"


# ---------------------------------------------------------------------------- joining a loadback
def test_second_request_joins_loadback_in_flight() -> None:
    """A second request matching nodes another request is loading joins that loadback:
    its own pin, no second copy, it waits for the same op (layer progress already made
    counts), and one acknowledgement lets both proceed; the loaded pages become readable
    by other requests only after that acknowledgement."""
    c = seeded(world=2)
    node = only_node(c)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    op = b.loadback_op
    (b_load,) = c.poll().commands  # poll hands the admission's loadback out
    layer(c, op, 0)  # layer 0 complete on both ranks before the second request arrives
    assert c.core.match(list("abcd")).device_units == 0  # not readable by others yet
    d = c.admit("d", list("abcd") + ["e"], prompt_tokens=11, chunk_tokens=3)
    c.check_invariants()
    assert d is not None and d.loadback_op is None and d.wait_ops == (op,) and c.state("d") == "loading"
    assert (d.start_token, d.chunk_tokens) == (8, 3)
    assert c.poll().commands == ()  # no second loadback
    assert (node.host_pin, node.lock_ref) == (3, 2)  # the op's pin, b's and d's
    assert d.page_table["kv"][:4] == b.page_table["kv"][:4] == list(b_load.transfers[0].dst_pages)
    assert c.layer_ready("d", 0) and not c.layer_ready("d", 1)
    layer(c, op, 1, ranks=[0])
    assert not c.layer_ready("d", 1) and not c.layer_ready("b", 1)
    layer(c, op, 1, ranks=[1])
    assert c.layer_ready("d", 1) and c.layer_ready("b", 1)
    ack(c, op)  # one acknowledgement: both proceed
    assert (c.state("b"), c.state("d")) == ("running", "running")
    assert (node.state, node.host_pin, node.lock_ref) == ("backed", 0, 2)
    assert c.core.match(list("abcd")).device_units == 4
    for rid, tokens in (("b", 1), ("d", 3)):
        c.step_done(rid, tokens)
        c.finish(rid)
    assert (c.state("b"), c.state("d")) == ("finished", "finishing")  # d's unit "e" is written back
    (wb,) = c.poll().commands
    ack(c, wb.op_id)
    assert c.state("d") == "finished"
    assert held(c) == {"kv": 0} and node.lock_ref == 0 and c.poll().commands == ()
    assert c.requests() == []


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
    assert c.state("b") == "fenced" and only_node(c).host_pin == 0 and held(c) == {"kv": 1}
    assert not c.layer_ready("b", 0)  # the layer it had is no longer readable
    c.complete(Completion(b.loadback_op, 0, True))  # late: absorbed
    assert c.core.stats.absorbed_late_completions == 1 and c.state("b") == "fenced"
    c.step_done("b", 0)
    assert c.state("b") == "waiting" and held(c) == {"kv": 0}
    c.check_invariants()


def test_abort_of_a_fenced_request_waits_for_its_pass() -> None:
    c = seeded()
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    assert [e.state for e in c.poll().events] == ["loading"]  # its loadback command is handed out (complete() refuses one poll() has not)
    ack(c, b.loadback_op, ok=False)
    assert c.state("b") == "fenced"
    c.abort("b", "gone")
    assert c.state("b") == "aborting" and held(c) == {"kv": 1}
    c.check_invariants()
    c.step_done("b", 0)
    assert c.state("b") == "aborted" and held(c) == {"kv": 0}
    assert [e.state for e in c.poll().events] == ["fenced", "aborting", "aborted"]


# ---------------------------------------------------------------------------- admission
def test_admission_is_all_or_nothing() -> None:
    """Short of device pages after eviction, admit returns None and holds nothing."""
    c = TieredCache(h1(), 4, None)
    x = c.admit("x", list("ab"), prompt_tokens=5, chunk_tokens=5)  # 3 own pages, not yet published
    assert x is not None
    before = snapshot(c.core)
    assert c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5) is None
    c.check_invariants()
    assert snapshot(c.core) == before
    v = c.request("y")
    assert (v.state, v.owed_forward, v.ops, v.reserved_tokens) == ("waiting", 0, (), 0)
    assert c.page_table("y") == {"kv": []}
    assert [e.request_id for e in c.poll().events] == ["x"]  # y changed no state
    # it fits once x is done (x's published pages are evicted for it)
    c.step_done("x", 5)
    c.finish("x")
    assert c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5) is not None


def test_admission_with_loadback_is_all_or_nothing() -> None:
    """A host hit whose loadback plus first chunk does not fit pins nothing and issues
    no operation."""
    c = seeded()
    node = only_node(c)
    x = c.admit("x", list("zzzzzz"), prompt_tokens=13, chunk_tokens=13)  # 7 of 8 device pages
    assert x is not None
    before = snapshot(c.core)
    assert c.admit("y", list("abcd"), prompt_tokens=9, chunk_tokens=1) is None  # 4 + 1 pages
    c.check_invariants()
    assert snapshot(c.core) == before
    assert (node.state, node.host_pin, node.lock_ref) == ("host", 0, 0)
    assert c.poll().commands == () and not c.core.operations()


def test_admission_evicts_unlocked_tree_pages() -> None:
    c = TieredCache(h1(), 4, None)
    prefill(c, "x", "ab", 5)
    c.finish("x")  # its 2 published pages stay in the tree, unlocked
    assert free(c) == {"kv": 2}
    y = c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5)
    assert y is not None and c.core.stats.device_evictions == 1


def test_admission_never_reuses_the_whole_prompt() -> None:
    c = TieredCache(h1(), 8, None)
    prefill(c, "x", "abcd", 8)
    adm = c.admit("y", list("abcd"), prompt_tokens=8, chunk_tokens=8)
    assert adm is not None and (adm.start_token, adm.chunk_tokens) == (6, 2)


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


# ---------------------------------------------------------------------------- bad calls
def bad_call_cache() -> TieredCache:
    """Requests in several states: running (settled), aborting, retracted, waiting."""
    c = TieredCache(h1(), 10, 8, policy="write_back")
    prefill(c, "run", "ab", 5)
    c.admit("owes", list("cd"), prompt_tokens=3, chunk_tokens=3)
    prefill(c, "ret", "ef", 4)
    c.retract("ret")
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id)
    assert c.state("ret") == "retracted"
    prefill(c, "ab", "gh", 2)
    c.reserve("ab", 1)
    c.abort("ab")
    assert c.state("ab") == "aborting"
    assert c.admit("wait", list("ijkl"), prompt_tokens=9, chunk_tokens=9) is None
    c.check_invariants()
    return c


BAD_CALLS = [
    ("unknown abort", "nope", lambda c: c.abort("nope"), UsageError, "unknown"),
    ("unknown finish", "nope", lambda c: c.finish("nope"), UsageError, "unknown"),
    ("unknown step_done", "nope", lambda c: c.step_done("nope", 1), UsageError, "unknown"),
    ("unknown resume", "nope", lambda c: c.resume("nope", 1), UsageError, "unknown"),
    ("unknown retract", "nope", lambda c: c.retract("nope"), UsageError, "unknown"),
    ("unknown reserve", "nope", lambda c: c.reserve("nope", 1), UsageError, "unknown"),
    ("unknown request", "nope", lambda c: c.request("nope"), UsageError, "unknown"),
    ("finish before admit", "wait", lambda c: c.finish("wait"), IllegalTransition, "waiting"),
    ("resume of a running request", "run", lambda c: c.resume("run", 2), IllegalTransition, "running"),
    ("resume of a waiting request", "wait", lambda c: c.resume("wait", 2), IllegalTransition, "waiting"),
    ("double abort", "ab", lambda c: c.abort("ab"), IllegalTransition, "aborting"),
    ("step_done with nothing owed", "run", lambda c: c.step_done("run", 0), UsageError, "owes no forward"),
    ("step_done of a retracted request", "ret", lambda c: c.step_done("ret", 0), UsageError, "retracted"),
    ("finish while a forward result is owed", "owes", lambda c: c.finish("owes"), GuardRejected, "settled"),
    ("retract while a forward result is owed", "owes", lambda c: c.retract("owes"), GuardRejected, "settled"),
    ("retract of a waiting request", "wait", lambda c: c.retract("wait"), IllegalTransition, "waiting"),
    ("retract of an aborting request", "ab", lambda c: c.retract("ab"), IllegalTransition, "aborting"),
    ("reserve of a retracted request", "ret", lambda c: c.reserve("ret", 1), UsageError, "retracted"),
    ("finish of a retracted request", "ret", lambda c: c.finish("ret"), IllegalTransition, "retracted"),
    ("admit of a running request", "run", lambda c: c.admit("run", list("ab"), prompt_tokens=5, chunk_tokens=1),
     UsageError, "is already admitted: admit in state 'running'"),
    ("more tokens than reserved", "owes", lambda c: c.step_done("owes", 4), UsageError, "owes"),
    ("resume with no tokens", "ret", lambda c: c.resume("ret", 0), UsageError, "chunk_tokens"),
    ("reserve of no tokens", "run", lambda c: c.reserve("run", 0), UsageError, "tokens"),
    ("layer outside the model", "run", lambda c: c.layer_ready("run", 2), UsageError, "layer"),
    ("a numpy-like bool as tokens", "run", lambda c: c.reserve("run", True), UsageError, "tokens"),
]


@pytest.mark.parametrize(("what", "rid", "call", "error", "state"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(what: str, rid: str, call: Any, error: type, state: str) -> None:
    c = bad_call_cache()
    before = fsnap(c)
    with pytest.raises(error) as info:
        call(c)
    message = str(info.value)
    assert isinstance(info.value, KvtierError)
    if error is not ConfigError:
        assert repr(rid) in message, f"{what}: the error does not name the request: {message}"
    assert state in message, f"{what}: the error does not name {state!r}: {message}"
    assert fsnap(c) == before, f"{what} changed something"
    c.check_invariants()


def test_abort_after_the_end_is_reported_names_the_end() -> None:
    """After poll reported the end the record is forgotten: a call names the end, and
    state() / request() still answer from the bounded history of ended requests."""
    c = TieredCache(h1(), 4, None)
    prefill(c, "a", "ab", 5)
    c.abort("a")
    with pytest.raises(IllegalTransition, match="'a'.*'aborted'"):
        c.abort("a")
    c.poll()
    with pytest.raises(UsageError, match=r"^request 'a' has ended \(aborted\) and poll\(\) reported it$"):
        c.abort("a")
    assert c.state("a") == "aborted" and c.request("a").reason == "aborted by client"
    assert c.requests() == [] and c.quiescent()


def test_retract_with_a_pass_in_flight_is_refused_and_its_pages_stay() -> None:
    """The bug class of issue 11: retract used to free the pages a pass still writes, and
    the next admit received them. Now retract is refused (``settled``) until step_done;
    nothing changes, and the pages go to another request only after the pass returned."""
    c = TieredCache(h1(), 8, None)
    adm = c.admit("a", list("abcd"), prompt_tokens=8, chunk_tokens=8)
    assert adm is not None and adm.page_table == {"kv": [0, 1, 2, 3]}
    before = fsnap(c)
    for call in (c.retract, c.finish):
        with pytest.raises(GuardRejected) as exc:
            call("a")
        assert exc.value.guards == ("settled",) and exc.value.state == "running"
        assert fsnap(c) == before
    other = c.admit("b", list("wxyz"), prompt_tokens=8, chunk_tokens=8)
    assert other is not None and other.page_table == {"kv": [4, 5, 6, 7]}  # never a's pages
    c.check_invariants()
    c.step_done("a", 8)
    assert c.retract("a") == {} and c.state("a") == "retracted" and c.request("a").owed_forward == 0
    c.abort("a")
    assert c.state("a") == "aborted" and c.poll().events[-1] == RequestEvent("a", "aborted", "aborted by client")
    assert [v.request_id for v in c.requests()] == ["b"]  # an ended request owes nothing: forgotten
    with pytest.raises(UsageError, match=r"request 'a' has ended \(aborted\)"):
        c.step_done("a", 0)
    c.check_invariants()


def test_overlapped_pass_keeps_the_pages_step_done_lets_go_of() -> None:
    """Overlapped scheduling: pass 2 of ``b`` is reserved before step_done of pass 1. That
    step_done publishes b's units, which ``a`` already published: b's copies leave its
    table, but pass 2 may still read them, so they are freed only at step_done of pass 2."""
    c = TieredCache(h1(), 12, None)
    a = c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert a is not None and b is not None
    assert (a.page_table, b.page_table) == ({"kv": [0, 1, 2, 3, 4]}, {"kv": [5, 6, 7, 8, 9]})
    c.step_done("a", 9)
    assert c.reserve("b", 1) == {} and c.request("b").reserved_tokens == 10  # pass 2 starts at token 9
    assert c.step_done("b", 9) == {}
    v = c.request("b")
    assert c.page_table("b") == {"kv": [0, 1, 2, 3, 9]}  # canonical pages from now on
    assert (v.owed_forward, v.own_pages, v.deferred_pages) == (1, {"kv": [9]}, {"kv": [5, 6, 7, 8]})
    assert free(c) == {"kv": 2} and held(c) == {"kv": 6}
    c.check_invariants()
    x = c.admit("x", list("w"), prompt_tokens=3, chunk_tokens=3)
    assert x is not None and x.page_table == {"kv": [10, 11]}  # never b's copies
    assert c.admit("y", list("v"), prompt_tokens=1, chunk_tokens=1) is None  # nothing else is free
    c.step_done("b", 1)
    v = c.request("b")
    assert (v.tokens, v.owed_forward, v.deferred_pages) == (10, 0, {})
    assert free(c) == {"kv": 4} and held(c) == {"kv": 4}
    y = c.admit("y", list("v"), prompt_tokens=1, chunk_tokens=1)
    assert y is not None and y.page_table["kv"][0] in (5, 6, 7, 8)
    c.check_invariants()


def test_abort_frees_deferred_pages_once_its_passes_return() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    c.abort("b")
    assert c.state("b") == "aborting" and c.request("b").deferred_pages == {"kv": [5, 6, 7, 8]}
    c.check_invariants()
    c.step_done("b", 0)
    assert c.state("b") == "aborted" and held(c) == {"kv": 1} and free(c) == {"kv": 7}
    c.check_invariants()


# ---------------------------------------------------------------------------- poll
def wb_in_flight(c: TieredCache) -> list[int]:
    return sorted(op for op, o in c.core.operations().items() if o.direction is Direction.WRITEBACK)


@pytest.mark.parametrize("limit", [1, 2])
def test_poll_bounds_writebacks_and_returns_loadbacks_first(limit: int) -> None:
    """poll() issues tree writebacks only while fewer than ``max_writebacks_in_flight``
    writeback operations are in flight (however many nodes each carries), never holds a
    loadback back, and lists loadbacks first."""
    c = TieredCache(h1(), 16, 32, policy="write_through", finish_writeback=False, max_writebacks_in_flight=limit)
    prefill(c, "s", "pq", 4)
    c.finish("s")
    (seed_wb,) = c.poll().commands
    ack(c, seed_wb.op_id)
    c.core.evict_device({"kv": 2})  # "pq" on the host only
    keys = ["aa", "bb", "cc", "dd", "ee", "ff"]
    for k in keys[:2]:
        prefill(c, k, k, 4)  # new device nodes queued for write-through
    adm = c.admit("l", list("pq"), prompt_tokens=5, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None
    out = c.poll()
    assert out.commands[0].op_id == adm.loadback_op
    assert all(cmd.direction is Direction.WRITEBACK for cmd in out.commands[1:])
    assert 1 <= len(wb_in_flight(c)) <= limit
    for k in keys[2:]:
        prefill(c, k, k, 4)  # more nodes queued while writebacks are in flight
        before = wb_in_flight(c)
        issued = c.poll().commands
        assert len(before) + len(issued) <= limit
        assert not issued or len(before) < limit  # nothing new once the bound is reached
    while wb_in_flight(c):
        ack(c, wb_in_flight(c)[0])
        c.poll()
        assert len(wb_in_flight(c)) <= limit
    assert c.core.queued_writebacks() == []
    backed = sorted("".join(n.key) for n in c.core.nodes() if n.state == "backed")  # type: ignore[arg-type]
    assert backed == keys


# ---------------------------------------------------------------------------- retract and resume
def test_retract_releases_device_pages_and_resume_uses_state_recovery() -> None:
    """Unlike the original, retract releases the request's own device pages (the partial
    tail and its working state) at once, and the tree's after the ack; resume matches its
    own terminal exactly (state recovery), loading the continuation checkpoint back and
    recomputing only the partial tail."""
    lay = src()
    c = TieredCache(lay, 4, 8, policy="write_back")
    adm = c.admit("a", list("xy"), prompt_tokens=10, chunk_tokens=10)  # 2 units + 2 tail tokens
    assert adm is not None
    assert {g: len(p) for g, p in adm.page_table.items()} == {"fh": 3, "swa": 4}
    c.step_done("a", 10, checkpoint=True)
    c.check_invariants()
    before = free(c)
    c.retract("a")
    c.check_invariants()
    assert c.state("a") == "retracting"
    assert held(c) == {"fh": 0, "swa": 0}
    assert free(c)["fh"] == before["fh"] + 1  # the partial tail page, at once
    assert free(c)["swa"] == before["swa"] + 4  # its working state; the checkpoint is the tree's
    assert len(only_node(c).dev_ckpt["swa"]) == 4
    (cmd,) = c.poll().commands
    assert {t.group for t in cmd.transfers} == {"fh", "swa"}  # history and the exact state
    node = only_node(c)
    assert node.lock_ref == 1
    ack(c, cmd.op_id)
    assert c.state("a") == "retracted" and node.lock_ref == 0 and node.state == "backed"
    c.core.evict_device({"fh": 4})  # demoted: the terminal lives on the host only
    assert node.state == "host"
    res = c.resume("a", chunk_tokens=8)
    c.check_invariants()
    assert res is not None and res.loadback_op is not None and c.state("a") == "loading"
    assert (res.start_token, res.hit_tokens, res.chunk_tokens) == (8, 8, 2)
    (load,) = [cmd for cmd in c.poll().commands if cmd.op_id == res.loadback_op]
    assert {t.group for t in load.transfers} == {"fh", "swa"}
    ack(c, res.loadback_op)
    assert c.state("a") == "running"


def test_resume_without_the_exact_terminal_state_recomputes_from_scratch() -> None:
    """State recovery never settles for a shorter prefix: with the terminal gone the
    request recomputes from the start."""
    c = TieredCache(src(), 4, None)
    c.admit("a", list("xy"), prompt_tokens=10, chunk_tokens=10)
    c.step_done("a", 10, checkpoint=True)
    c.retract("a")
    assert c.state("a") == "retracted"  # no host tier: nothing to write back
    c.core.evict_device({"fh": 4})
    res = c.resume("a", chunk_tokens=16)
    assert res is not None and (res.start_token, res.hit_tokens, res.chunk_tokens) == (0, 0, 10)


def test_a_checkpoint_handed_out_at_admission_stays_until_the_forward_result() -> None:
    """R is admitted on X's chunk checkpoint (it copies it into its working state during
    its forward pass). Q, admitted before X existed, then publishes a deeper checkpoint
    through X: X's chunk checkpoint must not be dropped (its pages freed and reused)
    while R's forward pass still reads it (invariant 14)."""
    c = TieredCache(src(), 8, None)
    assert c.admit("Q", list("xy"), prompt_tokens=9, chunk_tokens=9) is not None
    assert c.admit("A", list("xy"), prompt_tokens=9, chunk_tokens=4) is not None
    c.step_done("A", 4, checkpoint=True)  # X = [x] with a chunk checkpoint
    c.abort("A")
    x = only_node(c)
    assert x.chunk_checkpoint and len(x.dev_ckpt["swa"]) == 4
    r = c.admit("R", list("xz"), prompt_tokens=9, chunk_tokens=5)
    assert r is not None and r.start_token == 4 and r.checkpoint_pages == x.dev_ckpt
    pages = list(r.checkpoint_pages["swa"])
    c.step_done("Q", 9, checkpoint=True)  # Y = [x, y] under X, with its own checkpoint
    c.check_invariants()
    assert x.dev_ckpt == {"swa": pages}
    assert not set(pages) & c.core.device["swa"].free_pages()
    c.step_done("R", 5)  # R's forward pass has copied it: the chunk checkpoint may go now
    c.check_invariants()
    assert x.borrow_ref == 0
    c.abort("R")
    c.finish("Q")
    c.check_invariants()
    assert c.poll().events and c.requests() == []
    assert all(n.borrow_ref == 0 and n.lock_ref == 0 for n in c.core.nodes())


def test_no_checkpoint_is_published_inside_a_history_replay_span() -> None:
    """With history replay the forward pass recomputes the span before the hit end only
    to rebuild the continuation state: the state at a unit boundary inside the span is not
    exact, so a checkpoint there is not published (invariant 15); at the hit end it is."""
    lay = src()
    assert lay.replay_span_tokens() == 16
    c = TieredCache(lay, 32, None, history_replay=True)
    prefill(c, "A", "abcdefgh", 33, checkpoint=True)  # one node of 8 units, checkpoint at its end
    c.finish("A")
    b = c.admit("B", list("abcdefgz"), prompt_tokens=33, chunk_tokens=4)
    assert b is not None
    assert (b.start_token, b.recompute_tokens, b.history_hit_tokens, b.checkpoint_pages) == (12, 16, 28, {})
    assert c.step_done("B", 4, checkpoint=True) == {}  # tokens 12..16: inside the span
    assert [n.depth for n in c.core.nodes() if n.dev_ckpt] == [8]
    assert c.reserve("B", 12) is not None
    adopted = c.step_done("B", 12, checkpoint=True)  # tokens 16..28: the hit end, exact again
    c.check_invariants()
    assert set(adopted) == {"swa"}
    assert sorted(n.depth for n in c.core.nodes() if n.dev_ckpt) == [7, 8]


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


def test_a_completion_before_poll_hands_out_its_command_is_refused() -> None:
    """poll() is the one place commands come from: a completion for a loadback whose
    command is still waiting to be handed out is refused and nothing changes (it used to
    run the request on pages no byte was loaded into, and poll() then handed out a
    command for a settled operation)."""
    c = seeded()
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None and c.state("b") == "loading"
    with pytest.raises(UsageError, match=f"op {b.loadback_op}: its command has not been handed out by poll"):
        c.complete(Completion(b.loadback_op))
    assert c.state("b") == "loading" and not c.layer_ready("b", 0)
    assert [cmd.op_id for cmd in c.poll().commands] == [b.loadback_op]
    ack(c, b.loadback_op)
    assert c.state("b") == "running" and c.layer_ready("b", 0)
