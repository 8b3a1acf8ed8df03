"""Run ``kvtier replay`` on the GPU with a transfer backend its command line does not list.

``kvtier replay --backend`` offers ``none``, ``cpu``, ``torch`` and ``numba``, and the
replay's byte executor puts its device pool on the GPU for ``torch`` and ``numba`` only
(``src/kvtier/replay/command.py``, ``src/kvtier/replay/fingerprint.py``). Until ``hybrid`` is
added there, this script runs the replay with ``--backend numba`` (CUDA pools) and
replaces each executor's transfer engine, right after it is built and before any
copy, by one on the backend named here; the JSON's ``setup.backend`` says which.

    python bench/replay_backend.py hybrid --byte-scale 1 --layers 8 --limit 300 --json > out.json

``hybrid:page`` runs the hybrid backend with a page-major host pool
(``HostPool(layout="page")``), where the staging path moves whole host extents.

The JSON gets a ``flush_breakdown``: per flush, the host time from ``flush()`` to the
start event (the backend's ``begin``; the event-timed "measured" transfer time starts
there), from the start event to the first copy call or kernel launch (time the measured
clock runs while the stream waits on the host), and the whole ``flush()`` call, as totals
and medians, beside the event-timed device seconds, flushes, chunks, launches and copies
per direction: what a fixed cost per flush is made of.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from typing import Any

#: Per flush, host seconds (perf_counter): flush() start to the start event (the backend's
#: ``begin``, after which the event-timed "measured" clock runs), start event to the first
#: copy call or kernel launch (device-visible: the stream is idle unless earlier work is
#: still running), and the whole flush() call; plus the event-timed device seconds.
_BREAKDOWN: dict[str, list[float]] = {"to_start_event": [], "start_event_to_first_issue": [], "flush": []}
_MARK: dict[str, float] = {}


def _watch(eng: Any) -> None:
    """Wrap ``eng``'s flush, its backend's ``begin`` and the first copy/launch calls so
    that every flush adds its three host times to :data:`_BREAKDOWN`."""
    from kvtier.transfer.backends import driver, kernels

    def wrap(obj: Any, name: str, before: Any) -> None:
        fn = getattr(obj, name, None)
        if fn is None or getattr(fn, "_bench_wrap", False):
            return

        def wrapped(*a: Any, **k: Any) -> Any:
            before()
            return fn(*a, **k)
        wrapped._bench_wrap = True  # type: ignore[attr-defined]
        setattr(obj, name, wrapped)

    def first() -> None:
        if "begin" in _MARK and "first" not in _MARK:
            _MARK["first"] = time.perf_counter()

    def begin() -> None:
        _MARK.setdefault("begin", time.perf_counter())

    for obj, name in ((kernels, "launch_runs"), (eng.backend, "_launcher"), (driver.Driver, "copy")):
        wrap(obj, name, first)
    copier = getattr(eng.backend, "copier", None)
    if copier is not None:
        wrap(copier, "copy", first)
        wrap(copier, "copy2d", first)
    wrap(eng.backend, "begin", begin)
    flush = eng.flush

    def timed_flush(*a: Any, **k: Any) -> Any:
        _MARK.clear()
        t0 = time.perf_counter()
        out = flush(*a, **k)
        t1 = time.perf_counter()
        if "begin" in _MARK:
            _BREAKDOWN["to_start_event"].append(_MARK["begin"] - t0)
            _BREAKDOWN["start_event_to_first_issue"].append(_MARK.get("first", t1) - _MARK["begin"])
            _BREAKDOWN["flush"].append(t1 - t0)
        return out
    eng.flush = timed_flush


def _summary(engines: list[Any]) -> dict[str, Any]:
    """Totals and per-flush medians (ms) of :data:`_BREAKDOWN` over every engine of the
    run, beside the event-timed device seconds and flushes per direction."""
    import statistics
    out: dict[str, Any] = {"flushes_timed": len(_BREAKDOWN["flush"])}
    for k, v in _BREAKDOWN.items():
        out[f"{k}_s_total"] = sum(v)
        out[f"{k}_ms_median"] = 1e3 * statistics.median(v) if v else 0.0
    dev: dict[str, Any] = {}
    for e in engines:
        for d, st in e.stats().get("cumulative", {}).items():
            if isinstance(st, dict):
                a = dev.setdefault(d, {"seconds": 0.0, "flushes": 0, "bytes": 0, "chunks": 0, "stage_copies": 0,
                                       "kernel_launches": 0, "ce_calls": 0})
                for key in a:
                    a[key] += st.get(key) or 0
    out["device"] = dev
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: replay_backend.py BACKEND [kvtier replay options]", file=sys.stderr)
        return 2
    backend, rest = argv[0], argv[1:]
    backend, _, layout = backend.partition(":")
    base = os.environ.get("KVTIER_REPLAY_BASE", "numba")  # "cpu" to try this script without a GPU
    from kvtier import cli
    from kvtier.replay import fingerprint
    from kvtier.transfer import HostPool, TransferEngine

    original = fingerprint.BytesExecutor.__init__
    _ENGINES: list[Any] = []
    host_layout = layout

    def init(self: Any, layout: Any, device_pages: Any, host_pages: Any, _backend: str = "cpu",
             salt: int = 0) -> None:
        original(self, layout, device_pages, host_pages, base, salt)
        if host_layout:
            self.host = HostPool(list(layout.groups), host_pages or {g.name: 1 for g in layout.groups},
                                 layout=host_layout)
        # a page-major host measures the calibration at bind: the committed one has no copy
        # sizes of whole host extents (bench/RESULTS.md)
        opts = {"calibration": "measure"} if host_layout and backend == "hybrid" else None
        self.engine = TransferEngine(list(layout.groups), self.host, self.device, backend, backend_options=opts)
        _watch(self.engine)
        _ENGINES.append(self.engine)

    fingerprint.BytesExecutor.__init__ = init  # type: ignore[method-assign,assignment]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["replay", "--backend", base, *rest])
    text = out.getvalue()
    if "--json" in rest and rc == 0:
        doc = json.loads(text)
        doc["setup"]["backend"] = backend + (f" (host layout {layout})" if layout else "")
        doc["setup"]["backend_note"] = "run through bench/replay_backend.py (numba's CUDA pools, engine replaced)"
        doc["flush_breakdown"] = _summary(_ENGINES)
        text = json.dumps(doc, indent=1) + "\n"
    sys.stdout.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
