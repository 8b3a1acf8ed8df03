"""Reading a lifecycle event log within bounds, for ``kvtier check`` (:mod:`kvtier.cli.check`).

:func:`read_log` reads the JSON lines of docs/eventlog-format.md (plain or gzip, detected
from the content) under the trace reader's limits (:mod:`kvtier.replay.trace`, the same constants:
a line of at most ``MAX_LINE_BYTES``, JSON nested at most ``MAX_JSON_DEPTH`` deep, a gzip
file that decompresses to at most ``MAX_DECOMPRESSED_BYTES`` and at most ``MAX_GZIP_RATIO``
times its size), so ``kvtier check /dev/zero`` fails after 1 MiB instead of filling memory.
:func:`record_problem` checks that the fields the checker reads hold values of their type
(the table :data:`FIELDS`), so a malformed record is rejected naming the field and the value.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtier.fsm import ConfigError
from kvtier.fsm.checks import as_int

# the trace reader's line reader and limits, reused (not copied): one set of input limits
from ..replay.trace_lines import MAX_DECOMPRESSED_BYTES, MAX_JSON_DEPTH, TraceFormatError, TraceLines, too_deep

__all__ = ["FIELDS", "LogFormatError", "brief", "describe", "read_log", "record_problem"]


class LogFormatError(ValueError):
    """A log line that is not a record: not JSON, not an object, nested too deep, too long,
    not UTF-8, invalid gzip data, or a gzip stream that ends early.

    Attributes:
        line: 1-based line number (for a truncated gzip stream: the line after the last).
        detail: what is wrong (the message names the file too).
    """

    def __init__(self, path: str, line: int, detail: str) -> None:
        super().__init__(f"{path}: line {line}: {detail}")
        self.line = line
        self.detail = detail


def read_log(path: str | Path, *, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES,
             ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line of a log (gzip detected from the content).

    Args:
        max_decompressed_bytes: most bytes a gzip log may decompress to (>= 1; default
            ``kvtier.replay.trace.MAX_DECOMPRESSED_BYTES``, 1 GiB: decompress a larger log first).

    Raises:
        kvtier.fsm.ConfigError: ``max_decompressed_bytes`` not an int >= 1 (at the call).
        LogFormatError: while iterating, a line that is not a JSON object or is past a
            limit, invalid gzip data, or a gzip stream that ends early (raised when
            reached: the records before it are yielded first).
        OSError: the file cannot be opened or read (at the first record).
    """
    return _records(str(path), as_int(max_decompressed_bytes, "max_decompressed_bytes", minimum=1, error=ConfigError))


def _records(source: str, max_out: int) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(source, "rb") as stream:
        lines = TraceLines(stream, source, max_out)
        try:
            for i, text, complete in lines:
                yield i, _parse(source, i, text, complete)
        except TraceFormatError as exc:  # a line over MAX_LINE_BYTES, a gzip bomb, bad gzip data
            line = exc.line if exc.line is not None else lines.lineno + 1
            where = f"{exc.source}, line {line}: " if exc.line is not None else f"{exc.source}: "
            raise LogFormatError(source, line, str(exc).removeprefix(where)) from None
        if lines.gzip_truncated:
            raise LogFormatError(source, lines.lineno + 1, f"the gzip stream ends early after line "
                                                           f"{lines.lineno} (the file looks truncated)")


def _parse(source: str, line: int, text: bytes, complete: bool) -> dict[str, Any]:
    if too_deep(text):
        raise LogFormatError(source, line, f"JSON nested deeper than MAX_JSON_DEPTH = {MAX_JSON_DEPTH} levels")
    try:
        rec = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer literal too long
        cut = "" if complete else "; the last line has no line break (the file looks truncated)"
        raise LogFormatError(source, line, f"not JSON ({exc}){cut}") from None
    if not isinstance(rec, dict):
        raise LogFormatError(source, line, f"not a JSON object (got {type(rec).__name__})")
    return rec


def describe(value: object) -> str:
    """``value`` for a message: its repr cut to 40 characters, and its JSON type."""
    try:
        text = repr(value)
    except RecursionError:
        text = "..."
    if len(text) > 40:
        text = text[:37] + "..."
    kind = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)
    return f"{text} ({kind})"


def _int(v: object, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _mapping(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and ok(n) for k, n in v.items())


#: What a field must hold: (test, what it expects). A "?" kind also accepts null.
_KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "count": (_int, "an integer >= 0"),
    "ranks": (lambda v: _int(v, 1), "an integer >= 1"),
    "name": (lambda v: isinstance(v, str), "a string"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "ids": (lambda v: isinstance(v, list) and all(_int(x) for x in v), "an array of integers >= 0"),
    "counts": (_mapping(_int), "an object of name -> integer >= 0"),
    "flags": (_mapping(lambda n: isinstance(n, bool)), "an object of guard name -> true or false"),
}

#: The fields of each record kind that ``kvtier check`` reads: (name, kind, required). An
#: optional field may be absent; present, it must hold its kind (``kind?``: or null).
#: Other fields, and the kinds ``call`` and ``layer``, are not read (a producer may add its own).
FIELDS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "cache": (("world_size", "ranks", False),),
    "node": (("id", "count", True), ("ev", "name", True), ("from", "name", True), ("to", "name", True),
             ("parent", "count?", False), ("pstate", "name?", False), ("pwb", "count?", False),
             ("pfetch", "count?", False), ("lock", "count", False), ("borrow", "count", False),
             ("pin", "count", False), ("wb", "count?", False), ("lb", "count?", False),
             ("fetch", "count?", False), ("children", "counts?", False), ("pages", "counts?", False),
             ("guards", "flags?", False)),
    "request": (("id", "name", True), ("ev", "name", True), ("from", "name", True), ("to", "name", True),
                ("owed", "count", False), ("ops", "ids?", False), ("table", "count", False),
                ("guards", "flags?", False)),
    "return": (("id", "name", True), ("name", "name?", False), ("state", "name", True), ("table", "count", False)),
    "command": (("op", "count", True), ("dir", "name?", False)),
    "completion": (("op", "count", True), ("rank", "count", True), ("layer", "count?", False),
                   ("ok", "flag?", False)),
    "settled": (("op", "count", True), ("ok", "flag", True), ("expired", "flag", False)),
    "poison": (("op", "count", True),),
    "invariants": (("ok", "flag", True), ("invariant", "name?", False)),
    "refused": (("name", "name?", False),),
}


def record_problem(rec: object) -> str | None:
    """What is wrong with the fields of ``rec`` (see :data:`FIELDS`), or ``None``: a record
    of an unknown kind is left to the checker (which names it)."""
    if not isinstance(rec, dict):
        return f"a record must be a JSON object, got {describe(rec)}"
    kind = rec.get("k")
    if not isinstance(kind, str):
        return f"field 'k' (the record kind) must be a string, got {describe(kind)}"
    for name, spec, required in FIELDS.get(kind, ()):
        if name not in rec:
            if required:
                return f"field {name!r} is missing"
            continue
        value = rec[name]
        test, want = _KINDS[spec.rstrip("?")]
        if spec.endswith("?"):
            if value is None:
                continue
            want += " or null"
        if not test(value):
            return f"field {name!r} must be {want}, got {describe(value)}"
    return None


def brief(rec: dict[str, Any]) -> str:
    """One line for a record in a violation's context (a malformed one as read, cut at 300 characters)."""
    if record_problem(rec) is not None:  # a malformed record: as it was read, cut short
        try:
            text = json.dumps(rec, separators=(",", ":"), default=repr)
        except (ValueError, RecursionError):  # a circular or deeply nested object given to check_records
            text = reprlib.repr(rec)
        return text if len(text) <= 300 else text[:297] + "..."
    k = rec.get("k")
    if k in ("node", "request"):
        g = rec.get("guards") or {}
        gs = (" [" + ", ".join(f"{n}={'T' if v else 'F'}" for n, v in g.items()) + "]") if g else ""
        return f"{k} {rec.get('id')!r}: {rec.get('ev')} {rec.get('from')} -> {rec.get('to')}{gs}"
    if k == "call":
        return f"call {rec.get('name')}({', '.join(str(a) for a in rec.get('args', []))})" \
            if isinstance(rec.get("args"), list) else f"call {rec.get('name')} {rec.get('args')}"
    if k == "completion":
        extra = f" refused: {rec['refused']}" if rec.get("refused") else ""
        return f"completion op {rec.get('op')} rank {rec.get('rank')} layer {rec.get('layer')} ok={rec.get('ok')}{extra}"
    if k == "command":
        return f"command op {rec.get('op')} {rec.get('dir')} request {rec.get('request')!r} nodes {rec.get('nodes')}"
    if k == "settled":
        return f"settled op {rec.get('op')} {rec.get('dir')} ok={rec.get('ok')} expired={rec.get('expired')}"
    return json.dumps(rec, separators=(",", ":"))
