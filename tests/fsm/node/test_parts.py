"""The node core's parts on their own (issue 11, "Split fsm/cache.py"): receipts' holds,
an operation's own pin receipt across a split, the operation table's settled ids, the
writeback queue's views, and check_invariants() whose cost follows the pages in use,
never a pool's capacity."""

from __future__ import annotations

import itertools
import tracemalloc

import pytest
from core_helpers import ack, free, h1, put

from kvtier.fsm import CacheCore, KvtierError, UnknownOperation
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node.eviction import EvictionPolicy, HeapIndex
from kvtier.fsm.node import Node
from kvtier.fsm.node.pages import PageAllocator
from kvtier.fsm.node.receipts import ReceiptBook
from kvtier.fsm.records import Completion


# ----------------------------------------------------------------------------- receipts
def _chain() -> tuple[Node, Node]:
    root = Node(0, (), None)
    a = Node(1, ("a",), root)
    b = Node(2, ("b",), a)
    root.children["a"] = a
    a.children["b"] = b
    return a, b


def test_a_hold_takes_no_id_counts_no_hit_and_stamps_nothing() -> None:
    ids = itertools.count(10)
    touched: list[int] = []
    book = ReceiptBook(ids, lambda n: touched.append(n.node_id))
    a, b = _chain()
    hold = book.hold(b)
    assert hold.receipt_id == -1 and hold.node is b and hold.owner is None
    assert (a.lock_ref, b.lock_ref, a.hit_count, b.hit_count, a.last_access, b.last_access) == (1, 1, 0, 0, 0, 0)
    assert touched == [] and book.locks() == (hold,) and len(book) == 1
    book.unlock(hold, None)
    assert (a.lock_ref, b.lock_ref, a.last_access, b.last_access, hold.released) == (0, 0, 0, 0, True)
    assert touched == [2, 1] and book.locks() == ()
    assert book.hold(a).receipt_id == -2  # holds count down on their own
    assert next(ids) == 10  # the shared counter (node and receipt ids) was never drawn
    with pytest.raises(KvtierError, match=r"was already released or is unknown \(counts_with_receipts\)$"):
        book.unlock(hold, None)
    # a lock, by contrast, takes the next shared id, counts a hit and stamps the path
    lock = book.lock(b, "r", 7)
    assert (lock.receipt_id, b.hit_count, a.hit_count, b.last_access, a.last_access) == (11, 1, 1, 7, 7)


def test_load_holds_the_device_hit_without_using_an_id_or_a_stamp() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    b = put(c, "abcd", {"kv": a.dev["kv"]}).node
    ack(c, c.writeback(b))
    assert c.evict_device({"kv": 2}) == {"kv": 2} and (a.state, b.state) == ("backed", "host")
    clock, hits = c.clock, a.hit_count
    lr = c.load(c.match(list("abcd")), "r1")
    # ids: nodes 1, 2; then the load's pin 3 and lock 4 (the operation's own pin is -op_id)
    assert (lr.pin.receipt_id, lr.lock.receipt_id) == (3, 4)
    assert sorted(r.receipt_id for r in c.receipts.node_receipts()) == [-lr.command.op_id, 3]
    assert [r.receipt_id for r in c.receipts.locks()] == [4]  # the hold is gone
    assert (c.clock, a.hit_count, a.last_access) == (clock + 1, hits + 1, clock + 1)  # only the lock's
    assert put(c, "x").node.node_id == 5
    c.check_invariants()


# -------------------------------------------------------------------- an operation's own pin
def test_a_loadbacks_own_pin_is_split_with_its_operation() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "abcd").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    lr = c.load(c.match(list("abcd")), "r1")
    op_id = lr.command.op_id
    assert c.receipts.get(-op_id).nodes == [a] and a.host_pin == 2  # the op's pin and r1's
    c.match(list("abxy"))  # splits the loading node after two units
    c.check_invariants()
    p = a.parent
    assert p is not None and p is not c.root and p.key == ("a", "b") and a.key == ("c", "d")
    op = c.operations()[op_id]
    assert op.nodes == [p, a] and c.receipts.get(-op_id).nodes == [p, a] and lr.pin.nodes == [p, a]
    assert (p.state, p.lb_op, p.host_pin, a.host_pin) == ("loading", op_id, 2, 2)
    assert p.refs == a.refs == {-op_id, lr.pin.receipt_id}
    ack(c, lr.command)
    with pytest.raises(KeyError):
        c.receipts.get(-op_id)  # released with its operation, on both fragments
    assert (p.state, a.state, p.host_pin, a.host_pin) == ("backed", "backed", 1, 1)
    c.release(lr.pin)
    c.unlock(lr.lock)
    assert (p.host_pin, a.host_pin, p.refs, a.refs) == (0, 0, frozenset(), frozenset())
    c.check_invariants()


# -------------------------------------------------------------------------- operation table
def test_the_operation_table_knows_settled_ids_without_a_history() -> None:
    c = CacheCore(h1(), 8, 8)
    cmd = c.writeback(put(c, "ab").node)
    assert cmd.op_id in c.optable and not c.optable.settled(cmd.op_id) and len(c.optable) == 1
    ack(c, cmd)
    assert cmd.op_id not in c.optable and c.optable.settled(cmd.op_id) and len(c.optable) == 0
    assert not c.optable.settled(0) and not c.optable.settled(cmd.op_id + 1)
    assert c.complete(Completion(cmd.op_id)) == [] and c.stats.absorbed_late_completions == 1
    with pytest.raises(UnknownOperation, match=f"^completion for op {cmd.op_id + 1}: never issued$"):
        c.complete(Completion(cmd.op_id + 1))


# -------------------------------------------------------------------------- writeback queue
def test_the_writeback_queue_views() -> None:
    c = CacheCore(h1(), 8, 1, policy="write_back")
    x = put(c, "x").node
    ack(c, c.writeback(x, "r1"))  # the host's only page holds x's copy
    y = put(c, "y").node
    c.writebacks.want(y)
    assert (y.node_id in c.writebacks, len(c.writebacks), c.writebacks.node_ids()) == (True, 1, [y.node_id])
    assert not c.writebacks.refused(y.node_id)
    assert c.issue_writebacks() == []  # the host cannot take it
    assert (y.node_id in c.writebacks, len(c.writebacks), c.writebacks.refused(y.node_id)) == (False, 0, True)
    lock = c.lock(x)  # (else x, older and backed, would be demoted first)
    assert c.evict_device({"kv": 1}) == {"kv": 1}  # a refused node is dropped, not queued again
    assert (y.state, x.state, len(c.writebacks)) == ("removed", "backed", 0)
    assert not c.writebacks.refused(y.node_id)  # a node that left the tree is forgotten
    c.unlock(lock)
    c.check_invariants()


def test_the_default_eviction_index_is_an_eviction_policy() -> None:
    c = CacheCore(h1(), 8, 8)
    assert isinstance(c.eviction, HeapIndex)
    policy: EvictionPolicy = c.eviction  # (structural: mypy checks HeapIndex against the protocol)
    x = put(c, "x").node
    y = put(c, "y").node
    for n in (x, y):  # backed: victims of both tiers
        ack(c, c.writeback(n))
    assert [n.node_id for n in policy.device_candidates()] == [x.node_id, y.node_id]  # oldest first
    assert list(policy.device_candidates()) == []  # popped: forgotten until touched again
    assert list(policy.host_candidates()) == [x, y]  # the host heap has its own entries
    policy.touch(y)
    assert list(policy.device_candidates()) == [y] and list(policy.host_candidates()) == [y]


# ---------------------------------------------------------------- invariants vs capacity
HUGE = 10**14


def test_check_invariants_follows_the_pages_in_use_not_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    def capacity_walk(self: PageAllocator) -> None:
        raise AssertionError(f"check_invariants walked the {self.pool} pool's capacity")

    c = CacheCore(h1(), HUGE, HUGE)
    assert (c.device["kv"].capacity, c.host is not None and c.host["kv"].capacity) == (HUGE, HUGE)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    put(c, "abcd", a.dev)
    c.alloc_device({"kv": 3})
    monkeypatch.setattr(PageAllocator, "free_pages", capacity_walk)
    monkeypatch.setattr(PageAllocator, "free_order", capacity_walk)
    tracemalloc.start()
    try:
        c.check_invariants()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"check_invariants allocated {peak} bytes"
    # and it still finds a leak and a page both free and owned, by the pool's real counts
    c.host["kv"].alloc(1)  # type: ignore[index]
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert str(exc.value) == ("invariant 'conservation' violated by the cache: "
                              "host pool of 'kv': 3 pages allocated but 2 owned")
    c.host["kv"].release([2])  # type: ignore[index]
    c.device["kv"].release(a.dev["kv"][:1])
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert str(exc.value) == ("invariant 'conservation' violated by the cache: "
                              "device pages [0] of 'kv' free and owned")


def test_huge_pools_work_end_to_end() -> None:
    c = CacheCore(h1(), HUGE, HUGE, policy="write_through")
    a = put(c, "ab").node
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and a.state == "host"
    assert free(c) == {"kv": HUGE} and free(c, "host") == {"kv": HUGE - 2}
    lr = c.load(c.match(list("ab")), "r")
    ack(c, lr.command)
    c.release(lr.pin)
    c.unlock(lr.lock)
    assert a.state == "backed" and free(c) == {"kv": HUGE - 2}
    c.check_invariants()

