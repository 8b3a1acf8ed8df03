"""Start rank processes: ``torch.distributed`` over a file store, one process per rank.

:func:`launch` spawns ``world_size`` processes (``spawn`` start method), initialises the
process group in each (gloo by default), builds the rank's
:class:`~kvtier.parallel.sync.StepSync` and calls ``fn(sync, arg)``; each rank's return
value (picklable) comes back in rank order. A :class:`~kvtier.fsm.KvtierError` raised on a
rank (a :class:`~kvtier.parallel.sync.RankDivergence`, for instance) is returned as a
:class:`RankError` in that rank's place, so a test sees what every rank saw. When a rank
fails (any other exception, or a peer that left makes its collective fail), the launch
raises :class:`RankFailed` naming the first failure in time on any rank, the root cause
(a rank whose completions carry another rank's number raises ``ConfigError`` and leaves;
its peers then fail with "Connection closed by peer": the ``ConfigError`` is reported).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.fsm import ConfigError, KvtierError

from .sync import StepSync

__all__ = ["launch", "RankError", "RankFailed"]


@dataclass(frozen=True)
class RankError:
    """A kvtier error one rank raised: its class name, message and attributes."""

    rank: int
    kind: str
    message: str
    attrs: dict[str, Any]


class RankFailed(KvtierError):
    """A rank process failed: the first failure in time on any rank (the root cause; the
    others, often peers whose collective failed once it left, follow in the message).

    Attributes:
        first: the root cause (:class:`RankError`: rank, exception class, message).
        others: the later failures, in time order.
        traceback: the root cause's traceback, as text.
    """

    def __init__(self, first: RankError, others: list[RankError], tb: str) -> None:
        then = "".join(f"; then rank {e.rank}: {e.kind}: {e.message}" for e in others)
        super().__init__(f"rank {first.rank} failed first: {first.kind}: {first.message}{then}")
        self.first = first
        self.others = others
        self.traceback = tb


def _error(rank: int, e: BaseException) -> RankError:
    attrs = {k: v for k, v in vars(e).items() if isinstance(v, (int, float, str, tuple, list, type(None)))}
    return RankError(rank, type(e).__name__, str(e), attrs)


def _failures(tmp: str, world_size: int) -> list[tuple[float, RankError, str]]:
    """Every rank's failure on record (``rank<r>.failed``: when, what, traceback), by time."""
    out = []
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.failed")
        if os.path.exists(path):
            with open(path, "rb") as f:
                out.append(pickle.load(f))
    return sorted(out, key=lambda x: (x[0], x[1].rank))


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
        except BaseException as e:
            # when, on one host's monotonic clock: the first failure in time is the root cause
            with open(os.path.join(tmp, f"rank{rank}.failed"), "wb") as f:
                pickle.dump((time.monotonic(), _error(rank, e), traceback.format_exc()), f)
            if not isinstance(e, KvtierError):
                raise
            out = _error(rank, e)
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
        RankFailed: a rank raised something other than a kvtier error (or its process
            died): names the first failure in time on any rank, a kvtier error included.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="kvtier-ranks-") as tmp:
        try:
            mp.start_processes(  # type: ignore[attr-defined,no-untyped-call,unused-ignore]
                _entry, args=(fn, world_size, arg, tmp, backend, timeout_s, threads, device),
                nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:
            failed = _failures(tmp, world_size)
            if not failed:  # a process died without a word (killed, out of memory)
                raise RankFailed(RankError(-1, type(exc).__name__, str(exc), {}), [], "") from exc
            (_, first, tb), rest = failed[0], failed[1:]
            raise RankFailed(first, [e for _, e, _ in rest], tb) from exc
        out = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
