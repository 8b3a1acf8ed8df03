"""The kvtier event-sequence format: a run of a kit state machine as readable JSON.

This module holds the format only (:class:`Step`, :class:`EventSequence`); replaying a
sequence is :mod:`kvtier.testing.sequence`, the machines' names :mod:`kvtier.testing.registry`.

A sequence names the machine it drives and lists its steps, each a rule name with
plain JSON arguments (ints, strings, booleans, lists, ``null``). It is not tied to a
Hypothesis version: replaying calls the machine's rules directly, in order, checking
every invariant after every step, exactly as the run that recorded it did.

Format (version 1)::

    {
      "format": "kvtier-sequence",
      "version": 1,
      "name": "writeback-failure-publishes-nothing",
      "machine": "facade",            # a registered name, or "module:Class"
      "description": "...",
      "expect": {"outcome": "pass"}, # or {"outcome": "violation", "invariant": "..."}
      "steps": [
        {"rule": "setup", "args": {"world": 1, "policy": "write_through", ...}},
        {"rule": "admit", "args": {"req": 0, "key": ["a", "b"], "chunk": 2}},
        ...
      ]
    }
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..replay.trace_lines import MAX_JSON_DEPTH, too_deep

__all__ = ["FORMAT", "VERSION", "MAX_SEQUENCE_BYTES", "MAX_SEQUENCE_DEPTH", "Step", "EventSequence", "SequenceError"]

FORMAT = "kvtier-sequence"
VERSION = 1

MAX_SEQUENCE_BYTES = 64 << 20
"""Largest sequence file :meth:`EventSequence.load` reads, in bytes (64 MiB; the kit's
committed sequences are under 11 KB, a minimized counterexample a few KB)."""

MAX_SEQUENCE_DEPTH = MAX_JSON_DEPTH
"""Deepest nesting of JSON arrays and objects in a sequence file (32, as in traces and event
logs; a sequence needs 6: the file, its steps, a step, its args, a key, a nested value)."""


class SequenceError(ValueError):
    """A sequence file is malformed, of another version, or names an unknown machine or rule."""


def _jsonable(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, where) for k, v in value.items()}
    if hasattr(value, "value") and isinstance(value.value, (str, int)):  # enums
        return value.value
    raise SequenceError(f"{where}: argument {value!r} is not plain JSON data")


@dataclass(frozen=True)
class Step:
    """One rule call: ``rule`` with keyword ``args`` (plain JSON values)."""

    rule: str
    args: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(rule: str, args: Mapping[str, Any]) -> Step:
        return Step(rule, {k: _jsonable(v, rule) for k, v in args.items()})

    def render(self) -> str:
        """The step as one readable line, e.g. ``admit(req=0, key='ab', chunk=2)``."""
        parts = []
        for k, v in self.args.items():
            if isinstance(v, list) and v and all(isinstance(x, str) and len(x) == 1 for x in v):
                parts.append(f"{k}={''.join(v)!r}")
            else:
                parts.append(f"{k}={v!r}")
        return f"{self.rule}({', '.join(parts)})"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "args": dict(self.args)}


@dataclass
class EventSequence:
    """A named, deterministic sequence of steps for one machine."""

    machine: str
    steps: list[Step]
    name: str = "sequence"
    description: str = ""
    expect: dict[str, Any] = field(default_factory=lambda: {"outcome": "pass"})
    extra: dict[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        """Numbered readable steps."""
        width = len(str(len(self.steps)))
        return "\n".join(f"  {i:>{width}}. {s.render()}" for i, s in enumerate(self.steps, 1))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "name": self.name,
                               "machine": self.machine}
        if self.description:
            out["description"] = self.description
        out["expect"] = dict(self.expect)
        out.update(self.extra)
        out["steps"] = [s.to_json() for s in self.steps]
        return out

    def dumps(self) -> str:
        """The JSON text: one step per line, so diffs and reviews stay readable."""
        head = self.to_json()
        steps = head.pop("steps")
        text = json.dumps(head, indent=2)
        body = ",\n".join("    " + json.dumps(s, separators=(", ", ": ")) for s in steps)
        return text[:-2] + ',\n  "steps": [\n' + body + "\n  ]\n}\n"

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.dumps(), encoding="utf-8")
        return p

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> EventSequence:
        if raw.get("format") != FORMAT:
            raise SequenceError(f"not a kvtier event sequence: format {raw.get('format')!r}, expected {FORMAT!r}")
        if raw.get("version") != VERSION:
            raise SequenceError(f"sequence version {raw.get('version')!r} is not supported (this is {VERSION})")
        steps_raw = raw.get("steps")
        if not isinstance(steps_raw, list):
            raise SequenceError(f"malformed sequence: \"steps\" is {type(steps_raw).__name__}, expected a list")
        for i, s in enumerate(steps_raw, 1):
            if not isinstance(s, dict) or not isinstance(s.get("rule"), str) or not isinstance(s.get("args", {}), dict):
                raise SequenceError(f"malformed sequence: step {i} is {str(s)[:60]!r}, expected an object with a "
                                    f"string \"rule\" and an object \"args\"")
        if not isinstance(raw.get("expect", {}), dict):
            raise SequenceError(f"malformed sequence: \"expect\" is {str(raw.get('expect'))[:60]!r}, expected an "
                                f"object such as {{\"outcome\": \"pass\"}}")
        try:
            steps = [Step(str(s["rule"]), dict(s.get("args", {}))) for s in steps_raw]
            known = {"format", "version", "name", "machine", "description", "expect", "steps"}
            return EventSequence(str(raw["machine"]), steps, str(raw.get("name", "sequence")),
                                 str(raw.get("description", "")), dict(raw.get("expect", {"outcome": "pass"})),
                                 {k: v for k, v in raw.items() if k not in known})
        except (KeyError, TypeError, AttributeError) as exc:
            raise SequenceError(f"malformed sequence: {exc!r}") from exc

    @staticmethod
    def load(path: str | Path) -> EventSequence:
        """Read a sequence file.

        Raises:
            SequenceError: the file cannot be read, is larger than :data:`MAX_SEQUENCE_BYTES`,
                nests JSON deeper than :data:`MAX_SEQUENCE_DEPTH`, is not JSON (UTF-8), or is
                not a kvtier event sequence of this version (the message names the file).
        """
        try:
            with open(path, "rb") as stream:
                data = stream.read(MAX_SEQUENCE_BYTES + 1)
        except OSError as exc:
            raise SequenceError(f"cannot read sequence file {path}: {exc.strerror or exc}") from exc
        if len(data) > MAX_SEQUENCE_BYTES:
            raise SequenceError(f"{path}: larger than MAX_SEQUENCE_BYTES = {MAX_SEQUENCE_BYTES:,} bytes, expected "
                                f"a kvtier event sequence (a JSON object)")
        if too_deep(data):
            raise SequenceError(f"{path}: JSON nested deeper than MAX_SEQUENCE_DEPTH = {MAX_SEQUENCE_DEPTH} levels, "
                                f"expected a kvtier event sequence (a sequence nests 6 levels)")
        try:
            raw = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, a huge int literal
            raise SequenceError(f"{path}: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SequenceError(f"{path}: not a kvtier event sequence: a JSON {type(raw).__name__}, expected an "
                                f"object with \"format\": {FORMAT!r}")
        try:
            return EventSequence.from_json(raw)
        except SequenceError as exc:
            raise SequenceError(f"{path}: {exc}") from exc
