"""Trigger throughput of the lifecycle machines built from the spec, and the core's
performance targets (issue 3, "Performance").

- Raw machines: drives N plain ``__slots__`` subjects through realistic cycles with the
  shared machines (``kvtier.fsm.lifecycle.machines``) and compares with the same cycles done by
  direct state assignment; also times refused events (GuardRejected / IllegalTransition).
- Core cycle: node lifecycle triggers per second through the real machine inside
  :class:`~kvtier.fsm.node.core.CacheCore` (``cache.stats.triggers`` per second) over
  insert / writeback+ack / demote / match / load+ack / drop host / remove cycles, and per
  operation the same core with the machine replaced by direct state assignment (the price
  of verification; reported, not gated). Target: >= 100,000 triggers/s. The checked mode
  (every event through the compiled table and ``transitions``, compared; on in
  ``kvtier fuzz``, the kit and CI) has its own rows, against the compiled table.
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
import gc
import itertools
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Hashable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from harness import Row, format_table, median_seconds, provenance, record_section

from kvtier.fsm import GuardRejected, IllegalTransition
from kvtier.fsm import MatchResult, CacheCore
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.machines import Lifecycle, node_lifecycle, request_lifecycle, set_checked
from kvtier.fsm.node import Node
from kvtier.fsm.presets import preset
from kvtier.fsm.records import Completion

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


def _fire_checked(machine: Lifecycle, events: Sequence[str]) -> Callable[[Subjects], None]:
    """:func:`_fire` in the checked mode: every event through the compiled table and the
    ``transitions`` machine, compared (the price of checking the table)."""
    inner = _fire(machine, events)

    def run(subjects: Subjects) -> None:
        before = machine.checked
        machine.checked = True
        try:
            inner(subjects)
        finally:
            machine.checked = before

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
        (f"{what} cycle, Lifecycle.fire, checked mode", _fire_checked(machine, events), f"{what} cycle, Lifecycle.fire"),
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


# ---------------------------------------------------------------------------------------
# The core (CacheCore): triggers through the machine, the price of verification,
# match latency and memory per node. llama-3-8b with 16-token pages: one page = one unit.

TRIGGER_TARGET = 100_000  # node lifecycle triggers per second through the machine in the core
MATCH_TARGET_US = 50.0  # median us per match of a 64-page prompt on a 10,000-node tree
NODE_BYTES_TARGET = 1024  # bytes per node, without the key tuple and the page-id lists

CHUNKS = 4  # nodes per request in the core cycle: one per prefill chunk
CHUNK_PAGES = 4  # pages (16-token units) per chunk
PROMPT_PAGES = 64  # pages per key in the match tree and per matched prompt


def _layout() -> CacheLayout:
    return preset("llama-3-8b", page_tokens=16)


def _verdict(ok: bool, what: str) -> str:
    return f"{what}: {'met' if ok else 'MISSED'}"


def direct_fire() -> Callable[[Node, str], str]:
    """A stand-in for the machine's ``fire``: look up the spec's target state for
    (state, event) and assign it. No guards, no ``transitions``."""
    targets: dict[tuple[str, str], str] = {}
    for t in node_lifecycle().spec.transitions:
        targets.setdefault((t.source, t.event), t.target)

    def fire(node: Node, event: str) -> str:
        state = targets[(node.state, event)]
        node.state = state
        return state

    return fire


class UnverifiedCore(CacheCore):
    """The same core with its node events assigned directly (:func:`direct_fire`): no
    machine, no guards. Only for measuring the price of verification; never ship it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store.fire = direct_fire()  # (the one hook every node event goes through)


class CoreCycle:
    """One core cycle's untimed setup: a cache sized for ``requests`` requests of
    :data:`CHUNKS` chunks of :data:`CHUNK_PAGES` pages, each chunk's pages already
    allocated to the caller, so the timed phases only run the core's operations."""

    def __init__(self, requests: int, direct: bool) -> None:
        layout = _layout()
        units = requests * CHUNKS * CHUNK_PAGES
        # the price of verification: the same core without its machine
        self.cache = (UnverifiedCore if direct else CacheCore)(layout, units, units)
        self.group = g = layout.groups[0].name
        self.units = units
        self.keys: list[tuple[Hashable, ...]] = []
        self.inserts: list[tuple[tuple[Hashable, ...], dict[str, list[int]]]] = []  # request order
        for r in range(requests):
            key = tuple(r * 1_000 + u for u in range(CHUNKS * CHUNK_PAGES))
            table: list[int] = []
            for c in range(1, CHUNKS + 1):
                table = table + self.cache.alloc_device({g: CHUNK_PAGES}, evict=False)[g]
                self.inserts.append((key[:c * CHUNK_PAGES], {g: table}))
            self.keys.append(key)
        self.tips: list[Node] = []
        self.matches: list[MatchResult] = []

    # the phases, in cycle order; each ends with every node in the state the next expects
    def insert(self) -> None:
        insert, tips = self.cache.insert, self.tips
        for i, (key, pages) in enumerate(self.inserts):
            node = insert(key, pages).node
            if i % CHUNKS == CHUNKS - 1:
                tips.append(node)

    def writeback(self) -> None:
        cache = self.cache
        for tip in self.tips:
            cmd = cache.writeback(tip)
            assert cmd is not None
            cache.complete(Completion(cmd.op_id))
        cache.poll_commands()

    def demote(self) -> None:
        self.cache.evict_device({self.group: self.units})

    def match(self) -> None:
        match = self.cache.match
        self.matches = [match(key) for key in self.keys]

    def load(self) -> None:
        cache = self.cache
        for m in self.matches:
            lr = cache.load(m, evict=False)
            assert lr.command is not None
            cache.complete(Completion(lr.command.op_id))
            cache.release(lr.pin)
            cache.unlock(lr.lock)
        cache.poll_commands()

    def drop_host(self) -> None:
        self.cache.evict_host({self.group: self.units})

    def remove(self) -> None:
        self.cache.evict_device({self.group: self.units})


#: (row name, phase, ops per request, what an op is)
CORE_PHASES: tuple[tuple[str, Callable[[CoreCycle], None], int, str], ...] = (
    ("core insert", CoreCycle.insert, CHUNKS, f"per chunk: 1 new node of {CHUNK_PAGES} pages"),
    ("core writeback+ack", CoreCycle.writeback, 1, f"per request: {CHUNKS}-node chain, 1 op"),
    ("core demote (evict_device)", CoreCycle.demote, CHUNKS, "per node demoted"),
    ("core match", CoreCycle.match, 1, f"per request: {CHUNKS * CHUNK_PAGES}-page host hit"),
    ("core load+ack", CoreCycle.load, 1, f"per request: {CHUNKS}-node chain, 1 op, release+unlock"),
    ("core drop host (evict_host)", CoreCycle.drop_host, CHUNKS, "per node"),
    ("core remove (evict_device)", CoreCycle.remove, CHUNKS, "per node"),
)
#: node triggers per node per cycle: create, writeback submit+ack, demote, loadback
#: submit+ack, drop_host, evict_device
CYCLE_TRIGGERS = 8


def _run_cycle(requests: int, direct: bool, checked: bool = False) -> tuple[list[float], int]:
    """One core cycle: seconds per phase (GC off, setup untimed) and triggers fired;
    ``checked``: the lifecycles in the checked mode (:func:`set_checked`)."""
    cyc = CoreCycle(requests, direct)
    before = cyc.cache.stats.triggers
    times = []
    mode = set_checked(checked)
    gc.collect()
    gc.disable()
    try:
        for _, phase, _, _ in CORE_PHASES:
            t0 = time.perf_counter()
            phase(cyc)
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
        set_checked(mode)
    assert not cyc.cache.nodes(), "the cycle must end with an empty tree"
    return times, cyc.cache.stats.triggers - before


def core_cycles(args: argparse.Namespace) -> list[Row]:
    """Node lifecycle triggers per second through the machine inside the core, and per
    operation the same core with direct state assignment (runs interleaved)."""
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    checked_runs: list[list[float]] = []
    nodes = args.requests * CHUNKS
    triggers = CYCLE_TRIGGERS * nodes
    for _ in range(args.repeat):
        for direct in (False, True):
            times, fired = _run_cycle(args.requests, direct)
            assert fired == triggers, (fired, triggers)
            runs[direct].append(times)
        times, fired = _run_cycle(args.requests, False, checked=True)
        assert fired == triggers, (fired, triggers)
        checked_runs.append(times)
    total = {d: statistics.median(sum(t) for t in runs[d]) for d in runs}
    checked_total = statistics.median(sum(t) for t in checked_runs)
    rate = triggers / total[False]
    share_us = 1e6 * (total[False] - total[True]) / triggers
    with_machine = "core cycle (node triggers), machine"
    assigned = "core cycle (node triggers), direct assignment"
    rows = [
        Row(with_machine, triggers, total[False], assigned,
            f"{nodes:,} nodes ({args.requests:,} requests x {CHUNKS} chunks), {CYCLE_TRIGGERS} triggers each; "
            f"machine's share {share_us:.2g} us/trigger",
            _verdict(rate >= TRIGGER_TARGET, f">= {TRIGGER_TARGET:,}/s")),
        Row("core cycle (node triggers), checked mode", triggers, checked_total, with_machine,
            "every node event through the compiled table and transitions, compared (kvtier fuzz, the kit, CI)"),
        Row(assigned, triggers, total[True], None, "UnverifiedCore: spec target lookup + assignment, no guards"),
    ]
    for i, (name, _, per_request, what) in enumerate(CORE_PHASES):
        ops = per_request * args.requests
        seconds = {d: statistics.median(t[i] for t in runs[d]) for d in runs}
        rows.append(Row(f"{name}, machine", ops, seconds[False], f"{name}, direct assignment", what))
        rows.append(Row(f"{name}, direct assignment", ops, seconds[True], None, what))
    return rows


def _tree_plan(nodes: int, seed: int) -> list[tuple[Hashable, ...]]:
    """Keys of :data:`PROMPT_PAGES` units, random branching: each shares a random prefix
    (>= 1 unit) with an earlier key, then goes on with units never seen (so the insert
    creates one node, plus a split when the branch point is inside a node). At most
    ``nodes`` keys (each insert adds at least one node)."""
    rng = random.Random(seed)
    fresh = itertools.count(1_000_000)
    keys: list[tuple[Hashable, ...]] = []
    for _ in range(nodes):
        if keys:
            base = rng.choice(keys)
            cut = rng.randrange(1, PROMPT_PAGES)
            keys.append(base[:cut] + tuple(next(fresh) for _ in range(PROMPT_PAGES - cut)))
        else:
            keys.append(tuple(next(fresh) for _ in range(PROMPT_PAGES)))
    return keys


def _build_tree(plan: Sequence[tuple[Hashable, ...]], nodes: int, capacity: int,
                host: int | None) -> tuple[CacheCore, int]:
    """Insert keys of ``plan`` until the tree has ``nodes`` nodes; returns the cache and
    how many keys were inserted."""
    layout = _layout()
    g = layout.groups[0].name
    cache = CacheCore(layout, capacity, host)
    inserted = 0
    for key in plan:
        if len(cache.tree) >= nodes:
            break
        pages = cache.alloc_device({g: len(key)}, evict=False)
        res = cache.insert(key, pages)
        if res.duplicates:
            cache.free_device(res.duplicates)
        inserted += 1
    assert len(cache.tree) >= nodes, "plan too short"
    return cache, inserted


def _tree_capacity(plan: Sequence[tuple[Hashable, ...]]) -> int:
    """Device pages for the whole plan (an upper bound: every key's fresh units)."""
    seen: set[Hashable] = set()
    need = 0
    for key in plan:
        for u, unit in enumerate(key):
            if unit not in seen:  # first use of a fresh unit: the rest of the key is new
                need += len(key) - u
                seen.update(key[u:])
                break
    return need + PROMPT_PAGES


def matches(args: argparse.Namespace) -> list[Row]:
    """Median and p90 of one ``match()`` of a 64-page prompt sharing a random prefix with
    a tree of ``--tree-nodes`` nodes (the match splits the node where the prompt diverges,
    as it does for a real new prompt)."""
    plan = _tree_plan(args.tree_nodes, seed=1)
    cache, inserted = _build_tree(plan, args.tree_nodes, _tree_capacity(plan), PROMPT_PAGES)
    built = len(cache.tree)
    rng = random.Random(2)
    fresh = itertools.count(10**9)
    queries = []
    for _ in range(args.matches):
        base = plan[rng.randrange(inserted)]
        cut = rng.randrange(1, PROMPT_PAGES + 1)  # 64: the whole prompt is cached
        queries.append(base[:cut] + tuple(next(fresh) for _ in range(PROMPT_PAGES - cut)))
    match, clock = cache.match, time.perf_counter
    times = []
    hit = 0
    gc.collect()
    gc.disable()
    try:
        for q in queries:
            t0 = clock()
            m = match(q)
            times.append(clock() - t0)
            hit += m.device_units
    finally:
        gc.enable()
    assert hit > 0
    times.sort()
    median = statistics.median(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    name = f"match {PROMPT_PAGES}-page prompt, {args.tree_nodes:,}-node tree"
    note = (f"{len(times):,} matches, llama-3-8b 16-token pages; tree {built:,} nodes "
            f"({len(cache.tree):,} after the matches' splits); mean hit {hit / len(times):.0f} pages")
    return [
        Row(f"{name}: median", 1, median, None, note,
            _verdict(1e6 * median < MATCH_TARGET_US, f"median < {MATCH_TARGET_US:.0f} us")),
        Row(f"{name}: p90", 1, p90, None, "the time columns show the 90th percentile"),
    ]


def _excluded_bytes(nodes: Sequence[Node], int_bytes: int) -> int:
    """Bytes of the nodes' key tuples and page-id lists, with their page ints of
    ``int_bytes`` each (as allocated: ``sys.getsizeof`` says 28 where 32 are allocated)."""
    seen: set[int] = set()
    total = 0
    for n in nodes:
        total += sys.getsizeof(n.key)
        for pages_by_group in (n.dev, n.host, n.pending, n.dev_ckpt, n.host_ckpt, n.pending_ckpt):
            for pages in pages_by_group.values():
                total += sys.getsizeof(pages)
                for p in pages:
                    if not -5 <= p <= 256 and id(p) not in seen:  # small ints are preallocated
                        seen.add(id(p))
                        total += int_bytes
    return total


def _traced_int_bytes() -> int:
    """Bytes tracemalloc sees for one int above the small-int cache (call while tracing)."""
    before = tracemalloc.get_traced_memory()[0]
    probe = list(range(1_000_000, 1_001_000))
    return round((tracemalloc.get_traced_memory()[0] - before - sys.getsizeof(probe)) / len(probe))


def memory(args: argparse.Namespace) -> list[Row]:
    """Memory per node with tracemalloc: a tree of ``--tree-nodes`` nodes built by
    inserts; then the cache (allocators, LRU heaps, index) is dropped and what stays
    allocated is the nodes with their dicts and sets, key tuples and page-id lists; the
    latter two are subtracted."""
    plan = _tree_plan(args.tree_nodes, seed=3)
    untraced, _ = _build_tree(plan, args.tree_nodes, _tree_capacity(plan), None)
    # the same build needs exactly this many pages, plus one prompt's before its duplicates go back
    capacity = untraced.device[untraced.layout.groups[0].name].used + PROMPT_PAGES
    del untraced
    node_lifecycle()  # built once per process: not per-node memory
    gc.collect()  # also empties the free lists, so every block below is a new allocation
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache, _ = _build_tree(plan, args.tree_nodes, capacity, None)
        nodes = [cache.root, *cache.nodes()]
        del cache
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        int_bytes = _traced_int_bytes()
    finally:
        tracemalloc.stop()
    node_bytes = after - before - sys.getsizeof(nodes) - _excluded_bytes(nodes, int_bytes)
    per_node = node_bytes / (len(nodes) - 1)  # the root's few bytes are charged to the tree
    internal = sum(1 for n in nodes[1:] if n.children)
    return [Row("memory per node (tracemalloc)", len(nodes) - 1, 0.0, None,
                f"{per_node:,.0f} B/node: {len(nodes) - 1:,} nodes ({internal:,} with children) built by inserts; "
                "Node + its dicts/sets, without key tuples and page-id lists",
                _verdict(per_node < NODE_BYTES_TARGET, "< 1 KiB"), timed=False)]


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
