"""Trigger throughput of the lifecycle machines built from the spec, and the core's
performance targets (issue 3, "Performance").

- Raw machines: drives N plain ``__slots__`` subjects through realistic cycles with the
  shared machines (``kvtier.fsm.machines``) and compares with the same cycles done by
  direct state assignment; also times refused events (GuardRejected / IllegalTransition).
- Core cycle: node lifecycle triggers per second through the real machine inside
  :class:`~kvtier.fsm.core.CacheCore` (``cache.stats.triggers`` per second) over
  insert / writeback+ack / demote / match / load+ack / drop host / remove cycles, and per
  operation the same core with the machine replaced by direct state assignment (the price
  of verification; reported, not gated). Target: >= 100,000 triggers/s.
- Match: median and p90 microseconds of one ``match()`` of a 64-page prompt on a
  10,000-node tree. Target: median < 50 us.
- Memory per node (tracemalloc), without the key tuple and the page-id lists.
  Target: < 1 KiB.

Prints one table; ``--record`` also writes it to bench/RESULTS.md (section "Lifecycle
machines").

    python bench/lifecycle.py [-n 5000] [--repeat 5] [--requests 1000]
                              [--tree-nodes 10000] [--matches 2000] [--record]

To add rows, append a function ``(args) -> list[Row]`` to :data:`BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from harness import Row, format_table, median_seconds, provenance, record_section
from lifecycle_core import CHUNKS, core_cycles, matches, memory

from kvtier.fsm import GuardRejected, IllegalTransition
from kvtier.fsm.machines import Lifecycle, node_lifecycle, request_lifecycle

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")

#: A node's life: publish, write back, demote, load back layer by layer, shed the host
#: copy, a failed writeback, a split, eviction. (event, state after)
NODE_CYCLE = (
    ("create", "device"), ("writeback_submit", "writing"), ("writeback_ack", "backed"),
    ("demote", "host"), ("loadback_submit", "loading"), ("loadback_layer_done", "loading"),
    ("loadback_ack", "backed"), ("drop_host", "device"), ("writeback_submit", "writing"),
    ("writeback_fail", "device"), ("split", "device"), ("evict_device", "removed"),
)
#: A request with a host hit that is retracted once, resumes from the host and finishes
#: with a writeback of its own pages.
REQUEST_CYCLE = (
    ("schedule", "loading"), ("forward_result", "loading"), ("loadback_ack", "running"),
    ("forward_result", "running"), ("retract", "retracting"), ("writeback_ack", "retracted"),
    ("resume", "loading"), ("loadback_ack", "running"), ("finish", "finishing"),
    ("writeback_ack", "finished"),
)


class NodeSubject:
    """What the node guards read, as plain slots (the core's node computes them)."""

    __slots__ = ("state", "label", "lock_ref", "borrow_ref", "host_pin", "parent_on_host",
                 "parent_on_device", "parent_readable", "has_device_child", "has_host_child")

    def __init__(self, label: int, state: str = "new", lock_ref: int = 0) -> None:
        self.state, self.label = state, label
        self.lock_ref, self.borrow_ref, self.host_pin = lock_ref, 0, 0
        self.parent_on_host = self.parent_on_device = self.parent_readable = True
        self.has_device_child = self.has_host_child = False


class RequestSubject:
    __slots__ = ("state", "label", "has_loadback", "has_own_writeback", "settled")

    def __init__(self, label: int) -> None:
        self.state, self.label = "waiting", label
        self.has_loadback = self.has_own_writeback = True
        self.settled = True  # retract and finish require it


Subjects = list[Any]


def _fire(machine: Lifecycle, events: Sequence[str]) -> Callable[[Subjects], None]:
    fire = machine.fire

    def run(subjects: Subjects) -> None:
        for e in events:
            for s in subjects:
                fire(s, e)

    return run


def _check_fire(machine: Lifecycle, events: Sequence[str]) -> Callable[[Subjects], None]:
    """The core's validate-first path: check (no change), then fire."""
    check, fire = machine.check, machine.fire

    def run(subjects: Subjects) -> None:
        for e in events:
            for s in subjects:
                check(s, e)
                fire(s, e)

    return run


def _raw_trigger(machine: Lifecycle, events: Sequence[str]) -> Callable[[Subjects], None]:
    triggers = [machine.machine.events[e].trigger for e in events]

    def run(subjects: Subjects) -> None:
        for trigger in triggers:
            for s in subjects:
                trigger(s)

    return run


def _direct(states: Sequence[str]) -> Callable[[Subjects], None]:
    def run(subjects: Subjects) -> None:
        for state in states:
            for s in subjects:
                s.state = state

    return run


def _cycle_rows(what: str, machine: Lifecycle, make: Callable[[int], Any],
                cycle: Sequence[tuple[str, str]], args: argparse.Namespace) -> list[Row]:
    events = [e for e, _ in cycle]
    final = cycle[-1][1]
    direct = f"{what} cycle, direct assignment"
    variants = [
        (f"{what} cycle, Lifecycle.fire", _fire(machine, events), direct),
        (f"{what} cycle, check + fire", _check_fire(machine, events), direct),
        (f"{what} cycle, raw events[e].trigger", _raw_trigger(machine, events), direct),
        (direct, _direct([s for _, s in cycle]), None),
    ]
    rows = []
    for name, run, baseline in variants:
        def setup() -> Subjects:
            return [make(i) for i in range(args.subjects)]

        def checked(subjects: Subjects, run: Callable[[Subjects], None] = run, name: str = name) -> None:
            run(subjects)
            assert subjects[-1].state == final, (name, subjects[-1].state)

        seconds = median_seconds(setup, checked, args.repeat)
        rows.append(Row(name, len(events) * args.subjects, seconds, baseline,
                        f"{len(events)} events x {args.subjects:,} subjects"))
    return rows


def node_cycles(args: argparse.Namespace) -> list[Row]:
    return _cycle_rows("node", node_lifecycle(), NodeSubject, NODE_CYCLE, args)


def request_cycles(args: argparse.Namespace) -> list[Row]:
    return _cycle_rows("request", request_lifecycle(), RequestSubject, REQUEST_CYCLE, args)


def refusals(args: argparse.Namespace) -> list[Row]:
    """Events the machine refuses: each raises and changes nothing."""
    machine = node_lifecycle()
    cases = [
        ("GuardRejected raise (demote while locked)", "backed", 1, "demote", GuardRejected),
        ("IllegalTransition raise (create on host)", "host", 0, "create", IllegalTransition),
    ]
    rows = []
    for name, state, lock_ref, event, error in cases:
        def setup(state: str = state, lock_ref: int = lock_ref) -> Subjects:
            return [NodeSubject(i, state, lock_ref) for i in range(args.subjects)]

        def run(subjects: Subjects, event: str = event, error: type[Exception] = error) -> None:
            fire = machine.fire
            for s in subjects:
                try:
                    fire(s, event)
                except error:
                    pass
                else:  # pragma: no cover
                    raise AssertionError(f"{event} was not refused")

        rows.append(Row(name, args.subjects, median_seconds(setup, run, args.repeat),
                        "node cycle, Lifecycle.fire", "per refused event"))
    return rows


#: Benchmarks in table order; each returns its rows.
BENCHMARKS: list[Callable[[argparse.Namespace], list[Row]]] = [
    node_cycles, request_cycles, refusals, core_cycles, matches, memory]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("-n", "--subjects", type=int, default=5000, help="subjects per run (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per row; the median is shown "
                                                              "(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1000,
                        help=f"requests per core cycle, {CHUNKS} nodes each (default: %(default)s)")
    parser.add_argument("--tree-nodes", type=int, default=10_000,
                        help="nodes of the match and memory trees (default: %(default)s)")
    parser.add_argument("--matches", type=int, default=2000, help="timed matches (default: %(default)s)")
    parser.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="PATH",
                        help="also write the table to PATH (default: bench/RESULTS.md), section "
                             "'Lifecycle machines', keeping other sections")
    args = parser.parse_args(argv)
    if min(args.subjects, args.repeat, args.requests, args.tree_nodes, args.matches) < 1:
        parser.error("--subjects, --repeat, --requests, --tree-nodes and --matches must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for bench in BENCHMARKS for row in bench(args)]
    table = format_table(rows)
    print(table)
    if args.record:
        info = provenance(sys.argv if argv is None else ["bench/lifecycle.py", *argv],
                          f", transitions {version('transitions')}")
        vs = ("`vs baseline` is the time per op relative to the named row "
              "(machine cost vs direct state assignment; a refusal vs an accepted trigger). "
              "`core ...` rows run the real CacheCore (llama-3-8b, 16-token pages); "
              "their `direct assignment` rows are the same core (`UnverifiedCore`) with its machine replaced "
              "by a spec lookup and assignment (no guards), run interleaved with the machine's.")
        record_section(Path(args.record), "lifecycle", "Lifecycle machines",
                       f"{info}\n\n{vs}\n\n```\n{table}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
