"""Transfer engine benchmark (GPU): scattered pages through the public flush path.

Measures, in one process: the pinned contiguous copy ceiling (H2D, D2H, both at once),
then for scattered random pages of 1, 4, 16, 64 KiB, 37,440 B and a DeepSeek V4 mix of
per-layer page sizes, each way and both at once:

- ``kernel``: device time from the flush's start event to its last chunk's event
  (CUDA events on the transfer stream: every launch; the flush's run table is built
  and uploaded just before the start event);
- ``submit->ack``: wall time from ``submit`` to the acknowledgement returned by
  ``poll_completions``, three ways: ``cold`` (every plan cache cleared, fresh
  GroupTransfer objects: plan building included), ``warm`` (address tables cached,
  fresh GroupTransfer objects: the steady state of a server) and ``replay`` (the same
  GroupTransfer objects again: the whole plan, device table included, is cached);
- the host's time inside ``submit`` and ``flush`` (per mode, H2D);
- the ``torch`` backend (one ``copy_`` per contiguous run) and a plain loop of one
  ``copy_`` per page, for comparison; a thread-block sweep of the Numba kernel;
- a both-ways study (child process): each direction moved by the kernel, by one
  contiguous copy-engine ``copy_`` or by batched copy-engine copies of the same
  scattered pages (``cuMemcpyBatchAsync``), alone and paired, to show what limits both
  directions at once.

Writes one JSON file (raw numbers, environment, commit, GPU test and sanitizer
summaries when given). ``bench/render_results.py`` turns it into the table of
``bench/RESULTS.md``.

    python bench/transfer.py --out results.json [--commit SHA] [--gpu-junit X.xml] [--sanitizer-log S.log]
    python bench/transfer.py --sanitize     # small workload for compute-sanitizer
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from typing import Any

import numpy as np
import torch

from kvtier.fsm import CacheGroupSpec, Direction, GroupTransfer, TransferCommand
from kvtier.transfer import ArrayCommand, Calibration, DevicePool, HostPool, PageArrays, TransferEngine
from page_geometry import LAYERS, dsv4_specs
from page_geometry import one_size as _one

L, W = Direction.LOADBACK, Direction.WRITEBACK
MiB = 1 << 20
TARGET_BYTES = 256 * MiB  # per transfer, per direction
CONFIGS: list[tuple[str, list[CacheGroupSpec]]] = [
    ("1 KiB", _one("kv", 1024)),
    ("4 KiB", _one("kv", 4096)),
    ("16 KiB", _one("kv", 16384)),
    ("64 KiB", _one("kv", 65536)),
    ("37,440 B", _one("kv", 37440)),
    ("DeepSeek V4 mix", dsv4_specs()),
]


def _events_ms(fn: Any, reps: int, stream: torch.cuda.Stream | None = None) -> list[float]:
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def ceilings(reps: int) -> dict[str, Any]:
    n = 512 * MiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    def d2h() -> None:
        host2.copy_(dev2, non_blocking=True)

    def both() -> None:
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    res: dict[str, Any] = {"bytes": n}
    for name, fn, nbytes in (("h2d", h2d, n), ("d2h", d2h, n), ("both", both, 2 * n)):
        fn()
        ms = _events_ms(fn, reps)
        res[name] = nbytes / (statistics.median(ms) / 1e3) / 1e9
        res[name + "_samples_gbps"] = [nbytes / (m / 1e3) / 1e9 for m in ms]
    assert torch.equal(dev[:4096].cpu(), host[:4096])
    del host, host2, dev, dev2
    return res


class Setup:
    """Pools and commands of one configuration: loadback and writeback use disjoint
    pages, so the two may run at once."""

    def __init__(self, specs: list[CacheGroupSpec], seed: int = 0) -> None:
        self.specs = specs
        per_page = sum(s.page_bytes for s in specs)  # all layers and components
        self.n = max(1, TARGET_BYTES // per_page)
        pages = 2 * self.n
        self.host = HostPool(specs, pages, reserve_bytes=1 << 30)
        self.dev = DevicePool.allocate(specs, pages, "cuda")
        assert self.host.buffer is not None and self.dev.buffer is not None
        self.host.buffer.random_(0, 256)
        self.dev.buffer.random_(0, 256)
        rng = np.random.default_rng(seed)
        self.lb: dict[str, tuple[list[int], list[int]]] = {}
        self.wb: dict[str, tuple[list[int], list[int]]] = {}
        for s in specs:
            hp, dp = rng.permutation(pages), rng.permutation(pages)
            self.lb[s.name] = (hp[: self.n].tolist(), dp[: self.n].tolist())
            self.wb[s.name] = (dp[self.n:].tolist(), hp[self.n:].tolist())
        self.arrays = {d: {g: (np.asarray(s, dtype=np.int64), np.asarray(t, dtype=np.int64))
                           for g, (s, t) in (self.lb if d is L else self.wb).items()} for d in (L, W)}
        self.bytes = self.n * per_page
        self.op = 0

    def transfers(self, direction: Direction) -> tuple[GroupTransfer, ...]:
        src = self.lb if direction is L else self.wb
        return tuple(GroupTransfer(g, tuple(s), tuple(d)) for g, (s, d) in src.items())

    def page_arrays(self, direction: Direction) -> tuple[PageArrays, ...]:
        """New array records of the direction's pages (validated and copied: a serving
        engine's block tables turned into records)."""
        return tuple(PageArrays(g, s, d) for g, (s, d) in self.arrays[direction].items())

    def command(self, direction: Direction, transfers: tuple[Any, ...]) -> TransferCommand | ArrayCommand:
        self.op += 1
        if transfers and isinstance(transfers[0], PageArrays):
            return ArrayCommand(self.op, direction, transfers)
        return TransferCommand(self.op, direction, transfers, ())

    def array_command(self, direction: Direction) -> ArrayCommand:
        """A new :class:`ArrayCommand` with new page arrays ("warm": what serving does)."""
        self.op += 1
        return ArrayCommand(self.op, direction, self.page_arrays(direction))

    def check(self) -> bool:
        """Every page of both transfers landed (compares whole regions' moved pages)."""
        ok = True
        for s in self.specs:
            for layer in s.layers:
                for c in s.components:
                    h, d = self.host.region(s.name, c.name, layer), self.dev.region(s.name, c.name, layer)
                    hs, dd = (torch.tensor(x, device="cuda") for x in self.lb[s.name])
                    ok &= bool(torch.equal(d.index_select(0, dd), h.index_select(0, hs.cpu()).cuda()))
                    ds, hd = (torch.tensor(x, device="cuda") for x in self.wb[s.name])
                    ok &= bool(torch.equal(h.index_select(0, hd.cpu()).cuda(), d.index_select(0, ds)))
        return ok


def run_once(eng: TransferEngine, cmds: Any) -> float:
    """Submit, flush, poll until every op is acknowledged; wall seconds."""
    return run_once_parts(eng, cmds)[0]


def run_once_parts(eng: TransferEngine, cmds: Any) -> tuple[float, float, float]:
    """Like :func:`run_once`; (wall, submit, flush) seconds: the host's time in
    ``submit`` (validation, page lists to arrays) and in ``flush`` (planning, table
    upload, launches); the rest of the wall time is waiting for the copies. ``cmds``
    may be a callable making the commands: its time counts as submit time."""
    t0 = time.perf_counter()
    if callable(cmds):
        cmds = cmds()
    for c in cmds:
        eng.submit(c)
    t1 = time.perf_counter()
    eng.flush()
    t2 = time.perf_counter()
    want = {c.op_id for c in cmds}
    while want:
        for comp in eng.poll_completions():
            if comp.layer is None:
                assert comp.ok, comp
                want.discard(comp.op_id)
    return time.perf_counter() - t0, t1 - t0, t2 - t1


def kernel_seconds(eng: TransferEngine, direction: Direction) -> float:
    return float(eng.stats()["last_flush"][direction.value]["seconds"])


MODES = ("cold", "warm", "warm_tuples", "replay")


def measure_direction(setup: Setup, eng: TransferEngine, direction: Direction, reps: int,
                      modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Per mode, medians of ``reps`` submit->ack transfers: ``cold`` (plan caches
    cleared, new array records), ``warm`` (new array records: ArrayCommand built from
    the engine's page arrays inside the timed region), ``warm_tuples`` (new core
    records, TransferCommand with tuples of ints), ``replay`` (the same array records)."""
    same = setup.page_arrays(direction)
    run_once(eng, [setup.command(direction, same)])  # warm-up (JIT, allocator)
    run_once(eng, [setup.command(direction, setup.transfers(direction))])
    res: dict[str, Any] = {}
    for mode in modes:
        walls, kern, subs, flushes = [], [], [], []
        for _ in range(reps):
            if mode == "cold":
                eng.clear_plan_cache()
            if mode == "replay":
                make: Any = [setup.command(direction, same)]
            elif mode == "warm_tuples":
                make = [setup.command(direction, setup.transfers(direction))]  # tuples made outside the timing
            else:
                make = lambda: [setup.array_command(direction)]  # noqa: E731
            torch.cuda.synchronize()
            wall, sub, fl = run_once_parts(eng, make)
            walls.append(wall)
            subs.append(sub)
            flushes.append(fl)
            kern.append(kernel_seconds(eng, direction))
        res[mode + "_submit_ms"] = 1e3 * statistics.median(subs)
        res[mode + "_flush_ms"] = 1e3 * statistics.median(flushes)
        res[mode + "_wall_ms"] = 1e3 * statistics.median(walls)
        res[mode + "_gbps"] = setup.bytes / statistics.median(walls) / 1e9
        res[mode + "_samples_gbps"] = [setup.bytes / w / 1e9 for w in walls]
        res[mode + "_kernel_gbps"] = setup.bytes / statistics.median(kern) / 1e9
    last = eng.stats()["last_flush"][direction.value]
    res["kernel_gbps"] = res["replay_kernel_gbps" if "replay" in modes else modes[-1] + "_kernel_gbps"]
    res.update({k: last[k] for k in ("chunks", "kernel_launches", "copy_calls", "rows", "tensor_refs", "pages",
                                     "spans", "bytes", "sm_bytes", "ce_bytes", "ce_copies", "ce_calls", "waits",
                                     "max_blocks")})
    return res


def measure_both(setup: Setup, eng: TransferEngine, reps: int, mode: str = "warm") -> dict[str, Any]:
    """Both directions in one flush; ``mode`` ``warm`` (new array records, built in the
    timed region) or ``replay`` (the same records). ``kernel_gbps``: device time from an
    event before the flush to both streams' ends."""
    lb, wb = setup.page_arrays(L), setup.page_arrays(W)
    run_once(eng, [setup.command(L, lb), setup.command(W, wb)])
    walls, dev = [], []
    streams = getattr(eng.backend, "streams")
    split: dict[str, Any] = {}
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        if mode == "warm":
            cmds: list[Any] = [setup.array_command(L), setup.array_command(W)]
        else:
            cmds = [setup.command(L, lb), setup.command(W, wb)]
        for c in cmds:
            eng.submit(c)
        eng.flush()
        cur = torch.cuda.current_stream()
        cur.wait_stream(streams.stream(L))
        cur.wait_stream(streams.stream(W))
        end.record()
        want = {c.op_id for c in cmds}
        while want:
            for comp in eng.poll_completions():
                if comp.layer is None:
                    want.discard(comp.op_id)
        walls.append(time.perf_counter() - t0)
        end.synchronize()
        dev.append(start.elapsed_time(end) / 1e3)
        last = eng.stats()["last_flush"]
        split = {d: {k: last[d][k] for k in ("sm_bytes", "ce_bytes", "ce_copies", "waits", "max_blocks")}
                 for d in last}
    total = 2 * setup.bytes
    return {mode + "_gbps": total / statistics.median(walls) / 1e9,
            "kernel_gbps": total / statistics.median(dev) / 1e9,
            mode + "_samples_gbps": [total / w / 1e9 for w in walls], "split": split}


SERVING_CONFIGS = ("1 KiB", "4 KiB", "16 KiB", "64 KiB", "DeepSeek V4 mix")


class ServingSetup:
    """Pools for the serving-path table: ``n`` pages per direction (256 MiB), host pool
    of ``layout``; every flush gets new page lists: device pages a new random
    permutation, host pages one extent per direction (what kvtier's host allocator
    hands a flush where it can) in a new random order. Loadback host pages are
    ``0..n-1``, writeback host pages ``n..2n-1``."""

    def __init__(self, specs: list[CacheGroupSpec], layout: str, seed: int = 0) -> None:
        self.specs = specs
        per_page = sum(s.page_bytes for s in specs)
        self.n = max(1, TARGET_BYTES // per_page)
        self.host = HostPool(specs, 2 * self.n, reserve_bytes=1 << 30, layout=layout)
        self.dev = DevicePool.allocate(specs, 2 * self.n, "cuda")
        assert self.host.buffer is not None and self.dev.buffer is not None
        self.dev.buffer.random_(0, 256)
        self.host.buffer.copy_(torch.randint_like(self.host.buffer, 0, 256, device="cuda"))
        self.rng = np.random.default_rng(seed)
        self.bytes = self.n * per_page
        self.op = 0
        self.last: dict[Direction, dict[str, tuple[np.ndarray, np.ndarray]]] = {}

    def page_lists(self, directions: tuple[Direction, ...]) -> dict[Direction, dict[str, tuple[Any, Any]]]:
        """New page lists for each direction (the scheduler's block tables: made before
        the timed region)."""
        out: dict[Direction, dict[str, tuple[Any, Any]]] = {}
        dev = {s.name: self.rng.permutation(2 * self.n) for s in self.specs}
        for d in directions:
            pages = {}
            for s in self.specs:
                hp = self.rng.permutation(self.n) + (0 if d is L else self.n)
                dp = dev[s.name][: self.n] if d is L else dev[s.name][self.n:]
                pages[s.name] = (hp, dp) if d is L else (dp, hp)
            out[d] = pages
        return out

    def commands(self, lists: dict[Direction, dict[str, tuple[Any, Any]]]) -> list[ArrayCommand]:
        """New array records of ``lists`` (validated and copied: inside the timed region)."""
        out = []
        for d, pages in lists.items():
            self.last[d] = pages
            self.op += 1
            out.append(ArrayCommand(self.op, d, tuple(PageArrays(g, a, b) for g, (a, b) in pages.items())))
        return out

    def check(self) -> bool:
        """The last flush's pages landed (every region, both directions measured)."""
        ok = True
        for d, pages in self.last.items():
            for s in self.specs:
                src, dst = pages[s.name]
                si, di = torch.as_tensor(src), torch.as_tensor(dst)
                for layer in s.layers:
                    for c in s.components:
                        h, v = self.host.region(s.name, c.name, layer), self.dev.region(s.name, c.name, layer)
                        if d is L:
                            ok &= bool(torch.equal(v.index_select(0, di.cuda()).cpu(), h.index_select(0, si)))
                        else:
                            ok &= bool(torch.equal(h.index_select(0, di), v.index_select(0, si.cuda()).cpu()))
        return ok


#: perf_counter() of the first copy call or kernel launch since it was cleared (the bench's hook).
_FIRST_ISSUE: list[float] = []


def _watch_first_issue(eng: TransferEngine) -> None:
    """Record the host time of the first copy-engine call or kernel launch in
    :data:`_FIRST_ISSUE` (wraps the engine's copier and the kernels module once)."""
    from kvtier.transfer.backends import kernels

    def wrap(obj: Any, name: str) -> None:
        fn = getattr(obj, name)
        if getattr(fn, "_bench_first", False):
            return

        def wrapped(*a: Any, **k: Any) -> Any:
            if not _FIRST_ISSUE:
                _FIRST_ISSUE.append(time.perf_counter())
            return fn(*a, **k)
        wrapped._bench_first = True  # type: ignore[attr-defined]
        setattr(obj, name, wrapped)

    wrap(kernels, "launch_runs")
    if hasattr(eng.backend, "_launcher"):  # the pre-bound launch (transfer/backends/driver.py)
        wrap(eng.backend, "_launcher")
    from kvtier.transfer.backends import driver

    wrap(driver.Driver, "copy")
    copier = getattr(eng.backend, "copier", None)
    if copier is not None:
        wrap(copier, "copy")
        wrap(copier, "copy2d")


def measure_serving(setup: ServingSetup, eng: TransferEngine, directions: tuple[Direction, ...],
                    reps: int) -> dict[str, Any]:
    """Median over ``reps`` flushes (after two warm-ups) of submit->ack wall time with new
    page lists every flush (made before, turned into records inside the timed region),
    of the device time (an event before the flush to every transfer stream's end), of
    the host's time to the end of ``flush()`` and to the first copy call or kernel launch."""
    streams = getattr(eng.backend, "streams")
    walls, devs, hosts, firsts = [], [], [], []
    last: dict[str, Any] = {}
    first = _FIRST_ISSUE
    _watch_first_issue(eng)
    for rep in range(reps + 2):
        first.clear()
        lists = setup.page_lists(directions)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        cmds = setup.commands(lists)
        for c in cmds:
            eng.submit(c)
        eng.flush()
        t1 = time.perf_counter()
        cur = torch.cuda.current_stream()
        for d in directions:
            cur.wait_stream(streams.stream(d))
        end.record()
        want = {c.op_id for c in cmds}
        while want:
            for comp in eng.poll_completions():
                if comp.layer is None:
                    assert comp.ok, comp
                    want.discard(comp.op_id)
        wall = time.perf_counter() - t0
        end.synchronize()
        eng.synchronize()
        if rep >= 2:
            walls.append(wall)
            devs.append(start.elapsed_time(end) / 1e3)
            hosts.append(t1 - t0)
            firsts.append((first[0] - t0) if first else float("nan"))
        lf = eng.stats()["last_flush"]
        last = {d.value: {k: lf[d.value][k] for k in ("bytes", "sm_bytes", "ce_bytes", "stage_bytes", "stage_copies",
                                                      "ring_waits", "kernel_launches", "chunks", "max_blocks")}
                for d in directions if d.value in lf}
    total = len(directions) * setup.bytes
    return {"gbps": total / statistics.median(walls) / 1e9, "device_gbps": total / statistics.median(devs) / 1e9,
            "samples_gbps": [total / w / 1e9 for w in walls], "host_to_flush_end_ms": 1e3 * statistics.median(hosts),
            "host_to_first_issue_ms": 1e3 * statistics.median(firsts),
            "split": last}


def serving_table(reps: int, blocks: int, threads: int, calibration: Calibration | None,
                  wanted: set[str] | None = None) -> list[dict[str, Any]]:
    """The serving-path table: per configuration, the old path (hybrid backend,
    layer-first host pool: the SM kernel and batched copies) and the staging path
    (hybrid backend, page-major host pool: staging where it wins; loadbacks in chunks
    of 4 layers), and the staging path without its pipeline ramp (``staging_ramp=False``:
    whole slots from the first piece to the last), each way and both at once, new page
    lists every flush."""
    out = []
    for name, specs in CONFIGS:
        if name not in SERVING_CONFIGS or (wanted is not None and name not in wanted):
            continue
        row: dict[str, Any] = {"name": name, "page_bytes": sorted({c.page_bytes for s in specs for c in s.components})}
        setups: dict[str, ServingSetup] = {}
        for label, layout, chunk_layers, staging_bytes in (("old", "layer", 4, None), ("staging", "page", 4, None),
                                                           ("staging_noramp", "page", 4, None)):
            try:
                if layout not in setups:
                    setups.clear()
                    torch.cuda.empty_cache()
                    setups[layout] = ServingSetup(specs, layout)
                setup = setups[layout]
                opts: dict[str, Any] = {"blocks": blocks, "threads": threads,
                                        "calibration": calibration if calibration is not None else "default"}
                if layout == "page":
                    opts["staging_one_way"] = True  # the staging path alone, each way too
                    if staging_bytes is not None:
                        opts["staging_bytes"] = staging_bytes
                    if label == "staging_noramp":  # whole slots from the first piece to the last
                        opts["staging_ramp"] = False
                eng = TransferEngine(specs, setup.host, setup.dev, "hybrid", backend_options=opts,
                                     chunk_layers=chunk_layers)
                r: dict[str, Any] = {"pages": setup.n, "bytes": setup.bytes, "chunk_layers": chunk_layers}
                for key, dirs in (("h2d", (L,)), ("d2h", (W,)), ("both", (L, W))):
                    r[key] = measure_serving(setup, eng, dirs, reps)
                r["correct"] = setup.check()
                desc = eng.stats()["backend"]
                r["staging"] = desc.get("staging")
                r["bound_launch"], r["bound_error"] = desc.get("bound_launch"), desc.get("bound_error")
                row[label] = r
                print(f"serving {name:>16} {label:>7}: H2D {r['h2d']['gbps']:.1f} (dev {r['h2d']['device_gbps']:.1f}, "
                      f"host {r['h2d']['host_to_flush_end_ms']:.2f} ms, first issue "
                      f"{r['h2d']['host_to_first_issue_ms']:.2f} ms) D2H {r['d2h']['gbps']:.1f} (dev "
                      f"{r['d2h']['device_gbps']:.1f}) both {r['both']['gbps']:.1f} (dev {r['both']['device_gbps']:.1f}, host "
                      f"{r['both']['host_to_flush_end_ms']:.2f} ms, first {r['both']['host_to_first_issue_ms']:.2f} ms) "
                      f"bound {r['bound_launch']} "
                      f"ok {r['correct']} split {r['both']['split']}", flush=True)
                eng.synchronize()
                del eng
            except Exception:
                row[label] = {"error": traceback.format_exc()}
                print(f"serving {name} {label}: " + row[label]["error"], flush=True)
        setups.clear()
        torch.cuda.empty_cache()
        out.append(row)
    return out


def per_page_loop(setup: Setup, max_copies: int = 8192) -> dict[str, Any]:
    """One ``copy_`` per page per layer from Python (the baseline the issue names)."""
    stream = torch.cuda.Stream()
    pairs = []
    for s in setup.specs:
        src, dst = setup.lb[s.name]
        for layer in s.layers:
            for c in s.components:
                h, d = setup.host.region(s.name, c.name, layer), setup.dev.region(s.name, c.name, layer)
                pairs += [(d[j], h[i]) for i, j in zip(src, dst)]
    pairs = pairs[:max_copies]
    nbytes = sum(int(d.numel()) for d, _ in pairs)

    def go() -> None:
        with torch.cuda.stream(stream):
            for d, h in pairs:
                d.copy_(h, non_blocking=True)
        stream.synchronize()

    go()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        go()
        walls.append(time.perf_counter() - t0)
    return {"gbps": nbytes / statistics.median(walls) / 1e9, "copies": len(pairs), "bytes": nbytes}


def bench_config(name: str, specs: list[CacheGroupSpec], reps: int, blocks: int, threads: int,
                 backend: str = "hybrid", calibration: Calibration | None = None,
                 baselines: bool = True) -> dict[str, Any]:
    setup = Setup(specs)
    out: dict[str, Any] = {"name": name, "groups": len(specs),
                           "tensors_per_layer_max": max(len(s.components) for s in specs),
                           "page_bytes": sorted({c.page_bytes for s in specs for c in s.components}),
                           "pages": setup.n, "layers": LAYERS, "bytes": setup.bytes, "backend": backend}
    opts: dict[str, Any] = {"blocks": blocks, "threads": threads}
    if backend == "hybrid":
        opts["calibration"] = calibration if calibration is not None else "default"
    eng = TransferEngine(specs, setup.host, setup.dev, backend, backend_options=opts)
    out["h2d"] = measure_direction(setup, eng, L, reps)
    out["d2h"] = measure_direction(setup, eng, W, reps)
    out["both"] = measure_both(setup, eng, reps, "warm")
    out["both"].update({k: v for k, v in measure_both(setup, eng, reps, "replay").items() if k.startswith("replay")})
    eng.synchronize()
    out["correct"] = setup.check()
    out["plan_cache"] = eng.stats()["plan_cache"]
    out["thread_blocks"] = blocks
    out["threads"] = threads
    if backend != "numba":  # the SM kernel alone, same pages, for comparison
        neng = TransferEngine(specs, setup.host, setup.dev, "numba", backend_options={"blocks": blocks,
                                                                                       "threads": threads})
        out["numba"] = {"h2d": measure_direction(setup, neng, L, reps, ("warm",)),
                        "d2h": measure_direction(setup, neng, W, reps, ("warm",)),
                        "both": measure_both(setup, neng, reps, "warm")}
        neng.synchronize()
    if baselines:
        teng = TransferEngine(specs, setup.host, setup.dev, "torch")
        t = measure_direction(setup, teng, L, max(2, reps // 2))
        out["torch_h2d"] = {k: t[k] for k in ("replay_gbps", "kernel_gbps", "copy_calls")}
        out["loop"] = per_page_loop(setup)
    return out


def measure_calibration(blocks: int, threads: int) -> Calibration:
    """The hybrid backend's start-up calibration, measured once (it is what the
    backend would measure at bind) and given to every hybrid engine of the run."""
    from kvtier.transfer.backends.hybrid import HybridBackend

    specs = _one("kv", 4096)
    host, dev = HostPool(specs, 16), DevicePool.allocate(specs, 16, "cuda")
    b = HybridBackend(blocks, threads, calibration="measure")
    TransferEngine(specs, host, dev, b)
    assert b.calibration is not None
    return b.calibration


def blocks_sweep(reps: int) -> list[dict[str, Any]]:
    out = []
    for name, specs in (("4 KiB", _one("kv", 4096)), ("37,440 B", _one("kv", 37440))):
        setup = Setup(specs, seed=1)
        for blocks, threads in ((4, 1024), (8, 512), (8, 1024), (16, 1024), (32, 1024), (132, 256)):
            eng = TransferEngine(specs, setup.host, setup.dev, "numba",
                                 backend_options={"blocks": blocks, "threads": threads})
            r = measure_direction(setup, eng, L, reps)
            b = measure_both(setup, eng, reps, "replay")
            out.append({"config": name, "blocks": blocks, "threads": threads,
                        "h2d_kernel_gbps": r["kernel_gbps"], "h2d_replay_gbps": r["replay_gbps"],
                        "both_kernel_gbps": b["kernel_gbps"], "both_replay_gbps": b["replay_gbps"]})
        del setup
    return out


class _Batch:
    """Copy-engine copies of many scattered ranges in one call (``cuMemcpyBatchAsync``,
    CUDA 12.8+, through cuda-python's driver bindings); for the both-ways study."""

    def __init__(self, dsts: list[int], srcs: list[int], sizes: list[int], h2d: bool) -> None:
        from cuda.bindings import driver as drv

        self.drv = drv
        self.dsts = [drv.CUdeviceptr(x) for x in dsts]
        self.srcs = [drv.CUdeviceptr(x) for x in srcs]
        self.sizes = sizes
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        host, dev = drv.CUmemLocation(), drv.CUmemLocation()
        host.type, host.id = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST, 0
        dev.type, dev.id = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, torch.cuda.current_device()
        attr.srcLocHint, attr.dstLocHint = (host, dev) if h2d else (dev, host)
        attr.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_DEFAULT
        self.attr = attr

    def __call__(self, stream: torch.cuda.Stream) -> None:
        drv = self.drv
        n = len(self.sizes)
        step = 1 << 15
        for i in range(0, n, step):
            k = min(step, n - i)
            res = drv.cuMemcpyBatchAsync(self.dsts[i:i + k], self.srcs[i:i + k], self.sizes[i:i + k], k,
                                         [self.attr], [0], 1, drv.CUstream(stream.cuda_stream))
            if res[0] != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpyBatchAsync: {res[0]}")


def both_ways_study(reps: int) -> dict[str, Any]:
    """Why both directions at once stay far under the copy engines' both-ways ceiling:
    each direction by the kernel (zero-copy) or by the copy engines (contiguous
    ``copy_``, or scattered pages through ``cuMemcpyBatchAsync``), alone and paired.
    Everything is enqueued behind a sleeping kernel, so host enqueue time is not
    measured; each side's GB/s is its bytes over the time from the common start to its
    own end event, the pair's is both sides' bytes over the later end."""
    out: dict[str, Any] = {"variants": [], "errors": []}
    n = TARGET_BYTES
    c_host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    c_dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    c_host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    c_dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    side = {L: torch.cuda.Stream(), W: torch.cuda.Stream()}
    gate_cycles = int(3e8)  # ~0.15 s at the H200's clock: longer than any enqueue here

    for name, specs in (("4 KiB", _one("kv", 4096)), ("64 KiB", _one("kv", 65536))):
        setup = Setup(specs, seed=2)
        engines = {(d, b): TransferEngine(specs, setup.host, setup.dev, "numba", backend_options={"blocks": b})
                   for d in (L, W) for b in (8, 32, 64)}
        eng = {d: engines[(d, 8)] for d in (L, W)}
        same = {d: setup.transfers(d) for d in (L, W)}
        batches: dict[Direction, _Batch] = {}
        try:
            for d in (L, W):
                plan = eng[d].planner.plan(d, [setup.command(d, same[d])])
                g = plan.groups[0]
                src_pool, dst_pool = (setup.host, setup.dev) if d is L else (setup.dev, setup.host)
                dsts: list[int] = []
                srcs: list[int] = []
                sizes: list[int] = []
                for sp in specs:
                    for layer in sp.layers:
                        for c in sp.components:
                            sb = int(src_pool.region(sp.name, c.name, layer).data_ptr())
                            db = int(dst_pool.region(sp.name, c.name, layer).data_ptr())
                            srcs += (sb + g.run_src * c.page_bytes).tolist()
                            dsts += (db + g.run_dst * c.page_bytes).tolist()
                            sizes += (g.run_len * c.page_bytes).tolist()
                batches[d] = _Batch(dsts, srcs, sizes, d is L)
        except Exception:
            out["errors"].append(f"{name}: batch setup: " + traceback.format_exc(limit=3))

        def kernel(d: Direction, blocks: int = 8) -> Any:
            def go() -> torch.cuda.Stream:
                e = engines[(d, blocks)]
                e.submit(setup.command(d, same[d]))
                e.flush()
                return getattr(e.backend, "streams").stream(d)
            return go

        def contiguous(d: Direction) -> Any:
            def go() -> torch.cuda.Stream:
                with torch.cuda.stream(side[d]):
                    if d is L:
                        c_dev.copy_(c_host, non_blocking=True)
                    else:
                        c_host2.copy_(c_dev2, non_blocking=True)
                return side[d]
            return go

        def batch(d: Direction) -> Any:
            def go() -> torch.cuda.Stream:
                batches[d](side[d])
                return side[d]
            return go

        variants: list[tuple[str, list[tuple[Direction, str, Any]]]] = [
            ("kernel H2D + kernel D2H (8 + 8 blocks)", [(L, "kernel", kernel(L)), (W, "kernel", kernel(W))]),
            ("kernel H2D + kernel D2H (32 + 8 blocks)", [(L, "kernel", kernel(L, 32)), (W, "kernel", kernel(W))]),
            ("kernel H2D + kernel D2H (8 + 32 blocks)", [(L, "kernel", kernel(L)), (W, "kernel", kernel(W, 32))]),
            ("kernel H2D + kernel D2H (64 + 64 blocks)", [(L, "kernel", kernel(L, 64)), (W, "kernel", kernel(W, 64))]),
            ("kernel H2D alone (8 blocks)", [(L, "kernel", kernel(L))]),
            ("kernel D2H alone (8 blocks)", [(W, "kernel", kernel(W))]),
            ("kernel H2D + contiguous copy D2H", [(L, "kernel", kernel(L)), (W, "copy engine", contiguous(W))]),
            ("contiguous copy H2D + kernel D2H", [(L, "copy engine", contiguous(L)), (W, "kernel", kernel(W))]),
            ("contiguous copy H2D + contiguous copy D2H", [(L, "copy engine", contiguous(L)),
                                                           (W, "copy engine", contiguous(W))]),
        ]
        if len(batches) == 2:
            variants += [
                ("batched copies H2D alone", [(L, "batch", batch(L))]),
                ("batched copies D2H alone", [(W, "batch", batch(W))]),
                ("kernel H2D + batched copies D2H", [(L, "kernel", kernel(L)), (W, "batch", batch(W))]),
                ("batched copies H2D + kernel D2H", [(L, "batch", batch(L)), (W, "kernel", kernel(W))]),
                ("batched copies H2D + batched copies D2H", [(L, "batch", batch(L)), (W, "batch", batch(W))]),
            ]
        for label, parts in variants:
            try:
                per: dict[str, list[float]] = {"h2d": [], "d2h": [], "pair": []}
                for rep in range(reps + 1):
                    cur = torch.cuda.current_stream()
                    torch.cuda.synchronize()
                    torch.cuda._sleep(gate_cycles)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(cur)
                    ends = []
                    for d, _, fn in parts:
                        side[d].wait_stream(cur)  # the engines' own streams wait in flush()
                        st = fn()
                        e = torch.cuda.Event(enable_timing=True)
                        e.record(st)
                        ends.append((d, e))
                    torch.cuda.synchronize()
                    for e_ in engines.values():
                        e_.poll_completions()
                    if rep == 0:
                        continue  # warm-up
                    secs = {d: start.elapsed_time(e) / 1e3 for d, e in ends}
                    for d, t in secs.items():
                        per["h2d" if d is L else "d2h"].append(setup.bytes / t / 1e9)
                    per["pair"].append(len(secs) * setup.bytes / max(secs.values()) / 1e9)
                row: dict[str, Any] = {"pages": name, "variant": label,
                                       "h2d_by": next((how for d, how, _ in parts if d is L), None),
                                       "d2h_by": next((how for d, how, _ in parts if d is W), None)}
                for k, v in per.items():
                    if v:
                        row[k + "_gbps"] = statistics.median(v)
                out["variants"].append(row)
                print(f"both-ways study {name:>7} | {label:<44} | " + " ".join(
                    f"{k} {row[k + '_gbps']:.1f}" for k in ("h2d", "d2h", "pair") if k + "_gbps" in row), flush=True)
            except Exception:
                out["errors"].append(f"{name}: {label}: " + traceback.format_exc(limit=3))
                print(out["errors"][-1], flush=True)
        for e_ in engines.values():
            e_.synchronize()
        del setup, eng, engines, batches
        torch.cuda.empty_cache()
    return out


def profile_warm(reps: int = 20, backend: str = "hybrid") -> None:
    """cProfile of warm submit->ack (new array records, cached address tables), H2D,
    for 1 KiB and 64 KiB pages and the DeepSeek V4 mix, on ``backend``: where the host's
    time goes (printed)."""
    import cProfile
    import pstats

    for name, specs in (("1 KiB", _one("kv", 1024)), ("64 KiB", _one("kv", 65536)), ("V4 mix", dsv4_specs())):
        setup = Setup(specs, seed=3)
        eng = TransferEngine(specs, setup.host, setup.dev, backend)
        run_once(eng, [setup.array_command(L)])
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.cuda.synchronize()
            prof.enable()
            run_once(eng, lambda: [setup.array_command(L)])
            prof.disable()
        print(f"== profile, warm H2D {name}, {backend}: {1e3 * (time.perf_counter() - t0) / reps:.2f} ms per "
              f"transfer ({reps} transfers; profiled); split {eng.stats()['last_flush']['loadback']}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        eng.synchronize()
        del setup, eng
        torch.cuda.empty_cache()


def host_parts(setup: ServingSetup, eng: TransferEngine, dirs: tuple[Direction, ...], reps: int) -> dict[str, float]:
    """Host time per serving flush in the steps of submit and flush (wall-clock
    wrappers around the planner's, backend's and stager's methods; ms, means)."""
    import functools

    from kvtier.transfer.backends import stager as sgr

    acc: dict[str, float] = {}
    undo: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def w(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
        undo.append((obj, name, f))
        setattr(obj, name, w)

    b = eng.backend
    wrap(eng.planner, "plan", "plan")
    wrap(eng.planner, "queue", "queue")
    wrap(b, "split", "split")
    if getattr(b, "stager", None) is not None:
        wrap(b.stager, "choose", "split.choose")
        wrap(b.stager, "build", "split.plan_staging")
        wrap(b.stager, "upload", "upload")
        wrap(b.stager, "issue", "issue pieces")
        wrap(sgr, "fill_runs", "issue.fill_runs")
    wrap(b, "prepare", "prepare")
    wrap(b, "begin", "begin")
    wrap(b, "record", "record")
    total = 0.0
    for _ in range(reps):
        lists = setup.page_lists(dirs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cmds = setup.commands(lists)
        acc["make records"] = acc.get("make records", 0.0) + time.perf_counter() - t0
        t1 = time.perf_counter()
        for c in cmds:
            eng.submit(c)
        acc["submit"] = acc.get("submit", 0.0) + time.perf_counter() - t1
        eng.flush()
        total += time.perf_counter() - t0
        eng.synchronize()
        eng.poll_completions()
    for obj, name, f in reversed(undo):
        setattr(obj, name, f)
    out = {"total to flush end": 1e3 * total / reps}
    out.update({k: 1e3 * v / reps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])})
    return out


def profile_serving(reps: int = 10) -> None:
    """cProfile of the serving path's both-ways flush (page-major host, staging, new page
    lists every flush) for 4 KiB pages and the DeepSeek V4 mix: where the host's time
    to issue goes, per flush and per staged piece (printed)."""
    import cProfile
    import pstats

    for name, specs in (("4 KiB", _one("kv", 4096)), ("V4 mix", dsv4_specs())):
        setup = ServingSetup(specs, "page")
        eng = TransferEngine(specs, setup.host, setup.dev, "hybrid",
                             backend_options={"calibration": "default", "staging_one_way": True})
        measure_serving(setup, eng, (L, W), 1)
        prof = cProfile.Profile()
        host = []
        for _ in range(reps):
            lists = setup.page_lists((L, W))
            torch.cuda.synchronize()
            prof.enable()
            t0 = time.perf_counter()
            for c in setup.commands(lists):
                eng.submit(c)
            eng.flush()
            host.append(time.perf_counter() - t0)
            prof.disable()
            eng.synchronize()
            eng.poll_completions()
        lf = eng.stats()["last_flush"]
        pieces = sum(lf[d]["kernel_launches"] for d in lf)
        print(f"== profile, serving both ways {name}: host to the end of flush() {1e3 * statistics.median(host):.2f} ms "
              f"(profiled), {pieces} staged pieces; split {lf}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        for dirs in ((L,), (L, W)):
            parts = host_parts(setup, eng, dirs, reps)
            print(f"== host parts, serving {'+'.join(d.value for d in dirs)} {name} (ms per flush, means of {reps}): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        eng.synchronize()
        del setup, eng
        torch.cuda.empty_cache()


def junit_summary(path: str) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    failed = [c.get("name") for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    total["failed_tests"] = failed[:20]
    return total


def sanitizer_summary(path: str) -> dict[str, Any]:
    text = open(path, encoding="utf-8", errors="replace").read()
    m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    ok = "sanitize workload ok" in text
    memory = len(re.findall(r"^========= (Invalid|Out-of-range|Misaligned|Uninitialized)", text, re.M))
    api = len(re.findall(r"^========= Program hit CUDA_ERROR", text, re.M))
    return {"tool": "compute-sanitizer --tool memcheck --report-api-errors no", "error_summary": [int(x) for x in m],
            "memory_errors": memory, "api_errors_reported": api, "workload_ok": ok,
            "tail": text.strip().splitlines()[-3:] if text.strip() else []}


def sanitize_workload() -> None:
    """Small transfers of every kind, checked, for compute-sanitizer (memcheck)."""
    from kvtier.transfer.scenarios import (check_pools, check_protocol, random_commands, random_pools,
                                           random_specs, reference)

    mixed = {"sizes": [16, 48], "sm_gbps": {"loadback": [50, 50], "writeback": [50, 50]},
             "ce_gbps": {"loadback": [1, 60], "writeback": [1, 60]},
             "ce_pair_gbps": {"loadback": [1, 60], "writeback": [1, 60]}, "source": "sanitize: mixed"}
    stage = {"sizes": [1], "sm_gbps": {"loadback": [1], "writeback": [1]},
             "ce_gbps": {"loadback": [60], "writeback": [60]},
             "ce_pair_gbps": {"loadback": [60], "writeback": [60]}, "source": "sanitize: staging wins"}
    staged = {"calibration": stage, "staging_bytes": 1 << 14, "staging_slots": 2, "staging_min_bytes": 1,
              "staging_one_way": True}
    for seed, backend, opts, registered, layout in (
            (1, "numba", {}, False, "layer"), (2, "numba", {}, True, "layer"),
            (3, "numba", {"address_view": False}, True, "layer"),
            (4, "numba", {"blocks": 2, "threads": 64, "piece_bytes": 32}, True, "layer"),
            (5, "hybrid", {"calibration": mixed}, False, "layer"), (6, "hybrid", {"calibration": mixed}, True, "layer"),
            (7, "numba", {}, True, "page"), (8, "hybrid", staged, False, "page"), (9, "hybrid", staged, True, "page")):
        rng = np.random.default_rng(seed)
        specs = random_specs(rng)
        host, dev = random_pools(rng, specs, registered, device="cuda", host_layout=layout)
        eng = TransferEngine(specs, host, dev, backend, backend_options=opts, chunk_layers=2)
        cmds = random_commands(rng, specs, host, dev)
        want = reference(specs, host, dev, cmds)
        for c in cmds:
            eng.submit(c)
        eng.flush()
        eng.synchronize()
        comps = eng.poll_completions()
        check_protocol(cmds, comps)
        check_pools(host, dev, want)
    print("sanitize workload ok")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="transfer.json")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default=" ".join(sys.argv))
    ap.add_argument("--gpu-junit")
    ap.add_argument("--sanitizer-log")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1024)
    ap.add_argument("--sanitize", action="store_true", help="run the small sanitizer workload and exit")
    ap.add_argument("--configs", help="comma-separated config names to run (default: all)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the thread-block sweep")
    ap.add_argument("--no-study", action="store_true", help="skip the both-ways study")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of warm submit->ack and exit")
    ap.add_argument("--backend", default="hybrid", help="backend of the main table (default hybrid; the numba "
                                                          "backend is measured beside it)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the torch backend and the per-page loop")
    ap.add_argument("--serving", action="store_true", help="only the serving-path table (old path and staging "
                                                            "path) with the same run's ceilings and calibration")
    ap.add_argument("--replay-json", action="append", default=[],
                    help="a `kvtier replay --json` result of the same session to summarise (repeatable)")
    ap.add_argument("--study-only", action="store_true",
                    help="run only the both-ways study and write its JSON to --out (the benchmark runs it so, in a "
                         "child process, so that a driver failure there cannot lose the other results)")
    args = ap.parse_args()
    if args.sanitize:
        sanitize_workload()
        return 0
    if args.profile:
        profile_serving()
        profile_warm(backend=args.backend)
        return 0
    if args.study_only:
        study = both_ways_study(max(2, args.reps // 2))
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(study, f, indent=1, sort_keys=True)
        return 0
    import numba

    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "schema": 4,
        "backend": args.backend,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": args.commit,
        "command": args.command,
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
                     "numpy": np.__version__, "cuda": torch.version.cuda},
        "settings": {"blocks": args.blocks, "threads": args.threads, "reps": args.reps, "layers": LAYERS,
                     "target_bytes_per_transfer": TARGET_BYTES, "chunk_layers": 4, "piece_bytes": 16384},
        "errors": [],
    }
    try:
        import importlib.metadata as md
        result["versions"]["numba_cuda"] = md.version("numba-cuda")
    except Exception:
        pass
    t0 = time.time()
    try:
        result["ceilings"] = ceilings(args.reps)
        print(f"ceilings: H2D {result['ceilings']['h2d']:.1f}  D2H {result['ceilings']['d2h']:.1f}  "
              f"both {result['ceilings']['both']:.1f} GB/s", flush=True)
    except Exception:
        result["errors"].append(traceback.format_exc())
    calibration: Calibration | None = None
    if args.backend == "hybrid":
        try:
            calibration = measure_calibration(args.blocks, args.threads)
            result["calibration"] = calibration.as_dict()
            print(f"calibration ({calibration.extra.get('seconds')} s): crossovers {calibration.crossovers()}; "
                  f"sizes {calibration.sizes}; sm {calibration.sm_gbps}; ce {calibration.ce_gbps}; "
                  f"ce both {calibration.ce_pair_gbps}", flush=True)
        except Exception:
            result["errors"].append("calibration: " + traceback.format_exc())
            print(result["errors"][-1], flush=True)
    result["configs"] = []
    wanted = None if not args.configs else {x.strip() for x in args.configs.split(",")}
    if args.serving:
        result["serving"] = serving_table(args.reps, args.blocks, args.threads, calibration, wanted)
        wanted = set()  # the serving table only
    for name, specs in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        try:
            r = bench_config(name, specs, args.reps, args.blocks, args.threads, args.backend, calibration,
                             not args.no_baselines)
            result["configs"].append(r)
            h, d, b = r["h2d"], r["d2h"], r["both"]
            print(f"{name:>16}: H2D kernel {h['kernel_gbps']:.1f} cold {h['cold_gbps']:.1f} warm "
                  f"{h['warm_gbps']:.1f} tuples {h['warm_tuples_gbps']:.1f} replay {h['replay_gbps']:.1f} "
                  f"(sm {h['sm_bytes']} ce {h['ce_bytes']}) | D2H kernel {d['kernel_gbps']:.1f} warm "
                  f"{d['warm_gbps']:.1f} replay {d['replay_gbps']:.1f} | both kernel {b['kernel_gbps']:.1f} warm "
                  f"{b['warm_gbps']:.1f} replay {b['replay_gbps']:.1f} split {b['split']} | numba warm "
                  + (f"{r['numba']['h2d']['warm_gbps']:.1f}/{r['numba']['d2h']['warm_gbps']:.1f} both "
                     f"{r['numba']['both']['warm_gbps']:.1f}" if "numba" in r else "-")
                  + f" | ok {r['correct']}", flush=True)
        except Exception:
            result["errors"].append(f"{name}: " + traceback.format_exc())
            print(result["errors"][-1], flush=True)
        torch.cuda.empty_cache()
    if not args.no_sweep and not args.serving:
        try:
            result["blocks_sweep"] = blocks_sweep(args.reps)
        except Exception:
            result["errors"].append("blocks sweep: " + traceback.format_exc())
    if not args.no_study and not args.serving:
        torch.cuda.empty_cache()
        study_json = args.out + ".study.json"
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--study-only", "--out", study_json,
                                   "--reps", str(args.reps)], timeout=180)
            if proc.returncode == 0:
                with open(study_json, encoding="utf-8") as f:
                    result["both_ways_study"] = json.load(f)
            else:
                result["both_ways_study"] = {"variants": [], "errors": [f"study process exit {proc.returncode}"]}
        except Exception:
            result["both_ways_study"] = {"variants": [], "errors": [traceback.format_exc(limit=3)]}
    if args.gpu_junit:
        try:
            result["gpu_tests"] = junit_summary(args.gpu_junit)
        except Exception:
            result["errors"].append("gpu junit: " + traceback.format_exc())
    if args.sanitizer_log:
        try:
            result["sanitizer"] = sanitizer_summary(args.sanitizer_log)
        except Exception:
            result["errors"].append("sanitizer log: " + traceback.format_exc())
    result["replays"] = []
    for path in args.replay_json:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            both = doc["configurations"][1]
            result["replays"].append({
                "file": os.path.basename(path), "backend": doc["setup"]["backend"],
                "transfer_s_measured": both["transfer_s_measured"], "transfer_s_modeled": both["transfer_s_modeled"],
                "ratio": both["transfer_s_measured"] / both["transfer_s_modeled"] if both["transfer_s_modeled"]
                else None, "pages_checked": both.get("fingerprint_pages_checked")})
        except Exception:
            result["errors"].append(f"replay json {path}: " + traceback.format_exc(limit=2))
    result["bench_seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}; errors: {len(result['errors'])}")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
