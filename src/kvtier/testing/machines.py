"""Public Hypothesis state machines for kvtier and for engines that embed it.

This module is the kit's entry point: it re-exports the machines and what an engine
needs to plug into them (sequence files name the kit's machines ``core``, ``facade``,
``engine``, ``misuse``, ``l3tier``, ``node``, ``request`` and ``l3``:
:mod:`kvtier.testing.registry`). They live in modules with one job each:

- :mod:`kvtier.testing.base`: :class:`KitMachine` (step recording, named invariant
  checks, configuration), the run counters and the kit's small layout;
- :mod:`kvtier.testing.content`: the byte-content model behind invariant 12;
- :mod:`kvtier.testing.core_machine` (its state and shared steps in
  :mod:`kvtier.testing.core_steps`): :class:`CoreMachine` drives a
  :class:`~kvtier.fsm.node.core.CacheCore` the way a scheduler plus a transfer engine
  would (inserts, matches, locks, loadbacks, writebacks, completions in any order across
  ranks, failures, deadlines, pressure), with the byte-content model;
- :mod:`kvtier.testing.facade_machine` (its state and steps in
  :mod:`kvtier.testing.facade_steps`, its rules in :mod:`kvtier.testing.facade_rules` and
  :mod:`kvtier.testing.facade_engine`, its checks in :mod:`kvtier.testing.facade_checks`):
  :class:`FacadeMachine` drives the
  :class:`~kvtier.tiered.TieredCache` facade through a :class:`SchedulerAdapter` and a
  :class:`TransferBackend` (:mod:`kvtier.testing.plugs`): requests are admitted, computed,
  reserved, finished, retracted, resumed and aborted at any point, with completions
  reordered, delayed, failed per rank and expired. An engine subclasses it and overrides
  :meth:`FacadeMachine.make_scheduler` / :meth:`FacadeMachine.make_transfer` to run the
  same rules and invariants against its own integration;
  :mod:`kvtier.testing.canonical` abstracts its state for ``kvtier verify``;
- :mod:`kvtier.testing.engine_plug`: :class:`EngineFacadeMachine`, the facade machine on
  the real :class:`~kvtier.transfer.engine.TransferEngine` (one per rank) over the
  fake-asynchronous backend, with failures at issue time and at completion;
- :mod:`kvtier.testing.models`: the reference models (layer readiness per rank, the
  eviction order, liveness, aborted writebacks, whole-prompt reuse);
- :mod:`kvtier.testing.l3_machine` (its state and steps in :mod:`kvtier.testing.l3_steps`,
  its hostile calls and corruptions in :mod:`kvtier.testing.l3_cases`): :class:`L3TierMachine`,
  two instances with an L3 tier over one faulty fake store;
- :mod:`kvtier.testing.misuse_machine`: :class:`MisuseMachine`, hostile calls on a live
  cache (bad arguments, unknown ids, spent receipts, wrong states, malformed layouts and
  specs; more in :mod:`kvtier.testing.misuse_cases`), each refused with a KvtierError and
  changing nothing, and corruptions of copies (:mod:`kvtier.testing.corruptions`, the
  table in :mod:`kvtier.testing.corruption_cases`) that the checks must catch;
- :mod:`kvtier.testing.raw_machines`: :class:`NodeLifecycleMachine` and
  :class:`RequestLifecycleMachine` fire legal and illegal events at the raw lifecycle
  machines (where rejections are exercised).

Every rule records itself as a :class:`~kvtier.testing.steps.Step`, so any run (in
particular a shrunk failure) can be saved as a kvtier event sequence and replayed
exactly without Hypothesis (:func:`kvtier.testing.sequence.replay`). Rule arguments
are plain JSON values. Every invariant check raises
:class:`~kvtier.fsm.errors.InvariantViolation` naming the spec invariant.

Fault injection: ``fault_rate`` (class attribute; :meth:`KitMachine.configured`) is the
campaign's fault rate, from which each example draws its own (:data:`~kvtier.testing.base.FAULT_MIX`),
the chance that a delivered completion reports failure; ``world_size`` fixes the number
of tensor-parallel ranks (else drawn from 1 and 2).
"""

from __future__ import annotations

from .base import INVARIANTS, STATS, KitMachine, RunStats, kit_layout, recorded
from .core_machine import CoreMachine
from .engine_plug import EngineFacadeMachine, EngineTransfer
from .facade_machine import FacadeMachine
from .l3_machine import L3TierMachine
from .misuse_machine import MisuseMachine
from .plugs import SchedulerAdapter, TransferBackend
from .raw_machines import L3LifecycleMachine, NodeLifecycleMachine, RequestLifecycleMachine
from .raw_transfer import TransferLifecycleMachine

__all__ = [
    "KitMachine",
    "RunStats",
    "STATS",
    "recorded",
    "kit_layout",
    "CoreMachine",
    "FacadeMachine",
    "EngineFacadeMachine",
    "EngineTransfer",
    "MisuseMachine",
    "SchedulerAdapter",
    "TransferBackend",
    "NodeLifecycleMachine",
    "RequestLifecycleMachine",
    "L3LifecycleMachine",
    "TransferLifecycleMachine",
    "L3TierMachine",
    "INVARIANTS",
]
