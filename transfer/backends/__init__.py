"""The transfer backends and their registry: :func:`make_backend` builds one by name.

A backend moves the bytes of a :class:`~kvtier.transfer.plan.ChunkPlan` between the
pools and gives back events the engine polls (the interface: :mod:`.base`). Backends,
one module each: ``"hybrid"`` (the Numba kernel for small copies, batched copy-engine
copies for large ones, :mod:`.hybrid`, choosing by :mod:`.hybrid_choice`), ``"numba"``
(zero-copy Numba-CUDA kernels, :mod:`.numba_sm` with :mod:`.kernels`), ``"torch"`` (one
``copy_`` per contiguous run on side streams, :mod:`.torch_copy`), ``"cpu"`` (index copies
on CPU tensors, :mod:`.cpu`) and ``"fake-async"`` (the CPU backend whose copies complete
only when a test says so, :mod:`.fake_async`). The registry imports a backend's module
only when that backend is built; no backend imports the registry.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from kvtier.fsm import ConfigError

from ..errors import BackendUnavailable
from .base import Backend, ChunkCounts, DoneEvent, TransferEvent

__all__ = ["TransferEvent", "DoneEvent", "ChunkCounts", "Backend", "BACKENDS", "choose_backend",
           "make_backend", "simulator_enabled"]

#: backend name -> (its module in this package, its class).
_REGISTRY: dict[str, tuple[str, str]] = {
    "hybrid": ("hybrid", "HybridBackend"),
    "numba": ("numba_sm", "NumbaBackend"),
    "torch": ("torch_copy", "TorchBackend"),
    "cpu": ("cpu", "CpuBackend"),
    "fake-async": ("fake_async", "FakeAsyncBackend"),
}

#: Backend names accepted by :func:`make_backend` (plus ``"auto"``).
BACKENDS = tuple(_REGISTRY)


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is on. Reads ``numba.config`` if numba is
    already imported, else the ``NUMBA_ENABLE_CUDASIM`` environment variable (so
    deciding does not import numba)."""
    numba = sys.modules.get("numba")
    cfg = getattr(numba, "config", None) if numba is not None else None
    if cfg is not None and hasattr(cfg, "ENABLE_CUDASIM"):
        return bool(cfg.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


def choose_backend(device_is_cuda: bool) -> str:
    """The automatic choice: ``"cpu"`` without a CUDA device pool; with one, ``"numba"``
    when numba-cuda imports and the simulator is off, else ``"torch"``. Never ``"numba"``
    under the simulator (where ``cuda.is_available()`` is true). ``"hybrid"`` is opt-in:
    on the H200 it does not yet beat the kernel alone (bench/RESULTS.md)."""
    import torch

    if not device_is_cuda or not torch.cuda.is_available():
        return "cpu"
    if simulator_enabled():
        return "torch"
    try:
        from . import kernels  # noqa: F401  (imports numba-cuda)
    except Exception:  # pragma: no cover - depends on the machine
        return "torch"
    return "numba"


def make_backend(name: str, device_is_cuda: bool, **options: Any) -> Backend:
    """Build a backend by name (``"auto"``, ``"hybrid"``, ``"numba"``, ``"torch"``, ``"cpu"``,
    ``"fake-async"``), passing ``options`` to its constructor.

    Raises:
        ConfigError: unknown name or options.
        BackendUnavailable: the backend cannot run here.
    """
    if name == "auto":
        name = choose_backend(device_is_cuda)
    where = _REGISTRY.get(name) if isinstance(name, str) else None
    if where is None:
        raise BackendUnavailable(f"backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    module, cls_name = where
    cls: type[Backend] = getattr(importlib.import_module(f"{__name__}.{module}"), cls_name)
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"backend {name!r}: bad options {sorted(options)}: {e}") from None
