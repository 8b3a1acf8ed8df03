"""Generated hostile inputs for the trace reader, the reference scheduler and the ``kvtier``
command line (issue 13): every case asserts the exact error class and the message fragment
naming the file, line and field; scheduler cases also assert that nothing ran and that the
cache behaves afterwards exactly like a fresh one.

Families, not single cases: every trace field x every bad value kind (plain and gzip), every
whole-line defect, every size limit, every ``SchedRequest`` field x bad value (at construction
and after reassignment), every capacity spelling, every preset x small layer count, and every
exit status.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvtier import cli, replay_cli
from kvtier.cli.exitcodes import ExitCode
from kvtier.fsm import ConfigError, Direction, IllegalTransition, InvariantViolation
from kvtier.fsm.presets import preset
from kvtier.scheduler import InstantExecutor, ReferenceScheduler, RunStats, SchedRequest, SchedulerStalled
from kvtier.tiered import TieredCache
from kvtier.replay.trace import (
    MAX_DECOMPRESSED_BYTES,
    MAX_GZIP_RATIO,
    MAX_INPUT_LENGTH,
    MAX_JSON_DEPTH,
    MAX_LINE_BYTES,
    MAX_OUTPUT_LENGTH,
    MAX_TIMESTAMP_MS,
    TraceFormatError,
    load_trace,
)

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'
HUGE = "9" * 5000  # a 5,000-digit integer: more than Python's int/str conversion limit
FIELDS = {"timestamp": "0", "input_length": "600", "output_length": "5", "hash_ids": "[0, 1]"}


def _line(**raw: str) -> str:
    """A trace line with some fields replaced by raw JSON text (``None``-like removal: '')."""
    fields = {**FIELDS, **raw}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items() if v != "") + "}"


def _write(tmp_path: Path, text: str | bytes, packed: bool, name: str = "t.jsonl") -> Path:
    data = text.encode() if isinstance(text, str) else text
    path = tmp_path / (name + (".gz" if packed else ""))
    path.write_bytes(gzip.compress(data) if packed else data)
    return path


def _fails(path: Path, line: int | None, field: str | None, *fragments: str) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert type(err) is TraceFormatError and isinstance(err, ConfigError)
    assert (err.source, err.line, err.field) == (str(path), line, field)
    message = str(err)
    assert message.startswith(str(path) + ("" if line is None else f", line {line}"))
    if field is not None:
        assert f"field {field!r}" in message
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in message
    return err


# --- trace: every field x every bad value kind, plain and gzip ---------------------------

_NUMBER = "expected a number of milliseconds"
_INT = "expected an integer"
_TS_MAX = "must be <= 1e+13 ms (MAX_TIMESTAMP_MS)"
_ID = "expected an integer in 0 .. 2**64 - 1 (MAX_HASH_ID)"
FIELD_CASES: list[tuple[str, str, str, str]] = [  # (field, raw JSON value, field named, fragment)
    *[("timestamp", v, "timestamp", _NUMBER) for v in ('"5"', "true", "null", "[1]", "{}")],
    *[("timestamp", v, "timestamp", "must be finite and >= 0 ms") for v in ("NaN", "Infinity", "-Infinity", "1e400",
                                                                            "-1", "-0.5")],
    *[("timestamp", v, "timestamp", _TS_MAX) for v in ("1e308", str(MAX_TIMESTAMP_MS + 1), "1e14")],
    ("timestamp", HUGE, "timestamp", "got a 5,000-digit integer"),
    ("timestamp", "-" + HUGE, "timestamp", "got a 5,000-digit integer"),
    *[("input_length", v, "input_length", _INT) for v in ('"600"', "true", "null", "600.0", "6e2", "NaN",
                                                          "Infinity", "[600]", "{}")],
    *[("input_length", v, "input_length", "must be >= 1") for v in ("0", "-1", "-600")],
    ("input_length", str(MAX_INPUT_LENGTH + 1), "input_length", "must be <= 1,048,576 (MAX_INPUT_LENGTH)"),
    ("input_length", "9" * 30, "input_length", "(MAX_INPUT_LENGTH)"),
    ("input_length", HUGE, "input_length", "got a 5,000-digit integer"),
    *[("output_length", v, "output_length", _INT) for v in ('"5"', "false", "null", "1.5", "5.0", "NaN",
                                                            "-Infinity", "[5]", "{}")],
    *[("output_length", v, "output_length", "must be >= 0") for v in ("-1", "-3000000")],
    *[("output_length", v, "output_length", "must be <= 131,072 (MAX_OUTPUT_LENGTH)")
      for v in (str(MAX_OUTPUT_LENGTH + 1), "3000000")],
    ("output_length", HUGE, "output_length", "got a 5,000-digit integer"),
    *[("hash_ids", v, "hash_ids", "expected a list of integers") for v in ('"0,1"', "null", "{}", "5", "true")],
    *[("hash_ids", v, "hash_ids", "needs ceil(600/512) = 2") for v in ("[]", "[0]", "[0, 1, 2]")],
    *[("hash_ids", f"[0, {v}]", "hash_ids[1]", _ID) for v in ('"1"', "true", "null", "1.0", "-1", str(2**64),
                                                             "NaN", "[1]", "{}")],
    ("hash_ids", f"[0, {HUGE}]", "hash_ids[1]", "got a 5,000-digit integer"),
    *[(f, "", f, "missing") for f in FIELDS],
]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize(("field", "value", "named", "fragment"), FIELD_CASES,
                         ids=[f"{c[0]}={c[1][:12]}" for c in FIELD_CASES])
def test_bad_field_names_file_line_and_field(tmp_path: Path, packed: bool, field: str, value: str,
                                             named: str, fragment: str) -> None:
    path = _write(tmp_path, f"{GOOD}\n\n{_line(**{field: value})}\n{GOOD}\n", packed)
    _fails(path, 3, named, fragment)


# --- trace: whole-line defects ---------------------------------------------------------

LINE_CASES: list[tuple[str, bytes, str]] = [  # (id, line, fragment)
    ("array", b"[1, 2]", "expected a JSON object, got list"),
    ("string", b'"x"', "expected a JSON object, got str"),
    ("number", b"5", "expected a JSON object, got int"),
    ("null", b"null", "expected a JSON object, got NoneType"),
    ("bool", b"true", "expected a JSON object, got bool"),
    ("huge int line", HUGE.encode(), "expected a JSON object, got an integer"),
    ("open brace", b"{", "invalid JSON"),
    ("missing value", b'{"timestamp": }', "invalid JSON"),
    ("garbage", b"garbage", "invalid JSON"),
    ("not utf-8", b'{"timestamp": "\xff\xfe"}', "invalid JSON"),
    ("deep arrays", b"[" * 200_000 + b"]" * 200_000, f"nested deeper than MAX_JSON_DEPTH = {MAX_JSON_DEPTH}"),
    ("deep objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper than MAX_JSON_DEPTH"),
    ("deep unclosed", b"[" * 200_000, "nested deeper than MAX_JSON_DEPTH"),
    ("deep in ignored key", _line(x="[" * 1000 + "]" * 1000).encode(), "nested deeper than MAX_JSON_DEPTH"),
    ("one too deep", _line(x="[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH).encode(), "nested deeper than"),
]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize(("line", "fragment"), [c[1:] for c in LINE_CASES], ids=[c[0] for c in LINE_CASES])
def test_bad_line_names_file_and_line(tmp_path: Path, packed: bool, line: bytes, fragment: str) -> None:
    path = _write(tmp_path, GOOD.encode() + b"\n" + line + b"\n", packed)
    err = _fails(path, 2, None, fragment)
    assert "not gzip" not in str(err)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
def test_limits_are_inclusive(tmp_path: Path, packed: bool) -> None:
    """Values exactly at each limit are accepted (the limits are not off by one)."""
    at_depth = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)  # the line's object is one level
    big = _line(timestamp=str(MAX_TIMESTAMP_MS), input_length=str(MAX_INPUT_LENGTH),
                output_length=str(MAX_OUTPUT_LENGTH), hash_ids=json.dumps([2**64 - 1] * 2048), x=at_depth)
    wide = big[:-1] + " " * (MAX_LINE_BYTES - len(big)) + "}"
    assert len(wide) == MAX_LINE_BYTES
    trace = load_trace(_write(tmp_path, wide + "\n", packed))
    (req,) = trace.requests
    assert (req.arrival_s, req.input_length, req.output_length) == (MAX_TIMESTAMP_MS / 1000, MAX_INPUT_LENGTH,
                                                                    MAX_OUTPUT_LENGTH)
    assert req.hash_ids == (2**64 - 1,) * 2048


# --- trace: size limits and bombs ------------------------------------------------------

def _peak_bytes(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        call()
    except TraceFormatError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("line_no", [1, 3])
def test_line_over_max_line_bytes(tmp_path: Path, packed: bool, line_no: int) -> None:
    body = "\n".join([GOOD] * (line_no - 1) + ["x" * (MAX_LINE_BYTES + 1), GOOD]) + "\n"
    _fails(_write(tmp_path, body, packed), line_no, None, "longer than MAX_LINE_BYTES = 1,048,576 bytes")


def test_dev_zero_fails_fast_in_bounded_memory() -> None:
    assert _peak_bytes(lambda: _fails(Path("/dev/zero"), 1, None, "longer than MAX_LINE_BYTES")) < 8 * MAX_LINE_BYTES


def test_one_gigabyte_file_without_newlines(tmp_path: Path) -> None:
    path = tmp_path / "zeros.jsonl"
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: no disk used
    assert _peak_bytes(lambda: _fails(path, 1, None, "longer than MAX_LINE_BYTES")) < 8 * MAX_LINE_BYTES


def _bomb(tmp_path: Path, unit: bytes, single: bool) -> Path:
    """A gzip file of at most 0.5 MB that decompresses to up to 512 MiB of ``unit`` repeated.

    ``single``: one gzip member, built without compressing 512 MiB: a 1 MiB block deflated
    once and ended by a full flush (which resets the compressor, so the same bytes encode
    every repetition), repeated, with the CRC and size of the whole. Else one 1 MiB member
    repeated (a multi-member gzip file)."""
    block = unit * (-(-(1 << 20) // len(unit)))
    path = tmp_path / "bomb.jsonl.gz"
    if single:
        deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
        piece = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
        count = min(512, (500 << 10) // len(piece))
        crc = 0
        for _ in range(count):
            crc = zlib.crc32(block, crc)
        size = (count * len(block)) & 0xFFFFFFFF
        path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + piece * count + deflate.flush()
                         + struct.pack("<II", crc, size))
        assert gzip.decompress(path.read_bytes())[:len(block)] == block if count * len(block) < 64 << 20 else True
    else:
        member = gzip.compress(block, compresslevel=9)
        path.write_bytes(member * min(512, (500 << 10) // len(member)))
    return path


@pytest.mark.parametrize(("unit", "single", "line", "fragment"), [
    (b"\0", True, 1, "longer than MAX_LINE_BYTES = 1,048,576 bytes after gzip decompression"),
    (b"\0", False, 1, "longer than MAX_LINE_BYTES = 1,048,576 bytes after gzip decompression"),
    (b"\n", True, None, f"more than MAX_GZIP_RATIO = {MAX_GZIP_RATIO} times its size (a gzip bomb?)"),
    (b"   \n", True, None, f"more than MAX_GZIP_RATIO = {MAX_GZIP_RATIO} times its size (a gzip bomb?)"),
    ((GOOD + "\n").encode(), True, None, f"more than MAX_GZIP_RATIO = {MAX_GZIP_RATIO} times its size"),
    ((GOOD + "\n").encode(), False, None, f"more than MAX_GZIP_RATIO = {MAX_GZIP_RATIO} times its size"),
], ids=["zeros", "zeros multi-member", "newlines", "blank lines", "valid lines", "valid lines multi-member"])
def test_gzip_bomb_fails_fast_in_bounded_memory(tmp_path: Path, unit: bytes, single: bool, line: int | None,
                                                fragment: str) -> None:
    path = _bomb(tmp_path, unit, single)
    assert path.stat().st_size <= 512 << 10  # a 0.5 MB bomb
    # In a fresh process: the growth of its peak resident memory while reading (tracemalloc
    # would slow the per-line work tenfold).
    code = ("import json, resource, sys\nfrom kvtier.replay.trace import TraceFormatError, load_trace\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n    load_trace(sys.argv[1])\nexcept TraceFormatError as e:\n"
            "    err = e\n"
            "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
            "print(json.dumps([type(err).__name__, err.source, err.line, err.field, str(err), grown]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kind, source, err_line, field, message, grown_kib = json.loads(out.stdout)
    assert (kind, source, field) == ("TraceFormatError", str(path), None)
    assert fragment in message and "not gzip" not in message
    assert line is None or err_line == line
    assert err_line is not None and message.startswith(f"{path}, line {err_line}: ")
    assert grown_kib < 64 << 10  # KiB: the valid-lines bomb keeps about 4 MiB of requests; never 512 MiB


def test_max_decompressed_bytes(tmp_path: Path) -> None:
    path = _write(tmp_path, "".join(_line(timestamp=str(t)) + "\n" for t in range(200)), packed=True)
    assert len(load_trace(path)) == 200
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, max_decompressed_bytes=8000)
    err = info.value
    assert (err.source, err.line, err.field) == (str(path), 1, None)
    assert "line 1: the gzip stream decompresses to more than 8,000 bytes" in str(err)
    assert MAX_DECOMPRESSED_BYTES == 1 << 30


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10", None])
def test_bad_reader_arguments(tmp_path: Path, bad: object) -> None:
    path = _write(tmp_path, GOOD + "\n", packed=False)
    with pytest.raises(ConfigError, match="max_decompressed_bytes must be an int >= 1"):
        load_trace(path, max_decompressed_bytes=bad)  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(ConfigError, match="limit must be an int >= 1"):
            load_trace(path, limit=bad)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_as_limits(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    path = _write(tmp_path, "".join(_line(timestamp=str(t)) + "\n" for t in range(5)), packed=False)
    assert len(load_trace(path, limit=np.int64(3), max_decompressed_bytes=np.int32(10**6))) == 3


def test_not_gzip_hint_only_for_plain_content(tmp_path: Path) -> None:
    _fails(_write(tmp_path, b"garbage\n", packed=False, name="t.jsonl.gz"), 1, None,
           "the name ends in .gz but the content is not gzip")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("blank", ["\n", "  \n", "\r\n"], ids=["lf", "spaces", "crlf"])
def test_line_numbers_stay_exact_after_long_blank_runs(tmp_path: Path, packed: bool, blank: str) -> None:
    body = GOOD + "\n" + blank * 200_000 + _line(output_length="-1") + "\n"
    _fails(_write(tmp_path, body, packed), 200_002, "output_length", "must be >= 0")


# --- reference scheduler: every SchedRequest field x bad value ---------------------------

LAYOUT = preset("llama-3-8b", page_tokens=16)
_ARRIVAL = "arrival_s must be a finite number of seconds in 0 .. 1e+10"
_PROMPT = "prompt_tokens must be an int in 1..1048576"
_OUTPUT = "output_tokens must be an int in 0..131072"
SCHED_CASES: list[tuple[str, object, str]] = [
    *[("request_id", v, "request_id must be a non-empty str") for v in ("", None, 5, b"r1")],
    *[("arrival_s", v, _ARRIVAL) for v in (float("nan"), float("inf"), float("-inf"), -1.0, -1e-9, 1e308, 2e10,
                                            "0", None, True, 1j, [0.0])],
    *[("prompt_tokens", v, _PROMPT) for v in (0, -1, 1.5, 40.0, True, "40", None, MAX_INPUT_LENGTH + 1, 2**100,
                                               float("nan"))],
    *[("output_tokens", v, _OUTPUT) for v in (-1, 1.5, False, "3", None, MAX_OUTPUT_LENGTH + 1, 3_000_000)],
    *[("units", v, "units must be a tuple of unit keys") for v in ("ab", None, 5, {"a": 1}, {"a"})],
]


def _request(rid: str = "r1", **change: Any) -> SchedRequest:
    fields: dict[str, Any] = dict(request_id=rid, arrival_s=0.0, prompt_tokens=40, output_tokens=3,
                                  units=(("p", 0), ("p", 1)))
    fields.update(change)
    return SchedRequest(**fields)


def _workload() -> list[SchedRequest]:
    return [_request("r0"), _request("r1", arrival_s=0.01, units=(("p", 0), ("q", 1))),
            _request("r2", arrival_s=0.02, prompt_tokens=70, units=tuple(("s", i) for i in range(4)))]


def _outcome(stats: RunStats) -> dict[str, object]:
    out = dict(vars(stats))
    for timing in ("kvtier_s", "kvtier_decode_s"):
        out.pop(timing)
    return out


def _assert_unchanged(cache: TieredCache, sched: ReferenceScheduler) -> None:
    """Nothing ran: the scheduler counted nothing, and the cache then serves a workload exactly
    as a fresh cache does."""
    assert sched.stats == RunStats()
    assert not cache.in_flight()
    after = ReferenceScheduler(cache).run(_workload())
    fresh = ReferenceScheduler(TieredCache(LAYOUT, 16, 16)).run(_workload())
    assert after.finished == 3 and _outcome(after) == _outcome(fresh)


@pytest.mark.parametrize(("field", "value", "fragment"), SCHED_CASES,
                         ids=[f"{c[0]}={c[1]!r}"[:40] for c in SCHED_CASES])
def test_sched_request_rejects_bad_field(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _request(**{field: value})
    assert type(info.value) is ConfigError and fragment in str(info.value)
    assert f"got {value!r}" in str(info.value) or field == "units"


@pytest.mark.parametrize(("field", "value", "fragment"), SCHED_CASES,
                         ids=[f"{c[0]}={c[1]!r}"[:40] for c in SCHED_CASES])
def test_run_rechecks_reassigned_fields_before_anything_runs(field: str, value: object, fragment: str) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    good, bad = _request("r0"), _request("r1")
    setattr(bad, field, value)
    with pytest.raises(ConfigError) as info:
        sched.run([good, bad])
    assert type(info.value) is ConfigError and fragment in str(info.value)
    assert good.tokens == 0 and not good.done
    _assert_unchanged(cache, sched)


def _used(r: SchedRequest) -> SchedRequest:
    r.tokens = 5
    return r


RUN_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("str", lambda: "r0", "requests must be a sequence of SchedRequest, got str"),
    ("None", lambda: None, "requests must be a sequence of SchedRequest, got NoneType"),
    ("int", lambda: 5, "requests must be a sequence of SchedRequest, got int"),
    ("generator", lambda: (r for r in _workload()), "requests must be a sequence of SchedRequest, got generator"),
    ("dict item", lambda: [_request("r0"), {"request_id": "r1"}], "requests[1] must be a SchedRequest, got dict"),
    ("None item", lambda: [None], "requests[0] must be a SchedRequest, got NoneType"),
    ("duplicate id", lambda: [_request("r0"), _request("r1"), _request("r0")], "request id 'r0' appears twice"),
    ("run before", lambda: [_request("r0"), _used(_request("r1"))], "requests[1] ('r1') was run before"),
]


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_run_rejects_bad_request_lists(make: Callable[[], Any], fragment: str) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    with pytest.raises(ConfigError) as info:
        sched.run(make())
    assert type(info.value) is ConfigError and fragment in str(info.value)
    _assert_unchanged(cache, sched)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_run_rejects_bad_max_steps(bad: object) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    with pytest.raises(ConfigError, match="max_steps must be an int in 0[.][.]"):
        sched.run(_workload(), max_steps=bad)  # type: ignore[arg-type]
    _assert_unchanged(cache, sched)


@pytest.mark.parametrize("option", ["token_budget", "max_idle_steps"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None])
def test_scheduler_options_are_checked(option: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be an int in 1[.][.]"):
        ReferenceScheduler(TieredCache(LAYOUT, 16, 16), **{option: bad})


def test_numpy_values_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    r = _request("r0", arrival_s=np.float64(0.5), prompt_tokens=np.int64(40), output_tokens=np.int32(3),
                 units=[("p", 0), ("p", 1)])
    assert (type(r.arrival_s), type(r.prompt_tokens), type(r.output_tokens), r.units) == (
        float, int, int, (("p", 0), ("p", 1)))
    stats = ReferenceScheduler(TieredCache(LAYOUT, 16, 16), token_budget=np.int64(64)).run([r])
    assert stats.finished == 1


class _LosesLoadbacks(InstantExecutor):
    """Completes writebacks, never loadbacks (a lost completion, and no deadline)."""

    def submit(self, commands: Any) -> None:
        self._pending.extend(c for c in commands if c.direction is not Direction.LOADBACK)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])  # selective: no loadback in this workload
def test_lost_completion_raises_scheduler_stalled_instead_of_spinning(policy: str) -> None:
    cache = TieredCache(LAYOUT, 8, 64, policy=policy, op_deadline_steps=None)  # no deadline: waits forever
    sched = ReferenceScheduler(cache, _LosesLoadbacks(), max_idle_steps=500)
    a, b = tuple(("a", j) for j in range(4)), tuple(("b", j) for j in range(4))
    reqs = [_request("r0", prompt_tokens=70, units=a), _request("r1", arrival_s=1.0, prompt_tokens=70, units=b),
            _request("r2", arrival_s=2.0, prompt_tokens=70, units=a)]
    with pytest.raises(SchedulerStalled) as info:
        sched.run(reqs)
    err = info.value
    assert err.live == ("r2",) and cache.state("r2") == "loading"
    assert 500 < err.steps < 2000
    assert "no forward pass, arrival or ended request for 500 iterations (max_idle_steps)" in str(err)
    assert "1 request(s) not ended (r2)" in str(err)


# --- command line: capacities, layers, backends, small traces, exit statuses -------------

CAPACITY_BAD: list[tuple[str, str]] = [
    *[(t, "a bare number is a fraction of the working set, at most 1") for t in ("2", "1.5", "100", "1e3",
                                                                                 "300000", "1.0001")],
    *[(t, "must be a finite number > 0") for t in ("0", "-1", "-0.5", "nan", "inf", "-inf", "0%", "-5%", "nan%",
                                                  "inf%")],
    ("150%", "a percentage must be at most 100%"),
    ("100.5%", "a percentage must be at most 100%"),
    *[(t, "a token count must be >= 1") for t in ("0t", "-3t")],
    *[(t, "expected a fraction of the working set (0.05 or 5%) or a token count (300000t)")
      for t in ("1.5t", "t", "%", "", "lots", "0x10t", "1e5t", "5%t", "5t%", "5tt")],
]
CAPACITY_GOOD: list[tuple[str, tuple[str, float]]] = [
    ("1", ("fraction", 1.0)), ("0.05", ("fraction", 0.05)), ("5%", ("fraction", 0.05)),
    ("100%", ("fraction", 1.0)), (" 5% ", ("fraction", 0.05)), ("300000t", ("tokens", 300000)),
    ("300_000t", ("tokens", 300000)), ("256T", ("tokens", 256)), ("1e-3", ("fraction", 0.001)),
    ("5 t", ("tokens", 5)),
]


@pytest.mark.parametrize(("text", "fragment"), CAPACITY_BAD, ids=[repr(c[0]) for c in CAPACITY_BAD])
def test_capacity_spellings_rejected(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        replay_cli._capacity(text)
    assert str(info.value).startswith(f"capacity {text!r}") and fragment in str(info.value)


@pytest.mark.parametrize(("text", "parsed"), CAPACITY_GOOD, ids=[repr(c[0]) for c in CAPACITY_GOOD])
def test_capacity_spellings_accepted(text: str, parsed: tuple[str, float]) -> None:
    assert tuple(replay_cli._capacity(text)) == parsed


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("option", ["--device", "--host"])
@pytest.mark.parametrize("text", ["2", "300000", "0t"])
def test_cli_capacity_errors_exit_2(option: str, text: str) -> None:
    code, _, err = _main("replay", "--backend", "none", "--limit", "2", option, text)
    assert code == ExitCode.USAGE == 2
    assert f"argument {option}: capacity {text!r}" in err and "Traceback" not in err


def _replay_json(*argv: str) -> tuple[dict[str, Any], str]:
    code, out, err = _main("replay", "--backend", "none", "--json", *argv)
    assert code == ExitCode.OK, err
    return json.loads(out), err


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("name", ["deepseek-v4", "llama-3-8b", "deepseek-v3"])
def test_every_preset_runs_with_few_layers(name: str, layers: int) -> None:
    doc, _ = _replay_json("--limit", "2", "--preset", name, "--layers", str(layers))
    configs = doc["configurations"]
    assert [c["requests"] for c in configs] == [2, 2, 2]
    assert configs[-1]["finished"] == 2 and configs[-1]["aborts"] == 0


TINY_TRACES: list[tuple[str, list[str]]] = [
    ("one token", [_line(input_length="1", hash_ids="[7]")]),
    ("one block", [_line(input_length="512", hash_ids="[7]")]),
    ("no output", [_line(output_length="0")]),
    ("two requests", [GOOD, _line(timestamp="5", hash_ids="[0, 9]")]),
    ("long and short", [_line(input_length="1", hash_ids="[1]"),
                        _line(timestamp="1", input_length="20000", output_length="300",
                              hash_ids=json.dumps(list(range(40))))]),
]


@pytest.mark.parametrize("lines", [c[1] for c in TINY_TRACES], ids=[c[0] for c in TINY_TRACES])
def test_defaults_work_for_tiny_traces(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    doc, err = _replay_json(str(path))
    for config in doc["configurations"]:
        assert config["finished"] == len(lines) and config["aborts"] == 0
    longest = max(json.loads(line)["input_length"] + json.loads(line)["output_length"] for line in lines)
    assert doc["setup"]["device_tokens"] >= longest  # raised to the longest request
    assert "raised to" in err


@pytest.mark.parametrize("option", ["--device", "--host"])
def test_capacity_above_the_unbounded_configuration_is_lowered(option: str) -> None:
    doc, err = _replay_json("--limit", "3", option, f"{10**15}t")
    unbounded = doc["configurations"][-1]["device_tokens"]
    assert doc["setup"]["device_tokens" if option == "--device" else "host_tokens"] == unbounded < 10**15
    assert f"note: {option} lowered to {unbounded:,} tokens" in err


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_gpu_backend_without_cuda_names_the_cli_options(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _main("replay", "--limit", "2", "--backend", backend)
    assert code == ExitCode.USAGE
    assert f"--backend {backend} needs a CUDA GPU" in err
    assert "use --backend cpu (real copies in host memory) or --backend none (metadata only)" in err
    assert "device='cpu'" not in err and out == ""


def _raise(exc: BaseException) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return run


EXIT_CASES: list[tuple[str, BaseException, int, str]] = [
    ("fingerprint mismatch", __import__("kvtier.replay.fingerprint", fromlist=["x"]).FingerprintMismatch(
        "r1", "g", "kv", 0, 3, "differs"), 1, "FingerprintMismatch: request 'r1'"),
    ("stalled", SchedulerStalled("no progress", 10, ["r1"]), 1, "SchedulerStalled: no progress"),
    ("invariant", InvariantViolation("pages_conserved", "pool", "leak"), 1, "InvariantViolation: invariant"),
    ("trace format", TraceFormatError("t.jsonl", 4, "hash_ids", "bad"), 2, "t.jsonl, line 4, field 'hash_ids': bad"),
    ("config", ConfigError("bad value"), 2, "kvtier replay: bad value"),
    ("os", FileNotFoundError(2, "No such file or directory", "x.jsonl"), 2, "No such file or directory"),
    ("value", ValueError("bad"), 2, "kvtier replay: bad"),
    ("illegal transition", IllegalTransition("request", "request 'r1'", "loading", "retract"), 4, "internal error"),
    ("runtime", RuntimeError("boom"), 4, "internal error (exit status 4); this is a kvtier bug"),
    ("key", KeyError("k"), 4, "internal error"),
    ("interrupt", KeyboardInterrupt(), 130, "kvtier replay: interrupted"),
]


@pytest.mark.parametrize(("exc", "code", "fragment"), [c[1:] for c in EXIT_CASES], ids=[c[0] for c in EXIT_CASES])
def test_exit_status_of_each_error_class(monkeypatch: pytest.MonkeyPatch, exc: BaseException, code: int,
                                         fragment: str) -> None:
    monkeypatch.setattr("kvtier.replay.run_replay", _raise(exc))
    got, _, err = _main("replay", "--limit", "2", "--backend", "none")
    assert got == code and fragment in err
    assert ("Traceback" in err) == (code == ExitCode.INTERNAL)


@pytest.mark.parametrize("trace", ["/nonexistent/t.jsonl", "/", "/dev/zero"])
def test_unreadable_trace_files_exit_2(trace: str) -> None:
    code, _, err = _main("replay", trace, "--backend", "none")
    assert code == ExitCode.USAGE and err.startswith("kvtier replay: ") and "Traceback" not in err


@pytest.mark.parametrize("command", [[], ["replay"], ["fuzz"], ["verify"], ["diagram"]])
def test_help_lists_every_exit_status(command: list[str]) -> None:
    code, out, _ = _main(*command, "--help")
    assert code == 0
    tail = out[out.index("exit status:"):]
    for status in ExitCode:
        assert f"\n  {int(status):<3}  " in tail
