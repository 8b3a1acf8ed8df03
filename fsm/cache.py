"""The tiered radix prefix cache: the heart of kvtier (sans-I/O).

Every residency change of a node goes through the node-residency machine built from the
spec (:func:`kvtier.fsm.machines.node_lifecycle`). The cache talks to the outside world
only through the :class:`TransferCommand` records it returns and the :class:`Completion`
records it is given. Effects are validated first and committed around the trigger;
nothing is done inside ``transitions`` callbacks.

Units: a *unit* is ``layout.alignment`` tokens; keys are sequences of unit keys (any
hashable: a tuple of that many token ids, or a block hash). Pages are per cache group.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import CapacityError, ConfigError, DuplicateCompletion, KvtierError, UnknownOperation
from .layout import CacheLayout
from .machines import node_lifecycle
from .node import DEVICE_READABLE, HOST_VISIBLE, LockReceipt, Node, NodeReceipt, PageMap
from .ops import LayerProgress, Operation, Settled
from .pages import PageAllocator
from .records import Completion, Direction, Family, GroupTransfer, TransferCommand

__all__ = ["WritePolicy", "MatchMode", "MatchResult", "InsertResult", "LoadResult", "TieredPrefixCache"]


class WritePolicy(str, enum.Enum):
    """When tree pages are backed up to the host."""

    WRITE_THROUGH = "write_through"  #: back up every newly published node
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  #: once its hit count reaches the threshold
    WRITE_BACK = "write_back"  #: only when device eviction needs the room


class MatchMode(str, enum.Enum):
    """How a match may end."""

    PREFIX_REUSE = "prefix_reuse"  #: new requests: the deepest usable prefix
    STATE_RECOVERY = "state_recovery"  #: resuming a retracted request: exactly its own terminal


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What :meth:`TieredPrefixCache.match` found for a key.

    Attributes:
        key_units: units in the key.
        device_node: deepest node whose device pages the hit reads directly (the root if
            none); with a loadback, the node the loaded chain hangs from.
        device_units: units read directly from the device.
        terminal: the node where the whole usable hit ends (the root if none).
        host_nodes: nodes beyond the device hit to load back, parent first (``host``
            state) — empty without a host tier.
        joined_nodes: nodes beyond the device hit already loading in another operation,
            which this hit joins (it may end inside them).
        host_units: usable hit units in total (device + host); ``>= device_units``.
        history_units: the history-only bound: units matched with history pages,
            ignoring continuation state (equal to ``host_units`` without state groups).
        recompute_tokens: with ``history_replay``, tokens before the hit end the engine
            must recompute to rebuild the continuation state (0 otherwise).
        alignment: tokens per unit.
    """

    key_units: int
    device_node: Node
    device_units: int
    terminal: Node
    host_nodes: tuple[Node, ...]
    joined_nodes: tuple[Node, ...]
    host_units: int
    history_units: int
    recompute_tokens: int
    alignment: int

    @property
    def device_tokens(self) -> int:
        return self.device_units * self.alignment

    @property
    def hit_tokens(self) -> int:
        """Tokens the request need not compute (device + host hit, minus any replay span)."""
        return self.host_units * self.alignment - self.recompute_tokens

    @property
    def needs_loadback(self) -> bool:
        return self.host_units > self.device_units


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`TieredPrefixCache.insert` published.

    Attributes:
        node: deepest node now holding the published prefix (the root if nothing).
        published_units: units of the key now in the tree (device-readable).
        pages: history group -> the canonical device page ids of the published range
            (the caller's page table for it from now on).
        duplicates: group -> the caller's pages that duplicated canonical ones; the
            caller frees them (:meth:`TieredPrefixCache.free_device`).
        kept: group -> the caller's pages that were not published (beyond a node that is
            loading); they stay the caller's.
        created: nodes created by this insert.
    """

    node: Node
    published_units: int
    pages: PageMap
    duplicates: PageMap
    kept: PageMap
    created: tuple[Node, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A loadback started (or joined) by :meth:`TieredPrefixCache.load`.

    Attributes:
        command: the loadback to submit, or ``None`` when it only joined others.
        op_ids: every operation the caller must wait for (its own and joined ones).
        pin: the caller's pin receipt on the host copies (release it after the ack).
        lock: the caller's lock receipt on the loaded path (release it when done).
        device_pages: history group -> device page ids of the whole hit (device + loaded).
        extra: group -> the caller's own pages reserved with the loadback (``extra``).
    """

    command: TransferCommand | None
    op_ids: tuple[int, ...]
    pin: NodeReceipt
    lock: LockReceipt
    device_pages: PageMap
    extra: PageMap = field(default_factory=dict)


@dataclass
class CacheStats:
    """Cumulative counters (pages are summed over groups)."""

    demotions: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    host_drops: int = 0
    writebacks: int = 0
    writeback_failures: int = 0
    loadbacks: int = 0
    loadback_failures: int = 0
    joined_loadbacks: int = 0
    expired_ops: int = 0
    absorbed_late_completions: int = 0
    pages_written: int = 0
    pages_loaded: int = 0
    splits: int = 0
    triggers: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _as_capacity(layout: CacheLayout, value: int | Mapping[str, int], what: str) -> dict[str, int]:
    if isinstance(value, Mapping):
        unknown = set(value) - {g.name for g in layout.groups}
        if unknown:
            raise ConfigError(f"{what}: unknown cache groups {sorted(unknown)}")
        missing = {g.name for g in layout.groups} - set(value)
        if missing:
            raise ConfigError(f"{what}: no capacity for cache groups {sorted(missing)}")
        for g, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{what}: pages of group {g!r} must be an int >= 0, got {v!r}")
        return dict(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what}: must be an int >= 0 (units) or a mapping group -> pages, got {value!r}")
    return units_to_pages(layout, value)


def units_to_pages(layout: CacheLayout, units: int, checkpoints: int | None = None) -> dict[str, int]:
    """Pages per group for a pool that holds ``units`` cache units of history and
    ``checkpoints`` continuation-state checkpoints (default: one per 4 units, at least 4).
    """
    ckpt = max(4, units // 4) if checkpoints is None else checkpoints
    out = {}
    for g in layout.groups:
        out[g.name] = units * layout.pages_per_unit(g) if g.family is Family.HISTORY else ckpt * g.state_pages
    return out


class TieredPrefixCache:
    """A radix prefix cache whose nodes carry device and host copies of several cache groups.

    Args:
        layout: the model's cache groups (:class:`CacheLayout`).
        device_pages: device capacity: units of history (int; state groups sized by
            :func:`units_to_pages`) or pages per group (mapping).
        host_pages: host capacity likewise, or ``None`` for no host tier: then kvtier is a
            plain device prefix cache and does no transfer bookkeeping at all.
        policy: :class:`WritePolicy` (default ``write_through_selective``).
        write_threshold: hit count at which ``write_through_selective`` backs a node up.
        world_size: tensor-parallel ranks that must acknowledge every operation.
        op_deadline_steps: scheduler steps after which an operation fails (``None``: never).

    Raises:
        ConfigError: bad capacities, policy, threshold or world size.
    """

    def __init__(self, layout: CacheLayout, device_pages: int | Mapping[str, int],
                 host_pages: int | Mapping[str, int] | None = None, *,
                 policy: WritePolicy | str = WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold: int = 2,
                 world_size: int = 1, op_deadline_steps: int | None = None) -> None:
        if not isinstance(layout, CacheLayout):
            raise ConfigError(f"layout must be a CacheLayout (see kvtier.fsm.presets.preset), got {layout!r}")
        self.layout = layout
        try:
            self.policy = WritePolicy(policy)
        except ValueError:
            raise ConfigError(f"write policy must be one of {[p.value for p in WritePolicy]}, got {policy!r}") from None
        if isinstance(write_threshold, bool) or not isinstance(write_threshold, int) or write_threshold < 1:
            raise ConfigError(f"write_threshold must be an int >= 1, got {write_threshold!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        if op_deadline_steps is not None and (isinstance(op_deadline_steps, bool) or
                                              not isinstance(op_deadline_steps, int) or op_deadline_steps < 1):
            raise ConfigError(f"op_deadline_steps must be None or an int >= 1, got {op_deadline_steps!r}")
        self.write_threshold = write_threshold
        self.world_size = world_size
        self.op_deadline_steps = op_deadline_steps
        dev = _as_capacity(layout, device_pages, "device_pages")
        self.device = {g: PageAllocator("device", g, n) for g, n in dev.items()}
        self.host: dict[str, PageAllocator] | None = None
        if host_pages is not None:
            host = _as_capacity(layout, host_pages, "host_pages")
            self.host = {g: PageAllocator("host", g, n) for g, n in host.items()}
        self._history = [g.name for g in layout.history_groups]
        self._state = [g.name for g in layout.state_groups]
        self._ppu = {g.name: layout.pages_per_unit(g) for g in layout.history_groups}
        self._state_pages = {g.name: g.state_pages for g in layout.state_groups}
        self._all_layers = tuple(range(layout.num_layers))
        self._machine = node_lifecycle()
        self._fire = self._machine.fire
        self._ids = itertools.count(1)
        self._op_ids = itertools.count(1)
        self.root = Node(0, (), None)
        self.root.state = "root"
        self.clock = 0  # logical clock: advanced on every use
        self.step = 0  # scheduler steps (deadlines)
        self._nodes: dict[int, Node] = {}
        self._external: dict[str, set[int]] = {g.name: set() for g in layout.groups}
        self._locks: dict[int, LockReceipt] = {}
        self._receipts: dict[int, NodeReceipt] = {}
        self._ops: dict[int, Operation] = {}
        self._expired: set[int] = set()
        self._settled: set[int] = set()
        self._wb_queue: dict[int, Node] = {}  # node_id -> node wanting a tree writeback
        # device nodes whose tree writeback the host could not take: under write_back,
        # eviction drops them instead of queueing them again (no queue/refuse livelock)
        self._wb_refused: set[int] = set()
        self._outbox: list[TransferCommand] = []
        # lazy LRU heaps of eviction candidates, (lru key, node): a touch pushes a new entry
        # and stale ones are skipped when popped (the key no longer matches), so touching a
        # node is O(log n); keys hold the node id, so entries of different nodes never tie
        # and the node itself is never compared
        self._dev_lru: list[tuple[tuple[int, int, int], Node]] = []
        self._host_lru: list[tuple[tuple[int, int, int], Node]] = []
        self.stats = CacheStats()

    # ------------------------------------------------------------------ properties
    @property
    def has_host(self) -> bool:
        return self.host is not None

    @property
    def alignment(self) -> int:
        return self.layout.alignment

    def nodes(self) -> list[Node]:
        """Every node in the tree (root excluded)."""
        return list(self._nodes.values())

    def node(self, node_id: int) -> Node:
        """The node with ``node_id``.

        Raises:
            KvtierError: no such node in the tree.
        """
        try:
            return self._nodes[node_id]
        except KeyError:
            raise KvtierError(f"no node {node_id} in the tree") from None

    def operations(self) -> dict[int, Operation]:
        """In-flight operations by op id (a copy)."""
        return dict(self._ops)

    def ops_in_flight(self, direction: Direction | None = None) -> int:
        """Operations in flight (of ``direction`` only, if given)."""
        if direction is None:
            return len(self._ops)
        return sum(1 for op in self._ops.values() if op.command.direction is direction)

    def external_pages(self, group: str) -> frozenset[int]:
        """Device pages of ``group`` handed to callers (requests) and not yet published or freed."""
        return frozenset(self._external[group])

    # ------------------------------------------------------------------ the machine
    def _trigger(self, node: Node, event: str) -> None:
        self._fire(node, event)
        self.stats.triggers += 1
        self._touch(node)
        if node.parent is not None and node.parent.parent is not None:
            self._touch(node.parent)

    def _touch(self, n: Node) -> None:
        """Make ``n`` an eviction candidate under its current LRU key.

        Each heap holds at most ``4 x nodes + 256`` entries: past that it is rebuilt from the
        live nodes (O(nodes)), and not before, so rebuilds stay rare.
        """
        key = self._lru_key(n)
        heapq.heappush(self._dev_lru, (key, n))
        heapq.heappush(self._host_lru, (key, n))
        limit = 4 * len(self._nodes) + 256
        if len(self._dev_lru) > limit:
            self._dev_lru = self._rebuilt()
        if len(self._host_lru) > limit:
            self._host_lru = self._rebuilt()

    def _rebuilt(self) -> list[tuple[tuple[int, int, int], Node]]:
        heap = [(self._lru_key(n), n) for n in self._nodes.values()]
        heapq.heapify(heap)
        return heap

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ caller pages
    def alloc_device(self, need: Mapping[str, int], *, evict: bool = True) -> PageMap:
        """Allocate device pages for a caller (a request's own pages), all or nothing.

        Args:
            need: group -> pages.
            evict: evict unlocked tree pages (device, then demote) if short.

        Raises:
            CapacityError: still short after eviction; nothing allocated.
            ConfigError: unknown group or negative count.
        """
        self._check_need(need)
        short = {g: n - self.device[g].free for g, n in need.items() if n > self.device[g].free}
        if short and evict:
            self.evict_device(short)
        for g, n in need.items():
            if n > self.device[g].free:
                raise CapacityError("device", g, n, self.device[g].free)
        out = {g: self.device[g].alloc(n) for g, n in need.items() if n > 0}
        for g, pages in out.items():
            self._external[g].update(pages)
        return out

    def free_device(self, pages: Mapping[str, Iterable[int]]) -> None:
        """Return a caller's device pages.

        Raises:
            KvtierError: a page is not the caller's (tree-owned, free, or unknown); nothing freed.
        """
        lists = {g: list(p) for g, p in pages.items()}
        for g, ps in lists.items():
            if g not in self._external:
                raise ConfigError(f"free_device: unknown cache group {g!r}")
            bad = [p for p in ps if p not in self._external[g]]
            if bad or len(set(ps)) != len(ps):
                raise KvtierError(f"free_device: pages {bad or ps} of group {g!r} are not held by a caller")
        for g, ps in lists.items():
            self._external[g].difference_update(ps)
            self.device[g].release(ps)

    def _tree_nodes(self, what: str, nodes: Iterable[object]) -> list[Node]:
        """``nodes`` as a list, each checked to be a node of this tree (not the root)."""
        if isinstance(nodes, Node) or not isinstance(nodes, Iterable):
            raise KvtierError(f"{what} takes a list of nodes, got {nodes!r}")
        out: list[Node] = []
        for n in nodes:
            if not isinstance(n, Node) or self._nodes.get(n.node_id) is not n:
                raise KvtierError(f"{what}: {n!r} is not a node of this cache's tree")
            out.append(n)
        if not out:
            raise KvtierError(f"{what}: no nodes given")
        return out

    def _check_need(self, need: Mapping[str, int]) -> None:
        for g, n in need.items():
            if g not in self.device:
                raise ConfigError(f"unknown cache group {g!r}; groups: {sorted(self.device)}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"page count for group {g!r} must be an int >= 0, got {n!r}")

    # ------------------------------------------------------------------ tree walking
    def _split(self, node: Node, k: int) -> Node:
        """Split ``node`` after ``k`` units; returns the new prefix fragment (the parent).

        Both fragments keep the state, counts and in-flight operations (invariant 6).
        """
        assert 0 < k < len(node.key)
        self._trigger(node, "split")
        parent = node.parent
        assert parent is not None
        prefix = Node(next(self._ids), node.key[:k], parent)
        prefix.state = node.state
        for attr in ("dev", "host", "pending"):
            whole: PageMap = getattr(node, attr)
            head: PageMap = {}
            for g, pages in whole.items():
                cut = k * self._ppu[g]
                head[g] = pages[:cut]
                whole[g] = pages[cut:]
            setattr(prefix, attr, head)
        for attr in ("lock_ref", "borrow_ref", "host_pin", "hit_count", "last_access", "wb_op", "lb_op"):
            setattr(prefix, attr, getattr(node, attr))
        for rid in node.refs:
            prefix.add_ref(rid)
            r = self._receipts[rid]
            r.nodes.insert(r.nodes.index(node), prefix)
        for op_id in {node.wb_op, node.lb_op} - {None}:
            assert op_id is not None
            op = self._ops[op_id]
            op.nodes.insert(op.nodes.index(node), prefix)
        node.key = node.key[k:]
        parent.children[prefix.key[0]] = prefix
        prefix.children[node.key[0]] = node
        node.parent = prefix
        if node.node_id in self._wb_queue:
            self._wb_queue[prefix.node_id] = prefix
        self._nodes[prefix.node_id] = prefix
        self._touch(prefix)
        self.stats.splits += 1
        return prefix

    def _walk(self, key: Sequence[Hashable]) -> list[Node]:
        """Nodes matching ``key`` from the root, splitting the last one where the key diverges."""
        path: list[Node] = []
        node = self.root
        i = 0
        n = len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            ck = child.key
            m = 1
            limit = min(len(ck), n - i)
            while m < limit and ck[m] == key[i + m]:
                m += 1
            if m < len(ck):
                child = self._split(child, m)
            path.append(child)
            i += m
            node = child
            if m < len(ck):
                break
        return path

    # ------------------------------------------------------------------ match
    def match(self, key: Sequence[Hashable], mode: MatchMode | str = MatchMode.PREFIX_REUSE, *,
              history_replay: bool = False) -> MatchResult:
        """Find the usable device hit and, beyond it, the host hit for ``key``.

        The device hit runs through nodes whose device pages every request may read; the
        host hit continues through nodes with visible host copies and stops at the first
        gap (invariant 9); it may join nodes already loading but never goes past them.
        With state groups a hit ends only at a node holding the exact continuation state
        for its own length in the matching tier (invariant 15); in ``state_recovery`` mode
        only at the key's own end. ``history_replay=True`` (prefix_reuse only) returns the
        deeper history-only hit with ``recompute_tokens``: the engine recomputes that many
        tokens before the hit end to rebuild the continuation state. That is valid when
        every state group is a sliding window over the layers' own KV, so the state at D
        is a function of the history before D (the replay span covers the stacked
        windows; :meth:`CacheLayout.replay_span_tokens`); it is not valid for state that
        depends on earlier state the history does not determine.

        Splits the node where the key diverges mid-node (semantically invisible).

        Raises:
            ConfigError: ``key`` not a sequence, unknown mode, or ``history_replay`` with
                ``state_recovery``.
        """
        if not isinstance(key, Sequence):
            raise ConfigError(f"match: key must be a sequence of unit keys, got {key!r}")
        try:
            mode = MatchMode(mode)
        except ValueError:
            raise ConfigError(f"match mode must be one of {[m.value for m in MatchMode]}, got {mode!r}") from None
        if history_replay and mode is MatchMode.STATE_RECOVERY:
            raise ConfigError("history_replay applies to prefix_reuse matches only")
        path = self._walk(key)
        # device-readable prefix of the path, then host-visible nodes (stop after loading ones)
        d = 0
        while d < len(path) and path[d].state in DEVICE_READABLE:
            d += 1
        h = d
        if self.host is not None:
            while h < len(path) and path[h].state in ("host", "loading"):
                if path[h].state == "loading":  # (a loading node's lb_op is its operation)
                    h += 1
                    while h < len(path) and path[h].state == "loading" and path[h].lb_op == path[h - 1].lb_op:
                        h += 1
                    break
                h += 1
        history_units = path[h - 1].depth if h else 0
        recompute = 0
        if not self._state:
            dev_end, host_end = d, h  # history-only layouts may resume from any prefix
        else:
            dev_end = host_end = 0
            for i in range(h):
                nd = path[i]
                if i < d and self._has_checkpoint(nd.dev_state):
                    dev_end = host_end = i + 1
                elif i >= d and self._has_checkpoint(nd.host_state):
                    # (a loading node keeps its pinned host checkpoint until the loadback settles)
                    host_end = i + 1
            if mode is MatchMode.STATE_RECOVERY:
                full = h > 0 and path[h - 1].depth == len(key)
                if not (full and max(dev_end, host_end) == h):
                    dev_end = host_end = 0
            state_tokens = path[max(dev_end, host_end) - 1].depth * self.alignment if max(dev_end, host_end) else 0
            span = self.layout.replay_span_tokens()
            if history_replay and history_units * self.alignment - span > state_tokens:
                recompute = span
                dev_end, host_end = d, h
        if host_end > dev_end:  # load back path[d:host_end], read path[:d] from the device
            dev_end = d
        else:
            host_end = dev_end
        device_node = path[dev_end - 1] if dev_end else self.root
        beyond = path[dev_end:host_end]
        return MatchResult(
            key_units=len(key), device_node=device_node, device_units=device_node.depth,
            terminal=path[host_end - 1] if host_end else self.root,
            host_nodes=tuple(n for n in beyond if n.state == "host"),
            joined_nodes=tuple(n for n in beyond if n.state == "loading"),
            host_units=path[host_end - 1].depth if host_end else 0,
            history_units=history_units, recompute_tokens=recompute, alignment=self.alignment,
        )

    def _has_checkpoint(self, state_pages: PageMap) -> bool:
        return len(state_pages) == len(self._state)

    def device_pages(self, node: Node) -> PageMap:
        """The device page table from the root to ``node``'s end: history groups' pages
        along the path, and each state group's checkpoint at ``node`` (if any)."""
        out: PageMap = {g: [] for g in self._history}
        for n in reversed(node.path()):
            for g in self._history:
                out[g].extend(n.dev.get(g, ()))
        for g, pages in node.dev_state.items():
            out[g] = list(pages)
        return out

    # ------------------------------------------------------------------ locks, borrows, pins
    def lock(self, node: Node, owner: str | None = None) -> LockReceipt:
        """Lock ``node`` and its ancestors on the device (a running request uses them).

        Counts a hit for ``write_through_selective`` and stamps the logical clock.

        Raises:
            KvtierError: ``node`` is not a node of this cache's tree (nothing changes).
        """
        self._tree_nodes("lock", [node])
        rid = next(self._ids)
        receipt = LockReceipt(rid, node, owner)
        stamp = self._tick()
        for n in node.path():
            n.lock_ref += 1
            n.hit_count += 1
            n.last_access = stamp
            self._touch(n)
            if (self.host is not None and self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE
                    and n.hit_count >= self.write_threshold and n.state == "device"):
                self._wb_queue[n.node_id] = n
        self._locks[rid] = receipt
        return receipt

    def unlock(self, receipt: LockReceipt) -> None:
        """Release a lock receipt exactly once.

        Raises:
            KvtierError: the receipt was already released or is not this cache's (invariant 5).
        """
        if not isinstance(receipt, LockReceipt):
            raise KvtierError(f"unlock takes a LockReceipt, got {receipt!r}")
        if receipt.released or self._locks.get(receipt.receipt_id) is not receipt:
            raise KvtierError(f"{receipt!r} was already released or is unknown (counts_with_receipts)")
        receipt.released = True
        del self._locks[receipt.receipt_id]
        stamp = self._tick()
        for n in receipt.node.path():
            n.lock_ref -= 1
            n.last_access = stamp
            self._touch(n)

    def _take(self, kind: str, nodes: list[Node], owner: str | None) -> NodeReceipt:
        rid = next(self._ids)
        receipt = NodeReceipt(rid, kind, list(nodes), owner)
        attr = "host_pin" if kind == "pin" else "borrow_ref"
        for n in receipt.nodes:
            setattr(n, attr, getattr(n, attr) + 1)
            n.add_ref(rid)
        self._receipts[rid] = receipt
        return receipt

    def borrow(self, nodes: Sequence[Node], owner: str | None = None) -> NodeReceipt:
        """Borrow device pages of ``nodes`` (a request reads them; invariant 14).

        Raises:
            KvtierError: no nodes, a value that is not a node of this tree, or a node
                without device pages (nothing changes).
        """
        nodes = self._tree_nodes("borrow", nodes)
        bad = [n.node_id for n in nodes if n.state not in DEVICE_READABLE and n.state != "loading"]
        if bad:
            raise KvtierError(f"borrow: nodes {bad} have no device pages")
        return self._take("borrow", nodes, owner)

    def pin(self, nodes: Sequence[Node], owner: str | None = None) -> NodeReceipt:
        """Pin the host copies of ``nodes`` (invariant 4).

        Raises:
            KvtierError: no nodes, a value that is not a node of this tree, or a node
                without a visible host copy (nothing changes).
        """
        nodes = self._tree_nodes("pin", nodes)
        bad = [n.node_id for n in nodes if n.state not in HOST_VISIBLE]
        if bad:
            raise KvtierError(f"pin: nodes {bad} have no visible host copy")
        return self._take("pin", nodes, owner)

    def release(self, receipt: NodeReceipt) -> None:
        """Release a pin or borrow receipt exactly once.

        Raises:
            KvtierError: already released or unknown (invariant 5).
        """
        if not isinstance(receipt, NodeReceipt):
            raise KvtierError(f"release takes a pin or borrow receipt (NodeReceipt), got {receipt!r}")
        if receipt.released or self._receipts.get(receipt.receipt_id) is not receipt:
            raise KvtierError(f"{receipt!r} was already released or is unknown (counts_with_receipts)")
        receipt.released = True
        del self._receipts[receipt.receipt_id]
        attr = "host_pin" if receipt.kind == "pin" else "borrow_ref"
        for n in receipt.nodes:
            setattr(n, attr, getattr(n, attr) - 1)
            n.discard_ref(receipt.receipt_id)
            self._touch(n)

    # ------------------------------------------------------------------ insert
    def insert(self, key: Sequence[Hashable], pages: Mapping[str, Sequence[int]],
               checkpoint: Mapping[str, Sequence[int]] | None = None, *,
               chunk_checkpoint: bool = False) -> InsertResult:
        """Publish a computed prefix: ``pages`` hold, per history group, the caller's device
        page table for the whole ``key`` (canonical pages it borrowed, then its own pages).

        Ranges the tree already holds keep their canonical pages and the caller's copies
        come back as ``duplicates``; a ``host`` node on the way is republished with the
        caller's pages (``backed``); nothing is published at or beyond a node that is
        loading (those pages are ``kept``). ``checkpoint`` (state group -> its
        ``state_pages`` pages for exactly the key's end) gives the terminal node its
        continuation state; ``chunk_checkpoint`` marks it as left by an intermediate
        prefill chunk, so that a later, deeper checkpoint of the same prefix may drop it.

        Raises:
            ConfigError: wrong page counts, unknown groups, or pages that are neither the
                caller's nor the canonical ones for their range (nothing changes).
        """
        if not isinstance(key, Sequence) or not key:
            raise ConfigError(f"insert: key must be a non-empty sequence of unit keys, got {key!r}")
        if not isinstance(pages, Mapping):
            raise ConfigError(f"insert: pages must be a mapping group -> page ids, got {pages!r}")
        units = len(key)
        own = {g: list(pages.get(g, ())) for g in self._history}
        for g in self._history:
            if len(own[g]) != units * self._ppu[g]:
                raise ConfigError(f"insert: group {g!r} needs {units * self._ppu[g]} pages for {units} units, "
                                  f"got {len(own[g])}")
        extra = set(pages) - set(self._history)
        if extra:
            raise ConfigError(f"insert: pages given for non-history groups {sorted(extra)}")
        ckpt = {g: list(p) for g, p in (checkpoint or {}).items()}
        for g, p in ckpt.items():
            if g not in self._state_pages:
                raise ConfigError(f"insert: checkpoint for unknown state group {g!r}")
            if len(p) != self._state_pages[g]:
                raise ConfigError(f"insert: checkpoint of {g!r} needs {self._state_pages[g]} pages, got {len(p)}")
        if ckpt and set(ckpt) != set(self._state):
            raise ConfigError(f"insert: a checkpoint needs every state group {self._state}, got {sorted(ckpt)}")
        for g in itertools.chain(self._history, ckpt):
            table = own.get(g, []) + ckpt.get(g, [])
            if len(set(table)) != len(table):
                raise ConfigError(f"insert: the page table of group {g!r} lists a page twice")
        path = self._walk(key)
        # validate: every page is the canonical one for its position or the caller's own
        pos = 0
        for n in path:
            lo = pos
            pos = n.depth
            for g in self._history:
                span = own[g][lo * self._ppu[g]:pos * self._ppu[g]]
                canon = n.dev.get(g, [])
                for j, page in enumerate(span):
                    if not (page in self._external[g] or (j < len(canon) and canon[j] == page)):
                        raise ConfigError(f"insert: page {page} of group {g!r} at unit {lo + j // self._ppu[g]} "
                                          f"is neither the caller's nor node {n.node_id}'s")
        for g, ps in itertools.chain(
                ((g, own[g][pos * self._ppu[g]:]) for g in self._history), ckpt.items()):
            bad = [p for p in ps if p not in self._external[g]]
            if bad:
                raise ConfigError(f"insert: pages {bad} of group {g!r} are not held by the caller")
        # commit
        duplicates: PageMap = {}
        kept: PageMap = {}
        created: list[Node] = []
        stamp = self._tick()
        last: Node = self.root
        done = 0
        stopped = False
        for n in path:
            lo = done
            hi = n.depth
            if n.state == "loading":
                stopped = True
                break
            if n.state == "host":
                for g in self._history:
                    mine = own[g][lo * self._ppu[g]:hi * self._ppu[g]]
                    n.dev[g] = mine
                    self._external[g].difference_update(mine)
                self._trigger(n, "republish")
            else:
                for g in self._history:
                    mine = own[g][lo * self._ppu[g]:hi * self._ppu[g]]
                    canon = n.dev[g]
                    dup = [p for p, c in zip(mine, canon) if p != c]
                    if dup:
                        duplicates.setdefault(g, []).extend(dup)
            n.last_access = stamp
            self._touch(n)
            last = n
            done = hi
        if not stopped and done < units:
            node = Node(next(self._ids), tuple(key[done:]), last)
            for g in self._history:
                mine = own[g][done * self._ppu[g]:]
                node.dev[g] = mine
                self._external[g].difference_update(mine)
            node.last_access = stamp
            self._trigger(node, "create")
            last.children[node.key[0]] = node
            self._nodes[node.node_id] = node
            created.append(node)
            last = node
            done = units
            if self.host is not None and self.policy is WritePolicy.WRITE_THROUGH:
                self._wb_queue[node.node_id] = node
        for g in self._history:
            # only the caller's own pages: canonical pages of a loading node stay the tree's
            rest = [p for p in own[g][done * self._ppu[g]:] if p in self._external[g]]
            if rest:
                kept[g] = rest
        if ckpt:
            if done == units and last is not self.root:
                self._adopt_checkpoint(last, ckpt, duplicates, chunk_checkpoint)
            else:
                for g, p in ckpt.items():
                    kept.setdefault(g, []).extend(p)
        full = self.device_pages(last)
        return InsertResult(last, done, {g: full[g] for g in self._history}, duplicates, kept, tuple(created))

    def _adopt_checkpoint(self, node: Node, ckpt: PageMap, duplicates: PageMap, chunk: bool) -> None:
        if self._has_checkpoint(node.dev_state):
            for g, p in ckpt.items():
                if node.dev_state[g] != p:
                    duplicates.setdefault(g, []).extend(x for x in p if x not in node.dev_state[g])
            if not chunk:
                node.chunk_checkpoint = False
            return
        for g, p in ckpt.items():
            node.dev_state[g] = list(p)
            self._external[g].difference_update(p)
        node.chunk_checkpoint = chunk
        # ancestors' chunk checkpoints are no longer needed by this prefix
        for a in node.path()[1:]:
            if (a.chunk_checkpoint and a.state in ("device", "backed") and a.lock_ref <= 1
                    and a.borrow_ref == 0 and a.dev_state):
                self._drop_dev_checkpoint(a)

    def _drop_dev_checkpoint(self, node: Node) -> None:
        for g, p in node.dev_state.items():
            self.device[g].release(p)
        node.dev_state = {}
        node.chunk_checkpoint = False

    # ------------------------------------------------------------------ eviction
    def _lru_key(self, n: Node) -> tuple[int, int, int]:
        # oldest first, then deepest first, then node id: a total order every rank shares
        return (n.last_access, -n.depth, n.node_id)

    def evict_device(self, need: Mapping[str, int]) -> dict[str, int]:
        """Free device pages from unlocked, unborrowed device leaves in LRU order.

        A ``backed`` node is demoted (its host copy stays), a ``device`` node is dropped,
        or under ``write_back`` queued for writeback first (freeing nothing now).

        Args:
            need: group -> pages wanted (the loop stops once every group has that many freed).

        Returns:
            group -> pages actually freed (may be less than asked).
        """
        self._check_need(need)
        freed = {g: 0 for g in self.device}
        heap = self._dev_lru
        queued: list[Node] = []
        while heap and any(freed[g] < k for g, k in need.items()):
            # A node that is not a victim now is dropped from the heap: whatever makes it
            # one later (unlock, release, a child leaving, a state change) touches it again.
            key, n = heapq.heappop(heap)
            if self._nodes.get(n.node_id) is not n or key != self._lru_key(n) or not self._device_victim(n):
                continue
            if n.state == "backed":
                got = self._release_device(n)
                self._trigger(n, "demote")
                self.stats.demotions += 1
            elif self.policy is WritePolicy.WRITE_BACK and self.host is not None and not any(
                    a.node_id in self._wb_refused for a in self._device_chain(n)):
                for a in self._device_chain(n):  # back up the device-only chain, parent first
                    self._wb_queue[a.node_id] = a
                queued.append(n)  # still a candidate: back in the heap after this call
                continue
            else:
                got = self._release_device(n)
                self._trigger(n, "evict_device")
                self._remove(n)
                self.stats.device_evictions += 1
            for g, k in got.items():
                freed[g] += k
        for n in queued:
            self._touch(n)
        return freed

    @staticmethod
    def _device_chain(n: Node) -> list[Node]:
        """``n`` and its ancestors up to the first one not in the ``device`` state."""
        out = []
        for a in n.path():
            if a.state != "device":
                break
            out.append(a)
        return out

    def _device_victim(self, n: Node) -> bool:
        return (n.state in ("device", "backed") and n.lock_ref == 0 and n.borrow_ref == 0
                and not n.has_device_child)

    def _release_device(self, n: Node) -> dict[str, int]:
        got: dict[str, int] = {}
        for g, pages in itertools.chain(n.dev.items(), n.dev_state.items()):
            self.device[g].release(pages)
            got[g] = got.get(g, 0) + len(pages)
        n.dev = {}
        n.dev_state = {}
        n.chunk_checkpoint = False
        return got

    def _release_host(self, n: Node) -> dict[str, int]:
        assert self.host is not None
        got: dict[str, int] = {}
        for g, pages in itertools.chain(n.host.items(), n.host_state.items()):
            self.host[g].release(pages)
            got[g] = got.get(g, 0) + len(pages)
        n.host = {}
        n.host_state = {}
        return got

    def _remove(self, n: Node) -> None:
        parent = n.parent
        assert parent is not None and not n.children
        del parent.children[n.key[0]]
        del self._nodes[n.node_id]
        self._wb_queue.pop(n.node_id, None)
        self._wb_refused.discard(n.node_id)

    def evict_host(self, need: Mapping[str, int], *, protect: Iterable[Node] = (),
                   host_only: bool = False) -> dict[str, int]:
        """Free host pages from host leaves with pin 0 in LRU order (invariant 9): a
        ``host`` node is removed, a ``backed`` node sheds its host copy and stays on device.
        With ``host_only``, ``backed`` nodes are spared (only host-only nodes go).

        Returns:
            group -> host pages actually freed.
        """
        if self.host is None:
            return {}
        freed = {g: 0 for g in self.host}
        keep = {id(n) for n in protect}
        heap = self._host_lru
        spared: list[Node] = []
        while heap and any(freed[g] < k for g, k in need.items()):
            key, n = heapq.heappop(heap)
            if self._nodes.get(n.node_id) is not n or key != self._lru_key(n):
                continue
            if id(n) in keep or (host_only and n.state == "backed"):
                spared.append(n)  # spared this time only: a candidate again after this call
                continue
            if not self._host_victim(n, keep):
                continue
            got = self._release_host(n)
            if n.state == "host":
                self._trigger(n, "evict_host")
                self._remove(n)
                self.stats.host_evictions += 1
            else:
                self._trigger(n, "drop_host")
                self.stats.host_drops += 1
            for g, k in got.items():
                freed[g] += k
        for n in spared:  # protected this time only: candidates again
            self._touch(n)
        return freed

    def _host_victim(self, n: Node, keep: set[int]) -> bool:
        return (n.state in ("host", "backed") and n.host_pin == 0 and not n.has_host_child
                and id(n) not in keep and (n.state == "backed" or n.lock_ref == 0))

    # ------------------------------------------------------------------ loadback
    def load(self, match: MatchResult, owner: str | None = None, *, evict: bool = True,
             extra: Mapping[str, int] | None = None) -> LoadResult:
        """Load back the host part of ``match`` (all or nothing; invariant 11).

        Pins the host copies first (invariant 4), then allocates device pages (evicting
        if allowed), then moves the nodes to ``loading`` and returns the command. Nodes
        already loading are joined: the caller gets its own pin on them and waits for
        their operation. The caller's lock covers the whole hit. ``extra`` (group -> pages)
        allocates the caller's own pages in the same all-or-nothing reservation
        (returned in :attr:`LoadResult.extra`).

        Raises:
            KvtierError: no host tier, or ``match`` needs no loadback.
            CapacityError: device pages short after eviction; nothing changed.
        """
        if self.host is None or not match.needs_loadback:
            raise KvtierError("load: the match has no host hit to load back")
        host_nodes = list(match.host_nodes)
        joined = list(match.joined_nodes)
        stale = [n.node_id for n in host_nodes if n.state != "host" or n.node_id not in self._nodes]
        stale += [n.node_id for n in joined if n.state != "loading"]
        # the hit must still hang together: a split or a demotion since the match breaks the chain
        prev = match.device_node
        if prev is not self.root and (prev.state not in DEVICE_READABLE or prev.node_id not in self._nodes):
            stale.append(prev.node_id)
        for n in sorted(joined + host_nodes, key=lambda x: x.depth):
            if n.parent is not prev:
                stale.append(n.node_id)
            prev = n
        if stale:
            raise KvtierError(f"load: match is stale (nodes {stale} changed state or were split since the match)")
        terminal = match.terminal
        pin = self._take("pin", joined + host_nodes, owner)
        protect = match.device_node.path()
        for n in protect:  # keep the device part of the hit out of the eviction below
            n.lock_ref += 1
        need = {g: 0 for g in self.device}
        for n in host_nodes:
            for g in self._history:
                need[g] += len(n.host.get(g, ()))
        ckpt_node = terminal if (self._state and terminal in host_nodes
                                 and self._has_checkpoint(terminal.host_state)) else None
        if ckpt_node is not None:
            for g in self._state:
                need[g] += len(ckpt_node.host_state[g])
        if extra:
            self._check_need(extra)
            for g, k in extra.items():
                need[g] += k
        try:
            short = {g: k - self.device[g].free for g, k in need.items() if k > self.device[g].free}
            if short and evict:
                self.evict_device(short)
        finally:
            for n in protect:
                n.lock_ref -= 1
                self._touch(n)
        if any(k > self.device[g].free for g, k in need.items()):
            g = next(g for g, k in need.items() if k > self.device[g].free)
            free = self.device[g].free
            self.release(pin)
            raise CapacityError("device", g, need[g], free)
        command = None
        op_ids = sorted({n.lb_op for n in joined if n.lb_op is not None})
        if host_nodes:
            op_id = next(self._op_ids)
            transfers: dict[str, tuple[list[int], list[int]]] = {}
            for n in host_nodes:
                for g in self._history:
                    src = n.host.get(g, [])
                    dst = self.device[g].alloc(len(src))
                    n.dev[g] = dst
                    s, d = transfers.setdefault(g, ([], []))
                    s.extend(src)
                    d.extend(dst)
                n.lb_op = op_id
                self._trigger(n, "loadback_submit")
            if ckpt_node is not None:
                for g in self._state:
                    src = ckpt_node.host_state[g]
                    dst = self.device[g].alloc(len(src))
                    ckpt_node.dev_state[g] = dst
                    s, d = transfers.setdefault(g, ([], []))
                    s.extend(src)
                    d.extend(dst)
            command = self._command(op_id, Direction.LOADBACK, transfers, owner, host_nodes)
            op = Operation(command, list(host_nodes), ckpt_node)
            for n in host_nodes:
                n.host_pin += 1  # the operation's own pin, released when it settles
            self._ops[op_id] = op
            self._outbox.append(command)
            op_ids.append(op_id)
            self.stats.loadbacks += 1
            self.stats.pages_loaded += command.pages
        if joined:
            self.stats.joined_loadbacks += 1
        own = {g: self.device[g].alloc(k) for g, k in (extra or {}).items() if k > 0}
        for g, pages in own.items():
            self._external[g].update(pages)
        lock = self.lock(terminal, owner)
        return LoadResult(command, tuple(op_ids), pin, lock, self.device_pages(terminal), own)

    def _command(self, op_id: int, direction: Direction, transfers: Mapping[str, tuple[list[int], list[int]]],
                 owner: str | None, nodes: Sequence[Node]) -> TransferCommand:
        deadline = self.step + self.op_deadline_steps if self.op_deadline_steps else None
        return TransferCommand(
            op_id=op_id, direction=direction,
            transfers=tuple(GroupTransfer(g, tuple(s), tuple(d)) for g, (s, d) in transfers.items() if s),
            layers=self._all_layers, request_id=owner, node_ids=tuple(n.node_id for n in nodes),
            deadline_step=deadline)

    # ------------------------------------------------------------------ writeback
    def writeback(self, node: Node, owner: str | None = None) -> TransferCommand | None:
        """Write back, as one operation owned by ``owner``, every node on the path to
        ``node`` that is only on the device and whose parent is (or will be, in the same
        operation) on the host; nodes behind a writeback in flight elsewhere are queued
        as tree writebacks instead (invariant 1). Host pages are reserved all or nothing,
        evicting unpinned host leaves off this path if short.

        Returns:
            The command, or ``None`` when nothing needs writing (or the host is full).

        Raises:
            KvtierError: ``node`` is not a node of this cache's tree (nothing changes).
        """
        self._tree_nodes("writeback", [node])
        if self.host is None:
            return None
        # The device-only nodes of a path are consecutive and end it (the device set is
        # root-closed, and a host-visible or writing node's parent is host-visible or in the
        # same writeback), so the run is that chain, when its first node's parent is the root
        # or on the host; behind a writeback in flight elsewhere it waits in the tree queue.
        run: list[Node] = []
        for n in reversed(node.path()):
            if n.state != "device":
                continue
            p = n.parent
            assert p is not None
            if run or p.parent is None or p.state in HOST_VISIBLE:
                run.append(n)
            else:
                self._wb_queue[n.node_id] = n
        if not run:
            return None
        return self._submit_writeback(run, owner)

    def _submit_writeback(self, run: list[Node], owner: str | None, host_only: bool = False) -> TransferCommand | None:
        assert self.host is not None
        need: dict[str, int] = {}
        for n in run:
            for g, pages in itertools.chain(n.dev.items(), n.dev_state.items()):
                need[g] = need.get(g, 0) + len(pages)
        short = {g: k - self.host[g].free for g, k in need.items() if k > self.host[g].free}
        if short:  # never the run's ancestors: their host copies are what the run hangs from (invariant 1)
            self.evict_host(short, protect=[a for n in run for a in n.path()], host_only=host_only)
        if any(k > self.host[g].free for g, k in need.items()):
            return None
        op_id = next(self._op_ids)
        transfers: dict[str, tuple[list[int], list[int]]] = {}
        for n in run:
            n.wb_op = op_id
            for attr_src, attr_dst in (("dev", "pending"), ("dev_state", "pending_state")):
                src_map: PageMap = getattr(n, attr_src)
                dst_map: PageMap = {}
                for g, src in src_map.items():
                    dst = self.host[g].alloc(len(src))
                    dst_map[g] = dst
                    s, d = transfers.setdefault(g, ([], []))
                    s.extend(src)
                    d.extend(dst)
                setattr(n, attr_dst, dst_map)
            self._trigger(n, "writeback_submit")
            self._wb_queue.pop(n.node_id, None)
            self._wb_refused.discard(n.node_id)
        command = self._command(op_id, Direction.WRITEBACK, transfers, owner, run)
        self._ops[op_id] = Operation(command, list(run))
        self._outbox.append(command)
        self.stats.writebacks += 1
        self.stats.pages_written += command.pages
        return command

    def issue_writebacks(self, limit: int | None = None) -> list[TransferCommand]:
        """Submit queued tree writebacks whose parent is on the host, at most ``limit``
        operations. Every such node goes into one batched operation (one command, one
        ack: fewer, larger copies); if the host cannot hold the batch, nodes are submitted
        one by one and those that still do not fit leave the queue. Nodes whose parent is
        not yet on the host stay queued (invariant 1); nodes whose parent is only on the
        device and not queued leave it.
        """
        if self.host is None:
            self._wb_queue.clear()
            return []
        if limit is not None and limit < 1:
            return []
        ready: list[Node] = []
        # (every queued node is a device node of the tree: submitting a writeback and
        # removing a node both take it out of the queue)
        for n in sorted(self._wb_queue.values(), key=lambda x: (x.depth, x.node_id)):
            p = n.parent
            assert p is not None
            if p.parent is None or p.state in HOST_VISIBLE:
                ready.append(n)
            elif p.state == "device" and p.node_id not in self._wb_queue:
                self._wb_queue.pop(n.node_id, None)  # parent will not be written: drop (invariant 1)
        if not ready:
            return []
        # under write_back a writeback exists to let a device copy go: taking another node's
        # host copy for it (making that one device-only again) would only move the problem
        host_only = self.policy is WritePolicy.WRITE_BACK
        cmd = self._submit_writeback(ready, None, host_only)
        if cmd is not None:
            return [cmd]
        out: list[TransferCommand] = []
        for n in ready:  # (still device nodes: host eviction below only touches host copies)
            if limit is not None and len(out) >= limit:
                break
            p = n.parent
            assert p is not None
            if not (p.parent is None or p.state in HOST_VISIBLE):
                continue  # an earlier submission's host eviction took the parent's copy: wait
            one = self._submit_writeback([n], None, host_only)
            if one is None:
                self._wb_queue.pop(n.node_id, None)  # host full: give up on this node
                self._wb_refused.add(n.node_id)
                self._touch(n)  # an eviction candidate again (write_back now drops it)
            else:
                out.append(one)
        return out

    def queued_writebacks(self) -> list[int]:
        """Node ids waiting for a tree writeback."""
        return sorted(self._wb_queue)

    def poll_commands(self) -> list[TransferCommand]:
        """Commands created since the last poll (loadbacks first), for the transfer engine."""
        out = sorted(self._outbox, key=lambda c: (c.direction is not Direction.LOADBACK, c.op_id))
        self._outbox.clear()
        return out

    # ------------------------------------------------------------------ completions
    def complete(self, completion: Completion) -> list[Settled | LayerProgress]:
        """Take one rank's completion for an operation.

        Layer completions of a loadback are tracked per rank; a :class:`LayerProgress`
        is returned when every rank has reached a new layer. The acknowledgement
        (``layer=None``) settles the operation once every rank has sent it, successfully
        only if all succeeded: a :class:`Settled` is returned. A completion for an
        operation its deadline already failed is absorbed and counted (invariant 7).

        Raises:
            UnknownOperation: the op id was never issued, or already settled.
            DuplicateCompletion: the same (op, rank, layer) arrived twice.
            ConfigError: rank out of range, or a layer on a writeback.
            Nothing changes when it raises.
        """
        if not isinstance(completion, Completion):
            raise ConfigError(f"complete() takes a Completion, got {completion!r}")
        op = self._ops.get(completion.op_id)
        if op is None:
            if completion.op_id in self._expired:
                self.stats.absorbed_late_completions += 1
                return []
            state = "already settled" if completion.op_id in self._settled else "never issued"
            raise UnknownOperation(f"completion for op {completion.op_id}: {state}")
        if not (0 <= completion.rank < self.world_size):
            raise ConfigError(f"completion for op {completion.op_id}: rank {completion.rank} "
                              f"outside world size {self.world_size}")
        key = (completion.rank, completion.layer)
        if key in op.seen or completion.rank in op.acked:
            raise DuplicateCompletion(f"op {completion.op_id}: completion from rank {completion.rank} "
                                      f"layer {completion.layer} arrived twice (or after its ack)")
        if completion.layer is not None:
            if op.direction is not Direction.LOADBACK:
                raise ConfigError(f"op {completion.op_id} is a writeback: layer completions are for loadbacks")
            if completion.layer not in self._all_layers:
                raise ConfigError(f"op {completion.op_id}: layer {completion.layer} outside 0..{self.layout.num_layers - 1}")
            op.seen.add(key)
            before = min(op.layers.get(r, -1) for r in range(self.world_size))
            op.layers[completion.rank] = max(op.layers.get(completion.rank, -1), completion.layer)
            if not completion.ok:
                op.ok = False
            after = min(op.layers.get(r, -1) for r in range(self.world_size))
            if after > before:
                for n in op.nodes:
                    self._trigger(n, "loadback_layer_done")
                return [LayerProgress(op.op_id, after)]
            return []
        op.seen.add(key)
        op.acked.add(completion.rank)
        if not completion.ok:
            op.ok = False
        if len(op.acked) < self.world_size:
            return []
        return [self._settle(op, op.ok)]

    def _settle(self, op: Operation, ok: bool, expired: bool = False) -> Settled:
        assert self.host is not None
        del self._ops[op.op_id]
        self._settled.add(op.op_id)
        if op.direction is Direction.WRITEBACK:
            for n in reversed(op.nodes):  # deepest first
                if ok:
                    n.host, n.pending = n.pending, {}
                    n.host_state, n.pending_state = n.pending_state, {}
                    n.wb_op = None
                    self._trigger(n, "writeback_ack")
                else:
                    for g, pages in itertools.chain(n.pending.items(), n.pending_state.items()):
                        self.host[g].release(pages)
                    n.pending, n.pending_state = {}, {}
                    n.wb_op = None
                    self._trigger(n, "writeback_fail")
            if not ok:
                self.stats.writeback_failures += 1
                # queued children of a failed node would break invariant 1: drop them
                failed = {id(n) for n in op.nodes}
                for nid, q in list(self._wb_queue.items()):
                    if q.parent is not None and id(q.parent) in failed:
                        del self._wb_queue[nid]
        else:
            for n in reversed(op.nodes):
                n.host_pin -= 1
                n.lb_op = None
                if ok:
                    self._trigger(n, "loadback_ack")
                else:
                    for g, pages in n.dev.items():
                        self.device[g].release(pages)
                    n.dev = {}
                    if n is op.checkpoint:
                        for g, pages in n.dev_state.items():
                            self.device[g].release(pages)
                        n.dev_state = {}
                    self._trigger(n, "loadback_fail")
            if not ok:
                self.stats.loadback_failures += 1
        return Settled(op.op_id, op.direction, ok, op.command.request_id,
                       tuple(n.node_id for n in op.nodes), expired)

    def poison(self, op_id: int) -> None:
        """Make operation ``op_id`` fail whatever its ranks report (an aborted request's
        own writeback: possibly-corrupt KV is never published).

        Raises:
            UnknownOperation: the op is not in flight.
        """
        op = self._ops.get(op_id)
        if op is None:
            raise UnknownOperation(f"poison: op {op_id} is not in flight")
        op.ok = False

    def advance_step(self, steps: int = 1) -> list[Settled]:
        """Advance the scheduler step; fail every operation whose deadline passed
        (invariant 7). Their late real completions are absorbed later.

        Raises:
            ConfigError: ``steps`` is not an int >= 1.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"advance_step: steps must be an int >= 1, got {steps!r}")
        self.step += steps
        out = []
        for op in sorted(self._ops.values(), key=lambda o: o.op_id):
            dl = op.command.deadline_step
            if dl is not None and self.step > dl:
                self._expired.add(op.op_id)
                self.stats.expired_ops += 1
                out.append(self._settle(op, False, expired=True))
        return out

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Verify every invariant; raises :class:`InvariantViolation` naming it and the node."""
        from .invariants import check_cache

        check_cache(self)
