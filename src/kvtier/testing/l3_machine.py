"""The L3 machine: two instances, each a :class:`~kvtier.fsm.core.CacheCore` with an
:class:`~kvtier.fsm.l3.L3Tier`, sharing one fake store that misbehaves.

It drives the product the way two engines and a store driver would: requests publish
prefixes (written through to the host), offer them to L3 under the write policy, prefetch
(exists, then get into reserved host pages), load fetched chunks back to the device, evict
under pressure, remove objects; the store answers the operations in any order, and with
the example's fault rate it fails an operation as a whole, drops an object between the
exists and the get, hands back a torn object, refuses a put or a remove, or answers after
the deadline (the late answer must be absorbed, and a cancelled get writes nothing). The
store may also drop any object at any time.

Checks after every step: both cores' invariants, both tiers' ``l3_*`` invariants, and the
byte-content model (invariant 12, :mod:`kvtier.testing.content`) on both trees: every
device or host page a node exposes holds the content written for its prefix, so a chunk
fetched from the store is checked against what the other instance computed. A put is
checked when the store reads it: the pinned host pages must still hold the prefix's
content (``l3_put_source_pinned``). Reserved pages hold garbage until a get writes them,
so a failed get made visible would be caught.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvtier.fsm import CacheCore, CapacityError, Completion, Direction
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.l3 import WRITE_POLICIES, L3Options, L3Tier, StoreCommand, StoreOp, StoreResult
from kvtier.fsm.records import TransferCommand

from . import _views as views
from .base import FAULT_LEVEL, LAYOUTS, ROLL, KitMachine, layout_named, recorded
from .content import check_tree_bytes, content, node_prefix
from .sequence import register_machine

__all__ = ["L3TierMachine"]

_KEYS = st.lists(st.sampled_from("ab"), min_size=1, max_size=4)  # few keys: instances share prefixes
#: The kit's layouts without continuation-state groups (the L3 tier refuses those).
L3_LAYOUTS: tuple[str, ...] = tuple(n for n in LAYOUTS if not layout_named(n).state_groups)
#: How a faulty store answers (``answer``'s ``how``): fail the whole operation, drop the
#: first key first (a get then misses; the store dropped it after its exists), tear the
#: first key (a get finds a corrupt object), or answer only a prefix of the keys.
_FAULTS = ("error", "drop", "torn", "partial")


@dataclass
class _Pending:
    """A store operation in flight: its command, the instance that issued it, and whether
    its deadline cancelled it (the driver then writes nothing, and its answer is late)."""

    inst: int
    cmd: StoreCommand
    cancelled: bool = False


class L3TierMachine(KitMachine):
    """Two instances with an L3 tier over one fake, faulty store (see the module doc)."""

    kit_invariants = ("check_cores", "check_tiers", "check_loaded_equals_written")

    def __init__(self) -> None:
        super().__init__()
        self.cores: list[CacheCore] = []
        self.tiers: list[L3Tier] = []
        self.dev: list[dict[tuple[str, int], Any]] = []
        self.host: list[dict[tuple[str, int], Any]] = []
        self.store: dict[str, dict[str, list[Any]]] = {}
        self.pending: list[_Pending] = []
        self.prefix_of: dict[str, tuple[Hashable, ...]] = {}
        self.now = 0.0
        self.owners = 0

    @initialize(layout=st.sampled_from(L3_LAYOUTS), dev_units=st.integers(3, 8), host_units=st.integers(3, 10),
                lease=st.sampled_from([0.0, 2.0, 5.0]), deadline=st.sampled_from([1.0, 3.0]),
                prefetch_units=st.integers(1, 4), write_policy=st.sampled_from(WRITE_POLICIES),
                hint=st.sampled_from([1, 16]), faults=FAULT_LEVEL)
    @recorded
    def setup(self, layout: str, dev_units: int, host_units: int, lease: float, deadline: float,
              prefetch_units: int, write_policy: str, hint: int, faults: int | None = None) -> None:
        self.kit_fault_level(faults)
        lay = layout_named(layout)
        opts = L3Options(model="kit", lease_s=lease, deadline_s=deadline, prefetch_units=prefetch_units,
                         write_policy=write_policy, write_threshold=2, hint_size=hint, eviction_lookahead=4)
        for _ in range(2):
            core = CacheCore(lay, dev_units, host_units, policy="write_through")
            self.cores.append(core)
            self.tiers.append(L3Tier(core, opts))
            self.dev.append({})
            self.host.append({})

    # -- helpers -----------------------------------------------------------------
    def _apply(self, i: int, cmd: TransferCommand, ok: bool) -> None:
        dev, host = self.dev[i], self.host[i]
        src, dst = (dev, host) if cmd.direction is Direction.WRITEBACK else (host, dev)
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", cmd.op_id)

    def _settle_core(self, i: int) -> None:
        """Run the core's transfers to their end (each fails with the example's fault rate,
        drawn from its op id so a replay is exact)."""
        core = self.cores[i]
        for _ in range(64):  # a settle may issue more (a writeback after a loadback): bounded
            cmds = core.poll_commands()
            if not cmds:
                return
            for cmd in cmds:
                ok = not self.kit_fail((cmd.op_id * 7919) % 1000)
                core.complete(Completion(cmd.op_id, 0, ok, None))
                self._apply(i, cmd, ok)
        raise InvariantViolation("model_liveness", f"instance {i}", "transfers kept coming after 64 rounds")

    def _take_store_commands(self, i: int) -> None:
        for cmd in self.tiers[i].poll_commands():
            self.pending.append(_Pending(i, cmd))
            if cmd.kind is StoreOp.GET:  # reserved pages hold garbage until the get writes them
                for pages in cmd.pages:
                    for g, ps in pages.items():
                        for p in ps:
                            self.host[i][(g, p)] = ("reserved", cmd.op_id)

    def _remember_keys(self, i: int, key: tuple[Hashable, ...]) -> None:
        for j, k in enumerate(self.tiers[i].keys_for(key)):
            self.prefix_of[k] = key[: j + 1]

    def _expected(self, key: str) -> dict[str, list[Any]]:
        prefix = self.prefix_of.get(key)
        if prefix is None:  # a host-eviction victim put without an offer of its key: find it
            for i, core in enumerate(self.cores):
                for n in views.nodes(core).values():
                    self._remember_keys(i, node_prefix(n))
            prefix = self.prefix_of[key]
        ppu = views.pages_per_unit(self.cores[0])
        u = len(prefix) - 1
        return {g: [content(prefix, g, u * p + j, ppu) for j in range(p)] for g, p in ppu.items()}

    # -- rules: requests ---------------------------------------------------------------
    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def publish(self, i: int, key: list[str]) -> None:
        """A request computed ``key``: publish it on the device, write it through to the host."""
        self._publish(i, tuple(key))

    def _publish(self, i: int, k: tuple[Hashable, ...]) -> None:
        core = self.cores[i]
        ppu, history = views.pages_per_unit(core), views.history_groups(core)
        m = core.match(k)
        base = core.device_pages(m.device_node)
        rest = len(k) - m.device_units
        hold = core.lock(m.device_node, "r") if m.device_node is not core.root else None
        try:
            fresh = core.alloc_device({g: rest * ppu[g] for g in history})
        except CapacityError:
            if hold is not None:
                core.unlock(hold)
            return
        pages = {}
        for g in history:
            own = fresh.get(g, [])
            pages[g] = base[g] + own
            for j, p in enumerate(own):
                self.dev[i][(g, p)] = content(k, g, len(base[g]) + j, ppu)
        result = core.insert(k, pages)
        if hold is not None:
            core.unlock(hold)
        for ps in (result.duplicates, result.kept):
            for g, pp in ps.items():
                core.free_device({g: pp})
        core.issue_writebacks()
        self._settle_core(i)

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def offer(self, i: int, key: list[str]) -> None:
        """A request ended: the write policy puts what it picks."""
        self._offer(i, tuple(key))

    def _offer(self, i: int, key: tuple[Hashable, ...]) -> None:
        self._remember_keys(i, key)
        self.tiers[i].offer(key, self.now)
        self._take_store_commands(i)

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def prefetch(self, i: int, key: list[str]) -> None:
        """A request waits: ask the store for what lies beyond its local hit."""
        self._prefetch(i, tuple(key))

    def _prefetch(self, i: int, key: tuple[Hashable, ...]) -> None:
        self._remember_keys(i, key)
        self.owners += 1
        self.tiers[i].prefetch(f"q{self.owners}", key, self.now)
        self._take_store_commands(i)

    def _known(self, i: int, pick: int) -> tuple[Hashable, ...] | None:
        """The prefix of a node of instance ``i``'s tree (by node id, modulo the count)."""
        nodes = views.nodes(self.cores[i])
        ids = sorted(nodes)
        return node_prefix(nodes[ids[pick % len(ids)]]) if ids else None

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100))
    @recorded
    def offer_known(self, i: int, pick: int) -> None:
        """Offer a prefix instance ``i`` holds (puts are likely)."""
        key = self._known(i, pick)
        if key is not None:
            self._offer(i, key)

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), longer=st.booleans())
    @recorded
    def prefetch_known(self, i: int, pick: int, longer: bool) -> None:
        """Prefetch, on instance ``i``, a prefix the other instance holds (gets are likely)."""
        key = self._known(1 - i, pick)
        if key is not None:
            self._prefetch(i, key + (("a",) if longer else ()))

    @rule(i=st.integers(0, 1), key=_KEYS, roll=ROLL)
    @recorded
    def serve(self, i: int, key: list[str], roll: int) -> None:
        """A whole request on instance ``i``, as an engine runs it: prefetch (the store
        answers at once, misbehaving as ``roll`` draws), load the hit back, publish the
        prompt, offer it (the puts' answers come later)."""
        self._serve(i, tuple(key), roll)

    @precondition(lambda self: any(views.nodes(c) for c in self.cores))
    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), roll=ROLL)
    @recorded
    def serve_twice(self, i: int, pick: int, roll: int) -> None:
        """The other instance's prefix, put (answered at once), then served on instance
        ``i`` twice with everything evictable evicted in between: the second request
        fetches again what the first fetched (under a read lease, when the store grants
        one); then the leases pass."""
        key = self._known(1 - i, pick)
        if key is None:
            return
        self._offer(1 - i, key)
        for n in range(len(self.pending)):
            mine = [j for j, p in enumerate(self.pending) if p.inst == 1 - i and p.cmd.kind is StoreOp.PUT]
            if not mine:
                break
            self._answer_one(mine[0], 999, "error")  # roll 999: never a fault (the puts must land)
        self._serve(i, key, roll)
        self._evict_all(i)
        self._serve(i, key, (roll * 31 + 7) % 1000)
        self._advance(self.tiers[i].options.lease_s + 0.5)  # the read leases pass

    @precondition(lambda self: bool(self.store))
    @rule(i=st.integers(0, 1), pick=st.integers(0, 100))
    @recorded
    def drop_between(self, i: int, pick: int) -> None:
        """A prefetch on instance ``i`` of a prefix the store holds; the store answers the
        exists, then drops the first object before the get: the get misses, the hit
        shortens, nothing is read."""
        keys = sorted(self.store)
        key = self.prefix_of.get(keys[pick % len(keys)])
        if key is None:
            return
        self._prefetch(i, key)
        mine = [j for j, p in enumerate(self.pending) if p.inst == i and p.cmd.kind is StoreOp.EXISTS]
        if not mine:
            return
        self._answer_one(mine[-1], 999, "error")  # roll 999: never a fault
        for p in self.pending:
            if p.inst == i and p.cmd.kind is StoreOp.GET and p.cmd.keys:
                self.store.pop(p.cmd.keys[0], None)
        mine = [j for j, p in enumerate(self.pending) if p.inst == i and p.cmd.kind is StoreOp.GET]
        if mine:
            self._answer_one(mine[-1], 999, "error")

    def _serve(self, i: int, k: tuple[Hashable, ...], roll: int) -> None:
        self._prefetch(i, k)
        for n in range(8):  # exists, then get: both of instance i, answered in order
            mine = [j for j, p in enumerate(self.pending) if p.inst == i and p.cmd.kind in (StoreOp.EXISTS,
                                                                                              StoreOp.GET)]
            if not mine:
                break
            r = (roll + 7919 * n) % 1000
            self._answer_one(mine[0], r, _FAULTS[r % len(_FAULTS)])
        self._load(i, k)
        self._publish(i, k)
        self._offer(i, k)

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def load(self, i: int, key: list[str]) -> None:
        """Admit a request: load its host hit (fetched chunks included) back to the device."""
        self._load(i, tuple(key))

    def _load(self, i: int, key: tuple[Hashable, ...]) -> None:
        core = self.cores[i]
        m = core.match(key)
        if not m.needs_loadback:
            return
        try:
            res = core.load(m, "r")
        except CapacityError:
            return
        self._settle_core(i)
        core.release(res.pin)
        core.unlock(res.lock)

    @rule(i=st.integers(0, 1), tier=st.sampled_from(["device", "host"]), n=st.integers(1, 6))
    @recorded
    def pressure(self, i: int, tier: str, n: int) -> None:
        """Evict ``n`` pages of the first history group (pinned put sources and fetching
        nodes must survive)."""
        core = self.cores[i]
        g = views.history_groups(core)[0]
        if tier == "device":
            core.evict_device({g: n})
        else:
            core.evict_host({g: n})

    @rule(i=st.integers(0, 1))
    @recorded
    def evict_all(self, i: int) -> None:
        """Evict everything instance ``i`` may evict from both tiers (its next requests
        must go to the store again: a leased object is then fetched again)."""
        self._evict_all(i)

    def _evict_all(self, i: int) -> None:
        core = self.cores[i]
        big = {g: 1 << 20 for g in views.history_groups(core)}
        core.evict_device(big)
        core.evict_host(big)

    @rule(i=st.integers(0, 1), key=_KEYS, last=st.booleans())
    @recorded
    def remove(self, i: int, key: list[str], last: bool) -> None:
        """Remove ``key``'s objects (or only its last one) from the store."""
        keys = self.tiers[i].keys_for(tuple(key))
        self.tiers[i].remove(keys[-1:] if last else keys, self.now)
        self._take_store_commands(i)

    # -- rules: the store --------------------------------------------------------------
    @precondition(lambda self: bool(self.pending))
    @rule(pick=st.integers(0, 100), roll=ROLL, how=st.sampled_from(_FAULTS))
    @recorded
    def answer(self, pick: int, roll: int, how: str) -> None:
        """The store answers one operation in flight (any order); with the example's fault
        rate it misbehaves as ``how`` says."""
        self._answer_one(pick, roll, how)

    def _answer_one(self, pick: int, roll: int, how: str) -> None:
        p = self.pending.pop(pick % len(self.pending))
        fault = self.kit_fail(roll)
        res = self._answer(p, how if fault else None)
        tier = self.tiers[p.inst]
        late = tier.stats.absorbed_late_results
        tier.complete(res, self.now)
        if p.cancelled and tier.stats.absorbed_late_results != late + 1:
            raise InvariantViolation("l3_ends_by_deadline", f"op {p.cmd.op_id}",
                                     "a late answer after the deadline was not absorbed")
        self._take_store_commands(p.inst)

    @precondition(lambda self: bool(self.pending))
    @rule(roll=ROLL)
    @recorded
    def drain(self, roll: int) -> None:
        """The store answers everything in flight, oldest first (what follows included: the
        get after an exists); the ``k``-th answer misbehaves when the roll drawn from
        ``roll`` and ``k`` says so."""
        for k in range(64):
            if not self.pending:
                return
            r = (roll + 7919 * k) % 1000
            self._answer_one(0, r, _FAULTS[r % len(_FAULTS)])

    def _answer(self, p: _Pending, fault: str | None) -> StoreResult:
        cmd, store = p.cmd, self.store
        if fault == "error":
            return StoreResult(cmd.op_id, error="StoreError: the fake store failed the operation")
        if cmd.kind is StoreOp.EXISTS:
            n = 0
            for k in cmd.keys:
                if k not in store:
                    break
                n += 1
            return StoreResult(cmd.op_id, present=n - 1 if fault == "partial" and n else n)
        if cmd.kind is StoreOp.PUT:
            oks = []
            for j, (k, pages) in enumerate(zip(cmd.keys, cmd.pages)):
                if p.cancelled or (fault == "partial" and j == len(cmd.keys) - 1):
                    oks.append(False)
                    continue
                got = {g: [self.host[p.inst].get((g, pg)) for pg in ps] for g, ps in pages.items()}
                if got != self._expected(k):
                    raise InvariantViolation("l3_put_source_pinned", f"put {cmd.op_id} of object {k[:12]}",
                                             f"the host pages it reads hold {got!r}")
                store[k] = got
                oks.append(True)
            return StoreResult(cmd.op_id, ok=tuple(oks))
        if cmd.kind is StoreOp.GET:
            if fault == "drop" and cmd.keys:
                store.pop(cmd.keys[0], None)
            if fault == "torn" and cmd.keys and cmd.keys[0] in store:
                store[cmd.keys[0]] = {"torn": [cmd.op_id]}
            oks, corrupt = [], []
            for j, (k, pages) in enumerate(zip(cmd.keys, cmd.pages)):
                obj = store.get(k)
                if obj is None or (fault == "partial" and j == len(cmd.keys) - 1):
                    break
                if set(obj) != set(pages):  # the object's check fails: nothing is written
                    corrupt.append(k)
                    break
                if not p.cancelled:
                    for g, ps in pages.items():
                        for pg, v in zip(ps, obj[g]):
                            self.host[p.inst][(g, pg)] = v
                oks.append(True)
            oks += [False] * (len(cmd.keys) - len(oks))
            return StoreResult(cmd.op_id, ok=tuple(oks), corrupt=tuple(corrupt))
        oks = []
        for j, k in enumerate(cmd.keys):
            if fault == "partial" and j == len(cmd.keys) - 1:
                oks.append(False)
                continue
            store.pop(k, None)
            oks.append(True)
        return StoreResult(cmd.op_id, ok=tuple(oks))

    @precondition(lambda self: bool(self.store))
    @rule(pick=st.integers(0, 100))
    @recorded
    def store_drops(self, pick: int) -> None:
        """The store drops an object on its own (any time: between an exists and a get too)."""
        keys = sorted(self.store)
        del self.store[keys[pick % len(keys)]]

    @rule(dt=st.sampled_from([0.5, 1.5, 3.5, 6.0]))
    @recorded
    def advance(self, dt: float) -> None:
        """Time passes: operations past their deadline fail (the driver is told to cancel
        them: their answers come late), leases end, deferred removes go out."""
        self._advance(dt)

    def _advance(self, dt: float) -> None:
        self.now += dt
        for i, tier in enumerate(self.tiers):
            cancelled: list[int] = []
            tier.expire(self.now, cancelled.append)
            for p in self.pending:
                if p.inst == i and p.cmd.op_id in cancelled:
                    p.cancelled = True
            self._take_store_commands(i)

    # -- invariants ----------------------------------------------------------------------
    def check_cores(self) -> None:
        for core in self.cores:
            core.check_invariants()

    def check_tiers(self) -> None:
        for tier in self.tiers:
            tier.check_invariants()

    def check_loaded_equals_written(self) -> None:
        for core, dev, host in zip(self.cores, self.dev, self.host):
            check_tree_bytes(core, dev, host)


register_machine("l3tier", L3TierMachine)
