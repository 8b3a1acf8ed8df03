"""The node core: a tiered radix prefix cache whose every residency change is a lifecycle
event (sans-I/O).

:class:`CacheCore` validates its configuration, builds the state its parts share (a
:class:`~kvtier.fsm.node.store.NodeStore`: the radix tree, the page ledger, receipts, the
eviction index, the writeback queue and the operation table) and the parts, each with one
job and the store plus the sibling parts it calls: reclaiming pages
(:mod:`~kvtier.fsm.node.reclaim`), loadbacks and writebacks (:mod:`~kvtier.fsm.node.transfers`),
publishing (:mod:`~kvtier.fsm.node.publish`), L3 gets (:mod:`~kvtier.fsm.node.fetch`) and the
invariants (:mod:`~kvtier.fsm.node.invariants`); its public methods check their arguments and
delegate. Node events fire through the machine built from the spec
(:func:`kvtier.fsm.lifecycle.machines.node_lifecycle`); the core validates before it commits,
and does nothing inside ``transitions`` callbacks. It talks to the outside only through the
:class:`TransferCommand` records it returns and the :class:`Completion` records it takes.

Units: a *unit* is ``layout.alignment`` tokens; keys are sequences of unit keys (any
hashable: a tuple of that many token ids, or a block hash). Pages are per cache group.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from ..checks import as_bool, as_int, check_hashable, check_key_sequence
from ..errors import CapacityError, ConfigError, UsageError
from ..layout import CacheLayout
from ..lifecycle.names import DEVICE_RESIDENT, HOST_VISIBLE
from ..records import Completion, Direction, TransferCommand
from .eviction import EvictionPolicy
from .fetch import FetchTable
from .invariants import check_cache
from .ledger import PageLedger, as_capacity
from .match import MatchMode, MatchResult, find_match, has_checkpoint, match_mode
from .node import LockReceipt, Node, NodeReceipt, PageMap
from .ops import LayerProgress, Operation, Settled
from .pages import PageAllocator
from .publish import Publisher
from .reclaim import Reclaimer
from .results import InsertResult, LoadResult
from .store import NodeStore
from .transfers import Mover
from .writeback import WritePolicy

__all__ = ["CacheCore"]


class CacheCore:
    """A radix prefix cache whose nodes carry device and host copies of several cache groups.

    Args:
        layout: the model's cache groups (:class:`CacheLayout`).
        device_pages: device capacity: units of history (int; state groups sized by
            :func:`kvtier.fsm.node.ledger.units_to_pages`) or pages per group (mapping).
        host_pages: host capacity likewise, or ``None`` for no host tier: then kvtier is a
            plain device prefix cache and does no transfer bookkeeping at all.
        policy: :class:`WritePolicy` (default ``write_through_selective``).
        write_threshold: hit count at which ``write_through_selective`` backs a node up.
        world_size: tensor-parallel ranks that must acknowledge every operation.
        op_deadline_steps: scheduler steps after which an operation fails (``None``: never).
        eviction: eviction policy name (:data:`kvtier.fsm.node.eviction.POLICIES`: ``lru``,
            ``lru_turns``, ``lru2``).
        exclusive: an exclusive host tier: the host keeps what the device does not, so
            host eviction drops duplicate copies first (a loaded-back node gives up its
            host copy when the host needs the room).

    Raises:
        ConfigError: bad capacities, policy, eviction policy, threshold or world size.
    """

    def __init__(self, layout: CacheLayout, device_pages: int | Mapping[str, int],
                 host_pages: int | Mapping[str, int] | None = None, *,
                 policy: WritePolicy | str = WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold: int = 2,
                 world_size: int = 1, op_deadline_steps: int | None = None, eviction: str = "lru",
                 exclusive: bool = False) -> None:
        if not isinstance(layout, CacheLayout):
            raise ConfigError(f"layout must be a CacheLayout (see kvtier.fsm.presets.preset), got {layout!r}")
        self.layout = layout
        self._n_state, self._align = len(layout.state_groups), layout.alignment
        try:
            self.policy = WritePolicy(policy)
        except ValueError:
            raise ConfigError(f"write policy must be one of {[p.value for p in WritePolicy]}, got {policy!r}") from None
        self.write_threshold = as_int(write_threshold, "write_threshold", minimum=1, error=ConfigError)
        self.world_size = as_int(world_size, "world_size", minimum=1, error=ConfigError)
        if op_deadline_steps is not None:
            try:
                op_deadline_steps = as_int(op_deadline_steps, "op_deadline_steps", minimum=1, error=ConfigError)
            except ConfigError:
                raise ConfigError(f"op_deadline_steps must be None or an int >= 1, got {op_deadline_steps!r}") from None
        self.op_deadline_steps = op_deadline_steps
        dev = as_capacity(layout, device_pages, "device_pages")
        host = as_capacity(layout, host_pages, "host_pages") if host_pages is not None else None
        ledger = PageLedger(layout, dev, host)
        #: exclusive host tier: host eviction drops loaded-back duplicate copies first
        self.exclusive = as_bool(exclusive, "exclusive", error=ConfigError) and host is not None
        #: the state the parts share (the tree, pages, receipts, eviction index, queue, operations)
        self.store = store = NodeStore(layout, ledger, policy=self.policy, write_threshold=self.write_threshold,
                                       world_size=self.world_size, op_deadline_steps=op_deadline_steps,
                                       eviction=eviction, exclusive=self.exclusive)
        #: history group names, state group names, and history pages per unit
        self.history_groups, self.ckpt_groups, self.pages_per_unit = (store.history_groups, store.ckpt_groups,
                                                                      store.pages_per_unit)
        # the store's parts, read through the core (the same objects)
        self.tree, self.root, self.ledger, self.device = store.tree, store.root, store.ledger, store.device
        self.receipts, self.writebacks, self.optable, self.stats = (store.receipts, store.writebacks,
                                                                    store.optable, store.stats)
        self._reclaimer = Reclaimer(store)
        self._mover = Mover(store, self._reclaimer)
        self._publisher = Publisher(store)
        #: L3 gets into the host tier (kvtier.fsm.node.fetch: ``reserve`` and ``settle`` them)
        self.fetches = FetchTable(store, self._reclaimer)

    # ------------------------------------------------------------------ the store's replaceable parts
    # (assigned through the core, they change what every part uses: a kit corruption drops
    # the host tier, the vLLM adapter decorates the eviction index, the tensor-parallel
    # cache wraps trigger to fold every node event into its digest)
    @property
    def host(self) -> dict[str, PageAllocator] | None:
        """The host allocators by group (``None``: no host tier)."""
        return self.store.host

    @host.setter
    def host(self, pools: dict[str, PageAllocator] | None) -> None:
        self.store.host = pools

    @property
    def eviction(self) -> EvictionPolicy:
        """The eviction index (:mod:`kvtier.fsm.node.eviction`)."""
        return self.store.eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy) -> None:
        self.store.eviction = policy

    @property
    def trigger(self) -> Callable[[Node, str], None]:
        """The one way every part changes a node's state, ``trigger(node, event)``
        (:meth:`~kvtier.fsm.node.store.NodeStore.trigger`: fire the event through the spec's
        machine, re-file the node and its parent in the eviction index). A callable assigned
        here replaces it for every part; a wrapper must call the one it replaces."""
        return self.store.trigger

    @trigger.setter
    def trigger(self, fire: Callable[[Node, str], None]) -> None:
        self.store.trigger = fire  # type: ignore[method-assign,assignment]

    @property
    def clock(self) -> int:
        """The logical clock (advanced on every use: :meth:`tick`)."""
        return self.store.clock

    # ------------------------------------------------------------------ views
    @property
    def has_host(self) -> bool:
        return self.store.host is not None

    @property
    def alignment(self) -> int:
        return self.layout.alignment

    @property
    def step(self) -> int:
        """Scheduler steps advanced so far (operation deadlines count in them)."""
        return self.optable.step

    def nodes(self) -> list[Node]:
        """Every node in the tree (root excluded)."""
        return list(self.tree)

    def node(self, node_id: int) -> Node:
        """The node with ``node_id``. Raises UsageError if it is not in the tree."""
        return self.tree.node(node_id)

    def operations(self) -> dict[int, Operation]:
        """In-flight operations by op id (a copy)."""
        return self.optable.snapshot()

    def fenced_ops(self) -> tuple[int, ...]:
        """Op ids past their deadline whose copy may still run (spec ``[transfer]``
        ``fenced``): their pages come back once every rank acknowledged them; an engine
        hurries that with ``TransferEngine.cancel`` (invariant ``copy_fence``)."""
        return tuple(op.op_id for op in self.optable.fenced())

    def ops_in_flight(self, direction: Direction | None = None) -> int:
        """Operations in flight (of ``direction`` only, if given)."""
        return self.optable.in_flight(direction)

    def external_pages(self, group: str) -> frozenset[int]:
        """Device pages of ``group`` handed to callers (requests) and not yet published or freed."""
        return self.ledger.caller_pages(group)

    def has_commands(self) -> bool:
        """Whether some command waits for :meth:`poll_commands` (cheaper than
        :meth:`pending_commands`, which copies them)."""
        return bool(self._mover.outbox)

    def pending_commands(self) -> tuple[TransferCommand, ...]:
        """Commands created and not yet handed out by :meth:`poll_commands` (a snapshot)."""
        return self._mover.pending()

    def evictable_on_device(self, node: Node) -> bool:
        """Whether device eviction may take ``node`` now (demote or drop it)."""
        return self._reclaimer.device_victim(node)

    def evictable_on_host(self, node: Node) -> bool:
        """Whether host eviction may take ``node``'s host copy now (nothing protected)."""
        return self._reclaimer.host_victim(node)

    def queued_writebacks(self) -> list[int]:
        """Node ids waiting for a tree writeback."""
        return self.writebacks.node_ids()

    def device_pages(self, node: Node) -> PageMap:
        """The device page table from the root to ``node``'s end: history groups' pages
        along the path, and each state group's checkpoint at ``node`` (if any)."""
        return self.tree.page_table(node, self.history_groups)

    # ------------------------------------------------------------------ plumbing
    def tick(self) -> int:
        """Advance the logical clock; returns the new stamp."""
        return self.store.tick()

    def split(self, node: Node, k: int) -> Node:
        """Split ``node`` after ``k`` units; returns the new prefix fragment
        (:meth:`~kvtier.fsm.node.store.NodeStore.split`)."""
        return self.store.split(node, k)

    def walk(self, key: Sequence[Hashable]) -> list[Node]:
        """Nodes matching ``key`` from the root, splitting the last where the key diverges.

        Raises:
            UsageError: ``key`` not a sequence of unit keys (a str or bytes is refused; nothing changes)."""
        check_key_sequence(key, "walk: key")
        return self.tree.walk(key, self.store.split)

    # ------------------------------------------------------------------ caller pages
    def alloc_device(self, need: Mapping[str, int], *, evict: bool = True) -> PageMap:
        """Allocate device pages for a caller (a request's own pages), all or nothing.

        Args:
            need: group -> pages.
            evict: evict unlocked tree pages (device, then demote) if short.

        Raises:
            CapacityError: still short after eviction; nothing allocated.
            UsageError: unknown group or a count that is not an int >= 0.
        """
        self.ledger.check_need(need)
        return self.alloc_trusted(need, evict=evict)

    def alloc_trusted(self, need: Mapping[str, int], *, evict: bool = True) -> PageMap:
        """:meth:`alloc_device` for a ``need`` the request layer computed (known groups, ints
        >= 0), not checked again. CapacityError: short after eviction (nothing allocated)."""
        if short := self.ledger.device_short(need):
            if evict:
                self._reclaimer.evict_device(short)
            for g, n in need.items():
                if n > self.device[g].free:
                    raise CapacityError("device", g, n, self.device[g].free)
        return self.ledger.alloc_for_callers(need)

    def free_device(self, pages: Mapping[str, Iterable[int]]) -> None:
        """Return a caller's device pages.

        Raises:
            UsageError: a page is not the caller's (tree-owned, free, or unknown); nothing freed.
        """
        self.ledger.free_device(pages)

    # ------------------------------------------------------------------ match
    def match(self, key: Sequence[Hashable], mode: MatchMode | str = MatchMode.PREFIX_REUSE, *,
              history_replay: bool = False) -> MatchResult:
        """Find the usable device hit and, beyond it, the host hit for ``key``
        (:func:`kvtier.fsm.node.match.find_match` says how). Splits the node where the key
        diverges mid-node (semantically invisible).

        Raises:
            UsageError: ``key`` not a sequence of hashable unit keys (a str or bytes is refused: its
                characters are not units), unknown mode, or ``history_replay`` with ``state_recovery``.
        """
        check_key_sequence(key, "match: key")
        check_hashable(key, "match")
        return self.match_trusted(key, match_mode(mode, history_replay), history_replay)

    def match_trusted(self, key: Sequence[Hashable], mode: MatchMode, history_replay: bool) -> MatchResult:
        """:meth:`match` for arguments the caller has checked (the facade checks unit keys
        once at its edge, :func:`kvtier.fsm.checks.as_keys`): ``key`` a list or tuple of
        hashable, comparable unit keys, ``mode`` a :class:`MatchMode` and ``history_replay``
        only with ``prefix_reuse``. Nothing is checked again."""
        return find_match(self.tree.walk_from(self.root, key, self.store.split), self.root, len(key), mode,
                          history_replay=history_replay, has_host=self.store.host is not None, layout=self.layout,
                          n_state=self._n_state, align=self._align)

    # ------------------------------------------------------------------ receipts
    def lock(self, node: Node, owner: str | None = None) -> LockReceipt:
        """Lock ``node`` and its ancestors on the device (a running request uses them).
        Counts a hit (``write_through_selective`` counts hits) and stamps the logical clock.

        Raises:
            UsageError: ``node`` is not a node of this cache's tree (nothing changes).
        """
        if type(node) is not Node or not self.tree.has(node):
            self.tree.members("lock", [node])  # raises, naming the value
        self.store.clock += 1  # (tick)
        return self.receipts.lock(node, owner, self.store.clock)

    def unlock(self, receipt: LockReceipt) -> None:
        """Release a lock receipt exactly once.

        Raises:
            UsageError: the receipt was already released or is not this cache's (invariant ``counts_with_receipts``).
        """
        store = self.store
        self.receipts.unlock(receipt, store.clock + 1)  # (checks the receipt first, then stamps)
        store.clock += 1  # (tick: only once it was released)

    def borrow(self, nodes: Sequence[Node], owner: str | None = None) -> NodeReceipt:
        """Borrow device pages of ``nodes`` (a request reads them; invariant ``borrowed_pages_stay``).

        Raises:
            UsageError: no nodes, a value that is not a node of this tree, or a node
                without device pages (nothing changes).
        """
        nodes = self.tree.members("borrow", nodes)
        bad = [n.node_id for n in nodes if n.state not in DEVICE_RESIDENT]
        if bad:
            raise UsageError(f"borrow: nodes {bad} have no device pages")
        return self.receipts.take("borrow", nodes, owner)

    def pin(self, nodes: Sequence[Node], owner: str | None = None) -> NodeReceipt:
        """Pin the host copies of ``nodes`` (invariant ``loadback_source_pinned``).

        Raises:
            UsageError: no nodes, a value that is not a node of this tree, or a node
                without a visible host copy (nothing changes).
        """
        nodes = self.tree.members("pin", nodes)
        bad = [n.node_id for n in nodes if n.state not in HOST_VISIBLE]
        if bad:
            raise UsageError(f"pin: nodes {bad} have no visible host copy")
        return self.receipts.take("pin", nodes, owner)

    def release(self, receipt: NodeReceipt) -> None:
        """Release a pin or borrow receipt exactly once.

        Raises:
            UsageError: already released or unknown (invariant ``counts_with_receipts``).
        """
        self.receipts.release(receipt)

    # ------------------------------------------------------------------ insert
    def insert(self, key: Sequence[Hashable], pages: Mapping[str, Sequence[int]],
               checkpoint: Mapping[str, Sequence[int]] | None = None, *,
               chunk_checkpoint: bool = False, anchor: Node | None = None) -> InsertResult:
        """Publish a computed prefix (:meth:`kvtier.fsm.node.publish.Publisher.insert` says how;
        ``anchor``: a locked node on the key's path to start the walk from).

        Raises:
            UsageError: a bad key (a str or bytes is refused), wrong page counts, unknown groups, or
                pages that are neither the caller's nor the canonical ones for their range (nothing changes).
        """
        return self._publisher.insert(key, pages, checkpoint, chunk_checkpoint=chunk_checkpoint, anchor=anchor)

    def insert_trusted(self, key: Sequence[Hashable], pages: PageMap, anchor: Node, *,
                       chunk_checkpoint: bool = False) -> InsertResult:
        """:meth:`insert` without a checkpoint for arguments the request layer vouches for
        (:meth:`kvtier.fsm.node.publish.Publisher.insert_trusted` says which): nothing is checked again."""
        return self._publisher.insert_trusted(key, pages, anchor, chunk_checkpoint)

    # ------------------------------------------------------------------ eviction
    def evict_device(self, need: Mapping[str, int]) -> dict[str, int]:
        """Free device pages from unlocked, unborrowed device leaves in eviction order
        (:meth:`kvtier.fsm.node.reclaim.Reclaimer.evict_device` says how).

        Returns:
            group -> pages actually freed (may be less than asked).

        Raises:
            UsageError: unknown group or a count that is not an int >= 0.
        """
        self.ledger.check_need(need)
        return self._reclaimer.evict_device(need)

    def evict_host(self, need: Mapping[str, int], *, protect: Iterable[Node] = (),
                   host_only: bool = False) -> dict[str, int]:
        """Free host pages from host leaves with pin 0 in eviction order (invariant ``host_evict_leaves``;
        :meth:`kvtier.fsm.node.reclaim.Reclaimer.evict_host` says how).

        Returns:
            group -> host pages actually freed.

        Raises:
            UsageError: unknown group or a count that is not an int >= 0 (nothing changes).
        """
        return self._reclaimer.evict_host(need, protect=protect, host_only=host_only)

    def drop_device_checkpoint(self, node: Node) -> None:
        """Free ``node``'s device checkpoint (a chunk checkpoint a deeper one replaced)."""
        self._publisher.drop_device_checkpoint(node)

    # ------------------------------------------------------------------ loadback
    def load(self, match: MatchResult, owner: str | None = None, *, evict: bool = True,
             extra: Mapping[str, int] | None = None) -> LoadResult:
        """Load back the host part of ``match``, all or nothing (invariant ``atomic_admission``); see
        :meth:`kvtier.fsm.node.transfers.Mover.load`.

        Raises:
            UsageError: no host tier, the match needs no loadback, it is stale, or a bad ``extra``.
            CapacityError: device pages short after eviction; nothing changed.
        """
        return self._mover.load(match, owner, evict=evict, extra=extra)

    # ------------------------------------------------------------------ writeback
    def writeback(self, node: Node, owner: str | None = None) -> TransferCommand | None:
        """Write back, as one operation owned by ``owner``, the device-only nodes on the
        path to ``node`` (:meth:`kvtier.fsm.node.transfers.Mover.writeback` says which).

        Returns:
            The command, or ``None`` when nothing needs writing (or the host is full).

        Raises:
            UsageError: ``node`` is not a node of this cache's tree (nothing changes).
        """
        if type(node) is not Node or not self.tree.has(node):
            self.tree.members("writeback", [node])  # raises, naming the value
        return self._mover.writeback(node, owner) if self.store.host is not None else None

    def issue_writebacks(self, limit: int | None = None) -> list[TransferCommand]:
        """Submit queued tree writebacks whose parent is on the host, at most ``limit``
        operations (:meth:`kvtier.fsm.node.transfers.Mover.issue_writebacks` says how)."""
        return self._mover.issue_writebacks(limit)

    def poll_commands(self) -> list[TransferCommand]:
        """Commands created since the last poll (loadbacks first), for the transfer engine."""
        return self._mover.poll()

    # ------------------------------------------------------------------ completions
    def complete(self, completion: Completion) -> list[Settled | LayerProgress]:
        """Take one rank's completion for an operation.

        Layer completions of a loadback are tracked per rank; a :class:`LayerProgress` is
        returned when every rank has reached a new layer. The acknowledgement
        (``layer=None``) settles the operation once every rank has sent it, successfully
        only if all succeeded: a :class:`Settled` is returned. A completion for an
        operation that already settled (a late one after its deadline, or a duplicate) is
        absorbed and counted (invariant ``operation_ends_once``). Nothing changes when it raises.

        Raises:
            UnknownOperation: the op id was never issued.
            DuplicateCompletion: the same (op, rank, layer) arrived twice while in flight.
            UsageError: not a Completion, rank out of range, or a layer on a writeback.
        """
        if not isinstance(completion, Completion):
            raise UsageError(f"complete() takes a Completion, got {completion!r}")
        return self._mover.complete(completion)

    def poison(self, op_id: int) -> None:
        """Make operation ``op_id`` fail whatever its ranks report (an aborted request's
        own writeback: possibly-corrupt KV is never published). UnknownOperation: not in flight."""
        self.optable.poison(op_id)

    def withdraw(self, op_id: int) -> Settled | None:
        """Take back an operation whose command :meth:`poll_commands` has not handed out
        yet: it fails at once (no byte moved, no completion will come) and the command
        is never handed out. An aborted request's own writeback, which would only be
        discarded.

        Returns:
            Its :class:`Settled` (``ok=False``), or ``None`` when the command was already
            handed out (or the op is not in flight): poison it instead.
        """
        return self._mover.withdraw(op_id)

    def advance_step(self, steps: int = 1) -> list[Settled]:
        """Advance the scheduler step; fail every operation whose deadline passed
        (invariant ``operation_ends_once``). One whose command was handed out is fenced:
        its pages stay held until every rank's late acknowledgement arrives (which is
        otherwise absorbed; invariant ``copy_fence``, :meth:`fenced_ops`).

        Raises:
            UsageError: ``steps`` is not an int >= 1.
        """
        return self._mover.expire(as_int(steps, "advance_step: steps", minimum=1))

    # ------------------------------------------------------------------ checks
    def has_checkpoint(self, ckpt: PageMap) -> bool:
        """Whether a node's checkpoint map covers every state group."""
        return has_checkpoint(ckpt, len(self.ckpt_groups))

    def check_invariants(self) -> None:
        """Verify every invariant; raises :class:`InvariantViolation` naming it and the node."""
        check_cache(self.store)
        self.fetches.check()

