"""One rank of the rank-parallel mode: its executor wrapper, the agreed clock, injected
failures, the KV-head shard of a layout, and the drain check.

The same scheduler runs on every rank (see ``docs/parallel.md``): each
rank process owns a :class:`~kvtier.parallel.cache.RankCache` (its core), a local
executor with its own :class:`~kvtier.transfer.TransferEngine` over its own pools, and
a :class:`RankExecutor` around that executor whose ``collect`` is the step's collective.
The scheduler's inputs that could differ between processes are made equal: the
completions (every rank gets every rank's, at the same exchange) and, with a measured
clock, the time (:class:`AgreedClock`: rank 0's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvtier.fsm import Completion, ComponentSpec, ConfigError, InvariantViolation, TransferCommand
from kvtier.fsm.layout import CacheLayout

from ..scheduler import Clock, Executor
from ..tiered import Admission, TieredCache
from .cache import RankCache
from .sync import StepSync

__all__ = ["RankExecutor", "AgreedClock", "shard_layout", "drain_report", "check_drained"]


def shard_layout(layout: CacheLayout, world_size: int) -> CacheLayout:
    """The layout of one rank's shard: every component's page bytes divided by
    ``world_size`` (the rank holds ``1 / world_size`` of the KV heads; page counts,
    tokens per page and layers are unchanged).

    Raises:
        ConfigError: ``world_size`` not an int >= 1, or a component's page bytes not a
            multiple of ``world_size`` (its heads do not split evenly).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")

    def shard(c: ComponentSpec, group: str) -> ComponentSpec:
        if c.page_bytes % world_size:
            raise ConfigError(f"layout {layout.name!r}: {group}/{c.name} has {c.page_bytes} bytes per page, "
                              f"not a multiple of world_size {world_size}")
        return ComponentSpec(c.name, c.page_bytes // world_size)

    groups = tuple(replace(g, components=tuple(shard(c, g.name) for c in g.components)) for g in layout.groups)
    return replace(layout, groups=groups)


class RankExecutor:
    """The scheduler's executor on one rank: a local executor (world size 1: its
    completions carry rank 0 or this rank) whose ``collect`` runs the step's collective.

    Args:
        local: the rank's own executor (:class:`~kvtier.scheduler.InstantExecutor`,
            :class:`~kvtier.replay.fingerprint.BytesExecutor`, :class:`~kvtier.model.ModelExecutor`).
        sync: the rank's :class:`StepSync`.
        cache: the rank's :class:`RankCache` (its digest goes into every exchange).
        fail_ops: op ids whose completions this rank reports as failed (injected
            failures; the transfer may well have succeeded).
        step: returns the scheduler's step (named in a divergence).

    Attributes:
        injected: op ids this rank actually reported as failed.
    """

    def __init__(self, local: Executor, sync: StepSync, cache: RankCache, *, fail_ops: Sequence[int] = (),
                 step: Callable[[], int] | None = None) -> None:
        self.local = local
        self.sync = sync
        self.cache = cache
        self.rank = sync.rank
        self.fail_ops = frozenset(int(o) for o in fail_ops)
        self.injected: set[int] = set()
        self.step = step

    def submit(self, commands: Sequence[TransferCommand]) -> None:
        self.local.submit(commands)

    def collect(self) -> list[Completion]:
        mine = []
        for c in self.local.collect():
            if c.rank not in (0, self.rank):
                raise ConfigError(f"rank {self.rank}: the local executor reported rank {c.rank} (world size 1 "
                                  f"engines report 0 or this rank)")
            ok = c.ok
            if c.op_id in self.fail_ops:
                ok = False
                self.injected.add(c.op_id)
            mine.append(Completion(c.op_id, self.rank, ok, c.layer))
        out, _ = self.sync.exchange(self.cache.digest.value(), mine, step=self.step() if self.step else 0)
        return out

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        self.local.forward(cache, batch)

    def transfer_seconds(self) -> float:
        return self.local.transfer_seconds()

    def admitted(self, cache: TieredCache, adm: Admission) -> None:
        self.local.admitted(cache, adm)

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]], tokens: int) -> None:
        self.local.checkpointed(cache, request_id, pages, tokens)


class AgreedClock:
    """A measured clock every rank reads alike: :meth:`now` is rank 0's time (one
    broadcast per call), so arrivals are admitted at the same step on every rank.

    Args:
        local: this rank's clock (e.g. :class:`kvtier.model.WallClock`).
        sync: the rank's :class:`StepSync`.
    """

    def __init__(self, local: Clock, sync: StepSync) -> None:
        self.local = local
        self.sync = sync

    def now(self) -> float:
        return self.sync.broadcast_float(self.local.now())

    def skip_to(self, t: float) -> None:
        self.local.skip_to(t)


def drain_report(cache: TieredCache) -> dict[str, Any]:
    """What a drained cache still holds: requests, operations, forward results owed,
    caller pages, receipts (locks and pins), and device/host pages beyond the tree's own.

    Returns:
        A dict of counts; every value is 0 when nothing leaked (``tree_*_pages`` and
        ``*_used`` excepted: those are the tree's own, and must be equal).
    """
    core = cache.core
    tree_dev = {g: 0 for g in core.device}
    tree_host = {g: 0 for g in (core.host or {})}
    for n in core.tree:
        for pm, acc in ((n.dev, tree_dev), (n.dev_ckpt, tree_dev), (n.host, tree_host), (n.host_ckpt, tree_host)):
            for g, pages in pm.items():
                acc[g] += len(pages)
    dev_used = {g: a.used for g, a in core.device.items()}
    host_used = {g: a.used for g, a in (core.host or {}).items()}
    return {
        "requests": len(list(cache.table)), "ops_in_flight": len(core.optable), "owes_forward": int(cache.in_flight()),
        "caller_pages": core.ledger.caller_count(), "receipts": len(core.receipts),
        "device_leaked_pages": sum(dev_used[g] - tree_dev[g] for g in dev_used),
        "host_leaked_pages": sum(host_used[g] - tree_host.get(g, 0) for g in host_used),
        "device_used": sum(dev_used.values()), "host_used": sum(host_used.values()),
        "tree_device_pages": sum(tree_dev.values()), "tree_host_pages": sum(tree_host.values()),
        "tree_nodes": len(core.tree),
    }


def check_drained(cache: TieredCache) -> dict[str, Any]:
    """Raise unless the drained cache holds nothing beyond its tree; returns
    :func:`drain_report`.

    Raises:
        InvariantViolation: something is still held (the message lists what), or the
            core's or requests' invariants fail.
    """
    cache.check_invariants()
    rep = drain_report(cache)
    bad = {k: v for k, v in rep.items() if v and k not in ("device_used", "host_used", "tree_device_pages",
                                                            "tree_host_pages", "tree_nodes")}
    if bad:
        raise InvariantViolation("drained", "the cache", f"still held after draining: {bad}")
    return rep
