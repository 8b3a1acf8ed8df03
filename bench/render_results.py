"""Render the transfer section of bench/RESULTS.md from the newest committed JSON.

Only the text between ``<!-- transfer:begin -->`` and ``<!-- transfer:end -->`` is
replaced (other sections belong to other benchmarks); the markers are added under a
``## Transfer engine`` heading if missing.

    python bench/render_results.py            # rewrite bench/RESULTS.md
    python bench/render_results.py --check    # exit 1 if RESULTS.md is out of date
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
BEGIN, END = "<!-- transfer:begin -->", "<!-- transfer:end -->"


def newest_json(results_dir: str = os.path.join(HERE, "results")) -> str | None:
    files = sorted(glob.glob(os.path.join(results_dir, "transfer-*.json")))
    return files[-1] if files else None


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: float | None, ceiling: float | None) -> str:
    if x is None or not ceiling:
        return "-"
    return f"{100 * x / ceiling:.0f} %"


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def _tail(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    gt = data.get("gpu_tests")
    if gt:
        lines += ["", f"GPU tests (`pytest -m gpu tests/transfer/test_transfer_gpu.py`, same call): {gt['passed']} "
                      f"passed, {gt['failures'] + gt['errors']} failed, {gt['skipped']} skipped in {gt['time_s']} s"
                  + (f"; failed: {', '.join(gt['failed_tests'])}" if gt.get("failed_tests") else "") + "."]
    san = data.get("sanitizer")
    if san:
        lines += ["", f"`{san['tool']}` over the kernels and batched copies (`python bench/transfer.py --sanitize`: "
                      f"random small transfers, one-launch, per-bucket and hybrid paths, odd page sizes): ERROR "
                      f"SUMMARY {san['error_summary']}, memory errors {san.get('memory_errors', '-')}, workload "
                      f"checks passed: {'yes' if san['workload_ok'] else 'no'}."]
    if data.get("errors"):
        lines += ["", f"Errors during the run: {len(data['errors'])} (see the JSON)."]
    return lines


def _kib(x: int | None) -> str:
    return "never" if x is None else (f"{x // 1024} KiB" if x % 1024 == 0 else f"{x:,} B")


def render_v3(data: dict[str, Any], source: str) -> str:
    """Schema 3 (issue 16): the hybrid backend with array records, its calibration and
    the issue's targets."""
    c = data.get("ceilings", {})
    h2d_c, d2h_c, both_c = c.get("h2d"), c.get("d2h"), c.get("both")
    s = data.get("settings", {})
    cal = data.get("calibration")
    lines = [
        f"Run of {data['date']} on {data['gpu']} ({data['sm_count']} SMs), commit `{data['commit']}`, "
        f"from `{source}`.",
        "",
        f"Command: `{data['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(data.get("versions", {}).items())) + ".",
        "",
        f"Backend `{data.get('backend')}`: the Numba kernel ({s.get('blocks')} thread blocks x {s.get('threads')} "
        f"threads per launch, so at most {s.get('blocks')} of {data['sm_count']} SMs per launch) for small copies, "
        f"batched copy-engine copies (`cuMemcpyBatchAsync`) for large ones, per flush, direction and tensor ref; "
        f"loadbacks in chunks of {s.get('chunk_layers')} of {s.get('layers')} layers. Scattered random pages, about "
        f"{s.get('target_bytes_per_transfer', 0) / 2**20:.0f} MiB per transfer; medians of {s.get('reps')} "
        f"repetitions after a warm-up.",
        "",
        f"Pinned contiguous copy ceiling, same run: H2D {_f(h2d_c)} GB/s, D2H {_f(d2h_c)} GB/s, "
        f"both directions at once {_f(both_c)} GB/s.",
    ]
    if cal:
        x = cal["crossovers"]
        lines += ["", f"Calibration (measured at start-up in this run, {cal.get('extra', {}).get('seconds', '-')} s; "
                      f"GB/s of {cal.get('extra', {}).get('bytes_per_measure', 0) / 2**20:.0f} MiB in scattered "
                      f"copies of each size, the host's issue time included): copy engines from "
                      f"{_kib(x['loadback'])} (H2D) / {_kib(x['writeback'])} (D2H) per copy when the other direction "
                      f"is idle, from {_kib(x['loadback_busy'])} / {_kib(x['writeback_busy'])} when both are busy.",
                  "", "| copy size | " + " | ".join(_kib(z) for z in cal["sizes"]) + " |",
                  "| --- |" + " --- |" * len(cal["sizes"])]
        for label, key, d in (("kernel H2D", "sm_gbps", "loadback"), ("kernel D2H", "sm_gbps", "writeback"),
                              ("batched H2D", "ce_gbps", "loadback"), ("batched D2H", "ce_gbps", "writeback"),
                              ("batched H2D, both at once", "ce_pair_gbps", "loadback"),
                              ("batched D2H, both at once", "ce_pair_gbps", "writeback")):
            lines.append(f"| {label} | " + " | ".join(_f(v) for v in cal[key][d]) + " |")
    lines += [
        "",
        "GB/s and % of the same run's ceiling. *submit->ack*: wall time from making the commands to the "
        "acknowledgement from `poll_completions`; *cold*: plan caches cleared; *warm*: new array records "
        "(`ArrayCommand`, made from the page arrays inside the timed region) every flush: what serving does; "
        "*tuples*: new core records (`TransferCommand`, tuples of ints) every flush; *replay*: the same records "
        "(whole plan cached). *kernel*: device time from the flush's start event to its last event. *both*: a "
        "loadback and a writeback in one flush, bytes of both over the wall time to both acknowledgements. "
        "*numba*: the SM kernel alone (`numba` backend), warm, same pages.",
        "",
        "| pages | MB | engine H2D / D2H / both | H2D kernel | H2D cold / warm / tuples / replay | D2H kernel | "
        "D2H cold / warm / tuples / replay | both warm | both replay | numba warm H2D / D2H / both | correct |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def eng(x: dict[str, Any]) -> str:
        sm, ce = x.get("sm_bytes", 0), x.get("ce_bytes", 0)
        if sm and ce:
            return f"mixed ({100 * ce / (sm + ce):.0f} % CE)"
        return "CE" if ce else ("SM" if sm else "-")

    targets: list[tuple[str, str, str, str, bool | None]] = []
    max_blocks = 0
    for r in data.get("configs", []):
        h, d, b = r["h2d"], r["d2h"], r["both"]
        split = b.get("split", {})
        both_eng = "/".join(eng(split[k]) for k in ("loadback", "writeback") if k in split)
        nb = r.get("numba", {})
        nbs = (f"{_f(nb['h2d']['warm_gbps'])} / {_f(nb['d2h']['warm_gbps'])} / {_f(nb['both']['warm_gbps'])}"
               if nb else "-")
        for x in (h, d, *split.values()):
            max_blocks = max(max_blocks, int(x.get("max_blocks", 0)))
        lines.append(
            f"| {r['name']} x {r['pages']} x {r['layers']} layers | {r['bytes'] / 1e6:.0f} | "
            f"{eng(h)} / {eng(d)} / {both_eng or '-'} | "
            f"{_f(h['kernel_gbps'])} ({_pct(h['kernel_gbps'], h2d_c)}) | "
            f"{_f(h['cold_gbps'])} / {_f(h['warm_gbps'])} ({_pct(h['warm_gbps'], h2d_c)}) / "
            f"{_f(h.get('warm_tuples_gbps'))} / {_f(h['replay_gbps'])} | "
            f"{_f(d['kernel_gbps'])} ({_pct(d['kernel_gbps'], d2h_c)}) | "
            f"{_f(d['cold_gbps'])} / {_f(d['warm_gbps'])} ({_pct(d['warm_gbps'], d2h_c)}) / "
            f"{_f(d.get('warm_tuples_gbps'))} / {_f(d['replay_gbps'])} | "
            f"{_f(b.get('warm_gbps'))} ({_pct(b.get('warm_gbps'), both_c)}) | "
            f"{_f(b.get('replay_gbps'))} ({_pct(b.get('replay_gbps'), both_c)}) | {nbs} | "
            f"{'yes' if r.get('correct') else '**NO**'} |")
        name = r["name"]
        small = name.startswith("1 KiB")
        if h2d_c and d2h_c:
            want = 0.8 if small else 0.9
            for lab, x, ceil in (("H2D", h, h2d_c), ("D2H", d, d2h_c)):
                targets.append((f"warm submit->ack, {lab}", name, f"{_pct(x['warm_gbps'], ceil)}",
                                f">= {want:.0%}", x["warm_gbps"] >= want * ceil))
        if both_c and (name.startswith(("4 KiB", "64 KiB", "37,440", "DeepSeek"))):
            want = 0.75 if name.startswith("4 KiB") else 0.9
            for mode in ("warm", "replay"):
                v = b.get(mode + "_gbps")
                if v is not None:
                    targets.append((f"both directions at once, {mode}", name, f"{_f(v)} GB/s ({_pct(v, both_c)})",
                                    f">= {want:.0%} of {_f(both_c)}", v >= want * both_c))
    for rp in data.get("replays", []):
        ratio = rp.get("ratio")
        targets.append((f"GPU replay, measured / modeled transfer time ({rp['backend']})", "DeepSeek V4, 300 req.",
                        "-" if ratio is None else f"{ratio:.2f}x ({rp['transfer_s_measured']:.3f} / "
                        f"{rp['transfer_s_modeled']:.3f} s)", "<= 1.3x", None if ratio is None else ratio <= 1.3))
    targets.append(("SMs taken by one launch (largest)", "all", str(max_blocks), "<= 8", max_blocks <= 8))
    lines += ["", "Targets (issue 16), each against this run's ceilings:", "",
              "| measure | pages | measured | target | |", "| --- | --- | --- | --- | --- |"]
    for m, name, v, want, ok in targets:
        lines.append(f"| {m} | {name} | {v} | {want} | {_mark(ok)} |")
    cfgs = [r for r in data.get("configs", []) if "warm_submit_ms" in r.get("h2d", {})]
    if cfgs:
        lines += ["", "Host time per transfer (ms, medians): making the records and `submit` / `flush` (planning, "
                      "tables, uploads, launches and batched-copy calls) / wall time to the acknowledgement, warm:", "",
                  "| pages | H2D warm | H2D tuples | D2H warm | copies alone (H2D kernel) |",
                  "| --- | --- | --- | --- | --- |"]
        for r in cfgs:
            h, d = r["h2d"], r["d2h"]

            def parts(x: dict[str, Any], m: str) -> str:
                return f"{_f(x[m + '_submit_ms'], 2)} / {_f(x[m + '_flush_ms'], 2)} / {_f(x[m + '_wall_ms'], 2)}"
            lines.append(f"| {r['name']} | {parts(h, 'warm')} | {parts(h, 'warm_tuples')} | {parts(d, 'warm')} | "
                         f"{_f(r['bytes'] / h['kernel_gbps'] / 1e6, 2)} |")
    lines += _tail(data)
    return "\n".join(lines) + "\n"


def render(data: dict[str, Any], source: str) -> str:
    if data.get("schema", 1) >= 3:
        return render_v3(data, source)
    c = data.get("ceilings", {})
    h2d_c, d2h_c, both_c = c.get("h2d"), c.get("d2h"), c.get("both")
    s = data.get("settings", {})
    lines = [
        f"Run of {data['date']} on {data['gpu']} ({data['sm_count']} SMs), commit `{data['commit']}`, "
        f"from `{source}`.",
        "",
        f"Command: `{data['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(data.get("versions", {}).items())) + ".",
        "",
        f"Numba backend: {s.get('blocks')} thread blocks x {s.get('threads')} threads per launch "
        f"(at most {s.get('blocks')} of {data['sm_count']} SMs per direction), one launch per layer chunk "
        f"({s.get('chunk_layers')} layers; {s.get('layers')} layers per transfer, so loadbacks take "
        f"{max(1, s.get('layers', 1) // max(1, s.get('chunk_layers', 1)))} launches and writebacks 1), "
        f"rows split at {s.get('piece_bytes')} B. Scattered random pages, about "
        f"{s.get('target_bytes_per_transfer', 0) / 2**20:.0f} MiB per transfer; medians of {s.get('reps')} "
        f"repetitions after a warm-up.",
        "",
        f"Pinned contiguous copy ceiling, same run: H2D {_f(h2d_c)} GB/s, D2H {_f(d2h_c)} GB/s, "
        f"both directions at once {_f(both_c)} GB/s.",
        "",
        "GB/s and % of the same run's ceiling. *kernel*: device time from the flush's first event to its last "
        "chunk's event (" + ("all launches; the flush's run table is uploaded just before the first event"
                             if data.get("schema", 1) >= 2 else "table upload and all launches") + "). *submit->ack*: wall time from `submit` to the "
        "acknowledgement from `poll_completions`; *cold*: every plan cache cleared (plan building "
        "included), *warm*: new page lists, address tables cached, *replay*: the same transfer objects (whole "
        "plan and device table cached).",
        "",
        "| pages | MB | H2D kernel | H2D submit->ack cold / warm / replay | D2H kernel | D2H submit->ack "
        "cold / warm / replay | both ways kernel | both ways submit->ack | launches (H2D/D2H) | torch backend "
        "H2D | one copy_ per page | kernel / loop | correct |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    targets: list[tuple[str, str, bool | None, bool | None]] = []
    for r in data.get("configs", []):
        h, d, b = r["h2d"], r["d2h"], r["both"]
        loop = r.get("loop", {}).get("gbps")
        speedup = h["kernel_gbps"] / loop if loop else None
        lines.append(
            f"| {r['name']} x {r['pages']} x {r['layers']} layers | {r['bytes'] / 1e6:.0f} | "
            f"{_f(h['kernel_gbps'])} ({_pct(h['kernel_gbps'], h2d_c)}) | "
            f"{_f(h['cold_gbps'])} / {_f(h['warm_gbps'])} / {_f(h['replay_gbps'])} ({_pct(h['replay_gbps'], h2d_c)}) | "
            f"{_f(d['kernel_gbps'])} ({_pct(d['kernel_gbps'], d2h_c)}) | "
            f"{_f(d['cold_gbps'])} / {_f(d['warm_gbps'])} / {_f(d['replay_gbps'])} ({_pct(d['replay_gbps'], d2h_c)}) | "
            f"{_f(b['kernel_gbps'])} ({_pct(b['kernel_gbps'], both_c)}) | "
            f"{_f(b['replay_gbps'])} ({_pct(b['replay_gbps'], both_c)}) | "
            f"{h['kernel_launches']} / {d['kernel_launches']} | {_f(r['torch_h2d']['replay_gbps'], 2)} | "
            f"{_f(loop, 2)} | {_f(speedup, 0)}x | {'yes' if r.get('correct') else '**NO**'} |")
        one_way = 0.8 if r["name"].startswith("1 KiB") else 0.9
        for label, key in (("kernel", "kernel_gbps"), ("submit->ack replay", "replay_gbps"),
                           ("submit->ack warm", "warm_gbps")):
            ok1 = None if not (h2d_c and d2h_c) else (h[key] >= one_way * h2d_c and d[key] >= one_way * d2h_c)
            okb = None
            if key != "warm_gbps" and both_c:
                okb = b["kernel_gbps" if key == "kernel_gbps" else "replay_gbps"] >= 0.9 * both_c
            targets.append((r["name"], f"{label} (one way >= {one_way:.0%})", ok1, okb))
        targets.append((r["name"], "kernel >= 5x one copy_ per page", None if speedup is None else speedup >= 5, None))
    lines += ["", "Targets (issue 5), per page size:", "",
              "| pages | measure | one way | both ways |", "| --- | --- | --- | --- |"]
    for name, label, ok1, okb in targets:
        lines.append(f"| {name} | {label} | {_mark(ok1)} | {_mark(okb)} |")
    sweep = data.get("blocks_sweep", [])
    if sweep:
        first = [x for x in sweep if x["config"] == sweep[0]["config"]]
        lines += ["", "Thread blocks x threads per launch (kernel GB/s; H2D alone, and both directions at once with "
                      "that many blocks per direction):", "",
                  "| pages | measure | " + " | ".join(f"{x['blocks']} x {x['threads']}" for x in first) + " |",
                  "| --- | --- |" + " --- |" * len(first)]
        for cfg in dict.fromkeys(x["config"] for x in sweep):
            rows = [x for x in sweep if x["config"] == cfg]
            lines.append(f"| {cfg} | H2D | " + " | ".join(
                f"{_f(x['h2d_kernel_gbps'])} ({_pct(x['h2d_kernel_gbps'], h2d_c)})" for x in rows) + " |")
            if all("both_kernel_gbps" in x for x in rows):
                lines.append(f"| {cfg} | both ways | " + " | ".join(
                    f"{_f(x['both_kernel_gbps'])} ({_pct(x['both_kernel_gbps'], both_c)})" for x in rows) + " |")
    cfgs = [r for r in data.get("configs", []) if "warm_submit_ms" in r.get("h2d", {})]
    if cfgs:
        lines += ["", "Host time per transfer, H2D (ms, medians): in `submit` (validation, page lists to arrays) / in "
                      "`flush` (planning, table upload, launches) / wall time to the acknowledgement; the copies "
                      "alone (*kernel*) for comparison:", "",
                  "| pages | cold | warm | replay | kernel |", "| --- | --- | --- | --- | --- |"]
        for r in cfgs:
            h = r["h2d"]
            lines.append(f"| {r['name']} | " + " | ".join(
                f"{_f(h[m + '_submit_ms'], 2)} / {_f(h[m + '_flush_ms'], 2)} / {_f(h[m + '_wall_ms'], 2)}"
                for m in ("cold", "warm", "replay")) + f" | {_f(r['bytes'] / h['kernel_gbps'] / 1e6, 2)} |")
    study = data.get("both_ways_study", {})
    if study.get("variants"):
        lines += ["", "Both directions at once, by what moves each direction (GB/s; each side's bytes over the time from "
                      "the common start to its own end, the pair's over the later end; `python bench/transfer.py`'s "
                      "both-ways study, same run; *kernel*: the Numba backend, scattered pages; *copy engine*: one "
                      "contiguous `copy_` of the same bytes; *batch*: the same scattered pages as copy-engine copies, "
                      "`cuMemcpyBatchAsync` calls of up to 32,768 copies):", "",
                  "| pages | H2D by | D2H by | H2D | D2H | pair (% of both-ways ceiling) | variant |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for v in study["variants"]:
            pair = v.get("pair_gbps")
            lines.append(f"| {v['pages']} | {v.get('h2d_by') or '-'} | {v.get('d2h_by') or '-'} | "
                         f"{_f(v.get('h2d_gbps'))} | {_f(v.get('d2h_gbps'))} | "
                         f"{_f(pair)} ({_pct(pair, both_c) if v.get('h2d_by') and v.get('d2h_by') else '-'}) | "
                         f"{v['variant']} |")
    if study.get("errors"):
        lines += ["", f"Both-ways study errors: {len(study['errors'])} (see the JSON)."]
    gt = data.get("gpu_tests")
    if gt:
        lines += ["", f"GPU tests (`pytest -m gpu tests/transfer/test_transfer_gpu.py`, same call): {gt['passed']} "
                      f"passed, {gt['failures'] + gt['errors']} failed, {gt['skipped']} skipped in {gt['time_s']} s"
                  + (f"; failed: {', '.join(gt['failed_tests'])}" if gt.get("failed_tests") else "") + "."]
    san = data.get("sanitizer")
    if san:
        lines += ["", f"`{san['tool']}` over the kernels (`python bench/transfer.py --sanitize`: random small "
                      f"transfers, one-launch and per-bucket paths, odd page sizes): ERROR SUMMARY "
                      f"{san['error_summary']}, memory errors {san.get('memory_errors', '-')}, workload checks "
                      f"passed: {'yes' if san['workload_ok'] else 'no'}."]
    if data.get("errors"):
        lines += ["", f"Errors during the run: {len(data['errors'])} (see the JSON)."]
    return "\n".join(lines) + "\n"


def updated(md: str, body: str) -> str:
    block = f"{BEGIN}\n{body}{END}"
    if BEGIN in md and END in md:
        a, b = md.index(BEGIN), md.index(END) + len(END)
        return md[:a] + block + md[b:]
    if "## Transfer engine" not in md:
        md = md.rstrip("\n") + ("\n\n" if md.strip() else "# Benchmark results\n\n") + "## Transfer engine\n\n"
    i = md.index("## Transfer engine") + len("## Transfer engine\n")
    return md[:i] + "\n" + block + "\n" + md[i:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--results", default=RESULTS_MD)
    args = ap.parse_args()
    src = newest_json()
    if src is None:
        print("no bench/results/transfer-*.json", file=sys.stderr)
        return 1
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    body = render(data, os.path.relpath(src, os.path.dirname(HERE)))
    old = open(args.results, encoding="utf-8").read() if os.path.exists(args.results) else ""
    new = updated(old, body)
    if args.check:
        if new != old:
            print(f"{args.results} is out of date: run python bench/render_results.py", file=sys.stderr)
            return 1
        return 0
    with open(args.results, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
