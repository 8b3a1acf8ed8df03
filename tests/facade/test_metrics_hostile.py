"""Generated hostile inputs for the Prometheus metrics (kvtier.metrics, ``kvtier replay
--metrics-port/--metrics-hold``).

Scrapes beside a running scheduler: while a thread drives the cache inside
``KvtierCollector.driving()``, no scrape reads the cache (every read is on the driving
thread, between two steps) and each scrape equals a direct read of the cache at that point;
the driving thread never waits for a scrape; a real HTTP client scraping in a loop beside a
full ``kvtier replay`` gets HTTP 200 and text prometheus_client parses, every time. Label
values: every abort reason (a lone surrogate, control characters, quotes, a 10,000-character
reason, one spelled ``other``) is served with HTTP 200 on every later scrape, and the reason
label set stays bounded (kvtier's own reasons, the first MAX_ABORT_REASONS others, ``other``).
Construction and assignment: every cache, engine and wait that is not one is refused with
ConfigError naming it, changing nothing. Options: every ``--metrics-hold`` and
``--metrics-port`` out of range is an argparse error naming it (exit status 2).

Timeouts here are hang guards (joins, urlopen), never what decides an outcome.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client")  # the metrics extra; CI installs it with [test]
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvtier import Completion  # noqa: E402
from kvtier.cli import build_parser, main  # noqa: E402
from kvtier.fsm import ConfigError  # noqa: E402
from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS  # noqa: E402
from kvtier.fsm.presets import preset  # noqa: E402
from kvtier.metrics import MAX_ABORT_REASONS, MAX_LABEL_CHARS, KvtierCollector, serve  # noqa: E402
from kvtier.replay import trace_requests  # noqa: E402
from kvtier.scheduler import ReferenceScheduler  # noqa: E402
from kvtier.tiered import TieredCache  # noqa: E402
from kvtier.replay.trace import load_trace  # noqa: E402

GUARD_S = 120  # hang guard for joins and HTTP requests (never reached when the code is right)
LAYOUT = preset("llama-3-8b", num_layers=2)


def _cache() -> TieredCache:
    return TieredCache(LAYOUT, device_pages=64, host_pages=256, policy="write_through")


def _registry(collector: KvtierCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class _ReadLog:
    """Wraps ``cache.stats`` (every scrape reads it first) to record the threads that read."""

    def __init__(self, cache: TieredCache) -> None:
        self.threads: list[int] = []
        orig = cache.stats

        def stats() -> dict[str, Any]:
            self.threads.append(threading.get_ident())
            return orig()

        cache.stats = stats  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- scrapes beside a scheduler
def _scrape_in_thread(reg: CollectorRegistry) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(generate_latest(reg)), daemon=True)
    t.start()
    return t, got


def test_scrapes_beside_the_scheduler_read_only_on_its_thread_between_steps() -> None:
    """Every 97 steps of the reference scheduler a scrape starts on another thread; the
    scheduler's thread keeps calling step() (its hook between steps) until the scrape is
    served. The scrape's text equals a direct read of the cache at that point, and only the
    scheduler's thread read the cache."""
    cache = TieredCache(LAYOUT, device_pages=6000, host_pages=20000, policy="write_through")
    reads = _ReadLog(cache)
    collector = KvtierCollector(cache)
    reg = _registry(collector)
    direct = _registry(KvtierCollector(cache))  # not driven: reads the cache on the calling thread
    served: list[tuple[bytes, bytes]] = []
    calls = [0]

    def on_step() -> None:
        calls[0] += 1
        collector.step()
        if calls[0] % 97:
            return
        t, got = _scrape_in_thread(reg)
        for _ in range(GUARD_S * 100):  # hang guard: the first step() after the scrape waits serves it
            collector.step()
            t.join(0.01)
            if not t.is_alive():
                break
        assert not t.is_alive(), "the scrape was never served"
        served.append((got[0], generate_latest(direct)))

    reqs = trace_requests(load_trace(None, limit=12), LAYOUT)
    with collector.driving():
        stats = ReferenceScheduler(cache).run(reqs, on_step=on_step)
    assert stats.finished + stats.aborts == len(reqs) and len(served) >= 10, (stats, len(served))
    for scraped, expected in served:
        assert scraped == expected  # one consistent point: the values a direct read gives there
    assert set(reads.threads) == {threading.get_ident()}, "a scrape read the cache on the server's thread"
    values = [_samples(s.decode())[("kvtier:prompt_tokens_total", ())] for s, _ in served]
    assert values == sorted(values) and values[-1] > values[0]  # the counters moved between scrapes


def test_the_driving_thread_never_waits_for_a_scrape() -> None:
    """step() with no scrape waiting reads nothing and returns; a scrape waiting is served
    by one step() (the driving thread reads and hands over, it never waits on the scrape)."""
    cache = _cache()
    reads = _ReadLog(cache)
    collector = KvtierCollector(cache, snapshot_wait_s=GUARD_S)
    reg = _registry(collector)
    with collector.driving():
        for _ in range(1000):
            collector.step()
        assert reads.threads == []  # nothing waited: nothing read
        t, got = _scrape_in_thread(reg)
        while t.is_alive():  # bounded by the scrape's own wait (GUARD_S)
            collector.step()
            t.join(0.01)
    assert got and reads.threads == [threading.get_ident()] * len(reads.threads) and len(reads.threads) >= 1
    assert b"kvtier:prompt_tokens_total 0.0" in got[0]


def test_a_scrape_waiting_when_driving_ends_reads_the_cache_itself() -> None:
    cache = _cache()
    collector = KvtierCollector(cache, snapshot_wait_s=GUARD_S * 10)  # far past the join's guard
    reg = _registry(collector)
    with collector.driving():
        t, got = _scrape_in_thread(reg)
    t.join(GUARD_S)
    assert not t.is_alive() and got and b"kvtier:pages_free" in got[0]


def test_a_scrape_on_the_driving_thread_reads_the_cache_at_once() -> None:
    """An engine serving its metrics from its scheduler's own thread: the scrape does not
    wait for a snapshot that thread would have to take."""
    cache = _cache()
    collector = KvtierCollector(cache, snapshot_wait_s=GUARD_S * 10)  # far past the join's guard
    reg = _registry(collector)
    got: list[bytes] = []

    def driver() -> None:
        with collector.driving():
            got.append(generate_latest(reg))

    t = threading.Thread(target=driver, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive() and got and b"kvtier:pages_free" in got[0]


def test_a_driver_between_steps_for_long_serves_the_last_snapshot() -> None:
    """The driving thread stalls (no step()) after one snapshot: a scrape serves that
    snapshot after ``snapshot_wait_s``, without reading the cache on the server's thread."""
    cache = _cache()
    collector = KvtierCollector(cache, snapshot_wait_s=0.05)
    reg = _registry(collector)
    with collector.driving():
        t, got = _scrape_in_thread(reg)
        while t.is_alive():
            collector.step()
            t.join(0.01)
        reads = _ReadLog(cache)
        cache.admit("late", [("u", 0), ("u", 1)], prompt_tokens=40, chunk_tokens=40)  # not in the snapshot
        t, again = _scrape_in_thread(reg)
        t.join(GUARD_S)
    assert not t.is_alive() and reads.threads == [] and again == got


def test_every_scrape_of_a_running_replay_over_http_is_200_and_parses(tmp_path: Path) -> None:
    """A real HTTP client on the loopback scrapes in a loop, as fast as it can, while
    ``kvtier replay`` runs its three configurations and then holds the final values."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "replay", "--limit", "40", "--backend", "none",
                             "--metrics-port", "0", "--metrics-hold", "600"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    try:
        first = proc.stdout.readline()
        m = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", first)
        assert m, first
        reader.start()
        scrapes, seen, after_end = 0, [], 0
        while after_end < 3:
            ended = any(line.startswith("| prompt tokens") for line in lines)  # the table: the run ended
            with urllib.request.urlopen(m.group(1), timeout=GUARD_S) as resp:
                assert resp.status == 200
                body = resp.read().decode()
            got = _samples(body)  # parses
            scrapes += 1
            assert ("kvtier:aborts_total", (("reason", "other"),)) in got
            prompt = got[("kvtier:prompt_tokens_total", ())]
            if not seen or seen[-1] != prompt:
                seen.append(prompt)
            after_end += ended
            assert proc.poll() is None, "the replay exited during its hold"
            assert scrapes < 100_000
        assert len(seen) >= 3, seen  # the values moved while the replay ran
    finally:
        proc.kill()
        proc.wait(timeout=GUARD_S)


# ---------------------------------------------------------------------------- label values
def _aborted(reasons: list[str]) -> TieredCache:
    cache = _cache()
    for i, reason in enumerate(reasons):
        assert cache.admit(f"r{i}", [("u", i)], prompt_tokens=20, chunk_tokens=20) is not None
        cache.step_done(f"r{i}", 20)
        cache.abort(f"r{i}", reason)
        cache.poll()
    return cache


def _expected_label(reason: str) -> str:
    return reason.encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_LABEL_CHARS]


HOSTILE_REASONS = ["\udcff", "lone \ud800 high", "a\nb", 'quote"s', "back\\slash", "tab\there", "\x00nul",
                   "x" * 10_000, "emoji 🙂", "  ", "{}=,", "other"]


@pytest.mark.parametrize("reason", HOSTILE_REASONS, ids=lambda r: ascii(r)[:24])
def test_every_abort_reason_is_served_on_every_later_scrape(reason: str) -> None:
    cache = _aborted([reason])
    server = serve(KvtierCollector(cache), 0)
    try:
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=GUARD_S) as resp:
                assert resp.status == 200
                got = _samples(resp.read().decode())
            aborts = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "kvtier:aborts_total"}
            assert aborts[_expected_label(reason)] == 1 and sum(aborts.values()) == 1
            assert len(aborts) == len(KNOWN_ABORT_REASONS) + 1 + (reason != "other")
    finally:
        server.close()
    with pytest.raises(OSError):  # closed: nothing listens on the port any more
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=GUARD_S)


def test_reasons_that_coincide_once_encodable_add_up() -> None:
    cache = _aborted(["\udcff", "\\udcff", "y" * 200, "y" * 300])
    got = _samples(generate_latest(_registry(KvtierCollector(cache))).decode())
    assert got[("kvtier:aborts_total", (("reason", "\\udcff"),))] == 2
    assert got[("kvtier:aborts_total", (("reason", "y" * MAX_LABEL_CHARS),))] == 2


@pytest.mark.parametrize("distinct", [MAX_ABORT_REASONS - 1, MAX_ABORT_REASONS, MAX_ABORT_REASONS + 1, 500])
def test_the_reason_label_set_is_bounded(distinct: int) -> None:
    reasons = [f"engine reason {i}" for i in range(distinct)]
    cache = _aborted(reasons + list(KNOWN_ABORT_REASONS) + reasons[:3])
    collector = KvtierCollector(cache)
    got = _samples(generate_latest(_registry(collector)).decode())
    aborts = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "kvtier:aborts_total"}
    kept = reasons[:MAX_ABORT_REASONS]  # the first ones to occur
    assert set(aborts) == set(KNOWN_ABORT_REASONS) | set(kept) | {"other"}
    assert all(aborts[r] == 1 for r in KNOWN_ABORT_REASONS)
    assert all(aborts[r] == (2 if r in reasons[:3] else 1) for r in kept)
    assert aborts["other"] == max(0, distinct - MAX_ABORT_REASONS) and sum(aborts.values()) == distinct + 4 + 3
    # later reasons never move a kept one into "other": the series stay and only grow
    more = _aborted(reasons + list(KNOWN_ABORT_REASONS) + reasons[:3] + ["late"] * 2)
    collector.cache = more
    again = {dict(k[1])["reason"]: v for k, v in _samples(generate_latest(_registry(collector)).decode()).items()
             if k[0] == "kvtier:aborts_total"}
    assert set(again) == set(aborts) | ({"late"} if distinct < MAX_ABORT_REASONS else set())
    assert all(again[r] >= n for r, n in aborts.items())


# ---------------------------------------------------------------------------- construction and assignment
class _NoStats:
    stats = 5


BAD_CACHES = [object(), "cache", 1, TieredCache, _cache().core, [1]]
BAD_ENGINES = [object(), "engine", 1, _NoStats()]
BAD_WAITS = [0, -1, math.nan, math.inf, -math.inf, "1", True, None, 10**400]


@pytest.mark.parametrize("cache", BAD_CACHES, ids=lambda v: type(v).__name__)
def test_a_cache_that_is_not_one_is_refused(cache: Any) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierCollector(cache)
    assert type(info.value) is ConfigError and repr(cache)[:30] in str(info.value) and "TieredCache" in str(info.value)
    good = _cache()
    collector = KvtierCollector(good)
    with pytest.raises(ConfigError, match="cache must be a kvtier.TieredCache"):
        collector.cache = cache
    assert collector.cache is good  # nothing changed
    assert b"kvtier:pages_free" in generate_latest(_registry(collector))


@pytest.mark.parametrize("engine", BAD_ENGINES, ids=lambda v: type(v).__name__)
def test_an_engine_without_stats_is_refused(engine: Any) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierCollector(_cache(), engine)
    assert type(info.value) is ConfigError and repr(engine)[:30] in str(info.value) and "stats()" in str(info.value)
    collector = KvtierCollector(_cache())
    with pytest.raises(ConfigError):
        collector.engine = engine
    assert collector.engine is None


class _Engine:
    def __init__(self, stats: Any) -> None:
        self._stats = stats

    def stats(self) -> Any:
        return self._stats


@pytest.mark.parametrize("stats", [None, [], {"cumulative": []}, {"cumulative": {"writeback": 5}},
                                   {"cumulative": {"loadback": {"bytes": "many"}}},
                                   {"cumulative": {"writeback": {"seconds": None}}}], ids=repr)
def test_an_engine_whose_stats_are_not_the_engine_s_is_a_clear_scrape_error(stats: Any) -> None:
    collector = KvtierCollector(_cache(), _Engine(stats))
    reg = _registry(collector)
    with pytest.raises(ConfigError, match="KvtierCollector: engine"):
        generate_latest(reg)
    # driven: the driving thread's step() does not raise; the scrape does
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            generate_latest(reg)
        except ConfigError as exc:
            errors.append(exc)

    with collector.driving():
        t = threading.Thread(target=scrape, daemon=True)
        t.start()
        while t.is_alive():  # bounded by the scrape's own wait
            collector.step()
            t.join(0.01)
    assert len(errors) == 1 and "KvtierCollector: engine" in str(errors[0])


def test_a_good_engine_s_values_are_exported() -> None:
    eng = _Engine({"cumulative": {"writeback": {"bytes": 4096, "seconds": 0.5}, "loadback": {"bytes": 7}}})
    got = _samples(generate_latest(_registry(KvtierCollector(_cache(), eng))).decode())
    assert got[("kvtier:transfer_bytes_total", (("direction", "writeback"),))] == 4096
    assert got[("kvtier:transfer_seconds_total", (("direction", "writeback"),))] == 0.5
    assert got[("kvtier:transfer_bytes_total", (("direction", "loadback"),))] == 7


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, -0.5, 10**400, True], ids=repr)
@pytest.mark.parametrize("field", ["bytes", "seconds"])
def test_an_engine_counter_that_is_not_a_finite_number_at_least_0_is_a_clear_scrape_error(field: str,
                                                                                         value: Any) -> None:
    """The engine's bytes and seconds are exported as counters: NaN, an infinity or a
    negative count is no counter value (they were exported as NaN, +Inf, -5.0) and an int
    past a float's range raised OverflowError from prometheus_client's exposition: each is
    a ConfigError naming the field and the value."""
    eng = _Engine({"cumulative": {"writeback": {field: value}}})
    with pytest.raises(ConfigError) as info:
        generate_latest(_registry(KvtierCollector(_cache(), eng)))
    assert str(info.value) == (f"KvtierCollector: engine writeback {field} must be a finite number >= 0, "
                               f"got {value!r}")


def test_an_engine_s_numpy_counters_are_exported_as_plain_numbers() -> None:
    """A transfer engine that sums with numpy (np.int64 bytes, np.float64 seconds) is read as
    plain numbers (np.int64 was refused: not an int), as everywhere an int is taken."""
    eng = _Engine({"cumulative": {"writeback": {"bytes": np.int64(4096), "seconds": np.float32(0.5)},
                                  "loadback": {"bytes": np.uint32(7)}}})
    got = _samples(generate_latest(_registry(KvtierCollector(_cache(), eng))).decode())
    assert got[("kvtier:transfer_bytes_total", (("direction", "writeback"),))] == 4096
    assert got[("kvtier:transfer_seconds_total", (("direction", "writeback"),))] == 0.5
    assert got[("kvtier:transfer_bytes_total", (("direction", "loadback"),))] == 7


@pytest.mark.parametrize("wait", BAD_WAITS, ids=lambda v: repr(v)[:24])
def test_a_bad_snapshot_wait_is_refused(wait: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"snapshot_wait_s must be a finite number of seconds > 0, "
                                                    f"got {wait!r}")):
        KvtierCollector(_cache(), snapshot_wait_s=wait)


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(("option", "value"), [
    ("--metrics-hold", "inf"), ("--metrics-hold", "-inf"), ("--metrics-hold", "nan"), ("--metrics-hold", "-1"),
    ("--metrics-hold", "86401"), ("--metrics-hold", "1e309"), ("--metrics-hold", "soon"), ("--metrics-hold", ""),
    ("--metrics-port", "-1"), ("--metrics-port", "65536"), ("--metrics-port", "80.5"), ("--metrics-port", "x"),
])
def test_metrics_options_out_of_range_are_argparse_errors_naming_the_value(
        option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "--metrics-port=0", f"{option}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {value!r}" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "0.5", "86400"])
def test_metrics_hold_in_range_is_accepted(value: str) -> None:
    args = build_parser().parse_args(["replay", "--metrics-port", "0", "--metrics-hold", value])
    assert args.metrics_hold == float(value)


def test_a_completion_scrape_after_a_run_reads_the_final_values() -> None:
    """Outside driving(), a scrape reads the cache itself (after a run: nothing changes it)."""
    cache = _cache()
    cache.admit("a", [("u", 0), ("u", 1)], prompt_tokens=40, chunk_tokens=40)
    cache.step_done("a", 40)
    cache.finish("a")
    for cmd in cache.poll().commands:
        cache.complete(Completion(cmd.op_id))
    got = _samples(generate_latest(_registry(KvtierCollector(cache))).decode())
    assert got[("kvtier:prompt_tokens_total", ())] == 40
    assert got[("kvtier:requests_admitted_total", ())] == 1
