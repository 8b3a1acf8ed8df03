"""Replaying kvtier event sequences exactly, without Hypothesis, and minimizing failing ones.

A sequence (the format: :mod:`kvtier.testing.steps`) names the machine it drives (its
name: :mod:`kvtier.testing.registry`); :func:`replay` calls the machine's rules directly,
in order, checking every invariant after every step, exactly as the run that recorded it
did. The format's records and the machines' names are re-exported here, so
``kvtier.testing.sequence`` keeps every public name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .registry import KIT_MACHINES, machine_name, register_machine, registered
from .steps import FORMAT, VERSION, EventSequence, SequenceError, Step

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

def machine_class(name: str) -> Callable[[], Any]:
    """The machine a sequence names: a registered name, one of the kit's
    (:data:`~kvtier.testing.registry.KIT_MACHINES`, imported now) or ``"module:Class"``.

    Raises:
        SequenceError: the name is unknown, or its module or class cannot be imported.
    """
    found = registered(name)
    if found is not None:
        return found
    where = KIT_MACHINES.get(name, name)
    if name == "sglang" and "vllm" not in sys.modules:
        # SGLang's cache modules import on a CPU box only with placeholders for its GPU
        # dependencies (kvtier.testing.sglang_cpu); not beside vLLM's modules
        from .sglang_cpu import installed, load_sglang

        if installed():
            try:
                load_sglang()
            except ImportError:
                pass
    if ":" not in where:
        raise SequenceError(f"unknown machine {name!r}; the kit's: {sorted(KIT_MACHINES)} (or register one, "
                            f"or use 'module:Class')")
    mod, _, attr = where.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SequenceError(f"machine {name!r} cannot be imported: {exc} (is {mod!r} on the import "
                            f"path? e.g. run from the folder that holds it with PYTHONPATH=.)") from exc
    return obj  # type: ignore[no-any-return]


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
        SequenceError: the machine has no rule a step names, or a step's arguments do not
            fit the rule's parameters (a name it does not take, or one it needs missing).
    """
    machine = (factory or machine_class(seq.machine))()
    steps_run = 0
    try:
        check_all(machine)
        for i, step in enumerate(seq.steps, 1):
            fn = getattr(type(machine), step.rule, None)
            if fn is None or not callable(fn) or step.rule.startswith("_"):
                raise SequenceError(f"step {i}: machine {seq.machine!r} has no rule {step.rule!r}")
            _check_args(seq.machine, i, step, fn)
            steps_run = i
            if on_step is not None:
                on_step(i, step)
            machine.kit_replaying = True
            getattr(machine, step.rule)(**step.args)
            check_all(machine)
        end = getattr(machine, "kit_end", None)
        if callable(end):  # the drain every example ends with (a leak fails here)
            end()
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


#: a rule's signature, read once per rule (minimize replays every candidate sequence)
_signature = functools.lru_cache(maxsize=512)(inspect.signature)


def _check_args(machine: str, i: int, step: Step, fn: Callable[..., Any]) -> None:
    """Raise :class:`SequenceError` unless ``step.args`` bind to rule ``fn``'s parameters."""
    sig = _signature(fn)
    try:
        sig.bind(None, **step.args)
    except TypeError as exc:
        params = list(sig.parameters)[1:]
        raise SequenceError(f"step {i}: rule {step.rule!r} of machine {machine!r} takes {params}, "
                            f"got arguments {sorted(step.args)}: {exc}") from None


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
