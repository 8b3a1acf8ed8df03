"""Records the core returns from :meth:`~kvtier.fsm.node.core.CacheCore.insert` and
:meth:`~kvtier.fsm.node.core.CacheCore.load`, and its cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from .node import LockReceipt, Node, NodeReceipt, PageMap
from ..records import TransferCommand

__all__ = ["InsertResult", "LoadResult", "CacheStats"]


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`~kvtier.fsm.node.core.CacheCore.insert` published.

    Attributes:
        node: deepest node now holding the published prefix (the root if nothing).
        published_units: units of the key now in the tree (device-readable).
        pages: history group -> the canonical device page ids of the published range
            (the caller's page table for it from now on).
        duplicates: group -> the caller's pages that duplicated canonical ones; the
            caller frees them (:meth:`~kvtier.fsm.node.core.CacheCore.free_device`).
        kept: group -> the caller's pages that were not published (beyond a node that is
            loading); they stay the caller's.
        created: nodes created by this insert.
    """

    node: Node
    published_units: int
    pages: PageMap
    duplicates: PageMap
    kept: PageMap
    created: tuple[Node, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A loadback started (or joined) by :meth:`~kvtier.fsm.node.core.CacheCore.load`.

    Attributes:
        command: the loadback to submit, or ``None`` when it only joined others.
        op_ids: every operation the caller must wait for (its own and joined ones).
        pin: the caller's pin receipt on the host copies (release it after the ack).
        lock: the caller's lock receipt on the loaded path (release it when done).
        device_pages: history group -> device page ids of the whole hit (device + loaded).
        extra: group -> the caller's own pages reserved with the loadback (``extra``).
    """

    command: TransferCommand | None
    op_ids: tuple[int, ...]
    pin: NodeReceipt
    lock: LockReceipt
    device_pages: PageMap
    extra: PageMap = field(default_factory=dict)


@dataclass
class CacheStats:
    """Cumulative counters (pages are summed over groups)."""

    demotions: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    host_drops: int = 0
    writebacks: int = 0
    writeback_failures: int = 0
    loadbacks: int = 0
    loadback_failures: int = 0
    joined_loadbacks: int = 0
    expired_ops: int = 0
    absorbed_late_completions: int = 0
    withdrawn_ops: int = 0  # operations taken back before their command was handed out
    fences_released: int = 0  # expired operations whose copy every rank confirmed ended (copy_fence)
    pages_written: int = 0
    pages_loaded: int = 0
    splits: int = 0
    triggers: int = 0
    fetches: int = 0  # L3 gets that reserved host pages (kvtier.fsm.node.fetch)
    fetched_units: int = 0  # units an L3 get made visible on the host
    fetch_failed_units: int = 0  # units whose L3 get failed, missed or expired
    extra: dict[str, int] = field(default_factory=dict)
