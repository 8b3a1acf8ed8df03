"""kvtier replay: the three configurations, real bytes with fingerprints, an injected wrong
page mapping caught, the command line and its JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay.fingerprint import BytesExecutor, FingerprintMismatch
from kvtier.fsm import GroupTransfer, TransferCommand
from kvtier.fsm import units_to_pages
from kvtier.fsm.presets import preset
from kvtier.replay import ReplaySetup, make_executor, run_replay, working_set_units
from kvtier.replay.trace import load_trace


def setup_for(limit: int | None, backend: str) -> tuple[object, ReplaySetup]:
    trace = load_trace(None, limit=limit)
    ws = working_set_units(trace, preset("deepseek-v4"))
    return trace, ReplaySetup(device_units=int(ws * 0.05), host_units=int(ws * 0.5), backend=backend, limit=limit)


def test_default_trace_host_tier_computes_fewer_prefill_tokens() -> None:
    """Issue 6's 'done when': on the embedded default, device+host computes fewer prefill
    tokens than device-only at the default capacities."""
    trace, setup = setup_for(None, "none")
    results, summary = run_replay(trace, setup)  # type: ignore[arg-type]
    dev, both, unb = results
    assert (dev.name, both.name, unb.name) == ("device-only", "device+host", "unbounded")
    assert summary["requests"] == 1000 and summary["working_set_units"] == 41574
    assert dev.prompt_tokens == both.prompt_tokens == unb.prompt_tokens == 13_732_944
    assert both.prefill_tokens < dev.prefill_tokens
    assert both.hit_tokens > dev.hit_tokens and both.host_hit_tokens > 0 and dev.host_hit_tokens == 0
    assert unb.hit_tokens >= both.hit_tokens
    # every request ends; the unbounded cache never evicts
    assert dev.finished + dev.aborts == both.finished + both.aborts == unb.finished == 1000
    assert unb.evictions == 0 and unb.demotions == 0 and unb.loadbacks == 0
    # the history-only bound is at least the exact-state hit, and at most the ideal
    assert unb.hit_tokens <= unb.history_hit_tokens <= trace.ideal_hit_tokens()  # type: ignore[attr-defined]
    assert both.loadback_pages > 0 and both.writeback_pages > 0 and dev.writeback_pages == 0


def test_real_bytes_pass_fingerprint_checks() -> None:
    trace, setup = setup_for(150, "cpu")
    results, _ = run_replay(trace, setup)  # type: ignore[arg-type]
    dev, both, unb = results
    assert both.loadbacks > 0 and both.fingerprint_pages_checked > 0
    assert both.transfer_s_measured > 0
    # the same decisions as the metadata-only run: the backend never changes them
    meta, _ = run_replay(trace, dataclasses.replace(setup, backend="none"))  # type: ignore[arg-type]
    for a, b in zip(results, meta):
        assert (a.hit_tokens, a.prefill_tokens, a.loadback_pages, a.writeback_pages) == \
            (b.hit_tokens, b.prefill_tokens, b.loadback_pages, b.writeback_pages)


def test_injected_wrong_page_mapping_is_caught() -> None:
    """Swap two destination pages of every multi-page loadback: the request then reads a
    page holding another page's bytes, which its fingerprint check catches."""
    trace, setup = setup_for(150, "cpu")

    class WrongMapping(BytesExecutor):
        def submit(self, commands: list[TransferCommand]) -> None:  # type: ignore[override]
            out = []
            for cmd in commands:
                if cmd.direction.value == "loadback":
                    ts = []
                    for t in cmd.transfers:
                        dst = list(t.dst_pages)
                        if len(dst) > 1:
                            dst[0], dst[1] = dst[1], dst[0]
                        ts.append(GroupTransfer(t.group, t.src_pages, tuple(dst)))
                    cmd = dataclasses.replace(cmd, transfers=tuple(ts))
                out.append(cmd)
            super().submit(out)

    def factory(layout, dev, host):  # type: ignore[no-untyped-def]
        ex = make_executor(setup, layout, dev, host)
        assert isinstance(ex, BytesExecutor)
        return WrongMapping(ex.layout, units_to_pages(layout, dev), units_to_pages(layout, host) if host else None)

    with pytest.raises(FingerprintMismatch, match="loaded_equals_written") as info:
        run_replay(trace, setup, executor_factory=factory)  # type: ignore[arg-type]
    assert info.value.group.startswith("v4.")


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=300)


def test_cli_json_has_three_configurations() -> None:
    out = _kvtier("replay", "--limit", "40", "--backend", "none", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [c["name"] for c in doc["configurations"]] == ["device-only", "device+host", "unbounded"]
    assert doc["setup"]["requests"] == 40 and doc["setup"]["preset"] == "deepseek-v4"
    fields = {f.name for f in dataclasses.fields(__import__("kvtier.replay", fromlist=["ConfigResult"]).ConfigResult)}
    assert set(doc["configurations"][0]) == fields


def test_cli_table_and_capacities_in_tokens(tmp_path: Path) -> None:
    out = _kvtier("replay", "--limit", "30", "--backend", "none", "--preset", "deepseek-v3",
                  "--device", "20000t", "--host", "200000t")
    assert out.returncode == 0, out.stderr
    assert "device-only (19,968 dev / 0 host tokens)" in out.stdout  # 20,000 tokens in 64-token units
    assert "prefill tokens computed" in out.stdout and "modeled" in out.stdout


def test_cli_rejects_malformed_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    out = _kvtier("replay", str(bad), "--backend", "none")
    assert out.returncode == 2
    assert "line 2" in out.stderr and "hash_ids" in out.stderr
    out = _kvtier("replay", "--device", "lots")
    assert out.returncode == 2 and "capacity 'lots'" in out.stderr


def test_results_table_matches_committed_json() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "bench" / "replay_results.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_cli_default_table_is_short_verbose_has_every_row_and_a_plain_log_shows_progress() -> None:
    from kvtier.replay import ROWS, run_title

    short = _kvtier("replay", "--limit", "30", "--backend", "none")
    assert short.returncode == 0, short.stderr
    rows = [line for line in short.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == [label for label, _, _, default in ROWS if default]
    assert len(rows) == 13 and "lifecycle triggers" not in short.stdout and "--verbose shows every row" in short.stdout
    assert "prefill tokens computed (with recompute)" in short.stdout and "a --limit shrinks" in short.stdout and "recompute what they lost" in short.stdout
    # stderr is a pipe here, not a terminal: one progress line per configuration at least (the last at 100%)
    assert "unbounded: 30/30 requests (100%)" in short.stderr, short.stderr
    assert "device-only: " in short.stderr and "device+host: " in short.stderr
    full = _kvtier("replay", "--limit", "30", "--backend", "none", "--verbose")
    rows = [line for line in full.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(ROWS) == 21 and "pages fingerprint-checked" in full.stdout
    title = run_title({"requests": 30, "trace": "t.jsonl", "preset": "deepseek-v4", "device_tokens": 512,
                       "host_tokens": 4096, "working_set_tokens": 9000, "policy": "write_back", "backend": "cpu"})
    assert title == ("kvtier replay: 30 requests of t.jsonl, preset deepseek-v4\n"
                     "device 512 tokens, host 4,096 tokens (of a 9,000-token working set), policy write_back, backend cpu")
