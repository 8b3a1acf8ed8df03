"""The facade an engine embeds in its scheduler's step loop: :class:`TieredCache`.

One instance per scheduler, driven on the scheduler's thread, sans-I/O like the core: it
returns transfer commands to submit and takes completions back. Every request goes
through the request lifecycle of the spec; every residency change of the tree through
the node lifecycle.

A step, as an engine runs it::

    adm = cache.admit("r1", unit_keys, prompt_tokens=4096, chunk_tokens=2048)
    # forward pass over adm.start_token .. adm.start_token + adm.chunk_tokens,
    # reading each layer only when cache.layer_ready("r1", layer) (loadbacks)
    cache.step_done("r1", computed_tokens=adm.chunk_tokens)
    table = cache.reserve("r1", tokens=2048)          # next chunk, or None: wait
    for completion in transfer_engine.poll_completions():
        cache.complete(completion)
    out = cache.poll()                                 # commands to submit, request events
    cache.finish("r1")

Units: tokens; a *unit* is ``layout.alignment`` tokens, the granularity of prefix reuse.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.fsm import CapacityError, Completion, ConfigError, Direction, KvtierError, TransferCommand
from kvtier.fsm import MatchMode, CacheCore, WritePolicy
from kvtier.fsm.ops import LayerProgress, Settled
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.machines import request_lifecycle
from kvtier.fsm.node import LockReceipt, NodeReceipt, PageMap

__all__ = ["TieredCache", "Admission", "RequestEvent", "PollResult", "RequestView"]

TERMINAL = frozenset({"finished", "aborted"})


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
        loadback: the loadback this request started (submit it), or ``None``.
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
    loadback: TransferCommand | None
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
    """What :meth:`TieredCache.poll` hands the engine.

    Attributes:
        commands: transfer commands to submit now (loadbacks first).
        events: request state changes since the last poll, in order.
    """

    commands: tuple[TransferCommand, ...]
    events: tuple[RequestEvent, ...]


@dataclass(frozen=True, slots=True)
class RequestView:
    """A read-only summary of one request (for schedulers, tests and reports)."""

    request_id: str
    state: str
    tokens: int
    reserved_tokens: int
    hit_tokens: int
    owed_forward: int
    ops: tuple[int, ...]
    reason: str | None


class _Request:
    """The facade's record of one request; the request lifecycle's subject."""

    __slots__ = ("request_id", "state", "units", "prompt_tokens", "tokens", "reserved", "canon", "own",
                 "published", "lock", "pins", "ops", "owed_forward", "reason", "has_loadback",
                 "has_own_writeback", "hit_tokens", "layers", "poisoned", "retract_ckpt", "room",
                 "ckpt_borrow")

    def __init__(self, request_id: str, units: list[Hashable], prompt_tokens: int) -> None:
        self.request_id = request_id
        self.state = "waiting"
        self.units = units
        self.prompt_tokens = prompt_tokens
        self.tokens = 0  # tokens whose KV exists (hit + computed)
        self.reserved = 0  # tokens covered by the page table
        self.canon: PageMap = {}  # published units' canonical pages (history groups)
        self.own: PageMap = {}  # the request's own device pages (history tail, working state)
        self.published = 0  # units published into the tree
        self.lock: LockReceipt | None = None
        self.pins: list[NodeReceipt] = []
        self.ops: set[int] = set()  # operations it waits on (own loadback, joined, own writeback)
        self.owed_forward = 0
        self.reason: str | None = None
        self.has_loadback = False
        self.has_own_writeback = False
        self.hit_tokens = 0
        self.layers: dict[int, int] = {}  # loadback op -> highest complete layer (all ranks)
        self.retract_ckpt = False
        self.poisoned = False  # its own writebacks are treated as failed (aborted)
        self.room = 0  # tokens the history pages of its table cover (reserve's fast path)
        self.ckpt_borrow: NodeReceipt | None = None  # the hit's checkpoint, until the first forward result

    @property
    def label(self) -> str:
        return repr(self.request_id)

    @property
    def settled(self) -> bool:
        return self.owed_forward == 0 and not self.ops


class TieredCache:
    """A two-tier prefix cache with the request lifecycle, for a scheduler's step loop.

    Args:
        layout: the model's cache groups (see :mod:`kvtier.fsm.presets`).
        device_pages: device capacity in cache units (int) or pages per group.
        host_pages: host capacity likewise; ``None`` for a device-only cache.
        policy: write policy of the tree (:class:`WritePolicy`).
        write_threshold: hits before ``write_through_selective`` backs a node up.
        world_size: tensor-parallel ranks acknowledging every operation.
        max_writebacks_in_flight: at most this many writeback operations in flight
            (loadbacks are never held back; the original's quota was 2).
        op_deadline_steps: steps after which an operation fails (``None``: never).
        finish_writeback: write back a finished request's pages that lack a host copy
            (its own operation; default: only under ``write_through``).
        history_replay: allow history-only hits plus a recompute span (see
            :meth:`CacheCore.match`).

    Raises:
        ConfigError: bad capacities or options.
    """

    def __init__(self, layout: CacheLayout, device_pages: int | Mapping[str, int],
                 host_pages: int | Mapping[str, int] | None = None, *,
                 policy: WritePolicy | str = WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold: int = 2,
                 world_size: int = 1, max_writebacks_in_flight: int = 2, op_deadline_steps: int | None = None,
                 finish_writeback: bool | None = None, history_replay: bool = False, eviction: str = "lru",
                 exclusive: bool = False) -> None:
        self.core = CacheCore(layout, device_pages, host_pages, policy=policy,
                                      write_threshold=write_threshold, world_size=world_size,
                                      op_deadline_steps=op_deadline_steps, eviction=eviction, exclusive=exclusive)
        if isinstance(max_writebacks_in_flight, bool) or not isinstance(max_writebacks_in_flight, int) \
                or max_writebacks_in_flight < 1:
            raise ConfigError(f"max_writebacks_in_flight must be an int >= 1, got {max_writebacks_in_flight!r}")
        if finish_writeback is not None and not isinstance(finish_writeback, bool):
            raise ConfigError(f"finish_writeback must be None, True or False, got {finish_writeback!r}")
        if not isinstance(history_replay, bool):
            raise ConfigError(f"history_replay must be True or False, got {history_replay!r}")
        self.layout = layout
        self.max_writebacks_in_flight = max_writebacks_in_flight
        self.finish_writeback = (self.core.policy is WritePolicy.WRITE_THROUGH) if finish_writeback is None \
            else finish_writeback
        self.history_replay = history_replay
        self._lc = request_lifecycle()
        self._requests: dict[str, _Request] = {}
        self._op_waiters: dict[int, set[str]] = {}
        self._events: list[RequestEvent] = []
        self._ended: set[str] = set()  # ended requests not yet forgotten by poll()
        self._align = layout.alignment
        self._hist = [g.name for g in layout.history_groups]
        self._tpp = {g.name: g.tokens_per_page for g in layout.history_groups}
        self._state_pages = {g.name: g.state_pages for g in layout.state_groups}
        self._running_result_noop = self._lc.is_noop("running", "forward_result")
        self.aborted_by_scheduler = 0

    # ------------------------------------------------------------------ lookups
    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KvtierError(f"unknown request {request_id!r}") from None

    def request(self, request_id: str) -> RequestView:
        """A summary of one request.

        Raises:
            KvtierError: unknown request.
        """
        r = self._get(request_id)
        return RequestView(r.request_id, r.state, r.tokens, r.reserved, r.hit_tokens, r.owed_forward,
                           tuple(sorted(r.ops)), r.reason)

    def unit_keys(self, request_id: str) -> tuple[Hashable, ...]:
        """The unit keys known for the request (its prompt's full units, then decode units)."""
        return tuple(self._get(request_id).units)

    def state(self, request_id: str) -> str:
        """The request's lifecycle state.

        Raises:
            KvtierError: unknown request.
        """
        return self._get(request_id).state

    def requests(self) -> list[RequestView]:
        """Every request the cache still tracks (ended ones are dropped after :meth:`poll`)."""
        return [self.request(k) for k in self._requests]

    def page_table(self, request_id: str) -> PageMap:
        """The request's device page table: history groups cover tokens ``0 .. reserved``
        (canonical pages of published units, then its own); state groups its working state."""
        r = self._get(request_id)
        return self._table(r)

    def _table(self, r: _Request) -> PageMap:
        out = {g: list(r.canon.get(g, ())) + list(r.own.get(g, ())) for g in self._hist}
        for g in self._state_pages:
            out[g] = list(r.own.get(g, ()))
        return out

    # ------------------------------------------------------------------ lifecycle plumbing
    def _fire(self, r: _Request, event: str) -> str:
        before = r.state
        state = self._lc.fire(r, event)
        if state != before:
            self._events.append(RequestEvent(r.request_id, state, r.reason if state == "aborted" else None))
        if state in TERMINAL:
            self._release(r)
            self._ended.add(r.request_id)
        return state

    def _release(self, r: _Request) -> None:
        """Give back everything the request holds, exactly once (invariant 8)."""
        if r.lock is not None:
            self.core.unlock(r.lock)
            r.lock = None
        for pin in r.pins:
            self.core.release(pin)
        r.pins = []
        self._drop_ckpt_borrow(r)
        self._free_own(r)
        r.canon = {}

    def _drop_ckpt_borrow(self, r: _Request) -> None:
        if r.ckpt_borrow is not None:
            self.core.release(r.ckpt_borrow)
            r.ckpt_borrow = None

    def _free_own(self, r: _Request, groups: Sequence[str] | None = None) -> None:
        mine = {g: p for g, p in r.own.items() if p and (groups is None or g in groups)}
        if mine:
            self.core.free_device(mine)
        for g in mine:
            r.own[g] = []

    def _pages_for(self, tokens: int, g: str) -> int:
        return math.ceil(tokens / self._tpp[g])

    def _need(self, r: _Request, upto: int, with_state: bool) -> dict[str, int]:
        """Own pages to add so history groups cover ``upto`` tokens (+ working state)."""
        need = {}
        for g in self._hist:
            have = len(r.canon.get(g, ())) + len(r.own.get(g, ()))
            need[g] = max(0, self._pages_for(upto, g) - have)
        if with_state:
            for g, k in self._state_pages.items():
                need[g] = k
        return need

    def _add_own(self, r: _Request, pages: Mapping[str, list[int]]) -> None:
        for g, p in pages.items():
            r.own.setdefault(g, []).extend(p)
        self._set_room(r)

    def _set_room(self, r: _Request) -> None:
        r.room = min((len(r.canon.get(g, ())) + len(r.own.get(g, ()))) * self._tpp[g] for g in self._hist)

    # ------------------------------------------------------------------ admission
    def admit(self, request_id: str, units: Sequence[Hashable], prompt_tokens: int,
              chunk_tokens: int) -> Admission | None:
        """Admit a new request: match its prompt, lock and pin what it reuses, and reserve
        device pages for the loadback and the first prefill chunk, all or nothing.

        Args:
            request_id: unique id (str).
            units: unit keys of the prompt's full units (``prompt_tokens // alignment`` of
                them, more allowed for decode units known in advance; extra ones ignored).
            prompt_tokens: prompt length in tokens (>= 1).
            chunk_tokens: tokens of the first prefill chunk (>= 1).

        Returns:
            The :class:`Admission`, or ``None`` when device pages are short even after
            eviction: the request stays ``waiting`` and holds nothing.

        Raises:
            KvtierError: the id is already admitted (and not ended).
            ConfigError: bad lengths or too few unit keys.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests and self._requests[request_id].state not in TERMINAL:
            old = self._requests[request_id]
            if old.state != "waiting" or old.owed_forward or old.ops:
                raise KvtierError(f"request {request_id!r} is already admitted (state {old.state!r})")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise ConfigError(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        if isinstance(units, (str, bytes)) or not isinstance(units, Sequence):
            raise ConfigError(f"request {request_id!r}: units must be a list or tuple of unit keys, got {units!r}")
        try:
            for u in units:
                hash(u)
        except TypeError:
            raise ConfigError(f"request {request_id!r}: unit keys must be hashable, got {u!r}") from None
        full = prompt_tokens // self._align
        if len(units) < full:
            raise ConfigError(f"request {request_id!r}: {prompt_tokens} prompt tokens need {full} unit keys, "
                              f"got {len(units)}")
        prev = self._requests.get(request_id)
        if prev is not None and prev.state in TERMINAL and not prev.settled:
            raise KvtierError(f"request {request_id!r} ended but a forward result is still owed")
        # an ended request's id may be admitted again before poll() forgets it: a new record
        r = prev if prev is not None and prev.state not in TERMINAL else _Request(request_id, list(units), prompt_tokens)
        r.units = list(units)
        r.prompt_tokens = prompt_tokens
        self._requests[request_id] = r
        self._ended.discard(request_id)
        # never reuse the whole prompt: the last token must be computed to get logits
        usable = (prompt_tokens - 1) // self._align
        return self._admit(r, r.units[:usable], MatchMode.PREFIX_REUSE, prompt_tokens, chunk_tokens, "schedule")

    def _admit(self, r: _Request, key: Sequence[Hashable], mode: MatchMode, limit: int, chunk: int,
               event: str) -> Admission | None:
        core = self.core
        m = core.match(key, mode, history_replay=self.history_replay and mode is MatchMode.PREFIX_REUSE)
        if mode is MatchMode.STATE_RECOVERY and m.host_units != len(key):
            m = core.match((), mode)  # no exact terminal state: recompute from scratch
        hit_units = m.host_units
        start = m.hit_tokens
        hold = core.lock(m.device_node, r.request_id) if m.device_node is not core.root else None
        upto = min(max(limit, start + 1), start + chunk) if limit > start else start + chunk
        need: dict[str, int] = {}
        for g in self._hist:
            need[g] = max(0, self._pages_for(upto, g) - hit_units * core.pages_per_unit[g])
        for g, k in self._state_pages.items():
            need[g] = k
        load = None
        try:
            if m.needs_loadback:
                load = core.load(m, r.request_id, extra=need)
                own = load.extra
            else:
                own = core.alloc_device(need)
        except CapacityError:
            if hold is not None:
                core.unlock(hold)
            return None
        if load is not None:
            if hold is not None:
                core.unlock(hold)
            r.lock = load.lock
            r.pins = [load.pin]
            table = load.device_pages
            r.ops.update(load.op_ids)
            ops = self.core.operations()
            for op in load.op_ids:
                self._op_waiters.setdefault(op, set()).add(r.request_id)
                # a joined loadback may have completed layers on every rank already
                r.layers[op] = min(ops[op].layers.get(k, -1) for k in range(self.core.world_size))
        else:
            r.lock = hold
            table = core.device_pages(m.device_node)
            if any(g in table for g in self._state_pages):
                # its forward pass copies the hit's checkpoint (Admission.checkpoint_pages): a
                # lock alone does not stop a deeper insert from dropping a chunk checkpoint
                self._drop_ckpt_borrow(r)  # resumed before the pass of its last admission returned
                r.ckpt_borrow = core.borrow([m.device_node], r.request_id)
        r.canon = {g: list(table[g]) for g in self._hist}
        r.own = {g: list(own.get(g, ())) for g in list(self._hist) + list(self._state_pages)}
        r.published = hit_units
        self._set_room(r)
        r.tokens = start
        r.hit_tokens = start
        r.reserved = upto
        r.has_loadback = load is not None
        r.owed_forward += 1
        self._fire(r, event)
        return Admission(r.request_id, start, upto - start, start, m.device_units * self._align,
                         self._table(r), load.command if load is not None else None,
                         load.op_ids if load is not None else (), m.recompute_tokens,
                         m.history_units * self._align,
                         {g: list(table[g]) for g in self._state_pages if g in table})

    def reserve(self, request_id: str, tokens: int) -> PageMap | None:
        """Reserve device pages for ``tokens`` more tokens (the next prefill chunk or decode
        step) and count one forward pass owed; all or nothing.

        Returns:
            The pages newly added to the request's page table (group -> page ids, appended
            in order; empty when the reserved pages already cover them), or ``None`` if
            pages are short after eviction (nothing changed). :meth:`page_table` gives
            the whole table.

        Raises:
            KvtierError: unknown request, or not ``running``/``loading``.
            ConfigError: ``tokens`` < 1.
        """
        r = self._get(request_id)
        if r.state not in ("running", "loading"):
            raise KvtierError(f"request {request_id!r}: reserve in state {r.state!r} (needs running or loading)")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ConfigError(f"reserve: tokens must be an int >= 1, got {tokens!r}")
        upto = max(r.reserved, r.tokens + tokens)
        if upto <= r.room:  # the pages it holds already cover them (most decode steps)
            r.reserved = upto
            r.owed_forward += 1
            return {}
        need = self._need(r, upto, with_state=False)
        pages: PageMap = {}
        if any(need.values()):
            try:
                pages = self.core.alloc_device(need)
            except CapacityError:
                return None
            self._add_own(r, pages)
        r.reserved = upto
        r.owed_forward += 1
        return pages

    # ------------------------------------------------------------------ forward results
    def step_done(self, request_id: str, computed_tokens: int, *, new_units: Sequence[Hashable] = (),
                  checkpoint: bool = False) -> PageMap:
        """The forward pass that included the request returned: ``computed_tokens`` more
        tokens have KV. Publishes newly full units into the tree (when the request is
        running) and, with ``checkpoint``, the continuation state at the last full unit
        boundary (the engine copies its state into the checkpoint pages).

        Args:
            computed_tokens: tokens computed by this pass (0 for a discarded result).
            new_units: unit keys of units completed beyond the prompt's (decode).
            checkpoint: the engine holds the exact state at ``floor(tokens/alignment)`` units.

        Returns:
            Checkpoint pages the tree adopted (state group -> page ids): the engine copies
            its continuation state at that unit boundary into them. Empty otherwise.

        Raises:
            KvtierError: unknown request, or no forward result is owed.
            ConfigError: more tokens than reserved.
        """
        r = self._get(request_id)
        adopted: PageMap = {}
        if isinstance(computed_tokens, bool) or not isinstance(computed_tokens, int) or computed_tokens < 0:
            raise ConfigError(f"request {request_id!r}: computed_tokens must be an int >= 0, got {computed_tokens!r}")
        if r.owed_forward <= 0:
            raise KvtierError(f"request {request_id!r} (state {r.state!r}) owes no forward result")
        if r.state in ("running", "loading") and r.tokens + computed_tokens > r.reserved:
            raise ConfigError(f"request {request_id!r}: {computed_tokens} tokens computed but only "
                              f"{r.reserved - r.tokens} reserved")
        if r.state in TERMINAL:
            # aborted from waiting or retracted (it held nothing) while a forward pass was
            # still out: the late result only retires the count
            r.owed_forward -= 1
            return adopted
        if (r.state == "running" and self._running_result_noop and r.ckpt_borrow is None
                and not checkpoint and min(r.tokens + computed_tokens, (len(r.units) + len(new_units)) *
                                           self._align) < (r.published + 1) * self._align):
            # hot path (most decode steps): no unit completes, nothing to publish, and the
            # spec's forward_result in running is an unguarded internal transition
            if new_units:
                r.units.extend(new_units)
            r.tokens += computed_tokens
            r.retract_ckpt = False
            r.owed_forward -= 1
            return adopted
        self._lc.check(r, "forward_result")
        self._drop_ckpt_borrow(r)  # the pass that copied the checkpoint has returned
        r.units.extend(new_units)
        if r.state in ("running", "loading"):
            r.tokens += computed_tokens
            # the state is at floor(tokens/alignment) units: without that unit's key (decode
            # units come in new_units) the checkpoint would land on an earlier unit's node
            checkpoint = checkpoint and r.tokens // self._align <= len(r.units)
            r.retract_ckpt = checkpoint
        r.owed_forward -= 1
        if r.state == "running":
            # the checkpoint at the prompt's last full unit is kept for later turns of the
            # conversation; other chunk checkpoints give way to deeper ones
            at_prompt_end = r.tokens == (r.prompt_tokens // self._align) * self._align
            adopted = self._publish(r, checkpoint=checkpoint, final=at_prompt_end)
        self._fire(r, "forward_result")
        return adopted

    def _publish(self, r: _Request, checkpoint: bool, final: bool = False) -> PageMap:
        """Insert the request's full units into the tree; move its lock to the new terminal.

        Returns:
            The checkpoint pages the tree adopted (state group -> page ids), which the
            engine must fill with its state at that position; empty when none.
        """
        core = self.core
        n_units = min(r.tokens // self._align, len(r.units))
        if n_units < r.published:
            # inside a history-replay span (tokens below the hit end are recomputed only to
            # rebuild continuation state): nothing new, and no state there is exact yet
            return {}
        if n_units == r.published and not (checkpoint and core.ckpt_groups and n_units > 0):
            return {}
        ppu = core.pages_per_unit
        pages = {g: (r.canon.get(g, []) + r.own.get(g, []))[: n_units * ppu[g]] for g in self._hist}
        ckpt = None
        if checkpoint and self._state_pages and n_units > 0 and n_units * self._align <= r.tokens:
            try:
                ckpt = core.alloc_device(dict(self._state_pages), evict=False)
            except CapacityError:
                ckpt = None
        result = core.insert(r.units[:n_units], pages, ckpt, chunk_checkpoint=not final)
        dup = {g: p for g, p in result.duplicates.items() if p}
        # own pages now published or duplicated leave the request's own list
        for g in self._hist:
            used = pages[g][len(r.canon.get(g, [])):]
            kept = set(result.kept.get(g, ()))
            gone = set(used) - kept
            r.own[g] = [p for p in r.own.get(g, []) if p not in gone]
        state_dup = {g: p for g, p in dup.items() if g in self._state_pages}
        hist_dup = {g: p for g, p in dup.items() if g in self._hist}
        if hist_dup:
            core.free_device(hist_dup)
        if state_dup:
            core.free_device(state_dup)
        adopted: PageMap = {}
        if ckpt is not None:
            kept_state = {g: p for g, p in result.kept.items() if g in self._state_pages}
            if kept_state:
                core.free_device(kept_state)
            for g, p in ckpt.items():
                gone = set(dup.get(g, ())) | set(kept_state.get(g, ()))
                if not gone.intersection(p):
                    adopted[g] = p
        r.canon = {g: list(result.pages[g]) for g in self._hist}
        r.published = result.published_units
        if result.node is not core.root:
            new_lock = core.lock(result.node, r.request_id)
            if r.lock is not None:
                core.unlock(r.lock)
            r.lock = new_lock
        return adopted

    # ------------------------------------------------------------------ ends
    def finish(self, request_id: str) -> PageMap:
        """Generation ended: publish its full units; write back its own pages (its own
        operation) when ``finish_writeback``; then release (after the ack, if any).

        Returns:
            Checkpoint pages the tree adopted, as :meth:`step_done` (fill them before
            submitting the commands :meth:`poll` returns). Empty otherwise.

        Raises:
            KvtierError / IllegalTransition: unknown request or not running; nothing changes.
        """
        r = self._get(request_id)
        if r.state == "running" and r.owed_forward:
            # forward_result is not allowed in finishing: the request would never settle
            raise KvtierError(f"request {request_id!r} (state {r.state!r}): finish while {r.owed_forward} "
                              f"forward result(s) are owed")
        self._lc.check(r, "finish") if r.state == "running" else self._lc.fire(r, "finish")
        adopted = self._publish(r, checkpoint=r.retract_ckpt, final=True)
        cmd = None
        if self.finish_writeback and r.lock is not None:
            cmd = self.core.writeback(r.lock.node, r.request_id)
        self._own_writeback(r, cmd)
        self._fire(r, "finish")
        return adopted

    def retract(self, request_id: str) -> PageMap:
        """Preempt: publish full units and the exact continuation state at its terminal,
        write back what resuming needs (its own operation), release its own pages now and
        the tree's after the ack. Resume matches with ``state_recovery``.

        Returns:
            Checkpoint pages the tree adopted for the terminal, as :meth:`step_done`: the
            engine fills them with its state at that unit boundary before submitting the
            commands :meth:`poll` returns (the retract writeback copies them). Empty
            when the terminal already had its checkpoint (or there are no state groups).

        Raises:
            IllegalTransition: not running; nothing changes.
        """
        r = self._get(request_id)
        self._lc.check(r, "retract") if r.state == "running" else self._lc.fire(r, "retract")
        adopted = self._publish(r, checkpoint=True, final=True)
        cmd = self.core.writeback(r.lock.node, r.request_id) if r.lock is not None else None
        self._own_writeback(r, cmd)
        self._free_own(r)
        r.reserved = r.tokens
        self._fire(r, "retract")
        if r.state == "retracted":
            self._after_retract(r)
        return adopted

    def _own_writeback(self, r: _Request, cmd: TransferCommand | None) -> None:
        r.has_own_writeback = cmd is not None
        if cmd is not None:
            r.ops.add(cmd.op_id)
            self._op_waiters.setdefault(cmd.op_id, set()).add(r.request_id)

    def _after_retract(self, r: _Request) -> None:
        if r.lock is not None:
            self.core.unlock(r.lock)
            r.lock = None
        r.canon = {}

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        """Re-admit a retracted request with ``state_recovery`` (its own terminal exactly,
        or recompute from scratch); all or nothing like :meth:`admit`.

        Raises:
            IllegalTransition: not retracted; nothing changes.
        """
        r = self._get(request_id)
        if r.state != "retracted":
            self._lc.fire(r, "resume")  # raises IllegalTransition naming the state
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"request {request_id!r}: resume chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        n_units = min(r.tokens // self._align, len(r.units))
        # the hit covers its own terminal (or nothing); the tail up to r.tokens is recomputed
        return self._admit(r, r.units[:n_units], MatchMode.STATE_RECOVERY, r.tokens, chunk_tokens, "resume")

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort: at once if it owes nothing, else deferred until every forward result and
        its own operations have retired (its own writebacks are then treated as failed).

        Raises:
            KvtierError: unknown request; IllegalTransition: already ended or aborting;
            ConfigError: ``reason`` not a non-empty str.
        """
        r = self._get(request_id)
        if not isinstance(reason, str) or not reason:
            raise ConfigError(f"abort: reason must be a non-empty str, got {reason!r}")
        self._lc.check(r, "abort")
        r.reason = reason
        for op in sorted(r.ops):
            if self.core.operations().get(op) is not None and \
                    self.core.operations()[op].direction is Direction.WRITEBACK:
                self.core.poison(op)
        r.poisoned = True
        self._fire(r, "abort")

    def abort_victim(self, blocked: Sequence[str], reason: str = "cache capacity exhausted") -> str | None:
        """Abort exactly one deterministic victim among ``blocked`` requests (the largest
        token count, ties to the smallest id), only when nothing is in flight: no
        operation and no forward result owed by any request. Returns its id or ``None``.

        Raises:
            ConfigError: ``blocked`` not a list of ids, or an empty ``reason``.
            KvtierError: an unknown request id in ``blocked``.
        """
        if isinstance(blocked, str) or not isinstance(blocked, Sequence):
            raise ConfigError(f"abort_victim: blocked must be a list of request ids, got {blocked!r}")
        victims = [self._get(b) for b in blocked]
        if not isinstance(reason, str) or not reason:
            raise ConfigError(f"abort_victim: reason must be a non-empty str, got {reason!r}")
        if not blocked or self.core.operations() or any(r.owed_forward for r in self._requests.values()):
            return None
        victim = min(victims, key=lambda r: (-max(r.tokens, r.prompt_tokens), r.request_id))
        self.abort(victim.request_id, reason)
        self.aborted_by_scheduler += 1
        return victim.request_id

    # ------------------------------------------------------------------ completions
    def complete(self, completion: Completion) -> None:
        """A transfer completion from any rank, per layer or final, in any order.

        Raises:
            UnknownOperation, DuplicateCompletion, ConfigError: from the core; nothing changes.
        """
        for out in self.core.complete(completion):
            self._on_core_event(out)

    def advance_step(self, steps: int = 1) -> None:
        """Advance the scheduler's step counter (operation deadlines)."""
        for s in self.core.advance_step(steps):
            self._on_core_event(s)

    def _on_core_event(self, ev: Settled | LayerProgress) -> None:
        if isinstance(ev, LayerProgress):
            for rid in self._op_waiters.get(ev.op_id, ()):
                r = self._requests[rid]
                r.layers[ev.op_id] = ev.layer
            return
        for rid in sorted(self._op_waiters.pop(ev.op_id, set())):
            waiter = self._requests.get(rid)
            if waiter is None or ev.op_id not in waiter.ops:
                continue
            r = waiter
            r.ops.discard(ev.op_id)
            r.layers.pop(ev.op_id, None)
            if ev.direction is Direction.LOADBACK:
                self._loadback_settled(r, ev.ok)
            else:
                self._writeback_settled(r, ev.ok)

    def _loadback_settled(self, r: _Request, ok: bool) -> None:
        pending = any(op for op in r.ops if op in self.core.operations()
                      and self.core.operations()[op].direction is Direction.LOADBACK)
        if r.state == "loading":
            if ok and pending:
                return
            if ok:
                for pin in r.pins:
                    self.core.release(pin)
                r.pins = []
                self._fire(r, "loadback_done")
                self._publish(r, checkpoint=False)
            else:
                self._release(r)
                for op in list(r.ops):
                    self._op_waiters.get(op, set()).discard(r.request_id)
                r.ops.clear()
                r.layers.clear()
                r.tokens = r.reserved = r.published = 0
                r.hit_tokens = 0
                self._fire(r, "loadback_failed")
        elif r.state == "aborting":
            self._fire(r, "loadback_done" if ok else "loadback_failed")

    def _writeback_settled(self, r: _Request, ok: bool) -> None:
        if r.state == "finishing":
            self._fire(r, "writeback_done" if ok else "writeback_failed")
        elif r.state == "retracting":
            if ok:
                self._fire(r, "writeback_done")
                self._after_retract(r)
            else:
                r.reason = "retract writeback failed"
                self.aborted_by_scheduler += 1
                self._fire(r, "writeback_failed")
        elif r.state == "aborting":
            self._fire(r, "writeback_done" if ok else "writeback_failed")

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Whether the request's forward pass may read ``layer``: every loadback it waits
        on has completed that layer on every rank (or it waits on none)."""
        r = self._get(request_id)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ConfigError(f"layer must be an int in 0..{self.layout.num_layers - 1}, got {layer!r}")
        return all(done >= layer for done in r.layers.values())

    # ------------------------------------------------------------------ poll
    def poll(self) -> PollResult:
        """Commands to submit now (loadbacks first, at most ``max_writebacks_in_flight``
        writebacks in flight) and the request state changes since the last poll. Ended
        requests are forgotten once reported."""
        core = self.core
        room = self.max_writebacks_in_flight - core.ops_in_flight(Direction.WRITEBACK)
        if room > 0:
            core.issue_writebacks(room)
        commands = tuple(core.poll_commands())
        events = tuple(self._events)
        self._events.clear()
        # ended requests are forgotten once reported and settled (a late forward result
        # may settle one after its end was reported)
        for rid in [k for k in self._ended if self._requests[k].settled]:
            del self._requests[rid]
            self._ended.discard(rid)
        return PollResult(commands, events)

    def in_flight(self) -> bool:
        """True while any operation or forward result is outstanding."""
        return bool(self.core.ops_in_flight()) or any(r.owed_forward for r in self._requests.values())

    def check_invariants(self) -> None:
        """The core's invariants plus the facade's: every request's own pages are held by
        a caller, ended requests hold nothing, no two requests share own pages."""
        from kvtier.fsm.errors import InvariantViolation

        self.core.check_invariants()
        seen: dict[tuple[str, int], str] = {}
        for r in self._requests.values():
            for g, pages in r.own.items():
                ext = self.core.external_pages(g)
                for p in pages:
                    if p not in ext:
                        raise InvariantViolation("conservation", f"request {r.request_id!r}",
                                                 f"own page {p} of {g!r} is not held by a caller")
                    if (g, p) in seen:
                        raise InvariantViolation("conservation", f"request {r.request_id!r}",
                                                 f"page {p} of {g!r} also held by {seen[(g, p)]!r}")
                    seen[(g, p)] = r.request_id
            if r.state in TERMINAL and (r.lock is not None or r.pins or r.ckpt_borrow or any(r.own.values())):
                raise InvariantViolation("release_once_after_fence", f"request {r.request_id!r}",
                                         f"ended ({r.state}) but still holds pages, locks or pins")
            if r.state in ("retracted", "waiting") and (r.lock is not None or any(r.own.values())):
                raise InvariantViolation("release_once_after_fence", f"request {r.request_id!r}",
                                         f"{r.state} but still holds device pages or locks")
        external = sum(len(self.core.external_pages(g)) for g in self.core.device)
        if external != len(seen):
            raise InvariantViolation("conservation", "the facade",
                                     f"{external} caller pages in the core, {len(seen)} held by requests")

    def stats(self) -> dict[str, Any]:
        """Counters of the core plus scheduler aborts."""
        s = vars(self.core.stats).copy()
        s.pop("extra", None)
        s["scheduler_aborts"] = self.aborted_by_scheduler
        return s

