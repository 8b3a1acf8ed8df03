"""Stateful test of the raw node-residency machine on a small tree of plain nodes.

Random legal and illegal events on random nodes, with locks, borrows and pins taken
and released. After every step: each node's resources agree with what its state
declares in the spec, the host set is root-closed (invariant 1), the device set is
root-closed, and counts are never negative. A refused event changes nothing.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.fsm import LifecycleError
from kvtier.fsm.machines import node_lifecycle
from kvtier.fsm.spec import load_spec

MACHINE = node_lifecycle()
SPEC = load_spec().node
RESOURCES = {s.name: set(s.resources) for s in SPEC.states}
HOST_COPY = {"backed", "host", "loading"}
DEVICE_COPY = {"device", "writing", "backed", "loading"}


class Node:
    __slots__ = ("state", "label", "parent", "children", "lock_ref", "borrow_ref", "extra_pins",
                 "op_pin", "device", "host", "pending")

    def __init__(self, label: int, parent: "Node | None") -> None:
        self.state = "new"
        self.label = label
        self.parent = parent
        self.children: list[Node] = []
        self.lock_ref = self.borrow_ref = self.extra_pins = 0
        self.op_pin = self.device = self.host = self.pending = False

    @property
    def host_pin(self) -> int:
        return self.extra_pins + int(self.op_pin)

    def _parent_in(self, states: set[str]) -> bool:
        return self.parent is None or self.parent.state in states

    @property
    def parent_on_host(self) -> bool:
        return self._parent_in(HOST_COPY)

    @property
    def parent_on_device(self) -> bool:
        return self._parent_in(DEVICE_COPY)

    @property
    def parent_readable(self) -> bool:
        return self._parent_in({"device", "writing", "backed"})

    @property
    def has_device_child(self) -> bool:
        return any(c.state in DEVICE_COPY for c in self.children)

    @property
    def has_host_child(self) -> bool:
        return any(c.state in HOST_COPY | {"writing"} for c in self.children)

    def snapshot(self) -> tuple[Any, ...]:
        return (self.state, self.lock_ref, self.borrow_ref, self.extra_pins, self.op_pin,
                self.device, self.host, self.pending)


EFFECTS: dict[str, dict[str, Any]] = {
    "create": {"device": True},
    "writeback_submit": {"pending": True},
    "writeback_ack": {"pending": False, "host": True},
    "writeback_fail": {"pending": False},
    "demote": {"device": False},
    "drop_host": {"host": False},
    "loadback_submit": {"device": True, "op_pin": True},
    "loadback_layer_done": {},
    "loadback_ack": {"op_pin": False},
    "loadback_fail": {"op_pin": False, "device": False},
    "republish": {"device": True},
    "evict_device": {"device": False},
    "evict_host": {"host": False},
    "split": {},
}


class NodeMachineTest(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.refused = 0

    @initialize(shape=st.sampled_from([(-1, 0, 1, 0), (-1, 0, 1, 2), (-1, -1, 0, 1)]))
    def build_tree(self, shape: tuple[int, ...]) -> None:
        """Four nodes; shape[i] is the parent index of node i (-1: the root)."""
        for i, parent in enumerate(shape):
            p = self.nodes[parent] if parent >= 0 else None
            node = Node(i, p)
            if p is not None:
                p.children.append(node)
            self.nodes.append(node)

    @rule(index=st.integers(min_value=0, max_value=3), event=st.sampled_from(SPEC.events))
    def fire_any(self, index: int, event: str) -> None:
        """Any event, mostly illegal ones."""
        self._fire(self.nodes[index % len(self.nodes)], event)

    @rule(index=st.integers(min_value=0, max_value=3), data=st.data())
    def fire_allowed(self, index: int, data: st.DataObject) -> None:
        """An event the spec allows from the node's state (its guards may still refuse)."""
        node = self.nodes[index % len(self.nodes)]
        events = [e for e in SPEC.events if MACHINE.allowed(node.state, e)]
        if events:
            self._fire(node, data.draw(st.sampled_from(events)))

    def _fire(self, node: Node, event: str) -> None:
        if event == "loadback_fail" and node.has_device_child:
            # A failure cannot be refused; the core fails a loadback chain deepest
            # first, so a loading node never has device children when it fails.
            return
        before = node.snapshot()
        try:
            MACHINE.fire(node, event)
        except LifecycleError as err:
            assert err.event == event and err.state == before[0]
            assert node.snapshot() == before, "a refused event changed the node"
            self.refused += 1
            return
        for attr, value in EFFECTS[event].items():
            setattr(node, attr, value)

    @rule(index=st.integers(min_value=0, max_value=3), kind=st.sampled_from(["lock", "borrow", "pin"]),
          take=st.booleans())
    def count(self, index: int, kind: str, take: bool) -> None:
        node = self.nodes[index % len(self.nodes)]
        attr = {"lock": "lock_ref", "borrow": "borrow_ref", "pin": "extra_pins"}[kind]
        if kind == "pin" and node.state not in ("backed", "host"):
            return  # pins are taken on visible host copies only
        if kind != "pin" and node.state not in ("device", "writing", "backed"):
            return
        if take:
            setattr(node, attr, getattr(node, attr) + 1)
        elif getattr(node, attr) > 0:
            setattr(node, attr, getattr(node, attr) - 1)

    @invariant()
    def state_matches_resources(self) -> None:
        for n in self.nodes:
            declared = RESOURCES[n.state]
            assert n.device == ("device pages" in declared), (n.label, n.state)
            assert n.host == ("host pages" in declared), (n.label, n.state)
            assert n.pending == ("pending host reservation" in declared), (n.label, n.state)
            assert n.op_pin == ("host pin" in declared), (n.label, n.state)
            if n.host_pin:
                assert n.host, f"node {n.label} pinned without a host copy"

    @invariant()
    def root_closed_host_and_device(self) -> None:
        for n in self.nodes:
            if n.host or n.pending:
                assert n.parent is None or n.parent.host, f"root_closed_host: node {n.label}"
            if n.device:
                assert n.parent is None or n.parent.device, f"device set not root-closed at {n.label}"

    @invariant()
    def locked_and_borrowed_stay_on_device(self) -> None:
        for n in self.nodes:
            if n.lock_ref or n.borrow_ref:
                assert n.device, f"node {n.label} lost its device pages while locked or borrowed"

    @invariant()
    def counts_never_negative(self) -> None:
        assert all(n.lock_ref >= 0 and n.borrow_ref >= 0 and n.extra_pins >= 0 for n in self.nodes)

    @invariant()
    def removed_owns_nothing(self) -> None:
        for n in self.nodes:
            if n.state == "removed":
                assert not (n.device or n.host or n.pending or n.host_pin)


TestNodeMachine = NodeMachineTest.TestCase
TestNodeMachine.settings = settings(TestNodeMachine.settings, max_examples=max(300, TestNodeMachine.settings.max_examples), stateful_step_count=60)
