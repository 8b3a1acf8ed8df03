"""An independent reference model of the tiered cache: what the tree *should* hold.

Written from ``spec/README.md`` (section 1, "Policies") and the facade's documented calls,
sharing no code with ``kvtier.fsm``: plain objects, lists and dicts, no lifecycle machine,
no concurrency. It follows one request at a time through ``admit``, ``step_done``,
``finish`` and ``drain`` (``poll`` until nothing is handed out, every transfer succeeding at
once) and answers, per admission, the exact hit tokens by tier (:class:`Hit`, or ``None``
when short of device pages); per call, the exact victims
(:meth:`ReferenceCache.take_victims`); and every node's residency
(:meth:`ReferenceCache.residency`). The rules the spec's "Policies" prose leaves open are
stated there under "The rules behind the choices", each found by observing the product;
:mod:`kvtier.testing.reference_driver` runs the product and this model side by side.

Units: a *unit* is ``alignment`` tokens; capacities are in units (one page per unit and
history group; continuation-state groups are not modelled).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Hit", "ReferenceCache", "WRITE_POLICIES", "EVICTIONS"]

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
EVICTIONS = ("lru", "lru_turns", "lru2")
_Key = tuple[int, ...]


@dataclass(frozen=True)
class Hit:
    """An admission's answer: ``device_tokens`` already on the device, ``host_tokens``
    loaded back from the host (their sum is the first token computed)."""

    device_tokens: int
    host_tokens: int

    @property
    def hit_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class _Node:
    """A radix node: a run of units with one residency. ``ndev`` / ``nhost`` count the
    children with device pages / with a host copy or a pending host reservation."""

    __slots__ = ("nid", "units", "parent", "children", "depth", "dev", "host", "pending", "loading", "la",
                 "pu", "owner", "hc", "turns", "reloaded", "refused", "queued", "chained", "evicting", "ndev",
                 "nhost")

    def __init__(self, nid: int, units: list[Hashable], parent: _Node | None, depth: int) -> None:
        self.nid, self.units, self.parent, self.depth = nid, units, parent, depth
        self.children: dict[Hashable, _Node] = {}
        self.dev = self.host = self.pending = self.loading = False
        self.la = self.pu = 0  # clock of the last use; of the last use before the owner changed
        self.owner: str | None = None  # the request that made the last counted use
        self.hc = 0  # reuse count: uses by an owner other than the previous one
        self.turns = 1
        self.reloaded = self.refused = self.queued = self.chained = self.evicting = False
        self.ndev = self.nhost = 0

    def up(self) -> _Node:
        assert self.parent is not None, "the root has no parent"
        return self.parent

    def path(self) -> tuple[Hashable, ...]:
        out: list[Hashable] = []
        n: _Node | None = self
        while n is not None and n.parent is not None:
            out[:0] = n.units
            n = n.parent
        return tuple(out)

    def state(self) -> str:
        return "backed" if self.dev and self.host else "device" if self.dev else "host"


@dataclass
class _Request:
    rid: str
    keys: tuple[Hashable, ...]
    held: list[_Node]  # its locked path, root first
    tokens: int  # tokens with KV
    own: int  # device pages of its own (not the tree's)


class ReferenceCache:
    """The model of one ``TieredCache`` driven one request at a time (see the module doc).

    Args:
        alignment: tokens per unit (``layout.alignment``).
        device_units, host_units: capacities in units (``host_units`` ``None``: no host tier).
        policy, write_threshold, eviction, exclusive, finish_writeback: as ``TieredCache``.
    """

    def __init__(self, alignment: int, device_units: int, host_units: int | None = None, *,
                 policy: str = "write_through_selective", write_threshold: int = 2, eviction: str = "lru",
                 exclusive: bool = False, finish_writeback: bool | None = None) -> None:
        if policy not in WRITE_POLICIES:
            raise ValueError(f"policy must be one of {WRITE_POLICIES}, got {policy!r}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.a, self.dcap, self.hcap = alignment, device_units, host_units
        self.policy, self.threshold, self.eviction, self.exclusive = policy, write_threshold, eviction, exclusive
        self.finish_writeback = policy == "write_through" if finish_writeback is None else finish_writeback
        self.window = (device_units + (host_units or 0)) // 4  # lru_turns: window x log2(turns) ticks
        self.root = _Node(0, [], None, 0)
        self.root.dev = self.root.host = True
        self.nodes: dict[int, _Node] = {}
        self.clock = self._ids = self.dev_used = self.host_used = 0
        self.requests: dict[str, _Request] = {}
        self.queue: list[_Node] = []  # tree writebacks, issued by poll
        self.loads: list[_Node] = []  # loadbacks in flight until the next poll
        self.writes: list[_Node] = []  # finish writebacks in flight until the next poll
        self.releases: list[_Request] = []  # requests let go when their finish writeback ends
        self.victims: list[tuple[str, tuple[Hashable, ...], int]] = []
        self._dheap: list[_Key] = []  # device victim candidates (lazy: checked when popped)
        self._hheap: list[_Key] = []  # host victim candidates

    # ------------------------------------------------------------------ the calls
    def admit(self, rid: str, units: Sequence[Hashable], prompt_tokens: int, chunk_tokens: int) -> Hit | None:
        """Match, lock, reserve device pages for the loadback and the first chunk (evicting
        as needed); ``None`` when short (the request stays waiting, holding nothing)."""
        keys = tuple(units[:prompt_tokens // self.a])
        path = self._match(keys[:(prompt_tokens - 1) // self.a])  # the last token is always computed
        dev = [n for n in path if n.dev]
        host = path[len(dev):]
        d, h = sum(len(n.units) for n in dev), sum(len(n.units) for n in host)
        start = (d + h) * self.a
        own = -(-(start + min(chunk_tokens, prompt_tokens - start)) // self.a) - d - h
        if dev:
            self._touch(dev, rid)
        if not self._device_room(h + own, set(dev)):
            if dev:
                self._touch(dev, rid)  # the lock is let go
            return None
        if host:
            self._touch(host, rid)  # pinned for the loadback
            if dev:
                self._touch(dev, rid)
            for n in host:
                n.loading = True
            self.loads += host
        self.dev_used += h + own
        self.requests[rid] = _Request(rid, keys, list(path), start, own)
        return Hit(d * self.a, h * self.a)

    def step_done(self, rid: str, computed_tokens: int) -> None:
        """The forward pass computed ``computed_tokens`` more: publish the newly full units."""
        r = self.requests[rid]
        r.tokens += computed_tokens
        held = sum(len(n.units) for n in r.held)
        rest = list(r.keys[held:min(r.tokens // self.a, len(r.keys))])
        if not rest:
            return
        parent = r.held[-1] if r.held else self.root
        dups: list[_Node] = []  # nodes the tree already holds below the held path
        while rest and rest[0] in parent.children:
            child = parent.children[rest[0]]
            k = _common(child.units, rest)
            if k < len(child.units):
                child = self._split(child, k)
            dups.append(child)
            rest, parent = rest[k:], child
        self.clock += 1
        t = self.clock
        for n in dups:
            n.la = t  # a use with no owner: it counts no reuse
            r.own -= len(n.units)
            if n.dev:
                self.dev_used -= len(n.units)  # the request's copy is freed
            else:
                self._flags(n, dev=True)  # republish: the node adopts the request's pages
        new: list[_Node] = []
        if rest:
            turn = parent.turns + 1 if parent is not self.root and not parent.children else 1
            node = self._new(rest, parent)
            node.turns = turn
            self._flags(node, dev=True)
            r.own -= len(rest)
            for n in r.held + dups:
                n.turns = max(n.turns, turn)
            new.append(node)
            if self.policy == "write_through" and self.hcap is not None:
                self._enqueue(node)
        self._touch(dups + new, rid)
        if r.held:
            self._touch(r.held, rid)
        r.held += dups + new

    def finish(self, rid: str) -> None:
        """Generation ended: write back its path's device-only suffix (``finish_writeback``),
        then let go of its locks (after the writeback, which completes at the next poll)."""
        r = self.requests[rid]
        chain = [n for n in r.held if not n.host]
        if self.finish_writeback and self.hcap is not None and chain and self._reserve_host(chain):
            self.writes += chain
            self.releases.append(r)
        else:
            self._release(r)

    def drain(self) -> None:
        """``poll`` and complete every command until a poll hands out none."""
        while self.poll():
            continue

    def poll(self) -> int:
        """Issue the queued tree writebacks as one operation, complete every transfer in
        flight, and return how many nodes moved (spec: "Issuing tree writebacks")."""
        issued: list[_Node] = []
        keep: list[_Node] = []
        for n in sorted(self.queue if self.hcap is not None else (), key=lambda n: (n.depth, n.nid)):
            p = n.up()
            alive = n.nid in self.nodes and n.dev and not n.host and not n.pending
            if alive and (p.host or (n.chained and p.pending and p in issued)):
                self._flags(n, pending=True)  # its parent keeps its host copy (has_host_child)
                issued.append(n)
            elif alive and (p.pending or p.queued):
                keep.append(n)
            else:
                n.queued = n.chained = False
        need = sum(len(n.units) for n in issued)
        self._host_room(need)
        whole = self.hcap is not None and self.hcap - self.host_used >= need  # else one at a time
        for n in issued:
            self._flags(n, pending=False)
        done: list[_Node] = []
        for n in issued:
            p = n.up()
            if not (p.host or (whole and p in done)):
                keep.append(n)
                continue
            self._flags(n, pending=True)
            if not whole:
                self._host_room(len(n.units))
            if self.hcap is not None and self.hcap - self.host_used >= len(n.units):
                self.host_used += len(n.units)
                done.append(n)
                n.evicting = n.chained  # written back for an eviction: its host copy stays
                n.queued = n.chained = False
            else:
                self._flags(n, pending=False)
                n.refused, n.queued, n.chained = True, False, False
        self.queue = sorted(keep, key=lambda n: (n.depth, n.nid))
        moved = len(done) + len(self.loads) + len(self.writes)
        for n in self.loads:
            n.loading, n.reloaded = False, True
            self._flags(n, dev=True)
        self.loads = []
        for n in done + self.writes:
            n.reloaded = False  # a written-back copy is no duplicate of a loaded one
            self._flags(n, host=True, pending=False)
        self.writes = []
        for r in self.releases:
            self._release(r)
        self.releases = []
        return moved

    def take_victims(self) -> list[tuple[str, tuple[Hashable, ...], int]]:
        """The evictions since the last call, in order: (event, unit path to the end of the
        victim, units it freed)."""
        out, self.victims = self.victims, []
        return out

    def residency(self) -> dict[tuple[Hashable, ...], tuple[int, str]]:
        """Every node: unit path to its end -> (units, ``device`` | ``backed`` | ``host``)."""
        out: dict[tuple[Hashable, ...], tuple[int, str]] = {}
        stack: list[tuple[_Node, tuple[Hashable, ...]]] = [(self.root, ())]
        while stack:
            n, p = stack.pop()
            for c in n.children.values():
                q = p + tuple(c.units)
                out[q] = (len(c.units), c.state())
                stack.append((c, q))
        return out

    # ------------------------------------------------------------------ the tree
    def _new(self, units: list[Hashable], parent: _Node) -> _Node:
        self._ids += 1
        n = _Node(self._ids, list(units), parent, parent.depth + len(units))
        parent.children[units[0]] = n
        self.nodes[n.nid] = n
        return n

    def _split(self, n: _Node, k: int) -> _Node:
        """Split ``n`` after ``k`` units: the head is a new node (a new id), ``n`` keeps the
        tail; both keep the residency, the stamps and the counts; a host refusal stays with
        the tail."""
        assert n.parent is not None and 0 < k < len(n.units)
        head = self._new(n.units[:k], n.parent)
        for f in ("dev", "host", "pending", "loading", "la", "pu", "owner", "hc", "turns", "reloaded", "evicting"):
            setattr(head, f, getattr(n, f))  # a refusal stays with the tail (the node's id)
        head.ndev, head.nhost = int(n.dev), int(n.host or n.pending)
        if n.queued:  # the queue entry stays with the head too
            head.queued, head.chained = True, n.chained
            self.queue.append(head)
        n.units = n.units[k:]
        head.children[n.units[0]] = n
        n.parent = head
        for r in self.requests.values():
            if n in r.held:
                i = r.held.index(n)
                r.held[i:i] = [head]
        self._dirty(head)
        return head

    def _remove(self, n: _Node) -> None:
        assert n.parent is not None and not n.children
        self._flags(n, dev=False, host=False, pending=False)
        del n.parent.children[n.units[0]]
        del self.nodes[n.nid]

    def _flags(self, n: _Node, *, dev: bool | None = None, host: bool | None = None,
               pending: bool | None = None) -> None:
        """Change a node's residency, keeping its parent's child counts."""
        was_dev, was_host = n.dev, n.host or n.pending
        n.dev = n.dev if dev is None else dev
        n.host = n.host if host is None else host
        n.pending = n.pending if pending is None else pending
        p = n.parent
        if p is not None:
            p.ndev += n.dev - was_dev
            p.nhost += (n.host or n.pending) - was_host
            self._dirty(p)
        self._dirty(n)

    def _match(self, keys: tuple[Hashable, ...]) -> list[_Node]:
        """The longest matched path: readable device nodes, then host copies; split at its end."""
        path: list[_Node] = []
        n, i = self.root, 0
        while i < len(keys) and keys[i] in n.children:
            c = n.children[keys[i]]
            if not (c.dev or c.host) or (c.dev and not n.dev):
                break
            k = _common(c.units, keys[i:])
            if k < len(c.units):
                c = self._split(c, k)
            path.append(c)
            i, n = i + k, c
        return path

    # ------------------------------------------------------------------ clock and uses
    def _touch(self, nodes: Sequence[_Node], owner: str) -> None:
        """One tick; each node's use is stamped, and counted as a reuse when ``owner`` is not
        the owner of its last counted use (``write_through_selective`` queues it then)."""
        self.clock += 1
        t = self.clock
        for n in nodes:
            if owner != n.owner:
                n.pu, n.owner = n.la, owner
                n.hc += 1
                if (self.policy == "write_through_selective" and self.hcap is not None and n.hc >= self.threshold
                        and n.dev and not n.host):
                    self._enqueue(n)
            n.la = t
            self._dirty(n)

    def _release(self, r: _Request) -> None:
        if r.held:
            self._touch(r.held, r.rid)
        self.dev_used -= r.own
        del self.requests[r.rid]

    def _enqueue(self, n: _Node) -> None:
        if not n.queued:
            n.queued = True
            self.queue.append(n)

    # ------------------------------------------------------------------ eviction
    def _key(self, n: _Node, host: bool) -> _Key:
        """The policy's order (smallest first); ties go to the deepest node, then the
        smallest id. An exclusive host tier puts reloaded duplicates first."""
        first = (0 if n.dev and n.reloaded else 1,) if host and self.exclusive else ()
        if self.eviction == "lru_turns":
            return (*first, n.la + _bonus(self.window, n.turns), -n.depth, n.nid)
        if host and self.eviction == "lru2":
            return (*first, n.pu, n.la, -n.depth, n.nid)
        return (*first, n.la, -n.depth, n.nid)

    def _dirty(self, n: _Node) -> None:
        """Offer ``n`` to the heaps of the tiers it is a leaf of (stale entries are skipped)."""
        if n.parent is None:
            return
        if n.dev and not n.ndev:
            heapq.heappush(self._dheap, self._key(n, False))
        if n.host and not n.nhost:
            heapq.heappush(self._hheap, self._key(n, True))
        if len(self._dheap) + len(self._hheap) > 8 * len(self.nodes) + 4096:
            self._dheap = [self._key(m, False) for m in self.nodes.values() if m.dev and not m.ndev]
            self._hheap = [self._key(m, True) for m in self.nodes.values() if m.host and not m.nhost]
            heapq.heapify(self._dheap)
            heapq.heapify(self._hheap)

    def _pop(self, host: bool, skip: set[_Node]) -> _Node | None:
        """The next victim candidate of a tier, or ``None``; candidates in ``skip`` (locked,
        pledged in this pass) or in flight are set aside and offered again afterwards."""
        heap = self._hheap if host else self._dheap
        aside: list[_Key] = []
        found = None
        while heap:
            key = heapq.heappop(heap)
            n = self.nodes.get(key[-1])
            if n is None or self._key(n, host) != key:
                continue
            if not ((n.host and not n.nhost) if host else (n.dev and not n.ndev)):
                continue  # no longer a leaf of this tier
            if host and not n.loading and not (n.dev and n.evicting and not (self.exclusive and n.reloaded)):
                found = n  # (a copy written back for an eviction stays while it has device pages)
            elif not host and not (n.loading or n.pending or n in skip):
                found = n
            else:
                aside.append(key)
                continue
            break
        for key in aside:
            heapq.heappush(heap, key)
        return found

    def _device_room(self, need: int, locked: set[_Node]) -> bool:
        """Free ``need`` device units by the policy's order (spec: "Device eviction")."""
        pledged = 0
        skip = {n for r in self.requests.values() for n in r.held} | locked  # and this pass's pledges
        while self.dcap - self.dev_used + pledged < need:
            v = self._pop(False, skip)
            if v is None:
                break
            chain = [v]
            while not chain[-1].host and chain[-1].parent is not self.root and not chain[-1].up().host:
                chain.append(chain[-1].up())
            if not v.host and self.policy == "write_back" and self.hcap is not None and not any(
                    n.refused for n in chain):
                for n in chain:
                    self._enqueue(n)
                    n.chained = True
                skip.add(v)
                pledged += len(v.units)
                continue
            v = self._tail(v, need - (self.dcap - self.dev_used))
            self.dev_used -= len(v.units)
            if v.host:
                self._log("demote", v)
                self._flags(v, dev=False)
            else:
                self._log("evict_device", v)
                self._remove(v)
        return self.dcap - self.dev_used >= need

    def _reserve_host(self, chain: Sequence[_Node]) -> bool:
        """Reserve host units for ``chain`` (all or nothing), evicting for all of it first."""
        need = sum(len(n.units) for n in chain)
        for n in chain:
            self._flags(n, pending=True)
        self._host_room(need)
        if self.hcap is None or self.hcap - self.host_used < need:
            for n in chain:
                self._flags(n, pending=False)
            return False
        self.host_used += need
        return True

    def _host_room(self, need: int) -> None:
        """Evict host leaves by the policy's order until ``need`` units are free or none is left."""
        while self.hcap is not None and self.hcap - self.host_used < need:
            v = self._pop(True, set())
            if v is None:
                return
            v = self._tail(v, need - (self.hcap - self.host_used))
            self.host_used -= len(v.units)
            if v.dev:
                self._log("drop_host", v)
                self._flags(v, host=False)
            else:
                self._log("evict_host", v)
                self._remove(v)

    def _tail(self, n: _Node, k: int) -> _Node:
        """The last ``k`` units of ``n`` as a node of their own (exact eviction)."""
        if k < len(n.units):
            self._split(n, len(n.units) - k)
        return n

    def _log(self, event: str, n: _Node) -> None:
        self.victims.append((event, n.path(), len(n.units)))


def _bonus(window: int, turns: int) -> int:
    """``window x log2(turns)`` ticks, rounded down, with log2 interpolated linearly between
    powers of two (log2 3 = 1.5, log2 5 = 2.25, log2 6 = 2.5)."""
    k = turns.bit_length() - 1
    return window * k + (window * (turns - (1 << k))) // (1 << k)


def _common(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k
