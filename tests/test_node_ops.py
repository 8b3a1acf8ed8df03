"""Radix nodes, receipts and operation records on their own: fields, guard inputs, reprs."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.fsm.node import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE, LockReceipt, Node, NodeReceipt
from kvtier.fsm.ops import LayerProgress, Operation, Settled
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
