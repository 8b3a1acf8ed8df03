"""The core machine: drives one :class:`~kvtier.fsm.node.core.CacheCore` the way a
scheduler plus a transfer engine would (inserts, matches, locks, loadbacks, writebacks,
completions in any order across ranks, failures, deadlines, pressure), with a
byte-content model for invariant 12 (:mod:`kvtier.testing.content`).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvtier.fsm import CacheCore, Completion, MatchMode
from kvtier.fsm.errors import DuplicateCompletion, InvariantViolation, KvtierError, UnknownOperation
from kvtier.fsm.node.ledger import units_to_pages
from kvtier.fsm.node import DEVICE_READABLE
from kvtier.fsm.node.ops import Settled

from ..eventlog import attach_active
from . import _views as views
from .base import FAULT_LEVEL, LAYOUTS, ROLL, kit_layout, layout_named, probe_layers, recorded
from .content import node_prefix
from .drain import check_core_drained, evict_to_full_pools
from .core_steps import CoreSteps
from .logged import LogCheck
from .models import ModelViolation, liveness_bound

__all__ = ["CoreMachine"]

_ALPHABET = "abc"
_KEYS = st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=5)
#: pool configurations the setup draws: capacities in units (most), a mapping per group,
#: no host tier
_POOLS = st.sampled_from(["units", "units", "units", "units", "mapping", "no_host"])
#: one example in ten records its event log and checks it (kvtier.testing.logged)
_LOGGED = st.integers(0, 9).map(lambda x: x == 9)


class CoreMachine(CoreSteps):
    """Drives one :class:`CacheCore` like a scheduler plus a transfer engine.

    After every step ``check_invariants()`` holds, and the byte model checks invariant
    12: every device or host page a node exposes holds exactly the content written for
    its prefix (located through the page mapping). A reference set of inserted keys
    checks that nothing is matched beyond an inserted prefix. The setup draws the layout
    (the kit's, with or without state groups, or a preset's: :data:`~kvtier.testing.base.LAYOUTS`),
    the eviction policy (``lru``, ``lru2``, ``lru_turns``, exclusive host tier) and the example's fault
    level; inserts make final and chunk checkpoints. Reference models
    (:mod:`kvtier.testing.models`): every eviction takes victims in the policy's order,
    and ``quiesce`` checks that everything queued is issued within a bound.
    """

    kit_invariants = ("check_cache_invariants", "check_loaded_equals_written", "check_queue_model")

    @initialize(with_state=st.booleans(), world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 8),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 3]),
        seed_keys=st.lists(_KEYS, max_size=3), layout=st.sampled_from(LAYOUTS),
        eviction=st.sampled_from(["lru", "lru2", "lru_turns"]), exclusive=st.booleans(), faults=FAULT_LEVEL,
        pools=_POOLS, logged=_LOGGED)
    @recorded
    def setup(self, with_state: bool, world: int, policy: str, dev_units: int, host_units: int,
              deadline: int | None, seed_keys: list[list[str]], layout: str | None = None,
              eviction: str = "lru", exclusive: bool = False, faults: int | None = None,
              pools: str = "units", logged: bool = False) -> None:
        """Build the core. ``pools``: capacities in ``units``, as a ``mapping`` group ->
        pages (one page more in the first group's device pool), or ``no_host`` (a core
        without a host tier: every host-side call must do nothing). ``logged``: record the
        example's event log and check it at the end (:mod:`kvtier.testing.logged`)."""
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        self.kit_set_args(with_state=with_state, world=world, policy=policy, dev_units=dev_units,
                          host_units=host_units, deadline=deadline, seed_keys=seed_keys, layout=layout,
                          eviction=eviction, exclusive=exclusive, faults=faults, pools=pools,
                          logged=logged)
        self.kit_fault_level(faults)
        self.world = world
        self.eviction, self.exclusive = eviction, exclusive
        lay = kit_layout(with_state) if layout is None else layout_named(layout)
        self.layers = probe_layers(lay)
        dev: int | dict[str, int] = dev_units
        host: int | dict[str, int] | None = None if pools == "no_host" else host_units
        if pools == "mapping":
            dev_map = units_to_pages(lay, dev_units)
            dev_map[lay.groups[0].name] += 1
            dev, host = dev_map, units_to_pages(lay, host_units)
        self.cache = CacheCore(lay, dev, host, policy=policy, world_size=world,
                               op_deadline_steps=deadline, eviction=eviction, exclusive=exclusive)
        want = {"device": dev if isinstance(dev, dict) else units_to_pages(lay, dev),
                "host": None if host is None else host if isinstance(host, dict) else units_to_pages(lay, host)}
        got = {"device": {g: a.capacity for g, a in self.cache.device.items()},
               "host": None if self.cache.host is None else {g: a.capacity for g, a in self.cache.host.items()}}
        if got != want:
            raise InvariantViolation("conservation", "the core's pools", f"capacities {got}, configured {want}")
        attach_active(self.cache)  # the event log, when one is recording (kvtier.eventlog)
        self.log = LogCheck.start(self.cache, logged)
        for key in seed_keys:
            self._insert(tuple(key), True)

    # -- rules ---------------------------------------------------------------------
    @rule(key=_KEYS, checkpoint=st.booleans(), chunk=st.booleans(),
          anchor=st.sampled_from(["none", "none", "hit", "recompute"]))
    @recorded
    def insert(self, key: list[str], checkpoint: bool, chunk: bool = False, anchor: str = "none") -> None:
        """Publish ``key`` (with a checkpoint at its end; a chunk checkpoint, which a
        deeper one replaces, when ``chunk``; ``anchor``: see :meth:`_insert`)."""
        self._insert(tuple(key), checkpoint, chunk, anchor)

    @rule(key=_KEYS, chunk=st.booleans())
    @recorded
    def insert_and_write_through(self, key: list[str], chunk: bool = False) -> None:
        self._insert(tuple(key), True, chunk)
        self.cache.issue_writebacks()
        self._take_commands()

    @rule(key=_KEYS, issue=st.booleans())
    @recorded
    def chunked_prefill(self, key: list[str], issue: bool = True) -> None:
        """A prompt prefilled one unit per chunk: each chunk publishes its prefix with a
        chunk checkpoint (the last one with a final checkpoint); with ``issue`` the queued
        writebacks are issued after each chunk, so a deeper chunk checkpoint lands while
        an ancestor's writeback (which reads that ancestor's checkpoint) is in flight."""
        k = tuple(key)
        for j in range(1, len(k) + 1):
            self._insert(k[:j], True, j < len(k))
            if issue:
                self.cache.issue_writebacks()
                self._take_commands()

    @rule(key=_KEYS, mode=st.sampled_from([m.value for m in MatchMode]), replay=st.booleans(),
          owner=st.sampled_from(["r", "q"]))
    @recorded
    def match_and_lock(self, key: list[str], mode: str, replay: bool, owner: str = "r") -> None:
        """Match ``key`` and lock the device hit for request ``owner``."""
        k = tuple(key)
        m = self.cache.match(k, mode, history_replay=replay and mode == MatchMode.PREFIX_REUSE.value)
        assert m.device_units <= m.host_units <= m.history_units <= len(k), "match bounds"
        if not (any(x[: m.history_units] == k[: m.history_units] for x in self.inserted) or m.history_units == 0):
            raise InvariantViolation("host_evict_leaves", f"match of {''.join(k)!r}",
                                     f"matched {m.history_units} units beyond any inserted prefix")
        ckpt_groups = views.checkpoint_groups(self.cache)
        if ckpt_groups and m.host_units and not m.recompute_tokens:
            t = m.terminal
            n = len(ckpt_groups)
            exact = (len(t.dev_ckpt) == n if t.state in DEVICE_READABLE and m.host_units == m.device_units
                     else len(t.host_ckpt) == n or len(t.dev_ckpt) == n)
            if not exact:
                raise InvariantViolation("exact_continuation_state", f"node {t.node_id} ({t.state})",
                                         f"a {mode} hit of {m.host_units} units ends where no checkpoint is held")
        if m.device_node is not self.cache.root and m.device_node.state in DEVICE_READABLE:
            self.locks.append(self._lock(m.device_node, owner))

    @precondition(lambda self: bool(views.checkpoint_groups(self.cache)))
    @rule(key=st.lists(st.sampled_from(_ALPHABET), min_size=4, max_size=7), publish=st.booleans())
    @recorded
    def replay_match(self, key: list[str], publish: bool) -> None:
        """A long prompt (published first without a checkpoint when ``publish``) matched with
        ``history_replay``. Model (``CacheLayout.replay_span_tokens``): when the history hit
        ends more than the replay span beyond the exact-state hit of a plain match, the
        match returns the history hit with ``recompute_tokens`` = the span; otherwise it is
        the plain match."""
        k = tuple(key)
        c = self.cache
        if publish:
            self._insert(k, False)
        plain = c.match(k)
        m = c.match(k, MatchMode.PREFIX_REUSE.value, history_replay=True)
        align, span = c.layout.alignment, c.layout.replay_span_tokens()
        deeper = m.history_units * align - span > plain.host_units * align
        got = (m.recompute_tokens, m.host_units, m.history_units)
        want = (span, m.history_units, plain.history_units) if deeper else (0, plain.host_units, plain.history_units)
        if got != want or (m.device_units < plain.device_units if deeper else m.device_units != plain.device_units):
            raise InvariantViolation("exact_continuation_state", f"match of {''.join(k)!r}",
                                     f"history_replay (span {span} tokens): (recompute, host units, history units) "
                                     f"{got}, expected {want}; device units {m.device_units} (plain match: "
                                     f"{plain.device_units} on the device, {plain.host_units} in all, history "
                                     f"{plain.history_units})")

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 100), again=st.booleans())
    @recorded
    def unlock(self, i: int, again: bool) -> None:
        if not self.locks:
            return
        r = self.locks.pop(i % len(self.locks))
        self._unlock(r)
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

    @precondition(lambda self: bool(views.nodes(self.cache)))
    @rule(i=st.integers(0, 100), extend=st.booleans())
    @recorded
    def load_node(self, i: int, extend: bool = False) -> None:
        """Load back the prefix of an existing node (host hits are likely); with ``extend``,
        after device pressure, then publish that prefix plus one unit with a checkpoint while the loadback is in
        flight (the publish stops at the loading node and hands the rest back)."""
        if extend:  # device pressure first (checked against the shadow order): host-only nodes to load
            self._pressure(0, 64, "device")
        n = self._node_at(i)
        if n is not None:
            key = node_prefix(n)
            lock = self._load_key(key)
            if extend:  # (the loading terminal, locked, as the anchor: not readable yet, so ignored)
                self._insert(tuple(str(u) for u in key) + ("z",), True, at=lock.node if lock is not None else None)

    @precondition(lambda self: bool(views.nodes(self.cache)))
    @rule(i=st.integers(0, 100), checkpoint=st.booleans(), chunk=st.booleans())
    @recorded
    def insert_split(self, i: int, checkpoint: bool, chunk: bool = False) -> None:
        """Insert a key diverging after the first unit of an existing node (a split in
        whatever state the node is in)."""
        n = self._node_at(i)
        if n is None:
            return
        key = node_prefix(n)
        if len(n.key) >= 2:
            cut = len(key) - len(n.key) + 1
            self._insert(tuple(str(u) for u in key[:cut]) + ("z",), checkpoint, chunk)

    @precondition(lambda self: any(any(q) for qs in self.events.values() for q in qs))
    @rule()
    @recorded
    def drain(self) -> None:
        """Deliver every pending completion successfully, oldest op first."""
        self._drain()

    @precondition(lambda self: bool(views.nodes(self.cache)))
    @rule(i=st.integers(0, 100))
    @recorded
    def borrow(self, i: int) -> None:
        """A request reads a node's device pages directly (invariant 14)."""
        nodes = [n for _, n in sorted(views.nodes(self.cache).items()) if n.state in DEVICE_READABLE]
        if nodes:
            self.receipts.append(self.cache.borrow([nodes[i % len(nodes)]], "r"))

    @precondition(lambda self: bool(self.receipts))
    @rule(i=st.integers(0, 100))
    @recorded
    def release_pin(self, i: int) -> None:
        if self.receipts:
            self.cache.release(self.receipts.pop(i % len(self.receipts)))

    @precondition(lambda self: bool(views.nodes(self.cache)))
    @rule(i=st.integers(0, 100))
    @recorded
    def request_writeback(self, i: int) -> None:
        n = self._node_at(i)
        if n is not None:
            cmd = self.cache.writeback(n, "r")
            if self.cache.host is None and (cmd is not None or views.outbox(self.cache)):
                raise InvariantViolation("root_closed_host", f"node {n.node_id}",
                                         "a core without a host tier issued a writeback")
            self._take_commands()

    @rule(limit=st.sampled_from([None, 1, 2, 0]))
    @recorded
    def tree_writebacks(self, limit: int | None) -> None:
        out = self.cache.issue_writebacks(limit)
        if (self.cache.host is None or limit == 0) and out:
            raise InvariantViolation("root_closed_host", "issue_writebacks",
                                     f"issued {len(out)} writebacks with limit {limit} "
                                     f"(host tier: {self.cache.has_host})")
        if limit is not None and len(out) > limit:
            raise ModelViolation("model_liveness", "issue_writebacks", f"issued {len(out)} operations, limit {limit}")
        self._take_commands()

    @precondition(lambda self: any(any(q) for qs in self.events.values() for q in qs))
    @rule(i=st.integers(0, 1000), roll=ROLL)
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
            self.expired.add(s.op_id)
            # the real completions may still arrive: they are absorbed
        for op in list(self.events):
            if op in self.expired:
                for q in self.events.pop(op):
                    for ev in q:
                        if self.cache.complete(ev) != []:
                            raise InvariantViolation("operation_ends_once", f"op {op}",
                                                     "a late completion after the deadline was not absorbed")

    @rule(g=st.integers(0, 3), n=st.integers(1, 8), tier=st.sampled_from(["device", "host"]))
    @recorded
    def pressure(self, g: int | str, n: int, tier: str) -> None:
        """Evict ``n`` pages of a history group (by index; a name in older sequences),
        checking the pages freed and the victims' order against the policy's shadow."""
        self._pressure(g, n, tier)

    @precondition(lambda self: not self.churned)
    @rule(go=st.integers(0, 19), count=st.sampled_from([300, 400]))
    @recorded
    def churn(self, go: int, count: int = 300) -> None:
        """At most once per example (when ``go`` is 0): a burst of ``count`` short prompts, each a
        fresh one-unit key published under device pressure (a long-running server's
        traffic: far more nodes created and evicted than live at once, so the eviction
        index's lazy heaps fill with stale entries and are rebuilt); then evictions on both
        tiers, whose victims are checked against the policy's shadow order."""
        self.churned = True  # (drawn once per example: a burst in one example in twenty)
        if go:
            return
        for i in range(count):
            self._insert((f"churn{i}",), False)
        self._pressure(0, 4, "device")
        self._pressure(0, 4, "host")

    @precondition(lambda self: any(n.state == "host" for n in views.nodes(self.cache).values()))
    @rule(i=st.integers(0, 100), times=st.integers(1, 3))
    @recorded
    def reload_and_demote(self, i: int, times: int = 1) -> None:
        """A host-only node is loaded back, its loadback completes and is released, then
        device pressure demotes it again (under the exclusive host tier its host copy moved
        to the device and must move back), ``times`` over; every eviction is checked
        against the policy's order."""
        nodes = [n for _, n in sorted(views.nodes(self.cache).items()) if n.state == "host"]
        key = tuple(node_prefix(nodes[i % len(nodes)]))
        for _ in range(times):
            locks, receipts = len(self.locks), len(self.receipts)
            self._load_key(key)
            self._drain()
            while len(self.locks) > locks:
                self._unlock(self.locks.pop())
            while len(self.receipts) > receipts:
                self.cache.release(self.receipts.pop())
            self._pressure(0, sum(a.capacity for a in self.cache.device.values()), "device")

    @rule()
    @recorded
    def quiesce(self) -> None:
        """Liveness: rounds of "issue queued writebacks, deliver everything successfully";
        within :func:`~kvtier.testing.models.liveness_bound` rounds nothing may be queued
        or in flight (every queued writeback issued, or dropped because its node left or
        the host refused it)."""
        c = self.cache
        bound = liveness_bound(len(views.nodes(c)))
        for _ in range(bound):
            c.issue_writebacks()
            self._take_commands()
            if not self.events and not views.writeback_queue(c):
                break
            self._drain()
        left = views.writeback_queue(c)
        if left or views.ops(c) or self.events:
            raise ModelViolation("model_liveness", "the core",
                                 f"after {bound} rounds: queued {sorted(left)}, in flight {sorted(views.ops(c))}")

    def kit_drain(self) -> None:
        """Every transfer completes (queued writebacks issued), then every lock, pin and
        borrow the rules took is released: nothing may be left on the core, and the whole
        tree must evict to full pools (:mod:`kvtier.testing.drain`)."""
        if not hasattr(self, "cache"):
            return
        c = self.cache

        def settle() -> None:
            for _ in range(liveness_bound(len(views.nodes(c))) + 2):
                c.issue_writebacks()
                self._take_commands()
                if not self.events:
                    return
                self._drain()

        settle()
        while self.locks:
            self._unlock(self.locks.pop())
        while self.receipts:
            c.release(self.receipts.pop())
        check_core_drained(c, "the core")
        evict_to_full_pools(c, settle, "the core")

    def teardown(self) -> None:
        """The drain (:meth:`kit_drain`); then the example's event log, when it recorded
        one, must pass ``kvtier check``."""
        log, self.log = self.log, None
        super().teardown()
        if log is not None:
            log.finish()


