"""The facade an engine embeds in its scheduler's step loop: :class:`TieredCache`.

One instance per scheduler, driven on its thread, sans-I/O: it returns transfer commands
and takes completions back. It checks arguments and composes the parts in ``kvtier.fsm``:
the node core, the request table (``request_table``), ``admission``, ``forward``,
``request_ends``, ``completions`` and the request invariants (``fence``). Besides the calls
that drive it, it answers read-only queries (requests, page tables, which call a state
accepts, what is still outstanding, invariants and counters) that change nothing.

A step, as an engine runs it::

    adm = cache.admit("r1", unit_keys, prompt_tokens=4096, chunk_tokens=2048)
    out = cache.poll()                     # the one place commands come from: submit them all
    transfer_engine.submit(out.commands)   # (adm.loadback_op names the admission's loadback)
    # forward pass over its chunk; a layer is read once cache.layer_ready("r1", layer)
    out = cache.step(results=[ForwardResult("r1", adm.chunk_tokens)],  # the whole batch:
                     reserve=[Reservation("r1", 2048)])             # results, next chunks
    for completion in transfer_engine.poll_completions():
        cache.complete(completion)
    cache.advance_step()                               # operation deadlines count steps
    out = cache.poll()                                 # commands to submit, request events
    cache.finish("r1")                                 # once no pass is owed
    ...
    assert cache.quiescent(), cache.outstanding()      # after draining: nothing leaked

The contract: every transfer command is handed out by :meth:`TieredCache.poll` and
nowhere else (an :class:`Admission` names its loadback's op id only); an engine learns
that a request ended from the events ``poll`` returns, and :meth:`TieredCache.state`
still answers for the last ``ended_history`` ended requests after that.

Which call is accepted in which request state is declared in ``spec/lifecycle.toml``
(``[request.calls]``, and the transitions for finish, retract, resume and abort); a call
in another state raises ``UsageError`` (or ``IllegalTransition`` / ``GuardRejected``) and
changes nothing. Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from threading import Lock, get_ident
from typing import Any

from kvtier.fsm import Completion, ConfigError, Direction, KvtierError, UsageError
from kvtier.fsm.request.admission import Admitter
from kvtier.fsm.request.batch import Batcher, ForwardResult, ItemOutcome, Reservation, StepOutcome
from kvtier.fsm.checks import as_bool, as_int, as_keys, as_text
from kvtier.fsm.request.completions import CompletionRouter
from kvtier.fsm.request.fence import check_all
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.l3 import L3Options, L3Tier
from kvtier.fsm.node import PageMap
from kvtier.fsm.request.forward import ForwardResults
from kvtier.fsm.request import CALLS, TERMINAL, Admission, Outstanding, PollResult, RequestEvent, RequestView
from kvtier.fsm.request.ends import Ender
from kvtier.fsm.request.table import DEFAULT_ENDED_HISTORY, CacheCore, RequestTable, WritePolicy

__all__ = ["TieredCache", "Admission", "RequestEvent", "PollResult", "RequestView", "Outstanding", "TERMINAL",
           "DEFAULT_OP_DEADLINE_STEPS", "DEFAULT_ENDED_HISTORY", "ForwardResult", "Reservation", "ItemOutcome",
           "StepOutcome", "L3Options", "WritePolicy", "DEFAULT_MAX_REQUEST_TOKENS"]

#: The default ``op_deadline_steps``: an operation not acknowledged on every rank within
#: this many :meth:`TieredCache.advance_step` steps fails (its request recomputes or
#: ends; a late completion is absorbed), so one lost completion cannot hold a request
#: forever. 10,000 steps is minutes of decode steps, far beyond any real transfer.
DEFAULT_OP_DEADLINE_STEPS = 10_000

#: The default ``max_request_tokens``: the most tokens one request may hold (prompt plus
#: the decode units given in advance), 2**24 (16,777,216: 16x the longest prompt a trace
#: may hold, ``kvtier.replay.trace.MAX_INPUT_LENGTH``). :meth:`TieredCache.admit` checks
#: ``prompt_tokens`` and the number of unit keys against it before reading the keys.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 24

_BINDING = Lock()  # taken only while a cache binds its driving thread
_NOTHING = PollResult((), ())  # what poll returns when there is nothing to hand out or report


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
        op_deadline_steps: :meth:`advance_step` steps after which an operation fails
            (default :data:`DEFAULT_OP_DEADLINE_STEPS`; ``None``: never, so a lost
            completion holds its request and pages until the engine aborts it).
        finish_writeback: write back a finished request's pages that lack a host copy
            (its own operation; default: only under ``write_through``).
        history_replay: allow history-only hits plus a recompute span (core ``match``).
        eviction: eviction policy (``lru``, ``lru_turns``, ``lru2``).
        exclusive: an exclusive host tier (docs/policies.md).
        l3: :class:`kvtier.fsm.l3.L3Options` turns on the L3 tier ``cache.l3`` (docs/l3.md).
        ended_history: how many ended requests :meth:`state` and :meth:`request` still
            answer for after :meth:`poll` reported their end (oldest dropped first).
        max_request_tokens: the most tokens one request may hold (default
            :data:`DEFAULT_MAX_REQUEST_TOKENS`): a longer prompt, or more unit keys than
            ``max_request_tokens // alignment``, is refused before the keys are read.

    One thread drives a cache: the first call that changes it (admit, resume, reserve,
    step_done, step, finish, retract, abort, abort_victim, complete, advance_step, poll)
    binds it to the calling thread, and such a call from any other thread raises
    ``UsageError`` and changes nothing (the read-only queries answer from any thread;
    :meth:`bind_thread` hands the cache over to another thread).

    Capacities: at most :data:`kvtier.fsm.node.pages.MAX_POOL_PAGES` (2**53) pages per pool and
    group; memory grows with the pages in use, never with the capacity.

    Raises:
        ConfigError: bad capacities or options.
    """

    def __init__(self, layout: CacheLayout, device_pages: int | Mapping[str, int],
                 host_pages: int | Mapping[str, int] | None = None, *,
                 policy: WritePolicy | str = WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold: int = 2,
                 world_size: int = 1, max_writebacks_in_flight: int = 2,
                 op_deadline_steps: int | None = DEFAULT_OP_DEADLINE_STEPS, finish_writeback: bool | None = None,
                 history_replay: bool = False, ended_history: int = DEFAULT_ENDED_HISTORY, eviction: str = "lru",
                 exclusive: bool = False, l3: L3Options | None = None,
                 max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS) -> None:
        self._owner: int | None = None  # the thread that drives it (bound at the first call)
        self.core = CacheCore(layout, device_pages, host_pages, policy=policy, write_threshold=write_threshold,
                              world_size=world_size, op_deadline_steps=op_deadline_steps, eviction=eviction,
                              exclusive=exclusive)
        self.max_writebacks_in_flight = as_int(max_writebacks_in_flight, "max_writebacks_in_flight", minimum=1,
                                               error=ConfigError)
        if finish_writeback is not None:
            finish_writeback = as_bool(finish_writeback, "finish_writeback (or None)", error=ConfigError)
        self.history_replay = as_bool(history_replay, "history_replay", error=ConfigError)
        self.max_request_tokens = as_int(max_request_tokens, "max_request_tokens", minimum=1, error=ConfigError)
        self.layout = layout
        self._most_units = self.max_request_tokens // layout.alignment  # (the layout is frozen)
        self.finish_writeback = self.core.policy is WritePolicy.WRITE_THROUGH if finish_writeback is None else finish_writeback
        self._table = RequestTable(self.core, ended_history)
        self._admitter = Admitter(self._table, self.history_replay)
        self._forward = ForwardResults(self._table)
        self._ender = Ender(self._table, self._forward, self.finish_writeback)
        self._router = CompletionRouter(self._table, self._forward)
        self._batch = Batcher(self._table, self._admitter, self._forward)
        self._victims = 0
        self.l3: L3Tier | None = L3Tier(self.core, l3) if l3 is not None else None

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
            The :class:`Admission` (one forward pass owed), or ``None`` when device pages
            are short after eviction: the request stays ``waiting``, holding nothing. A
            loadback it starts (``Admission.loadback_op``) is handed out by the next
            :meth:`poll`: poll and submit before the forward pass.

        Raises:
            UsageError: the id is admitted and not ``waiting``, bad lengths, or too few
                (or unhashable) unit keys; nothing changes.
        """
        if self._owner != get_ident():
            self._bind()
        if type(request_id) is not str or not request_id:
            as_text(request_id, "request_id")  # raises, naming the value
        most = self.max_request_tokens
        if type(prompt_tokens) is not int or prompt_tokens < 1:
            prompt_tokens = as_int(prompt_tokens, "prompt_tokens", minimum=1)
        if prompt_tokens > most:
            raise UsageError(f"request {request_id!r}: prompt_tokens {prompt_tokens} above max_request_tokens {most}")
        if type(chunk_tokens) is not int or chunk_tokens < 1:
            chunk_tokens = as_int(chunk_tokens, "chunk_tokens", minimum=1)
        if type(units) is list or type(units) is tuple or (isinstance(units, Sequence)
                                                            and not isinstance(units, (str, bytes))):
            n = len(units)
            if n > self._most_units:
                raise UsageError(f"request {request_id!r}: {n} unit keys, more than max_request_tokens {most} "
                                 f"holds ({most // self.layout.alignment} units of {self.layout.alignment} tokens)")
        units = as_keys(units, f"request {request_id!r}: units")
        prev = self._table.find(request_id)
        kept = (prev.units, prev.prompt_tokens) if prev is not None else None
        try:
            return self._admitter.admit(request_id, units, prompt_tokens, chunk_tokens, prev)
        except KvtierError:
            raise
        except Exception as exc:  # a key that passed the probe raised in the tree's match (it changes
            # nothing before the key's last comparison): put the request's record back as it was
            if prev is None:
                self._table._records.pop(request_id, None)
            elif kept is not None:
                prev.units, prev.prompt_tokens = kept
            raise UsageError(f"request {request_id!r}: a unit key raised {type(exc).__name__} in the radix "
                             f"tree: {exc}") from exc

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        """Re-admit a retracted request with ``state_recovery`` (its own terminal exactly,
        or recompute from scratch); all or nothing like :meth:`admit`. IllegalTransition:
        not retracted; UsageError: bad ``chunk_tokens``. Nothing changes."""
        if self._owner != get_ident():
            self._bind()
        r = self._table.get(request_id)
        self._table.check(r, "resume")
        return self._admitter.resume(r, as_int(chunk_tokens, f"request {request_id!r}: resume chunk_tokens",
                                               minimum=1))

    def reserve(self, request_id: str, tokens: int) -> PageMap | None:
        """One request's :meth:`step` reservation: device pages for ``tokens`` more tokens
        (next prefill chunk or decode step), one forward pass owed; all or nothing. A pass
        reserved before the previous one's :meth:`step_done` (overlapped scheduling) starts
        where the reserved tokens end. Returns the pages newly added to its page table
        (group -> page ids, in order; empty when its pages cover them), or ``None`` if pages
        are short after eviction. UsageError: unknown request, a state other than
        ``running``/``loading``, or ``tokens`` < 1. Nothing changes on ``None`` or error."""
        if self._owner != get_ident():
            self._bind()
        return self._batch.reserve_one(request_id, tokens)

    def step_done(self, request_id: str, computed_tokens: int, *, new_units: Sequence[Hashable] = (),
                  checkpoint: bool = False) -> PageMap:
        """One request's :meth:`step` result: its oldest pass out returned, ``computed_tokens``
        (0: discarded) more tokens have KV, ``new_units`` complete units beyond the prompt's.
        Publishes newly full units (when running) and, with ``checkpoint`` (the engine holds
        the exact state at ``floor(tokens/alignment)`` units), that state; pages leaving its
        table are freed once every pass reserved before has returned. Returns the checkpoint
        pages the tree adopted (state group -> page ids; the engine copies its state there).
        UsageError: unknown request, nothing owed, a bad argument, or more tokens than
        reserved; nothing changes."""
        if self._owner != get_ident():
            self._bind()
        return self._batch.result_one(request_id, computed_tokens, new_units, checkpoint)

    def step(self, results: Sequence[ForwardResult | tuple[Any, ...]] = (),
             reserve: Sequence[Reservation | tuple[Any, ...]] = (), *,
             stop_on_short: bool = False) -> StepOutcome:
        """One call per scheduler step for the whole batch: each :class:`ForwardResult` (as
        :meth:`step_done`), then each :class:`Reservation` (as :meth:`reserve`), in order.
        Each item is all or nothing on its own: a refused one (``"refused"`` with its
        ``error``, or ``"short"`` of pages) changes nothing and leaves the others intact;
        with ``stop_on_short`` the reservations after the first short one are ``"skipped"``.
        Every item's arguments are checked before it changes anything: a unit key whose
        hash or ``==`` raises refuses its item (``UsageError``), never escapes half-applied.
        Returns a :class:`StepOutcome` (one :class:`ItemOutcome` per item, ``pages``: adopted
        checkpoint pages or new pages). UsageError: not lists of those records, or a request
        twice in one list (nothing changes)."""
        if self._owner != get_ident():
            self._bind()
        return self._batch.step(results, reserve, stop_on_short)

    def states(self, request_ids: Sequence[str]) -> list[str]:
        """The lifecycle state of each request (UsageError: an unknown request)."""
        return self._table.states(request_ids)

    # ------------------------------------------------------------------ ends
    def finish(self, request_id: str) -> PageMap:
        """Generation ended: publish its full units; write back its own pages (its own
        operation) when ``finish_writeback``; then release (after the ack, if any).
        Returns the checkpoint pages the tree adopted, as :meth:`step_done`.

        Raises:
            UsageError: unknown request.
            IllegalTransition: not running.
            GuardRejected: a forward result is owed (step_done first). Nothing changes.
        """
        if self._owner != get_ident():
            self._bind()
        return self._ender.finish(self._table.get(request_id))

    def retract(self, request_id: str) -> PageMap:
        """Preempt: publish full units and the exact continuation state at its terminal,
        write back what resuming needs (its own operation), free its own pages now and
        let go of the tree's after the ack. Resume matches with ``state_recovery``.
        Returns the checkpoint pages the tree adopted, as :meth:`step_done` (fill them
        before submitting the commands :meth:`poll` returns).

        Raises:
            UsageError: unknown request.
            IllegalTransition: not running.
            GuardRejected: ``settled`` is false: a pass is out, whose KV writes would land in
                pages given away (step_done first). Nothing changes.
        """
        if self._owner != get_ident():
            self._bind()
        return self._ender.retract(self._table.get(request_id))

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort: at once if it owes nothing, else deferred (``aborting``) until every
        forward result and its own operations have retired (its writebacks then fail; one
        :meth:`poll` has not handed out yet is withdrawn and never handed out).
        UsageError: unknown request or empty ``reason``; IllegalTransition: already ended
        or aborting. Nothing changes."""
        if self._owner != get_ident():
            self._bind()
        r = self._table.get(request_id)
        for settled in self._ender.abort(r, as_text(reason, "abort: reason")):
            self._router.on_core_event(settled)  # its own writeback not yet handed out: withdrawn
        if self.l3 is not None:  # an L3 prefetch of its id in flight is detached (l3.cancel says how)
            self.l3.forget(request_id)

    def abort_victim(self, blocked: Sequence[str], reason: str = "cache capacity exhausted") -> str | None:
        """Abort one deterministic victim among ``blocked`` (the largest token count, ties
        to the smallest id), only when no operation and no forward result is owed by any
        request. Returns its id or ``None``. UsageError: bad ``blocked`` or ``reason``."""
        if self._owner != get_ident():
            self._bind()
        if isinstance(blocked, str) or not isinstance(blocked, Sequence):
            raise UsageError(f"abort_victim: blocked must be a list of request ids, got {blocked!r}")
        victim = self._ender.abort_victim(blocked, as_text(reason, "abort_victim: reason"))
        self._victims += victim is not None
        return victim

    # ------------------------------------------------------------------ completions
    def complete(self, completion: Completion) -> None:
        """A transfer completion from any rank, per layer or final, in any order
        (UnknownOperation, DuplicateCompletion, ConfigError from the core; UsageError for an
        op whose command :meth:`poll` has not handed out yet: nothing changes)."""
        if self._owner != get_ident():
            self._bind()
        if (isinstance(completion, Completion) and self.core.has_commands()
                and any(c.op_id == completion.op_id for c in self.core.pending_commands())):
            raise UsageError(f"completion for op {completion.op_id}: its command has not been handed out by poll() yet")
        for out in self.core.complete(completion):
            self._router.on_core_event(out)

    def advance_step(self, steps: int = 1) -> None:
        """Advance the scheduler's step counter (operation deadlines)."""
        if self._owner != get_ident():
            self._bind()
        for s in self.core.advance_step(steps):
            self._router.on_core_event(s)

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Whether the request's forward pass may read ``layer``: it is in a state with
        readable pages (``[request.calls] layer_ready``), no loadback it waited on failed,
        and every loadback it waits on completed that layer on every rank. UsageError:
        unknown request or ``layer`` outside ``0 .. num_layers - 1``."""
        r = self._table.get(request_id)
        layer = as_int(layer, f"request {request_id!r}: layer", maximum=self.layout.num_layers - 1)
        return self._router.layer_ready(r, layer)

    # ------------------------------------------------------------------ poll
    def poll(self) -> PollResult:
        """Commands to submit now (loadbacks first, at most ``max_writebacks_in_flight``
        writebacks in flight) and the request state changes since the last poll.

        This is the one place commands are handed out, each exactly once: admissions'
        loadbacks, finish and retract writebacks and tree writebacks; submit every one.
        An ended request is forgotten once reported (its event is how the engine learns
        the end); :meth:`state` still answers for the last ``ended_history`` of them."""
        if self._owner != get_ident():
            self._bind()
        core = self.core
        if core.writebacks:  # tree writebacks queued
            room = self.max_writebacks_in_flight - core.ops_in_flight(Direction.WRITEBACK)
            if room > 0:
                core.issue_writebacks(room)
        waiting = core.has_commands()
        table = self._table
        if not waiting and not table.has_news():
            return _NOTHING  # (most polls of a step loop: nothing to hand out or report)
        return PollResult(tuple(core.poll_commands()) if waiting else (), tuple(table.take_events()))

    # ------------------------------------------------------------------ the driving thread
    def bind_thread(self) -> None:
        """Make the calling thread the one that drives the cache (an engine that moves its
        scheduler loop to another thread calls this there first, once the old thread has
        stopped calling)."""
        self._owner = get_ident()

    def _bind(self) -> None:
        """The first call that changes the cache binds it to its thread; a call from
        another thread raises UsageError before anything changes."""
        with _BINDING:  # two threads' first calls at once: one of them binds
            if self._owner is None:
                self._owner = get_ident()
            if self._owner == get_ident():
                return
        raise UsageError(f"TieredCache called from thread {get_ident()}, but thread {self._owner} drives it: "
                         f"one thread drives a cache (bind_thread() hands it over; serialise calls from "
                         f"several threads with one lock and bind_thread() under it)")

    # ------------------------------------------------------------------ read-only queries
    def request(self, request_id: str) -> RequestView:
        """A summary of one request, tracked or among the last ``ended_history`` ended
        (UsageError: unknown request)."""
        return self._table.view(request_id)

    def unit_keys(self, request_id: str) -> tuple[Hashable, ...]:
        """The unit keys known for the request (its prompt's full units, then decode units)."""
        return tuple(self._table.get(request_id).units)

    def state(self, request_id: str) -> str:
        """The request's lifecycle state; for the last ``ended_history`` ended requests
        still ``finished`` or ``aborted`` after :meth:`poll` reported it (UsageError:
        unknown request)."""
        r = self._table.find(request_id) if isinstance(request_id, str) else None
        return r.state if r is not None else self._table.view(request_id).state

    def requests(self) -> list[RequestView]:
        """Every request the cache still tracks (ended ones are dropped after :meth:`poll`
        reported them; :meth:`request` and :meth:`state` still answer for recent ones)."""
        return [r.view() for r in self._table]

    def page_table(self, request_id: str) -> PageMap:
        """The device page table: history groups cover tokens ``0 .. reserved`` (canonical
        pages of published units, then its own); state groups hold its working state."""
        return self._table.page_table(self._table.get(request_id))

    def allows(self, request_id: str, call: str) -> bool:
        """Whether ``call`` (``"admit"``, ``"reserve"``, ``"step_done"``, ``"layer_ready"``) is
        accepted in the request's state, as the spec's ``[request.calls]`` declares
        (UsageError: unknown request or call)."""
        if call not in CALLS:
            raise UsageError(f"allows: call must be one of {sorted(CALLS)}, got {call!r}")
        return self._table.get(request_id).state in CALLS[call]

    @property
    def table(self) -> RequestTable:
        """The request table (read its records; change them only through this facade)."""
        return self._table

    @property
    def aborted_by_scheduler(self) -> int:
        """Requests aborted by :meth:`abort_victim` or by a failed retract writeback."""
        return self._victims + self._router.aborted_by_scheduler

    def in_flight(self) -> bool:  # any operation or forward result outstanding
        return bool(self.core.ops_in_flight()) or self._table.owes_forward()

    def outstanding(self) -> Outstanding:
        """What the cache still holds or owes: requests tracked, forward results, operations,
        commands not handed out, unreported events, receipts and device pages held outside
        the tree, host pages reserved and the L3 tier's work (:class:`Outstanding`; cost
        grows with what is held, never capacity)."""
        out = self._table.outstanding()
        if self.l3 is None:
            return out
        l3 = self.l3.outstanding()
        return replace(out, store_operations=l3.operations, store_commands=l3.commands, prefetches=l3.prefetches)

    def quiescent(self) -> bool:
        """True when nothing is held or owed (:attr:`Outstanding.quiescent`): after an
        engine drained (every request ended, completions delivered, :meth:`poll` called),
        ``assert cache.quiescent(), cache.outstanding()`` checks that nothing leaked."""
        return self.outstanding().quiescent

    def check_invariants(self) -> None:
        """The core's invariants plus the requests' (:func:`kvtier.fsm.request.fence.check_all`):
        raises InvariantViolation naming the invariant and the request or node."""
        check_all(self._table)

    def stats(self) -> dict[str, Any]:
        """The core's counters, scheduler aborts, and ``"facade"``: the requests' (FacadeCounters.as_dict)."""
        s = {k: v for k, v in vars(self.core.stats).items() if k != "extra"}
        return {**s, "scheduler_aborts": self.aborted_by_scheduler, "facade": self._table.counters.as_dict()}
