"""The raw lifecycle machines: legal and illegal events fired at the spec's node and
request machines directly, on plain records (where rejections are exercised).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvtier.fsm.errors import InvariantViolation, LifecycleError
from kvtier.fsm.lifecycle.machines import Lifecycle, l3_lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.lifecycle.spec import load_spec

from .base import TERMINAL, KitMachine, recorded

__all__ = ["NodeLifecycleMachine", "RequestLifecycleMachine"]

_NODE_SPEC = load_spec().node
_NODE_RESOURCES = {s.name: set(s.resources) for s in _NODE_SPEC.states}
_HOST_COPY = {"backed", "host", "loading"}
_DEVICE_COPY = {"device", "writing", "backed", "loading"}


class _RawNode:
    __slots__ = ("state", "label", "parent", "children", "lock_ref", "borrow_ref", "extra_pins",
                 "op_pin", "device", "host", "pending")

    def __init__(self, label: int, parent: _RawNode | None) -> None:
        self.state = "new"
        self.label = label
        self.parent = parent
        self.children: list[_RawNode] = []
        self.lock_ref = self.borrow_ref = self.extra_pins = 0
        self.op_pin = self.device = self.host = self.pending = False

    @property
    def host_pin(self) -> int:
        return self.extra_pins + int(self.op_pin)

    def _parent_in(self, states: set[str]) -> bool:
        return self.parent is None or self.parent.state in states

    @property
    def parent_on_host(self) -> bool:
        return self._parent_in(_HOST_COPY)

    @property
    def parent_on_device(self) -> bool:
        return self._parent_in(_DEVICE_COPY)

    @property
    def parent_readable(self) -> bool:
        return self._parent_in({"device", "writing", "backed"})

    @property
    def has_device_child(self) -> bool:
        return any(c.state in _DEVICE_COPY for c in self.children)

    @property
    def has_host_child(self) -> bool:
        return any(c.state in _HOST_COPY | {"writing", "fetching"} for c in self.children)

    def snapshot(self) -> tuple[Any, ...]:
        return (self.state, self.lock_ref, self.borrow_ref, self.extra_pins, self.op_pin,
                self.device, self.host, self.pending)


_EFFECTS: dict[str, dict[str, Any]] = {
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
    "fetch_submit": {"pending": True},
    "fetch_ack": {"pending": False, "host": True},
    "fetch_fail": {"pending": False},
}


class NodeLifecycleMachine(KitMachine):
    """Random legal and illegal events on a small tree of plain nodes driven through the
    raw node-residency machine, with locks, borrows and pins taken and released. After
    every step each node's resources agree with its state's, the host and device sets
    are root-closed and counts are never negative; a refused event changes nothing."""

    kit_invariants = ("check_state_matches_resources", "check_root_closed", "check_borrowed_pages_stay",
                      "check_counts")

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[_RawNode] = []
        self.swept: set[str] = set()
        self.refused = 0
        self.machine: Lifecycle = node_lifecycle()

    @initialize(shape=st.sampled_from([(-1, 0, 1, 0), (-1, 0, 1, 2), (-1, -1, 0, 1)]),
                states=st.lists(st.sampled_from(range(6)), min_size=4, max_size=4))
    @recorded
    def build_tree(self, shape: list[int], states: list[int] | None = None) -> None:
        """Four nodes; shape[i] is the parent index of node i (-1: the root). Each starts
        in a state consistent with its parent's (root-closed device and host sets), picked
        by ``states[i]`` (0: new), with the resources its state declares."""
        picks = list(states or [0, 0, 0, 0])
        self.kit_set_args(shape=list(shape), states=picks)
        for i, parent in enumerate(shape):
            p = self.nodes[parent] if parent >= 0 else None
            node = _RawNode(i, p)
            if p is not None:
                p.children.append(node)
            options = [st_ for st_ in ("new", "device", "writing", "backed", "host", "loading")
                       if p is None or st_ == "new" or (
                           (st_ not in _DEVICE_COPY or p.state in _DEVICE_COPY)
                           and (st_ not in _HOST_COPY | {"writing"} or p.state in _HOST_COPY))]
            node.state = options[picks[i] % len(options)]
            declared = _NODE_RESOURCES[node.state]
            node.device = "device_pages" in declared
            node.host = "host_pages" in declared
            node.pending = "pending_host" in declared
            node.op_pin = "host_pin" in declared
            self.nodes.append(node)

    @rule()
    @recorded
    def probe_root(self) -> None:
        """Every event at the tree's root is refused and changes nothing: the root state
        is never the subject of an event."""
        root = _RawNode(-1, None)
        root.state = "root"
        for event in _NODE_SPEC.events:
            try:
                self.machine.fire(root, event)
            except LifecycleError:
                if root.state != "root":
                    raise InvariantViolation("state_matches_resources", "the root",
                                             f"a refused {event} moved it to {root.state}") from None
                continue
            raise InvariantViolation("state_matches_resources", "the root", f"{event} was accepted")

    @rule(index=st.integers(min_value=0, max_value=3), event=st.sampled_from(_NODE_SPEC.events))
    @recorded
    def fire_any(self, index: int, event: str) -> None:
        """Any event, mostly illegal ones."""
        self._fire(self.nodes[index % len(self.nodes)], event)

    @rule(index=st.integers(min_value=0, max_value=3), pick=st.integers(0, 20))
    @recorded
    def fire_allowed(self, index: int, pick: int) -> None:
        """An event the spec allows from the node's state (its guards may still refuse)."""
        node = self.nodes[index % len(self.nodes)]
        events = [e for e in _NODE_SPEC.events if self.machine.allowed(node.state, e)]
        if events:
            self._fire(node, events[pick % len(events)])

    @rule(index=st.integers(min_value=0, max_value=3), pick=st.integers(0, 20))
    @recorded
    def fire_legal(self, index: int, pick: int) -> None:
        """An event whose guards hold now (the node moves on through its lifecycle)."""
        node = self.nodes[index % len(self.nodes)]
        events = []
        for e in _NODE_SPEC.events:
            if self.machine.allowed(node.state, e):
                try:
                    self.machine.check(node, e)
                except LifecycleError:
                    continue
                events.append(e)
        if events:
            self._fire(node, events[pick % len(events)])

    def _fire(self, node: _RawNode, event: str) -> None:
        if event == "loadback_fail" and node.has_device_child:
            # A failure cannot be refused; the core fails a loadback chain deepest
            # first, so a loading node never has device children when it fails.
            return
        before = node.snapshot()
        try:
            self.machine.fire(node, event)
        except LifecycleError as err:
            assert err.event == event and err.state == before[0], "the error names the event and state"
            if node.snapshot() != before:
                raise InvariantViolation("state_matches_resources", f"node {node.label}",
                                         "a refused event changed the node") from None
            self.refused += 1
            return
        for attr, value in _EFFECTS[event].items():
            setattr(node, attr, value)
        self._sweep(node)

    def _sweep(self, node: _RawNode) -> None:
        """Once per state per run: every refused event from the node's new state."""
        if node.state in self.swept:
            return
        self.swept.add(node.state)
        for event in _NODE_SPEC.events:
            if not self.machine.allowed(node.state, event):
                before = node.snapshot()
                try:
                    self.machine.fire(node, event)
                except LifecycleError:
                    if node.snapshot() != before:
                        raise InvariantViolation("state_matches_resources", f"node {node.label}",
                                                 "a refused event changed the node") from None
                    continue
                raise InvariantViolation("state_matches_resources", f"node {node.label}",
                                         f"{event} accepted in {before[0]}, which the spec does not allow")

    @rule(event=st.sampled_from(_NODE_SPEC.events))
    @recorded
    def fire_at_root(self, event: str) -> None:
        """The root is never the subject of an event: every event is refused."""
        root = _RawNode(-1, None)
        root.state = "root"
        before = root.snapshot()
        try:
            self.machine.fire(root, event)
        except LifecycleError:
            if root.snapshot() != before:
                raise InvariantViolation("state_matches_resources", "the root", "a refused event changed it") from None
            return
        raise InvariantViolation("state_matches_resources", "the root", f"{event} was accepted")

    @rule(index=st.integers(min_value=0, max_value=3))
    @recorded
    def probe(self, index: int) -> None:
        """Fire every event the spec does not allow from the node's state (each must be
        refused, changing nothing) and check every allowed one without firing it."""
        node = self.nodes[index % len(self.nodes)]
        for event in _NODE_SPEC.events:
            if self.machine.allowed(node.state, event):
                try:
                    self.machine.check(node, event)
                except LifecycleError:
                    pass
            else:
                self._fire(node, event)

    @rule(index=st.integers(min_value=0, max_value=3), kind=st.sampled_from(["lock", "borrow", "pin"]),
          take=st.booleans())
    @recorded
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

    def check_state_matches_resources(self) -> None:
        for n in self.nodes:
            declared = _NODE_RESOURCES[n.state]
            got = (n.device, n.host, n.pending, n.op_pin)
            want = ("device_pages" in declared, "host_pages" in declared,
                    "pending_host" in declared, "host_pin" in declared)
            if got != want:
                raise InvariantViolation("state_matches_resources", f"node {n.label} ({n.state})",
                                         f"device/host/pending/pin {got}, the spec declares {want}")
            if n.host_pin and not n.host:
                raise InvariantViolation("loadback_source_pinned", f"node {n.label}", "pinned without a host copy")

    def check_root_closed(self) -> None:
        for n in self.nodes:
            if (n.host or n.pending) and not (n.parent is None or n.parent.host):
                raise InvariantViolation("root_closed_host", f"node {n.label}", "host copy under a parent without one")
            if n.device and not (n.parent is None or n.parent.device):
                raise InvariantViolation("state_matches_resources", f"node {n.label}", "device set not root-closed")

    def check_borrowed_pages_stay(self) -> None:
        for n in self.nodes:
            if (n.lock_ref or n.borrow_ref) and not n.device:
                raise InvariantViolation("borrowed_pages_stay", f"node {n.label}",
                                         "lost its device pages while locked or borrowed")

    def check_counts(self) -> None:
        for n in self.nodes:
            if min(n.lock_ref, n.borrow_ref, n.extra_pins) < 0:
                raise InvariantViolation("counts_with_receipts", f"node {n.label}", "a negative count")
            if n.state == "removed" and (n.device or n.host or n.pending or n.host_pin):
                raise InvariantViolation("state_matches_resources", f"node {n.label}", "removed but owns resources")


def _fire_as_spec_says(machine: Lifecycle, subject: Any, event: str, what: str) -> bool:
    """Fire ``event`` at a plain subject whose guard inputs are set: the machine must do
    exactly what the spec says (the first candidate whose guards hold, else a refusal that
    changes nothing). Returns whether it moved."""
    expected = next((t for t in machine.spec.candidates(subject.state, event)
                     if all(getattr(subject, g.name) != g.negated for g in t.guards)), None)
    before = subject.state
    try:
        machine.fire(subject, event)
    except LifecycleError:
        if expected is not None or subject.state != before:
            raise InvariantViolation("state_matches_resources", what,
                                     f"{event} refused in {before} (spec: {expected})") from None
        return False
    if expected is None or subject.state != expected.target:
        raise InvariantViolation("state_matches_resources", what,
                                 f"{event} from {before} went to {subject.state}, the spec says {expected}")
    return True


class _RawRequest:
    __slots__ = ("state", "label", "has_loadback", "has_own_writeback", "settled")

    def __init__(self, label: int) -> None:
        self.state = "waiting"
        self.label = label
        self.has_loadback = self.has_own_writeback = self.settled = False


class RequestLifecycleMachine(KitMachine):
    """Random events with random guard inputs at plain requests driven through the raw
    request machine: the result must be exactly the spec's (first candidate whose
    guards hold; otherwise a refusal that changes nothing)."""

    kit_invariants = ("check_states",)

    def __init__(self) -> None:
        super().__init__()
        self.machine: Lifecycle = request_lifecycle()
        self.reqs = [_RawRequest(i) for i in range(2)]
        self.swept: set[str] = set()

    @initialize(states=st.lists(st.sampled_from(range(len(load_spec().request.states))), min_size=2, max_size=2))
    @recorded
    def start(self, states: list[int]) -> None:
        """Each request starts in any state of the spec (plain requests own nothing)."""
        names = self.machine.spec.state_names
        for r, k in zip(self.reqs, states):
            r.state = names[k % len(names)]

    @rule(index=st.integers(0, 1), event=st.sampled_from(load_spec().request.events),
          has_loadback=st.booleans(), has_own_writeback=st.booleans(), settled=st.booleans())
    @recorded
    def fire(self, index: int, event: str, has_loadback: bool, has_own_writeback: bool, settled: bool) -> None:
        self._fire(index, event, has_loadback, has_own_writeback, settled)

    def _fire(self, index: int, event: str, has_loadback: bool, has_own_writeback: bool, settled: bool) -> None:
        r = self.reqs[index % len(self.reqs)]
        r.has_loadback, r.has_own_writeback, r.settled = has_loadback, has_own_writeback, settled
        if not _fire_as_spec_says(self.machine, r, event, f"request {r.label}"):
            return
        if r.state not in self.swept:  # once per state per run: every refused event from it
            self.swept.add(r.state)
            for e in self.machine.spec.events:
                if not self.machine.allowed(r.state, e):
                    self._fire(index, e, has_loadback, has_own_writeback, settled)

    @rule(index=st.integers(0, 1), pick=st.sampled_from(range(6)), has_loadback=st.booleans(),
          has_own_writeback=st.booleans(), settled=st.booleans())
    @recorded
    def fire_allowed(self, index: int, pick: int, has_loadback: bool, has_own_writeback: bool,
                     settled: bool) -> None:
        """An event the spec allows from the request's state (its guards may refuse)."""
        r = self.reqs[index % len(self.reqs)]
        events = [e for e in self.machine.spec.events if self.machine.allowed(r.state, e)]
        if events:
            self._fire(index, events[pick % len(events)], has_loadback, has_own_writeback, settled)

    @rule(index=st.integers(0, 1))
    @recorded
    def probe(self, index: int) -> None:
        """Fire every event the spec does not allow from the request's state."""
        r = self.reqs[index % len(self.reqs)]
        for event in self.machine.spec.events:
            if not self.machine.allowed(r.state, event):
                self._fire(index, event, r.has_loadback, r.has_own_writeback, r.settled)

    @rule(index=st.integers(0, 1), pick=st.sampled_from(range(8)))
    @recorded
    def fire_row(self, index: int, pick: int) -> None:
        """Take a transition of the spec from the request's state, with guard inputs set
        so that it applies (the machine must then pick exactly that row)."""
        r = self.reqs[index % len(self.reqs)]
        rows = [t for t in self.machine.spec.transitions if t.source == r.state]
        if not rows:
            return
        row = rows[pick % len(rows)]
        values = {"has_loadback": r.has_loadback, "has_own_writeback": r.has_own_writeback, "settled": r.settled}
        for g in row.guards:
            values[g.name] = not g.negated
        self._fire(index, row.event, values["has_loadback"], values["has_own_writeback"], values["settled"])

    @rule(index=st.integers(0, 1), state=st.sampled_from(range(len(load_spec().request.states))))
    @recorded
    def jump(self, index: int, state: int) -> None:
        """Put a request in any state of the spec (plain requests own nothing)."""
        names = self.machine.spec.state_names
        self.reqs[index % len(self.reqs)].state = names[state % len(names)]

    @rule(index=st.integers(0, 1))
    @recorded
    def restart(self, index: int) -> None:
        """A new request in the slot (after an end)."""
        r = self.reqs[index % len(self.reqs)]
        if r.state in TERMINAL:
            self.reqs[index % len(self.reqs)] = _RawRequest(r.label)

    def check_states(self) -> None:
        names = set(self.machine.spec.state_names)
        for r in self.reqs:
            if r.state not in names:
                raise InvariantViolation("state_matches_resources", f"request {r.label}", f"unknown state {r.state}")


class _RawObject:
    __slots__ = ("state", "label", "host_visible", "store_answered", "lease_holds")

    def __init__(self, label: int) -> None:
        self.state = "unknown"
        self.label = label
        self.host_visible = self.store_answered = self.lease_holds = False


_L3 = load_spec().l3
_L3_GUARDS = ("host_visible", "store_answered", "lease_holds")


class L3LifecycleMachine(KitMachine):
    """Random events with random guard inputs at plain L3 objects driven through the raw
    ``[l3]`` machine: the result must be exactly the spec's (first candidate whose guards
    hold; otherwise a refusal that changes nothing)."""

    kit_invariants = ("check_states",)

    def __init__(self) -> None:
        super().__init__()
        self.machine: Lifecycle = l3_lifecycle()
        self.objs = [_RawObject(i) for i in range(2)]
        self.swept: set[str] = set()

    def _fire(self, index: int, event: str, guards: tuple[bool, bool, bool]) -> None:
        o = self.objs[index % len(self.objs)]
        o.host_visible, o.store_answered, o.lease_holds = guards
        if not _fire_as_spec_says(self.machine, o, event, f"l3 object {o.label}"):
            return
        if o.state not in self.swept:  # once per state per run: every refused event from it
            self.swept.add(o.state)
            for e in self.machine.spec.events:
                if not self.machine.allowed(o.state, e):
                    self._fire(index, e, guards)

    @rule(index=st.integers(0, 1), event=st.sampled_from(_L3.events if _L3 is not None else ("-",)),
          guards=st.tuples(st.booleans(), st.booleans(), st.booleans()))
    @recorded
    def fire(self, index: int, event: str, guards: tuple[bool, bool, bool]) -> None:
        self._fire(index, event, tuple(guards))  # type: ignore[arg-type]

    @rule(index=st.integers(0, 1), pick=st.sampled_from(range(8)))
    @recorded
    def fire_row(self, index: int, pick: int) -> None:
        """Take a transition of the spec from the object's state, with guard inputs set so
        that it applies (the machine must then pick exactly that row)."""
        o = self.objs[index % len(self.objs)]
        rows = [t for t in self.machine.spec.transitions if t.source == o.state]
        if not rows:
            return
        row = rows[pick % len(rows)]
        values = {g: getattr(o, g) for g in _L3_GUARDS}
        for g in row.guards:
            values[g.name] = not g.negated
        self._fire(index, row.event, (values["host_visible"], values["store_answered"], values["lease_holds"]))

    @rule(index=st.integers(0, 1), state=st.sampled_from(range(len(_L3.states) if _L3 is not None else 1)))
    @recorded
    def jump(self, index: int, state: int) -> None:
        """Put an object in any state of the spec."""
        names = self.machine.spec.state_names
        self.objs[index % len(self.objs)].state = names[state % len(names)]

    def check_states(self) -> None:
        names = set(self.machine.spec.state_names)
        for o in self.objs:
            if o.state not in names:
                raise InvariantViolation("state_matches_resources", f"l3 object {o.label}", f"unknown state {o.state}")
