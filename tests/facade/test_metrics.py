"""Prometheus metrics (kvtier.metrics): every series from the start with zeros, values that
match the cache's statistics, and a live scrape of a running ``kvtier replay --metrics-port``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")  # the metrics extra; CI installs it with [test]
from facade_helpers import readme_cache, serve_readme_example  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvtier.metrics import KvtierCollector, serve  # noqa: E402

GROUP = "llama.full_attention"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _expected_series(groups: list[str]) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    want = {("kvtier:prompt_tokens_total", ()), ("kvtier:demotions_total", ()), ("kvtier:host_drops_total", ()),
            ("kvtier:retractions_total", ()), ("kvtier:invariant_checks_total", ()),
            ("kvtier:invariant_check_failures_total", ()), ("kvtier:requests_admitted_total", ())}
    want |= {("kvtier:prompt_tokens_cached_total", (("source", s),)) for s in ("device", "host")}
    want |= {("kvtier:operations_total", (("direction", d), ("outcome", o)))
             for d in ("writeback", "loadback") for o in ("ok", "failed", "deadline")}
    want |= {("kvtier:evictions_total", (("tier", t),)) for t in ("device", "host")}
    want |= {("kvtier:aborts_total", (("reason", "aborted by client"),))}
    for g in groups:
        want |= {(f"kvtier:pages_{k}", (("group", g), ("tier", t))) for k in ("used", "free") for t in ("device", "host")}
        want |= {(f"kvtier:pages_{k}", (("group", g),)) for k in ("pinned", "locked")}
    want |= {("kvtier:operations_in_flight", (("direction", d),)) for d in ("writeback", "loadback")}
    want |= {("kvtier:requests", (("state", s),)) for s in ("waiting", "running", "aborted")}
    return want


def test_every_series_exists_with_zero_values_before_any_work() -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvtierCollector(readme_cache()))
    got = _samples(generate_latest(reg).decode())
    missing = _expected_series([GROUP]) - set(got)
    assert not missing, sorted(missing)
    assert all(v == 0 for k, v in got.items() if not k[0].startswith("kvtier:pages_free"))
    assert got[("kvtier:pages_free", (("group", GROUP), ("tier", "device")))] == 8
    assert got[("kvtier:pages_free", (("group", GROUP), ("tier", "host")))] == 64
    assert all(name.startswith("kvtier:") for name, _ in got)


def test_values_follow_the_cache_statistics() -> None:
    from prometheus_client import CollectorRegistry

    cache = readme_cache()
    serve_readme_example(cache)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvtierCollector(cache))
    got = _samples(generate_latest(reg).decode())
    st = cache.stats()
    assert got[("kvtier:prompt_tokens_total", ())] == 70 + 70 + 100 + 70
    # b reuses the 4 system units (64 tokens) on the device; d finds the first one still on the
    # device (exact eviction freed only what c needed) and loads the other three back from the host
    assert got[("kvtier:prompt_tokens_cached_total", (("source", "device"),))] == 64 + 16
    assert got[("kvtier:prompt_tokens_cached_total", (("source", "host"),))] == 48
    assert got[("kvtier:requests_admitted_total", ())] == 4
    assert got[("kvtier:operations_total", (("direction", "loadback"), ("outcome", "ok")))] == st["loadbacks"] == 1
    assert got[("kvtier:operations_total", (("direction", "writeback"), ("outcome", "ok")))] == st["writebacks"]
    assert got[("kvtier:evictions_total", (("tier", "device"),))] == st["device_evictions"]
    assert got[("kvtier:demotions_total", ())] == st["demotions"] > 0
    assert got[("kvtier:transfer_pages_total", (("direction", "loadback"),))] == st["pages_loaded"] == 3
    assert got[("kvtier:invariant_checks_total", ())] == 4
    used = got[("kvtier:pages_used", (("group", GROUP), ("tier", "device")))]
    free = got[("kvtier:pages_free", (("group", GROUP), ("tier", "device")))]
    assert used + free == 8 and used == cache.core.device[GROUP].used
    assert got[("kvtier:requests", (("state", "finished"),))] == 0  # forgotten once reported by poll()


def test_pages_locked_counts_the_device_pages_a_running_request_holds() -> None:
    """A request running on a reused device prefix that has no host copy yet (write_back, the
    writeback acked only for the first request's own finish) locks that prefix's device pages:
    ``kvtier:pages_locked`` is the locked nodes' device pages (4 units of one page), not their
    host pages."""
    from prometheus_client import CollectorRegistry

    from kvtier import Completion, TieredCache
    from kvtier.fsm.presets import preset

    cache = TieredCache(preset("llama-3-8b"), device_pages=16, host_pages=64, policy="write_back")
    units = [("u", i) for i in range(4)]
    cache.admit("a", units, prompt_tokens=70, chunk_tokens=80)
    cache.step_done("a", 70)
    cache.finish("a")
    for c in cache.poll().commands:
        cache.complete(Completion(c.op_id))
    adm = cache.admit("b", units, prompt_tokens=70, chunk_tokens=80)
    assert adm.hit_tokens == 64
    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvtierCollector(cache))
    got = _samples(generate_latest(reg).decode())
    assert got[("kvtier:pages_locked", (("group", GROUP),))] == 4


def test_serve_on_loopback_and_bad_port() -> None:
    server = serve(KvtierCollector(readme_cache()), 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
        assert "kvtier:prompt_tokens_total 0.0" in body
    finally:
        server.close()
    with pytest.raises(ValueError, match="0..65535"):
        serve(KvtierCollector(), 70000)


def test_live_scrape_of_a_running_replay(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "replay", "--limit", "60", "--backend", "none",
                             "--metrics-port", "0", "--metrics-hold", "60"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        url = None
        for _ in range(5):
            m = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", proc.stdout.readline())
            if m:
                url = m.group(1)
                break
        assert url is not None, "the replay did not print its metrics address"
        seen: list[float] = []
        scrapes = 0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            body = urllib.request.urlopen(url, timeout=10).read().decode()
            got = _samples(body)
            scrapes += 1
            missing = {k for k in _expected_series([]) if "group" not in dict(k[1])} - set(got)
            assert not missing, sorted(missing)  # every series, zeros included, on every scrape
            prompt = got[("kvtier:prompt_tokens_total", ())]
            if not seen or seen[-1] != prompt:
                seen.append(prompt)
            if len(set(seen)) >= 3 and proc.poll() is None:
                break  # the counters moved between scrapes: the replay was running
            time.sleep(0.05)
        assert proc.poll() is None and len(set(seen)) >= 3 and max(seen) > 0, (scrapes, seen)
        # a configuration is running: its pools, per tier and cache group, are exported
        assert sum(1 for k in got if k[0] == "kvtier:pages_used") == 2 * 6  # deepseek-v4: 6 groups
    finally:
        proc.kill()
        proc.wait(timeout=30)
