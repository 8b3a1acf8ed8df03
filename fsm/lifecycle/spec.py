"""Load and validate the lifecycle specification (``kvtier.spec/lifecycle.toml``).

The file is package data read with :mod:`importlib.resources`, so an installed wheel
finds it exactly as a source checkout does.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ..errors import ConfigError, SpecNameError

__all__ = [
    "INTERNAL",
    "GuardRef",
    "TransitionSpec",
    "StateSpec",
    "LifecycleSpec",
    "Specification",
    "load_spec",
    "spec_text",
]

#: ``dest`` of an internal transition (the state does not change).
INTERNAL = "="


@dataclass(frozen=True, slots=True)
class GuardRef:
    """A guard on a transition: ``name`` must be true, or false when ``negated``."""

    name: str
    negated: bool = False

    @property
    def label(self) -> str:
        """``"name"`` or ``"!name"``, as written in the spec."""
        return ("!" if self.negated else "") + self.name


@dataclass(frozen=True, slots=True)
class TransitionSpec:
    """One transition row: ``event`` moves ``source`` to ``dest`` when every guard holds."""

    event: str
    source: str
    dest: str  # a state name, or INTERNAL
    guards: tuple[GuardRef, ...]
    doc: str

    @property
    def target(self) -> str:
        """The state after the transition (``source`` for an internal transition)."""
        return self.source if self.dest == INTERNAL else self.dest


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A state with its prose meaning and the resources it owns."""

    name: str
    description: str
    resources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LifecycleSpec:
    """One lifecycle (``node`` or ``request``) as declared in the spec file."""

    name: str
    title: str
    description: str
    subject: str
    initial: str
    states: tuple[StateSpec, ...]
    transitions: tuple[TransitionSpec, ...]
    guards: dict[str, str]  # name -> doc
    resources: dict[str, str]  # declared resource vocabulary: name -> doc (may be empty)
    #: facade call -> the states in which it is accepted (``[<lifecycle>.calls]``; may be empty)
    calls: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def events(self) -> tuple[str, ...]:
        """Event names in order of first appearance."""
        return tuple(dict.fromkeys(t.event for t in self.transitions))

    def state(self, name: str) -> StateSpec:
        """The declared state ``name``.

        Raises:
            SpecNameError: no such state in this lifecycle.
        """
        for st in self.states:
            if st.name == name:
                return st
        raise SpecNameError(f"the {self.name} lifecycle declares no state {name!r}")

    def states_holding(self, resource: str) -> frozenset[str]:
        """States whose declared resources include ``resource``.

        Raises:
            SpecNameError: ``resource`` is not in the lifecycle's resource vocabulary.
        """
        if resource not in self.resources:
            raise SpecNameError(f"the {self.name} lifecycle declares no resource {resource!r}")
        return frozenset(st.name for st in self.states if resource in st.resources)

    @property
    def terminal_states(self) -> frozenset[str]:
        """States no transition leaves (the subject's end)."""
        left = {t.source for t in self.transitions}
        return frozenset(st.name for st in self.states if st.name not in left and st.name != self.initial)

    def candidates(self, state: str, event: str) -> tuple[TransitionSpec, ...]:
        """The transitions ``event`` may take from ``state``, in spec order."""
        return tuple(t for t in self.transitions if t.source == state and t.event == event)


@dataclass(frozen=True, slots=True)
class Specification:
    """The whole spec: the lifecycles and the named invariants (name -> statement).

    ``l3`` is the L3 object lifecycle (``[l3]``, the shared-store tier) and ``transfer`` the
    transfer operation lifecycle (``[transfer]``, a copy past its deadline fenced until it
    ended); a spec text without one of those tables parses with ``None`` for it."""

    version: int
    node: LifecycleSpec
    request: LifecycleSpec
    invariants: dict[str, str]
    l3: LifecycleSpec | None = None
    transfer: LifecycleSpec | None = None

    @property
    def lifecycles(self) -> tuple[LifecycleSpec, ...]:
        return (self.node, self.request) + tuple(lc for lc in (self.l3, self.transfer) if lc is not None)


def spec_text(name: str = "lifecycle.toml") -> str:
    """The text of a file shipped in ``kvtier.spec`` (``lifecycle.toml`` or ``README.md``)."""
    return resources.files("kvtier.spec").joinpath(name).read_text(encoding="utf-8")


def _parse_lifecycle(name: str, raw: dict[str, Any]) -> LifecycleSpec:
    where = f"spec [{name}]"
    try:
        states = tuple(
            StateSpec(s, str(v["description"]), tuple(v.get("resources", ())))
            for s, v in raw["states"].items()
        )
        guards = {g: str(v["doc"]) for g, v in raw.get("guards", {}).items()}
        vocabulary = {str(k): str(v) for k, v in raw.get("resources", {}).items()}
        rows: list[TransitionSpec] = []
        for i, t in enumerate(raw["transitions"]):
            refs = tuple(GuardRef(g.lstrip("!"), g.startswith("!")) for g in t.get("guards", ()))
            for src in t["source"]:
                rows.append(TransitionSpec(str(t["event"]), src, str(t["dest"]), refs, str(t.get("doc", ""))))
        calls = {str(c): tuple(str(s) for s in v) for c, v in raw.get("calls", {}).items()}
        spec = LifecycleSpec(name, str(raw["title"]), str(raw["description"]), str(raw["subject"]),
                             str(raw["initial"]), states, tuple(rows), guards, vocabulary, calls)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{where}: malformed ({exc!r})") from exc
    names = set(spec.state_names)
    if vocabulary:
        for st in spec.states:
            unknown = [r for r in st.resources if r not in vocabulary]
            if unknown:
                raise ConfigError(f"{where}: state {st.name!r} lists undeclared resources {unknown}")
    if spec.initial not in names:
        raise ConfigError(f"{where}: initial state {spec.initial!r} is not declared")
    for call, states_of in spec.calls.items():
        for s in states_of:
            if s not in names:
                raise ConfigError(f"{where}: call {call!r} lists undeclared state {s!r}")
    used: set[str] = set()
    seen: set[tuple[str, str, tuple[GuardRef, ...]]] = set()
    for t in spec.transitions:
        if t.source not in names:
            raise ConfigError(f"{where}: event {t.event!r} has undeclared source {t.source!r}")
        if t.dest != INTERNAL and t.dest not in names:
            raise ConfigError(f"{where}: event {t.event!r} has undeclared dest {t.dest!r}")
        for g in t.guards:
            if g.name not in guards:
                raise ConfigError(f"{where}: event {t.event!r} uses undeclared guard {g.name!r}")
            used.add(g.name)
        key = (t.source, t.event, t.guards)
        if key in seen:
            raise ConfigError(f"{where}: duplicate transition {t.event!r} from {t.source!r} "
                              f"with guards {[g.label for g in t.guards]}")
        seen.add(key)
    unused = set(guards) - used
    if unused:
        raise ConfigError(f"{where}: guards declared but never used: {sorted(unused)}")
    return spec


def parse_spec(text: str) -> Specification:
    """Parse and validate spec text.

    Raises:
        ConfigError: naming the lifecycle and the offending state, event or guard.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"spec: not valid TOML: {exc}") from exc
    try:
        version = int(raw["version"])
        node, request = raw["node"], raw["request"]
        invariants = {k: str(v["statement"]) for k, v in raw["invariants"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"spec: malformed ({exc!r})") from exc
    return Specification(
        version=version,
        node=_parse_lifecycle("node", node),
        request=_parse_lifecycle("request", request),
        invariants=invariants,
        l3=_parse_lifecycle("l3", raw["l3"]) if "l3" in raw else None,
        transfer=_parse_lifecycle("transfer", raw["transfer"]) if "transfer" in raw else None,
    )


@functools.cache
def load_spec() -> Specification:
    """The shipped specification, parsed once per process."""
    return parse_spec(spec_text())
