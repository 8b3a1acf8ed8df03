"""Generated hostile inputs for the trace reader: every case asserts the exact error class
and the message fragment naming the file, line and field.

Families, not single cases: every trace field x every bad value kind (plain and gzip), every
whole-line defect, every size limit and decompression bomb, and the reader's arguments.
"""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.fsm import ConfigError
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
