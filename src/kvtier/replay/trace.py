"""Reader for request traces in the Mooncake format (``.jsonl`` or ``.jsonl.gz``).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

* ``timestamp``: arrival time in milliseconds since the start of the trace
  (an integer or a finite float, 0 .. :data:`MAX_TIMESTAMP_MS`, non-decreasing from line to line);
* ``input_length``: prompt length in tokens (integer, 1 .. :data:`MAX_INPUT_LENGTH`);
* ``output_length``: generated length in tokens (integer, 0 .. :data:`MAX_OUTPUT_LENGTH`);
* ``hash_ids``: one integer id (0 .. 2**64 - 1) per 512-token prefix block of the prompt,
  ``len(hash_ids) == ceil(input_length / 512)``; the last block may be partial. Ids are
  chained: equal ids at equal positions mean an identical prefix.

Other keys are ignored; blank lines are skipped. Any malformed line raises
:class:`TraceFormatError` naming the file, the 1-based line number and the field.

Nothing is read without bound. The limits are module constants: :data:`MAX_LINE_BYTES`
(1 MiB per line), :data:`MAX_JSON_DEPTH` (32), :data:`MAX_INPUT_LENGTH` (1 Mi tokens),
:data:`MAX_OUTPUT_LENGTH` (128 Ki tokens), :data:`MAX_HASH_ID` (ids fit in 64 bits),
:data:`MAX_TIMESTAMP_MS` (1e13 ms), and for gzip files :data:`MAX_DECOMPRESSED_BYTES`
(1 GiB) and :data:`MAX_GZIP_RATIO` (200 times the compressed size).
``load_trace(None)`` reads the embedded default, the first 1,000 requests of the public
Mooncake conversation trace (provenance in ``kvtier/data/README.md``).
"""

from __future__ import annotations

import json
import math
import operator
import os
import warnings
from dataclasses import dataclass
from typing import IO

from kvtier.fsm import ConfigError

from ..data import DEFAULT_TRACE_NAME, default_trace_path
from .trace_lines import (
    GZIP_RATIO_GRACE_BYTES,
    MAX_DECOMPRESSED_BYTES,
    MAX_GZIP_RATIO,
    MAX_JSON_DEPTH,
    MAX_LINE_BYTES,
    BigInt,
    TraceFormatError,
    TraceLines,
    parse_int,
    too_deep,
)

__all__ = [
    "GZIP_RATIO_GRACE_BYTES",
    "MAX_DECOMPRESSED_BYTES",
    "MAX_GZIP_RATIO",
    "MAX_HASH_ID",
    "MAX_HASH_IDS",
    "MAX_INPUT_LENGTH",
    "MAX_JSON_DEPTH",
    "MAX_LINE_BYTES",
    "MAX_OUTPUT_LENGTH",
    "MAX_TIMESTAMP_MS",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake format."""

MAX_INPUT_LENGTH = 1 << 20
"""Longest prompt accepted, ``input_length`` in tokens (1,048,576: 1 Mi tokens, eight times
a 128 Ki-token context window)."""

MAX_HASH_IDS = -(-MAX_INPUT_LENGTH // 512)
"""Most ``hash_ids`` entries on a line: ``ceil(MAX_INPUT_LENGTH / 512)`` = 2,048."""

MAX_OUTPUT_LENGTH = 1 << 17
"""Longest generation accepted, ``output_length`` in tokens (131,072 = 128 Ki tokens). The
reference scheduler decodes one token per request per step, so the replay time grows with
it: 3,000,000 tokens took over 4 minutes."""

MAX_HASH_ID = (1 << 64) - 1
"""Largest ``hash_ids`` entry accepted (ids must fit in 64 bits)."""

MAX_TIMESTAMP_MS = 10**13
"""Latest ``timestamp`` accepted, in milliseconds (about 317 years: room for Unix-epoch
milliseconds, now about 1.7e12). Below it an arrival in seconds keeps a float resolution of
2 microseconds or better; 1e308 ms left no room to add a step time, so times to first token
came out as 0.000."""


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


def _describe(value: object) -> str:
    if isinstance(value, BigInt):
        return repr(value)
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


def _int_field(obj: dict[str, object], name: str, minimum: int, maximum: int, limit_name: str,
               source: str, line: int) -> int:
    value = _get(obj, name, source, line)
    if isinstance(value, BigInt):
        raise TraceFormatError(source, line, name,
                               f"must be <= {maximum:,} ({limit_name}), got {_describe(value)}")
    if not _is_int(value):
        raise TraceFormatError(source, line, name, f"expected an integer, got {_describe(value)}")
    assert isinstance(value, int)
    if value < minimum:
        raise TraceFormatError(source, line, name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise TraceFormatError(source, line, name, f"must be <= {maximum:,} ({limit_name}), got {value:,}")
    return value


def _timestamp(obj: dict[str, object], source: str, line: int) -> float:
    ts = _get(obj, "timestamp", source, line)
    if isinstance(ts, BigInt):
        raise TraceFormatError(source, line, "timestamp",
                               f"must be <= {MAX_TIMESTAMP_MS:.0e} ms (MAX_TIMESTAMP_MS), got {_describe(ts)}")
    if not (_is_int(ts) or isinstance(ts, float)):
        raise TraceFormatError(source, line, "timestamp",
                               f"expected a number of milliseconds, got {_describe(ts)}")
    assert isinstance(ts, (int, float))
    if not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(source, line, "timestamp", f"must be finite and >= 0 ms, got {ts}")
    if ts > MAX_TIMESTAMP_MS:
        raise TraceFormatError(source, line, "timestamp",
                               f"must be <= {MAX_TIMESTAMP_MS:.0e} ms (MAX_TIMESTAMP_MS), got {ts:.6g}")
    return ts


def _hash_ids(obj: dict[str, object], input_length: int, source: str, line: int) -> tuple[int, ...]:
    ids = _get(obj, "hash_ids", source, line)
    if not isinstance(ids, list):
        raise TraceFormatError(source, line, "hash_ids", f"expected a list of integers, got {_describe(ids)}")
    blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceFormatError(
            source, line, "hash_ids",
            f"has {len(ids):,} ids but input_length {input_length} needs "
            f"ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {blocks}")
    for i, block_id in enumerate(ids):
        if not _is_int(block_id) or block_id < 0 or block_id > MAX_HASH_ID:
            raise TraceFormatError(source, line, f"hash_ids[{i}]",
                                   f"expected an integer in 0 .. 2**64 - 1 (MAX_HASH_ID), "
                                   f"got {_describe(block_id)}")
    return tuple(ids)


def _parse(lines: TraceLines, source: str, limit: int | None, strict: bool) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    prev_ts: float | None = None
    prev_line = 0
    lineno = 0
    for lineno, text, complete in lines:
        obj: object = None
        if too_deep(text):
            raise TraceFormatError(source, lineno, None,
                                   f"JSON nested deeper than MAX_JSON_DEPTH = {MAX_JSON_DEPTH} levels")
        try:
            obj = json.loads(text, parse_int=parse_int)
        except RecursionError as exc:  # not reached after too_deep; a safety net
            raise TraceFormatError(source, lineno, None, "JSON nested too deeply") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if complete or not text.startswith(b"{"):
                hint = ("; the name ends in .gz but the content is not gzip"
                        if lineno == 1 and not lines.is_gzip and str(source).endswith(".gz") else "")
                raise TraceFormatError(source, lineno, None, f"invalid JSON ({exc}){hint}") from exc
            msg = (f"file looks truncated at line {lineno}: the last line is incomplete "
                   f"JSON with no trailing newline ({exc})")
            if strict:
                raise TraceFormatError(source, lineno, None, msg) from exc
            warnings.warn(f"{source}: {msg}; skipped it", stacklevel=3)
            break
        if not isinstance(obj, dict):
            kind = "an integer" if isinstance(obj, BigInt) else type(obj).__name__
            raise TraceFormatError(source, lineno, None, f"expected a JSON object, got {kind}")
        ts = _timestamp(obj, source, lineno)
        if prev_ts is not None and ts < prev_ts:
            raise TraceFormatError(
                source, lineno, "timestamp",
                f"goes backwards: {ts} ms is earlier than {prev_ts} ms on line {prev_line}")
        input_length = _int_field(obj, "input_length", 1, MAX_INPUT_LENGTH, "MAX_INPUT_LENGTH", source, lineno)
        output_length = _int_field(obj, "output_length", 0, MAX_OUTPUT_LENGTH, "MAX_OUTPUT_LENGTH",
                                   source, lineno)
        ids = _hash_ids(obj, input_length, source, lineno)
        requests.append(TraceRequest(index=len(requests), arrival_s=ts / 1000.0,
                                     input_length=input_length, output_length=output_length,
                                     hash_ids=ids))
        prev_ts, prev_line = ts, lineno
        if limit is not None and len(requests) >= limit:
            return requests  # the rest of the file is not read
    if lines.gzip_truncated:
        msg = f"file looks truncated after line {lines.lineno}: the gzip stream ends early"
        if strict:
            raise TraceFormatError(source, None, None, msg)
        warnings.warn(f"{source}: {msg}", stacklevel=3)
    return requests


def _count(value: object, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (anything ``operator.index`` accepts but bool; the
    wording of ``kvtier.fsm.checks.as_int``)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return n


def load_trace(path: str | os.PathLike[str] | None = None, limit: int | None = None,
               *, strict: bool = True, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> Trace:
    """Read a Mooncake-format trace.

    Limits (module constants): lines of at most :data:`MAX_LINE_BYTES` (1 MiB), JSON nested at
    most :data:`MAX_JSON_DEPTH` deep, ``input_length`` at most :data:`MAX_INPUT_LENGTH`
    (1 Mi tokens), ``output_length`` at most :data:`MAX_OUTPUT_LENGTH` (128 Ki tokens),
    ``hash_ids`` entries below 2**64, ``timestamp`` at most :data:`MAX_TIMESTAMP_MS`; a gzip
    file decompresses to at most ``max_decompressed_bytes`` and at most
    :data:`MAX_GZIP_RATIO` times its size. Reading takes time linear in the file and memory
    linear in the requests kept; a bad line fails as soon as it is read.

    Args:
        path: a ``.jsonl`` or ``.jsonl.gz`` file (gzip is detected from the content);
            ``None`` reads the embedded default (first 1,000 Mooncake conversation requests).
        limit: read only the first ``limit`` requests (>= 1); ``None`` reads them all.
        strict: if false, a truncated last line (incomplete JSON, no trailing newline) or
            a gzip stream that ends early is skipped with a warning instead of raising.
        max_decompressed_bytes: most bytes a gzip file may decompress to (>= 1; default
            :data:`MAX_DECOMPRESSED_BYTES`, 1 GiB).

    Raises:
        TraceFormatError: a malformed line or one past a limit (the message names the file,
            1-based line number and field), a truncated file (when ``strict``), or no
            requests at all.
        kvtier.fsm.ConfigError: an invalid ``limit`` or ``max_decompressed_bytes``.
        OSError: the file cannot be opened or read.
    """
    if limit is not None:
        limit = _count(limit, "limit", 1)
    max_out = _count(max_decompressed_bytes, "max_decompressed_bytes", 1)
    if path is None:
        source = f"embedded default kvtier/data/{DEFAULT_TRACE_NAME}"
        opened: IO[bytes] = default_trace_path().open("rb")
    else:
        source = os.fspath(path)
        opened = open(path, "rb")
    with opened as stream:
        requests = _parse(TraceLines(stream, source, max_out), source, limit, strict)
    if not requests:
        raise TraceFormatError(source, None, None, "no requests")
    return Trace(requests=tuple(requests), block_tokens=MOONCAKE_BLOCK_TOKENS, source=source)
