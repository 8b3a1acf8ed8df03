"""Host time per serving flush on the CPU (no GPU): records, submit, planning, the
staging split and the run-table fill, to the first copy and to the end of ``flush()``.

The serving path of ``bench/transfer.py --serving`` (256 MiB per direction, 8 layers,
new page lists every flush: device pages a new random permutation, each direction's
host pages one extent in a new random order; page-major host pool, staging ring
3 x 32 MiB per direction, staged both ways and each way), on CPU pools under the CUDA
simulator. The copies themselves are replaced by no-ops (the simulator's kernel on
256 MiB would take minutes); what is timed (CPU time of the thread) is the host's work
around them, the part that comes before the first copy on a GPU.

Runs with whatever ``kvtier`` the interpreter imports, so two trees can be compared
back to back under the same load (the old tree's interpreter first, then the new one):

    NUMBA_ENABLE_CUDASIM=1 python bench/transfer_host.py [--reps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

from kvtier.fsm import CacheGroupSpec, Direction  # noqa: E402
from kvtier.transfer import ArrayCommand, DevicePool, HostPool, PageArrays, TransferEngine  # noqa: E402
from page_geometry import dsv4_specs, one_size  # noqa: E402

L, W = Direction.LOADBACK, Direction.WRITEBACK
MiB = 1 << 20
TARGET_BYTES = 256 * MiB
CONFIGS = [("1 KiB", one_size("kv", 1024)), ("4 KiB", one_size("kv", 4096)), ("16 KiB", one_size("kv", 16384)),
           ("64 KiB", one_size("kv", 65536)), ("DeepSeek V4 mix", dsv4_specs())]

_FIRST: list[float] = []

#: CPU time of this thread (seconds): on a shared, loaded machine wall time counts the
#: time the process waits for a core; the host work measured here is single-threaded.
_clock = time.thread_time


def _no_copies(eng: TransferEngine) -> None:
    """Replace the kernel launches and the copier's copies by no-ops that note the
    time of the first one (``_FIRST``)."""
    b: Any = eng.backend

    def first(*_a: Any, **_k: Any) -> int:
        if not _FIRST:
            _FIRST.append(_clock())
        return 1

    b._k = type("K", (), {"launch_runs": staticmethod(first), "device_array": staticmethod(b._k.device_array),
                          "span_arrays": staticmethod(getattr(b._k, "span_arrays", None))})
    if getattr(b, "copier", None) is not None:
        b.copier.copy = first
        b.copier.copy2d = first


def measure(name: str, specs: list[CacheGroupSpec], dirs: tuple[Direction, ...], reps: int,
            rng: np.random.Generator) -> dict[str, float]:
    per_page = sum(s.page_bytes for s in specs)
    n = max(1, TARGET_BYTES // per_page)
    host = HostPool(specs, 2 * n, pin=False, reserve_bytes=0, layout="page")
    dev = DevicePool.allocate(specs, 2 * n, "cpu", reserve_bytes=0)
    eng = TransferEngine(specs, host, dev, "hybrid", chunk_layers=4,
                         backend_options={"calibration": "default", "staging_one_way": True,
                                          "staging_bytes": 192 * MiB})
    _no_copies(eng)
    parts: dict[str, list[float]] = {"records+submit": [], "to first copy": [], "to flush end": []}
    op = 0
    for rep in range(reps + 2):
        devp = {s.name: rng.permutation(2 * n) for s in specs}
        lists = {}
        for d in dirs:
            pages = {}
            for s in specs:
                hp = rng.permutation(n) + (0 if d is L else n)
                dp = devp[s.name][:n] if d is L else devp[s.name][n:]
                pages[s.name] = (hp, dp) if d is L else (dp, hp)
            lists[d] = pages
        _FIRST.clear()
        t0 = _clock()
        for d, pages in lists.items():
            op += 1
            eng.submit(ArrayCommand(op, d, tuple(PageArrays(g, a, b) for g, (a, b) in pages.items())))
        t1 = _clock()
        eng.flush()
        t2 = _clock()
        eng.synchronize()
        done = [c for c in eng.poll_completions() if c.layer is None]
        assert len(done) == len(dirs) and all(c.ok for c in done), done
        if rep >= 2:
            parts["records+submit"].append(t1 - t0)
            parts["to first copy"].append((_FIRST[0] if _FIRST else t2) - t0)
            parts["to flush end"].append(t2 - t0)
    lf = eng.stats()["last_flush"]
    staged = all(lf[d.value]["stage_bytes"] > 0 for d in dirs)
    del eng, host, dev
    out = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    out["staged"] = float(staged)
    return out


def run(reps: int, wanted: set[str] | None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    res: dict[str, Any] = {}
    for name, specs in CONFIGS:
        if wanted and name not in wanted:
            continue
        for label, dirs in (("both", (L, W)), ("h2d", (L,))):
            res[f"{name} {label}"] = measure(name, specs, dirs, reps, rng)
            r = res[f"{name} {label}"]
            print(f"{name:>16} {label:>4}: records+submit {r['records+submit']:.2f} ms, to first copy "
                  f"{r['to first copy']:.2f} ms, to flush end {r['to flush end']:.2f} ms, staged {bool(r['staged'])}",
                  flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--configs", help="comma-separated config names (default: all)")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    import kvtier

    commit = subprocess.run(["git", "-C", os.path.dirname(kvtier.__file__), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"kvtier from {os.path.dirname(kvtier.__file__)} ({commit}); load {os.getloadavg()[0]:.2f}", flush=True)
    res = run(args.reps, None if not args.configs else {x.strip() for x in args.configs.split(",")})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kvtier": os.path.dirname(kvtier.__file__), "commit": commit, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
