"""The kvtier event-sequence format: a run of a kit state machine as readable JSON.

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

import importlib
import json
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "VERSION",
    "Step",
    "EventSequence",
    "ReplayResult",
    "SequenceError",
    "register_machine",
    "machine_class",
    "machine_name",
    "replay",
    "classify",
    "minimize",
    "custom_invariants",
    "check_all",
]

FORMAT = "kvtier-sequence"
VERSION = 1

_REGISTRY: dict[str, Callable[[], Any]] = {}


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
        try:
            steps = [Step(str(s["rule"]), dict(s.get("args", {}))) for s in raw["steps"]]
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
            SequenceError: the file cannot be read, is not JSON, or is not a kvtier event
                sequence of this version (the message names the file).
        """
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise SequenceError(f"cannot read sequence file {path}: {exc.strerror or exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SequenceError(f"{path}: not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise SequenceError(f"{path}: not a kvtier event sequence: a JSON {type(raw).__name__}, expected an "
                                f"object with \"format\": {FORMAT!r}")
        try:
            return EventSequence.from_json(raw)
        except SequenceError as exc:
            raise SequenceError(f"{path}: {exc}") from exc


def register_machine(name: str, factory: Callable[[], Any]) -> None:
    """Register a machine class under a short name for sequence files."""
    _REGISTRY[name] = factory


def machine_class(name: str) -> Callable[[], Any]:
    """The machine a sequence names: a registered name or ``"module:Class"``."""
    if name not in _REGISTRY and ":" not in name:
        importlib.import_module("kvtier.testing.machines")  # registers the kit's machines
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            obj: Any = importlib.import_module(mod)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise SequenceError(f"machine {name!r} cannot be imported: {exc} (is {mod!r} on the import "
                                f"path? e.g. run from the folder that holds it with PYTHONPATH=.)") from exc
        return obj  # type: ignore[no-any-return]
    raise SequenceError(f"unknown machine {name!r}; registered: {sorted(_REGISTRY)} (or use 'module:Class')")


def machine_name(cls: type) -> str:
    """The name sequence files use for ``cls``: its registered name, else ``module:Class``."""
    for name, factory in _REGISTRY.items():
        if factory is cls:
            return name
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class ReplayResult:
    """How a replay ended.

    Attributes:
        outcome: ``"pass"`` or ``"violation"``.
        steps_run: steps executed (the failing one included).
        invariant: the violated invariant's name (or the exception type for a crash).
        message: the failure message.
        failed_step: 1-based index of the step after which (or during which) it failed.
        detail: the traceback text of the failure.
    """

    outcome: str
    steps_run: int
    invariant: str | None = None
    message: str = ""
    failed_step: int | None = None
    detail: str = ""

    def matches(self, expect: Mapping[str, Any]) -> bool:
        """Whether this result is what ``expect`` (a sequence's ``expect``) says."""
        if self.outcome != expect.get("outcome", "pass"):
            return False
        want = expect.get("invariant")
        return want is None or want == self.invariant

    def describe(self) -> str:
        if self.outcome == "pass":
            return f"pass: {self.steps_run} steps, every invariant held after each"
        return f"violation of {self.invariant} at step {self.failed_step}: {self.message}"


#: where Hypothesis' ``@invariant()`` records itself on the decorated function
_INVARIANT_MARKER = "hypothesis_stateful_invariant"
_CUSTOM: dict[type, tuple[tuple[str, Any], ...]] = {}


def custom_invariants(cls: type) -> tuple[tuple[str, Any], ...]:
    """The ``@invariant()`` methods of a machine class other than the kit's own (whose
    names start with ``kit_``): an engine's own checks, as ``(method name, Hypothesis
    invariant record)`` pairs sorted by name."""
    found = _CUSTOM.get(cls)
    if found is None:
        pairs = []
        for name in dir(cls):
            if name.startswith(("kit_", "__")):
                continue
            inv = getattr(getattr(cls, name, None), _INVARIANT_MARKER, None)
            if inv is not None:
                pairs.append((name, inv))
        found = _CUSTOM[cls] = tuple(pairs)
    return found


def check_all(machine: Any) -> None:
    """Every check a run makes after a step: the kit's named invariants
    (``machine.kit_check()``), then the machine's own ``@invariant()`` methods (their
    preconditions respected). A failure of an own invariant that names no spec invariant
    is tagged with the method's name (``exc.kit_invariant``), which :func:`classify`
    reports, so a saved sequence records which invariant failed."""
    kit_check = getattr(machine, "kit_check", None)
    if kit_check is not None:
        kit_check()
    for name, inv in custom_invariants(type(machine)):
        if not all(pre(machine) for pre in getattr(inv, "preconditions", ())):
            continue
        try:
            inv.function(machine)
        except Exception as exc:
            if not isinstance(getattr(exc, "invariant", None), str):
                try:
                    exc.kit_invariant = name  # type: ignore[attr-defined]
                except AttributeError:  # pragma: no cover - an exception type with __slots__
                    pass
            raise


def classify(exc: BaseException) -> tuple[str, str]:
    """(invariant name, message) of a failure: the spec name of an
    :class:`~kvtier.fsm.errors.InvariantViolation`, the method name of a machine's own
    ``@invariant()`` (tagged by :func:`check_all`), the prefix ``name:`` of an assertion
    message, else the exception type. An exception group (Hypothesis' ``FlakyFailure``)
    is classified by its first exception."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    name = getattr(exc, "invariant", None)
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(name, str):
        return name, msg
    custom = getattr(exc, "kit_invariant", None)
    if isinstance(custom, str):
        return custom, msg
    if isinstance(exc, AssertionError) and ":" in msg:
        head = msg.split(":", 1)[0].strip()
        if head.replace("_", "").isalnum() and " " not in head:
            return head, msg
    return type(exc).__name__, msg


def replay(seq: EventSequence, factory: Callable[[], Any] | None = None,
           on_step: Callable[[int, Step], None] | None = None) -> ReplayResult:
    """Run ``seq`` on a fresh machine, checking every invariant after every step: the
    kit's and the machine's own ``@invariant()`` methods (:func:`check_all`).

    Raises:
        SequenceError: the machine has no rule a step names.
    """
    machine = (factory or machine_class(seq.machine))()
    steps_run = 0
    try:
        check_all(machine)
        for i, step in enumerate(seq.steps, 1):
            fn = getattr(type(machine), step.rule, None)
            if fn is None or not callable(fn) or step.rule.startswith("_"):
                raise SequenceError(f"step {i}: machine {seq.machine!r} has no rule {step.rule!r}")
            steps_run = i
            if on_step is not None:
                on_step(i, step)
            machine.kit_replaying = True
            getattr(machine, step.rule)(**step.args)
            check_all(machine)
    except SequenceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the system under test
        from ..eventlog import record_failure

        record_failure(exc)  # into the event log, when one is recording
        name, msg = classify(exc)
        return ReplayResult("violation", steps_run, name, msg, steps_run,
                            "".join(traceback.format_exception(exc)))
    finally:
        try:
            machine.teardown()
        except Exception:  # noqa: BLE001
            pass
    return ReplayResult("pass", steps_run)


def steps_from(pairs: Iterable[tuple[str, Mapping[str, Any]]]) -> list[Step]:
    """Steps from ``(rule, args)`` pairs."""
    return [Step.of(r, a) for r, a in pairs]


def minimize(seq: EventSequence, factory: Callable[[], Any] | None = None) -> EventSequence:
    """A 1-minimal sub-sequence that still fails with the same invariant: the run is cut
    after the failing step, then every step but the first (the setup) is dropped in turn
    while the replay still fails the same way. ``seq`` is returned unchanged if it passes."""
    first = replay(seq, factory)
    if first.outcome != "violation":
        return seq
    want = first.invariant
    steps = list(seq.steps[: first.failed_step or len(seq.steps)])

    def fails(candidate: list[Step]) -> bool:
        r = replay(EventSequence(seq.machine, candidate), factory)
        return r.outcome == "violation" and r.invariant == want

    changed = True
    while changed:
        changed = False
        i = len(steps) - 1
        while i >= 1:
            candidate = steps[:i] + steps[i + 1:]
            if fails(candidate):
                steps = candidate
                changed = True
            i -= 1
    return EventSequence(seq.machine, steps, seq.name, seq.description, dict(seq.expect), dict(seq.extra))
