"""Model-based stateful test of the tiered cache (issue 3).

Random inserts, matches with lock and unlock, request and tree writebacks, loadbacks
with per-layer progress, completions delivered in any order (successes and failures,
across ranks), splits through diverging inserts, device and host eviction under pressure
and deadlines. After every step ``check_invariants()`` holds, and a simulated byte store
checks invariant 12: every device or host page a node exposes holds exactly the content
written for its prefix (pages are located through the mapping, never by identity). A
reference trie of inserted keys checks that nothing is ever matched beyond a prefix that
was inserted.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.fsm import CacheGroupSpec, CapacityError, ComponentSpec, Completion, Direction, Family
from kvtier.fsm.cache import MatchMode, TieredPrefixCache
from kvtier.fsm.errors import DuplicateCompletion, KvtierError, UnknownOperation
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.node import DEVICE_READABLE, HOST_VISIBLE, Node

ALPHABET = "abc"
KEYS = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5).map(tuple)


def layout(with_state: bool) -> CacheLayout:
    groups = [
        CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1, 2), (ComponentSpec("k", 64),)),
        CacheGroupSpec("c4", Family.HISTORY, 1, 4, (1, 2), (ComponentSpec("c", 32), ComponentSpec("i", 16))),
    ]
    if with_state:
        groups.append(CacheGroupSpec("swa", Family.STATE, 2, 1, (0, 1, 2), (ComponentSpec("s", 64),), window=4))
    return CacheLayout("test", tuple(groups), 3)


class CoreMachine(RuleBasedStateMachine):
    """Drives one TieredPrefixCache like a scheduler plus a transfer engine would."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredPrefixCache
        self.dev_bytes: dict[tuple[str, int], Any] = {}
        self.host_bytes: dict[tuple[str, int], Any] = {}
        self.inserted: set[tuple[str, ...]] = set()
        self.locks: list[Any] = []
        self.receipts: list[Any] = []
        self.events: dict[int, list[list[Completion]]] = {}  # op -> per-rank queue
        self.commands: dict[int, Any] = {}
        self.world = 1

    @initialize(with_state=st.booleans(), world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 8),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 3]),
        seed_keys=st.lists(KEYS, max_size=3))
    def setup(self, with_state: bool, world: int, policy: str, dev_units: int, host_units: int,
              deadline: int | None, seed_keys: list[tuple[str, ...]]) -> None:
        lay = layout(with_state)
        self.world = world
        self.cache = TieredPrefixCache(lay, dev_units, host_units, policy=policy, world_size=world,
                                       op_deadline_steps=deadline)
        for key in seed_keys:
            self._insert(key, True)

    # -- helpers -----------------------------------------------------------------
    def _content(self, key: tuple[str, ...], group: str, index: int) -> tuple[Any, ...]:
        """What page ``index`` of ``group`` must hold for the prefix ``key``."""
        c = self.cache
        if group in c._ppu:
            unit = index // c._ppu[group]
            return (key[: unit + 1], group, index)
        return (key, group, "state", index)

    @staticmethod
    def _prefix(node: Node) -> tuple[str, ...]:
        out: list[str] = []
        for n in reversed(node.path()):
            out.extend(n.key)  # type: ignore[arg-type]
        return tuple(out)

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

    def _apply_bytes(self, op_id: int, ok: bool) -> None:
        cmd = self.commands.pop(op_id)
        src, dst = ((self.dev_bytes, self.host_bytes) if cmd.direction is Direction.WRITEBACK
                    else (self.host_bytes, self.dev_bytes))
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", op_id)

    # -- rules ---------------------------------------------------------------------
    @rule(key=KEYS, checkpoint=st.booleans())
    def insert(self, key: tuple[str, ...], checkpoint: bool) -> None:
        self._insert(key, checkpoint)

    @rule(key=KEYS)
    def insert_and_write_through(self, key: tuple[str, ...]) -> None:
        self._insert(key, True)
        self.cache.issue_writebacks()
        self._take_commands()

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
                self.dev_bytes[(g, p)] = self._content(key, g, len(base[g]) + j)
        ckpt = {g: fresh[g] for g in state_groups}
        for g, ps in ckpt.items():
            for j, p in enumerate(ps):
                self.dev_bytes[(g, p)] = self._content(key, g, j)
        result = c.insert(key, pages, ckpt or None)
        if hold is not None:
            c.unlock(hold)
        self.inserted.add(key)
        for g, ps in result.duplicates.items():
            c.free_device({g: ps})
        for g, ps in result.kept.items():
            c.free_device({g: ps})
        self._take_commands()

    @rule(key=KEYS, mode=st.sampled_from(list(MatchMode)), replay=st.booleans())
    def match_and_lock(self, key: tuple[str, ...], mode: MatchMode, replay: bool) -> None:
        m = self.cache.match(key, mode, history_replay=replay and mode is MatchMode.PREFIX_REUSE)
        assert m.device_units <= m.host_units <= m.history_units <= len(key)
        assert any(k[: m.history_units] == key[: m.history_units] for k in self.inserted) or m.history_units == 0
        if m.device_node is not self.cache.root and m.device_node.state in DEVICE_READABLE:
            self.locks.append(self.cache.lock(m.device_node, "r"))

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 100), again=st.booleans())
    def unlock(self, i: int, again: bool) -> None:
        r = self.locks.pop(i % len(self.locks))
        self.cache.unlock(r)
        if again:  # a receipt is released exactly once
            try:
                self.cache.unlock(r)
            except KvtierError:
                return
            raise AssertionError("a receipt was released twice")

    @rule(key=KEYS)
    def load(self, key: tuple[str, ...]) -> None:
        c = self.cache
        m = c.match(key)
        if not m.needs_loadback:
            return
        try:
            res = c.load(m, "r")
        except CapacityError:
            assert m.host_nodes and all(n.state == "host" for n in m.host_nodes)
            return
        assert res.op_ids
        self.receipts.append(res.pin)
        self.locks.append(res.lock)
        if res.command is not None:
            want = sum(len(ps) for n in m.host_nodes for ps in n.host.values())
            if m.terminal in m.host_nodes:
                want += sum(len(ps) for ps in m.terminal.host_state.values())
            assert res.command.pages == want
        self._take_commands()

    @precondition(lambda self: bool(self.receipts))
    @rule(i=st.integers(0, 100))
    def release_pin(self, i: int) -> None:
        self.cache.release(self.receipts.pop(i % len(self.receipts)))

    @precondition(lambda self: bool(self.cache._nodes))
    @rule(i=st.integers(0, 100))
    def request_writeback(self, i: int) -> None:
        nodes = sorted(self.cache._nodes)
        self.cache.writeback(self.cache._nodes[nodes[i % len(nodes)]], "r")
        self._take_commands()

    @rule(limit=st.sampled_from([None, 1, 2]))
    def tree_writebacks(self, limit: int | None) -> None:
        self.cache.issue_writebacks(limit)
        self._take_commands()

    @precondition(lambda self: any(any(q) for qs in self.events.values() for q in qs))
    @rule(i=st.integers(0, 1000), ok=st.sampled_from([True, True, True, False]))
    def deliver(self, i: int, ok: bool) -> None:
        if i % 17 == 0:
            try:
                self.cache.complete(Completion(10**9))
            except UnknownOperation:
                pass
            else:
                raise AssertionError("a completion for an unknown op was accepted")
        ready = [(op, r) for op, qs in sorted(self.events.items()) for r, q in enumerate(qs) if q]
        op, rank = ready[i % len(ready)]
        ev = self.events[op][rank].pop(0)
        ev = Completion(ev.op_id, ev.rank, ok, ev.layer)
        out = self.cache.complete(ev)
        for s in out:
            if hasattr(s, "ok"):
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
                raise AssertionError(f"duplicate completion {ev} was accepted")

    @rule(steps=st.integers(1, 3))
    def advance(self, steps: int) -> None:
        for s in self.cache.advance_step(steps):
            self._apply_bytes(s.op_id, False)
            # the real completions may still arrive: they are absorbed
        for op in list(self.events):
            if op in self.cache._expired:
                for q in self.events.pop(op):
                    for ev in q:
                        assert self.cache.complete(ev) == []

    @rule(g=st.sampled_from(["kv", "c4"]), n=st.integers(1, 8), tier=st.sampled_from(["device", "host"]))
    def pressure(self, g: str, n: int, tier: str) -> None:
        c = self.cache
        pool = c.device if tier == "device" else c.host
        assert pool is not None
        before = pool[g].free
        freed = c.evict_device({g: n}) if tier == "device" else c.evict_host({g: n})
        assert pool[g].free == before + freed[g], "eviction reported what it freed"
        if freed[g] < n:  # it stopped early: nothing it may evict is left
            if tier == "host":
                left = [x for x in c.nodes() if c._host_victim(x, set())]
            elif c.policy.value != "write_back":
                left = [x for x in c.nodes() if c._device_victim(x)]
            else:
                left = []
            assert not left, f"eviction stopped with victims left: {left}"

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    @invariant()
    def loaded_equals_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        for n in self.cache._nodes.values():
            key = self._prefix(n)
            lo = len(key) - len(n.key)
            checks = []
            if n.state in DEVICE_READABLE:
                checks.append((self.dev_bytes, n.dev, n.dev_state))
            if n.state in HOST_VISIBLE:
                checks.append((self.host_bytes, n.host, n.host_state))
            for store, hist, state in checks:
                for g, pages in hist.items():
                    first = lo * self.cache._ppu[g]
                    for j, p in enumerate(pages):
                        assert store.get((g, p)) == self._content(key, g, first + j), (
                            f"loaded_equals_written: node {n.node_id} group {g} page {p}")
                for g, pages in state.items():
                    for j, p in enumerate(pages):
                        assert store.get((g, p)) == self._content(key, g, j), (
                            f"loaded_equals_written: node {n.node_id} checkpoint {g} page {p}")


TestCoreStateful = CoreMachine.TestCase
TestCoreStateful.settings = settings(TestCoreStateful.settings,
                                     stateful_step_count=max(100, TestCoreStateful.settings.stateful_step_count))
