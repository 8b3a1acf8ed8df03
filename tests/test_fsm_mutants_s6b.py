"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) left unchecked in
``transfers.py``, ``node.py`` and ``pages.py``, session 6: a loadback with history replay
whose terminal has no host checkpoint loads no checkpoint, the operation's own pin is
owned by ``op <id>``, a writeback acknowledgement clears ``reloaded``, ``limit=0`` submits
no writeback, the one-by-one writeback pass goes on past a node whose parent lost its host
copy; a new node's reuse owner, turn and ``reloaded`` flag; released numpy page ids come
back as plain ints and released non-integers are refused; an allocator's free state."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import ack, free, h1, put, src

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.pages import PageAllocator


def keys(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _fetched(c: CacheCore, ks: list[str], op_id: int = 900) -> list:
    """Two-step L3 get of ``ks`` under the root, every node acknowledged (state host)."""
    nodes = c.fetches.reserve(c.root, ks, op_id)
    assert [n.state for n in nodes] == ["fetching"] * len(ks)
    assert c.fetches.settle(op_id, len(ks)) == nodes
    c.check_invariants()
    return nodes


# ------------------------------------------------------------------ node defaults
def test_a_new_node_has_no_reuse_owner_so_an_empty_owner_counts_its_first_reuse() -> None:
    """node.py:85: ``last_owner`` starts as None (no request counted a reuse yet), so a
    lock by the owner ``""`` counts one (only an owner equal to the last one does not)."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, keys("a", 2)).node
    assert (n.hit_count, n.last_owner) == (0, None)
    lk = c.lock(n, "")
    assert (n.hit_count, n.last_owner) == (1, "")
    c.unlock(lk)
    lk = c.lock(n, "")  # the same owner again: no second reuse
    assert (n.hit_count, n.last_owner) == (1, "")
    c.unlock(lk)
    f = _fetched(c, ["f0"])[0]  # a node made by an L3 get starts the same way
    assert (f.hit_count, f.last_owner) == (0, None)
    c.check_invariants()


def test_a_fetched_node_starts_at_turn_one_and_so_does_a_request_extending_it() -> None:
    """node.py:86: a node an L3 get created has turn 1 (publish sets the turn only of the
    nodes it creates); a request publishing below such a leaf used by no other request
    continues its turn (1), so the new leaf and the path keep turn 1."""
    c = CacheCore(h1(), 8, 8, policy="write_back")
    f0, f1 = _fetched(c, ["f0", "f1"])
    assert (f0.turns, f1.turns) == (1, 1)
    assert (f0.state, f1.state, f1.hit_count) == ("host", "host", 0)
    r = put(c, ["f0", "f1", "g0"])  # republishes the fetched nodes, creates one leaf below
    assert [n.node_id for n in r.created] == [r.node.node_id]
    assert r.node.parent is f1
    assert (f0.state, f1.state) == ("backed", "backed")
    assert (f0.turns, f1.turns, r.node.turns) == (1, 1, 1)


def test_a_republished_fetched_node_is_not_a_loaded_back_duplicate() -> None:
    """node.py:94: ``reloaded`` starts False: a node an L3 get created and a request then
    republished is ``backed`` without a loadback, so host-only host eviction spares it even
    with an exclusive host tier (only loaded-back copies are duplicates there)."""
    c = CacheCore(h1(), 8, 4, policy="write_back", exclusive=True)
    f0, f1 = _fetched(c, ["f0", "f1"])
    assert (f0.reloaded, f1.reloaded) == (False, False)
    assert f0.reloaded is False and f1.reloaded is False
    put(c, ["f0", "f1"])
    assert (f0.state, f1.state, f1.reloaded) == ("backed", "backed", False)
    assert f0.reloaded is False and f1.reloaded is False
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}
    assert (f0.state, f1.state, c.stats.host_drops) == ("backed", "backed", 0)
    assert free(c, "host") == {"kv": 2}
    c.check_invariants()


# ------------------------------------------------------------------ pages.py
def test_released_numpy_page_ids_are_stored_and_handed_out_as_plain_ints() -> None:
    """pages.py:98: numpy integer page ids are converted to plain ints on release."""
    a = PageAllocator("device", "kv", 4)
    assert a.alloc(3) == [0, 1, 2]
    a.release([np.int64(1), np.int32(2)])
    state = a.free_state()
    assert state == (1, (1, 2))
    assert [type(p) for p in state[1]] == [int, int]
    got = a.alloc(2)
    assert got == [2, 1] and [type(p) for p in got] == [int, int]
    assert a.free_pages() == frozenset({3}) and a.used == 3


@pytest.mark.parametrize("bad", [1.0, True, "1"])
def test_releasing_a_page_id_that_is_not_an_integer_is_refused(bad: object) -> None:
    """pages.py:98: a float, a bool or a str is not a page id (nothing is released)."""
    a = PageAllocator("host", "kv", 4)
    assert a.alloc(2) == [0, 1]
    with pytest.raises(InvariantViolation, match="release of pages that are not allocated"):
        a.release([bad])
    assert a.free_state() == (2, ()) and a.used == 2 and a.free == 2


def test_free_state_counts_the_ids_never_allocated() -> None:
    """pages.py:119: (capacity - ids handed out so far, the freed ids in release order)."""
    a = PageAllocator("device", "kv", 8)
    assert a.free_state() == (8, ())
    assert a.alloc(3) == [0, 1, 2]
    assert a.free_state() == (5, ())
    a.release([1, 0])
    assert a.free_state() == (5, (1, 0))
    assert a.alloc(1) == [0]
    assert a.free_state() == (5, (1,))
    assert a.alloc(6) == [1, 3, 4, 5, 6, 7]
    assert a.free_state() == (0, ())


# ------------------------------------------------------------------ transfers.py: loadback
def test_a_history_replay_loadback_without_a_host_checkpoint_loads_history_only() -> None:
    """transfers.py:59: with state groups, a loadback loads the terminal's checkpoint only
    when the terminal has one on the host; a history-replay hit ends at a node without
    one, so only its ``fh`` pages move and no ``swa`` page is taken."""
    c = CacheCore(src(), {"fh": 8, "swa": 8}, {"fh": 8, "swa": 8})
    r = put(c, "abcde")
    ack(c, c.writeback(r.node))
    assert c.evict_device({"fh": 5}) == {"fh": 5, "swa": 0}
    m = c.match(list("abcde"), history_replay=True)
    assert (m.host_nodes, m.terminal, m.recompute_tokens) == ((r.node,), r.node, 16)
    assert r.node.host_ckpt == {}
    res = c.load(m, "r1")
    assert res.command is not None
    assert [(t.group, len(t.src_pages), len(t.dst_pages)) for t in res.command.transfers] == [("fh", 5, 5)]
    assert (free(c), r.node.dev_ckpt) == ({"fh": 3, "swa": 8}, {})
    assert c.receipts.get(-res.command.op_id).owner == f"op {res.command.op_id}"
    ack(c, res.command)
    c.release(res.pin)
    c.unlock(res.lock)
    assert (r.node.state, r.node.dev_ckpt, free(c)) == ("backed", {}, {"fh": 3, "swa": 8})
    c.check_invariants()


def test_the_loadback_own_pin_is_owned_by_its_operation() -> None:
    """transfers.py:129: the operation's own pin (receipt id -op_id) names the op."""
    c = CacheCore(h1(), 4, 4, policy="write_through")
    n = put(c, keys("h", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and n.state == "host"
    res = c.load(c.match(keys("h", 2)), "r1")
    assert res.command is not None
    op = res.command.op_id
    own = c.receipts.get(-op)
    assert (own.kind, own.owner, [x.node_id for x in own.nodes]) == ("pin", f"op {op}", [n.node_id])
    assert res.pin.owner == "r1" and n.host_pin == 2
    assert repr(own) == f"<pin receipt {-op} owner='op {op}' nodes=[{n.node_id}]>"
    ack(c, res.command)
    with pytest.raises(KeyError):
        c.receipts.get(-op)
    c.release(res.pin)
    c.unlock(res.lock)
    assert n.host_pin == 0
    c.check_invariants()


# ------------------------------------------------------------------ transfers.py: writeback
def test_a_writeback_ack_clears_reloaded_even_on_a_node_a_loadback_brought_back() -> None:
    """transfers.py:163: a writeback acknowledgement makes the host copy the node's own
    (``reloaded`` False): with an exclusive host tier, host-only eviction then spares it.
    The node here was loaded back (reloaded True), lost its host copy to an exclusive
    host eviction (state device, the flag kept) and was written back again."""
    c = CacheCore(h1(), 4, 4, policy="write_through", exclusive=True)
    n = put(c, keys("h", 2)).node
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert (n.state, n.reloaded) == ("backed", False) and n.reloaded is False
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}  # its own copy: spared
    assert c.evict_device({"kv": 2}) == {"kv": 2} and n.state == "host"
    res = c.load(c.match(keys("h", 2)), "r1")
    assert res.command is not None
    ack(c, res.command)
    c.release(res.pin)
    c.unlock(res.lock)
    assert (n.state, n.reloaded) == ("backed", True)
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 2}  # a duplicate: dropped
    assert (n.state, n.reloaded) == ("device", True)
    cmd = c.writeback(n, "r2")
    assert cmd is not None and cmd.node_ids == (n.node_id,)
    ack(c, cmd)
    assert (n.state, n.reloaded) == ("backed", False) and n.reloaded is False
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}
    assert n.state == "backed" and c.stats.host_drops == 1
    c.check_invariants()


def test_issue_writebacks_with_limit_zero_submits_nothing() -> None:
    """transfers.py:249: a limit below 1 submits no operation, even when the whole batch
    would fit; the queue stays as it was."""
    c = CacheCore(h1(), 8, 8, policy="write_through")
    a = put(c, keys("a", 2)).node
    b = put(c, keys("b", 2)).node
    assert c.queued_writebacks() == [a.node_id, b.node_id]
    assert c.issue_writebacks(limit=0) == []
    assert c.issue_writebacks(limit=-1) == []
    assert (c.queued_writebacks(), c.ops_in_flight(), c.poll_commands()) == ([a.node_id, b.node_id], 0, [])
    assert (a.state, b.state, free(c, "host"), c.stats.writebacks) == ("device", "device", {"kv": 8}, 0)
    (cmd,) = c.issue_writebacks(limit=1)  # the batch is one operation
    assert cmd.node_ids == (a.node_id, b.node_id)
    c.check_invariants()


def test_one_by_one_writebacks_skip_a_node_whose_parent_lost_its_host_copy_and_go_on() -> None:
    """transfers.py:267: the batch of three queued nodes does not fit the host; one by one,
    N1's writeback takes the tail of P's host copy (P is split), so N2 (below P) waits, and
    N3 (below R) is still written back, taking the rest of P's copy.

    h1: one page per unit. Host 6 pages: P (2) and R (2) backed, 2 free. Queued, all at
    depth 3, in this order: N1 (3 units under the root), N2 (1 unit under P), N3 (1 unit
    under R). The batch (5 pages, P and R protected) is refused; N1 needs 3, evicts 1 page
    (P's last unit), N2's parent is now device-only, N3 needs 1 and evicts P's first unit."""
    c = CacheCore(h1(), 16, 6, policy="write_through")
    p = put(c, ["p0", "p1"]).node
    r = put(c, ["r0", "r1"]).node
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert (p.state, r.state, free(c, "host")) == ("backed", "backed", {"kv": 2})
    lk = c.lock(r, "keep-r-recent")  # P is the least recently used host leaf
    c.unlock(lk)
    n1 = put(c, ["a0", "a1", "a2"]).node
    n2 = put(c, ["p0", "p1", "q0"], {"kv": p.dev["kv"]}).node
    n3 = put(c, ["r0", "r1", "c0"], {"kv": r.dev["kv"]}).node
    assert (n1.depth, n2.depth, n3.depth) == (3, 3, 3)
    assert (n2.parent, n3.parent) == (p, r)
    assert c.queued_writebacks() == [n1.node_id, n2.node_id, n3.node_id]
    out = c.issue_writebacks()
    assert [cmd.node_ids for cmd in out] == [(n1.node_id,), (n3.node_id,)]
    assert (n1.state, n2.state, n3.state) == ("writing", "device", "writing")
    assert p.state == "device" and p.key == ("p1",) and p.parent is not None
    p_head = p.parent
    assert (p_head.key, p_head.state) == (("p0",), "device")
    assert r.state == "backed" and c.stats.host_drops == 2
    assert c.queued_writebacks() == [n2.node_id]
    assert free(c, "host") == {"kv": 0}
    for cmd in out:
        ack(c, cmd)
    assert (n1.state, n3.state) == ("backed", "backed")
    c.check_invariants()
