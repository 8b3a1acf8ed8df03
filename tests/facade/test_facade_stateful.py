"""Model-based stateful test of the facade, :class:`kvtier.tiered.TieredCache` (issue 4).

The machine plays a scheduler and a transfer engine around one TieredCache: random
arrivals with shared-prefix unit keys from a small alphabet, admission, chunked prefill
and decode reservations, forward results (some discarded), finishes, retractions,
resumes, client aborts at every point (while loading, retracting, finishing), completions
delivered in random order across ops and ranks with per-layer progress and random
failures, deadlines, victim aborts, bad calls, and capacity pressure from tiny device and
host pools; with a history-only layout and a history + continuation-state layout, world
size 1 and 2.

After every step the core's and the facade's invariants hold, tree writebacks in flight
respect ``max_writebacks_in_flight``, ``layer_ready`` agrees with the layer completions
delivered, and a byte model (content keyed by prefix, moved by acknowledged transfers)
checks that every full page a running request's page table lists holds the bytes written
for that prefix (invariant 12 as the engine sees it). At teardown everything still alive
is aborted, every owed forward result is reported and every completion delivered: then no
page is held outside the tree, nothing is locked, pinned or borrowed, no operation is in
flight, every request ended exactly once and ``poll()`` leaves no request behind.

``TestFacadeShortRun`` runs the same machine for few examples (the mutation run's subset,
bench/mutation/tests.txt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from core_helpers import snapshot
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, Direction, Family, GuardRejected, KvtierError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.machines import request_lifecycle
from kvtier.fsm.node import DEVICE_READABLE, HOST_VISIBLE
from kvtier.tiered import TERMINAL, TieredCache

ALPHABET = "ab"
NUM_LAYERS = 3
#: request states an abort is accepted in (the spec's abort rows)
ABORTABLE = tuple(s for s in request_lifecycle().spec.state_names if request_lifecycle().allowed(s, "abort"))
ALIGN = 4  # lcm of kv (2 tokens/page) and c4 (4 tokens/page)
ENDED = ("finished", "aborted")


def layout(with_state: bool) -> CacheLayout:
    """kv: 2 tokens per page (2 pages per unit); c4: 4 tokens per page (1 page per unit);
    swa (optional): continuation state of layer 0, window 4 (2 pages per checkpoint; a
    history-replay span of 4 tokens)."""
    groups = [
        CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1, 2), (ComponentSpec("k", 64),)),
        CacheGroupSpec("c4", Family.HISTORY, 1, 4, (1, 2), (ComponentSpec("c", 32),)),
    ]
    if with_state:
        groups.append(CacheGroupSpec("swa", Family.STATE, 2, 1, (0,), (ComponentSpec("s", 64),), window=4))
    return CacheLayout("facade-test", tuple(groups), NUM_LAYERS)


@dataclass
class Req:
    """The engine's view of one request."""

    rid: str
    prompt_units: list[str]
    decode_units: list[str]
    prompt_tokens: int
    chunk: int
    known: int = 0  # unit keys the facade has been given
    serial: int = 0  # bumped on every (re)admission/resume: older forward passes are stale
    fwd: list[tuple[int, int]] = field(default_factory=list)  # planned (tokens, serial), FIFO
    ckpt: dict[str, list[int]] = field(default_factory=dict)  # checkpoint it copies in its next pass
    ckpt_units: int = 0

    @property
    def units(self) -> list[str]:
        return self.prompt_units + self.decode_units

    @property
    def max_tokens(self) -> int:
        # every full unit reached must have a key: tokens < (len(units) + 1) * ALIGN
        return max(self.prompt_tokens, len(self.units) * ALIGN + ALIGN - 1)


class FacadeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredCache
        self.reqs: dict[str, Req] = {}
        self.next_id = 0
        self.world = 1
        self.queues: dict[int, list[list[Completion]]] = {}  # op -> per-rank completions
        self.commands: dict[int, Any] = {}
        self.delivered: dict[int, dict[int, int]] = {}  # loadback op -> rank -> highest layer delivered
        self.dev_bytes: dict[tuple[str, int], Any] = {}
        self.host_bytes: dict[tuple[str, int], Any] = {}
        self.blocked: set[str] = set()
        self.ended: dict[str, int] = {}  # terminal events seen per request
        self.reasons: dict[str, str | None] = {}
        self.victims: set[str] = set()

    # ------------------------------------------------------------------ setup
    @initialize(with_state=st.booleans(), world=st.sampled_from([1, 2]),
                policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                dev_units=st.integers(4, 12), host_units=st.sampled_from([None, 3, 6, 10, 16]),
                deadline=st.sampled_from([None, None, 2, 4]), max_wb=st.sampled_from([1, 2]),
                finish_writeback=st.sampled_from([None, True, False]),
                seeds=st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4), max_size=3),
                demote=st.booleans(), replay=st.booleans())
    def setup(self, with_state: bool, world: int, policy: str, dev_units: int, host_units: int | None,
              deadline: int | None, max_wb: int, finish_writeback: bool | None, seeds: list[list[str]],
              demote: bool, replay: bool) -> None:
        self.world = world
        self.cache = TieredCache(layout(with_state), dev_units, host_units, policy=policy, world_size=world,
                                 max_writebacks_in_flight=max_wb, op_deadline_steps=deadline,
                                 finish_writeback=finish_writeback, history_replay=replay)
        self.hist = [g.name for g in self.cache.layout.history_groups]
        self.state_groups = [g.name for g in self.cache.layout.state_groups]
        self.ppu = {g.name: self.cache.layout.pages_per_unit(g) for g in self.cache.layout.history_groups}
        event(f"layout {'history+state' if with_state else 'history-only'}, world {world}")
        # warm the tree: requests that ran to the end, written back, maybe demoted
        c = self.cache
        for units in seeds:
            r = Req(f"s{self.next_id:02d}", units, [], len(units) * ALIGN + 1, len(units) * ALIGN + 1)
            self.next_id += 1
            self.reqs[r.rid] = r
            self._admit(r)
            if self._state(r.rid) == "running":
                tokens, _ = r.fwd.pop(0)
                self._write(r, c.request(r.rid).tokens, tokens)
                r.ckpt = {}
                self._fill(r, c.step_done(r.rid, tokens, checkpoint=True))
                self._fill(r, c.finish(r.rid))
        for n in sorted(c.core.nodes(), key=lambda n: n.depth):
            c.core.writeback(n)
        self._drain_ok()
        if demote:
            c.core.evict_device({g: 10**6 for g in c.core.device})
        c.check_invariants()

    def _drain_ok(self) -> None:
        """Poll and acknowledge everything successfully (layer by layer)."""
        while True:
            self._poll()
            if not self.queues:
                return
            for op in sorted(self.queues):
                for q in self.queues.pop(op):
                    for ev in q:
                        self._complete(ev)

    # ------------------------------------------------------------------ helpers
    def _ids(self, *states: str, owed: bool | None = None) -> list[str]:
        out = []
        for rid in sorted(self.reqs):
            try:
                v = self.cache.request(rid)
            except KvtierError:
                continue
            if v.state in states and (owed is None or (v.owed_forward > 0) == owed):
                out.append(rid)
        return out

    def _state(self, rid: str) -> str | None:
        try:
            return self.cache.request(rid).state
        except KvtierError:
            return None

    def _content(self, units: list[str], g: str, j: int) -> tuple[Any, ...]:
        """What page ``j`` of history group ``g`` holds for a request with these units."""
        u = j // self.ppu[g]
        return (tuple(units[: u + 1]), g, j % self.ppu[g])

    def _settle_bytes(self, before: dict[int, Any], fails_before: int) -> None:
        """Apply the byte effect of operations that settled since ``before``."""
        ops = self.cache.core.operations()
        gone = [op for op in before if op not in ops]
        assert len(gone) <= 1 or fails_before < 0
        for op_id in gone:
            cmd = before[op_id].command
            st_ = self.cache.core.stats
            ok = fails_before >= 0 and st_.writeback_failures + st_.loadback_failures == fails_before
            src, dst = ((self.dev_bytes, self.host_bytes) if cmd.direction is Direction.WRITEBACK
                        else (self.host_bytes, self.dev_bytes))
            for t in cmd.transfers:
                for s, d in zip(t.src_pages, t.dst_pages):
                    dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", op_id)
            self.delivered.pop(op_id, None)
            event(f"{cmd.direction.value} {'acked' if ok else 'failed'}")

    def _fails(self) -> int:
        s = self.cache.core.stats
        return s.writeback_failures + s.loadback_failures

    def _take(self, commands: tuple[Any, ...], chunked: bool) -> None:
        for cmd in commands:
            self.commands[cmd.op_id] = cmd
            layers = (1, NUM_LAYERS - 1) if chunked else tuple(range(NUM_LAYERS))
            qs = []
            for rank in range(self.world):
                q: list[Completion] = []
                if cmd.direction is Direction.LOADBACK:
                    q += [Completion(cmd.op_id, rank, True, layer) for layer in layers]
                q.append(Completion(cmd.op_id, rank, True, None))
                qs.append(q)
            self.queues[cmd.op_id] = qs
            if cmd.direction is Direction.LOADBACK:
                self.delivered[cmd.op_id] = {}

    def _poll(self, chunked: bool = False) -> None:
        core = self.cache.core
        out = self.cache.poll()
        dirs = [c.direction for c in out.commands]
        assert dirs == sorted(dirs, key=lambda d: d is not Direction.LOADBACK), "loadbacks first"
        self._take(out.commands, chunked)
        for e in out.events:
            if e.state in ENDED:
                self.ended[e.request_id] = self.ended.get(e.request_id, 0) + 1
                self.reasons[e.request_id] = e.reason
                assert self.ended[e.request_id] == 1, f"request {e.request_id} ended twice"
                assert (e.reason is not None) == (e.state == "aborted")
                if e.reason == "retract writeback failed":
                    event("retract writeback failed -> aborted")
        for rid in self.reqs:
            if self.ended.get(rid):
                # an ended request is forgotten once reported and settled (request() and
                # state() still answer from the bounded history of ended requests)
                v = self.cache.table.find(rid)
                assert v is None or v.owed_forward > 0 or v.ops, f"{rid} still tracked after poll: {v}"
                assert self.cache.state(rid) in TERMINAL or v is not None
        assert core.poll_commands() == []

    def _admitted(self, r: Req, adm: Any) -> None:
        self.blocked.discard(r.rid)
        r.serial += 1
        r.fwd.append((adm.chunk_tokens, r.serial))
        assert adm.chunk_tokens >= 1 and adm.start_token == adm.hit_tokens
        assert adm.page_table == self.cache.page_table(r.rid)
        if adm.loadback_op is not None or adm.wait_ops:
            event("admitted with loadback" if adm.loadback_op is not None else "admitted joining a loadback")
            assert self._state(r.rid) == "loading"
        else:
            assert self._state(r.rid) == "running"
            self._check_table(r)
            if adm.recompute_tokens:
                event("admitted with a history-replay span")
                assert adm.checkpoint_pages == {}
            elif adm.hit_tokens and self.state_groups:
                # exact continuation state (invariant 15): the hit ends at a checkpoint
                assert set(adm.checkpoint_pages) == set(self.state_groups), adm
                r.ckpt, r.ckpt_units = adm.checkpoint_pages, adm.start_token // ALIGN
                self._check_ckpt(r)
                event("admitted on a device checkpoint")
        if adm.hit_tokens:
            event("admitted with a prefix hit")

    def _check_ckpt(self, r: Req) -> None:
        """The checkpoint the request copies holds the state for exactly its hit."""
        for g, pages in r.ckpt.items():
            for k, p in enumerate(pages):
                got = self.dev_bytes.get((g, p))
                want = ("state", tuple(r.units[: r.ckpt_units]), g, k)
                assert got == want, f"exact_continuation_state: request {r.rid} checkpoint {g} page {p}: {got}"

    def _fill(self, r: Req, adopted: dict[str, list[int]]) -> None:
        """The engine copies its continuation state into checkpoint pages the tree adopted."""
        if adopted:
            v = self.cache.request(r.rid)
            n = min(v.tokens // ALIGN, r.known)
            assert n > 0
            for g, pages in adopted.items():
                for k, p in enumerate(pages):
                    self.dev_bytes[(g, p)] = ("state", tuple(r.units[:n]), g, k)
            event("checkpoint adopted")

    def _write(self, r: Req, tokens: int, computed: int) -> int:
        """The forward pass writes the units it completes into the request's pages."""
        table = self.cache.page_table(r.rid)
        before, after = tokens // ALIGN, (tokens + computed) // ALIGN
        for u in range(before, after):
            for g in self.hist:
                for k in range(self.ppu[g]):
                    j = u * self.ppu[g] + k
                    self.dev_bytes[(g, table[g][j])] = self._content(r.units, g, j)
        return after

    def _check_table(self, r: Req) -> None:
        """Every full unit the request has must be on pages holding that prefix's bytes."""
        v = self.cache.request(r.rid)
        table = self.cache.page_table(r.rid)
        full = v.tokens // ALIGN
        for g in self.hist:
            assert len(table[g]) * self.cache.layout.group(g).tokens_per_page >= v.reserved_tokens
            for j in range(full * self.ppu[g]):
                got = self.dev_bytes.get((g, table[g][j]))
                assert got == self._content(r.units, g, j), (
                    f"loaded_equals_written: request {r.rid} group {g} page #{j} ({table[g][j]}) holds {got}")

    # ------------------------------------------------------------------ arrivals and admission
    @rule(units=st.lists(st.sampled_from(ALPHABET), max_size=5), tail=st.integers(0, ALIGN - 1),
          decode=st.lists(st.sampled_from(ALPHABET), max_size=2), chunk=st.integers(1, 12))
    def arrive(self, units: list[str], tail: int, decode: list[str], chunk: int) -> None:
        prompt = max(1, len(units) * ALIGN + tail)
        rid = f"r{self.next_id:02d}"
        self.next_id += 1
        r = Req(rid, units, decode, prompt, chunk)
        self.reqs[rid] = r
        self._admit(r)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 100), extra=st.lists(st.sampled_from(ALPHABET), max_size=2),
          tail=st.integers(0, ALIGN - 1), chunk=st.integers(1, 12))
    def arrive_like(self, i: int, extra: list[str], tail: int, chunk: int) -> None:
        """A new request sharing another one's prompt (device hits, joins, duplicates)."""
        ids = sorted(self.reqs)
        other = self.reqs[ids[i % len(ids)]]
        self.arrive(units=other.prompt_units + extra, tail=tail, decode=[], chunk=chunk)

    def _admit(self, r: Req) -> None:
        c = self.cache
        ext_before = {g: len(c.core.external_pages(g)) for g in c.core.device}
        receipts_before = sorted(i for v in c.requests() for i in v.receipts)
        adm = c.admit(r.rid, r.prompt_units, prompt_tokens=r.prompt_tokens, chunk_tokens=r.chunk)
        r.known = len(r.prompt_units)
        if adm is None:
            event("admission blocked")
            self.blocked.add(r.rid)
            v = c.request(r.rid)
            assert (v.state, v.owed_forward, v.ops, v.reserved_tokens) == ("waiting", 0, (), 0)
            assert {g: len(c.core.external_pages(g)) for g in c.core.device} == ext_before, "admission leaked"
            assert sorted(i for v in c.requests() for i in v.receipts) == receipts_before
            return
        self._admitted(r, adm)

    @precondition(lambda self: bool(self._ids("waiting", owed=False)))
    @rule(i=st.integers(0, 100))
    def readmit(self, i: int) -> None:
        ids = [rid for rid in self._ids("waiting", owed=False) if not self.cache.request(rid).ops]
        if ids:
            self._admit(self.reqs[ids[i % len(ids)]])

    @precondition(lambda self: bool(self._ids("running", "loading", owed=False)))
    @rule(i=st.integers(0, 100))
    def reserve(self, i: int) -> None:
        ids = self._ids("running", "loading", owed=False)
        r = self.reqs[ids[i % len(ids)]]
        v = self.cache.request(r.rid)
        if v.tokens >= r.max_tokens:
            return
        amount = min(r.chunk, r.prompt_tokens - v.tokens) if v.tokens < r.prompt_tokens else 1
        table = self.cache.reserve(r.rid, amount)
        if table is None:
            event("reserve blocked")
            self.blocked.add(r.rid)
            assert self.cache.request(r.rid) == v
            return
        self.blocked.discard(r.rid)
        r.fwd.append((amount, r.serial))
        assert self.cache.request(r.rid).reserved_tokens >= v.tokens + amount

    @precondition(lambda self: any(r.fwd for r in self.reqs.values()))
    @rule(i=st.integers(0, 100), discard=st.sampled_from([False, False, False, True]), checkpoint=st.booleans())
    def forward_done(self, i: int, discard: bool, checkpoint: bool = True) -> None:
        ids = [rid for rid, r in sorted(self.reqs.items()) if r.fwd]
        r = self.reqs[ids[i % len(ids)]]
        v = self.cache.request(r.rid)
        assert v.owed_forward == len(r.fwd)
        tokens, serial = r.fwd[0]
        live = v.state in ("running", "loading") and serial == r.serial
        if live and v.state == "loading" and not discard:
            if not self.cache.layer_ready(r.rid, NUM_LAYERS - 1):
                return  # the forward pass still waits on a layer
            event("forward pass of a loading request")
        computed = tokens if live and not discard else 0
        if v.state == "running" and computed:
            self._check_table(r)
        new_units: list[str] = []
        if computed:
            after = self._write(r, v.tokens, computed)
            if after > r.known:
                new_units = r.units[r.known:after]
                r.known = after
        r.fwd.pop(0)
        if r.ckpt:
            self._check_ckpt(r)  # its forward pass copies the checkpoint: still intact
            r.ckpt = {}
        adopted = self.cache.step_done(r.rid, computed, new_units=new_units, checkpoint=checkpoint)
        self._fill(r, adopted)
        if not computed:
            event("forward result discarded")
        w = self.cache.request(r.rid)
        assert w.tokens == v.tokens + computed or w.state not in ("running", "loading")

    def _loading_ready(self) -> list[str]:
        return [rid for rid in self._ids("loading", owed=True)
                if self.cache.layer_ready(rid, NUM_LAYERS - 1) and self.reqs[rid].fwd[0][1] == self.reqs[rid].serial]

    @precondition(lambda self: bool(self._loading_ready()))
    @rule(i=st.integers(0, 100))
    def forward_loading(self, i: int) -> None:
        """The forward pass of a loading request whose layers are all complete returns
        before the loadback's acknowledgement."""
        ids = self._loading_ready()
        rid = ids[i % len(ids)]
        owners = sorted(r for r, q in self.reqs.items() if q.fwd)
        self.forward_done(owners.index(rid), discard=False)

    @rule()
    def batch_step(self) -> None:
        """A whole scheduler step: reserve for every running or loading request, then
        every forward pass that can complete returns."""
        for rid in self._ids("running", "loading", owed=False):
            ids = self._ids("running", "loading", owed=False)
            if rid in ids:
                self.reserve(ids.index(rid))
        for rid in sorted(self.reqs):
            r = self.reqs[rid]
            if r.fwd and (self._state(rid) != "loading" or self.cache.layer_ready(rid, NUM_LAYERS - 1)):
                owners = sorted(k for k, q in self.reqs.items() if q.fwd)
                self.forward_done(owners.index(rid), discard=False)

    # ------------------------------------------------------------------ ends
    @precondition(lambda self: bool(self._ids("running", owed=False)))
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        ids = self._ids("running", owed=False)
        rid = ids[i % len(ids)]
        self._fill(self.reqs[rid], self.cache.finish(rid))
        self.blocked.discard(rid)
        st_ = self._state(rid)
        assert st_ in ("finishing", "finished")
        event(f"finish -> {st_}")

    @precondition(lambda self: bool(self._ids("running", owed=True)))
    @rule(i=st.integers(0, 100), finish=st.booleans())
    def retract_refused(self, i: int, finish: bool) -> None:
        """Retract (or finish) with a forward pass out is refused by the guard ``settled``
        and changes nothing (forward_fence): the pass may still write into its pages."""
        ids = self._ids("running", owed=True)
        rid = ids[i % len(ids)]
        snap = self._snap()
        with pytest.raises(GuardRejected) as exc:
            (self.cache.finish if finish else self.cache.retract)(rid)
        assert exc.value.guards == ("settled",) and repr(rid) in str(exc.value)
        assert self._snap() == snap
        event("finish/retract refused with a pass out")

    @precondition(lambda self: bool(self._ids("running", owed=False)))
    @rule(i=st.integers(0, 100))
    def retract(self, i: int) -> None:
        ids = self._ids("running", owed=False)
        r = self.reqs[ids[i % len(ids)]]
        c = self.cache
        self._fill(r, c.retract(r.rid))
        self.blocked.discard(r.rid)
        v = c.request(r.rid)
        assert v.state in ("retracting", "retracted")
        # unlike the original, retract releases the request's own device pages at once
        assert v.own_pages == {} and v.owed_forward == 0, "retract keeps own device pages"
        event(f"retract -> {v.state}{' with a forward owed' if v.owed_forward else ''}")

    @precondition(lambda self: bool(self._ids("retracted")))
    @rule(i=st.integers(0, 100))
    def resume(self, i: int) -> None:
        ids = self._ids("retracted")
        r = self.reqs[ids[i % len(ids)]]
        adm = self.cache.resume(r.rid, chunk_tokens=r.chunk)
        if adm is None:
            event("resume blocked")
            self.blocked.add(r.rid)
            assert self._state(r.rid) == "retracted"
            return
        event("resumed with a hit" if adm.hit_tokens else "resumed from scratch")
        self._admitted(r, adm)

    @precondition(lambda self: bool(self._ids(*ABORTABLE)))
    @rule(i=st.integers(0, 100))
    def abort(self, i: int | str) -> None:
        ids = self._ids(*ABORTABLE)
        rid = i if isinstance(i, str) else ids[i % len(ids)]
        before = self._state(rid)
        self.cache.abort(rid, "client abort")
        self.blocked.discard(rid)
        after = self._state(rid)
        event(f"abort in {before} -> {after}")
        assert after in ("aborting", "aborted")
        v = self.cache.request(rid)
        assert (after == "aborted") == (v.owed_forward == 0 and not v.ops) or before in ("waiting", "retracted")

    @precondition(lambda self: bool(self._ids("loading", "retracting", "finishing")))
    @rule(i=st.integers(0, 100))
    def abort_busy(self, i: int) -> None:
        """Aborts while the request's own loadback or writeback is in flight."""
        ids = self._ids("loading", "retracting", "finishing")
        self.abort(i=ids[i % len(ids)])

    @rule(g=st.sampled_from(["kv", "c4"]), n=st.integers(1, 12))
    def pressure(self, g: str, n: int) -> None:
        """Another tenant of the device pool: evict (demote) unlocked tree pages."""
        self.cache.core.evict_device({g: n})

    @rule()
    def victim(self) -> None:
        c = self.cache
        blocked = [rid for rid in sorted(self.blocked) if self._state(rid) in ("waiting", "running", "retracted")]
        if not blocked:
            return
        busy = c.in_flight()
        snap = self._snap() if busy else None
        got = c.abort_victim(blocked)
        if busy:
            assert got is None and self._snap() == snap, "victim abort while something is in flight"
            return
        views = [c.request(b) for b in blocked]
        want = min(views, key=lambda v: (-max(v.tokens, self.reqs[v.request_id].prompt_tokens), v.request_id))
        assert got == want.request_id
        assert self._state(got) == "aborted"
        self.victims.add(got)
        self.blocked.discard(got)
        event("victim aborted")

    # ------------------------------------------------------------------ the transfer engine
    @rule(chunked=st.booleans())
    def poll(self, chunked: bool) -> None:
        self._poll(chunked)

    @precondition(lambda self: any(any(q) for qs in self.queues.values() for q in qs))
    @rule(i=st.integers(0, 1000), ok=st.sampled_from([True, True, True, True, False]))
    def deliver(self, i: int, ok: bool) -> None:
        ready = [(op, rank) for op, qs in sorted(self.queues.items()) for rank, q in enumerate(qs) if q]
        op, rank = ready[i % len(ready)]
        ev = self.queues[op][rank].pop(0)
        ev = Completion(ev.op_id, ev.rank, ok, ev.layer)
        if not any(self.queues[op]):
            del self.queues[op]
        self._complete(ev)

    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=6), chunked=st.booleans())
    def engine_round(self, picks: list[int], chunked: bool) -> None:
        """The engine polls, then some completions arrive (in random order)."""
        self._poll(chunked)
        for i in picks:
            if self.queues:
                self.deliver(i, ok=i % 11 != 0)

    @precondition(lambda self: bool(self.queues))
    @rule(i=st.integers(0, 100))
    def layers_progress(self, i: int) -> None:
        """A loadback's layer completions arrive on every rank (its acknowledgement later)."""
        ops = sorted(op for op, qs in self.queues.items() if any(q and q[0].layer is not None for q in qs))
        if not ops:
            return
        op = ops[i % len(ops)]
        for q in self.queues[op]:
            while q and q[0].layer is not None:
                self._complete(q.pop(0))

    @precondition(lambda self: bool(self.queues))
    @rule(i=st.integers(0, 100))
    def fail_own_writeback(self, i: int) -> None:
        """A rank reports a request's own writeback (finish or retract) as failed."""
        ops = sorted(op for op in self.queues if self.commands[op].direction is Direction.WRITEBACK
                     and self.commands[op].request_id is not None)
        if not ops:
            return
        op = ops[i % len(ops)]
        ready = [k for k, q in enumerate(self.queues[op]) if q]
        rank = ready[i % len(ready)]
        ev = self.queues[op][rank].pop(0)
        if not any(self.queues[op]):
            del self.queues[op]
        self._complete(Completion(ev.op_id, ev.rank, False, ev.layer))
        event("own writeback reported failed")

    def _complete(self, ev: Completion) -> None:
        before = self.cache.core.operations()
        fails = self._fails()
        states = {rid: self._state(rid) for rid in self.reqs}
        self.cache.complete(ev)
        if ev.op_id in self.delivered:
            d = self.delivered[ev.op_id]
            if not ev.ok:  # a rank reported the copy failed (a layer or its ack): no layer reads as ready
                d[ev.rank] = -(10**9)
            elif ev.layer is not None and d.get(ev.rank, -1) > -(10**9):
                d[ev.rank] = max(d.get(ev.rank, -1), ev.layer)
        self._settle_bytes(before, fails)
        for rid, s in states.items():
            now = self._state(rid)
            if s == "loading" and now == "waiting":
                event("loadback failed -> waiting")

    @rule(steps=st.integers(1, 3))
    def advance(self, steps: int) -> None:
        before = self.cache.core.operations()
        self.cache.advance_step(steps)
        if len(before) != len(self.cache.core.operations()):
            event("deadline expired an operation")
        self._settle_bytes(before, -1)  # expired: every settled op failed

    @rule(i=st.integers(0, 100), which=st.integers(0, 4))
    def bad_call(self, i: int, which: int) -> None:
        """Refused calls raise a KvtierError naming the request and change nothing."""
        c = self.cache
        ids = sorted(self.reqs)
        calls: list[tuple[str, Any]] = []
        owe_nothing = [r for r in ids if self._state(r) not in (None,) and c.request(r).owed_forward == 0]
        not_retracted = [r for r in ids if self._state(r) not in (None, "retracted")]
        not_running = [r for r in ids if self._state(r) not in (None, "running")]
        aborting = [r for r in ids if self._state(r) == "aborting"]
        if which == 0 or not ids:
            calls.append(("zz-unknown", lambda r: c.abort(r)))
        elif which == 1 and owe_nothing:
            calls.append((owe_nothing[i % len(owe_nothing)], lambda r: c.step_done(r, 0)))
        elif which == 2 and not_retracted:
            calls.append((not_retracted[i % len(not_retracted)], lambda r: c.resume(r, 4)))
        elif which == 3 and not_running:
            calls.append((not_running[i % len(not_running)], lambda r: c.finish(r)))
        elif which == 4 and aborting:
            calls.append((aborting[i % len(aborting)], lambda r: c.abort(r)))
        for rid, call in calls:
            snap = self._snap()
            try:
                call(rid)
            except KvtierError as e:
                assert repr(rid) in str(e), f"error does not name the request: {e}"
            else:
                raise AssertionError(f"bad call {which} on {rid} accepted")
            assert self._snap() == snap, f"bad call {which} on {rid} changed something"

    def _snap(self) -> tuple[Any, ...]:
        c = self.cache
        reqs = sorted((v.request_id, v) for v in c.requests())
        tables = sorted((v.request_id, c.page_table(v.request_id)) for v in c.requests())
        return (reqs, tables, c.table.pending_events(), snapshot(c.core))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.check_invariants()
        tree_wb = [o for o in c.core.operations().values()
                   if o.direction is Direction.WRITEBACK and o.command.request_id is None]
        assert len(tree_wb) <= c.max_writebacks_in_flight
        for v in c.requests():
            r = self.reqs[v.request_id]
            if v.state not in ENDED:
                assert v.owed_forward == len(r.fwd), f"{v.request_id}: owed {v.owed_forward}, engine {len(r.fwd)}"
            if v.state == "loading":
                assert v.ops, f"{v.request_id} loading without an operation"
                for layer in range(NUM_LAYERS):
                    want = all(min(self.delivered.get(op, {}).get(k, -1) for k in range(self.world)) >= layer
                               for op in v.ops)
                    assert c.layer_ready(v.request_id, layer) == want, (
                        f"layer_ready({v.request_id}, {layer}) != {want}")
            elif v.state == "running":
                assert all(c.layer_ready(v.request_id, layer) for layer in range(NUM_LAYERS))
            elif v.state in ("waiting", "fenced", "retracted"):  # nothing readable (forward_fence)
                assert not any(c.layer_ready(v.request_id, layer) for layer in range(NUM_LAYERS))

    @invariant()
    def tree_holds_written_bytes(self) -> None:
        """Every page the tree exposes (device-readable or host-visible) holds the bytes
        written for its prefix: history by the forward passes, checkpoints by the engine
        into the pages the facade said the tree adopted (invariant 12)."""
        if not hasattr(self, "cache"):
            return
        for n in self.cache.core.nodes():
            prefix: list[Any] = []
            for a in reversed(n.path()):
                prefix.extend(a.key)
            lo = len(prefix) - len(n.key)
            stores = []
            if n.state in DEVICE_READABLE:
                stores.append(("device", self.dev_bytes, n.dev, n.dev_ckpt))
            if n.state in HOST_VISIBLE:
                stores.append(("host", self.host_bytes, n.host, n.host_ckpt))
            for pool, store, hist, state in stores:
                for g, pages in hist.items():
                    for i, p in enumerate(pages):
                        got = store.get((g, p))
                        assert got == self._content(prefix, g, lo * self.ppu[g] + i), (
                            f"loaded_equals_written: node {n.node_id} {pool} page {p} of {g}: {got}")
                for g, pages in state.items():
                    for k, p in enumerate(pages):
                        got = store.get((g, p))
                        assert got == ("state", tuple(prefix), g, k), (
                            f"loaded_equals_written: node {n.node_id} {pool} checkpoint page {p} of {g}: {got}")

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        for rid in sorted(self.reqs):
            if self._state(rid) in ABORTABLE:
                c.abort(rid, "teardown")
                c.check_invariants()
        for _ in range(1000):
            for rid, r in sorted(self.reqs.items()):
                while r.fwd:
                    r.fwd.pop(0)
                    c.step_done(rid, 0)
                    c.check_invariants()
            for op in sorted(self.queues):
                for q in self.queues.pop(op):
                    for ev in q:
                        self._complete(ev)
                        c.check_invariants()
            self._poll()
            if not self.queues and not c.core.operations() and not any(r.fwd for r in self.reqs.values()):
                break
        else:
            raise AssertionError("teardown did not drain")
        self._poll()
        core = c.core
        assert c.requests() == [], f"requests left after poll: {c.requests()}"
        assert not core.operations() and not core.receipts.locks() and not core.receipts.node_receipts()
        for g in core.device:
            assert not core.external_pages(g), f"device pages of {g} still held outside the tree"
        for n in core.nodes():
            assert (n.lock_ref, n.borrow_ref, n.host_pin) == (0, 0, 0), f"{n} still held"
            assert n.state in ("device", "backed", "host"), f"{n} left in {n.state}"
        c.check_invariants()  # conservation: free + tree-owned == capacity, per pool and group
        for rid in self.reqs:
            assert self.ended.get(rid) == 1, f"request {rid} ended {self.ended.get(rid, 0)} times"
        for rid in self.victims:
            assert self.reasons[rid] == "cache capacity exhausted"


TestFacadeStateful = FacadeMachine.TestCase
TestFacadeStateful.settings = settings(TestFacadeStateful.settings,
                                       stateful_step_count=max(100, TestFacadeStateful.settings.stateful_step_count),
                                       max_examples=max(150, TestFacadeStateful.settings.max_examples))


class FacadeMachineShortRun(FacadeMachine):
    """The facade machine, few examples: fast enough for every mutant of the request lifecycle."""


TestFacadeShortRun = FacadeMachineShortRun.TestCase


TestFacadeShortRun.settings = settings(TestFacadeShortRun.settings, max_examples=25, stateful_step_count=40)
