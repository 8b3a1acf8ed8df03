"""How deep one admission goes: Python calls and distinct source files, traced with
``sys.setprofile``, for one :meth:`kvtier.TieredCache.admit` on a warm cache and for a
whole request (admit, forward results, finish).

The cache is warmed first (one request over the same prompt, run to its end and polled),
so the traced admission takes the common path: a device hit, a lock on it, pages for
the first chunk. Only Python frames count as calls (``"call"`` events; builtins and C
functions are not calls here); files are those calls' source files, all of them and
those of kvtier alone. Deterministic: the same numbers on every run of the same code.

    python bench/admission_trace.py            # a table
    python bench/admission_trace.py --json     # one JSON object
    python bench/admission_trace.py --files    # also list the kvtier files of each trace
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from kvtier import TieredCache
from kvtier.fsm.presets import preset
from kvtier.tiered import ForwardResult

PROMPT_UNITS = 8  #: full units of the prompt (16 tokens each)
PAGE_TOKENS = 16
KVTIER = Path(__import__("kvtier").__file__).resolve().parent


def _package_root() -> list[Path]:
    """Folders whose files count as kvtier's (the facade, and the core and transfer
    folders wherever the package-dir mapping puts them)."""
    import kvtier.fsm
    import kvtier.transfer

    return [KVTIER, Path(kvtier.fsm.__file__).resolve().parent, Path(kvtier.transfer.__file__).resolve().parent]


def trace(fn: Callable[[], Any]) -> tuple[int, Counter[str]]:
    """Run ``fn`` under ``sys.setprofile``: the Python calls it makes (``fn`` itself
    excluded) and the calls per source file."""
    files: Counter[str] = Counter()
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1
            files[frame.f_code.co_filename] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    # the profiled lambda's own frame and sys.setprofile's return are not the cache's
    return calls - 1, files - Counter({__file__: 1})


def _kvtier_files(files: Counter[str]) -> list[str]:
    roots = _package_root()
    out = []
    for f in files:
        p = Path(f).resolve()
        for r in roots:
            if p.is_relative_to(r):
                out.append(f"{r.name}/{p.relative_to(r).as_posix()}" if r != KVTIER else
                           f"src/kvtier/{p.relative_to(r).as_posix()}")
                break
    return sorted(out)


def warm_cache() -> tuple[TieredCache, list[tuple[int, ...]], int]:
    """A cache that already holds the prompt's prefix on the device (one request over it,
    finished and polled), with the unit keys and prompt length of the next request."""
    cache = TieredCache(preset("llama-3-8b", page_tokens=PAGE_TOKENS), 64, 64)
    units = [tuple(range(u * PAGE_TOKENS, (u + 1) * PAGE_TOKENS)) for u in range(PROMPT_UNITS)]
    prompt = PROMPT_UNITS * PAGE_TOKENS
    adm = cache.admit("warm", units, prompt, prompt)
    assert adm is not None
    cache.step(results=[ForwardResult("warm", adm.chunk_tokens)])
    cache.finish("warm")
    cache.poll()
    return cache, units, prompt


def measure() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    cache, units, prompt = warm_cache()
    calls, files = trace(lambda: cache.admit("r1", units, prompt, prompt))
    adm = cache.request("r1")
    assert adm.state == "running" and adm.hit_tokens > 0, adm
    out["admit"] = {"calls": calls, "files": len(files), "kvtier_files": _kvtier_files(files)}

    cache, units, prompt = warm_cache()

    def whole() -> None:
        a = cache.admit("r2", units, prompt, prompt)
        assert a is not None
        cache.step(results=[ForwardResult("r2", a.chunk_tokens)])
        cache.finish("r2")

    calls, files = trace(whole)
    out["request"] = {"calls": calls, "files": len(files), "kvtier_files": _kvtier_files(files)}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--files", action="store_true", help="also list the kvtier files each trace enters")
    args = p.parse_args(argv)
    res = measure()
    if args.json:
        print(json.dumps({k: {"calls": v["calls"], "files": v["files"], "kvtier_files": len(v["kvtier_files"])}
                          for k, v in res.items()}, sort_keys=True))
        return 0
    print("| traced | Python calls | files | kvtier files |")
    print("|---|---:|---:|---:|")
    names = {"admit": "one admit (warm cache, device hit)", "request": "admit + forward result + finish"}
    for k, v in res.items():
        print(f"| {names[k]} | {v['calls']} | {v['files']} | {len(v['kvtier_files'])} |")
    if args.files:
        for k, v in res.items():
            print(f"\n{names[k]}:")
            for f in v["kvtier_files"]:
                print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
