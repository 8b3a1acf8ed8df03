"""Start rank processes: ``torch.distributed`` over a file store, one process per rank.

:func:`launch` spawns ``world_size`` processes (``spawn`` start method), initialises the
process group in each (gloo by default), builds the rank's
:class:`~kvtier.parallel.sync.StepSync` and calls ``fn(sync, arg)``; each rank's return
value (picklable) comes back in rank order. A :class:`~kvtier.fsm.KvtierError` raised on a
rank (a :class:`~kvtier.parallel.sync.RankDivergence`, for instance) is returned as a
:class:`RankError` in that rank's place, so a test sees what every rank saw; any other
exception stops the launch (``torch.multiprocessing.ProcessRaisedException``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.fsm import ConfigError, KvtierError

from .sync import StepSync

__all__ = ["launch", "RankError"]


@dataclass(frozen=True)
class RankError:
    """A kvtier error one rank raised: its class name, message and attributes."""

    rank: int
    kind: str
    message: str
    attrs: dict[str, Any]


def _entry(rank: int, fn: Callable[[StepSync, Any], Any], world_size: int, arg: Any, tmp: str, backend: str,
           timeout_s: float, threads: int, device: str | None) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl" and device is None:
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank (NCCL needs it)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dev = device if device is not None else ("cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}")
        sync = StepSync(device=dev)
        try:
            out: Any = fn(sync, arg)
        except KvtierError as e:
            attrs = {k: v for k, v in vars(e).items() if isinstance(v, (int, float, str, tuple, list, type(None)))}
            out = RankError(rank, type(e).__name__, str(e), attrs)
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[[StepSync, Any], Any], world_size: int, arg: Any = None, *, backend: str = "gloo",
           timeout_s: float = 120.0, threads: int = 1, device: str | None = None) -> list[Any]:
    """Run ``fn(sync, arg)`` in ``world_size`` rank processes; their results in rank order.

    Args:
        fn: a module-level function (pickled into the processes).
        world_size: ranks (>= 1).
        arg: passed to every rank (picklable).
        backend: ``gloo`` (CPU) or ``nccl`` (GPUs; ``device`` then defaults to the
            current CUDA device of the process, which ``fn`` may set).
        timeout_s: collective timeout (a rank that stops answering fails the others).
        threads: torch threads per process.
        device: where :class:`StepSync` puts its tensors (default: by backend).

    Raises:
        ConfigError: bad ``world_size``.
        torch.multiprocessing.ProcessRaisedException: a rank raised something other
            than a kvtier error.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="kvtier-ranks-") as tmp:
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call,unused-ignore]
            _entry, args=(fn, world_size, arg, tmp, backend, timeout_s, threads, device),
            nprocs=world_size, join=True, start_method="spawn")
        out = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
