"""The reference model against the product on the whole conversation trace.

    python bench/reference_model.py [TRACE] [--limit N] [--capacities 1000:-,8000 4000:-,32000]
                                    [--record [RESULTS.md]]

For every legal combination (write policy x eviction policy x exclusive host tier, one
configuration per eviction policy without a host tier) at each capacity, runs
``kvtier.tiered.TieredCache`` with instant transfers and the independent reference model
``kvtier.testing.reference.ReferenceCache`` side by side
(``kvtier.testing.reference_driver.compare_requests``: the peers' method, one request
after another, the whole prompt as one chunk; hit tokens by tier per admission and the
victims of every call compared, the whole tree at the end), and prints one row per
configuration: requests compared, the first difference (or ``-``), hit rate, seconds.

Preset ``llama-3-8b`` with 512-token pages: one trace block per cache unit. The exit
status is 1 when any configuration differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import provenance, record_section  # noqa: E402

from kvtier.cli.argtypes import positive_int  # noqa: E402
from kvtier.fsm import KvtierError  # noqa: E402
from kvtier.fsm.presets import preset  # noqa: E402
from kvtier.replay import trace_requests  # noqa: E402
from kvtier.testing.reference_driver import Divergence, compare_requests, configs  # noqa: E402
from kvtier.replay.trace import load_trace  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
#: device units : host units (comma-separated, ``-`` for no host tier)
CAPACITIES = ("1000:-,8000", "4000:-,32000")


def capacity(text: str) -> tuple[int, list[int | None]]:
    """``"4000:-,32000"`` -> (4000, [None, 32000])."""
    try:
        device, hosts = text.split(":")
        return int(device), [None if h == "-" else int(h) for h in hosts.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be DEVICE:HOST[,HOST...] (HOST '-' for none), got {text!r}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE) if TRACE.exists() else None,
                    help="Mooncake trace (default: ../shared/traces/mooncake_conversation_trace.jsonl, "
                         "else the embedded 1,000-request slice)")
    ap.add_argument("--limit", type=positive_int, default=None, help="compare only the first N requests")
    ap.add_argument("--capacities", type=capacity, nargs="+", default=[capacity(c) for c in CAPACITIES],
                    metavar="DEVICE:HOSTS", help="capacities in units (default: %(default)s)")
    ap.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="RESULTS.md",
                    help="write the table into this file's 'reference-model' section")
    args = ap.parse_args(argv)
    try:
        trace = load_trace(Path(args.trace) if args.trace else None, args.limit)
    except (KvtierError, OSError) as exc:
        print(f"bench/reference_model.py: {exc}", file=sys.stderr)
        return 2
    layout = preset("llama-3-8b", page_tokens=512)
    requests = trace_requests(trace, layout)
    prompt = sum(r.prompt_tokens for r in requests)
    lines = [f"trace: {trace.source}, {len(requests):,} requests", "",
             "| device / host units | policy | eviction | exclusive | requests compared | first difference | "
             "hit rate | of which host | seconds |", "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    failed = 0
    for device, hosts in args.capacities:
        for cfg in configs(device, hosts):
            try:
                r = compare_requests(requests, layout, cfg)
                compared, first = f"{r.requests:,}", "-"
                rate, host, seconds = r.hit_tokens / prompt, r.host_hit_tokens / prompt, f"{r.seconds:.1f}"
                cells = f"{rate:.2%} | {host:.2%} | {seconds}"
            except Divergence as d:
                failed += 1
                compared, first, cells = f"{d.index:,}", f"#{d.index} ({d.request_id}): {d.what}", "- | - | -"
            host_cell = f"{cfg.host:,}" if cfg.host is not None else "none"
            policy = cfg.policy if cfg.host is not None else "-"
            line = (f"| {cfg.device:,} / {host_cell} | {policy} | {cfg.eviction} | {'yes' if cfg.exclusive else 'no'} "
                    f"| {compared} | {first} | {cells} |")
            lines.append(line)
            print(line, flush=True)
    print(f"\n{failed} configuration(s) differ" if failed else "\nevery configuration agrees")
    if args.record:
        info = provenance(sys.argv if argv is None else ["bench/reference_model.py", *argv])
        body = "\n\n".join([info, "\n".join(lines),
                            "Method: kvtier.testing.reference_driver.compare_requests (instant transfers, one request "
                            "after another, the whole prompt as one chunk); hit tokens by tier per admission, the "
                            "victims of every call and the whole tree at the end compared. Re-run: "
                            "`python bench/reference_model.py --record`."])
        record_section(Path(args.record), "reference-model", "The reference model against the product", body)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
