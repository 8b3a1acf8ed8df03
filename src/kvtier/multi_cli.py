"""``kvtier replay --instances N [--l3 URL]``: the multi-instance replay's command line.

The options are registered on ``kvtier replay`` (:func:`add_arguments`); the run itself is
:func:`kvtier.l3replay.run_multi`. Capacities (``--device``/``--host``) are per instance;
the single-cache configuration gets N times both.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from .argtypes import int_in_range, positive_float, positive_int

__all__ = ["add_arguments", "run_multi_cli", "refuse_multi_only", "MULTI_DEFAULTS"]

#: What ``--instances`` changes when the option is not given: the L3 tier stores history
#: pages only (deepseek-v4 has continuation-state groups), one 512-token trace block per
#: cache unit keeps a store object per block (4 KiB at byte scale 1024 with 2 layers), and
#: a write-through host tier puts every prefix where the L3 write policy sees it.
MULTI_DEFAULTS = {"preset": "llama-3-8b", "layers": 2, "page_tokens": 512, "policy": "write_through",
                  "exclusive": False}

_ROUTERS = ("round-robin", "conversation")  # kvtier.router.ROUTERS (not imported: the parser stays light)
_WRITE_POLICIES = ("host_write", "selective", "host_eviction")  # kvtier.fsm.l3.options.WRITE_POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The multi-instance options of ``kvtier replay``."""
    g = p.add_argument_group(
        "multi-instance replay with a shared L3 store",
        "--instances N replays the trace on N kvtier instances (each with its own device and host tiers, "
        "--device/--host per instance) behind a router, three ways in one run: without L3, with L3 on the store "
        "at --l3 (when given), and as one cache with all their capacity. It prints hit tokens by tier per instance "
        "and in aggregate, the share of the hit rate lost to routing that L3 recovered, the prefetch cost, and the "
        "time of device-only hits with and without L3. Real (scaled) host bytes move to and from the store; every "
        "hit page is fingerprint-checked. Defaults with --instances: " +
        ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in MULTI_DEFAULTS.items() if k != "exclusive") +
        ", --no-exclusive")
    g.add_argument("--instances", type=int_in_range(1, 64), default=None, metavar="N",
                   help="engine instances, 1 to 64 (turns the multi-instance replay on)")
    g.add_argument("--l3", default=None, metavar="URL",
                   help="the shared store: redis://HOST:PORT[/DB] or mooncake://... (kvtier.transfer.store.open_store)")
    g.add_argument("--router", default=None, choices=_ROUTERS,
                   help="round-robin (default), or conversation: every turn of a conversation on the instance of "
                        "its first turn (conversations recovered from the trace's hash-id chains)")
    g.add_argument("--l3-write-policy", default=None, choices=_WRITE_POLICIES,
                   help="what goes to the store: host_write (a request's host-visible prefix when it ends; default), "
                        "selective (chunks reused twice), host_eviction (the host's next victims)")
    g.add_argument("--prefetch-units", type=positive_int, default=None, metavar="N",
                   help="most units one prefetch asks the store for (default 512)")
    g.add_argument("--l3-hint-size", type=positive_int, default=None, metavar="N",
                   help="keys each instance remembers as put (not put again while remembered; default 2048): "
                        "smaller puts a reused prefix again, which refreshes it in a store that evicts by LRU "
                        "(whole conversation trace, 4 instances, a 168 MB Redis: 2048 recovered 91.5 %% of the "
                        "routing loss, 65536 83.2 %%; bench/RESULTS.md)")
    g.add_argument("--l3-deadline", type=positive_float, default=None, metavar="S",
                   help="seconds a store operation may take before it fails (default 2)")


_MULTI_ONLY = ("l3", "router", "l3_write_policy", "prefetch_units", "l3_deadline", "l3_hint_size")


def refuse_multi_only(args: argparse.Namespace) -> None:
    """Raises ValueError when a multi-instance option is given without ``--instances``."""
    given = [f"--{name.replace('_', '-')}" for name in _MULTI_ONLY if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} need(s) --instances N (the multi-instance replay)")


def _check_store(url: str, timeout_s: float) -> float:
    """Fail before the run when the store URL is malformed or the store does not answer;
    returns the read lease the store grants (seconds; Mooncake Store: 10 by default)."""
    from kvtier.transfer.store import StoreError, open_store

    store = open_store(url, timeout_s=timeout_s)
    try:
        store.exists_prefix(["0" * 32])
        return float(store.lease_s)
    except (StoreError, OSError) as exc:
        raise ValueError(f"--l3 {url}: the store does not answer ({exc})") from None
    finally:
        store.close()


def run_multi_cli(args: argparse.Namespace) -> int:
    """Run ``kvtier replay --instances N``; returns the exit status.

    Raises:
        ValueError, kvtier.fsm.ConfigError: options the multi-instance replay does not take,
            a bad capacity or an unreachable store (exit status 2 from ``kvtier.cli.main``).
    """
    from kvtier.fsm.l3 import L3Options
    from kvtier.fsm.presets import preset

    from .exitcodes import ExitCode
    from .l3replay import MultiSetup, _one_thread, format_report, load_requests, report_json, run_multi
    from .replay import capacity_bounds, working_set_units
    from .replay_cli import LineProgress, _units
    from .router import route
    from .trace import load_trace

    for opt, bad in (("--plot", args.plot), ("--metrics-port", args.metrics_port is not None),
                     ("--event-log", args.event_log)):
        if bad:
            raise ValueError(f"{opt} is not available with --instances (single-instance replay only)")
    if args.backend != "cpu":
        raise ValueError(f"--backend {args.backend}: the multi-instance replay moves real host bytes (scaled by "
                         f"--byte-scale, fingerprint-checked) between the instances' host tiers and the store; use "
                         f"--backend cpu (the default with --instances; its copies are host-memory copies)")
    name = str(args.preset or MULTI_DEFAULTS["preset"])
    params: dict[str, Any] = {}
    if name == "llama-3-8b" or args.layers is not None:
        params["num_layers"] = args.layers or MULTI_DEFAULTS["layers"]
    if name != "deepseek-v4":
        params["page_tokens"] = args.page_tokens or MULTI_DEFAULTS["page_tokens"]
    layout = preset(name, **params)
    deadline = args.l3_deadline or 2.0
    opts = L3Options(model=name, write_policy=args.l3_write_policy or "host_write",
                     prefetch_units=args.prefetch_units or 512, deadline_s=deadline,
                     hint_size=args.l3_hint_size or L3Options().hint_size)
    if args.l3 is not None:
        if layout.state_groups:
            raise ValueError(f"--l3: preset {name!r} has continuation-state groups; the L3 tier stores history "
                             f"pages only (use --preset llama-3-8b or deepseek-v3)")
        opts = replace(opts, lease_s=_check_store(args.l3, deadline))  # leases are honoured
    _one_thread()
    trace = load_trace(args.trace, limit=args.limit)
    ws = working_set_units(trace, layout)
    longest, unbounded = capacity_bounds(trace, layout)
    dev = _units("--device", args.device, ws, longest, unbounded, layout.alignment)
    host = _units("--host", args.host, ws, longest, unbounded, layout.alignment)
    router = args.router or "round-robin"
    setup = MultiSetup(args.instances, router, dev, host, args.l3, opts, args.byte_scale, args.seed,
                       args.policy or str(MULTI_DEFAULTS["policy"]), args.eviction,
                       bool(MULTI_DEFAULTS["exclusive"]) if args.exclusive is None else args.exclusive)
    if not args.json:
        print(f"replaying {len(trace):,} requests of {trace.source} on {args.instances} instance(s), router "
              f"{router}, L3 {args.l3 or 'none'}; preset {name} {params}: per instance {dev * layout.alignment:,} "
              f"device + {host * layout.alignment:,} host tokens", flush=True)

    def progress(config: str, total: int) -> Any:
        return LineProgress(config, total, sys.stderr)

    where = route(trace.requests, args.instances, router, trace.block_tokens)
    rep = run_multi(load_requests(trace, layout), where, layout, setup, progress=progress)
    if args.json:
        json.dump(report_json(rep), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_report(rep))
    return ExitCode.OK
