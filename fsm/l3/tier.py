"""The third tier (L3): prefix chunks in a shared store, as one instance sees them (sans-I/O).

:class:`L3Tier` sits beside a :class:`kvtier.fsm.node.core.CacheCore` and uses only its public
methods. It never waits and never touches bytes: it returns :class:`StoreCommand` records
(exists, put, get, remove) from :meth:`L3Tier.poll_commands` and takes
:class:`StoreResult` records back through :meth:`L3Tier.complete`, on the scheduler's
thread; a store backend (:mod:`kvtier.transfer.store`) moves the bytes on its own thread.
Every object it handles follows the ``[l3]`` lifecycle of ``spec/lifecycle.toml``
(:func:`kvtier.fsm.lifecycle.machines.l3_lifecycle`); a get fills ``fetching`` nodes of the core
(:mod:`kvtier.fsm.node.fetch`).

Objects and keys: one object per cache unit (``layout.alignment`` tokens; every history
group's pages of that unit). Its key is a content hash chained over the page-aligned
prefix up to and including the unit, seeded by a namespace that hashes the model name,
the layout (groups, components, page bytes, layers), the tensor-parallel rank and world
size and the dtype (:func:`namespace`), so instances of one model agree on a prefix and
two models (or ranks) never share a key. Layouts with continuation-state groups are
refused (:class:`ConfigError`): a store object carries history pages only.

Rules: spec ``[l3]`` and invariants ``l3_*`` (``spec/README.md`` section 3): a put pins
the host copy it reads until it ends and makes nothing visible; a prefetch asks one batch
exists beyond the local hit, gets that prefix into invisible reserved host pages and keeps
the acknowledged prefix; every operation fails at its deadline; no remove under a lease
(a get, acknowledged or failed, leaves the object ``leased`` for ``lease_s``; a corrupt
object's remove waits for ``lease_end``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from ..checks import as_keys, as_time, check_key_sequence, plain_int
from ..errors import ConfigError, UsageError
from .walks import local_end, offer_items, victim_items
from .options import (WRITE_POLICIES, error_kind, L3Object, L3Op, L3Options, L3Outstanding, L3Stats, Prefetch, chain_keys,
                      namespace)
from ..lifecycle.machines import l3_lifecycle
from ..records import StoreCommand, StoreOp, StoreResult, store_result_fields
from ..lifecycle.names import HOST_VISIBLE, L3_EVENT as EV, L3_STATE as LS
from ..node.node import Node, NodeReceipt, PageMap

if TYPE_CHECKING:
    from ..node.core import CacheCore

__all__ = ["StoreOp", "StoreCommand", "StoreResult", "L3Options", "L3Stats", "L3Object", "L3Outstanding", "L3Tier",
           "WRITE_POLICIES", "namespace", "chain_keys"]

class L3Tier:
    """The L3 tier of one instance over ``core``.

    Args:
        core: the instance's cache core (with a host tier).
        options: :class:`L3Options`.

    Raises:
        ConfigError: no host tier, a layout with continuation-state groups, or bad options.
    """

    def __init__(self, core: CacheCore, options: L3Options | None = None) -> None:
        self.options = options = options or L3Options()
        if not isinstance(options, L3Options):
            raise ConfigError(f"l3 options must be an L3Options, got {options!r}")
        options.check()
        if not core.has_host:
            raise ConfigError("the L3 tier needs a host tier (host_pages): gets land in host pages")
        if core.ckpt_groups:
            raise ConfigError(f"the L3 tier stores history pages only; layout {core.layout.name!r} has "
                              f"continuation-state groups {list(core.ckpt_groups)}")
        self.core = core
        self.seed = namespace(core.layout, options.model, options.dtype, options.tp_rank, options.world_size)
        self.stats = L3Stats()
        self._life = l3_lifecycle()
        self._objects: dict[str, L3Object] = {}
        self._ops: dict[int, L3Op] = {}
        self._outbox: list[StoreCommand] = []
        self._issued = 0
        self._prefetch: dict[str, Prefetch] = {}
        self._hint: OrderedDict[str, None] = OrderedDict()
        self._pending_removes: list[str] = []

    @property
    def objects(self) -> dict[str, L3Object]:
        """Objects with something in flight or a lease (a snapshot)."""
        return dict(self._objects)

    @property
    def operations(self) -> dict[int, L3Op]:  # store operations in flight by op id (a snapshot)
        return dict(self._ops)

    def ops_in_flight(self) -> int:  # store operations in flight
        return len(self._ops)

    def prefetching(self, owner: str) -> bool:
        """Whether ``owner``'s prefetch is still in flight."""
        p = self._prefetch.get(owner)
        return p is not None and not p.done

    def fetched_units(self, owner: str) -> int:
        """Units ``owner``'s last prefetch brought to the host (0 if none)."""
        p = self._prefetch.get(owner)
        return p.fetched if p is not None else 0

    def forget(self, owner: str, now: float | None = None, cancel: Callable[[int], None] | None = None) -> None:
        """Drop ``owner``'s prefetch record (after it was admitted, or its request ended).
        One still in flight is cancelled first (:meth:`cancel`; with ``now`` left out it
        is only detached: its store operation stays in flight until answered or expired).
        UsageError: ``owner`` not a string (nothing changes)."""
        if not isinstance(owner, str):
            raise UsageError(f"l3 forget: owner must be a request id string, got {owner!r}")
        if self.prefetching(owner):
            self.cancel(owner, now, cancel)
        self._prefetch.pop(owner, None)

    def cancel(self, owner: str, now: float | None, cancel: Callable[[int], None] | None = None) -> bool:
        """Cancel ``owner``'s prefetch in flight (its request was aborted); the record is
        dropped and ``owner`` may prefetch again. Its store operation (exists or get):

        - not handed out by :meth:`poll_commands` yet: withdrawn and failed now;
        - handed out, with ``cancel`` (the store driver's): ``cancel(op_id)`` is called,
          then it fails now;
        - handed out without ``cancel``, or ``now`` is ``None``: it stays in flight (a
          backend may still write its pages) and the store's answer or its deadline ends
          it as any get (acknowledged units become host copies no request waits on).

        A get that fails releases its reserved host pages once (a late answer is absorbed).

        Returns:
            ``True`` if a prefetch was in flight.

        Raises:
            UsageError: ``owner`` not a string or ``now`` not a finite number or ``None``.
        """
        if not isinstance(owner, str):
            raise UsageError(f"l3 cancel: owner must be a request id string, got {owner!r}")
        if now is not None:
            now = as_time(now, "l3 cancel: now")
        if not self.prefetching(owner):
            return False
        op_id = self._prefetch.pop(owner).op_id
        self.stats.cancelled_prefetches += 1
        waiting = [c for c in self._outbox if c.op_id == op_id]
        if now is None or not (waiting or cancel is not None):
            return True
        if waiting:
            self._outbox = [c for c in self._outbox if c.op_id != op_id]
        elif cancel is not None:
            cancel(op_id)
        self._fail_now(op_id, now, "cancelled: the request's prefetch was cancelled")
        return True

    def outstanding(self) -> L3Outstanding:
        """What this tier holds or owes (:class:`~kvtier.fsm.l3.options.L3Outstanding`)."""
        from .checks import l3_outstanding

        return l3_outstanding(self, self._outbox, self._prefetch)

    def keys_for(self, units: Sequence[Hashable]) -> list[str]:
        """The object keys of ``units`` (a prefix from the root), in order."""
        return [d.hex() for d in chain_keys(self.seed, units)]

    def poll_commands(self) -> list[StoreCommand]:
        """Commands created since the last poll, for the store backend."""
        out = self._outbox
        self._outbox = []
        return out

    def _obj(self, key: str) -> L3Object:
        o = self._objects.get(key)
        if o is None:
            o = L3Object(key)
        return o

    def _fire(self, o: L3Object, event: str) -> None:
        self._life.fire(o, event)
        if o.state == LS.unknown:
            self._objects.pop(o.key, None)
            o.op_id = None
            o.store_answered = False
        else:
            self._objects[o.key] = o

    def _new_op(self, kind: StoreOp, objects: list[L3Object], pages: Sequence[PageMap], now: float,
                owner: str | None = None, receipt: NodeReceipt | None = None, op_id: int | None = None) -> L3Op:
        if op_id is None:
            self._issued += 1
            op_id = self._issued
        op = L3Op(op_id, kind, objects, now + self.options.deadline_s, owner, receipt)
        self._ops[op.op_id] = op
        for o in objects:
            o.op_id = op.op_id
        self._outbox.append(StoreCommand(op.op_id, kind, tuple(o.key for o in objects),
                                         tuple({g: list(p) for g, p in pm.items()} for pm in pages), op.deadline))
        return op

    def _remember(self, key: str) -> None:
        self._hint[key] = None
        self._hint.move_to_end(key)
        while len(self._hint) > self.options.hint_size:
            self._hint.popitem(last=False)

    def prefetch(self, owner: str, units: Sequence[Hashable], now: float) -> bool:
        """Start a prefetch for ``owner`` (a waiting request): ask the store which chunks
        beyond the local hit of ``units`` it holds (one batch exists). The get follows when
        the answer comes (:meth:`complete`).

        Returns:
            ``True`` if an exists was submitted; ``False`` when nothing is worth asking
            (short tail, the local hit ends on a node without a host copy) or ``owner``
            already has a prefetch in flight.

        Raises:
            UsageError: ``owner`` not a string, ``units`` not a sequence of hashable unit keys
                (named) or ``now`` not a finite number; nothing changes.
        """
        now = as_time(now, "l3 prefetch: now")
        if not isinstance(owner, str):
            raise UsageError(f"l3 prefetch: owner must be a request id string, got {owner!r}")
        check_key_sequence(units, "l3 prefetch: units")
        as_keys(units, "l3 prefetch: units")  # keys the tree can hash and compare, before anything changes
        if self.prefetching(owner):
            return False
        self._prefetch.pop(owner, None)
        node, start = local_end(self.core, units)
        if node is not self.core.root and node.state not in HOST_VISIBLE:
            return False  # a device-only end: its children cannot have a host copy yet
        end = min(len(units), start + self.options.prefetch_units)
        if end - start < self.options.min_prefetch_units:
            return False
        keys = self.keys_for(units[:end])
        objs = [L3Object(k) for k in keys[start:]]  # not tracked: exists moves no object
        op = self._new_op(StoreOp.EXISTS, objs, (), now, owner)
        self._prefetch[owner] = Prefetch(owner, tuple(units[:end]), start, keys, op.op_id)
        self.stats.prefetches += 1
        self.stats.exists_ops += 1
        self.stats.exists_keys += len(objs)
        return True

    def _on_exists(self, op: L3Op, res: StoreResult, now: float) -> None:
        pf = self._prefetch.get(op.owner or "")
        present = max(0, min(int(res.present), len(op.objects))) if res.error is None else 0
        self.stats.exists_present += present
        if pf is None or pf.op_id != op.op_id:
            return
        if present == 0:
            pf.done = True
            return
        node, depth = local_end(self.core, pf.units[:pf.start])
        if depth != pf.start or (node is not self.core.root and node.state not in HOST_VISIBLE):
            pf.done = True  # the local prefix changed meanwhile: start over next time
            return
        # each object must be free to get (unknown or leased) and the store must have answered
        chosen: list[L3Object] = []
        for key in pf.keys[pf.start:pf.start + present]:
            o = self._obj(key)
            if o.state not in (LS.unknown, LS.leased):
                break
            chosen.append(o)
        if not chosen:
            self.stats.get_no_room += present
            pf.done = True
            return
        self._issued += 1
        op_id = self._issued
        nodes = self.core.fetches.reserve(node, pf.units[pf.start:pf.start + len(chosen)], op_id)
        self.stats.get_no_room += present - len(nodes)
        if not nodes:
            pf.done = True
            return
        chosen = chosen[:len(nodes)]
        for o in chosen:
            o.store_answered = True
            self._fire(o, EV.get_submit)
        self._new_op(StoreOp.GET, chosen, [n.pending for n in nodes], now, pf.owner, op_id=op_id)
        pf.op_id = op_id
        self.stats.get_ops += 1
        self.stats.get_keys += len(chosen)

    def _on_get(self, op: L3Op, res: StoreResult, now: float) -> None:
        oks = list(res.ok) if res.error is None else []
        acked = 0
        while acked < len(op.objects) and acked < len(oks) and oks[acked]:
            acked += 1
        self.core.fetches.settle(op.op_id, acked)
        corrupt = set(res.corrupt)
        for i, o in enumerate(op.objects):
            # the store may have leased every object it was asked for, served or not
            o.lease_holds = self.options.lease_s > 0
            o.lease_until = now + self.options.lease_s
            if i < acked:
                self._fire(o, EV.get_ack)
                self._remember(o.key)
            else:
                if res.error is None and i < len(oks) and not oks[i] and o.key not in corrupt:
                    self.stats.get_misses += 1
                self._fire(o, EV.get_fail)
                if o.key in corrupt:
                    self.stats.get_corrupt += 1
                    self._pending_removes.append(o.key)
        self.stats.get_ok += acked
        self.stats.get_failed += len(op.objects) - acked
        pf = self._prefetch.get(op.owner or "")
        if pf is not None and pf.op_id == op.op_id:
            pf.fetched = acked
            pf.done = True

    def _put_units(self, items: list[tuple[Node, int, str]], now: float) -> int:
        """Put (node, unit index within node, key) items, one operation; returns keys put."""
        if not items:
            return 0
        nodes: list[Node] = []
        seen: set[int] = set()
        for n, _, _ in items:
            if n.node_id not in seen:
                seen.add(n.node_id)
                nodes.append(n)
        receipt = self.core.pin(nodes, owner="l3-put")
        objs: list[L3Object] = []
        pages: list[PageMap] = []
        for n, i, key in items:
            o = self._obj(key)
            o.host_visible = True
            self._fire(o, EV.put_submit)
            o.host_visible = False
            objs.append(o)
            pages.append({g: n.host[g][i * p:(i + 1) * p] for g, p in self.core.pages_per_unit.items()})
        self._new_op(StoreOp.PUT, objs, pages, now, None, receipt)
        self.stats.put_ops += 1
        self.stats.put_keys += len(objs)
        return len(objs)

    def _wants(self, key: str, node: Node) -> bool:
        if key in self._hint or key in self._objects:
            return False
        if self.options.write_policy == "selective":
            return node.hit_count >= self.options.write_threshold
        return True

    def offer(self, units: Sequence[Hashable], now: float) -> int:
        """Apply the write policy after a request's prefix reached the host tier (call it
        when a request ends or is retracted): ``host_write`` and ``selective`` put the
        host-visible chunks of ``units`` not put recently; ``host_eviction`` puts the next
        host eviction victims instead.

        Returns:
            Objects submitted.

        Raises:
            UsageError: ``units`` not a sequence of hashable unit keys (named), or a bad ``now``.
        """
        now = as_time(now, "l3 offer: now")
        check_key_sequence(units, "l3 offer: units")
        as_keys(units, "l3 offer: units")  # keys the tree can hash and compare
        wants = self._wants
        if self.options.write_policy == "host_eviction":
            return self._put_units(victim_items(self.core, self.seed, self.options, wants), now)
        return self._put_units(offer_items(self.core, self.keys_for, self.options, units, wants), now)

    def _on_put(self, op: L3Op, res: StoreResult) -> None:
        if op.receipt is not None:
            self.core.release(op.receipt)
        oks = list(res.ok) if res.error is None else []
        for i, o in enumerate(op.objects):
            ok = i < len(oks) and oks[i]
            self._fire(o, EV.put_ack if ok else EV.put_fail)
            if ok:
                self._remember(o.key)
                self.stats.put_ok += 1
            else:
                self.stats.put_failed += 1

    def remove(self, keys: Sequence[str], now: float) -> int:
        """Remove objects from the store; objects under a read lease, or with an operation
        in flight, wait until it ends (:meth:`expire` submits them then).

        Returns:
            Keys submitted now.
        """
        now = as_time(now, "l3 remove: now")
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise UsageError(f"l3 remove: keys must be a sequence of key strings, got {keys!r}")
        for bad in (k for k in keys if not isinstance(k, str)):  # every key checked before anything changes
            raise UsageError(f"l3 remove: key must be a string, got {bad!r}")
        return self._remove(keys, now)

    def _remove(self, keys: Sequence[str], now: float) -> int:
        objs: list[L3Object] = []
        for k in keys:
            o = self._obj(k)
            if o.state != LS.unknown or any(x.key == k for x in objs):
                if o.state == LS.leased:
                    self.stats.removes_deferred_by_lease += 1
                if k not in self._pending_removes:
                    self._pending_removes.append(k)
                continue
            objs.append(o)
        for o in objs:
            self._fire(o, EV.remove_submit)
        if objs:
            self._new_op(StoreOp.REMOVE, objs, (), now)
            self.stats.remove_ops += 1
            self.stats.remove_keys += len(objs)
        return len(objs)

    def _on_remove(self, op: L3Op, res: StoreResult) -> None:
        oks = list(res.ok) if res.error is None else []
        for i, o in enumerate(op.objects):
            self._fire(o, EV.remove_ack if i < len(oks) and oks[i] else EV.remove_fail)

    def complete(self, result: StoreResult, now: float) -> None:
        """Take the result of a store operation (on the scheduler's thread).

        A result for an operation that already ended (after its deadline) is absorbed.

        Raises:
            UsageError: not a StoreResult, an op id not an int, or one never issued, a bad field
                (``present`` not an int >= 0, ``ok`` not bools, ...) or ``now`` not a finite
                number (nothing changes: the operation can still complete or expire).
        """
        if not isinstance(result, StoreResult):
            raise UsageError(f"l3 complete: expected a StoreResult, got {result!r}")
        if plain_int(result.op_id) is None:  # a bool would complete op 1 (True == 1)
            raise UsageError(f"l3 complete: op_id must be an int, got {result.op_id!r}")
        store_result_fields(result, f"l3 complete: op {result.op_id}", UsageError)  # a record built around __init__
        self._complete(result, as_time(now, "l3 complete: now"))

    def _complete(self, result: StoreResult, now: float) -> None:
        op = self._ops.pop(result.op_id, None)
        if op is None:
            if 1 <= result.op_id <= self._issued:
                self.stats.absorbed_late_results += 1
                return
            raise UsageError(f"l3 complete: op {result.op_id} was never issued")
        self.stats.seconds += result.seconds
        if result.error is not None:
            self.stats.op_errors += 1
            kind = error_kind(self.stats.errors, result.error)
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        if op.kind is StoreOp.EXISTS:
            self.stats.get_seconds += result.seconds
            self._on_exists(op, result, now)
        elif op.kind is StoreOp.GET:
            self.stats.get_seconds += result.seconds
            self.stats.bytes_in += result.nbytes
            self._on_get(op, result, now)
        elif op.kind is StoreOp.PUT:
            self.stats.bytes_out += result.nbytes
            self._on_put(op, result)
        else:
            self._on_remove(op, result)

    def expire(self, now: float, cancel: Callable[[int], None] | None = None) -> list[int]:
        """Fail every operation whose deadline passed, end passed leases and submit removes
        that waited for one. ``cancel(op_id)`` is called for each expired operation before
        its pages are let go, so the backend stops touching them (a get no longer writes
        into pages that are freed; a put no longer reads pages that are unpinned).

        Returns:
            The expired op ids.

        Raises:
            UsageError: ``now`` NaN, -inf or not a number (nothing changes); ``inf`` is taken:
                every deadline and lease has passed (at shutdown).
        """
        now = as_time(now, "l3 expire: now", infinite=True)
        expired = [op for op in self._ops.values() if op.deadline <= now]
        for op in expired:
            if cancel is not None:
                cancel(op.op_id)
            self.stats.expired_ops += 1
            self._fail_now(op.op_id, now, "deadline: the store did not answer in time")
        for o in [o for o in self._objects.values() if o.state == LS.leased and o.lease_until <= now]:
            self._fire(o, EV.lease_end)
        if self._pending_removes:
            ready = [k for k in self._pending_removes if self._obj(k).state == LS.unknown]
            self._pending_removes = [k for k in self._pending_removes if k not in ready]
            if ready:
                self._remove(ready, now)
        return [op.op_id for op in expired]

    def _fail_now(self, op_id: int, now: float, error: str) -> None:
        """Fail operation ``op_id`` on the caller's side (deadline or cancel), counted as
        such, not as a backend error."""
        self._complete(StoreResult(op_id, error=error), now)
        why = error_kind(self.stats.errors, error)  # where _complete counted it
        self.stats.op_errors -= 1
        self.stats.errors[why] -= 1
        if not self.stats.errors[why]:
            del self.stats.errors[why]

    def check_invariants(self) -> None:
        """Check the ``l3_*`` invariants (:func:`kvtier.fsm.l3.checks.check_l3`).

        Raises:
            InvariantViolation: naming the invariant and the object.
        """
        from .checks import check_l3  # looked up at each call (tests replace it)

        check_l3(self)
