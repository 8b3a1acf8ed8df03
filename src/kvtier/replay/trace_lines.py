"""The byte level of the trace reader (:mod:`kvtier.replay.trace`): the lines of a plain or
gzip-compressed stream, each bounded, and the error a malformed trace raises.

Nothing is read without bound: a line has at most :data:`MAX_LINE_BYTES`, JSON nests at most
:data:`MAX_JSON_DEPTH` deep, and a gzip stream decompresses to at most
:data:`MAX_DECOMPRESSED_BYTES` (by default) and at most :data:`MAX_GZIP_RATIO` times its size.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import IO

from kvtier.fsm import ConfigError

__all__ = ["TraceFormatError", "TraceLines", "BigInt", "parse_int", "too_deep", "MAX_LINE_BYTES",
           "MAX_DECOMPRESSED_BYTES", "MAX_GZIP_RATIO", "GZIP_RATIO_GRACE_BYTES", "MAX_JSON_DEPTH"]

MAX_LINE_BYTES = 1 << 20
"""Longest line accepted, in bytes (1 MiB, after gzip decompression; the line break excluded).

A Mooncake line is about 100 B plus 2 to 21 B per ``hash_ids`` entry, so a request at
:data:`~kvtier.replay.trace.MAX_INPUT_LENGTH` (2,048 ids of up to 20 digits) needs under
50 KiB. Lines are read in chunks of 64 KiB; a longer line raises :class:`TraceFormatError` as soon as the limit
is passed, so a file without line breaks (or ``/dev/zero``) fails after 1 MiB."""

MAX_DECOMPRESSED_BYTES = 1 << 30
"""Most bytes a gzip-compressed trace may decompress to (1 GiB; the whole public Mooncake
conversation trace, 12,031 requests, is 3.0 MB). Larger traces: decompress them first
(plain files have no total limit) or pass ``max_decompressed_bytes`` to :func:`~kvtier.replay.trace.load_trace`."""

MAX_GZIP_RATIO = 200
"""Most decompressed bytes per compressed byte of a gzip trace, checked once
:data:`GZIP_RATIO_GRACE_BYTES` have been decompressed. Real traces compress 3 to 50 times
(the embedded Mooncake slice: 3.4); deflate's maximum, reached by gzip bombs of one
repeated byte, is about 1,030. Rejecting above 200 stops a bomb after 4 MiB of output,
whatever its content (a single repeated line of a valid request compresses about 300 times:
decompress such a trace first)."""

GZIP_RATIO_GRACE_BYTES = 4 << 20
"""Decompressed bytes (4 MiB) read before :data:`MAX_GZIP_RATIO` applies."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of JSON arrays and objects accepted on a line (a Mooncake line has 2)."""

_INT_DIGITS = 30  # longer integer literals are never converted (MAX_HASH_ID has 20 digits)
_CHUNK_BYTES = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"
_BRACKETS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


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


class BigInt:
    """An integer literal too long to convert; only its digit count is kept."""

    __slots__ = ("digits",)

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"a {self.digits:,}-digit integer"


def parse_int(text: str) -> int | BigInt:
    return int(text) if len(text) <= _INT_DIGITS else BigInt(text)


class TraceLines:
    """The non-blank lines of a plain or gzip-compressed byte stream (gzip detected by magic
    bytes), read in chunks of 64 KiB, each line at most :data:`MAX_LINE_BYTES`.

    Yields ``(line number, stripped line, complete)``, ``complete`` false for a last line
    without a trailing ``b"\\n"``. After iteration, ``gzip_truncated`` says whether the
    compressed stream ended inside a gzip member.
    """

    def __init__(self, stream: IO[bytes], source: str, max_decompressed_bytes: int) -> None:
        self._stream = stream
        self._source = source
        self._max_out = max_decompressed_bytes
        self.is_gzip = False
        self.gzip_truncated = False
        self.lineno = 0  # lines completed so far

    def _fail(self, detail: str) -> TraceFormatError:
        return TraceFormatError(self._source, self.lineno + 1, None, detail)

    def _gzip_chunks(self, first: bytes) -> Iterator[bytes]:
        decomp = zlib.decompressobj(wbits=31)
        data, read_bytes, out_bytes, in_member = first, len(first), 0, True
        try:
            while True:
                while True:  # at most _CHUNK_BYTES of output per call: memory stays bounded
                    if data and not in_member:  # the next member of a multi-member file
                        decomp, in_member = zlib.decompressobj(wbits=31), True
                    chunk = decomp.decompress(data, _CHUNK_BYTES)
                    if decomp.eof:
                        data, in_member = decomp.unused_data, False
                    else:
                        data = decomp.unconsumed_tail
                    out_bytes += len(chunk)
                    if out_bytes > self._max_out:
                        raise self._fail(
                            f"the gzip stream decompresses to more than {self._max_out:,} bytes "
                            f"(the limit, MAX_DECOMPRESSED_BYTES by default); decompress it first")
                    used = read_bytes - len(data)  # compressed bytes consumed so far
                    if out_bytes > GZIP_RATIO_GRACE_BYTES and out_bytes > MAX_GZIP_RATIO * used:
                        raise self._fail(
                            f"the gzip stream decompresses to {out_bytes:,} bytes from {used:,}, "
                            f"more than MAX_GZIP_RATIO = {MAX_GZIP_RATIO} times its size (a gzip bomb?); "
                            f"a real trace that compresses this well can be read decompressed")
                    if chunk:
                        yield chunk
                    if not data and len(chunk) < _CHUNK_BYTES:
                        break  # input consumed and output drained
                data = self._stream.read(_CHUNK_BYTES)
                read_bytes += len(data)
                if not data:
                    break
        except zlib.error as exc:
            raise self._fail(f"invalid gzip data ({exc})") from exc
        self.gzip_truncated = in_member

    def _chunks(self) -> Iterator[bytes]:
        first = self._stream.read(_CHUNK_BYTES)
        if first.startswith(_GZIP_MAGIC):
            self.is_gzip = True
            yield from self._gzip_chunks(first)
            return
        yield first
        yield from iter(lambda: self._stream.read(_CHUNK_BYTES), b"")

    def _too_long(self) -> TraceFormatError:
        after = " after gzip decompression" if self.is_gzip else ""
        return self._fail(f"the line is longer than MAX_LINE_BYTES = {MAX_LINE_BYTES:,} bytes{after} "
                          f"(is this a JSON-lines trace?)")

    def __iter__(self) -> Iterator[tuple[int, bytes, bool]]:
        pending = bytearray()
        for chunk in self._chunks():
            if not chunk.strip() and not pending.strip():  # blank lines only: counted at C speed
                breaks = chunk.count(b"\n")
                if breaks:
                    self.lineno += breaks
                    pending.clear()
                    chunk = chunk[chunk.rfind(b"\n") + 1:]
                pending += chunk
                if len(pending) > MAX_LINE_BYTES:
                    raise self._too_long()
                continue
            parts = chunk.split(b"\n")
            if len(parts) > 1:
                if pending:
                    if len(pending) + len(parts[0]) > MAX_LINE_BYTES:
                        raise self._too_long()
                    parts[0] = bytes(pending) + parts[0]
                    pending.clear()
                for part in parts[:-1]:
                    self.lineno += 1
                    text = part.strip()
                    if text:
                        yield self.lineno, text, True
            pending += parts[-1]
            if len(pending) > MAX_LINE_BYTES:
                raise self._too_long()
        text = bytes(pending).strip()
        if text:
            yield self.lineno + 1, text, False


def too_deep(text: bytes) -> bool:
    """Whether JSON ``text`` nests arrays and objects deeper than :data:`MAX_JSON_DEPTH`
    (brackets inside strings do not count)."""
    if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
        return False
    depth = 0
    for match in _BRACKETS.finditer(text):
        c = match.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False
