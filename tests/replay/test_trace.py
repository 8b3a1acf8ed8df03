"""Tests for kvtier.replay.trace: the Mooncake trace reader and the embedded default slice."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvtier.data import default_trace_path
from kvtier.fsm import ConfigError
from kvtier.replay.trace import Trace, TraceFormatError, TraceRequest, load_trace

SLICE_SHA256 = "d289afab1294d376c92b3496d96c27f8f0e36893398fbda7957f3a40e37b70ba"


def _row(ts: Any = 0, n: Any = 600, out: Any = 5, ids: Any = None) -> dict[str, Any]:
    if ids is None:
        ids = list(range(math.ceil(n / 512)))
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl", newline: bool = True) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + ("\n" if newline else ""))
    return path


# --- the embedded default -------------------------------------------------------------


def test_embedded_default_matches_provenance() -> None:
    with default_trace_path().open("rb") as f:
        raw = gzip.decompress(f.read())
    assert hashlib.sha256(raw).hexdigest() == SLICE_SHA256
    trace = load_trace()
    assert len(trace) == 1000 and trace.block_tokens == 512
    assert "embedded default" in trace.source
    assert [r.index for r in trace.requests] == list(range(1000))
    # Stated in kvtier/data/README.md.
    assert trace.prompt_tokens() == 13_732_944
    assert trace.requests[0].arrival_s == 0.0 and trace.requests[-1].arrival_s == 330.0
    assert trace.unbounded_working_set_blocks() == 21_514
    assert round(100 * trace.ideal_hit_rate(), 1) == 21.6


def test_embedded_default_parses_to_its_raw_rows() -> None:
    """The embedded slice (the first 1,000 rows of the public Mooncake conversation trace:
    src/kvtier/data/README.md), read row by row as plain JSON, agrees with what load_trace
    makes of it."""
    with default_trace_path().open("rb") as f:
        head = gzip.decompress(f.read()).splitlines(keepends=True)
    assert len(head) == 1000 and hashlib.sha256(b"".join(head)).hexdigest() == SLICE_SHA256
    rows = [json.loads(line) for line in head]
    trace = load_trace()
    assert trace.prompt_tokens() == sum(r["input_length"] for r in rows)
    assert trace.requests[0].arrival_s == rows[0]["timestamp"] / 1000
    assert trace.requests[-1].arrival_s == rows[-1]["timestamp"] / 1000
    assert sum(r.output_length for r in trace.requests) == sum(r["output_length"] for r in rows)
    assert trace.unbounded_working_set_blocks() == len({i for r in rows for i in r["hash_ids"]})
    for req, row in zip(trace.requests, rows):
        assert req.hash_ids == tuple(row["hash_ids"])


def test_gz_and_plain_agree(tmp_path: Path) -> None:
    with default_trace_path().open("rb") as f:
        raw = gzip.decompress(f.read())
    plain = tmp_path / "slice.jsonl"
    plain.write_bytes(raw)
    gz = tmp_path / "slice.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    a, b, c = load_trace(plain), load_trace(gz), load_trace()
    assert a.requests == b.requests == c.requests
    assert a.source == str(plain)


def test_limit(tmp_path: Path) -> None:
    trace = load_trace(limit=10)
    assert len(trace) == 10 and trace.requests == load_trace().requests[:10]
    # Lines after the limit are not read, so a bad line there does not matter.
    path = _write(tmp_path, [json.dumps(_row(0)), json.dumps(_row(1)), "garbage"])
    assert len(load_trace(path, limit=2)) == 2
    with pytest.raises(TraceFormatError, match="line 3"):
        load_trace(path, limit=3)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="limit"):
            load_trace(path, limit=bad)  # type: ignore[arg-type]


def test_blank_lines_skipped_and_extra_keys_ignored(tmp_path: Path) -> None:
    row = _row(1500, 1024, 7, [3, 9]) | {"extra": "x"}
    path = _write(tmp_path, ["", json.dumps(_row(0)), "   ", json.dumps(row), ""])
    trace = load_trace(path)
    assert trace.requests[1] == TraceRequest(index=1, arrival_s=1.5, input_length=1024,
                                             output_length=7, hash_ids=(3, 9))


# --- malformed lines ------------------------------------------------------------------

_BAD: list[tuple[str, str, str | None, str]] = [
    ("missing timestamp", json.dumps({k: v for k, v in _row(5).items() if k != "timestamp"}),
     "timestamp", "missing"),
    ("missing input_length", json.dumps({k: v for k, v in _row(5).items()
                                         if k != "input_length"}), "input_length", "missing"),
    ("missing output_length", json.dumps({k: v for k, v in _row(5).items()
                                          if k != "output_length"}), "output_length", "missing"),
    ("missing hash_ids", json.dumps({k: v for k, v in _row(5).items() if k != "hash_ids"}),
     "hash_ids", "missing"),
    ("str length", json.dumps(_row(5, n="600", ids=[0, 1])), "input_length", "integer"),
    ("float length", json.dumps(_row(5, n=600.0, ids=[0, 1])), "input_length", "integer"),
    ("bool length", json.dumps(_row(5, n=True, ids=[0])), "input_length", "integer"),
    ("bool output", json.dumps(_row(5, out=False)), "output_length", "integer"),
    ("null output", json.dumps(_row(5, out=None)), "output_length", "integer"),
    ("str timestamp", json.dumps(_row("5")), "timestamp", "number"),
    ("bool timestamp", json.dumps(_row(True)), "timestamp", "number"),
    ("nan timestamp", json.dumps(_row(float("nan"))), "timestamp", "finite"),
    ("negative timestamp", json.dumps(_row(-1)), "timestamp", ">= 0"),
    ("negative input", json.dumps(_row(5, n=-512, ids=[])), "input_length", ">= 1"),
    ("zero input", json.dumps(_row(5, n=0, ids=[])), "input_length", ">= 1"),
    ("negative output", json.dumps(_row(5, out=-3)), "output_length", ">= 0"),
    ("hash_ids not list", json.dumps(_row(5, ids="0,1")), "hash_ids", "list"),
    ("hash id str", json.dumps(_row(5, ids=[0, "1"])), "hash_ids[1]", "integer"),
    ("hash id bool", json.dumps(_row(5, ids=[True, 1])), "hash_ids[0]", "integer"),
    ("hash id negative", json.dumps(_row(5, ids=[0, -1])), "hash_ids[1]", "0 .. 2**64 - 1"),
    ("too few ids", json.dumps(_row(5, n=1025, ids=[0, 1])), "hash_ids", "ceil(1025/512) = 3"),
    ("too many ids", json.dumps(_row(5, n=512, ids=[0, 1])), "hash_ids", "has 2 ids"),
    ("backwards", json.dumps(_row(0.5)), "timestamp", "backwards"),
    ("array line", "[1, 2, 3]", None, "JSON object"),
    ("invalid JSON", '{"timestamp": 5, "input_length": }', None, "invalid JSON"),
]


@pytest.mark.parametrize(("line", "field", "words"), [b[1:] for b in _BAD],
                         ids=[b[0] for b in _BAD])
def test_malformed_line_names_line_and_field(tmp_path: Path, line: str, field: str | None,
                                             words: str) -> None:
    # Line 3 is bad (after a good line and a blank one); a good line follows it.
    path = _write(tmp_path, [json.dumps(_row(1)), "", line, json.dumps(_row(9))])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert (err.source, err.line, err.field) == (str(path), 3, field)
    message = str(err)
    assert str(path) in message and "line 3" in message and words in message
    if field is not None:
        assert repr(field) in message
    assert isinstance(err, ConfigError)


def test_backwards_names_previous_line(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(_row(100)), json.dumps(_row(200)), json.dumps(_row(150))])
    with pytest.raises(TraceFormatError, match=r"line 3, field 'timestamp': goes backwards: "
                                               r"150 ms is earlier than 200 ms on line 2"):
        load_trace(path)


def test_equal_timestamps_and_float_timestamps_ok(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(_row(0)), json.dumps(_row(0)), json.dumps(_row(2.5))])
    assert [r.arrival_s for r in load_trace(path).requests] == [0.0, 0.0, 0.0025]


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(_write(tmp_path, ["", ""]))


# --- truncation -----------------------------------------------------------------------


def test_truncated_last_line(tmp_path: Path) -> None:
    good = [json.dumps(_row(t)) for t in (0, 1, 2)]
    cut = json.dumps(_row(3, n=2000))[:-9]  # inside hash_ids, no trailing newline
    path = _write(tmp_path, [*good, "", cut], newline=False)
    with pytest.raises(TraceFormatError, match="looks truncated at line 5") as info:
        load_trace(path)
    assert info.value.line == 5
    with pytest.warns(UserWarning, match="looks truncated at line 5"):
        trace = load_trace(path, strict=False)
    assert len(trace) == 3
    # The same cut line followed by a newline is plainly invalid, not truncation.
    path = _write(tmp_path, [*good, cut], newline=True)
    with pytest.raises(TraceFormatError, match="line 4: invalid JSON"):
        load_trace(path, strict=False)
    # A complete last line without a trailing newline is fine.
    path = _write(tmp_path, good, newline=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_trace(path)) == 3


def test_truncated_gzip(tmp_path: Path) -> None:
    with default_trace_path().open("rb") as f:
        data = f.read()
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="looks truncated"):
        load_trace(path)
    with pytest.warns(UserWarning, match="looks truncated"):
        trace = load_trace(path, strict=False)
    assert 0 < len(trace) < 1000
    assert trace.requests == load_trace().requests[: len(trace)]
    # A gzip stream cut exactly at a line end is still reported.
    whole = gzip.compress(b"".join(json.dumps(_row(t)).encode() + b"\n" for t in range(3)))
    (tmp_path / "cut2.jsonl.gz").write_bytes(whole[:-8])  # drop the crc/size trailer
    with pytest.raises(TraceFormatError, match="gzip stream ends early"):
        load_trace(tmp_path / "cut2.jsonl.gz")


def test_invalid_gzip(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"\x1f\x8b" + b"\x00" * 40)
    with pytest.raises(TraceFormatError, match="invalid gzip"):
        load_trace(path)


# --- the ideal (unbounded cache) bound ------------------------------------------------


def test_ideal_hit_tokens_hand_computed() -> None:
    def req(i: int, n: int, ids: tuple[int, ...]) -> TraceRequest:
        return TraceRequest(index=i, arrival_s=float(i), input_length=n, output_length=1,
                            hash_ids=ids)

    trace = Trace((
        req(0, 1500, (0, 1, 2)),       # nothing seen: 0
        req(1, 1100, (0, 1, 5)),       # blocks 0, 1 seen: 1024
        req(2, 1200, (0, 1, 2)),       # all 3 seen, capped at the prompt: 1200
        req(3, 300, (0,)),             # one partial block seen: min(512, 300) = 300
        req(4, 2048, (0, 7, 1, 2)),    # 0 seen, 7 new; 1 and 2 after 7 are new prefixes: 512
        req(5, 600, (9, 1)),           # 1 was seen, but after 0, not after 9: 0
    ))
    assert trace.prompt_tokens() == 1500 + 1100 + 1200 + 300 + 2048 + 600
    assert trace.ideal_hit_tokens() == 0 + 1024 + 1200 + 300 + 512 + 0
    # Prefix blocks: 0,0/1,0/1/2,0/1/5,0/7,0/7/1,0/7/1/2,9,9/1.
    assert trace.unbounded_working_set_blocks() == 9
    assert trace.ideal_hit_rate() == pytest.approx(3036 / 6748)
    assert trace.duration_s() == 5.0
    assert Trace(()).ideal_hit_rate() == 0.0


def test_embedded_trace_figures() -> None:
    """The facts src/kvtier/data/README.md gives for the embedded slice: 1,000 requests over
    330 s, 13,732,944 prompt tokens in 21,514 distinct prefix blocks, 21.6 % of them prefix
    hits with an unbounded cache; every conversation starts from block 0."""
    trace = load_trace()
    assert len(trace) == 1000
    assert trace.duration_s() == 330.0
    assert round(100 * trace.ideal_hit_rate(), 1) == 21.6
    assert trace.ideal_hit_tokens() == 2_962_776 and trace.prompt_tokens() == 13_732_944
    assert trace.unbounded_working_set_blocks() == 21_514
    assert all(r.hash_ids[0] == 0 for r in trace.requests)


def test_garbage_is_invalid_json_not_a_truncated_file(tmp_path: Path) -> None:
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_bytes(b"garbage")  # named .gz, not gzip, no trailing newline
    with pytest.raises(TraceFormatError) as exc:
        load_trace(fake)
    assert str(exc.value).endswith("line 1: invalid JSON (Expecting value: line 1 column 1 (char 0)); "
                                   "the name ends in .gz but the content is not gzip")
