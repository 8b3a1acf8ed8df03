"""Hypothesis stateful test of the fake-asynchronous backend through the engine.

Rules read like the stream rules: commands may be submitted and flushed at any time;
a pending copy may complete (or fail) on either stream at any time, but each stream
completes in issue order; completions may be polled at any time. The model keeps the
bytes every page should hold; invariants: a page with a pending write holds the poison
byte (and reading it is refused), every other page holds the model's bytes, and the
completions follow the protocol (per-chunk layer completions, then one ack).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, Direction, GroupTransfer, TransferCommand
from kvtier.transfer import (
    POISON_BYTE,
    DevicePool,
    FakeAsyncBackend,
    HazardError,
    HostPool,
    NotReadyError,
    PoisonedReadError,
    TransferEngine,
)

L, W = Direction.LOADBACK, Direction.WRITEBACK
LAYERS = (0, 1, 2, 3)
HOST_PAGES, DEV_PAGES = 8, 6
SPEC = CacheGroupSpec("kv", "history", 4, 1, LAYERS, (ComponentSpec("k", 16), ComponentSpec("x", 5)))
SIDE = {("src", L): "host", ("dst", L): "device", ("src", W): "device", ("dst", W): "host"}


@dataclass
class Job:
    stream: Direction
    ops: tuple[int, ...]
    chunk: int
    layers: tuple[int, ...]
    seq: int = 0


@dataclass
class Flight:
    direction: Direction
    ops: tuple[int, ...]
    jobs: list[Job]
    done: int = 0            # leading jobs completed
    failed_at: int | None = None
    reported: int = 0        # layer completions reported (per op, same for all)
    acked: bool = False


@dataclass
class Model:
    pages: dict[tuple[str, str, int], torch.Tensor] = field(default_factory=dict)  # (side, comp, layer) -> [pages, pb]
    pairs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    direction: dict[int, Direction] = field(default_factory=dict)


class FakeAsyncMachine(RuleBasedStateMachine):
    engine: TransferEngine
    fake: FakeAsyncBackend

    @initialize(chunk_layers=st.sampled_from([1, 2, 4]))
    def setup(self, chunk_layers: int) -> None:
        host = HostPool([SPEC], HOST_PAGES)
        dev = DevicePool.allocate([SPEC], DEV_PAGES, "cpu")
        g = torch.Generator().manual_seed(0)
        self.m = Model()
        for side, pool in (("host", host), ("device", dev)):
            for k in pool.keys():
                r = pool.region(*k)
                r.copy_(torch.randint(0, 256, tuple(r.shape), generator=g, dtype=torch.uint8))
                self.m.pages[(side, k[1], k[2])] = r.clone()
        self.engine = TransferEngine([SPEC], host, dev, "fake-async", chunk_layers=chunk_layers)
        assert isinstance(self.engine.backend, FakeAsyncBackend)
        self.fake = self.engine.backend
        self.chunks = [LAYERS[i:i + chunk_layers] for i in range(0, len(LAYERS), chunk_layers)]
        self.queue: dict[Direction, list[int]] = {L: [], W: []}
        self.streams: dict[Direction, list[Job]] = {L: [], W: []}
        self.flights: list[Flight] = []
        self.next_op = 1
        self.seq = 0
        self.comps: dict[int, list[Completion]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _access(self, direction: Direction, ops: list[int] | tuple[int, ...]) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        reads = {(SIDE[("src", direction)], s) for op in ops for s, _ in self.m.pairs[op]}
        writes = {(SIDE[("dst", direction)], d) for op in ops for _, d in self.m.pairs[op]}
        return reads, writes

    def _hazard(self, new: dict[Direction, list[int]], with_pending: bool = True) -> bool:
        """Would issuing ``new`` touch pages the other stream uses (pending, or new)?"""
        for d, ops in new.items():
            if not ops:
                continue
            r, w = self._access(d, ops)
            other = W if d is L else L
            pend = ([op for j in self.streams[other] for op in j.ops] if with_pending else []) + new[other]
            orr, ow = self._access(other, pend) if pend else (set(), set())
            if w & ow or w & orr or r & ow:
                return True
        return False

    def _pending_write(self, side: str, page: int, layer: int) -> bool:
        return any(layer in j.layers and (side, page) in self._access(j.stream, j.ops)[1]
                   for s in self.streams.values() for j in s)

    # -- rules -------------------------------------------------------------------------------
    @rule(direction=st.sampled_from([L, W]), data=st.data())
    def submit(self, direction: Direction, data: st.DataObject) -> None:
        n_src, n_dst = (HOST_PAGES, DEV_PAGES) if direction is L else (DEV_PAGES, HOST_PAGES)
        dsts = data.draw(st.lists(st.integers(0, n_dst - 1), min_size=1, max_size=3, unique=True))
        srcs = data.draw(st.lists(st.integers(0, n_src - 1), min_size=len(dsts), max_size=len(dsts)))
        pairs = list(zip(srcs, dsts))
        other = W if direction is L else L
        # commands of one flush never conflict with each other (that is a plan test's job)
        taken = {d for op in self.queue[direction] for _, d in self.m.pairs[op]}
        if taken & set(dsts):
            return
        op = self.next_op
        self.m.pairs[op] = pairs
        if self._hazard({direction: self.queue[direction] + [op], other: self.queue[other]}, with_pending=False):
            del self.m.pairs[op]  # would conflict within one flush: never flushable
            return
        self.next_op += 1
        self.m.direction[op] = direction
        self.engine.submit(TransferCommand(op, direction, (GroupTransfer("kv", tuple(srcs), tuple(dsts)),), ()))
        self.queue[direction].append(op)
        self.comps[op] = []

    @precondition(lambda self: self.queue[L] or self.queue[W])
    @rule()
    def flush(self) -> None:
        if self._hazard(self.queue):
            with pytest.raises(HazardError):
                self.engine.flush()
            assert set(self.engine.queued) == set(self.queue[L] + self.queue[W])
            return
        self.engine.flush()
        for d in (L, W):
            ops = tuple(self.queue[d])
            if not ops:
                continue
            chunks = self.chunks if d is L else [LAYERS]
            jobs = [Job(d, ops, i, tuple(c), seq=self.seq + i) for i, c in enumerate(chunks)]
            self.seq += len(jobs)
            self.streams[d] += jobs
            self.flights.append(Flight(d, ops, jobs))
            side = SIDE[("dst", d)]
            for op in ops:
                for _, dp in self.m.pairs[op]:
                    for layer in LAYERS:
                        for comp in ("k", "x"):
                            self.m.pages[(side, comp, layer)][dp] = POISON_BYTE
            self.queue[d] = []
        got = [(p.stream, p.op_ids, p.chunk, p.layers) for p in self.fake.pending()]
        want = [(j.stream, j.ops, j.chunk, j.layers)
                for j in sorted((j for q in self.streams.values() for j in q), key=lambda j: j.seq)]
        assert got == want

    @precondition(lambda self: self.streams[L] or self.streams[W])
    @rule(stream=st.sampled_from([L, W, None]), fail=st.booleans())
    def complete(self, stream: Direction | None, fail: bool) -> None:
        heads = [(s, q[0]) for s, q in self.streams.items() if q and (stream is None or s is stream)]
        if not heads:
            return
        s = min(heads, key=lambda h: h[1].seq)[0]  # the backend picks the older head
        job = self.streams[s][0]
        if fail:
            self.fake.fail_next(s)
        info = self.fake.complete_next(s)
        assert info is not None and (info.stream, info.op_ids, info.chunk, info.layers) == (
            job.stream, job.ops, job.chunk, job.layers)
        self.streams[s].pop(0)
        src_side, dst_side = SIDE[("src", s)], SIDE[("dst", s)]
        if not fail:
            for op in job.ops:
                for sp, dp in self.m.pairs[op]:
                    for layer in job.layers:
                        for comp in ("k", "x"):
                            self.m.pages[(dst_side, comp, layer)][dp] = self.m.pages[(src_side, comp, layer)][sp]
        fl = next(f for f in self.flights if job in f.jobs)
        if fail and fl.failed_at is None:
            fl.failed_at = fl.done
        fl.done += 1

    @rule()
    def poll(self) -> None:
        got = self.engine.poll_completions()
        want: list[Completion] = []
        for fl in self.flights:
            ok_chunks = fl.done if fl.failed_at is None else fl.failed_at
            if fl.direction is L:
                while fl.reported < ok_chunks:
                    layer = fl.jobs[fl.reported].layers[-1]
                    want += [Completion(op, 0, True, layer) for op in fl.ops]
                    fl.reported += 1
            if fl.done == len(fl.jobs) and not fl.acked:
                want += [Completion(op, 0, fl.failed_at is None) for op in fl.ops]
                fl.acked = True
        assert sorted(got, key=repr) == sorted(want, key=repr)
        for c in got:  # per op: ascending layers, then one ack, nothing after it
            prior = self.comps[c.op_id]
            assert not prior or prior[-1].layer is not None
            if c.layer is not None and prior:
                assert prior[-1].layer is not None and c.layer > prior[-1].layer
            prior.append(c)
        self.flights = [f for f in self.flights if not f.acked]

    @rule(side=st.sampled_from(["host", "device"]), layer=st.sampled_from(LAYERS), data=st.data())
    def read(self, side: str, layer: int, data: st.DataObject) -> None:
        page = data.draw(st.integers(0, (HOST_PAGES if side == "host" else DEV_PAGES) - 1))
        if self._pending_write(side, page, layer):
            with pytest.raises(PoisonedReadError):
                self.engine.read_pages(side, "kv", "k", layer, [page])
        else:
            got = self.engine.read_pages(side, "kv", "k", layer, [page])
            assert torch.equal(got[0], self.m.pages[(side, "k", layer)][page])

    @precondition(lambda self: any(f.direction is L and not f.acked for f in self.flights))
    @rule(data=st.data())
    def wait_layer(self, data: st.DataObject) -> None:
        fl = data.draw(st.sampled_from([f for f in self.flights if f.direction is L and not f.acked]))
        layer = data.draw(st.sampled_from(LAYERS))
        chunk = next(i for i, j in enumerate(fl.jobs) if layer in j.layers)
        if chunk < fl.done:
            self.engine.wait_layer(fl.ops[0], layer)
        else:
            with pytest.raises(NotReadyError):
                self.engine.wait_layer(fl.ops[0], layer)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def bytes_match_the_model(self) -> None:
        if not hasattr(self, "engine"):
            return
        for side, pool in (("host", self.engine.host), ("device", self.engine.device)):
            for k in pool.keys():
                assert torch.equal(pool.region(*k), self.m.pages[(side, k[1], k[2])]), (side, k)

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.fake.complete_all()
            self.engine.poll_completions()


FakeAsyncMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestFakeAsync = FakeAsyncMachine.TestCase
