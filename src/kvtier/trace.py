"""Reader for request traces in the Mooncake format (``.jsonl`` or ``.jsonl.gz``).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

* ``timestamp``: arrival time in milliseconds since the start of the trace
  (an integer or a finite float, non-decreasing from line to line);
* ``input_length``: prompt length in tokens (integer >= 1);
* ``output_length``: generated length in tokens (integer >= 0);
* ``hash_ids``: one non-negative integer id per 512-token prefix block of the prompt,
  ``len(hash_ids) == ceil(input_length / 512)``; the last block may be partial. Ids are
  chained: equal ids at equal positions mean an identical prefix.

Other keys are ignored; blank lines are skipped. Any malformed line raises
:class:`TraceFormatError` naming the file, the 1-based line number and the field.
``load_trace(None)`` reads the embedded default, the first 1,000 requests of the public
Mooncake conversation trace (provenance in ``kvtier/data/README.md``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from kvtier.fsm import ConfigError

from .data import DEFAULT_TRACE_NAME, default_trace_path

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake format."""

_CHUNK_BYTES = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"


class TraceFormatError(ConfigError):  # type: ignore[misc,unused-ignore]  # Any when mypy cannot map kvtier.fsm
    """A trace file is malformed (or truncated).

    Attributes:
        source: the file (path or description) being read.
        line: 1-based line number of the offending line, or ``None`` for the whole file.
        field: the offending field (e.g. ``"input_length"``, ``"hash_ids[3]"``), or
            ``None`` when the line as a whole is bad (invalid JSON, not an object).
    """

    def __init__(self, source: str, line: int | None, field: str | None, detail: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        where = source if line is None else f"{source}, line {line}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {detail}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: 0-based position of the request in the trace.
        arrival_s: arrival time in seconds since the start of the trace (``timestamp / 1000``).
        input_length: prompt length in tokens.
        output_length: generated length in tokens.
        hash_ids: one id per prefix block of the prompt (512 tokens each, the last one
            possibly partial).
    """

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """A request trace, in arrival order.

    Attributes:
        requests: the requests, with non-decreasing ``arrival_s``.
        block_tokens: tokens per ``hash_ids`` block (512 for Mooncake traces).
        source: where the trace came from (a path or a description of the embedded default).
    """

    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = "<in memory>"

    def __len__(self) -> int:
        return len(self.requests)

    def prompt_tokens(self) -> int:
        """Total prompt length over all requests, in tokens."""
        return sum(r.input_length for r in self.requests)

    def duration_s(self) -> float:
        """Time from the first to the last arrival, in seconds (0.0 for an empty trace)."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def _prefix_walk(self) -> tuple[int, int]:
        """Replay the trace into an unbounded prefix tree.

        Returns ``(distinct prefix blocks, prompt tokens hit)``. A block matches when the
        same id sits at the same position after the same prefix in an earlier request.
        """
        nodes: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node
        hit_tokens = 0
        for req in self.requests:
            parent, matched, matching = -1, 0, True
            for block_id in req.hash_ids:
                node = nodes.get((parent, block_id))
                if node is None:
                    node = nodes[(parent, block_id)] = len(nodes)
                    matching = False
                elif matching:
                    matched += 1
                parent = node
            hit_tokens += min(matched * self.block_tokens, req.input_length)
        return len(nodes), hit_tokens

    def unbounded_working_set_blocks(self) -> int:
        """Distinct prefix blocks in the trace: what an unbounded cache ends up holding.

        In blocks of ``block_tokens`` tokens (a request's last, partial block counts as one).
        """
        return self._prefix_walk()[0]

    def ideal_hit_tokens(self) -> int:
        """Prompt tokens covered by prefix blocks already seen earlier in the trace, in tokens.

        The unbounded-cache bound at block granularity: each request hits its longest
        prefix of blocks seen in earlier requests, counted as
        ``min(block_tokens * matched_blocks, input_length)`` since the last block may be
        partial.
        """
        return self._prefix_walk()[1]

    def ideal_hit_rate(self) -> float:
        """``ideal_hit_tokens() / prompt_tokens()`` (a fraction, 0.0 for an empty trace)."""
        total = self.prompt_tokens()
        return self.ideal_hit_tokens() / total if total else 0.0


class _Lines:
    """Raw lines of a plain or gzip-compressed byte stream (gzip detected by magic bytes).

    Yields each line with its ``b"\\n"`` kept (the last one may lack it). After iteration,
    ``gzip_truncated`` says whether the compressed stream ended before its end marker.
    """

    def __init__(self, stream: IO[bytes], source: str) -> None:
        self._stream = stream
        self._source = source
        self.gzip_truncated = False

    def _chunks(self) -> Iterator[bytes]:
        first = self._stream.read(_CHUNK_BYTES)
        if not first.startswith(_GZIP_MAGIC):
            yield first
            yield from iter(lambda: self._stream.read(_CHUNK_BYTES), b"")
            return
        decomp = zlib.decompressobj(wbits=31)
        data = first
        try:
            while True:
                if data:
                    yield decomp.decompress(data)
                    while decomp.eof and decomp.unused_data:  # multi-member gzip
                        rest = decomp.unused_data
                        decomp = zlib.decompressobj(wbits=31)
                        yield decomp.decompress(rest)
                data = self._stream.read(_CHUNK_BYTES)
                if not data:
                    break
        except zlib.error as exc:
            raise TraceFormatError(self._source, None, None, f"invalid gzip data ({exc})") from exc
        yield decomp.flush()
        self.gzip_truncated = not decomp.eof

    def __iter__(self) -> Iterator[bytes]:
        pending = b""
        for chunk in self._chunks():
            if not chunk:
                continue
            parts = (pending + chunk).split(b"\n")
            pending = parts.pop()
            for part in parts:
                yield part + b"\n"
        if pending:
            yield pending


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(obj: dict[str, object], name: str, source: str, line: int) -> object:
    if name not in obj:
        raise TraceFormatError(source, line, name, "missing")
    return obj[name]


def _int_field(obj: dict[str, object], name: str, minimum: int, source: str, line: int) -> int:
    value = _get(obj, name, source, line)
    if not _is_int(value):
        raise TraceFormatError(source, line, name, f"expected an integer, got {_describe(value)}")
    assert isinstance(value, int)
    if value < minimum:
        raise TraceFormatError(source, line, name, f"must be >= {minimum}, got {value}")
    return value


def _parse(lines: _Lines, source: str, limit: int | None, strict: bool) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    prev_ts: float | None = None
    prev_line = 0
    lineno = 0
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if raw.endswith(b"\n") or not text.startswith(b"{"):
                hint = ("; the name ends in .gz but the content is not gzip"
                        if lineno == 1 and str(source).endswith(".gz") else "")
                raise TraceFormatError(source, lineno, None, f"invalid JSON ({exc}){hint}") from exc
            msg = (f"file looks truncated at line {lineno}: the last line is incomplete "
                   f"JSON with no trailing newline ({exc})")
            if strict:
                raise TraceFormatError(source, lineno, None, msg) from exc
            warnings.warn(f"{source}: {msg}; skipped it", stacklevel=3)
            break
        if not isinstance(obj, dict):
            raise TraceFormatError(source, lineno, None,
                                   f"expected a JSON object, got {type(obj).__name__}")
        ts = _get(obj, "timestamp", source, lineno)
        if not (_is_int(ts) or isinstance(ts, float)):
            raise TraceFormatError(source, lineno, "timestamp",
                                   f"expected a number of milliseconds, got {_describe(ts)}")
        assert isinstance(ts, (int, float))
        if not math.isfinite(ts) or ts < 0:
            raise TraceFormatError(source, lineno, "timestamp",
                                   f"must be finite and >= 0 ms, got {ts}")
        if prev_ts is not None and ts < prev_ts:
            raise TraceFormatError(
                source, lineno, "timestamp",
                f"goes backwards: {ts} ms is earlier than {prev_ts} ms on line {prev_line}")
        input_length = _int_field(obj, "input_length", 1, source, lineno)
        output_length = _int_field(obj, "output_length", 0, source, lineno)
        ids = _get(obj, "hash_ids", source, lineno)
        if not isinstance(ids, list):
            raise TraceFormatError(source, lineno, "hash_ids",
                                   f"expected a list of integers, got {_describe(ids)}")
        for i, block_id in enumerate(ids):
            if not _is_int(block_id) or block_id < 0:
                raise TraceFormatError(source, lineno, f"hash_ids[{i}]",
                                       f"expected an integer >= 0, got {_describe(block_id)}")
        blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != blocks:
            raise TraceFormatError(
                source, lineno, "hash_ids",
                f"has {len(ids)} ids but input_length {input_length} needs "
                f"ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {blocks}")
        requests.append(TraceRequest(index=len(requests), arrival_s=ts / 1000.0,
                                     input_length=input_length, output_length=output_length,
                                     hash_ids=tuple(ids)))
        prev_ts, prev_line = ts, lineno
        if limit is not None and len(requests) >= limit:
            return requests  # the rest of the file is not read
    if lines.gzip_truncated:
        msg = f"file looks truncated after line {lineno}: the gzip stream ends early"
        if strict:
            raise TraceFormatError(source, None, None, msg)
        warnings.warn(f"{source}: {msg}", stacklevel=3)
    return requests


def load_trace(path: str | os.PathLike[str] | None = None, limit: int | None = None,
               *, strict: bool = True) -> Trace:
    """Read a Mooncake-format trace.

    Args:
        path: a ``.jsonl`` or ``.jsonl.gz`` file (gzip is detected from the content);
            ``None`` reads the embedded default (first 1,000 Mooncake conversation requests).
        limit: read only the first ``limit`` requests (>= 1); ``None`` reads them all.
        strict: if false, a truncated last line (incomplete JSON, no trailing newline) or
            a gzip stream that ends early is skipped with a warning instead of raising.

    Raises:
        TraceFormatError: a malformed line (the message names the file, 1-based line
            number and field), a truncated file (when ``strict``), or no requests at all.
        kvtier.fsm.ConfigError: an invalid ``limit``.
        OSError: the file cannot be opened.
    """
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ConfigError(f"limit must be an integer >= 1 or None, got {limit!r}")
    if path is None:
        source = f"embedded default kvtier/data/{DEFAULT_TRACE_NAME}"
        opened: IO[bytes] = default_trace_path().open("rb")
    else:
        source = os.fspath(path)
        opened = open(path, "rb")
    with opened as stream:
        requests = _parse(_Lines(stream, source), source, limit, strict)
    if not requests:
        raise TraceFormatError(source, None, None, "no requests")
    return Trace(requests=tuple(requests), block_tokens=MOONCAKE_BLOCK_TOKENS, source=source)
