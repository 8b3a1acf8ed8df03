"""``kvtier replay``: the command-line front of :mod:`kvtier.replay`.

:func:`add_parser` registers ``replay`` with its options, the multi-instance ones among them
(:func:`add_arguments`); :func:`run` runs the single-instance replay
(:func:`kvtier.replay.run_replay`), or with ``--instances N [--l3 URL]`` the multi-instance one
(:func:`run_multi_cli`, :func:`kvtier.replay.l3replay.run_multi`). Capacities
(``--device``/``--host``) are per instance; the single-cache configuration gets N times both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import replace
from typing import Any, NamedTuple

from ..cli.argtypes import float_in_range, int_in_range, positive_float, positive_int
from ..cli.exitcodes import ExitCode, LineFormatter, epilog

__all__ = ["add_parser", "run", "Capacity", "CAPACITY_HELP", "DEFAULT_DEVICE_FRACTION", "DEFAULT_HOST_FRACTION",
           "LineProgress", "add_arguments", "run_multi_cli", "refuse_multi_only", "MULTI_DEFAULTS",
           "MAX_METRICS_HOLD_S"]

DEFAULT_DEVICE_FRACTION = 0.05
"""Default ``--device``: 5 % of the trace's unbounded working set."""
DEFAULT_HOST_FRACTION = 0.5
"""Default ``--host``: 50 % of the trace's unbounded working set."""
MAX_METRICS_HOLD_S = 86_400
"""Longest ``--metrics-hold``, in seconds (one day)."""

CAPACITY_HELP = ("CAP is a fraction of the trace's unbounded working set, written 0.05 or 5%% (a bare "
                 "number must be in (0, 1]: 1 is the whole working set), or a token count with a 't' "
                 "suffix: 300000t. A fraction is rounded down to whole cache units and raised to at least "
                 "the longest request's units, so every request fits; any capacity above the unbounded "
                 "configuration's (which never evicts) is lowered to it, with a note")


class Capacity(NamedTuple):
    """A parsed ``--device`` / ``--host`` value: ``kind`` is ``"fraction"`` (``value`` in (0, 1])
    or ``"tokens"`` (``value`` an int >= 1)."""

    kind: str
    value: float


def _capacity(text: str) -> Capacity:
    """``"0.05"`` or ``"5%"`` -> a fraction of the working set; ``"300000t"`` -> tokens.

    A bare number above 1 is refused (it could mean tokens or a percentage), never guessed."""
    t = text.strip().lower()
    expected = "expected a fraction of the working set (0.05 or 5%) or a token count (300000t)"
    try:
        if t.endswith("t"):
            tokens = int(t[:-1])
            if tokens < 1:
                raise argparse.ArgumentTypeError(f"capacity {text!r}: a token count must be >= 1")
            return Capacity("tokens", tokens)
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity {text!r}: {expected}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"capacity {text!r} must be a finite number > 0")
    if t.endswith("%") and v > 1:
        raise argparse.ArgumentTypeError(f"capacity {text!r}: a percentage must be at most 100%")
    if v > 1:
        raise argparse.ArgumentTypeError(
            f"capacity {text!r}: a bare number is a fraction of the working set, at most 1; "
            f"write {t}t for {t} tokens or {t}% for a percentage")
    return Capacity("fraction", v)


def _v4_ratios(layers: int) -> tuple[int, ...]:
    """DeepSeek V4 compression ratios for ``layers`` layers: the preset's pattern (two
    sliding-window-only layers, then 4 and 128 alternating), with fewer sliding-window-only
    layers below 3 layers so at least one layer keeps compressed history: 1 -> (4,), 2 -> (1, 4)."""
    window_only = min(2, layers - 1)
    return (1,) * window_only + tuple(4 if i % 2 == 0 else 128 for i in range(layers - window_only))


def _check_backend(backend: str) -> None:
    """Fail before the run, with a CLI hint, when ``torch``/``numba`` has no CUDA device here."""
    if backend not in ("torch", "numba", "hybrid"):
        return
    try:
        import torch
    except ImportError:
        raise ValueError(f"--backend {backend} needs torch with CUDA; torch is not installed. "
                         f"Use --backend none (metadata only)") from None
    if not torch.cuda.is_available():
        raise ValueError(f"--backend {backend} needs a CUDA GPU, and this machine has none "
                         f"(torch.cuda.is_available() is False); use --backend cpu (real copies in host memory) "
                         f"or --backend none (metadata only)")


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
                    f"an unbounded cache. {CAPACITY_HELP.replace('%%', '%')}. Defaults: device "
                    f"{DEFAULT_DEVICE_FRACTION:g}, host {DEFAULT_HOST_FRACTION:g}, which make the default run "
                    "capacity-bound on the embedded trace and work on any valid trace.",
        epilog=epilog(), formatter_class=LineFormatter)
    p.add_argument("trace", nargs="?", default=None,
                   help="trace file (.jsonl or .jsonl.gz); default: the embedded slice")
    p.add_argument("--preset", default=None, choices=["deepseek-v4", "llama-3-8b", "deepseek-v3"],
                   help="model preset (default: deepseek-v4; with --instances: llama-3-8b with 2 layers and "
                        "512-token pages, one trace block per cache unit, as the L3 tier stores history pages only)")
    p.add_argument("--layers", type=int_in_range(1, 4096), default=None, metavar="N",
                   help="model layers, 1 to 4096 (a preset parameter; default: the preset's; deepseek-v4 "
                        "below 3 layers: ratios (4,) or (1, 4))")
    p.add_argument("--page-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per page for llama-3-8b / deepseek-v3 (default: the preset's)")
    p.add_argument("--device", type=_capacity, default=Capacity("fraction", DEFAULT_DEVICE_FRACTION), metavar="CAP",
                   help=f"device capacity: a fraction of the working set (0.05 or 5%%; a bare number must be "
                        f"at most 1) or tokens with a 't' suffix (300000t) (default {DEFAULT_DEVICE_FRACTION})")
    p.add_argument("--host", type=_capacity, default=Capacity("fraction", DEFAULT_HOST_FRACTION), metavar="CAP",
                   help=f"host capacity, likewise (default {DEFAULT_HOST_FRACTION})")
    p.add_argument("--policy", default=None,
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="write policy: write_back for the highest hit rate when the host is tight (with "
                        "--exclusive), write_through to keep every node backed (cheap demotions, more copies), "
                        "write_through_selective to back up only what two requests used (fewest copies) "
                        "(default: write_back; with --instances: write_through, so every prefix reaches the "
                        "host and the L3 write policy sees it)")
    p.add_argument("--eviction", default="lru", choices=["lru", "lru2", "lru_turns"],
                   help="eviction policy: lru (default; the next turn of a conversation reuses the newest tail), "
                        "lru_turns (LRU in which conversations that came back over several turns age slower: "
                        "more hits than lru device only or with --policy write_back --exclusive and a host about twice the "
                        "device; lru stays better with a large host), "
                        "lru2 (LRU on the device, LRU-2 on the host: keeps what two requests used over one-off "
                        "tails; for shared-prefix workloads; loses on conversation traces)")
    p.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                   help="exclusive host tier: the host keeps what the device does not (loaded-back duplicates "
                        "are dropped first); best with --policy write_back when the host is small "
                        "(default: on; --no-exclusive for an inclusive host tier; with --instances: off)")
    p.add_argument("--backend", default="cpu", choices=["none", "cpu", "torch", "numba", "hybrid"],
                   help="transfer backend; none = metadata only, cpu = real copies in host memory, torch, "
                        "numba and hybrid need a CUDA GPU (default: %(default)s)")
    p.add_argument("--byte-scale", type=positive_int, default=1024, metavar="N",
                   help="divide page bytes by N for real copies, keeping >= 64 B per page per group and "
                        "component (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="replay the first N requests only")
    p.add_argument("--seed", type=int, default=0, help="fingerprint salt (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot hit rate and tier occupancy over time (needs matplotlib: pip install 'kvtier[plot]')")
    p.add_argument("--verbose", action="store_true",
                   help="show every row of the table (the default shows what a user decides on; --verbose adds "
                        "internal counters: triggers, events per second, pages fingerprint-checked, ...)")
    p.add_argument("--metrics-port", type=int_in_range(0, 65535), default=None, metavar="N",
                   help="serve Prometheus metrics of the running configuration at http://127.0.0.1:N/metrics "
                        "while the replay runs (needs prometheus_client: pip install 'kvtier[metrics]')")
    p.add_argument("--metrics-hold", type=float_in_range(0, MAX_METRICS_HOLD_S), default=0.0, metavar="S",
                   help="with --metrics-port: keep serving the final values S seconds after the replay "
                        f"(0 .. {MAX_METRICS_HOLD_S:,}; default %(default)s)")
    p.add_argument("--event-log", default=None, metavar="FILE",
                   help="record the lifecycle event log of every configuration (JSON lines; check it with "
                        "kvtier check FILE). Recording costs bookkeeping time: see bench/RESULTS.md")
    add_arguments(p)
    p.set_defaults(func=run)


def _units(opt: str, cap: Capacity, working_set: int, longest: int, unbounded: int, alignment: int) -> int:
    """Cache units for a capacity (see :data:`CAPACITY_HELP`); a note on stderr when raised
    or lowered.

    Raises:
        ValueError: a token count below one cache unit.
    """
    if cap.kind == "fraction":
        units = int(working_set * cap.value)
        if units < longest:
            print(f"kvtier replay: note: {opt} {cap.value:g} of the working set is {units:,} unit(s); raised "
                  f"to {longest:,} units ({longest * alignment:,} tokens), the longest request's", file=sys.stderr)
            units = longest
    else:
        units = int(cap.value) // alignment
        if units < 1:
            raise ValueError(f"{opt} {int(cap.value):,}t is less than one cache unit ({alignment} tokens)")
    if units > unbounded:
        print(f"kvtier replay: note: {opt} lowered to {unbounded * alignment:,} tokens, the unbounded "
              f"configuration's capacity: this trace never uses more", file=sys.stderr)
        units = unbounded
    return units


def run(args: argparse.Namespace) -> int:
    """Run the replay; returns the exit status (:class:`kvtier.cli.exitcodes.ExitCode`).

    Raises:
        kvtier.fsm.ConfigError, ValueError, OSError: bad options or input (``kvtier.cli.main``
            reports them with exit status 2); errors found by the run itself propagate too.
    """
    from kvtier.fsm.presets import preset

    from . import ReplaySetup, capacity_bounds, format_table, run_replay, to_json, working_set_units
    from .trace import load_trace

    if args.instances is not None:
        return run_multi_cli(args)
    refuse_multi_only(args)
    args.preset = args.preset or "deepseek-v4"
    args.policy = args.policy or "write_back"
    args.exclusive = True if args.exclusive is None else args.exclusive

    if args.plot:
        _check_plot(args.plot)
    _check_backend(args.backend)
    if args.backend == "cpu":
        import torch

        # the scheduler and the copies run one after the other on this thread: for the
        # replay's small indexed copies torch's intra-op threads only spin (on a busy
        # 2-core machine an indexed store took 7x the CPU time with 2 threads than with 1)
        torch.set_num_threads(1)
    try:
        trace = load_trace(args.trace, limit=args.limit)
    except OSError as exc:  # a missing or unreadable file: one line naming it, exit status 2
        raise ValueError(f"cannot read trace file {args.trace}: {exc.strerror or exc}") from exc
    params: list[tuple[str, int | tuple[int, ...]]] = []
    if args.layers is not None:
        params.append(("num_layers", args.layers))
        if args.preset == "deepseek-v4" and args.layers < 3:
            params.append(("ratios", _v4_ratios(args.layers)))
    if args.page_tokens is not None:
        if args.preset == "deepseek-v4":
            raise ValueError("--page-tokens applies to llama-3-8b and deepseek-v3 (deepseek-v4's pages are fixed)")
        params.append(("page_tokens", args.page_tokens))
    layout = preset(args.preset, **dict(params))
    ws = working_set_units(trace, layout)
    longest, unbounded = capacity_bounds(trace, layout)
    dev_units = _units("--device", args.device, ws, longest, unbounded, layout.alignment)
    host_units = _units("--host", args.host, ws, longest, unbounded, layout.alignment)
    setup = ReplaySetup(preset=args.preset, preset_params=tuple(params), device_units=dev_units,
                        host_units=host_units, policy=args.policy, eviction=args.eviction,
                        exclusive=args.exclusive,
                        backend=args.backend, byte_scale=args.byte_scale, limit=args.limit, seed=args.seed)
    bars: list[Any] = []

    def progress(name: str, total: int) -> Any:
        if args.json:
            return None
        if sys.stderr.isatty():
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

            bar = tqdm(total=total, desc=name, unit="req", leave=False, file=sys.stderr)
            bars.append(bar)
            return bar.update
        return LineProgress(name, total, sys.stderr)  # a plain log: one line every few seconds

    hooks: list[Any] = []
    server = collector = None
    on_step: Any = None
    if args.metrics_port is not None:
        try:
            from ..metrics import KvtierCollector, serve
        except ImportError as exc:
            raise ValueError(f"--metrics-port needs prometheus_client: pip install 'kvtier[metrics]' ({exc})") \
                from None
        collector = KvtierCollector()
        server = serve(collector, args.metrics_port)
        on_step = collector.step  # scrapes take the scheduler's snapshots, between its steps

        def point(name: str, cache: Any, executor: Any) -> None:
            collector.cache = cache
            collector.engine = getattr(executor, "engine", None)

        hooks.append(point)
        if not args.json:
            print(f"metrics: http://127.0.0.1:{server.port}/metrics", flush=True)
    recorder = None
    try:
        if args.event_log:
            from ..eventlog import EventRecorder

            recorder = EventRecorder(args.event_log)
            hooks.append(lambda name, cache, executor: recorder.attach(cache))

        def on_start(name: str, cache: Any, executor: Any) -> None:
            for h in hooks:
                h(name, cache, executor)

        if not args.json:
            print(f"replaying {len(trace):,} requests of {trace.source} with preset {layout.name}: unbounded "
                  f"working set {ws * layout.alignment:,} tokens; device {setup.device_units * layout.alignment:,} "
                  f"tokens, host {setup.host_units * layout.alignment:,} tokens; backend {args.backend}",
                  flush=True)
        try:
            with collector.driving() if collector is not None else contextlib.nullcontext():
                results, summary = run_replay(trace, setup, progress=progress, on_start=on_start, on_step=on_step)
        finally:
            if recorder is not None:
                recorder.close()
            for bar in bars:
                bar.close()
        if args.json:
            json.dump(to_json(results, summary), sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            print(format_table(results, summary, verbose=args.verbose))
        if args.plot:
            try:
                from .plot import plot_timeline
            except ImportError as exc:
                print(f"kvtier replay: --plot needs matplotlib (pip install 'kvtier[plot]'): {exc}", file=sys.stderr)
                return ExitCode.USAGE
            plot_timeline(results, args.plot, summary)
            if not args.json:
                print(f"plot written to {args.plot}")
        if args.event_log and not args.json:
            print(f"event log written to {args.event_log} (check it: kvtier check {args.event_log})")
        if server is not None and args.metrics_hold > 0:
            time.sleep(args.metrics_hold)
    finally:
        if server is not None:
            server.close()
    return ExitCode.OK


class LineProgress:
    """Progress for a log that is not a terminal: one line every ``interval_s`` seconds
    (and one at the end), e.g. ``device+host: 412/1,000 requests (41%), 12 s``.

    Args:
        name: the configuration's name; total: requests in it; stream: where lines go.
        interval_s: seconds between lines (> 0).
    """

    def __init__(self, name: str, total: int, stream: Any, interval_s: float = 5.0) -> None:
        self.name, self.total, self.stream, self.interval_s = name, total, stream, interval_s
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval_s or self.done >= self.total:
            self.last = now
            pct = f" ({self.done / self.total:.0%})" if self.total else ""
            print(f"{self.name}: {self.done:,}/{self.total:,} requests{pct}, {now - self.t0:.0f} s",
                  file=self.stream, flush=True)


#: What ``--instances`` changes when the option is not given: the L3 tier stores history
#: pages only (deepseek-v4 has continuation-state groups), one 512-token trace block per
#: cache unit keeps a store object per block (4 KiB at byte scale 1024 with 2 layers), and
#: a write-through host tier puts every prefix where the L3 write policy sees it.
MULTI_DEFAULTS = {"preset": "llama-3-8b", "layers": 2, "page_tokens": 512, "policy": "write_through",
                  "exclusive": False}

_ROUTERS = ("round-robin", "conversation")  # .router.ROUTERS (not imported: the parser stays light)
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

    from . import capacity_bounds, working_set_units
    from .l3replay import MultiSetup, _one_thread, format_report, load_requests, report_json, run_multi
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
