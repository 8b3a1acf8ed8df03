"""Radix nodes, receipts and operation records on their own (kvtier.fsm.node, kvtier.fsm.node.ops):
fields, guard inputs, reprs, and a new node's reuse owner, turn and ``reloaded`` flag (also
for a node an L3 get created)."""

from __future__ import annotations

import dataclasses

import pytest
from core_helpers import free, h1, keys, put

from kvtier.fsm import CacheCore
from kvtier.fsm.node import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE, LockReceipt, Node, NodeReceipt
from kvtier.fsm.node.ops import LayerProgress, Operation, Settled
from kvtier.fsm.records import Direction, TransferCommand


def chain() -> tuple[Node, Node, Node]:
    root = Node(0, (), None)
    a = Node(1, ("a", "b"), root)
    b = Node(2, ("c",), a)
    root.children["a"] = a
    a.children["c"] = b
    return root, a, b


def test_state_sets() -> None:
    assert DEVICE_READABLE == {"device", "writing", "backed"}
    assert DEVICE_RESIDENT == {"device", "writing", "backed", "loading"}
    assert HOST_VISIBLE == {"backed", "host", "loading"}
    assert HOST_PENDING == {"writing", "fetching"}


def test_new_node_fields() -> None:
    root, a, b = chain()
    assert (root.depth, a.depth, b.depth) == (0, 2, 3)
    assert (b.node_id, b.label, b.state, b.key, b.parent) == (2, 2, "new", ("c",), a)
    assert root.is_root and not a.is_root
    assert (b.lock_ref, b.borrow_ref, b.host_pin, b.hit_count, b.last_access) == (0, 0, 0, 0, 0)
    assert (b.wb_op, b.lb_op, b.chunk_checkpoint) == (None, None, False)
    assert b.dev == b.host == b.pending == b.dev_ckpt == b.host_ckpt == b.pending_ckpt == {}
    assert b.children == {} and b.refs == frozenset()
    assert repr(b) == "<node 2 new depth=3 units=1>"
    assert b.path() == [b, a] and a.path() == [a] and root.path() == []


def test_refs_set_exists_only_while_a_receipt_lists_the_node() -> None:
    # a node no receipt lists allocates no set: every such node shows the one shared empty view
    _, a, b = chain()
    a.discard_ref(5)  # absent: no error
    assert a.refs == frozenset() and a.refs is b.refs
    a.add_ref(5)
    a.add_ref(6)
    assert a.refs == {5, 6} and a.refs is not b.refs and b.refs == frozenset()
    a.discard_ref(5)
    assert a.refs == {6}
    a.discard_ref(6)
    assert a.refs == frozenset() and a.refs is b.refs  # the set was dropped once empty


def test_parent_on_host() -> None:
    root, a, b = chain()
    assert a.parent_on_host  # parent is the root
    for state, want in [("new", False), ("device", False), ("backed", True), ("host", True),
                        ("loading", True), ("writing", False)]:
        a.state = state
        assert b.parent_on_host is want, state
    a.state = "writing"
    a.wb_op = b.wb_op = 4  # parent written back by the same operation
    assert b.parent_on_host
    b.wb_op = 5
    assert not b.parent_on_host
    a.wb_op = b.wb_op = None  # no operation is not "the same operation"
    assert not b.parent_on_host


def test_parent_on_device_and_readable() -> None:
    root, a, b = chain()
    assert a.parent_on_device and a.parent_readable
    for state in ("new", "device", "writing", "backed", "host", "loading", "removed"):
        a.state = state
        assert b.parent_on_device is (state in DEVICE_RESIDENT), state
        assert b.parent_readable is (state in DEVICE_READABLE), state


def test_device_and_host_children() -> None:
    root, a, b = chain()
    for state in ("new", "device", "writing", "backed", "host", "loading", "removed"):
        b.state = state
        assert a.has_device_child is (state in DEVICE_RESIDENT), state
        assert a.has_host_child is (state in HOST_VISIBLE or state == "writing"), state
    assert not b.has_device_child and not b.has_host_child


def test_receipts() -> None:
    _, a, b = chain()
    pin = NodeReceipt(3, "pin", [a, b], "r1")
    assert (pin.receipt_id, pin.kind, pin.nodes, pin.owner, pin.released) == (3, "pin", [a, b], "r1", False)
    assert repr(pin) == "<pin receipt 3 owner='r1' nodes=[1, 2]>"
    lock = LockReceipt(4, b, None)
    assert (lock.receipt_id, lock.node, lock.owner, lock.released) == (4, b, None, False)
    assert repr(lock) == "<lock receipt 4 owner=None node=2>"
    with pytest.raises(AttributeError):
        lock.extra = 1  # type: ignore[attr-defined]


def test_operation_record() -> None:
    _, a, b = chain()
    cmd = TransferCommand(7, "loadback", (), (0,), request_id="r", node_ids=(1, 2))
    op = Operation(cmd, [a, b], checkpoint=b)
    assert (op.op_id, op.direction, op.nodes, op.checkpoint) == (7, Direction.LOADBACK, [a, b], b)
    assert (op.acked, op.ok, op.layers, op.seen) == (set(), True, {}, set())
    assert Operation(cmd, []).checkpoint is None
    s = Settled(7, Direction.LOADBACK, True, "r", (1, 2))
    assert s.expired is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ok = False  # type: ignore[misc]
    assert LayerProgress(7, 3) == LayerProgress(op_id=7, layer=3)
    for record, field in ((s, "ok"), (LayerProgress(7, 3), "layer")):
        assert not hasattr(record, "__dict__")  # slotted
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, 1)


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
