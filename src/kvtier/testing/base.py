"""The base of the kit's machines: step recording, run counters, named invariant checks,
configuration, and what the rules of several machines share (the kit's small layout,
the fault roll, the terminal request states).

Fault injection: ``fault_rate`` (class attribute; :meth:`KitMachine.configured`) is the
campaign's fault rate; each example draws its own rate from it (:data:`FAULT_MIX`: none,
a fifth, the rate itself, or twice it, at most 1), so that all-success runs are common
and so are failure-heavy ones, and a delivered completion fails with the example's rate
(``kit_rate``); ``world_size`` fixes the number of tensor-parallel ranks (else drawn
from 1 and 2).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from kvtier.fsm import CacheGroupSpec, ComponentSpec, Family
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.presets import preset
from kvtier.fsm.request import TERMINAL as _REQUEST_TERMINAL
from kvtier.fsm.lifecycle.machines import set_checked
from kvtier.fsm.lifecycle.spec import load_spec

from .registry import machine_name
from .steps import EventSequence, Step

__all__ = ["KitMachine", "RunStats", "STATS", "recorded", "kit_layout", "INVARIANTS", "ROLL", "TERMINAL",
           "FAULT_MIX", "FAULT_LEVEL", "LAYOUTS", "STATE_LAYOUTS", "PRESET_PARAMS", "PRESET_VARIANTS", "layout_named",
           "probe_layers"]

F = TypeVar("F", bound=Callable[..., Any])

#: The invariant names of the spec (what failures print).
INVARIANTS: tuple[str, ...] = tuple(load_spec().invariants)


@dataclass
class RunStats:
    """Process-wide counters of kit machines (the fuzz driver reads and resets them)."""

    steps: int = 0
    checks: int = 0
    examples: int = 0
    #: steps run (since the last reset) and ``time.perf_counter()`` when a step, check or
    #: drain first raised, before any shrinking (``None``: nothing failed yet)
    failed_at_step: int | None = None
    failed_at: float | None = None

    def reset(self) -> None:
        self.steps = self.checks = self.examples = 0
        self.failed_at_step = self.failed_at = None

    def note_failure(self) -> None:
        """Remember the first failure's step and time (later ones are the shrinker's)."""
        if self.failed_at_step is None:
            self.failed_at_step, self.failed_at = self.steps, time.perf_counter()


STATS = RunStats()
_CURRENT: list[KitMachine] = []


def recorded(fn: F) -> F:
    """Record each call of a rule as a :class:`Step` of the running machine."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: KitMachine, **kwargs: Any) -> Any:
        self.kit_trace.append(Step.of(name, kwargs))
        STATS.steps += 1
        self.kit_ok = False  # until the step returns: a failed example is not drained
        try:
            out = fn(self, **kwargs)
        except Exception:
            STATS.note_failure()
            raise
        self.kit_ok = True
        return out

    return wrapper  # type: ignore[return-value]


def kit_layout(with_state: bool = False) -> CacheLayout:
    """The small layout the kit machines use: history ``kv`` (2 tokens per page) and
    ``c4`` (4 tokens per page, two components), alignment 4 tokens, 3 layers; with
    ``with_state`` a continuation-state group ``swa`` (window 4 tokens: 2 pages)."""
    groups = [
        CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1, 2), (ComponentSpec("k", 64),)),
        CacheGroupSpec("c4", Family.HISTORY, 1, 4, (1, 2), (ComponentSpec("c", 32), ComponentSpec("i", 16))),
    ]
    if with_state:
        groups.append(CacheGroupSpec("swa", Family.STATE, 2, 1, (0, 1, 2), (ComponentSpec("s", 64),), window=4))
    return CacheLayout("kvtier-testing", tuple(groups), 3)


#: The presets' layouts the machines run, with fewer layers and smaller heads than the
#: models (the lifecycle depends on the groups, their families, page geometry in tokens,
#: windows and layer sets, not on the bytes per page): every group of each preset kept.
PRESET_PARAMS: dict[str, dict[str, Any]] = {
    "deepseek-v4": {"num_layers": 6, "head_dim": 128, "rope_dim": 64, "index_head_dim": 32},
    "llama-3-8b": {"num_layers": 4, "kv_heads": 1, "head_dim": 16},
    "deepseek-v3": {"num_layers": 4, "values_per_token": 32},
}
#: Preset variants with parameters of their own (name -> (preset, parameters)): DeepSeek V4
#: with explicit per-layer compression ratios, one with ratio-4 layers only and one with
#: ratio-128 layers only (the preset then builds only that compressed branch's groups).
PRESET_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v4/c4": ("deepseek-v4", {**PRESET_PARAMS["deepseek-v4"], "num_layers": 4, "ratios": (1, 4, 1, 4)}),
    "deepseek-v4/c128": ("deepseek-v4", {**PRESET_PARAMS["deepseek-v4"], "num_layers": 3, "ratios": (1, 128, 128),
                                         "sliding_window": 64}),
}
#: Layout names the machines draw (:func:`layout_named`): the kit's small layouts, then
#: every preset's (``fsm/presets.py``), then the preset variants.
LAYOUTS: tuple[str, ...] = ("kit", "kit+state", *PRESET_PARAMS, *PRESET_VARIANTS)
#: The layouts with continuation-state groups (checkpoints).
STATE_LAYOUTS: tuple[str, ...] = ("kit+state", "deepseek-v4", *PRESET_VARIANTS)


def layout_named(name: str) -> CacheLayout:
    """The layout a machine's setup names: ``kit`` / ``kit+state`` (:func:`kit_layout`)
    or a preset of ``fsm/presets.py`` with :data:`PRESET_PARAMS`.

    Raises:
        ValueError: an unknown name.
    """
    if name in ("kit", "kit+state"):
        return kit_layout(name == "kit+state")
    if name in PRESET_VARIANTS:
        base, params = PRESET_VARIANTS[name]
        return preset(base, **params)
    if name not in PRESET_PARAMS:
        raise ValueError(f"unknown kit layout {name!r}; expected one of {list(LAYOUTS)}")
    return preset(name, **PRESET_PARAMS[name])


def probe_layers(layout: CacheLayout) -> tuple[int, ...]:
    """The layers a simulated loadback reports progress for: the first, a middle and the
    last layer (so an off-by-one in layer readiness shows between them)."""
    n = layout.num_layers
    return tuple(sorted({0, n // 2, n - 1}))


class KitMachine(RuleBasedStateMachine):
    """Base of the kit's machines: step recording, named invariant checks, configuration.

    Subclasses list their invariant-check methods in ``kit_invariants`` (each raises
    :class:`InvariantViolation` naming a spec invariant). Building one turns on the checked
    mode of every lifecycle in the process (:func:`kvtier.fsm.lifecycle.machines.set_checked`):
    each event is fired through the compiled table and the ``transitions`` machine, and a
    difference raises ``compiled_lifecycle``.
    """

    kit_invariants: ClassVar[tuple[str, ...]] = ()
    #: chance that a delivered completion fails (0..1)
    fault_rate: ClassVar[float] = 0.25
    #: tensor-parallel ranks; ``None``: drawn from 1 and 2
    world_size: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        set_checked(True)
        self.kit_rate = self.fault_rate
        self.kit_trace: list[Step] = []
        self.kit_replaying = False
        self.kit_ok = True  # no step or check of this example failed (yet)
        self.kit_drained = False
        STATS.examples += 1
        _CURRENT[:] = [self]

    # -- configuration -------------------------------------------------------------
    @classmethod
    def configured(cls, **attrs: Any) -> type[KitMachine]:
        """A subclass with class attributes replaced (``fault_rate``, ``world_size``, ...)."""
        meta: Any = type(cls)
        sub: type[KitMachine] = meta(cls.__name__, (cls,), dict(attrs))
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        return sub

    def kit_fault_level(self, level: int | None) -> None:
        """Set this example's fault rate: ``fault_rate`` times :data:`FAULT_MIX` [``level``]
        (at most 1); ``None`` keeps ``fault_rate`` (sequences saved before the mix)."""
        self.kit_rate = self.fault_rate if level is None else min(1.0, self.fault_rate * FAULT_MIX[level])

    def kit_fail(self, roll: int) -> bool:
        """Whether a completion drawn with ``roll`` (0..999) fails under this example's
        fault rate (``kit_rate``)."""
        return roll < int(round(self.kit_rate * 1000))

    def kit_set_args(self, **args: Any) -> None:
        """Replace the recorded arguments of the step now running (effective values)."""
        last = self.kit_trace[-1]
        self.kit_trace[-1] = Step.of(last.rule, args)

    # -- invariants ----------------------------------------------------------------
    def kit_check(self) -> None:
        """Run every invariant check of this machine."""
        STATS.checks += 1
        self.kit_ok = False
        try:
            for name in self.kit_invariants:
                getattr(self, name)()
        except Exception:
            STATS.note_failure()
            raise
        self.kit_ok = True

    # -- the end of an example ---------------------------------------------------------
    def kit_drain(self) -> None:
        """Drain this machine to quiescence and check that nothing leaked
        (:mod:`kvtier.testing.drain`): every machine that drives the product overrides it
        (complete or fail every transfer, end every request, release its own receipts, then
        require every tier empty and the whole tree evictable to full pools)."""

    def kit_end(self) -> None:
        """Drain once at the end of the example (:meth:`kit_drain`, then every invariant),
        unless a step or check of the example failed (its failure is the one reported)."""
        if self.kit_ok and not self.kit_drained:
            self.kit_drained = True
            self.kit_ok = False
            try:
                self.kit_drain()
            except Exception:
                STATS.note_failure()
                raise
            self.kit_check()

    def teardown(self) -> None:
        """Hypothesis ends every example here: :meth:`kit_end`."""
        self.kit_end()

    @invariant()
    def kit_all_invariants(self) -> None:
        self.kit_check()

    def check_invariants(self, *args: Any, **kwargs: Any) -> None:
        """Hypothesis's check of every ``@invariant()`` (an engine's own included): a
        failure is noted as the campaign's first (:meth:`RunStats.note_failure`)."""
        try:
            super().check_invariants(*args, **kwargs)
        except Exception:
            STATS.note_failure()
            raise

    # -- sequences -----------------------------------------------------------------
    def kit_sequence(self, name: str = "sequence", description: str = "") -> EventSequence:
        """This run so far as a kvtier event sequence."""
        base = type(self)
        while base.__name__ == base.__mro__[1].__name__:  # configured() copies
            base = base.__mro__[1]
        return EventSequence(machine_name(base), list(self.kit_trace), name, description)

    @staticmethod
    def kit_current() -> KitMachine | None:
        """The machine most recently created in this process (the last example run)."""
        return _CURRENT[0] if _CURRENT else None

    # -- bounded verification (kvtier verify) ---------------------------------------
    def kit_actions(self) -> list[Step]:
        """Every step enabled now, with arguments from a small finite domain."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")

    def kit_canonical(self) -> Hashable:
        """An abstraction of the state: equal for states that behave the same."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")


#: Per-example fault rate, as multiples of the campaign's ``fault_rate`` (level 0, no
#: faults at all, is what Hypothesis shrinks toward).
FAULT_MIX: tuple[float, ...] = (0.0, 0.2, 1.0, 2.0)
#: The per-example fault level drawn by the machines' setup (an index into :data:`FAULT_MIX`).
FAULT_LEVEL = st.integers(0, len(FAULT_MIX) - 1)
#: A completion's fault roll (0..999), compared with ``fault_rate`` by :meth:`KitMachine.kit_fail`.
ROLL = st.integers(0, 999)
#: The request states a request ends in.
TERMINAL = tuple(sorted(_REQUEST_TERMINAL))
