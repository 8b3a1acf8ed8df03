"""An independent reference model of the tiered cache: what the tree *should* hold.

Written from ``spec/README.md`` (section 1, "Policies": write policies, eviction policies,
exact eviction, the exclusive host tier) and the facade's documented calls, sharing no
code with ``kvtier.fsm``: plain objects, lists and dicts, no lifecycle machine, no
concurrency. It follows one request at a time through ``admit``, ``step_done``,
``finish`` and ``poll`` with transfers that succeed at once (every command ``poll`` hands
out completes before the next call), and answers:

- per admission, the exact hit tokens by tier (:class:`Hit`: device, host) or ``None``
  when the device is short after eviction (the evictions it did stay done);
- per call, the exact victims (:meth:`ReferenceCache.take_victims`: ``demote``,
  ``evict_device``, ``drop_host``, ``evict_host`` of a node's tail, by unit path);
- the residency of every node (:meth:`ReferenceCache.residency`).

The rules the spec leaves to the implementation (the clock's stamps, tie-breaks, when a
writeback is queued) are the ones ``spec/README.md`` "Policies" states, each found by
observing the product; the driver (:mod:`kvtier.testing.reference_driver`) runs the
product and this model side by side and fails on the first difference.

Units: a *unit* is ``alignment`` tokens; capacities are in units (one page per unit).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Hit", "ReferenceCache", "WRITE_POLICIES", "EVICTIONS"]

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
EVICTIONS = ("lru", "lru_turns", "lru2")


@dataclass(frozen=True)
class Hit:
    """An admission's answer: ``device_tokens`` already on the device, ``host_tokens``
    loaded back from the host, ``start_token`` = their sum (the first token computed)."""

    device_tokens: int
    host_tokens: int

    @property
    def hit_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class _Node:
    """One radix node: a run of units with one residency (``dev``, ``host``)."""

    __slots__ = ("nid", "units", "parent", "children", "depth", "dev", "host", "la", "pu", "owner", "hc",
                 "turns", "reloaded", "refused", "queued", "pending", "loading")

    def __init__(self, nid: int, units: list[Hashable], parent: _Node | None, depth: int) -> None:
        self.nid = nid
        self.units = units
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.depth = depth  # units from the root to this node's last unit
        self.dev = self.host = False
        self.la = self.pu = 0  # last use, second-to-last use by a distinct owner (clock ticks)
        self.owner: str | None = None  # the owner of the last counted use
        self.hc = 0  # reuse count: distinct owners in a row
        self.turns = 1
        self.reloaded = self.refused = self.queued = self.pending = self.loading = False

    def path(self) -> tuple[Hashable, ...]:
        out: list[Hashable] = []
        n: _Node | None = self
        while n is not None and n.parent is not None:
            out[:0] = n.units
            n = n.parent
        return tuple(out)

    def state(self) -> str:
        return "backed" if self.dev and self.host else "device" if self.dev else "host"


class _Request:
    __slots__ = ("rid", "keys", "held", "tokens", "own", "prompt")

    def __init__(self, rid: str, keys: tuple[Hashable, ...], prompt: int) -> None:
        self.rid = rid
        self.keys = keys
        self.prompt = prompt
        self.held: list[_Node] = []  # its locked path, root first
        self.tokens = 0  # tokens with KV
        self.own = 0  # device pages of its own (not the tree's)


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
        self.a = alignment
        self.dcap, self.hcap = device_units, host_units
        self.policy, self.threshold, self.eviction = policy, write_threshold, eviction
        self.exclusive = exclusive
        self.finish_writeback = policy == "write_through" if finish_writeback is None else finish_writeback
        self.window = (device_units + (host_units or 0)) // 4  # lru_turns: window x log2(turns) ticks
        self.root = _Node(0, [], None, 0)
        self.root.dev = self.root.host = True
        self.clock = 0
        self._ids = 0
        self.dev_used = self.host_used = 0
        self.requests: dict[str, _Request] = {}
        self.queue: list[_Node] = []  # tree writebacks, issued by poll
        self.loads: list[_Node] = []  # loadbacks in flight until the next poll
        self.writes: list[tuple[_Node, ...]] = []  # finish writebacks in flight until the next poll
        self.releases: list[_Request] = []  # requests released when their finish writeback ends
        self.victims: list[tuple[str, tuple[Hashable, ...], int]] = []

    # ------------------------------------------------------------------ the calls
    def admit(self, rid: str, units: Sequence[Hashable], prompt_tokens: int, chunk_tokens: int) -> Hit | None:
        """Match, lock, reserve device pages for the loadback and the first chunk (evicting
        as needed); ``None`` when short (the request stays waiting, holding nothing)."""
        full = prompt_tokens // self.a
        keys = tuple(units[:full])
        path = self._match(keys[:(prompt_tokens - 1) // self.a])  # the last token is computed
        dev = [n for n in path if n.dev]
        host = path[len(dev):]
        d, h = sum(len(n.units) for n in dev), sum(len(n.units) for n in host)
        start = (d + h) * self.a
        chunk = min(chunk_tokens, prompt_tokens - start)
        own = -(-(start + chunk) // self.a) - d - h
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
            self.loads.extend(host)
        r = _Request(rid, keys, prompt_tokens)
        r.held, r.tokens, r.own = list(path), start, own
        self.dev_used += h + own
        self.requests[rid] = r
        return Hit(d * self.a, h * self.a)

    def step_done(self, rid: str, computed_tokens: int) -> None:
        """The forward pass computed ``computed_tokens`` more: publish the newly full units."""
        r = self.requests[rid]
        r.tokens += computed_tokens
        full = min(r.tokens // self.a, len(r.keys))
        held = sum(len(n.units) for n in r.held)
        if full <= held:
            return
        rest = list(r.keys[held:full])
        parent = r.held[-1] if r.held else self.root
        dups: list[_Node] = []
        while rest:  # units the tree already holds below the held path: copies of its pages
            child = parent.children.get(rest[0])
            if child is None:
                break
            k = _common(child.units, rest)
            if k < len(child.units):
                child = self._split(child, k)
            dups.append(child)
            rest = rest[k:]
            parent = child
        t = self._tick()
        for n in dups:
            n.la = t  # a use with no owner: it counts no reuse
            r.own -= len(n.units)
            if n.dev:
                self.dev_used -= len(n.units)  # the request's copy is freed
            else:
                n.dev = True  # republish: the node adopts the request's pages
        new: list[_Node] = []
        if rest:
            leaf = parent is not self.root and not parent.children
            turn = parent.turns + 1 if leaf else 1
            node = self._new(rest, parent)
            node.dev, node.turns = True, turn
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
        chain = tuple(n for n in r.held if not n.host)
        if self.finish_writeback and self.hcap is not None and chain and self._reserve_host(chain):
            self.writes.append(chain)
            self.releases.append(r)
            return
        self._release(r)

    def poll(self) -> None:
        """Issue the queued tree writebacks as one operation (parents first), then complete
        every transfer."""
        issued: list[_Node] = []
        for n in sorted(self.queue, key=lambda n: (n.depth, n.nid)):
            n.queued = False
            p = n.parent
            if n.dev and not n.host and not n.pending and p is not None and (p.host or p.pending):
                n.pending = True  # its parent keeps its host copy (has_host_child)
                issued.append(n)
        self.queue = []
        self._host_room(sum(len(n.units) for n in issued))
        done: list[_Node] = []
        for n in issued:
            p = n.parent
            if self.hcap - self.host_used >= len(n.units) and (p.host or p in done):
                self.host_used += len(n.units)
                done.append(n)
            else:
                n.pending, n.refused = False, True
        for n in self.loads:
            n.loading = False
            n.dev = n.reloaded = True
        self.loads = []
        for chain in self.writes:
            done.extend(chain)
        self.writes = []
        for n in done:
            n.pending = False
            n.host = True
        for r in self.releases:
            self._release(r)
        self.releases = []

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
        return n

    def _split(self, n: _Node, k: int) -> _Node:
        """Split ``n`` after ``k`` units: the head is a new node (a new id), ``n`` keeps the tail."""
        assert n.parent is not None and 0 < k < len(n.units)
        head = self._new(n.units[:k], n.parent)
        for f in ("dev", "host", "la", "pu", "owner", "hc", "turns", "reloaded", "refused", "pending", "loading"):
            setattr(head, f, getattr(n, f))
        n.units = n.units[k:]
        head.children[n.units[0]] = n
        n.parent = head
        for r in self.requests.values():
            if n in r.held:
                i = r.held.index(n)
                r.held[i:i] = [head]
        return head

    def _match(self, keys: tuple[Hashable, ...]) -> list[_Node]:
        """The longest matched path of readable nodes (device, then host), split at its end."""
        path: list[_Node] = []
        n, i, on_dev = self.root, 0, True
        while i < len(keys):
            c = n.children.get(keys[i])
            if c is None or not (c.dev or c.host) or (c.dev and not on_dev):
                break
            on_dev = on_dev and c.dev
            k = _common(c.units, keys[i:])
            if k < len(c.units):
                c = self._split(c, k)
            path.append(c)
            i += k
            n = c
        return path

    def _remove(self, n: _Node) -> None:
        assert n.parent is not None and not n.children
        del n.parent.children[n.units[0]]

    def _tail(self, n: _Node, k: int) -> _Node:
        """The last ``k`` units of ``n`` as a node of their own (exact eviction)."""
        if k < len(n.units):
            self._split(n, len(n.units) - k)
        return n

    # ------------------------------------------------------------------ clock and uses
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _touch(self, nodes: Sequence[_Node], owner: str) -> None:
        t = self._tick()
        for n in nodes:
            if owner != n.owner:
                n.pu, n.owner = n.la, owner
                n.hc += 1
                if (self.policy == "write_through_selective" and self.hcap is not None and n.hc >= self.threshold
                        and n.dev and not n.host):
                    self._enqueue(n)
            n.la = t

    def _release(self, r: _Request) -> None:
        if r.held:
            self._touch(r.held, r.rid)
        self.dev_used -= r.own
        r.own = 0
        del self.requests[r.rid]

    def _enqueue(self, n: _Node) -> None:
        if not n.queued:
            n.queued = True
            self.queue.append(n)

    # ------------------------------------------------------------------ eviction
    def _key(self, n: _Node, host: bool) -> tuple[float, ...]:
        if self.eviction == "lru_turns":
            return (n.la + _bonus(self.window, n.turns), -n.depth, n.nid)
        if host and self.eviction == "lru2":
            return (n.pu, n.la, -n.depth, n.nid)
        return (n.la, -n.depth, n.nid)

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.extend(n.children.values())
            stack.extend(n.children.values())
        return out

    def _locked(self) -> set[_Node]:
        return {n for r in self.requests.values() for n in r.held}

    def _device_room(self, need: int, locked: set[_Node]) -> bool:
        """Free ``need`` device units by the policy's order. ``write_back`` queues a
        device-only victim's chain and counts the victim's units as pledged: the search
        stops once free and pledged units cover ``need``; a victim freed now is split to
        what is still short of free units (pledges not counted)."""
        pledged = 0
        held = self._locked() | locked
        while self.dcap - self.dev_used + pledged < need:
            short = need - (self.dcap - self.dev_used)
            cands = [n for n in self._nodes() if n.dev and not n.loading and not n.queued and n not in held
                     and not any(c.dev for c in n.children.values())]
            if not cands:
                break
            v = min(cands, key=lambda n: self._key(n, False))
            if not v.host and self.policy == "write_back" and self.hcap is not None and not v.refused:
                chain = [v]
                while chain[-1].parent is not self.root and not chain[-1].parent.host:
                    chain.append(chain[-1].parent)
                for n in chain:
                    self._enqueue(n)
                pledged += len(v.units)
                continue
            v = self._tail(v, min(short, len(v.units)))
            self.dev_used -= len(v.units)
            if v.host:
                v.dev = False
                self._log("demote", v)
            else:
                self._log("evict_device", v)
                self._remove(v)
        return self.dcap - self.dev_used >= need

    def _reserve_host(self, chain: Sequence[_Node]) -> bool:
        """Reserve host units for ``chain`` (all or nothing), evicting for them first."""
        need = sum(len(n.units) for n in chain)
        for n in chain:
            n.pending = True
        self._host_room(need)
        if self.hcap - self.host_used < need:
            for n in chain:
                n.pending = False
            return False
        self.host_used += need
        return True

    def _host_room(self, need: int) -> None:
        """Evict host leaves by the policy's order until ``need`` units are free or nothing
        more can go (an exclusive tier drops reloaded duplicates first)."""
        while self.hcap - self.host_used < need:
            cands = [n for n in self._nodes() if n.host and not n.loading
                     and not any(c.host or c.pending for c in n.children.values())]
            if not cands:
                return
            if self.exclusive:
                dup = [n for n in cands if n.dev and n.reloaded]
                cands = dup or cands
            v = min(cands, key=lambda n: self._key(n, True))
            v = self._tail(v, min(need - (self.hcap - self.host_used), len(v.units)))
            v.host = False
            self.host_used -= len(v.units)
            if v.dev:
                self._log("drop_host", v)
            else:
                self._log("evict_host", v)
                self._remove(v)

    def _log(self, event: str, n: _Node) -> None:
        self.victims.append((event, n.path(), len(n.units)))


def _bonus(window: int, turns: int) -> int:
    """``window x log2(turns)`` ticks, rounded down, with log2 interpolated linearly between
    powers of two (log2 3 = 1.5, log2 5 = 2.25, log2 6 = 2.5)."""
    k = turns.bit_length() - 1
    return window * k + (window * (turns - (1 << k))) // (1 << k)


def _common(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k
