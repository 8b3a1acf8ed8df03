"""The L3 machine's state and the steps its rules share (:mod:`kvtier.testing.l3_machine`).

:class:`L3Steps` holds the two instances (a core with an L3 tier each), the fake store
they share, the store operations in flight and the per-instance models, the steps the
rules take (publish, offer, prefetch, serve, load, remove, answer, advance) and the
invariant checks; the rules and the hostile calls are in :mod:`kvtier.testing.l3_machine`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kvtier.fsm import CacheCore, CapacityError, Completion, Direction
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.l3 import L3Tier, StoreCommand, StoreOp, StoreResult
from kvtier.fsm.records import TransferCommand

from . import _views as views
from .drain import check_core_drained, check_l3_drained, evict_to_full_pools
from .base import KitMachine
from .content import check_tree_bytes, content, node_prefix
from .l3_store import FakeStore, HostBytes, run_command, sync_driver
from .models import ModelViolation

__all__ = ["L3Steps", "InstanceModel", "FAULTS", "ERROR_KINDS", "words"]

#: How a faulty store answers (``answer``'s ``how``): fail the whole operation, drop the
#: first key first (a get then misses; the store dropped it after its exists), tear the
#: first key (a get finds a corrupt object), answer only a prefix of the keys, or answer a
#: get with a gap (a middle object missing: the delivered prefix ends before it).
FAULTS = ("error", "drop", "torn", "partial", "gap", "holes", "short")
#: ``holes`` and ``short`` answer a get as another store driver may: ok flags with holes after
#: the first miss (later objects reported delivered), or an ok list cut after the leading run
#: (shorter than the keys). Only the leading run of ok objects may be loaded, the rest released.
#: The fake store's own fault under each of them:
_STORE_FAULT = {"holes": "gap", "short": "partial"}
#: The kinds of error the fake store reports (the text before the first colon): a backend
#: failure, a saturated driver queue, and a backend's own timeout named ``deadline`` (the
#: tier's expiries use that kind too, and must not count the backend's).
ERROR_KINDS = ("StoreError", "queue", "deadline")


def words(n: int) -> list[tuple[str, ...]]:
    """Every word of ``n`` letters over "ab", in order."""
    out: list[tuple[str, ...]] = [()]
    for _ in range(n):
        out = [w + (c,) for w in out for c in "ab"]
    return out


@dataclass
class _Pending:
    """A store operation in flight: its command, the instance that issued it, and whether
    its deadline cancelled it (the driver then writes nothing, and its answer is late)."""

    inst: int
    cmd: StoreCommand
    cancelled: bool = False
    owner: str | None = None


@dataclass
class InstanceModel:
    """Per instance: the backend errors the store reported, by kind; the units each
    finished prefetch's get delivered, by owner; keys whose remove was deferred."""

    errors: dict[str, int] = field(default_factory=dict)
    fetched: dict[str, int] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)


class L3Steps(KitMachine):
    """The L3 machine's state, shared steps and invariant checks (see
    :class:`~kvtier.testing.l3_machine.L3TierMachine`)."""

    def __init__(self) -> None:
        super().__init__()
        self.cores: list[CacheCore] = []
        self.tiers: list[L3Tier] = []
        self.dev: list[dict[tuple[str, int], Any]] = []
        self.host: list[HostBytes] = []
        self.fake = FakeStore()
        self.store: dict[str, bytes] = self.fake.objects  # key -> object bytes
        self.drivers: list[Any] = []  # per instance: a StoreDriver run on this thread
        self.table: dict[bytes, tuple[Any, str, int]] = {}  # host byte patterns -> content values
        # per instance: key -> the end of the read lease a get it was answered left on it
        self.leases: list[dict[str, float]] = []
        self.pending: list[_Pending] = []
        self.prefix_of: dict[str, tuple[Hashable, ...]] = {}
        self.now = 0.0
        self.owners = 0
        self.model: list[InstanceModel] = []
        self.refused = 0

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
        raise ModelViolation("model_liveness", f"instance {i}", "transfers kept coming after 64 rounds")

    def _take_store_commands(self, i: int) -> None:
        opts = self.tiers[i].options
        for cmd in self.tiers[i].poll_commands():
            if cmd.kind is StoreOp.PUT and not 1 <= len(cmd.keys) <= opts.max_put_units:
                raise ModelViolation("model_l3_options", f"put {cmd.op_id}",
                                         f"{len(cmd.keys)} objects; max_put_units is {opts.max_put_units}")
            if cmd.kind is StoreOp.EXISTS and not opts.min_prefetch_units <= len(cmd.keys) <= opts.prefetch_units:
                raise ModelViolation("model_l3_options", f"exists {cmd.op_id}",
                                         f"asks {len(cmd.keys)} keys; the options allow "
                                         f"{opts.min_prefetch_units}..{opts.prefetch_units}")
            if cmd.kind is StoreOp.REMOVE:
                self.model[i].deferred.difference_update(cmd.keys)
                leased = [k[:12] for k in cmd.keys if self.leases[i].get(k, 0.0) > self.now]
                if leased:
                    raise InvariantViolation("l3_lease_blocks_remove", f"remove {cmd.op_id} on instance {i}",
                                             f"removes objects {leased} under the read lease a get of this "
                                             f"instance left (a get leases every object it asks for)")
            op = self.tiers[i].operations.get(cmd.op_id)
            self.pending.append(_Pending(i, cmd, owner=op.owner if op is not None else None))
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

    def _offer(self, i: int, key: tuple[Hashable, ...]) -> None:
        self._remember_keys(i, key)
        self.tiers[i].offer(key, self.now)
        self._take_store_commands(i)

    def _prefetch(self, i: int, key: tuple[Hashable, ...]) -> str:
        self._remember_keys(i, key)
        self.owners += 1
        owner = f"q{self.owners}"
        self.tiers[i].prefetch(owner, key, self.now)
        self._take_store_commands(i)
        return owner

    def _known(self, i: int, pick: int) -> tuple[Hashable, ...] | None:
        """The prefix of a node of instance ``i``'s tree (by node id, modulo the count)."""
        nodes = views.nodes(self.cores[i])
        ids = sorted(nodes)
        return node_prefix(nodes[ids[pick % len(ids)]]) if ids else None

    def _serve(self, i: int, k: tuple[Hashable, ...], roll: int) -> None:
        owner = self._prefetch(i, k)
        for n in range(8):  # exists, then get: both of instance i, answered in order
            mine = [j for j, p in enumerate(self.pending) if p.inst == i and p.cmd.kind in (StoreOp.EXISTS,
                                                                                              StoreOp.GET)]
            if not mine:
                break
            r = (roll + 7919 * n) % 1000
            self._answer_one(mine[0], r, FAULTS[r % len(FAULTS)])
        self._load(i, k)
        self._forget(i, owner)
        self._publish(i, k)
        self._offer(i, k)

    def _forget(self, i: int, owner: str) -> None:
        """The request was admitted or ended: the engine drops its prefetch record. A
        finished one reports what its get delivered (the model's count), then nothing; one
        in flight is detached (its operation ends by the store's answer or its deadline)."""
        tier = self.tiers[i]
        busy = tier.prefetching(owner)
        if not busy and tier.fetched_units(owner) != self.model[i].fetched.get(owner, 0):
            raise ModelViolation("model_l3_fetched", f"prefetch {owner} on instance {i}",
                                     f"fetched_units {tier.fetched_units(owner)}, but its get delivered "
                                     f"{self.model[i].fetched.get(owner, 0)}")
        tier.forget(owner)
        if tier.prefetching(owner) or tier.fetched_units(owner) != 0:
            raise ModelViolation("model_l3_fetched", f"prefetch {owner} on instance {i}",
                                     "forget kept a prefetch (in flight: it is detached)")
        self._detach(i, owner)

    def _cancel(self, i: int, pick: int, tell: bool) -> None:
        """The ``pick``-th request with a prefetch in flight on instance ``i`` is aborted:
        ``cancel`` with the driver's callback (``tell``: the operation fails now, its
        reserved host pages freed once, its answer comes late) or without (detached: the
        pages stay reserved until the store answers or the deadline passes)."""
        tier = self.tiers[i]
        owners = sorted(p[0] for p in views.l3_internals(tier)[3] if not p[6])
        if not owners:
            return
        owner = owners[pick % len(owners)]
        op_id = next(p[4] for p in views.l3_internals(tier)[3] if p[0] == owner)
        told: list[int] = []
        reserved = tier.outstanding().reserved_pages
        mine = sum(len(ps) for n in (tier.core.fetches.nodes(op_id) if op_id in tier.core.fetches else ())
                   for ps in n.pending.values())
        if not tier.cancel(owner, self.now, told.append if tell else None) or tier.prefetching(owner):
            raise ModelViolation("model_l3_fetched", f"prefetch {owner} on instance {i}", "cancel left it in flight")
        left = tier.outstanding().reserved_pages
        if told != ([op_id] if tell else []) or left != (reserved - mine if tell else reserved):
            raise ModelViolation("model_drain", f"cancel of {owner}'s prefetch on instance {i}",
                                 f"driver told {told} (op {op_id}), reserved host pages {reserved} -> {left} "
                                 f"(the get held {mine})")
        for op in told:  # (the tier tells the driver only of a command it handed out)
            self.drivers[i].cancel(op)
        for p in self.pending:
            if tell and p.inst == i and p.cmd.op_id == op_id:
                p.cancelled = True
        self._detach(i, owner)

    def _detach(self, i: int, owner: str) -> None:
        """``owner``'s prefetch record is gone: its operations still in flight answer no one."""
        self.model[i].fetched.pop(owner, None)
        for p in self.pending:
            if p.inst == i and p.owner == owner:
                p.owner = None

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

    def _evict_all(self, i: int) -> None:
        core = self.cores[i]
        big = {g: 1 << 20 for g in views.history_groups(core)}
        core.evict_device(big)
        core.evict_host(big)

    def _remove(self, i: int, keys: list[str]) -> None:
        """Remove ``keys``: those busy (an operation in flight, or a lease) must wait, and go
        out at the first expiry after they are free (:meth:`_advance` checks)."""
        tier = self.tiers[i]
        busy = {k for k in keys if k in tier.objects}
        leased = sum(1 for k in keys if k in tier.objects and tier.objects[k].state == "leased")
        deferred = tier.stats.removes_deferred_by_lease
        tier.remove(keys, self.now)
        issued = {k for c in views.l3_internals(tier)[4] if c.kind is StoreOp.REMOVE for k in c.keys}
        if issued & busy or tier.stats.removes_deferred_by_lease != deferred + leased:
            raise InvariantViolation("l3_lease_blocks_remove", f"remove on instance {i}",
                                     f"removed busy objects {sorted(k[:12] for k in issued & busy)} at once, or "
                                     f"counted {tier.stats.removes_deferred_by_lease - deferred} deferrals by "
                                     f"lease for {leased} leased objects")
        self._take_store_commands(i)
        self.model[i].deferred |= busy

    def _stored_prefix(self, pick: int, min_units: int = 1) -> tuple[Hashable, ...]:
        """A prefix of at least ``min_units`` units the store holds (by ``pick``). When it
        holds none, a third engine sharing the store puts one first: ``min_units`` to 4
        units over "ab" (by ``pick``), with the content every instance computes for it."""
        keys = sorted(k for k in self.store if k in self.prefix_of and len(self.prefix_of[k]) >= min_units)
        if keys:
            return self.prefix_of[keys[pick % len(keys)]]
        n = max(min_units, 1 + pick % 4)
        key = tuple("ab"[(pick >> j) & 1] for j in range(n))
        self._remember_keys(0, key)
        for k in self.tiers[0].keys_for(key):
            self.store[k] = self.host[0].blob(k, self._expected(k))
        return key

    def _answer_exists(self, i: int, owner: str) -> None:
        """The store answers ``owner``'s exists on instance ``i`` now, without a fault."""
        mine = [j for j, p in enumerate(self.pending)
                if p.inst == i and p.owner == owner and p.cmd.kind is StoreOp.EXISTS]
        if mine:
            self._answer_one(mine[0], 999, "error")  # roll 999: never a fault

    def _gappy_get(self, i: int, pick: int, how: str) -> None:
        """A get of a stored prefix of at least 2 units on instance ``i``, answered as
        ``how`` ("holes" or "short") whatever the fault rate; then the hit is loaded and the
        prefetch forgotten (its fetched count checked against the leading run)."""
        key = self._stored_prefix(pick, 2)
        self._evict_all(i)
        owner = self._prefetch(i, key)
        self._answer_exists(i, owner)
        mine = [j for j, p in enumerate(self.pending) if p.inst == i and p.owner == owner and p.cmd.kind is StoreOp.GET]
        if mine:
            self._answer_one(mine[0], pick, how, forced=True)
        self._load(i, key)
        self._forget(i, owner)

    def _answer_one(self, pick: int, roll: int, how: str, error: str | None = None, forced: bool = False) -> None:
        """Answer ``pending[pick]`` (misbehaving as ``how`` when ``roll`` draws a fault or
        ``forced``), or fail it as a whole with an ``error`` of that kind."""
        p = self.pending.pop(pick % len(self.pending))
        if error is not None:
            res = self._answer(p, "error", error)
        else:
            fault = forced or self.kit_fail(roll)
            res = self._answer(p, how if fault else None, ERROR_KINDS[roll % len(ERROR_KINDS)])
        tier, model = self.tiers[p.inst], self.model[p.inst]
        late = tier.stats.absorbed_late_results
        tier.complete(res, self.now)
        if p.cancelled and tier.stats.absorbed_late_results != late + 1:
            raise InvariantViolation("l3_ends_by_deadline", f"op {p.cmd.op_id}",
                                     "a late answer after the deadline was not absorbed")
        if roll % 7 == 3:  # the store answers the same operation twice: the second is absorbed
            before, late = tier.outstanding(), tier.stats.absorbed_late_results
            tier.complete(res, self.now)
            if tier.stats.absorbed_late_results != late + 1 or tier.outstanding() != before:
                raise InvariantViolation("l3_duplicate_answer_absorbed", f"op {p.cmd.op_id}",
                                         "a duplicate answer was not absorbed without a change")
        if not p.cancelled:
            if res.error is not None:
                kind = res.error.split(":", 1)[0]
                model.errors[kind] = model.errors.get(kind, 0) + 1
            if p.cmd.kind is StoreOp.GET and p.owner is not None:
                acked = 0
                while res.error is None and acked < len(res.ok) and res.ok[acked]:
                    acked += 1
                model.fetched[p.owner] = acked
        self._check_errors(p.inst)
        self._take_store_commands(p.inst)

    def _check_errors(self, i: int) -> None:
        if self.tiers[i].stats.errors != self.model[i].errors:
            raise ModelViolation("model_l3_counters", f"instance {i}",
                                     f"error counters {self.tiers[i].stats.errors}, but the store reported "
                                     f"{self.model[i].errors} (expiries are not the store's errors)")

    def _answer(self, p: _Pending, fault: str | None, kind: str = ERROR_KINDS[0]) -> StoreResult:
        """The store's answer to ``p``: a whole failure, else the instance's store driver
        runs the command against the fake store misbehaving as ``fault`` says."""
        cmd = p.cmd
        if cmd.kind is StoreOp.PUT and not p.cancelled and fault != "error":
            for k, pages in zip(cmd.keys, cmd.pages):
                got = {g: [self.host[p.inst].get((g, pg)) for pg in ps] for g, ps in pages.items()}
                if got != self._expected(k):
                    raise InvariantViolation("l3_put_source_pinned", f"put {cmd.op_id} of object {k[:12]}",
                                             f"the host pages it reads hold {got!r}")
        lease = self.tiers[p.inst].options.lease_s
        store_fault = _STORE_FAULT.get(fault or "", fault)
        self.fake.now, self.fake.lease_s, self.fake.fault, self.fake.error_kind = self.now, lease, store_fault, kind
        try:
            res = run_command(self.drivers[p.inst], cmd)
        finally:
            self.fake.fault = None
        if cmd.kind is StoreOp.GET and fault in _STORE_FAULT and res.error is None:
            run = 0
            while run < len(res.ok) and res.ok[run]:
                run += 1
            ok = list(res.ok[:run]) if fault == "short" else [*res.ok[:run + 1], *[True] * (len(res.ok) - run - 1)]
            res = replace(res, ok=tuple(ok))
        if cmd.kind is StoreOp.GET and fault != "error":
            self.host[p.inst].read_back(cmd.pages)
            if not p.cancelled and lease > 0:  # the tier hears of these leases: it must respect them
                for k in cmd.keys:
                    if self.fake.leases.get(k) == self.now + lease:
                        self.leases[p.inst][k] = self.now + lease
        return res

    def _advance(self, dt: float, tell: bool = True) -> None:
        self.now += dt
        for i, tier in enumerate(self.tiers):
            told: list[int] = []
            owners = {p.cmd.op_id: p.owner for p in self.pending if p.inst == i and p.cmd.kind is StoreOp.GET}
            expired = tier.expire(self.now, told.append) if tell else tier.expire(self.now)
            if tell and told != expired:
                raise InvariantViolation("l3_ends_by_deadline", f"instance {i}",
                                         f"expire cancelled {told} but reports {expired}")
            for op_id in expired:  # (told through the callback or from the ids returned)
                self.drivers[i].cancel(op_id)
            for p in self.pending:
                if p.inst == i and p.cmd.op_id in expired:
                    p.cancelled = True
            for op_id in expired:
                owner = owners.get(op_id)
                if owner is not None:
                    self.model[i].fetched[owner] = 0  # an expired get delivered nothing
            self._check_errors(i)
            self._take_store_commands(i)
            stuck = {k for k in self.model[i].deferred if k not in tier.objects}
            if stuck or not self.model[i].deferred <= set(views.l3_internals(tier)[2]):
                raise ModelViolation("model_liveness", f"instance {i}",
                                         f"deferred removes of free objects {sorted(k[:12] for k in stuck)} "
                                         f"did not go out at expiry, or left the waiting list")

    # -- the end of an example ----------------------------------------------------------
    def kit_drain(self) -> None:
        """The store answers everything without a fault, transfers succeed, time passes
        until every lease has ended and every deferred remove went out and was answered;
        then neither tier nor core may hold anything (store operations, commands,
        prefetches, reserved pages, put pins, leases, receipts), neither store driver may
        keep a command, a result or a cancelled id, and both trees must evict to full pools (:mod:`kvtier.testing.drain`)."""
        if not self.tiers:
            return
        self.kit_rate = 0.0
        for _ in range(64):
            for _ in range(256):
                if not self.pending:
                    break
                self._answer_one(0, 999, "error")  # roll 999: never a fault
            for i in range(len(self.cores)):
                self._settle_core(i)
            self._advance(1e6)  # past every deadline and lease: deferred removes go out
            if not self.pending:
                break
        for i, (core, tier) in enumerate(zip(self.cores, self.tiers)):
            for owner in sorted(p[0] for p in views.l3_internals(tier)[3]):
                self._forget(i, owner)
            drv = self.drivers[i]
            if drv._queued or drv._done or drv._cancelled:  # every command ran, every result was taken
                raise ModelViolation("model_drain", f"instance {i}'s store driver",
                                     f"{drv._queued} commands queued, {len(drv._done)} results not taken, "
                                     f"cancelled ids kept {sorted(drv._cancelled)}")
            check_l3_drained(tier, f"instance {i}'s L3 tier")
            check_core_drained(core, f"instance {i}'s core")
            evict_to_full_pools(core, partial(self._settle_core, i), f"instance {i}'s core")

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
