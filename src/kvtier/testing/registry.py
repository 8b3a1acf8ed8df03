"""The names sequence files give the kit's machines, and the machines engines register.

A sequence names the machine it drives (:mod:`kvtier.testing.steps`): one of the kit's
(:data:`KIT_MACHINES`: ``core``, ``facade``, ``engine``, ``misuse``, ``l3tier``, ``reference``, ``scheduler``, ``node``,
``request``, ``l3``, and ``vllm`` and ``sglang`` where those engines are installed), a name an engine registered with :func:`register_machine`, or
``"module:Class"``. This module only names: it imports no machine (importing one is
:func:`kvtier.testing.sequence.machine_class`'s job), so every machine module may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["KIT_MACHINES", "register_machine", "registered", "machine_name"]

#: the kit's machines by the name sequence files use: ``"module:Class"``
KIT_MACHINES: dict[str, str] = {
    "core": "kvtier.testing.core_machine:CoreMachine",
    "facade": "kvtier.testing.facade_machine:FacadeMachine",
    "engine": "kvtier.testing.engine_plug:EngineFacadeMachine",
    "misuse": "kvtier.testing.misuse_machine:MisuseMachine",
    "l3tier": "kvtier.testing.l3_machine:L3TierMachine",
    "reference": "kvtier.testing.reference_machine:ReferenceMachine",
    "scheduler": "kvtier.testing.scheduler_machine:SchedulerMachine",
    "node": "kvtier.testing.raw_machines:NodeLifecycleMachine",
    "request": "kvtier.testing.raw_machines:RequestLifecycleMachine",
    "l3": "kvtier.testing.raw_machines:L3LifecycleMachine",
    "transfer": "kvtier.testing.raw_transfer:TransferLifecycleMachine",
    # the adapters' machines (they need vLLM or SGLang installed: kvtier.testing.fuzz.default_mix)
    "vllm": "kvtier.adapters.vllm_machine:VllmAdapterMachine",
    "sglang": "kvtier.adapters.sglang_machine:SglangAdapterMachine",
}

_REGISTRY: dict[str, Callable[[], Any]] = {}


def register_machine(name: str, factory: Callable[[], Any]) -> None:
    """Register a machine class (or factory) under a short name for sequence files."""
    _REGISTRY[name] = factory


def registered(name: str) -> Callable[[], Any] | None:
    """The machine registered under ``name`` by :func:`register_machine`, if any."""
    return _REGISTRY.get(name)


def machine_name(cls: type) -> str:
    """The name sequence files use for ``cls``: its registered name, the kit's name for one
    of the kit's machines, else ``module:Class``."""
    for name, factory in _REGISTRY.items():
        if factory is cls:
            return name
    path = f"{cls.__module__}:{cls.__qualname__}"
    for name, where in KIT_MACHINES.items():
        if where == path:
            return name
    return path
