"""What the lifecycle event log costs (kvtier.eventlog): free when off, cheap when on.

Two measurements in one run, interleaved so that machine load hits both sides alike:

1. ``Lifecycle.fire`` per call, as shipped (with the ``observer is not None`` test, no
   observer) against the same method without that test (a subclass restoring the code as
   it was before the hook): the price of the hook when recording is off.
2. ``kvtier replay``'s bookkeeping (wall time inside the cache's calls, the replay's own
   measure) per request, on the embedded trace, metadata only (``--backend none``): no
   recorder, then an :class:`EventRecorder` writing every configuration's log to a file.

Usage: ``python bench/eventlog.py [--requests 100] [--repeat 3] [--record]`` (``--record``
writes the table into bench/RESULTS.md, section "Event log cost").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import provenance, record_section

from kvtier.eventlog import EventRecorder
from kvtier.fsm.errors import IllegalTransition
from kvtier.fsm.lifecycle.machines import Lifecycle, request_lifecycle
from kvtier.replay import ReplaySetup, run_replay, working_set_units
from kvtier.replay.trace import load_trace

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


class _Unhooked(Lifecycle):
    """``Lifecycle.fire`` as it was before the observer hook (the baseline)."""

    def fire(self, subject: Any, event: str) -> str:
        state: str = subject.state
        key = (state, event)
        if key not in self._table:
            raise IllegalTransition(self.name, self.describe(subject), state, event)
        if key in self._noop:
            return state
        if not self._events[event].trigger(subject):
            self.check(subject, event)
            raise AssertionError("unreachable")
        new_state: str = subject.state
        return new_state


class _Req:
    __slots__ = ("state", "label", "has_loadback", "has_own_writeback", "settled")

    def __init__(self) -> None:
        self.state = "waiting"
        self.label = "bench"
        self.has_loadback = self.has_own_writeback = False
        self.settled = True


def fire_ns(lc: Lifecycle, n: int, noop: bool) -> float:
    """ns per fire: ``noop`` -- forward_result in running (an unguarded internal transition,
    the cheapest path, where the hook's test weighs most); else the cycle retract -> resume
    (guarded, real transitions through the transitions library)."""
    r = _Req()
    lc.fire(r, "schedule")
    t0 = time.perf_counter()
    if noop:
        for _ in range(n):
            lc.fire(r, "forward_result")
            lc.fire(r, "forward_result")
    else:
        for _ in range(n // 10):
            lc.fire(r, "retract")
            lc.fire(r, "resume")
        n //= 10
    return (time.perf_counter() - t0) / (2 * n) * 1e9


def replay_us(requests: int, log: Path | None) -> tuple[float, int, int]:
    """(bookkeeping us per request summed over the three configurations, records, bytes)."""
    trace = load_trace(None, limit=requests)
    layout = ReplaySetup().layout()
    ws = working_set_units(trace, layout)
    setup = ReplaySetup(device_units=int(ws * 0.05), host_units=int(ws * 0.5), backend="none")
    rec = EventRecorder(log) if log is not None else None
    try:
        results, _ = run_replay(trace, setup, on_start=(lambda n, c, e: rec.attach(c)) if rec else None)
    finally:
        if rec is not None:
            rec.close()
    us = sum(r.bookkeeping_us_per_request for r in results)
    return us, (rec.records if rec else 0), (log.stat().st_size if log is not None else 0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fires", type=int, default=100_000)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)

    spec = request_lifecycle().spec
    from kvtier.fsm.lifecycle.guards import GUARDS

    hooked, plain = request_lifecycle(), _Unhooked(spec, GUARDS["request"])
    assert hooked.observer is None
    fire: dict[bool, tuple[float, float]] = {}
    for noop in (True, False):
        on_ns, off_ns = [], []
        for _ in range(7):
            off_ns.append(fire_ns(plain, args.fires, noop))
            on_ns.append(fire_ns(hooked, args.fires, noop))
        fire[noop] = (min(off_ns), min(on_ns))

    off_us, on_us = [], []
    records = size = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            off_us.append(replay_us(args.requests, None)[0])
            us, records, size = replay_us(args.requests, Path(tmp) / f"run{i}.kvlog")
            on_us.append(us)
    r_off, r_on = statistics.median(off_us), statistics.median(on_us)
    lines = [
        "| measure | without | with | ratio |",
        "| --- | ---: | ---: | ---: |",
        *(f"| `Lifecycle.fire`, ns per call, {what}: no hook vs the hook with no observer (recording off) | "
          f"{fire[k][0]:,.0f} | {fire[k][1]:,.0f} | {fire[k][1] / fire[k][0]:.3f} |"
          for k, what in ((True, "internal no-op transition"), (False, "guarded transition"))),
        f"| replay bookkeeping, us per request (3 configurations summed): no recorder vs recording to a file | "
        f"{r_off:,.0f} | {r_on:,.0f} | {r_on / r_off:.2f} |",
        "",
        f"The recorded run wrote {records:,} records ({size / 1e6:.1f} MB) for {args.requests:,} requests "
        f"(three configurations); replay: medians of {args.repeat} interleaved runs; fire: the fastest of 7 "
        f"interleaved runs of {args.fires:,} calls (the least disturbed by other load).",
    ]
    table = "\n".join(lines)
    print(table)
    if args.record:
        body = provenance(["bench/eventlog.py", *argv]) + "\n\n" + table
        record_section(RESULTS, "eventlog", "Event log cost", body)
        print(f"recorded in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
