"""Public Hypothesis state machines for kvtier and for engines that embed it.

- :class:`CoreMachine` drives a :class:`~kvtier.fsm.core.CacheCore` the way a
  scheduler plus a transfer engine would (inserts, matches, locks, loadbacks,
  writebacks, completions in any order across ranks, failures, deadlines, pressure),
  with a byte-content model for invariant 12.
- :class:`FacadeMachine` drives the :class:`~kvtier.tiered.TieredCache` facade through a
  :class:`SchedulerAdapter` and a :class:`TransferBackend`: requests are admitted,
  computed, reserved, finished, retracted, resumed and aborted at any point, with
  completions reordered, delayed, failed per rank and expired. An engine subclasses it
  and overrides :meth:`FacadeMachine.make_scheduler` / :meth:`FacadeMachine.make_transfer`
  to run the same rules and invariants against its own integration.
- :class:`NodeLifecycleMachine` and :class:`RequestLifecycleMachine` fire legal and
  illegal events at the raw lifecycle machines (where rejections are exercised).

Every rule records itself as a :class:`~kvtier.testing.sequence.Step`, so any run (in
particular a shrunk failure) can be saved as a kvtier event sequence and replayed
exactly without Hypothesis (:func:`kvtier.testing.sequence.replay`). Rule arguments
are plain JSON values. Every invariant check raises
:class:`~kvtier.fsm.errors.InvariantViolation` naming the spec invariant.

Fault injection: ``fault_rate`` (class attribute; :meth:`KitMachine.configured`) is the
chance that a delivered completion reports failure; ``world_size`` fixes the number of
tensor-parallel ranks (else drawn from 1 and 2).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.fsm import CacheGroupSpec, CapacityError, ComponentSpec, Completion, Direction, Family
from kvtier.fsm import MatchMode, CacheCore
from kvtier.fsm.errors import (
    DuplicateCompletion,
    IllegalTransition,
    InvariantViolation,
    KvtierError,
    LifecycleError,
    UnknownOperation,
)
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.machines import Lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.node import DEVICE_READABLE, HOST_VISIBLE, Node
from kvtier.fsm.ops import Operation, Settled
from kvtier.fsm.records import TransferCommand
from kvtier.fsm.spec import load_spec

from ..tiered import Admission, PollResult, TieredCache
from .sequence import EventSequence, Step, machine_name, register_machine

__all__ = [
    "KitMachine",
    "RunStats",
    "STATS",
    "recorded",
    "kit_layout",
    "CoreMachine",
    "FacadeMachine",
    "SchedulerAdapter",
    "TransferBackend",
    "NodeLifecycleMachine",
    "RequestLifecycleMachine",
    "INVARIANTS",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The invariant names of the spec (what failures print).
INVARIANTS: tuple[str, ...] = tuple(load_spec().invariants)


@dataclass
class RunStats:
    """Process-wide counters of kit machines (the fuzz driver reads and resets them)."""

    steps: int = 0
    checks: int = 0
    examples: int = 0

    def reset(self) -> None:
        self.steps = self.checks = self.examples = 0


STATS = RunStats()
_CURRENT: list[KitMachine] = []


def recorded(fn: F) -> F:
    """Record each call of a rule as a :class:`Step` of the running machine."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: KitMachine, **kwargs: Any) -> Any:
        self.kit_trace.append(Step.of(name, kwargs))
        STATS.steps += 1
        return fn(self, **kwargs)

    return wrapper  # type: ignore[return-value]


def kit_layout(with_state: bool = False) -> CacheLayout:
    """The small layout the kit machines use: history ``kv`` (2 tokens per page) and
    ``c4`` (4 tokens per page, two components), alignment 4 tokens, 3 layers; with
    ``with_state`` a continuation-state group ``swa`` (window 4 tokens: 2 pages)."""
    groups = [
        CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1, 2), (ComponentSpec("k", 64),)),
        CacheGroupSpec("c4", Family.HISTORY, 1, 4, (1, 2), (ComponentSpec("c", 32), ComponentSpec("i", 16))),
    ]
    if with_state:
        groups.append(CacheGroupSpec("swa", Family.STATE, 2, 1, (0, 1, 2), (ComponentSpec("s", 64),), window=4))
    return CacheLayout("kvtier-testing", tuple(groups), 3)


class KitMachine(RuleBasedStateMachine):
    """Base of the kit's machines: step recording, named invariant checks, configuration.

    Subclasses list their invariant-check methods in ``kit_invariants`` (each raises
    :class:`InvariantViolation` naming a spec invariant).
    """

    kit_invariants: ClassVar[tuple[str, ...]] = ()
    #: chance that a delivered completion fails (0..1)
    fault_rate: ClassVar[float] = 0.25
    #: tensor-parallel ranks; ``None``: drawn from 1 and 2
    world_size: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.kit_trace: list[Step] = []
        self.kit_replaying = False
        STATS.examples += 1
        _CURRENT[:] = [self]

    # -- configuration -------------------------------------------------------------
    @classmethod
    def configured(cls, **attrs: Any) -> type[KitMachine]:
        """A subclass with class attributes replaced (``fault_rate``, ``world_size``, ...)."""
        meta: Any = type(cls)
        sub: type[KitMachine] = meta(cls.__name__, (cls,), dict(attrs))
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        return sub

    def kit_fail(self, roll: int) -> bool:
        """Whether a completion drawn with ``roll`` (0..999) fails under ``fault_rate``."""
        return roll < int(round(self.fault_rate * 1000))

    def kit_set_args(self, **args: Any) -> None:
        """Replace the recorded arguments of the step now running (effective values)."""
        last = self.kit_trace[-1]
        self.kit_trace[-1] = Step.of(last.rule, args)

    # -- invariants ----------------------------------------------------------------
    def kit_check(self) -> None:
        """Run every invariant check of this machine."""
        STATS.checks += 1
        for name in self.kit_invariants:
            getattr(self, name)()

    @invariant()
    def kit_all_invariants(self) -> None:
        self.kit_check()

    # -- sequences -----------------------------------------------------------------
    def kit_sequence(self, name: str = "sequence", description: str = "") -> EventSequence:
        """This run so far as a kvtier event sequence."""
        base = type(self)
        while base.__name__ == base.__mro__[1].__name__:  # configured() copies
            base = base.__mro__[1]
        return EventSequence(machine_name(base), list(self.kit_trace), name, description)

    @staticmethod
    def kit_current() -> KitMachine | None:
        """The machine most recently created in this process (the last example run)."""
        return _CURRENT[0] if _CURRENT else None

    # -- bounded verification (kvtier verify) ---------------------------------------
    def kit_actions(self) -> list[Step]:
        """Every step enabled now, with arguments from a small finite domain."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")

    def kit_canonical(self) -> Hashable:
        """An abstraction of the state: equal for states that behave the same."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")


# ======================================================================================
# byte-content model shared by the core and facade machines
# ======================================================================================

def _content(prefix: tuple[Hashable, ...], group: str, index: int, ppu: Mapping[str, int]) -> tuple[Any, ...]:
    """What page ``index`` of ``group`` must hold for the prefix ``prefix`` (units)."""
    if group in ppu:
        unit = index // ppu[group]
        return (prefix[: unit + 1], group, index)
    return (prefix, group, "state", index)


def _prefix(node: Node) -> tuple[Hashable, ...]:
    out: list[Hashable] = []
    for n in reversed(node.path()):
        out.extend(n.key)
    return tuple(out)


def _check_tree_bytes(cache: CacheCore, dev: Mapping[tuple[str, int], Any],
                      host: Mapping[tuple[str, int], Any]) -> None:
    """Invariant 12 on the tree: every page a node exposes holds its prefix's content."""
    ppu = cache._ppu
    for n in cache._nodes.values():
        key = _prefix(n)
        lo = len(key) - len(n.key)
        checks = []
        if n.state in DEVICE_READABLE:
            checks.append(("device", dev, n.dev, n.dev_ckpt))
        if n.state in HOST_VISIBLE:
            checks.append(("host", host, n.host, n.host_ckpt))
        for tier, store, hist, state in checks:
            for g, pages in hist.items():
                first = lo * ppu[g]
                for j, p in enumerate(pages):
                    if store.get((g, p)) != _content(key, g, first + j, ppu):
                        raise InvariantViolation("loaded_equals_written", f"node {n.node_id} ({n.state})",
                                                 f"{tier} page {p} of {g!r} holds {store.get((g, p))!r}")
            for g, pages in state.items():
                for j, p in enumerate(pages):
                    if store.get((g, p)) != _content(key, g, j, ppu):
                        raise InvariantViolation("loaded_equals_written", f"node {n.node_id} ({n.state})",
                                                 f"{tier} checkpoint page {p} of {g!r} holds {store.get((g, p))!r}")


class TransferBackend:
    """The simulated transfer engine: per-(op, rank) completion queues and a byte store
    per tier. Bytes move when an operation settles (success: source to destination;
    failure or deadline: the destination holds garbage), so a source page modified or
    reused while the copy is in flight shows up as wrong bytes (invariants 3, 4, 12).

    An engine plugs in its own backend by subclassing this one (e.g. doing real copies
    between CPU tensors in :meth:`apply`) and returning it from
    :meth:`FacadeMachine.make_transfer`.
    """

    def __init__(self, world_size: int, num_layers: int) -> None:
        self.world_size = world_size
        self.layers = sorted({0, num_layers - 1})
        self.dev: dict[tuple[str, int], Any] = {}
        self.host: dict[tuple[str, int], Any] = {}
        self.commands: dict[int, TransferCommand] = {}
        self.queues: dict[int, list[list[Completion]]] = {}

    def submit(self, cmd: TransferCommand) -> None:
        """Accept a command (once per op id)."""
        if cmd.op_id in self.commands:
            return
        self.commands[cmd.op_id] = cmd
        queues = []
        for rank in range(self.world_size):
            q: list[Completion] = []
            if cmd.direction is Direction.LOADBACK:
                q += [Completion(cmd.op_id, rank, True, layer) for layer in self.layers]
            q.append(Completion(cmd.op_id, rank, True, None))
            queues.append(q)
        self.queues[cmd.op_id] = queues

    def ready(self) -> list[tuple[int, int]]:
        """(op, rank) pairs with a completion to deliver, in a fixed order."""
        return [(op, r) for op, qs in sorted(self.queues.items()) for r, q in enumerate(qs) if q]

    def take(self, op: int, rank: int, ok: bool) -> Completion:
        """The next completion of ``op`` on ``rank`` (reporting ``ok``)."""
        ev = self.queues[op][rank].pop(0)
        if not any(self.queues[op]):
            del self.queues[op]
        return Completion(ev.op_id, ev.rank, ok, ev.layer)

    def apply(self, op: int, ok: bool) -> None:
        """The operation settled: move its bytes (or leave garbage on failure)."""
        cmd = self.commands.pop(op, None)
        if cmd is None:
            return
        src, dst = ((self.dev, self.host) if cmd.direction is Direction.WRITEBACK else (self.host, self.dev))
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", op)


class SchedulerAdapter:
    """How the facade machine talks to the system under test. The default calls the
    :class:`TieredCache` directly; an engine's adapter calls its own scheduler, which
    must end in the same :class:`TieredCache` (``self.cache``) for the invariants."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache

    def admit(self, request_id: str, units: Sequence[Hashable], prompt_tokens: int,
              chunk_tokens: int) -> Admission | None:
        return self.cache.admit(request_id, units, prompt_tokens, chunk_tokens)

    def reserve(self, request_id: str, tokens: int) -> dict[str, list[int]] | None:
        out: dict[str, list[int]] | None = self.cache.reserve(request_id, tokens)
        return out

    def step_done(self, request_id: str, computed_tokens: int, new_units: Sequence[Hashable],
                  checkpoint: bool) -> None:
        self.cache.step_done(request_id, computed_tokens, new_units=new_units, checkpoint=checkpoint)

    def finish(self, request_id: str) -> None:
        self.cache.finish(request_id)

    def retract(self, request_id: str) -> None:
        self.cache.retract(request_id)

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        return self.cache.resume(request_id, chunk_tokens)

    def abort(self, request_id: str) -> None:
        self.cache.abort(request_id)

    def complete(self, completion: Completion) -> None:
        self.cache.complete(completion)

    def advance_step(self, steps: int) -> None:
        self.cache.advance_step(steps)

    def poll(self) -> PollResult:
        return self.cache.poll()


# ======================================================================================
# the core machine
# ======================================================================================

_ALPHABET = "abc"
_KEYS = st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=5)
_ROLL = st.integers(0, 999)


class CoreMachine(KitMachine):
    """Drives one :class:`CacheCore` like a scheduler plus a transfer engine.

    After every step ``check_invariants()`` holds, and the byte model checks invariant
    12: every device or host page a node exposes holds exactly the content written for
    its prefix (located through the page mapping). A reference set of inserted keys
    checks that nothing is matched beyond an inserted prefix.
    """

    kit_invariants = ("check_cache_invariants", "check_loaded_equals_written")

    def __init__(self) -> None:
        super().__init__()
        self.cache: CacheCore
        self.dev_bytes: dict[tuple[str, int], Any] = {}
        self.host_bytes: dict[tuple[str, int], Any] = {}
        self.inserted: set[tuple[str, ...]] = set()
        self.locks: list[Any] = []
        self.receipts: list[Any] = []
        self.events: dict[int, list[list[Completion]]] = {}  # op -> per-rank queue
        self.commands: dict[int, TransferCommand] = {}
        self.failed_ops: set[int] = set()
        self.world = 1

    @initialize(with_state=st.booleans(), world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 8),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 3]),
        seed_keys=st.lists(_KEYS, max_size=3))
    @recorded
    def setup(self, with_state: bool, world: int, policy: str, dev_units: int, host_units: int,
              deadline: int | None, seed_keys: list[list[str]]) -> None:
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        self.kit_set_args(with_state=with_state, world=world, policy=policy, dev_units=dev_units,
                          host_units=host_units, deadline=deadline, seed_keys=seed_keys)
        self.world = world
        self.cache = CacheCore(kit_layout(with_state), dev_units, host_units, policy=policy,
                                       world_size=world, op_deadline_steps=deadline)
        for key in seed_keys:
            self._insert(tuple(key), True)

    # -- helpers -----------------------------------------------------------------
    def _node_at(self, i: int) -> Node | None:
        """The ``i``-th node of the tree by node id (modulo the node count), or ``None``."""
        ids = sorted(self.cache._nodes)
        return self.cache._nodes[ids[i % len(ids)]] if ids else None

    def _take_commands(self) -> None:
        for cmd in self.cache.poll_commands():
            self.commands[cmd.op_id] = cmd
            queues = []
            for rank in range(self.world):
                q: list[Completion] = []
                if cmd.direction is Direction.LOADBACK:
                    q += [Completion(cmd.op_id, rank, True, layer) for layer in (0, 2)]
                q.append(Completion(cmd.op_id, rank, True, None))
                queues.append(q)
            self.events[cmd.op_id] = queues

    def _check_settled(self, s: Settled) -> None:
        """Invariant 10: an operation with a failed completion never settles as a success,
        and a failed loadback leaves its nodes on the host only."""
        if s.ok and s.op_id in self.failed_ops:
            raise InvariantViolation("failure_not_success", f"op {s.op_id}", "a rank reported failure, it settled ok")
        if not s.ok and s.direction is Direction.LOADBACK:
            for nid in s.node_ids:
                n = self.cache._nodes.get(nid)
                if n is not None and n.state != "host":
                    raise InvariantViolation("failure_not_success", f"node {nid} ({n.state})",
                                             f"loadback op {s.op_id} failed but the node did not fall back to host")

    def _apply_bytes(self, op_id: int, ok: bool) -> None:
        cmd = self.commands.pop(op_id)
        src, dst = ((self.dev_bytes, self.host_bytes) if cmd.direction is Direction.WRITEBACK
                    else (self.host_bytes, self.dev_bytes))
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", op_id)

    def _insert(self, key: tuple[str, ...], checkpoint: bool) -> None:
        c = self.cache
        m = c.match(key)
        base = c.device_pages(m.device_node)
        rest = len(key) - m.device_units
        need = {g: rest * c._ppu[g] for g in c._history}
        state_groups = c._state if checkpoint else []
        for g in state_groups:
            need[g] = c._state_pages[g]
        hold = c.lock(m.device_node, "r") if m.device_node is not c.root else None
        try:
            fresh = c.alloc_device(need)
        except CapacityError:
            if hold is not None:
                c.unlock(hold)
            return
        pages = {}
        for g in c._history:
            own = fresh.get(g, [])
            pages[g] = base[g] + own
            for j, p in enumerate(own):
                self.dev_bytes[(g, p)] = _content(key, g, len(base[g]) + j, c._ppu)
        ckpt = {g: fresh[g] for g in state_groups}
        for g, ps in ckpt.items():
            for j, p in enumerate(ps):
                self.dev_bytes[(g, p)] = _content(key, g, j, c._ppu)
        result = c.insert(key, pages, ckpt or None)
        if hold is not None:
            c.unlock(hold)
        self.inserted.add(key)
        for g, ps in result.duplicates.items():
            c.free_device({g: ps})
        for g, ps in result.kept.items():
            c.free_device({g: ps})
        self._take_commands()

    # -- rules ---------------------------------------------------------------------
    @rule(key=_KEYS, checkpoint=st.booleans())
    @recorded
    def insert(self, key: list[str], checkpoint: bool) -> None:
        self._insert(tuple(key), checkpoint)

    @rule(key=_KEYS)
    @recorded
    def insert_and_write_through(self, key: list[str]) -> None:
        self._insert(tuple(key), True)
        self.cache.issue_writebacks()
        self._take_commands()

    @rule(key=_KEYS, mode=st.sampled_from([m.value for m in MatchMode]), replay=st.booleans())
    @recorded
    def match_and_lock(self, key: list[str], mode: str, replay: bool) -> None:
        k = tuple(key)
        m = self.cache.match(k, mode, history_replay=replay and mode == MatchMode.PREFIX_REUSE.value)
        assert m.device_units <= m.host_units <= m.history_units <= len(k), "match bounds"
        if not (any(x[: m.history_units] == k[: m.history_units] for x in self.inserted) or m.history_units == 0):
            raise InvariantViolation("host_evict_leaves", f"match of {''.join(k)!r}",
                                     f"matched {m.history_units} units beyond any inserted prefix")
        c = self.cache
        if c._state and m.host_units and not m.recompute_tokens:
            t = m.terminal
            exact = (len(t.dev_ckpt) == len(c._state) if t.state in DEVICE_READABLE and m.host_units == m.device_units
                     else len(t.host_ckpt) == len(c._state) or len(t.dev_ckpt) == len(c._state))
            if not exact:
                raise InvariantViolation("exact_continuation_state", f"node {t.node_id} ({t.state})",
                                         f"a {mode} hit of {m.host_units} units ends where no checkpoint is held")
        if m.device_node is not self.cache.root and m.device_node.state in DEVICE_READABLE:
            self.locks.append(self.cache.lock(m.device_node, "r"))

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 100), again=st.booleans())
    @recorded
    def unlock(self, i: int, again: bool) -> None:
        if not self.locks:
            return
        r = self.locks.pop(i % len(self.locks))
        self.cache.unlock(r)
        if again:  # a receipt is released exactly once
            try:
                self.cache.unlock(r)
            except KvtierError:
                return
            raise InvariantViolation("counts_with_receipts", repr(r), "a receipt was released twice")

    @rule(key=_KEYS)
    @recorded
    def load(self, key: list[str]) -> None:
        self._load_key(tuple(key))

    def _load_key(self, key: tuple[Hashable, ...]) -> None:
        c = self.cache
        m = c.match(key)
        if not m.needs_loadback:
            return
        try:
            res = c.load(m, "r")
        except CapacityError:
            assert m.host_nodes and all(n.state == "host" for n in m.host_nodes), "load refused a join"
            return
        assert res.op_ids, "a loadback without operations"
        self.receipts.append(res.pin)
        self.locks.append(res.lock)
        if res.command is not None:
            want = sum(len(ps) for n in m.host_nodes for ps in n.host.values())
            if m.terminal in m.host_nodes:
                want += sum(len(ps) for ps in m.terminal.host_ckpt.values())
            if res.command.pages != want:
                raise InvariantViolation("atomic_admission", f"loadback op {res.command.op_id}",
                                         f"moves {res.command.pages} pages, the hit has {want}")
        self._take_commands()

    @precondition(lambda self: bool(self.cache._nodes))
    @rule(i=st.integers(0, 100))
    @recorded
    def load_node(self, i: int) -> None:
        """Load back the prefix of an existing node (host hits are likely)."""
        n = self._node_at(i)
        if n is not None:
            self._load_key(_prefix(n))

    @precondition(lambda self: bool(self.cache._nodes))
    @rule(i=st.integers(0, 100), checkpoint=st.booleans())
    @recorded
    def insert_split(self, i: int, checkpoint: bool) -> None:
        """Insert a key diverging after the first unit of an existing node (a split in
        whatever state the node is in)."""
        n = self._node_at(i)
        if n is None:
            return
        key = _prefix(n)
        if len(n.key) >= 2:
            cut = len(key) - len(n.key) + 1
            self._insert(tuple(str(u) for u in key[:cut]) + ("z",), checkpoint)

    @precondition(lambda self: any(any(q) for qs in self.events.values() for q in qs))
    @rule()
    @recorded
    def drain(self) -> None:
        """Deliver every pending completion successfully, oldest op first."""
        while self.events:
            op = min(self.events)
            for rank, q in enumerate(self.events[op]):
                while q:
                    ev = q.pop(0)
                    for st_ in self.cache.complete(ev):
                        if isinstance(st_, Settled):
                            self._check_settled(st_)
                            self._apply_bytes(st_.op_id, st_.ok)
            self.events.pop(op, None)

    @precondition(lambda self: bool(self.cache._nodes))
    @rule(i=st.integers(0, 100))
    @recorded
    def borrow(self, i: int) -> None:
        """A request reads a node's device pages directly (invariant 14)."""
        nodes = [n for _, n in sorted(self.cache._nodes.items()) if n.state in DEVICE_READABLE]
        if nodes:
            self.receipts.append(self.cache.borrow([nodes[i % len(nodes)]], "r"))

    @precondition(lambda self: bool(self.receipts))
    @rule(i=st.integers(0, 100))
    @recorded
    def release_pin(self, i: int) -> None:
        if self.receipts:
            self.cache.release(self.receipts.pop(i % len(self.receipts)))

    @precondition(lambda self: bool(self.cache._nodes))
    @rule(i=st.integers(0, 100))
    @recorded
    def request_writeback(self, i: int) -> None:
        n = self._node_at(i)
        if n is not None:
            self.cache.writeback(n, "r")
            self._take_commands()

    @rule(limit=st.sampled_from([None, 1, 2]))
    @recorded
    def tree_writebacks(self, limit: int | None) -> None:
        self.cache.issue_writebacks(limit)
        self._take_commands()

    @precondition(lambda self: any(any(q) for qs in self.events.values() for q in qs))
    @rule(i=st.integers(0, 1000), roll=_ROLL)
    @recorded
    def deliver(self, i: int, roll: int = 0, ok: bool | None = None) -> None:
        if ok is None:
            ok = not self.kit_fail(roll)
        self.kit_set_args(i=i, ok=ok)
        if i % 17 == 0:
            try:
                self.cache.complete(Completion(10**9))
            except UnknownOperation:
                pass
            else:
                raise InvariantViolation("operation_ends_once", "op 1000000000",
                                         "a completion for an unknown op was accepted")
        ready = [(op, r) for op, qs in sorted(self.events.items()) for r, q in enumerate(qs) if q]
        if not ready:
            return
        op, rank = ready[i % len(ready)]
        ev = self.events[op][rank].pop(0)
        ev = Completion(ev.op_id, ev.rank, ok, ev.layer)
        if not ok:
            self.failed_ops.add(op)
        out = self.cache.complete(ev)
        for s in out:
            if isinstance(s, Settled):
                self._check_settled(s)
                self._apply_bytes(s.op_id, s.ok)
                del self.events[s.op_id]
        if not any(self.events.get(op, [[]])) and op in self.events:
            del self.events[op]
        # a second delivery of the same event is refused and changes nothing
        if op in self.events or ev.layer is not None:
            try:
                self.cache.complete(ev)
            except (DuplicateCompletion, UnknownOperation):
                pass
            else:
                raise InvariantViolation("operation_ends_once", f"op {op}",
                                         f"duplicate completion {ev} was accepted")

    @rule(steps=st.integers(1, 3))
    @recorded
    def advance(self, steps: int) -> None:
        for s in self.cache.advance_step(steps):
            self._apply_bytes(s.op_id, False)
            # the real completions may still arrive: they are absorbed
        for op in list(self.events):
            if op in self.cache._expired:
                for q in self.events.pop(op):
                    for ev in q:
                        if self.cache.complete(ev) != []:
                            raise InvariantViolation("operation_ends_once", f"op {op}",
                                                     "a late completion after the deadline was not absorbed")

    @rule(g=st.sampled_from(["kv", "c4"]), n=st.integers(1, 8), tier=st.sampled_from(["device", "host"]))
    @recorded
    def pressure(self, g: str, n: int, tier: str) -> None:
        c = self.cache
        pool = c.device if tier == "device" else c.host
        assert pool is not None
        before = pool[g].free
        freed = c.evict_device({g: n}) if tier == "device" else c.evict_host({g: n})
        if pool[g].free != before + freed[g]:
            raise InvariantViolation("conservation", f"{tier} pool of {g!r}",
                                     f"eviction reported {freed[g]} pages freed, {pool[g].free - before} were")
        if freed[g] < n:  # it stopped early: nothing it may evict is left
            if tier == "host":
                left = [x for x in c.nodes() if c._host_victim(x, set())]
            elif c.policy.value != "write_back":
                left = [x for x in c.nodes() if c._device_victim(x)]
            else:
                left = []
            if left:
                raise InvariantViolation("host_evict_leaves" if tier == "host" else "conservation",
                                         f"{tier} eviction", f"stopped with victims left: {left}")

    # -- invariants ------------------------------------------------------------------
    def check_cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def check_loaded_equals_written(self) -> None:
        if hasattr(self, "cache"):
            _check_tree_bytes(self.cache, self.dev_bytes, self.host_bytes)


# ======================================================================================
# the facade machine
# ======================================================================================

_REQS = 3
_RARE = st.integers(0, 4)  # destructive rules act when 0: one draw in five
_TERMINAL = ("finished", "aborted")


class FacadeMachine(KitMachine):
    """Drives a :class:`TieredCache` through a :class:`SchedulerAdapter` with a
    :class:`TransferBackend`, checking after every step the core's and the facade's
    invariants plus invariant 12 for the tree and for what running requests read.

    Requests ``r0``..``r2`` have prompts drawn from a small alphabet (shared prefixes,
    splits); their decode units are private. Subclass and override
    :meth:`make_scheduler` / :meth:`make_transfer` to test an engine's integration.
    """

    kit_invariants = ("check_cache_invariants", "check_loaded_equals_written", "check_requests_read_written",
                      "check_request_records")
    #: for ``kvtier verify``: the fixed prompts of the requests and their count
    verify_prompts: ClassVar[tuple[tuple[str, ...], ...]] = (("a", "b"), ("a", "c"))
    verify_max_units: ClassVar[int] = 3

    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredCache
        self.sched: SchedulerAdapter
        self.xfer: TransferBackend
        self.units: dict[str, list[Hashable]] = {}
        self.inflight: dict[int, Operation] = {}
        self.world = 1
        self.deadline: int | None = None
        self.fenced: dict[str, dict[str, list[int]]] = {}  # aborting request -> own pages it must keep

    # -- plug points -----------------------------------------------------------------
    def make_cache(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
                   wb_limit: int) -> TieredCache:
        """The cache under test (override to change the layout or options)."""
        return TieredCache(kit_layout(False), dev_units, host_units, policy=policy, world_size=world,
                           op_deadline_steps=deadline, max_writebacks_in_flight=wb_limit)

    def make_scheduler(self, cache: TieredCache) -> SchedulerAdapter:
        """The scheduler adapter (override to plug in an engine's scheduler)."""
        return SchedulerAdapter(cache)

    def make_transfer(self, world: int, num_layers: int) -> TransferBackend:
        """The transfer backend (override to plug in an engine's transfer engine)."""
        return TransferBackend(world, num_layers)

    @initialize(world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 10),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 4]), wb_limit=st.sampled_from([1, 2]))
    @recorded
    def setup(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
              wb_limit: int) -> None:
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        self.kit_set_args(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                          deadline=deadline, wb_limit=wb_limit)
        self.world = world
        self.deadline = deadline
        self.cache = self.make_cache(world, policy, dev_units, host_units, deadline, wb_limit)
        self.sched = self.make_scheduler(self.cache)
        self.xfer = self.make_transfer(world, self.cache.layout.num_layers)

    # -- helpers -----------------------------------------------------------------------
    @staticmethod
    def _rid(req: int) -> str:
        return f"r{req % _REQS}"

    def _state(self, rid: str) -> str | None:
        r = self.cache._requests.get(rid)
        return None if r is None else r.state

    def _unit(self, rid: str, u: int) -> Hashable:
        units = self.units[rid]
        while len(units) <= u:
            units.append(f"{rid}.{len(units)}")
        return units[u]

    def _ppu(self) -> dict[str, int]:
        return self.cache.core._ppu

    def _sync(self) -> None:
        """Bytes move for every operation that settled since the last step."""
        ops = self.cache.core._ops
        for op_id in sorted(set(self.inflight) - set(ops)):
            op = self.inflight.pop(op_id)
            self.xfer.apply(op_id, op.ok and op_id not in self.cache.core._expired)
        for op_id, op in ops.items():
            self.inflight.setdefault(op_id, op)

    def _expect_refused(self, rid: str, call: Callable[[], Any]) -> None:
        before = self._state(rid)
        try:
            call()
        except (LifecycleError, KvtierError):
            if self._state(rid) != before:
                raise InvariantViolation("state_matches_resources", f"request {rid!r}",
                                         f"a refused call moved it from {before} to {self._state(rid)}") from None
            return
        raise AssertionError(f"request {rid!r} in state {before}: the call was accepted")

    def _write_own(self, rid: str, lo_tokens: int, hi_tokens: int) -> None:
        """The forward pass wrote KV for tokens [lo, hi) into the request's own pages."""
        r = self.cache._requests[rid]
        table = self.cache.page_table(rid)
        ppu = self._ppu()
        align = self.cache.layout.alignment
        for g in self.cache.core._history:
            tpp = align // ppu[g]
            own = set(r.own.get(g, ()))
            for j in range(lo_tokens // tpp, -(-hi_tokens // tpp)):
                if j < len(table[g]) and table[g][j] in own:
                    u = j // ppu[g]
                    prefix = tuple(self._unit(rid, k) for k in range(u + 1))
                    self.xfer.dev[(g, table[g][j])] = _content(prefix, g, j, ppu)

    def _check_read(self, rid: str, tokens: int) -> None:
        """Invariant 12 for a request: the pages it reads for its full units hold them."""
        table = self.cache.page_table(rid)
        ppu = self._ppu()
        units = tokens // self.cache.layout.alignment
        prefix = tuple(self._unit(rid, k) for k in range(units))
        for g in self.cache.core._history:
            for j in range(units * ppu[g]):
                if j >= len(table[g]):
                    raise InvariantViolation("loaded_equals_written", f"request {rid!r}",
                                             f"page table of {g!r} covers {len(table[g])} pages, reads {j + 1}")
                got = self.xfer.dev.get((g, table[g][j]))
                if got != _content(prefix, g, j, ppu):
                    raise InvariantViolation("loaded_equals_written", f"request {rid!r}",
                                             f"reads device page {table[g][j]} of {g!r} (position {j}): {got!r}")

    # -- rules -------------------------------------------------------------------------
    @rule(req=st.integers(0, _REQS - 1), key=st.sampled_from(["a", "ab", "abb", "aba", "ba", "abab"]).map(list),
          chunk=st.integers(1, 3), tail=st.booleans())
    @recorded
    def admit(self, req: int, key: list[str], chunk: int, tail: bool) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        align = self.cache.layout.alignment
        prompt = len(key) * align + (1 if tail else 0)
        r = self.cache._requests.get(rid)
        if r is not None and (state not in ("waiting", *_TERMINAL) or (state in _TERMINAL and not r.settled)
                              or (state == "waiting" and not r.settled)):
            self._expect_refused(rid, lambda: self.sched.admit(rid, list(key), prompt, chunk * align))
            return
        self.units[rid] = list(key)
        adm = self.sched.admit(rid, list(key), prompt, chunk * align)
        if adm is not None:
            self._check_read(rid, adm.device_hit_tokens)
        self._sync()

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in self.cache.core._nodes.values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), chunk=st.integers(1, 3))
    @recorded
    def admit_cached(self, req: int, i: int, chunk: int) -> None:
        """Admit a prompt that extends the prefix of a node with a host copy (a host hit,
        so a loadback when the node was demoted)."""
        nodes = [n for _, n in sorted(self.cache.core._nodes.items()) if n.state in HOST_VISIBLE]
        if not nodes:
            return
        key = [str(u) for u in _prefix(nodes[i % len(nodes)])]
        rid = self._rid(req)
        state = self._state(rid)
        r = self.cache._requests.get(rid)
        align = self.cache.layout.alignment
        prompt = len(key) * align + 1
        if r is not None and (state not in ("waiting", *_TERMINAL) or not r.settled):
            return
        self.units[rid] = list(key)
        adm = self.sched.admit(rid, list(key), prompt, chunk * align)
        if adm is not None:
            self._check_read(rid, adm.device_hit_tokens)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), checkpoint=st.booleans(), discard=st.booleans())
    @recorded
    def step_done(self, req: int, checkpoint: bool, discard: bool) -> None:
        self._forward(self._rid(req), checkpoint, discard)

    def _forward(self, rid: str, checkpoint: bool, discard: bool) -> None:
        r = self.cache._requests.get(rid)
        if r is None or r.owed_forward <= 0:
            if r is not None:
                self._expect_refused(rid, lambda: self.sched.step_done(rid, 0, (), False))
            return
        computed = 0
        if r.state in ("running", "loading") and not discard:
            computed = r.reserved - r.tokens
        if r.state == "running":
            self._check_read(rid, r.tokens)
        if computed:
            self._write_own(rid, r.tokens, r.tokens + computed)
        align = self.cache.layout.alignment
        full = (r.tokens + computed) // align
        new = [self._unit(rid, u) for u in range(len(r.units), full)] if full > len(r.units) else []
        self.sched.step_done(rid, computed, new, checkpoint)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), units=st.integers(1, 2))
    @recorded
    def reserve(self, req: int, units: int) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        tokens = units * self.cache.layout.alignment
        if state not in ("running", "loading"):
            self._expect_refused(rid, lambda: self.sched.reserve(rid, tokens))
            return
        self.sched.reserve(rid, tokens)
        self._sync()

    def _lifecycle_call(self, rid: str, legal: bool, call: Callable[[], Any]) -> None:
        if legal:
            call()
        else:
            self._expect_refused(rid, call)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1))
    @recorded
    def finish(self, req: int) -> None:
        rid = self._rid(req)
        r = self.cache._requests.get(rid)
        if r is not None and r.state == "running" and r.owed_forward > 0:
            self._forward(rid, False, False)  # the last forward result first
        if r is not None:  # finishing is legal once no forward result is owed
            self._lifecycle_call(rid, r.state == "running" and r.owed_forward == 0, lambda: self.sched.finish(rid))

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def retract(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        if go == 0 and self._state(rid) is not None:
            self._lifecycle_call(rid, self._state(rid) == "running", lambda: self.sched.retract(rid))

    @rule(req=st.integers(0, _REQS - 1), chunk=st.integers(1, 3))
    @recorded
    def resume(self, req: int, chunk: int) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        align = self.cache.layout.alignment
        self._lifecycle_call(rid, state == "retracted", lambda: self.sched.resume(rid, chunk * align))

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def abort(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if go == 0 and state is not None:
            r = self.cache._requests[rid]
            own = {g: list(p) for g, p in r.own.items() if p}
            self._lifecycle_call(rid, state not in ("aborting", *_TERMINAL), lambda: self.sched.abort(rid))
            if self._state(rid) == "aborting":
                self.fenced[rid] = own

    @precondition(lambda self: bool(self.xfer.ready()) or bool(self.cache.core._outbox))
    @rule(i=st.integers(0, 1000), roll=_ROLL)
    @recorded
    def deliver(self, i: int, roll: int = 0, ok: bool | None = None) -> None:
        """Poll (submitting new commands), then deliver one pending completion."""
        if ok is None:
            ok = not self.kit_fail(roll)
        self.kit_set_args(i=i, ok=ok)
        self._poll()
        ready = self.xfer.ready()
        if not ready:
            return
        op, rank = ready[i % len(ready)]
        ev = self.xfer.take(op, rank, ok)
        late = op not in self.cache.core._ops
        self.sched.complete(ev)
        if late and op not in self.cache.core._expired:
            raise InvariantViolation("operation_ends_once", f"op {op}", "a completion for a settled op was accepted")
        try:  # the same completion again is refused (or absorbed after a deadline)
            self.sched.complete(ev)
        except (DuplicateCompletion, UnknownOperation):
            pass
        else:
            if op not in self.cache.core._expired:
                raise InvariantViolation("operation_ends_once", f"op {op}", f"duplicate {ev} was accepted")
        self._sync()

    @precondition(lambda self: self.deadline is not None)
    @rule(steps=st.integers(1, 3))
    @recorded
    def advance(self, steps: int) -> None:
        self.sched.advance_step(steps)
        self._sync()

    @rule(go=_RARE)
    @recorded
    def drain(self, go: int = 0) -> None:
        """Poll, then deliver every pending completion successfully, oldest op first."""
        if go != 0:
            return
        self._poll()
        while self.xfer.ready():
            op, rank = self.xfer.ready()[0]
            self.sched.complete(self.xfer.take(op, rank, True))
            self._sync()

    @rule()
    @recorded
    def poll(self) -> None:
        self._poll()

    def _poll(self) -> None:
        out = self.sched.poll()
        for cmd in out.commands:
            self.xfer.submit(cmd)
        lc = request_lifecycle()
        for ev in out.events:
            if ev.state not in lc.spec.state_names:
                raise InvariantViolation("state_matches_resources", f"request {ev.request_id!r}",
                                         f"reported in unknown state {ev.state!r}")
        self._sync()

    @rule(tier=st.sampled_from(["device", "device", "host"]), g=st.sampled_from(["kv", "c4"]),
          n=st.integers(1, 16))
    @recorded
    def pressure(self, tier: str, g: str, n: int) -> None:
        core = self.cache.core
        if tier == "device":
            core.evict_device({g: n})
        else:
            core.evict_host({g: n})
        self._sync()

    # -- invariants --------------------------------------------------------------------
    def check_cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def check_loaded_equals_written(self) -> None:
        if hasattr(self, "cache"):
            _check_tree_bytes(self.cache.core, self.xfer.dev, self.xfer.host)

    def check_requests_read_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid, r in self.cache._requests.items():
            if r.state == "running":
                self._check_read(rid, r.tokens)

    def check_request_records(self) -> None:
        if not hasattr(self, "cache"):
            return
        ops = self.cache.core._ops
        for rid, r in self.cache._requests.items():
            if r.owed_forward < 0:
                raise InvariantViolation("counts_with_receipts", f"request {rid!r}", "owes a negative count")
            for op in r.ops:
                if op not in ops:
                    raise InvariantViolation("operation_ends_once", f"request {rid!r}",
                                             f"waits on op {op}, which already ended")
            if r.state in ("finishing", "retracting") and not r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} without its own writeback in flight")
            if r.state == "aborting" and r.settled:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         "aborting with nothing owed: never released")
            if r.state == "loading" and not r.pins:
                raise InvariantViolation("loadback_source_pinned", f"request {rid!r}", "loading without a pin")
            if r.state in _TERMINAL and r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} with operations {sorted(r.ops)} still in flight")
        for rid, own in list(self.fenced.items()):
            fenced = self.cache._requests.get(rid)
            if fenced is None or fenced.state != "aborting":
                del self.fenced[rid]
                continue
            for g, pages in own.items():
                if not set(pages) <= set(fenced.own.get(g, ())):
                    raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                             f"aborting with work in flight but its pages of {g!r} were released")
        core = self.cache.core
        held = {r.lock.receipt_id for r in self.cache._requests.values() if r.lock is not None}
        held |= {p.receipt_id for r in self.cache._requests.values() for p in r.pins}
        leaked = (set(core._locks) | set(core._receipts)) - held
        if leaked:
            raise InvariantViolation("atomic_admission", "the facade",
                                     f"receipts {sorted(leaked)} are held by no request (a reservation not rolled back)")

    # -- bounded verification ------------------------------------------------------------
    @classmethod
    def verify_setup(cls, world: int = 1, policy: str = "write_through", dev_units: int = 4,
                     host_units: int = 4, deadline: int | None = None, wb_limit: int = 1) -> Step:
        return Step.of("setup", dict(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                                     deadline=deadline, wb_limit=wb_limit))

    def kit_actions(self) -> list[Step]:
        out: list[Step] = []
        align = self.cache.layout.alignment
        for req, key in enumerate(self.verify_prompts):
            rid = self._rid(req)
            r = self.cache._requests.get(rid)
            state = None if r is None else r.state
            # the bounded model: at most 2 forward passes owed per request
            if state is None or ((state == "waiting" or state in _TERMINAL) and r is not None and r.owed_forward < 2):
                out.append(Step.of("admit", dict(req=req, key=list(key), chunk=len(key), tail=False)))
            if r is None:
                continue
            if r.owed_forward > 0:
                out.append(Step.of("step_done", dict(req=req, checkpoint=False, discard=False)))
            if state == "running" and r.owed_forward == 0 and r.reserved < self.verify_max_units * align:
                out.append(Step.of("reserve", dict(req=req, units=1)))
            if state == "running":
                if r.owed_forward == 0:
                    out.append(Step.of("finish", dict(req=req)))
                out.append(Step.of("retract", dict(req=req, go=0)))
            if state == "retracted" and r.owed_forward < 2:
                out.append(Step.of("resume", dict(req=req, chunk=len(key))))
            if state not in (None, "aborting", *_TERMINAL):
                out.append(Step.of("abort", dict(req=req, go=0)))
        for i, _ in enumerate(self.xfer.ready()):
            out.append(Step.of("deliver", dict(i=i, ok=True)))
            out.append(Step.of("deliver", dict(i=i, ok=False)))
        if self.deadline is not None and self.cache.core._ops:
            out.append(Step.of("advance", dict(steps=1)))
        core = self.cache.core
        if core._outbox or self.cache._events or core._wb_queue:
            out.append(Step.of("poll", {}))
        if any(core._device_victim(n) and n.state == "backed" for n in core._nodes.values()):
            out.append(Step.of("pressure", dict(tier="device", g="kv", n=64)))  # demote everything evictable
        return out

    def kit_canonical(self) -> Hashable:
        return _Canon(self).value()


class _Canon:
    """Canonical abstraction of a facade machine's state: nodes by their prefix, page ids,
    op ids and receipt ids renumbered by first appearance, clock stamps replaced by
    their order (LRU order kept), deadlines relative to the current step."""

    def __init__(self, m: FacadeMachine) -> None:
        self.m = m
        self.pages: dict[tuple[str, str, int], int] = {}
        self.ops: dict[int, int] = {}
        self.nodes: dict[int, tuple[Hashable, ...]] = {}

    def page(self, pool: str, g: str, p: int) -> int:
        k = (pool, g, p)
        if k not in self.pages:
            self.pages[k] = sum(1 for x in self.pages if x[0] == pool and x[1] == g)
        return self.pages[k]

    def pmap(self, pool: str, pm: Mapping[str, Sequence[int]]) -> tuple[Any, ...]:
        return tuple((g, tuple(self.page(pool, g, p) for p in ps)) for g, ps in sorted(pm.items()))

    def op(self, op_id: int | None) -> int | None:
        if op_id is None:
            return None
        if op_id not in self.ops:
            self.ops[op_id] = len(self.ops)
        return self.ops[op_id]

    def node(self, n: Node) -> tuple[Hashable, ...]:
        return self.nodes.get(n.node_id) or _prefix(n)

    def value(self) -> Hashable:
        m = self.m
        core = m.cache.core
        stamps = sorted({n.last_access for n in core._nodes.values()})
        ids = sorted(core._nodes)
        thr = core.write_threshold
        tree: list[Any] = []

        def walk(n: Node) -> None:
            for key in sorted(n.children, key=repr):
                c = n.children[key]
                self.nodes[c.node_id] = _prefix(c)
                tree.append((self.nodes[c.node_id], c.state, self.pmap("d", c.dev), self.pmap("h", c.host),
                             self.pmap("h", c.pending), self.pmap("d", c.dev_ckpt), self.pmap("h", c.host_ckpt),
                             self.pmap("h", c.pending_ckpt), c.lock_ref, c.borrow_ref, c.host_pin,
                             min(c.hit_count, thr), stamps.index(c.last_access), ids.index(c.node_id),
                             self.op(c.wb_op), self.op(c.lb_op), c.chunk_checkpoint, c.node_id in core._wb_queue))
                walk(c)

        walk(core.root)
        ops = []
        for op_id in sorted(core._ops, key=lambda o: (self.op(o) is None, self.op(o) or 0, o)):
            op = core._ops[op_id]
            cmd = op.command
            dl = None if cmd.deadline_step is None else cmd.deadline_step - core.step
            src_pool, dst_pool = ("d", "h") if cmd.direction is Direction.WRITEBACK else ("h", "d")
            ops.append((self.op(op_id), cmd.direction.value, cmd.request_id, dl,
                        tuple((t.group, tuple(self.page(src_pool, t.group, p) for p in t.src_pages),
                               tuple(self.page(dst_pool, t.group, p) for p in t.dst_pages)) for t in cmd.transfers),
                        tuple(self.node(n) for n in op.nodes), tuple(sorted(op.acked)), op.ok,
                        tuple(sorted(op.layers.items())), tuple(sorted(op.seen, key=repr)),
                        None if op.checkpoint is None else self.node(op.checkpoint)))
        reqs = []
        for rid in sorted(m.cache._requests):
            r = m.cache._requests[rid]
            reqs.append((rid, r.state, tuple(r.units), r.prompt_tokens, r.tokens, r.reserved,
                         self.pmap("d", r.canon), self.pmap("d", r.own), r.published,
                         None if r.lock is None else self.node(r.lock.node),
                         tuple(tuple(self.node(n) for n in p.nodes) for p in r.pins),
                         tuple(sorted(self.op(o) or 0 for o in r.ops)), r.owed_forward, r.reason,
                         r.has_loadback, r.has_own_writeback, r.hit_tokens,
                         tuple(sorted((self.op(o), v) for o, v in r.layers.items())), r.poisoned, r.retract_ckpt))
        outbox = tuple(self.op(c.op_id) for c in core._outbox)
        queues = tuple(sorted((self.op(op), tuple(tuple((c.rank, c.layer) for c in q) for q in qs))
                              for op, qs in m.xfer.queues.items()))
        expired = tuple(sorted(self.op(op) or 0 for op in core._expired if op in m.xfer.queues))
        free = []
        for pool, allocs in (("d", core.device), ("h", core.host or {})):
            for g, a in sorted(allocs.items()):
                free.append((pool, g, tuple(self.page(pool, g, p) for p in a.free_order())))
        store = []
        # bytes of allocated pages only: a free page's stale content is never read before written
        free_now = {(pool, g, p) for pool, allocs in (("d", core.device), ("h", core.host or {}))
                    for g, a in allocs.items() for p in a.free_order()}
        for pool, data in (("d", m.xfer.dev), ("h", m.xfer.host)):
            for (g, p), v in data.items():
                if (pool, g, p) in self.pages and (pool, g, p) not in free_now:
                    garbage = isinstance(v, tuple) and len(v) == 2 and v[0] == "garbage"
                    store.append((pool, g, self.pages[(pool, g, p)], "garbage" if garbage else repr(v)))
        # unreported request events: which ones are pending, not how many times (poll reports them)
        events = tuple(sorted({(e.request_id, e.state, e.reason or "") for e in m.cache._events}))
        fenced = tuple(sorted((rid, self.pmap("d", own)) for rid, own in m.fenced.items()))
        return (tuple(tree), tuple(ops), tuple(reqs), outbox, queues, expired, tuple(free),
                tuple(sorted(store)), events, fenced)


# ======================================================================================
# raw lifecycle machines (rejections are exercised here)
# ======================================================================================

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
        return any(c.state in _HOST_COPY | {"writing"} for c in self.children)

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
            node.device = "device pages" in declared
            node.host = "host pages" in declared
            node.pending = "pending host reservation" in declared
            node.op_pin = "host pin" in declared
            self.nodes.append(node)

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
            want = ("device pages" in declared, "host pages" in declared,
                    "pending host reservation" in declared, "host pin" in declared)
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

    @initialize(states=st.lists(st.sampled_from(range(9)), min_size=2, max_size=2))
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
        spec = self.machine.spec
        expected = next((t for t in spec.candidates(r.state, event)
                         if all(getattr(r, g.name) != g.negated for g in t.guards)), None)
        before = r.state
        try:
            self.machine.fire(r, event)
        except LifecycleError:
            if expected is not None or r.state != before:
                raise InvariantViolation("state_matches_resources", f"request {r.label}",
                                         f"{event} refused in {before} (spec: {expected})") from None
            return
        if expected is None or r.state != expected.target:
            raise InvariantViolation("state_matches_resources", f"request {r.label}",
                                     f"{event} from {before} went to {r.state}, the spec says {expected}")
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

    @rule(index=st.integers(0, 1), state=st.sampled_from(range(9)))
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
        if r.state in _TERMINAL:
            self.reqs[index % len(self.reqs)] = _RawRequest(r.label)

    def check_states(self) -> None:
        names = set(self.machine.spec.state_names)
        for r in self.reqs:
            if r.state not in names:
                raise InvariantViolation("state_matches_resources", f"request {r.label}", f"unknown state {r.state}")


register_machine("core", CoreMachine)
register_machine("facade", FacadeMachine)
register_machine("node", NodeLifecycleMachine)
register_machine("request", RequestLifecycleMachine)

_ = (itertools, IllegalTransition)
