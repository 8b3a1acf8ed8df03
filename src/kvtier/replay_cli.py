"""``kvtier replay``: the command-line front of :mod:`kvtier.replay`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from .argtypes import int_in_range, positive_int

__all__ = ["add_parser", "run"]

DEFAULT_DEVICE_FRACTION = 0.05
DEFAULT_HOST_FRACTION = 0.5


def _capacity(text: str) -> tuple[str, float]:
    """``"0.05"`` or ``"5%"`` -> a fraction of the working set; ``"300000t"`` -> tokens."""
    t = text.strip().lower()
    kind = "tokens" if t.endswith("t") else "fraction" if t.endswith("%") else ""
    try:
        v = float(int(t[:-1])) if kind == "tokens" else float(t[:-1]) / 100 if kind else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capacity {text!r}: expected a fraction of the working set (0.05 or 5%) or tokens (300000t)") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"capacity {text!r} must be a finite number > 0")
    if kind == "fraction" and v > 1:
        raise argparse.ArgumentTypeError(f"capacity {text!r}: a percentage must be at most 100%")
    if kind:
        return kind, v
    return ("fraction", v) if v <= 1 else ("tokens", v)


def _check_plot(path: str) -> None:
    """Fail before the run, not after it, on a --plot that cannot be written."""
    from pathlib import Path

    p = Path(path)
    if p.suffix.lower() != ".png":
        raise ValueError(f"--plot {path!r}: expected a .png file name")
    if not p.parent.exists():
        raise ValueError(f"--plot {path!r}: folder {str(p.parent)!r} does not exist")
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvtier[plot]'") from None


def add_parser(sub: Any) -> None:
    """Register ``replay`` on the subcommand parsers."""
    p = sub.add_parser(
        "replay", help="replay a request trace through the tiered cache (the main job)",
        description="Replay a Mooncake-format trace (default: the embedded first 1,000 requests of the public "
                    "Mooncake conversation trace) through the reference scheduler, the tiered cache and a "
                    "transfer backend, in three configurations: device cache only, device plus host tier, and "
                    "an unbounded cache. Capacities are fractions of the trace's unbounded working set "
                    f"(defaults: device {DEFAULT_DEVICE_FRACTION:g}, host {DEFAULT_HOST_FRACTION:g}, which make "
                    "the default run capacity-bound) or token counts with a 't' suffix.")
    p.add_argument("trace", nargs="?", default=None,
                   help="trace file (.jsonl or .jsonl.gz); default: the embedded slice")
    p.add_argument("--preset", default="deepseek-v4", choices=["deepseek-v4", "llama-3-8b", "deepseek-v3"],
                   help="model preset (default: %(default)s)")
    p.add_argument("--layers", type=int_in_range(1, 4096), default=None, metavar="N",
                   help="model layers, 1 to 4096 (a preset parameter; default: the preset's)")
    p.add_argument("--page-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per page for llama-3-8b / deepseek-v3 (default: the preset's)")
    p.add_argument("--device", type=_capacity, default=("fraction", DEFAULT_DEVICE_FRACTION), metavar="CAP",
                   help=f"device capacity: a fraction of the working set (0.05 or 5%%), or tokens ('300000t'; a "
                        f"plain number above 1 is also tokens) (default {DEFAULT_DEVICE_FRACTION})")
    p.add_argument("--host", type=_capacity, default=("fraction", DEFAULT_HOST_FRACTION), metavar="CAP",
                   help=f"host capacity, likewise (default {DEFAULT_HOST_FRACTION})")
    p.add_argument("--policy", default="write_through_selective",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="write policy (default: %(default)s)")
    p.add_argument("--backend", default="cpu", choices=["none", "cpu", "torch", "numba", "hybrid"],
                   help="transfer backend; none = metadata only (default: %(default)s)")
    p.add_argument("--byte-scale", type=positive_int, default=1024, metavar="N",
                   help="divide page bytes by N for real copies, keeping >= 64 B per page per group and "
                        "component (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="replay the first N requests only")
    p.add_argument("--seed", type=int, default=0, help="fingerprint salt (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot hit rate and tier occupancy over time (needs matplotlib: pip install 'kvtier[plot]')")
    p.set_defaults(func=run)


def _units(kind_value: tuple[str, float], working_set: int, alignment: int) -> int:
    kind, value = kind_value
    return int(working_set * value) if kind == "fraction" else int(value) // alignment


def run(args: argparse.Namespace) -> int:
    """Run the replay; returns the exit status."""
    from kvtier.fsm import KvtierError
    from kvtier.fsm.presets import preset

    from .replay import ReplaySetup, format_table, run_replay, to_json, working_set_units
    from .trace import load_trace

    try:
        if args.plot:
            _check_plot(args.plot)
        trace = load_trace(args.trace, limit=args.limit)
        params: list[tuple[str, int]] = []
        if args.layers is not None:
            params.append(("num_layers", args.layers))
        if args.page_tokens is not None:
            if args.preset == "deepseek-v4":
                raise ValueError("--page-tokens applies to llama-3-8b and deepseek-v3 (deepseek-v4's pages are fixed)")
            params.append(("page_tokens", args.page_tokens))
        layout = preset(args.preset, **dict(params))
        ws = working_set_units(trace, layout)
        dev_units = _units(args.device, ws, layout.alignment)
        host_units = _units(args.host, ws, layout.alignment)
        for opt, units in (("--device", dev_units), ("--host", host_units)):
            if units < 1:
                raise ValueError(f"{opt} is less than one cache unit ({layout.alignment} tokens)")
        setup = ReplaySetup(preset=args.preset, preset_params=tuple(params), device_units=dev_units,
                            host_units=host_units, policy=args.policy,
                            backend=args.backend, byte_scale=args.byte_scale, limit=args.limit, seed=args.seed)
        show = not args.json and sys.stderr.isatty()
        bars: list[Any] = []

        def progress(name: str, total: int) -> Any:
            if not show:
                return None
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

            bar = tqdm(total=total, desc=name, unit="req", leave=False, file=sys.stderr)
            bars.append(bar)
            return bar.update

        if not args.json:
            print(f"replaying {len(trace):,} requests of {trace.source} with preset {layout.name}: unbounded "
                  f"working set {ws * layout.alignment:,} tokens; device {setup.device_units * layout.alignment:,} "
                  f"tokens, host {setup.host_units * layout.alignment:,} tokens; backend {args.backend}",
                  flush=True)
        results, summary = run_replay(trace, setup, progress=progress)
        for bar in bars:
            bar.close()
    except (KvtierError, OSError, ValueError) as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(to_json(results, summary), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(results, summary))
    if args.plot:
        try:
            from .plot import plot_timeline
        except ImportError as exc:
            print(f"kvtier replay: --plot needs matplotlib (pip install 'kvtier[plot]'): {exc}", file=sys.stderr)
            return 2
        plot_timeline(results, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
