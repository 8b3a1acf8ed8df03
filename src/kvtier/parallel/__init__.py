"""Rank-parallel mode: one kvtier core per tensor-parallel rank, in separate processes,
taking the same decisions (issue 21).

Each rank process runs the facade (:class:`RankCache`, a
:class:`~kvtier.tiered.TieredCache` with a decision digest) and its own
:class:`~kvtier.transfer.TransferEngine` over its own pools (its shard of the KV heads,
:func:`shard_layout`). Once per scheduler step (at the executor's ``collect``:
:class:`RankExecutor`) the ranks exchange their completions and digests
(:class:`StepSync`: ``torch.distributed``, gloo on the CPU, NCCL on GPUs): every core gets
every rank's completions, an operation succeeds only if it succeeded on every rank, and a
digest mismatch raises :class:`RankDivergence` naming the first step where the ranks'
decisions differ. ``docs/parallel.md`` says why the same scheduler runs
on every rank and how a single driving scheduler fits the same parts.

:func:`launch` starts rank processes; :func:`run_rank` replays requests on one rank;
:mod:`kvtier.parallel.tp` shards the paged Llama's heads and MLP across ranks.
"""

from __future__ import annotations

from .cache import RankCache
from .digest import DecisionDigest
from .launch import RankError, RankFailed, launch
from .rank import AgreedClock, RankExecutor, check_drained, drain_report, shard_layout
from .replay import RankJob, fresh, reference_run, run_jobs, run_rank
from .sync import RankDivergence, StepSync, SyncStats

__all__ = ["RankCache", "DecisionDigest", "StepSync", "SyncStats", "RankDivergence", "RankExecutor", "AgreedClock",
           "shard_layout", "drain_report", "check_drained", "launch", "RankError", "RankFailed", "RankJob", "run_rank", "run_jobs",
           "reference_run", "fresh"]
