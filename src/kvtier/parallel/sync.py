"""The per-step collective of the rank-parallel mode: :class:`StepSync`.

Every rank calls :meth:`StepSync.exchange` at the same point of the scheduler's step
(the executor's ``collect``, see :class:`~kvtier.parallel.rank.RankExecutor`) with its
own transfer completions and the digest of its core's decisions so far. Two
``torch.distributed`` all-gathers (gloo on the CPU, NCCL on GPUs) follow:

1. a header per rank, int64 ``[5]``: exchange index, scheduler step, decision digest,
   number of completions, and a float64 payload (bit-cast) from the rank;
2. when any rank has completions: int64 ``[max_n, 4]`` rows ``(op_id, rank, ok, layer)``
   (``layer`` -1 for an acknowledgement), padded to the longest rank's count.

Every rank then holds every rank's completions, in rank order, and feeds them all to its
core, so every core sees the same completions at the same step: an operation is
acknowledged when every rank acknowledged it, and fails if any rank failed it (the
core's ``world_size`` rule). All ranks compare the digests they all received: a mismatch
raises :class:`RankDivergence` on every rank at once (no rank is left waiting in a
collective), naming the first exchange and scheduler step where the decisions differ.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvtier.fsm import Completion, ConfigError, KvtierError

__all__ = ["StepSync", "RankDivergence", "SyncStats"]

_HEADER = 5


class RankDivergence(KvtierError):  # type: ignore[misc,unused-ignore]  # Any when mypy cannot map kvtier.fsm
    """The ranks' cores decided differently (or fell out of step).

    Attributes:
        exchange: the first exchange (1-based) whose digests differ.
        step: the scheduler step each rank reported at that exchange (rank order).
        digests: each rank's digest at that exchange (rank order).
    """

    def __init__(self, exchange: int, steps: Sequence[int], digests: Sequence[int], indices: Sequence[int]) -> None:
        self.exchange = exchange
        self.step = tuple(steps)
        self.digests = tuple(digests)
        self.indices = tuple(indices)
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        parts = "; ".join(f"ranks {ranks}: digest {d & 0xFFFFFFFFFFFFFFFF:016x}" for d, ranks in groups.items())
        if len(set(indices)) > 1 or len(set(steps)) > 1:
            where = f"ranks out of step: exchange indices {list(indices)}, scheduler steps {list(steps)}"
        else:
            where = f"scheduler step {steps[0]}"
        super().__init__(f"ranks decided differently at exchange {exchange} ({where}): {parts}")


@dataclass
class SyncStats:
    """What the agreement cost (wall seconds, on this rank).

    Attributes:
        exchanges: calls of :meth:`StepSync.exchange`.
        exchange_s: seconds inside them (both all-gathers, packing and comparing).
        completion_gathers: exchanges that needed the second all-gather.
        completions: completions received from every rank.
        broadcasts, broadcast_s: :meth:`StepSync.broadcast_float` calls and seconds.
        samples_us: per-exchange microseconds (the first ``keep_samples``).
    """

    exchanges: int = 0
    exchange_s: float = 0.0
    completion_gathers: int = 0
    completions: int = 0
    broadcasts: int = 0
    broadcast_s: float = 0.0
    samples_us: list[float] = field(default_factory=list)


def _f2i(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _i2f(x: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(x)))[0])


class StepSync:
    """The collective of one rank (``torch.distributed`` must be initialised).

    Args:
        group: the process group of the tensor-parallel ranks (``None``: the default).
        device: where the exchanged tensors live: ``"cpu"`` for gloo, the rank's CUDA
            device for NCCL.
        keep_history: keep this rank's digest of every exchange (:attr:`history`).
        keep_samples: per-exchange timings kept in :attr:`stats` (bounded).

    Raises:
        ConfigError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: Any = None, *, device: str | torch.device = "cpu", keep_history: bool = False,
                 keep_samples: int = 100_000) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("StepSync needs torch.distributed initialised (init_process_group) first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)
        self.stats = SyncStats()
        self.keep_samples = keep_samples
        self.history: list[int] | None = [] if keep_history else None
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return out

    def exchange(self, digest: int, completions: Sequence[Completion], *, step: int = 0,
                 payload: float = 0.0) -> tuple[list[Completion], list[float]]:
        """Share this rank's completions and digest; receive every rank's.

        Args:
            digest: this rank's decision digest (signed 64-bit int).
            completions: this rank's new completions (their ``rank`` is this rank's).
            step: the scheduler's step (named in a divergence).
            payload: a float every rank receives (e.g. rank 0's clock).

        Returns:
            Every rank's completions (rank order, each rank's in its own order) and every
            rank's payload.

        Raises:
            RankDivergence: the digests differ, or the ranks are at different exchanges.
            ConfigError: a completion carries another rank's number.
        """
        t0 = time.perf_counter()
        st = self.stats
        st.exchanges += 1
        for c in completions:
            if c.rank != self.rank:
                raise ConfigError(f"rank {self.rank}: completion for op {c.op_id} carries rank {c.rank}")
        head = torch.tensor([st.exchanges, int(step), int(digest), len(completions), _f2i(payload)],
                            dtype=torch.int64).to(self.device)
        heads = torch.stack(self._gather(head)).cpu().tolist()
        if self.history is not None:
            self.history.append(int(digest))
        idx = [h[0] for h in heads]
        digests = [h[2] for h in heads]
        if len(set(idx)) > 1 or len(set(digests)) > 1:
            raise RankDivergence(min(idx), [h[1] for h in heads], digests, idx)
        counts = [h[3] for h in heads]
        out: list[Completion] = []
        width = max(counts)
        if width:
            rows = torch.full((width, 4), -1, dtype=torch.int64)
            if completions:
                rows[: len(completions)] = torch.tensor(
                    [(c.op_id, c.rank, int(c.ok), -1 if c.layer is None else c.layer) for c in completions],
                    dtype=torch.int64)
            got = self._gather(rows.to(self.device))
            for r, (t, n) in enumerate(zip(got, counts)):
                for op, rank, ok, layer in t[:n].cpu().tolist():
                    if rank != r:
                        raise ConfigError(f"rank {self.rank}: rank {r} sent a completion marked rank {rank}")
                    out.append(Completion(op, rank, bool(ok), None if layer < 0 else layer))
            st.completion_gathers += 1
            st.completions += len(out)
        dt = time.perf_counter() - t0
        st.exchange_s += dt
        if len(st.samples_us) < self.keep_samples:
            st.samples_us.append(dt * 1e6)
        return out, [_i2f(h[4]) for h in heads]

    def broadcast_float(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (one broadcast of a float64)."""
        t0 = time.perf_counter()
        t = torch.tensor([value], dtype=torch.float64).to(self.device)
        dist.broadcast(t, src=self._src, group=self.group)
        out = float(t.item())
        self.stats.broadcasts += 1
        self.stats.broadcast_s += time.perf_counter() - t0
        return out
