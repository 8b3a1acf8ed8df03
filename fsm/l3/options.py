"""The L3 tier's options, counters, object record and keys (see :mod:`kvtier.fsm.l3`)."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..checks import finite
from ..errors import ConfigError
from ..lifecycle.names import L3_STATE as LS

if TYPE_CHECKING:
    from ..layout import CacheLayout
    from ..node.node import NodeReceipt
    from ..records import StoreOp

__all__ = ["MAX_ERROR_KINDS", "error_kind", "L3Outstanding", "L3Op", "L3Options", "L3Stats", "L3Object", "Prefetch", "WRITE_POLICIES", "namespace", "chain_keys"]

#: L3 write policies: put a request's host-visible prefix when it is offered (``host_write``),
#: only chunks reused at least ``write_threshold`` times (``selective``), or the host tier's
#: next eviction victims before they go (``host_eviction``).
WRITE_POLICIES = ("host_write", "selective", "host_eviction")

#: Backend error kinds :attr:`L3Stats.errors` counts under their own name (the first ones to
#: occur); every later kind counts under ``other``, so the table stays bounded.
MAX_ERROR_KINDS = 32


def error_kind(errors: dict[str, int], error: str) -> str:
    """The :attr:`L3Stats.errors` entry ``error`` counts under: the text before its first ':'
    (at most 60 characters), or ``other`` once ``errors`` holds :data:`MAX_ERROR_KINDS` kinds."""
    kind = error.split(":", 1)[0][:60]
    return kind if kind in errors or len(errors) < MAX_ERROR_KINDS else "other"


@dataclass(frozen=True, slots=True)
class L3Options:
    """Opt-in options of the L3 tier.

    Attributes:
        model: model name (part of every key).
        dtype: KV dtype name (part of every key).
        tp_rank, world_size: tensor-parallel rank and size (part of every key).
        write_policy: one of :data:`WRITE_POLICIES`.
        write_threshold: reuse count a chunk needs under ``selective``.
        prefetch_units: most units one prefetch asks the store for.
        min_prefetch_units: a prefetch is skipped when fewer units lie beyond the local hit.
        deadline_s: seconds an operation may take before it fails.
        lease_s: the store's read lease after a get (0: none; Mooncake Store: 10 s by default).
        max_put_units: most objects one put carries.
        eviction_lookahead: ``host_eviction``: host victims put ahead, per offer.
        hint_size: keys remembered as recently put (to avoid putting them again; never
            taken as presence). Small on purpose: a store that evicts by LRU sees only puts
            and gets, so a prefix an instance keeps hitting locally must be put again to
            stay in the store (whole conversation trace, 4 instances, a 168 MB Redis:
            2,048 keys recovered 91.5 % of the hit rate lost to routing, 65,536 keys
            83.2 %, for 13 % more bytes written; bench/RESULTS.md, "L3 multi-instance").
    """

    model: str = "model"
    dtype: str = "bfloat16"
    tp_rank: int = 0
    world_size: int = 1
    write_policy: str = "host_write"
    write_threshold: int = 2
    prefetch_units: int = 512
    min_prefetch_units: int = 1
    deadline_s: float = 2.0
    lease_s: float = 0.0
    max_put_units: int = 1024
    eviction_lookahead: int = 64
    hint_size: int = 2048

    def check(self) -> None:
        """Raises ConfigError naming the first bad option."""
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"L3 write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        for name in ("write_threshold", "prefetch_units", "min_prefetch_units", "max_put_units", "hint_size",
                     "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"L3 {name} must be an int >= 1, got {v!r}")
        for name in ("tp_rank", "eviction_lookahead"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"L3 {name} must be an int >= 0, got {v!r}")
        if self.tp_rank >= self.world_size:
            raise ConfigError(f"L3 tp_rank {self.tp_rank} is not below world_size {self.world_size}")
        for name in ("deadline_s", "lease_s"):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not finite(v) or v < 0
                    or (name == "deadline_s" and v == 0)):  # NaN and inf: an operation that never expires
                raise ConfigError(f"L3 {name} must be a finite number of seconds (> 0 for deadline_s), got {v!r}")


@dataclass
class L3Stats:
    """Cumulative L3 counters (keys = objects = units)."""

    exists_ops: int = 0
    exists_keys: int = 0
    exists_present: int = 0
    get_ops: int = 0
    get_keys: int = 0
    get_ok: int = 0
    get_failed: int = 0  # keys not delivered: miss, error, corrupt, deadline or after a gap
    get_misses: int = 0  # keys the store no longer had after answering it had them
    get_corrupt: int = 0
    get_no_room: int = 0  # keys answered present but not fetched (no host room or taken)
    put_ops: int = 0
    put_keys: int = 0
    put_ok: int = 0
    put_failed: int = 0
    remove_ops: int = 0
    remove_keys: int = 0
    removes_deferred_by_lease: int = 0
    op_errors: int = 0  # operations the backend failed as a whole
    expired_ops: int = 0
    cancelled_prefetches: int = 0  # prefetches in flight cancelled (their requests aborted)
    absorbed_late_results: int = 0
    prefetches: int = 0
    bytes_in: int = 0  # store -> host
    bytes_out: int = 0  # host -> store
    seconds: float = 0.0  # backend seconds, all operations
    get_seconds: float = 0.0  # backend seconds of exists and gets (the prefetch path)
    errors: dict[str, int] = field(default_factory=dict)  # by kind: at most MAX_ERROR_KINDS, then "other"


def namespace(layout: CacheLayout, model: str, dtype: str, tp_rank: int, world_size: int) -> bytes:
    """The seed of every key: a hash of the model name, the layout's geometry, the dtype and
    the tensor-parallel rank and size."""
    h = hashlib.blake2b(digest_size=16)
    parts: list[object] = ["kvtier-l3/1", model, dtype, tp_rank, world_size, layout.name, layout.num_layers]
    for g in layout.groups:
        parts.append((g.name, g.family.value, g.tokens_per_page, tuple(g.layers),
                      tuple((c.name, c.page_bytes) for c in g.components)))
    h.update(repr(parts).encode())
    return h.digest()


def chain_keys(seed: bytes, units: Sequence[Hashable], start: int = 0, prev: bytes | None = None) -> list[bytes]:
    """Chained digests of ``units[start:]``: digest i hashes digest i-1 and ``repr`` of unit i
    (``prev`` is digest ``start - 1``; ``seed`` when ``start`` is 0). Unit keys must have a
    stable ``repr`` (ints, strings, bytes, tuples of them)."""
    out: list[bytes] = []
    h = seed if prev is None else prev
    for u in units[start:]:
        h = hashlib.blake2b(h + repr(u).encode(), digest_size=16).digest()
        out.append(h)
    return out


class L3Object:
    """One object (chunk) this instance is doing something with; the ``[l3]`` subject.

    Objects in ``unknown`` are not kept: the table holds only those with an operation in
    flight or a lease.
    """

    __slots__ = ("key", "state", "host_visible", "store_answered", "lease_holds", "lease_until", "op_id")

    def __init__(self, key: str) -> None:
        self.key = key
        self.state: str = LS.unknown
        self.host_visible = False
        self.store_answered = False
        self.lease_holds = False
        self.lease_until = 0.0
        self.op_id: int | None = None

    @property
    def label(self) -> str:
        return self.key[:12]


@dataclass
class Prefetch:
    """A prefetch in progress for one request: its units, where the local hit ends
    (``start``), the keys asked, the exists/get op and how many units came back."""

    owner: str
    units: tuple[Hashable, ...]
    start: int
    keys: list[str]
    op_id: int
    fetched: int = 0
    done: bool = False


@dataclass
class L3Op:
    """A store operation in flight: its kind, objects, deadline (the caller's clock), the
    prefetch owner and, for a put, the receipt of the host pages it pins."""

    op_id: int
    kind: StoreOp
    objects: list[L3Object]
    deadline: float
    owner: str | None = None
    receipt: NodeReceipt | None = None


@dataclass(frozen=True)
class L3Outstanding:
    """What an L3 tier holds or owes (:meth:`kvtier.fsm.l3.tier.L3Tier.outstanding`).

    Attributes:
        operations: op ids of the store operations in flight (exists, get, put, remove),
            sorted.
        commands: op ids of those :meth:`~kvtier.fsm.l3.tier.L3Tier.poll_commands` has not
            handed out yet.
        prefetches: owners with a prefetch in flight, sorted.
        reserved_pages: host pages reserved by gets in flight, summed over groups.
        pins: host pin receipts held by puts in flight.
        leases: objects under a read lease (they end by time, in
            :meth:`~kvtier.fsm.l3.tier.L3Tier.expire`: not part of :attr:`quiescent`).
    """

    operations: tuple[int, ...] = ()
    commands: tuple[int, ...] = ()
    prefetches: tuple[str, ...] = ()
    reserved_pages: int = 0
    pins: int = 0
    leases: int = 0

    @property
    def quiescent(self) -> bool:
        """No store operation, command, prefetch, reserved page or pin outstanding."""
        return not (self.operations or self.commands or self.prefetches or self.reserved_pages or self.pins)
