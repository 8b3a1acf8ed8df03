"""The L3 machine: two instances, each a :class:`~kvtier.fsm.node.core.CacheCore` with an
:class:`~kvtier.fsm.l3.L3Tier`, sharing one fake store that misbehaves.

It drives the product the way two engines and a store driver would: requests publish
prefixes (written through to the host), offer them to L3 under the write policy, prefetch
(exists, then get into reserved host pages), load fetched chunks back to the device, evict
under pressure, remove objects; the store answers the operations in any order, and with
the example's fault rate it fails an operation as a whole, drops an object between the
exists and the get, hands back a torn object, answers a get with holes in its ok flags
or a short ok list (another driver may: only the leading run loads), refuses a put or a
remove, answers twice, or after the deadline (absorbed; a cancelled get writes nothing).
The store may drop any object at any time. Scenario rules needing a stored prefix find one,
or have a third engine sharing the store put one first (the content every instance computes).

Between the ordinary steps it makes hostile calls (:mod:`kvtier.testing.l3_cases`: bad
arguments, op ids never issued, bad options, refused fetch reservations), each of which
must raise and leave both instances exactly as they were, and inert calls that must do
nothing; and it corrupts copies of an instance to see the ``l3_*`` checks fire. Every
example draws its own L3 options (lease, deadline, prefetch bounds, put batch size, write
policy, hint size, host-eviction lookahead), and the fake store reports failures with
several error kinds (a backend's own ``deadline`` included).

Models beside the invariants: every command respects the options' bounds (a put carries at
most ``max_put_units`` objects, an exists asks ``min_prefetch_units`` to
``prefetch_units``), the error counters equal the failures the store reported, a
finished prefetch reports the units its get delivered (``fetched_units``), and a remove
deferred by a lease or an operation in flight goes out at the first expiry after the
object is free (liveness).

Checks after every step: both cores' invariants, both tiers' ``l3_*`` invariants, and the
byte-content model (invariant 12, :mod:`kvtier.testing.content`) on both trees: every
device or host page a node exposes holds the content written for its prefix, so a chunk
fetched from the store is checked against what the other instance computed. A put is
checked when the store reads it: the pinned host pages must still hold the prefix's
content (``l3_put_source_pinned``). Reserved pages hold garbage until a get writes them,
so a failed get made visible would be caught.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation, KvtierError
from kvtier.fsm.l3 import WRITE_POLICIES, L3Options, L3Tier, StoreOp

from . import _views as views
from .base import FAULT_LEVEL, LAYOUTS, ROLL, layout_named, recorded
from .l3_cases import CORRUPTIONS, HOSTILE, INERT, Skip, copy_instance, fingerprint
from .l3_steps import FAULTS, InstanceModel, L3Steps, words
from .l3_store import HostBytes, sync_driver, torn as l3_torn

__all__ = ["L3TierMachine"]

_KEYS = st.lists(st.sampled_from("ab"), min_size=1, max_size=4)  # few keys: instances share prefixes
#: The kit's layouts without continuation-state groups (the L3 tier refuses those).
L3_LAYOUTS: tuple[str, ...] = tuple(n for n in LAYOUTS if not layout_named(n).state_groups)


class L3TierMachine(L3Steps):
    """Two instances with an L3 tier over one fake, faulty store (see the module doc)."""

    kit_invariants = ("check_cores", "check_tiers", "check_loaded_equals_written")

    @initialize(layout=st.sampled_from(L3_LAYOUTS), dev_units=st.integers(3, 8), host_units=st.integers(3, 10),
                lease=st.sampled_from([0.0, 2.0, 5.0]), deadline=st.sampled_from([1.0, 3.0]),
                prefetch_units=st.integers(1, 4), write_policy=st.sampled_from(WRITE_POLICIES),
                hint=st.sampled_from([1, 16]), faults=FAULT_LEVEL, max_put=st.sampled_from([1, 2, 1024]),
                min_prefetch=st.integers(1, 2), lookahead=st.sampled_from([1, 4]),
                policy2=st.sampled_from(WRITE_POLICIES))
    @recorded
    def setup(self, layout: str, dev_units: int, host_units: int, lease: float, deadline: float,
              prefetch_units: int, write_policy: str, hint: int, faults: int | None = None,
              max_put: int = 1024, min_prefetch: int = 1, lookahead: int = 4, policy2: str | None = None) -> None:
        self.kit_fault_level(faults)
        lay = layout_named(layout)
        opts = L3Options(model="kit", lease_s=lease, deadline_s=deadline, prefetch_units=prefetch_units,
                         min_prefetch_units=min(min_prefetch, prefetch_units), write_policy=write_policy,
                         write_threshold=2, hint_size=hint, eviction_lookahead=lookahead, max_put_units=max_put)
        # the second instance may put under another write policy, at most 2 objects a put
        second = replace(opts, write_policy=policy2 or write_policy, max_put_units=min(2, max_put))
        for n in range(2):
            core = CacheCore(lay, dev_units, host_units, policy="write_through")
            self.cores.append(core)
            self.tiers.append(L3Tier(core, second if n else opts))
            self.dev.append({})
            self.host.append(HostBytes(core, self.table))
            self.drivers.append(sync_driver(self.fake, self.host[n].io))
            self.leases.append({})
            self.model.append(InstanceModel())

    # -- rules: requests ---------------------------------------------------------------
    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def publish(self, i: int, key: list[str]) -> None:
        """A request computed ``key``: publish it on the device, write it through to the host."""
        self._publish(i, tuple(key))

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def offer(self, i: int, key: list[str]) -> None:
        """A request ended: the write policy puts what it picks."""
        self._offer(i, tuple(key))

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def prefetch(self, i: int, key: list[str]) -> None:
        """A request waits: ask the store for what lies beyond its local hit."""
        self._prefetch(i, tuple(key))

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
    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), roll=ROLL, sweep=st.booleans())
    @recorded
    def serve_twice(self, i: int, pick: int, roll: int, sweep: bool = False) -> None:
        """The other instance's prefix, put (answered at once), then served on instance
        ``i`` twice with everything evictable evicted in between: the second request
        fetches again what the first fetched (under a read lease, when the store grants
        one); with ``sweep`` the calls and corruptions of :meth:`_sweep` (variant ``pick``)
        follow, under those leases; then the leases pass."""
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
        if sweep:
            self._sweep(i, pick)
        self._advance(self.tiers[i].options.lease_s + 0.5)  # the read leases pass

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), torn=st.booleans())
    @recorded
    def drop_between(self, i: int, pick: int, torn: bool = False) -> None:
        """A prefetch on instance ``i`` of a prefix the store holds; the store answers the
        exists, then drops the first object before the get (with ``torn``, after instance
        ``i`` evicted what it may: another writer tears it): the get misses (or finds it
        corrupt), the hit shortens, nothing is read. A corrupt object is removed from the
        store as soon as no lease holds it (the liveness model of deferred removes follows
        it)."""
        key = self._stored_prefix(pick)
        if torn:
            self._evict_all(i)  # what it holds locally it would not get
        owner = self._prefetch(i, key)
        self._answer_exists(i, owner)
        mine = [j for j, p in enumerate(self.pending) if p.owner == owner and p.cmd.kind is StoreOp.GET]
        if not mine:
            return
        first = self.pending[mine[0]].cmd.keys[0]
        if torn and first in self.store:
            self.store[first] = l3_torn(self.store[first])
        else:
            torn = False
            self.store.pop(first, None)
        tier = self.tiers[i]
        corrupt = tier.stats.get_corrupt
        self._answer_one(mine[0], 999, "error")  # roll 999: never a fault
        if torn:
            waiting = views.l3_internals(tier)[2]
            if tier.stats.get_corrupt != corrupt + 1 or first not in waiting:
                raise InvariantViolation("l3_lease_blocks_remove", f"object {first[:12]} on instance {i}",
                                         "a corrupt object was not counted, or is not waiting for its remove")
            self.model[i].deferred.add(first)

    @rule(i=st.integers(0, 1), key=_KEYS)
    @recorded
    def load(self, i: int, key: list[str]) -> None:
        """Admit a request: load its host hit (fetched chunks included) back to the device."""
        self._load(i, tuple(key))

    @rule(i=st.integers(0, 1), tier=st.sampled_from(["device", "host"]), n=st.integers(1, 6))
    @recorded
    def pressure(self, i: int, tier: str, n: int) -> None:
        """Evict ``n`` pages of the first history group (pinned put sources, fetching nodes stay)."""
        core = self.cores[i]
        g = views.history_groups(core)[0]
        if tier == "device":
            core.evict_device({g: n})
        else:
            core.evict_host({g: n})

    @rule(i=st.integers(0, 1))
    @recorded
    def evict_all(self, i: int) -> None:
        """Evict all instance ``i`` may evict from both tiers (its next requests go to the store)."""
        self._evict_all(i)

    @rule(i=st.integers(0, 1), key=_KEYS, last=st.booleans())
    @recorded
    def remove(self, i: int, key: list[str], last: bool) -> None:
        """Remove ``key``'s objects (or only its last one) from the store."""
        keys = self.tiers[i].keys_for(tuple(key))
        self._remove(i, keys[-1:] if last else keys)

    @precondition(lambda self: any(t.objects for t in self.tiers))
    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), extra=st.booleans())
    @recorded
    def remove_busy(self, i: int, pick: int, extra: bool) -> None:
        """Remove an object instance ``i`` is busy with or holds a read lease on (and, with
        ``extra``, the next busy one and a free one): the busy ones wait, and an expiry that
        comes at once (nothing is free yet) must leave them waiting."""
        keys = sorted(self.tiers[i].objects)
        if not keys:
            return
        chosen = [keys[pick % len(keys)]]
        if extra:
            chosen += [keys[(pick + 1) % len(keys)], *self.tiers[i].keys_for(("b", "b", "a"))[-1:]]
        self._remove(i, chosen)
        self._advance(0.0)

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), evict=st.booleans(), again=st.booleans(),
          sweep=st.booleans())
    @recorded
    def fetch_pending(self, i: int, pick: int, evict: bool, again: bool, sweep: bool = False) -> None:
        """A prefetch on instance ``i`` of a prefix the store holds (after evicting what
        may go, with ``evict``): the store answers the exists at once and the get stays in
        flight, its nodes fetching. With ``again`` a second request prefetches the same
        prefix meanwhile: its walk stops at the fetching nodes, and it may fetch nothing
        the first is getting. With ``sweep``, the hostile calls, inert calls and every
        corruption of :meth:`_sweep` (variant ``pick``) follow while the get is in flight."""
        key = self._stored_prefix(pick)
        if evict:
            self._evict_all(i)
        owner = self._prefetch(i, key)
        self._answer_exists(i, owner)
        if again:
            other = self._prefetch(i, key + ("a",))
            self._answer_exists(i, other)
            getting = {k for op in self.tiers[i].operations.values() if op.kind is StoreOp.GET and op.owner == owner
                       for k in (o.key for o in op.objects)}
            for q in self.pending:
                if q.inst == i and q.owner == other and q.cmd.kind is StoreOp.GET and set(q.cmd.keys) & getting:
                    raise InvariantViolation("l3_get_invisible", f"get {q.cmd.op_id}",
                                             "fetches an object another get is fetching")
        if sweep:
            self._sweep(i, pick, every=True)  # most corruptions apply here

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), publish=st.booleans())
    @recorded
    def prefix_changes(self, i: int, pick: int, publish: bool) -> None:
        """The local prefix a prefetch started from changes before the store answers its
        exists. Instance ``i`` first holds all but the last unit of a stored prefix (it
        evicts, then computes that much), prefetches the prefix, then evicts everything it
        may (or, with ``publish``, computes the whole prefix itself). The answer must start
        no get from the stale start (the reservation refuses a parent without a visible
        host copy, and a publish made the chunk local); the prefetch ends without a get."""
        key = self._stored_prefix(pick, 1 if publish else 2)
        self._evict_all(i)
        if len(key) > 1:
            self._publish(i, key[:-1])
        owner = self._prefetch(i, key)
        tier = self.tiers[i]
        if not tier.prefetching(owner):
            return
        start = self.cores[i].match(key).host_units
        if publish:
            self._publish(i, key)
        else:
            self._evict_all(i)
        changed = self.cores[i].match(key).host_units != start
        gets = tier.stats.get_ops
        self._answer_exists(i, owner)
        if changed and (tier.stats.get_ops != gets or tier.prefetching(owner)):
            raise InvariantViolation("l3_get_invisible", f"prefetch {owner} on instance {i}",
                                     "a get started from a local prefix that changed after its exists")

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), how=st.sampled_from(["holes", "short"]))
    @recorded
    def gappy_get(self, i: int, pick: int, how: str) -> None:
        self._gappy_get(i, pick, how)  # a get answered with holes or a short ok list (l3_steps)

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100))
    @recorded
    def fetch_no_room(self, i: int, pick: int) -> None:
        """Instance ``i``'s host is full of copies its requests pin when a prefetch's exists
        comes back: the get finds no room, is not sent, and every key the store answered
        counts as ``get_no_room``. Then the pins go."""
        key = self._stored_prefix(pick)
        core, tier = self.cores[i], self.tiers[i]
        self._evict_all(i)
        other = "b" if key[0] == "a" else "a"
        fillers = [(other, *rest) for n in range(4) for rest in words(n)]
        g = views.history_groups(core)[0]
        host = core.host or {}
        for f in fillers:
            if host[g].free < views.pages_per_unit(core)[g]:
                break
            self._publish(i, f)
        visible = [n for _, n in sorted(views.nodes(core).items()) if n.state in ("host", "backed")]
        if not visible:
            return
        pin = core.pin(visible, "filler")
        try:
            owner = self._prefetch(i, key)
            asked = [p.cmd.keys for p in self.pending if p.owner == owner]
            present = 0
            for k in asked[0] if asked else ():
                if k not in self.store:
                    break
                present += 1
            before = (tier.stats.get_ops, tier.stats.get_no_room)
            full = all(a.free < views.pages_per_unit(core)[h] for h, a in host.items())
            self._answer_exists(i, owner)
            if asked and full and (tier.stats.get_ops, tier.stats.get_no_room) != (before[0], before[1] + present):
                raise InvariantViolation("l3_get_invisible", f"prefetch {owner} on instance {i}",
                                         f"a full, pinned host: {present} keys present should count as no room "
                                         f"and send no get")
        finally:
            core.release(pin)

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100))
    @recorded
    def lease_then_remove(self, i: int, pick: int) -> None:
        """Instance ``i`` fetches a stored prefix (everything it may evicted first; the
        store answers at once, without faults), so the store leases the objects it read
        (when its lease is not 0); then it removes them: the leased ones wait (counted as
        deferred by lease) and go out at the first expiry after the lease ends."""
        key = self._stored_prefix(pick)
        self._evict_all(i)
        owner = self._prefetch(i, key)
        self._answer_exists(i, owner)
        mine = [j for j, p in enumerate(self.pending) if p.owner == owner and p.cmd.kind is StoreOp.GET]
        if mine:
            self._answer_one(mine[0], 999, "error")  # roll 999: never a fault
        self._remove(i, self.tiers[i].keys_for(key))
        self._advance(self.tiers[i].options.lease_s + 0.5)

    @rule(i=st.integers(0, 1), case=st.integers(0, 10_000), v=st.integers(0, 100))
    @recorded
    def hostile(self, i: int, case: int, v: int) -> None:
        """One hostile call (:data:`~kvtier.testing.l3_cases.HOSTILE` [``case`` mod its
        length], variant ``v``) on instance ``i``: it must raise a KvtierError and change
        nothing on either instance."""
        self._hostile(i, case % len(HOSTILE), v)

    def _hostile(self, i: int, case: int, v: int) -> None:
        name, call = HOSTILE[case]
        before = fingerprint(self)
        try:
            call(self, i, v)
        except KvtierError:
            self.refused += 1
        except Skip:
            return
        else:
            raise AssertionError(f"hostile L3 call {name!r} (variant {v}) was accepted")
        if fingerprint(self) != before:
            raise InvariantViolation("state_matches_resources", f"hostile L3 call {name!r} (variant {v})",
                                     "was refused but changed an instance")

    @rule(i=st.integers(0, 1), case=st.integers(0, 10_000), v=st.integers(0, 100))
    @recorded
    def inert(self, i: int, case: int, v: int) -> None:
        """One call of :data:`~kvtier.testing.l3_cases.INERT` on instance ``i``: legal
        here, it returns its "nothing" value and changes nothing."""
        self._inert(i, case % len(INERT), v)

    def _inert(self, i: int, case: int, v: int) -> None:
        name, call = INERT[case]
        before = fingerprint(self)
        try:
            answered = call(self, i, v)
        except Skip:
            return
        if answered is not True or fingerprint(self) != before:
            raise InvariantViolation("state_matches_resources", f"L3 call {name!r} (variant {v})",
                                     "should have done nothing" + ("" if answered is True else
                                                                   ", and returned something else"))

    @rule(i=st.integers(0, 1), v=st.integers(0, 100))
    @recorded
    def corrupt(self, i: int, v: int) -> None:
        """The ``l3_*`` checks see what they claim to: the first corruption of
        :data:`~kvtier.testing.l3_cases.CORRUPTIONS`, from the ``v``-th on, that applies
        now, done to a deep copy of instance ``i``'s tier and core, must make its check
        raise, naming its invariant."""
        self._corrupt(i, v, every=False)

    def _corrupt(self, i: int, v: int, every: bool = True) -> None:
        """Corruptions from the ``v``-th (mod their count) on, each on a deep copy of
        instance ``i`` (a case that does not apply changes nothing: its copy serves the
        next); all of them with ``every``, else only the first that applies."""
        copy: L3Tier | None = None
        for k in range(len(CORRUPTIONS)):
            name, spoil, check, inv = CORRUPTIONS[(v + k) % len(CORRUPTIONS)]
            copy = copy or copy_instance(self.tiers[i])
            try:
                spoil(copy, v)
            except Skip:
                continue
            try:
                check(copy)
            except InvariantViolation as exc:
                if exc.invariant != inv:
                    raise AssertionError(f"corruption {name!r} (variant {v}) was reported as {exc.invariant}, "
                                         f"not {inv}") from exc
            else:
                raise AssertionError(f"corruption {name!r} (variant {v}) went unnoticed by the l3 checks")
            if not every:
                return
            copy = None

    def _sweep(self, i: int, v: int, every: bool = False) -> None:
        """Every hostile call and every inert call, variant ``v``, on instance ``i`` as it
        is now, then the first corruption that applies from the ``v``-th on (every one
        that applies, with ``every``)."""
        for case in range(len(HOSTILE)):
            self._hostile(i, case, v)
        for case in range(len(INERT)):
            self._inert(i, case, v)
        self._corrupt(i, v, every)

    # -- rules: the store --------------------------------------------------------------
    @precondition(lambda self: bool(self.pending))
    @rule(pick=st.integers(0, 100), roll=ROLL, how=st.sampled_from(FAULTS))
    @recorded
    def answer(self, pick: int, roll: int, how: str) -> None:
        """The store answers one operation in flight (any order), misbehaving as ``how`` at the fault rate."""
        self._answer_one(pick, roll, how)

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
            self._answer_one(0, r, FAULTS[r % len(FAULTS)])

    @precondition(lambda self: len(self.pending) > 1)
    @rule(pick=st.integers(0, 100))
    @recorded
    def slow_store(self, pick: int) -> None:
        """The store times out: it fails one operation with its own ``deadline`` error, and
        the others of that instance stay unanswered past their deadline (they expire). The
        error counters keep the store's deadline error and not the expiries."""
        p = self.pending[pick % len(self.pending)]
        self._answer_one(pick, 0, "error", error="deadline")
        deadlines = [q.cmd.deadline for q in self.pending if q.inst == p.inst and not q.cancelled]
        if deadlines:
            self._advance(max(0.0, max(deadlines) - self.now) + 0.5)

    @precondition(lambda self: bool(self.store))
    @rule(pick=st.integers(0, 100))
    @recorded
    def store_drops(self, pick: int) -> None:
        """The store drops an object on its own (any time: between an exists and a get too)."""
        keys = sorted(self.store)
        del self.store[keys[pick % len(keys)]]

    @rule(i=st.integers(0, 1), pick=st.integers(0, 100), tell=st.booleans())
    @recorded
    def abort_prefetch(self, i: int, pick: int, tell: bool) -> None:
        """A waiting request is aborted: its prefetch in flight is cancelled (``_cancel``)."""
        self._cancel(i, pick, tell)

    @rule(dt=st.sampled_from([0.5, 1.5, 3.5, 6.0]), tell=st.booleans())
    @recorded
    def advance(self, dt: float, tell: bool = True) -> None:
        """Time passes: operations past their deadline fail (with ``tell`` the driver is
        told to cancel each through the callback, otherwise from the ids returned: their
        answers come late), leases end, deferred removes go out."""
        self._advance(dt, tell)


