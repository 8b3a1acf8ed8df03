"""The core machine's state and the steps its rules share (:mod:`kvtier.testing.core_machine`).

:class:`CoreSteps` holds the cache under test, the byte-content model, the receipts and
operations the machine holds, the models of the writeback queue and of use stamps, the steps
the rules take (insert, lock, unlock, load, drain, pressure) and the invariant checks; the
rules are in :mod:`kvtier.testing.core_machine`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from kvtier.fsm import CacheCore, CapacityError, Completion, Direction
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import Node
from kvtier.fsm.node.ops import Settled
from kvtier.fsm.records import TransferCommand

from . import _views as views
from .base import KitMachine
from .content import check_tree_bytes, content
from .logged import LogCheck
from .models import (check_eviction_order, check_queue_exits, check_split_queue, check_use, snapshot_candidates,
                     snapshot_use)


class CoreSteps(KitMachine):
    """The core machine's state, shared steps and invariant checks (see
    :class:`~kvtier.testing.core_machine.CoreMachine`)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: LogCheck | None = None  # the example's recorded event log (setup's logged)
        self.cache: CacheCore
        self.dev_bytes: dict[tuple[str, int], Any] = {}
        self.host_bytes: dict[tuple[str, int], Any] = {}
        self.inserted: set[tuple[str, ...]] = set()
        self.locks: list[Any] = []
        self.receipts: list[Any] = []
        self.events: dict[int, list[list[Completion]]] = {}  # op -> per-rank queue
        self.expired: set[int] = set()  # ops their deadline settled (late completions absorbed)
        self.commands: dict[int, TransferCommand] = {}
        self.failed_ops: set[int] = set()
        self.world = 1
        self.layers: tuple[int, ...] = (0, 2)
        self.eviction = "lru"
        self.exclusive = False
        self.queued: dict[int, Node] = {}  # the writeback queue at the last check
        self.live_ids: set[int] = set()  # the tree's node ids at the last check
        self.submitted: set[int] = set()  # nodes of writeback commands taken since the last check
        self.churned = False  # the churn burst ran (once per example)

    # -- helpers -----------------------------------------------------------------
    def _node_at(self, i: int) -> Node | None:
        """The ``i``-th node of the tree by node id (modulo the node count), or ``None``."""
        nodes = views.nodes(self.cache)
        ids = sorted(nodes)
        return nodes[ids[i % len(ids)]] if ids else None

    def _newest_stamp(self) -> int:
        return max((n.last_access for n in views.nodes(self.cache).values()), default=0)

    def _lock(self, node: Node, owner: str) -> Any:
        """``cache.lock``, checked against the use model (a reuse counted exactly when the
        owner changes; the path becomes the most recently used)."""
        before, newest = snapshot_use(node.path()), self._newest_stamp()
        receipt = self.cache.lock(node, owner)
        self.cache.check_invariants()  # the invariants first: they name what broke more precisely
        check_use(before, newest, owner, True, f"lock by {owner!r}")
        return receipt

    def _unlock(self, receipt: Any) -> None:
        """``cache.unlock``, checked against the use model (the path becomes the most
        recently used; reuse counts unchanged)."""
        before, newest = snapshot_use(receipt.node.path()), self._newest_stamp()
        self.cache.unlock(receipt)
        self.cache.check_invariants()
        check_use(before, newest, None, False, "unlock")

    def _take_commands(self) -> None:
        for cmd in self.cache.poll_commands():
            self.commands[cmd.op_id] = cmd
            if cmd.direction is Direction.WRITEBACK:
                self.submitted.update(cmd.node_ids)
            queues = []
            for rank in range(self.world):
                q: list[Completion] = []
                if cmd.direction is Direction.LOADBACK:
                    q += [Completion(cmd.op_id, rank, True, layer) for layer in self.layers]
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
                n = views.nodes(self.cache).get(nid)
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

    def _insert(self, key: tuple[str, ...], checkpoint: bool, chunk: bool = False, anchor: str = "none",
                at: Node | None = None) -> None:
        """Publish ``key``, reusing its device hit (locked meanwhile). ``anchor``: ``hit``
        passes the locked hit as the walk's anchor (the fast path); ``recompute`` computes
        the whole key into fresh pages (the hit's pages duplicated) with the hit as anchor,
        which must then be ignored; ``at``: an anchor given by the caller (a locked node on
        the key's path, e.g. one being loaded). Whatever the anchor, the tree must end the
        same (the invariants and the byte model check it)."""
        c = self.cache
        ppu, history = views.pages_per_unit(c), views.history_groups(c)
        m = c.match(key)
        base = c.device_pages(m.device_node)
        if anchor == "recompute":
            base = {g: [] for g in history}
        rest = len(key) - (0 if anchor == "recompute" else m.device_units)
        need = {g: rest * ppu[g] for g in history}
        state_groups = views.checkpoint_groups(c) if checkpoint else []
        for g in state_groups:
            need[g] = views.checkpoint_pages(c)[g]
        hold = self._lock(m.device_node, "r") if m.device_node is not c.root else None
        try:
            fresh = c.alloc_device(need)
        except CapacityError:
            if hold is not None:
                self._unlock(hold)
            return
        pages = {}
        for g in history:
            own = fresh.get(g, [])
            pages[g] = base[g] + own
            for j, p in enumerate(own):
                self.dev_bytes[(g, p)] = content(key, g, len(base[g]) + j, ppu)
        ckpt = {g: fresh[g] for g in state_groups}
        for g, ps in ckpt.items():
            for j, p in enumerate(ps):
                self.dev_bytes[(g, p)] = content(key, g, j, ppu)
        if at is None and anchor != "none" and hold is not None:
            at = hold.node
        result = c.insert(key, pages, ckpt or None, chunk_checkpoint=chunk and bool(ckpt), anchor=at)
        if hold is not None:
            self._unlock(hold)
        if ckpt and result.published_units < len(key):  # stopped at a loading node: the state stays the caller's
            for g, ps in ckpt.items():
                if not set(ps) <= set(result.kept.get(g, ())):
                    raise InvariantViolation("exact_continuation_state", f"insert of {''.join(map(str, key))!r}",
                                             f"published {result.published_units} of {len(key)} units, but the "
                                             f"checkpoint pages of {g!r} were not handed back")
        self.inserted.add(key)
        for g, ps in result.duplicates.items():
            c.free_device({g: ps})
        for g, ps in result.kept.items():
            c.free_device({g: ps})
        self._take_commands()

    def _load_key(self, key: tuple[Hashable, ...]) -> Any:
        """Load back ``key``'s host hit, if any; returns the lock receipt of the loadback's
        terminal (``None`` without a loadback)."""
        c = self.cache
        m = c.match(key)
        if c.host is None and (m.host_units != m.device_units or m.needs_loadback):
            raise InvariantViolation("host_evict_leaves", f"match of {key!r}",
                                     f"a core without a host tier matched {m.host_units} units beyond its "
                                     f"device hit of {m.device_units}")
        if not m.needs_loadback:
            return None
        try:
            res = c.load(m, "r")
        except CapacityError:
            assert m.host_nodes and all(n.state == "host" for n in m.host_nodes), "load refused a join"
            return None
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
        return res.lock

    def _drain(self) -> None:
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

    def _pressure(self, g: int | str, n: int, tier: str) -> None:
        c = self.cache
        history = views.history_groups(c)
        g = g if isinstance(g, str) else history[g % len(history)]
        pool = c.device if tier == "device" else c.host
        if pool is None:  # no host tier: host eviction frees nothing and changes nothing
            before_nodes = {nid: n.state for nid, n in views.nodes(c).items()}
            if c.evict_host({g: n}) or {nid: x.state for nid, x in views.nodes(c).items()} != before_nodes:
                raise InvariantViolation("host_evict_leaves", "host eviction",
                                         "a core without a host tier evicted from the host")
            return
        before = pool[g].free
        victim = views.device_victim if tier == "device" else views.host_victim
        cands = snapshot_candidates([x for x in c.nodes() if victim(c, x)], self.eviction, tier,
                                    self.exclusive and c.has_host, views.eviction_window(c))
        queued_before = set(views.writeback_queue(c))
        freed = c.evict_device({g: n}) if tier == "device" else c.evict_host({g: n})
        check_eviction_order(cands, tier, set(views.nodes(c)), set(views.writeback_queue(c)), queued_before)
        if pool[g].free != before + freed[g]:
            raise InvariantViolation("conservation", f"{tier} pool of {g!r}",
                                     f"eviction reported {freed[g]} pages freed, {pool[g].free - before} were")
        if freed[g] < n:  # it stopped early: nothing it may evict is left
            if tier == "host":
                left = [x for x in c.nodes() if views.host_victim(c, x)]
            elif c.policy.value != "write_back":
                left = [x for x in c.nodes() if views.device_victim(c, x)]
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
            check_tree_bytes(self.cache, self.dev_bytes, self.host_bytes)

    def check_queue_model(self) -> None:
        """Model: nothing leaves the writeback queue without a reason (:func:`check_queue_exits`)."""
        if not hasattr(self, "cache"):
            return
        c = self.cache
        after = views.writeback_queue(c)
        for cmd in views.outbox(c):  # issued, not yet polled
            self.submitted.update(cmd.node_ids)
        live = views.nodes(c)
        check_queue_exits(self.queued, after, live, self.submitted,
                          lambda nid: views.writeback_refused(c, nid))
        check_split_queue(self.live_ids, self.queued, after, lambda nid: views.writeback_refused(c, nid))
        self.queued, self.submitted, self.live_ids = after, set(), set(live)
