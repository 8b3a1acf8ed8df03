"""Request records: the request lifecycle's subject and the records that cross the facade.

:class:`Request` is the one mutable record per request (held by
:class:`kvtier.fsm.request.table.RequestTable`); engines see it only through the frozen
:class:`RequestView`. :data:`CALLS` and :data:`TERMINAL` are derived from the spec
(``[request.calls]`` and the states with no outgoing transition).

Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..node.node import LockReceipt, NodeReceipt, PageMap
from ..records import TransferCommand
from ..lifecycle.spec import load_spec

__all__ = ["Request", "Admission", "RequestEvent", "PollResult", "RequestView", "Outstanding", "CALLS", "TERMINAL"]

_SPEC = load_spec().request
#: facade call -> the request states in which it is accepted (spec ``[request.calls]``).
CALLS: dict[str, frozenset[str]] = {call: frozenset(states) for call, states in _SPEC.calls.items()}
#: request states with no outgoing transition (``finished``, ``aborted``).
TERMINAL: frozenset[str] = frozenset(
    s for s in _SPEC.state_names if not any(t.source == s for t in _SPEC.transitions))


@dataclass(frozen=True, slots=True)
class Admission:
    """What the forward pass of a newly admitted (or resumed) request needs.

    Attributes:
        request_id: the request.
        start_token: first token to compute (tokens before it are a prefix hit).
        chunk_tokens: tokens reserved for the first chunk.
        hit_tokens: prefix-hit tokens (device + host).
        device_hit_tokens: of which already on the device.
        page_table: group -> device page ids: history groups cover tokens
            ``0 .. start_token + chunk_tokens``; state groups hold the request's working
            state pages (initialised from the checkpoint at ``start_token`` on a hit).
        loadback_op: the op id of the loadback this admission started, or ``None``. Its
            command is handed out by :meth:`kvtier.TieredCache.poll` (the one place every
            command comes from): poll and submit before the forward pass.
        wait_ops: loadback ops the forward pass must wait on layer by layer (its own and
            any it joined).
        recompute_tokens: with history replay, tokens before ``start_token`` recomputed
            to rebuild continuation state (already excluded from ``hit_tokens``).
        history_hit_tokens: the history-only bound: tokens a hit would cover if exact
            continuation state were not required (equals ``hit_tokens`` without state groups).
        checkpoint_pages: state group -> device pages of the continuation-state checkpoint
            at ``start_token`` (copy it into the working state pages); empty without one.
    """

    request_id: str
    start_token: int
    chunk_tokens: int
    hit_tokens: int
    device_hit_tokens: int
    page_table: PageMap
    loadback_op: int | None
    wait_ops: tuple[int, ...]
    recompute_tokens: int = 0
    history_hit_tokens: int = 0
    checkpoint_pages: PageMap = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A request changed state (the engine tells its client when it ended).

    Attributes:
        request_id: the request.
        state: its new request-lifecycle state.
        reason: why it was aborted (scheduler aborts included), else ``None``.
    """

    request_id: str
    state: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class PollResult:
    """What :meth:`kvtier.TieredCache.poll` hands the engine.

    Attributes:
        commands: transfer commands to submit now (loadbacks first).
        events: request state changes since the last poll, in order.
    """

    commands: tuple[TransferCommand, ...]
    events: tuple[RequestEvent, ...]


@dataclass(frozen=True, slots=True)
class RequestView:
    """A read-only summary of one request (for schedulers, tests and reports).

    Attributes:
        request_id, state, reason: as the request lifecycle has them.
        tokens: tokens whose KV exists (hit + computed).
        reserved_tokens: tokens its page table covers.
        hit_tokens: prefix-hit tokens of its last admission.
        owed_forward: forward passes reserved whose result has not come back.
        ops: operations it waits on (its loadbacks, joined ones, its own writeback).
        settled: no forward result and no operation owed.
        own_pages: group -> its own device pages (a copy).
        deferred_pages: group -> pages it let go of whose free waits for an earlier pass.
        receipts: ids of the lock, pin and borrow receipts it holds.
        units: unit keys known for it.
    """

    request_id: str
    state: str
    tokens: int
    reserved_tokens: int
    hit_tokens: int
    owed_forward: int
    ops: tuple[int, ...]
    reason: str | None
    settled: bool = True
    own_pages: PageMap = field(default_factory=dict)
    deferred_pages: PageMap = field(default_factory=dict)
    receipts: tuple[int, ...] = ()
    units: int = 0


@dataclass(frozen=True, slots=True)
class Outstanding:
    """What a cache still holds or owes (:meth:`kvtier.TieredCache.outstanding`), counted
    from the core's and the request table's public views in O(requests + operations +
    receipts + caller pages), never O(capacity).

    Attributes:
        requests: ids of the requests it tracks (live, or ended and not yet reported by
            ``poll``), sorted.
        owed_forward: forward results owed, over every request.
        operations: op ids of the operations in flight (handed out or not), sorted.
        commands: op ids of those whose command ``poll`` has not handed out yet.
        events: request events ``poll`` has not reported yet.
        locks: lock receipts held (requests' locks on tree paths).
        pins: pin receipts held by requests (an operation's own pin is the operation's).
        borrows: borrow receipts held (a hit's checkpoint until its pass returns).
        caller_pages: device pages held outside the tree (requests' own and deferred
            pages), summed over groups.
        queued_writebacks: tree nodes waiting for a tree writeback (cache work, not a
            leak: not part of :attr:`quiescent`).
        fenced: op ids of the operations past their deadline whose copy may still run:
            their pages stay fenced until every rank's engine confirms the copy ended
            (a late acknowledgement, e.g. after ``TransferEngine.cancel``), sorted.
        reserved_pages: host pages reserved by L3 gets in flight (``fetching`` nodes),
            summed over groups.
        store_operations: op ids of the L3 tier's store operations in flight (exists,
            get, put, remove; the facade's ``l3``), sorted.
        store_commands: op ids of those ``l3.poll_commands`` has not handed out yet.
        prefetches: requests with an L3 prefetch in flight, sorted.
    """

    requests: tuple[str, ...]
    owed_forward: int
    operations: tuple[int, ...]
    commands: tuple[int, ...]
    events: int
    locks: int
    pins: int
    borrows: int
    caller_pages: int
    queued_writebacks: int = 0
    fenced: tuple[int, ...] = ()
    reserved_pages: int = 0
    store_operations: tuple[int, ...] = ()
    store_commands: tuple[int, ...] = ()
    prefetches: tuple[str, ...] = ()

    @property
    def quiescent(self) -> bool:
        """Nothing held or owed: no request tracked, no forward result, operation (fenced
        ones included), command or event outstanding, no receipt, no device page held
        outside the tree, no host page reserved and nothing in flight or unpolled on the
        L3 tier."""
        return not (self.requests or self.owed_forward or self.operations or self.commands or self.events
                    or self.locks or self.pins or self.borrows or self.caller_pages or self.fenced
                    or self.reserved_pages or self.store_operations or self.store_commands or self.prefetches)


class Request:
    """The core's record of one request; the request lifecycle's subject.

    Attributes:
        request_id: the id; ``state``: its request-lifecycle state.
        units: unit keys (prompt's full units, then decode units).
        prompt_tokens, tokens, reserved: prompt length; tokens with KV; tokens its table covers.
        canon: history group -> canonical tree pages of its published/hit units (held by ``lock``).
        own: group -> its own device pages (history tail, working state).
        published: units published into the tree (or hit).
        lock, pins, ckpt_borrow: its receipts on the tree (``ckpt_borrow``: the hit's
            checkpoint ``ckpt_pages``, until the pass that copies it returns).
        ops: operations it waits on; layers: loadback op -> highest complete layer.
        passes, results: forward passes reserved / returned since it was created.
        deferred: FIFO of (passes reserved when the pages left its table, pages): freed once
            that many results have come back (an overlapped pass may still read them).
        layers_failed: a loadback it waited on failed: no layer is readable.
        poisoned: its own writebacks are treated as failed (aborted).
        room: tokens the history pages of its table cover (reserve's fast path).
    """

    __slots__ = ("request_id", "state", "units", "prompt_tokens", "tokens", "reserved", "canon", "own",
                 "published", "lock", "pins", "ops", "passes", "results", "reason", "has_loadback",
                 "has_own_writeback", "hit_tokens", "layers", "layers_failed", "poisoned", "retract_ckpt",
                 "room", "ckpt_borrow", "ckpt_pages", "deferred")

    def __init__(self, request_id: str, units: list[Hashable], prompt_tokens: int) -> None:
        self.request_id = request_id
        self.state = _SPEC.initial
        self.units = units
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        self.reserved = 0
        self.canon: PageMap = {}
        self.own: PageMap = {}
        self.published = 0
        self.lock: LockReceipt | None = None
        self.pins: list[NodeReceipt] = []
        self.ops: set[int] = set()
        self.passes = 0
        self.results = 0
        self.reason: str | None = None
        self.has_loadback = False
        self.has_own_writeback = False
        self.hit_tokens = 0
        self.layers: dict[int, int] = {}
        self.layers_failed = False
        self.poisoned = False
        self.retract_ckpt = False
        self.room = 0
        self.ckpt_borrow: NodeReceipt | None = None
        self.ckpt_pages: PageMap = {}
        self.deferred: deque[tuple[int, PageMap]] = deque()

    @property
    def label(self) -> str:
        return repr(self.request_id)

    @property
    def owed_forward(self) -> int:
        """Forward passes reserved whose result has not come back."""
        return self.passes - self.results

    @property
    def settled(self) -> bool:
        """The ``settled`` guard: no forward result and no operation owed."""
        return self.passes == self.results and not self.ops

    def receipts(self) -> tuple[int, ...]:
        """Ids of the receipts it holds (lock, pins, checkpoint borrow)."""
        out = [p.receipt_id for p in self.pins]
        if self.lock is not None:
            out.append(self.lock.receipt_id)
        if self.ckpt_borrow is not None:
            out.append(self.ckpt_borrow.receipt_id)
        return tuple(sorted(out))

    def deferred_pages(self) -> PageMap:
        """Group -> pages whose free waits for an earlier pass (a new dict)."""
        out: PageMap = {}
        for _, pages in self.deferred:
            for g, p in pages.items():
                out.setdefault(g, []).extend(p)
        return out

    def view(self) -> RequestView:
        """A frozen summary (copies every list)."""
        return RequestView(self.request_id, self.state, self.tokens, self.reserved, self.hit_tokens,
                           self.owed_forward, tuple(sorted(self.ops)), self.reason, self.settled,
                           {g: list(p) for g, p in self.own.items() if p}, self.deferred_pages(),
                           self.receipts(), len(self.units))
