"""Render the replay section of bench/RESULTS.md from the committed JSON files.

    python bench/replay_results.py            # rewrite the section
    python bench/replay_results.py --check    # exit 1 if the section differs (CI test)
    python bench/replay_results.py --compact bench/results/replay-*.json   # before committing them

Inputs (``bench/results/``, written by ``kvtier replay ... --json``; committed without each
configuration's per-step ``timeline``, which is not rendered and is most of the file:
``--compact`` rewrites the files named without it; a file is read only from here):

- ``replay-cpu-full-deepseek-v4-<commit>.json``: the whole Mooncake conversation trace,
  default preset and capacities, metadata only, on the 2-core CPU machine;
- ``replay-cpu-full-llama512-<commit>.json``: the same trace with the llama-3-8b preset and
  512-token pages at the peers' capacities (4,000 device blocks, host 8x), the setting of
  shared/reference/anchors.md section 7;
- ``replay-h200-<backend>-<date>-<commit>.json``: ``bench/gpu_replay.sh`` on the H200 (real
  bytes at full DeepSeek V4 page geometry, 8 layers, first 300 requests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import record_section  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
KEY = "replay"
TITLE = "Trace replay (kvtier replay)"

PEERS = ("peers on the same trace and capacities (anchors.md section 7): SGLang HiCache write_through 33.60 %, "
         "write_back 34.75 %, vLLM + CPU offload 34.39 %, ideal LRU 34.99 %; device-only (4,000 blocks) "
         "SGLang 8.72 %, vLLM 9.19 %, ideal 8.82 %; bookkeeping 300-420 us per request with the host tier")


def _load(pattern: str) -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob(pattern))]


def _table(doc: dict[str, Any]) -> str:
    rows = [
        ("prompt tokens", lambda c: f"{c['prompt_tokens']:,}"),
        ("prefix-hit tokens (device / host)", lambda c: f"{c['hit_tokens']:,} ({c['device_hit_tokens']:,} / "
                                                        f"{c['host_hit_tokens']:,})"),
        ("history-only bound", lambda c: f"{c['history_hit_tokens']:,}"),
        ("prefill tokens computed", lambda c: f"{c['prefill_tokens']:,}"),
        ("hit rate / vs unbounded", lambda c: f"{c['hit_rate']:.2%} / {c['hit_rate_vs_unbounded']:.2%}"),
        ("loadback GB / pages", lambda c: f"{c['loadback_bytes'] / 1e9:,.2f} / {c['loadback_pages']:,}"),
        ("writeback GB / pages", lambda c: f"{c['writeback_bytes'] / 1e9:,.2f} / {c['writeback_pages']:,}"),
        ("transfer s measured / modeled", lambda c: f"{c['transfer_s_measured']:.3f} / {c['transfer_s_modeled']:.3f}"),
        ("evictions / demotions", lambda c: f"{c['evictions']:,} / {c['demotions']:,}"),
        ("loadbacks / writebacks", lambda c: f"{c['loadbacks']:,} / {c['writebacks']:,}"),
        ("retractions / aborts", lambda c: f"{c['retractions']:,} / {c['aborts']:,}"),
        ("TTFT mean / p50 / p99 s (modeled)", lambda c: f"{c['ttft_mean_s']:.3f} / {c['ttft_p50_s']:.3f} / "
                                                        f"{c['ttft_p99_s']:.3f}"),
        ("kvtier bookkeeping us / request (decode calls)", lambda c: f"{c['bookkeeping_us_per_request']:,.0f} "
                                                                     f"({c['decode_bookkeeping_us_per_request']:,.0f})"),
        ("lifecycle triggers / per s of bookkeeping", lambda c: f"{c['lifecycle_triggers']:,} / "
                                                                f"{c['lifecycle_triggers'] / max(c['bookkeeping_s'], 1e-9):,.0f}"),
        ("wall s of the configuration", lambda c: f"{c['wall_s']:.1f}"),
        ("pages fingerprint-checked", lambda c: f"{c['fingerprint_pages_checked']:,}"),
    ]
    cfgs = doc["configurations"]
    head = ["", *(f"{c['name']} ({c['device_tokens']:,} / {c['host_tokens']:,} tokens)" for c in cfgs)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for label, fmt in rows:
        lines.append("| " + " | ".join([label, *(fmt(c) for c in cfgs)]) + " |")
    s = doc["setup"]
    lines.append("")
    lines.append(f"Setup: preset {s['preset']} (unit {s['alignment_tokens']} tokens), {s['requests']:,} requests, "
                 f"working set {s['working_set_tokens']:,} tokens, policy {s['policy']}, backend {s['backend']}, "
                 f"byte scale {s['byte_scale']}; modeled: {s['cost_model']}.")
    return "\n".join(lines)


def render() -> str:
    parts = []
    for name, doc in _load("replay-cpu-full-deepseek-v4-*.json"):
        parts.append(f"### Whole trace, default preset and capacities, metadata only (2-core CPU box)\n\n"
                     f"`kvtier replay ../shared/traces/mooncake_conversation_trace.jsonl --backend none --json` "
                     f"-> `bench/results/{name}`\n\n{_table(doc)}")
    for name, doc in _load("replay-cpu-full-llama512-*.json"):
        parts.append(f"### Whole trace at the peers' setting (llama-3-8b, 512-token pages, 4,000 device blocks, "
                     f"host 8x)\n\n`kvtier replay ../shared/traces/mooncake_conversation_trace.jsonl --preset "
                     f"llama-3-8b --page-tokens 512 --device 2048000t --host 16384000t --backend none --json` -> "
                     f"`bench/results/{name}`\n\n{_table(doc)}\n\nFor comparison, {PEERS}.")
    for name, doc in _load("replay-h200-*.json"):
        both = doc["configurations"][1]
        ratio = both["transfer_s_measured"] / both["transfer_s_modeled"] if both["transfer_s_modeled"] else 0.0
        stamp = name.split("-")[3] if name.count("-") >= 4 else ""
        date = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}" if len(stamp) == 8 and stamp.isdigit() else "date unknown"
        parts.append(f"### H200, real bytes ({doc['setup']['backend']} backend, full DeepSeek V4 page geometry, "
                     f"8 layers, first 300 requests)\n\n`bash bench/gpu_replay.sh` (through the device tool, "
                     f"{date}; NVIDIA H200, PCIe Gen5 x16) -> `bench/results/{name}`; "
                     f"device+host measured / modeled transfer time: {ratio:.1f}x\n\n{_table(doc)}")
    return "\n\n".join(parts) + "\n\n" + NOTES


NOTES = """Reading the tables:
- The exact counts (hits, tokens computed, bytes and pages moved) are the headline; times to
  first token are modeled by `kvtier.replay.costmodel` (constants and sources in its docstring).
- DeepSeek V4 needs exact continuation state: the history-only bound shows the hit a
  history-only rule would allow; the gap is the price of invariant 15.
- On the H200, the measured transfer time is the backend's CUDA-event time of its flushes, the
  modeled time the same bytes at 48 GB/s; their ratio is printed with each H200 table. The
  replay issues many small operations (about 3 MB each, one per scheduler step), where the
  per-flush overhead dominates (about 0.3 ms per operation with the numba backend, of which
  the copy itself is about 0.06 ms); `bench/transfer.py` shows the kernels at 89-95 % of the
  link for large flushes. The numba run was repeated three times with identical decisions and
  every reused page fingerprint-checked (`REPEAT=3 bash bench/gpu_replay.sh`).
- Decisions on the GPU may differ slightly between backends (loadback pages and prefill
  tokens): completions arrive asynchronously, as in a real engine; on the CPU backend they
  are identical to the metadata-only run (tests/replay/test_replay.py checks it).
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md's section is stale")
    ap.add_argument("--compact", nargs="+", type=Path, metavar="JSON",
                    help="rewrite these replay JSON files without their per-step timeline, then exit")
    args = ap.parse_args()
    if args.compact:
        for p in args.compact:
            doc = json.loads(p.read_text(encoding="utf-8"))
            for c in doc["configurations"]:
                c.pop("timeline", None)
            p.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            print(f"{p}: {p.stat().st_size:,} bytes without the timeline")
        return 0
    path = ROOT / "RESULTS.md"
    body = render()
    if args.check:
        text = path.read_text(encoding="utf-8")
        begin, end = f"<!-- {KEY}:begin -->", f"<!-- {KEY}:end -->"
        if begin not in text or end not in text:
            print("bench/RESULTS.md has no replay section", file=sys.stderr)
            return 1
        current = text.split(begin, 1)[1].split(end, 1)[0]
        if current.strip() != f"## {TITLE}\n\n{body.strip()}".strip():
            print("bench/RESULTS.md's replay section differs from bench/results/replay-*.json", file=sys.stderr)
            return 1
        return 0
    record_section(path, KEY, TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
