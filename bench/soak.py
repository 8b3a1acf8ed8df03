"""Soak: a million random facade operations with faults, then drained to zero (issue 13).

    python bench/soak.py [--ops 1000000] [--seed 1] [--interval 100000] [--record [RESULTS.md]]

A random engine drives one :class:`kvtier.tiered.TieredCache` (world size 2, operation
deadlines of 6 steps) through every call: admissions of prompts that share prefixes (so
hits, loadbacks and joined loadbacks happen), reserves and forward results (chunked
prefill, decode, some passes overlapped), finishes, retracts, resumes, client aborts,
polls and completions. Its transfer engine is hostile: completions arrive per rank and
per layer in random order; 5 % report failure; 2 % are lost (the deadline fails the
operation); 2 % are held back and delivered after the deadline (late, absorbed); 2 % are
sent twice (a duplicate while in flight is refused, after settling absorbed). It also
makes illegal calls on purpose (a step_done with nothing owed, a reserve of a request
that is not running, a resume of one that is not retracted, an unknown request) and
counts them refused.

Every request id is new (the table's bounded history of ended requests is exercised), and
``check_invariants`` runs every 10,000 operations. At each interval it prints the process
RSS (``/proc/self/statm``), the memory tracemalloc traces, and the sizes of what could
grow: requests tracked, the ended-request history, operations in flight, tree nodes. Then
it stops admitting, finishes or aborts every live request, delivers everything, polls, and
asserts :meth:`TieredCache.quiescent` (no request, operation, command, event, receipt or
held page left) and the invariants.

An *operation* is one facade call (``admit``, ``reserve``, ``step_done``, ``finish``,
``retract``, ``resume``, ``abort``, ``complete``, ``advance_step``, ``poll``), refused
illegal calls included.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import provenance, record_section  # noqa: E402

from kvtier.cli.argtypes import positive_int  # noqa: E402
from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, DuplicateCompletion, Family  # noqa: E402
from kvtier.fsm.errors import KvtierError  # noqa: E402
from kvtier.fsm.layout import CacheLayout  # noqa: E402
from kvtier.fsm.records import Direction, TransferCommand  # noqa: E402
from kvtier.tiered import TieredCache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ALIGN = 4  # tokens per unit
WORLD = 2
DEADLINE = 6
FAIL, LOSE, LATE, DUP = 0.05, 0.02, 0.02, 0.02


def layout() -> CacheLayout:
    """History ``kv`` (4 tokens per page) and continuation state ``swa`` (window 4 tokens:
    one page per checkpoint), 2 layers; alignment 4 tokens."""
    kv = CacheGroupSpec("kv", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("k", 64),))
    swa = CacheGroupSpec("swa", Family.STATE, 4, 1, (0, 1), (ComponentSpec("s", 64),), window=4)
    return CacheLayout("soak", (kv, swa), 2)


@dataclass
class Req:
    rid: str
    units: list[tuple[int, int]]
    prompt: int
    output: int
    made: int = 0  # tokens with KV, as the engine counts them


@dataclass
class Engine:
    """The hostile transfer engine: completions per (op, rank), per layer for loadbacks."""

    rng: random.Random
    queue: list[Completion] = field(default_factory=list)
    late: list[tuple[int, Completion]] = field(default_factory=list)  # (step to deliver at, completion)

    def submit(self, cmd: TransferCommand, step: int) -> None:
        for rank in range(WORLD):
            if cmd.direction is Direction.LOADBACK:
                for layer in cmd.layers:
                    self.queue.append(Completion(cmd.op_id, rank, True, layer))
            roll = self.rng.random()
            ack = Completion(cmd.op_id, rank, roll >= FAIL)
            if roll < FAIL + LOSE and roll >= FAIL:
                continue  # lost: the deadline fails the operation
            if FAIL + LOSE <= roll < FAIL + LOSE + LATE:
                self.late.append((step + DEADLINE + 2, ack))  # after the deadline: absorbed
                continue
            self.queue.append(ack)

    def take(self, step: int) -> Completion | None:
        due = [i for i, (at, _) in enumerate(self.late) if at <= step]
        if due:
            return self.late.pop(due[0])[1]
        if not self.queue:
            return None
        # per rank in order (a layer never after its ack); ranks and ops interleave freely
        i = self.rng.randrange(len(self.queue))
        c = self.queue[i]
        first = next(j for j, d in enumerate(self.queue) if d.op_id == c.op_id and d.rank == c.rank)
        return self.queue.pop(first)


@dataclass
class Sample:
    ops: int
    seconds: float
    rss_mb: float
    traced_mb: float
    peak_mb: float
    tracked: int
    history: int
    in_flight: int
    nodes: int


@dataclass
class Soak:
    ops_target: int
    seed: int
    interval: int
    rng: random.Random = field(init=False)
    cache: TieredCache = field(init=False)
    engine: Engine = field(init=False)
    live: dict[str, Req] = field(default_factory=dict)
    retracted: dict[str, Req] = field(default_factory=dict)
    ops: int = 0
    next_id: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.cache = TieredCache(layout(), 256, 1024, policy="write_through_selective", write_threshold=1,
                                 world_size=WORLD, op_deadline_steps=DEADLINE, max_writebacks_in_flight=4,
                                 finish_writeback=True)
        self.engine = Engine(random.Random(self.seed + 1))

    # -- counting ---------------------------------------------------------------------
    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        self.ops += n

    def refuse(self, what: str, call: object) -> None:
        """An illegal call on purpose: it must raise a KvtierError."""
        try:
            call()  # type: ignore[operator]
        except KvtierError:
            self.count("refused " + what)
            return
        raise AssertionError(f"illegal {what} was accepted")

    # -- the engine's calls -------------------------------------------------------------------
    def new_request(self) -> None:
        family = self.rng.randrange(24)  # shared prefixes: hits, loadbacks, joins
        shared = self.rng.randrange(1, 9)
        own = self.rng.randrange(0, 6)
        units = [(family, i) for i in range(shared)] + [(10_000 + self.next_id, i) for i in range(own)]
        prompt = len(units) * ALIGN + self.rng.randrange(1, ALIGN)
        rid = f"q{self.next_id}"
        self.next_id += 1
        r = Req(rid, units, prompt, self.rng.randrange(1, 12))
        adm = self.cache.admit(rid, units, prompt, self.rng.choice((4, 8, 16)))
        self.count("admit")
        if adm is None:
            self.cache.abort(rid, "no room")  # waiting, holds nothing: aborted at once
            self.count("abort")
            return
        r.made = adm.start_token
        self.live[rid] = r

    def forward(self, r: Req) -> None:
        """One pass of ``r``: its owed result comes back (sometimes a second pass is
        reserved first: overlapped scheduling)."""
        c = self.cache
        v = c.request(r.rid)
        state = v.state
        if v.owed_forward:
            if state in ("running", "loading") and self.rng.random() < 0.3 and v.owed_forward == 1 \
                    and v.reserved_tokens < r.prompt + r.output:
                c.reserve(r.rid, 1)  # overlap: the next pass before this result
                self.count("reserve")
            v = c.request(r.rid)
            n = v.reserved_tokens - v.tokens if state in ("running", "loading") else 0
            if state in ("running", "loading") and v.owed_forward == 2:
                n = max(0, n - 1)
            new_units = []
            after = v.tokens + n
            have = len(c.unit_keys(r.rid))
            if after // ALIGN > have:
                new_units = [(20_000 + int(r.rid[1:]), i) for i in range(have, after // ALIGN)]
            c.step_done(r.rid, n, new_units=new_units, checkpoint=after % ALIGN == 0 and self.rng.random() < 0.5)
            self.count("step_done")
            r.made = after
            return
        if state != "running":
            return
        if r.made >= r.prompt + r.output:
            c.finish(r.rid)
            self.count("finish")
            return
        left = r.prompt - r.made
        if c.reserve(r.rid, left if left > 0 else 1) is not None:
            self.count("reserve")
        else:
            self.count("reserve (short)")

    def step(self) -> None:
        c, rng = self.cache, self.rng
        roll = rng.random()
        if roll < 0.12 and len(self.live) < 16:
            self.new_request()
        elif roll < 0.45 and self.live:
            self.forward(self.live[rng.choice(list(self.live))])
        elif roll < 0.47 and self.live:
            r = self.live[rng.choice(list(self.live))]
            v = c.request(r.rid)
            if v.state == "running" and v.settled:
                c.retract(r.rid)
                self.count("retract")
        elif roll < 0.49 and self.retracted:
            rid = rng.choice(sorted(self.retracted))
            if c.state(rid) == "retracted":  # (an abort since may not be polled yet)
                adm = c.resume(rid, rng.choice((4, 16)))
                self.count("resume")
                if adm is not None:
                    self.retracted.pop(rid).made = adm.start_token
        elif roll < 0.50 and self.live:
            r = self.live[rng.choice(list(self.live))]
            if c.state(r.rid) not in ("aborting", "aborted", "finished"):
                c.abort(r.rid)
                self.count("abort")
        elif roll < 0.51 and self.live:
            self.illegal(self.live[rng.choice(list(self.live))])
        elif roll < 0.90:
            done = self.engine.take(c.core.step)
            if done is not None:
                self.deliver(done)
        elif roll < 0.96:
            self.poll()
        else:
            c.advance_step()
            self.count("advance_step")

    def illegal(self, r: Req) -> None:
        c = self.cache
        v = c.request(r.rid)
        if not v.owed_forward and v.state in ("running", "loading", "fenced", "aborting"):
            self.refuse("step_done", lambda: c.step_done(r.rid, 0))
        elif v.state not in ("running", "loading"):
            self.refuse("reserve", lambda: c.reserve(r.rid, 1))
        if v.state != "retracted":
            self.refuse("resume", lambda: c.resume(r.rid, 4))
        self.refuse("unknown request", lambda: c.finish("nobody"))

    def deliver(self, done: Completion) -> None:
        c = self.cache
        c.complete(done)
        self.count("complete")
        if self.rng.random() < DUP:
            try:
                c.complete(done)  # a duplicate: absorbed once settled, else refused
                self.count("complete (duplicate absorbed)")
            except DuplicateCompletion:
                self.count("refused duplicate completion")

    def poll(self) -> None:
        out = self.cache.poll()
        self.count("poll")
        for cmd in out.commands:
            self.engine.submit(cmd, self.cache.core.step)
        for e in out.events:
            if e.state in ("finished", "aborted"):
                self.live.pop(e.request_id, None)
                self.retracted.pop(e.request_id, None)
            # an event may be stale by now (a later one in this batch ended the request):
            # act on the request's current state, which state() gives even once it ended
            elif e.state == "retracted" and e.request_id in self.live \
                    and self.cache.state(e.request_id) == "retracted":
                self.retracted[e.request_id] = self.live[e.request_id]
            elif e.state == "waiting" and e.request_id in self.live \
                    and self.cache.state(e.request_id) == "waiting":
                # its loadback failed: it recomputes from the start of its admission
                self.cache.abort(e.request_id, "loadback failed")  # waiting: at once
                self.count("abort")

    # -- the run --------------------------------------------------------------------------
    def sample(self, t0: float) -> None:
        gc.collect()
        traced, peak = tracemalloc.get_traced_memory()
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        core = self.cache.core
        s = Sample(self.ops, time.perf_counter() - t0, rss / 2**20, traced / 2**20, peak / 2**20,
                   len(self.cache.table), len(self.cache.table.ended()), core.ops_in_flight(), len(core.tree))
        self.samples.append(s)
        print(f"{s.ops:>10,} ops {s.seconds:7.1f} s  RSS {s.rss_mb:6.1f} MB  traced {s.traced_mb:6.2f} MB "
              f"(peak {s.peak_mb:6.2f})  tracked {s.tracked:3}  history {s.history:5}  in flight "
              f"{s.in_flight:3}  nodes {s.nodes:4}", flush=True)

    def run(self) -> None:
        tracemalloc.start()
        t0 = time.perf_counter()
        self.sample(t0)
        next_sample = self.interval
        next_check = 10_000
        while self.ops < self.ops_target:
            self.step()
            if self.ops >= next_check:
                self.cache.check_invariants()
                next_check += 10_000
            if self.ops >= next_sample:
                self.sample(t0)
                next_sample += self.interval
        self.drain()
        self.sample(t0)
        tracemalloc.stop()

    def drain(self) -> None:
        """Finish or abort every live request, deliver everything, poll to quiescence."""
        c = self.cache
        for _ in range(100_000):
            for rid in list(self.live):
                v = c.request(rid)
                if v.owed_forward:
                    self.forward(self.live[rid])
                elif v.state == "running":
                    c.finish(rid)
                    self.count("finish")
                elif v.state in ("retracted", "waiting"):
                    c.abort(rid, "drained")
                    self.count("abort")
            while True:
                done = self.engine.take(c.core.step)
                if done is None:
                    break
                self.deliver(done)
            self.poll()
            if not self.live and not c.in_flight() and not self.engine.queue and not self.engine.late:
                self.poll()
                break
            c.advance_step()  # lost completions: their deadline fails them
            self.count("advance_step")
        c.check_invariants()
        out = c.outstanding()
        assert out.quiescent, out


def table(s: Soak, seconds: float) -> str:
    warm = [x for x in s.samples[1:-1] if x.ops >= s.ops_target // 5] or s.samples
    rss = [x.rss_mb for x in warm]
    traced = [x.traced_mb for x in warm]
    rows = ["| operations | s | RSS MB | traced MB | traced peak MB | requests tracked | ended history | "
            "ops in flight | tree nodes |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, x in enumerate(s.samples):
        label = "drained" if i == len(s.samples) - 1 else f"{x.ops:,}"
        rows.append(f"| {label} | {x.seconds:.1f} | {x.rss_mb:.1f} | {x.traced_mb:.2f} | {x.peak_mb:.2f} | "
                    f"{x.tracked} | {x.history} | {x.in_flight} | {x.nodes} |")
    out = s.cache.outstanding()
    st = s.cache.stats()
    calls = ", ".join(f"{k} {v:,}" for k, v in sorted(s.counts.items()))
    lines = ["\n".join(rows), "",
             f"After warm-up (samples from {warm[0].ops:,} operations on): RSS {min(rss):.1f}-{max(rss):.1f} MB "
             f"(spread {max(rss) - min(rss):.1f} MB), traced {min(traced):.2f}-{max(traced):.2f} MB "
             f"(spread {max(traced) - min(traced):.2f} MB).",
             f"Drained: quiescent {out.quiescent} (requests {len(out.requests)}, operations {len(out.operations)}, "
             f"commands {len(out.commands)}, locks {out.locks}, pins {out.pins}, borrows {out.borrows}, "
             f"held device pages {out.caller_pages}); invariants hold.",
             f"{s.ops:,} operations in {seconds:.0f} s: {calls}.",
             f"Faults: {st['writeback_failures']:,} writeback and {st['loadback_failures']:,} loadback failures, "
             f"{st['expired_ops']:,} operations expired by their deadline, {st['absorbed_late_completions']:,} late "
             f"or duplicate completions absorbed, {st['withdrawn_ops']:,} aborted writebacks withdrawn; "
             f"{st['loadbacks']:,} loadbacks ({st['joined_loadbacks']:,} joined), {st['writebacks']:,} writebacks, "
             f"{s.next_id:,} requests."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=positive_int, default=1_000_000, help="operations (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval", type=positive_int, default=100_000, help="operations between samples")
    p.add_argument("--record", nargs="?", const=str(RESULTS), metavar="RESULTS.md",
                   help="write the table into bench/RESULTS.md (section 'soak')")
    ns = p.parse_args(argv)
    s = Soak(ns.ops, ns.seed, ns.interval)
    t0 = time.perf_counter()
    s.run()
    body = table(s, time.perf_counter() - t0)
    print(body)
    if ns.record:
        record_section(Path(ns.record), "soak", "Soak: a million random operations with faults, drained to zero",
                       provenance(sys.argv) + "\n\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
