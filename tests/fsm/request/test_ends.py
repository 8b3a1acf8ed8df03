"""How a request stops (kvtier.fsm.request.ends), with scenarios from source_system.md
sections 2.3-2.4 and 5: an abort during a loadback waits for the acknowledgement
(AbortDuringLoadbackWaitsForAck); an abort during a retract or finish writeback discards it
(AbortDuringWriteBackWaitsForAckAndDiscardsHostState), and neither waits for nor poisons a
tree write-through; the deterministic victim abort
(AbortsOneDeterministicVictimAndSurvivorAdvancesNextRound), the largest request first and
none while anything is in flight; an abort of a fenced request waits for its pass; a
retract with a pass in flight is refused, one without releases the request's device pages
and a resume recovers its state; finish without its writeback, retract publishing the
exact continuation state (and adding it to a unit published without one), the checkpoint a
request ends with kept under a deeper one, an aborted request marked poisoned, a retracted
one holding nothing, deferred frees after an abort, and every failed retract writeback
counted as a scheduler abort.

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint)."""

from __future__ import annotations

import pytest
from core_helpers import h1, src
from facade_helpers import ack, free, fsnap, held, layer, only_node, prefill, seeded

from kvtier.fsm import Completion, Direction
from kvtier.fsm.errors import GuardRejected, IllegalTransition, UsageError
from kvtier.tiered import RequestEvent, TieredCache


def test_a_retracted_request_holds_no_own_page_and_no_room() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    r = c.table.get("a")
    assert (r.room, r.own) == (10, {"kv": [4]})
    c.retract("a")
    assert (r.state, r.room, r.own, r.reserved) == ("retracted", 0, {"kv": []}, 9)


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


def test_retract_adds_the_checkpoint_to_a_unit_published_without_one() -> None:
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    assert c.step_done("a", 5) == {}
    assert c.table.get("a").published == 1
    assert c.retract("a") == {"swa": [4, 5, 6, 7]}
    assert {n.key: n.dev_ckpt for n in c.core.nodes()} == {("a",): {"swa": [4, 5, 6, 7]}}


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
