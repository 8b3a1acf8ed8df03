"""What kvtier's vLLM manager keeps per request and per transfer, the checks of its
arguments, the chain order of full-attention chunks and vLLM's store threshold (extra
``kvtier[vllm]``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm import ConfigError, KvtierError, UsageError
from kvtier.fsm.node import LockReceipt, NodeReceipt

__all__ = ["ChainOrder", "Coord", "LoadRecord", "OfferCounter", "RequestRecord", "StoreRecord", "check_ctx",
           "check_manager_args",
           "check_key", "check_keys", "check_records", "short_hex"]

#: a full-attention chunk's place in its request: (end token position, KV cache group)
Coord = tuple[int, int]


@dataclass
class StoreRecord:
    """One prepare_store call's writeback operations (one store job on vLLM's side)."""

    keys: frozenset[bytes]
    op_ids: list[int]
    req_id: str


@dataclass
class LoadRecord:
    """One prepare_load call: the pin on the host sources and the locks (recency)."""

    keys: frozenset[bytes]
    pin: NodeReceipt | None
    locks: list[LockReceipt]


@dataclass
class RequestRecord:
    """What the manager keeps per request (dropped once finished and drained)."""

    req_id: str
    seq: dict[Coord, bytes] = field(default_factory=dict)  # chain position -> key
    coord: dict[bytes, Coord] = field(default_factory=dict)  # key -> chain position
    stores: list[StoreRecord] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    finished: bool = False
    rank: int = 0  # own-use order: the request's rank (0: none yet; kvtier.adapters.vllm_recency)
    used: dict[int, Any] = field(default_factory=dict)  # own-use order: node id -> node it used


def short_hex(key: object) -> str:
    """A key for messages: its first 8 bytes in hex."""
    return f"{key.hex()[:16]}.." if isinstance(key, bytes) else repr(key)[:60]


def check_key(key: object, what: str) -> bytes:
    """``key`` if it is a vLLM OffloadKey (bytes: block hash + 4-byte group index).

    Raises:
        UsageError: anything else (naming the value).
    """
    if not isinstance(key, bytes) or len(key) < 4:
        raise UsageError(f"{what}: a key must be a vLLM OffloadKey (bytes: block hash + 4-byte group index), "
                         f"got {type(key).__name__} {key!r:.60}")
    return key


def check_keys(keys: object, what: str, *, unique: bool) -> list[bytes]:
    """``keys`` as a list of OffloadKeys.

    Raises:
        UsageError: not a collection of keys, a bad key, or (``unique``) a key listed twice.
    """
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Iterable):
        raise UsageError(f"{what}: keys must be a collection of vLLM OffloadKeys, got {type(keys).__name__} "
                         f"{keys!r:.60}")
    out = list(keys)
    if out and (set(map(type, out)) != {bytes} or min(map(len, out)) < 4):  # (C loops; the slow path names the key)
        for k in out:
            check_key(k, what)  # (a bytes subclass passes; anything else raises)
    if unique and len(set(out)) != len(out):
        seen: set[bytes] = set()
        for k in out:
            if k in seen:
                raise UsageError(f"{what}: key {short_hex(k)} is listed twice")
            seen.add(k)
    return out


def check_ctx(ctx: object, what: str) -> ReqContext:
    """``ctx`` if it is a vLLM ReqContext. Raises UsageError otherwise."""
    if not isinstance(ctx, ReqContext):
        raise UsageError(f"{what}: req_context must be a vLLM ReqContext, got {type(ctx).__name__} {ctx!r:.60}")
    return ctx


class ChainOrder:
    """The order in which a request's full-attention chunks chain: by token position, and
    at one position by KV cache group (chunk ``i`` of every group before chunk ``i + 1``),
    so one radix path holds all the groups' chunks of a prefix, tails deepest.

    Args:
        tokens_per_chunk: full-attention group id -> tokens per offload chunk.
    """

    def __init__(self, tokens_per_chunk: Mapping[int, int]) -> None:
        self.groups = sorted(tokens_per_chunk.items())
        self.tokens = dict(self.groups)
        #: a key's last 4 bytes (its group index, big-endian) -> (group, tokens per chunk)
        self._by_suffix = {g.to_bytes(4, "big"): (g, t) for g, t in self.groups if 0 <= g < 1 << 32}
        self._single = self.groups[0] if len(self.groups) == 1 else None

    def coord(self, key: bytes, ctx: ReqContext, st: RequestRecord) -> Coord | None:
        """``key``'s place in the request's chain (recorded in ``st``), or None: another
        group, or no whole-chunk position known for it."""
        c = st.coord.get(key)
        if c is not None:
            return c
        gt = self._by_suffix.get(key[-4:])
        if gt is None:
            return None
        g, t = gt
        pos = ctx.get_offload_key_position(key)  # type: ignore[arg-type, unused-ignore]  # (a NewType of bytes)
        if pos is None or pos <= 0 or pos % t:
            return None
        c = st.coord[key] = (int(pos), g)
        st.seq[c] = key
        return c

    def pred(self, c: Coord, st: RequestRecord) -> Coord | None:
        """The chain position before ``c`` among those the request has shown (its
        lookups, loads and stores): the nearest earlier chunk of each group, latest
        first. None: ``c`` is the first chunk the request has of its prefix."""
        pos, g = c
        if self._single is not None:  # one full-attention group: the chunk before
            before = (pos - self._single[1], g)
            return before if before in st.seq else None
        near = []
        for g2, t2 in self.groups:
            p2 = pos - pos % t2 if g2 < g else (pos - 1) - (pos - 1) % t2
            if p2 > 0:
                near.append((p2, g2))
        for cand in sorted(near, reverse=True):
            if cand in st.seq:
                return cand
        return None

    def follows(self, c: Coord, before: Coord, st: RequestRecord) -> bool:
        """Whether chain position ``c`` comes right after ``before`` in the request."""
        if self._single is not None:
            return c[1] == before[1] and c[0] == before[0] + self._single[1]
        return self.pred(c, st) == before

    def tail_first(self, keys: list[bytes], ctx: ReqContext, st: RequestRecord) -> list[bytes]:
        """``keys`` in the order their recency is stamped: chained chunks deepest first,
        then keys without a position in reverse offer order (the first offered, taken
        as the head, ends up the most recent)."""
        coords = [self.coord(k, ctx, st) for k in keys]
        chained = sorted((c, k) for c, k in zip(coords, keys) if c is not None)
        flat = [k for c, k in zip(coords, keys) if c is None]
        return [k for _, k in reversed(chained)] + flat[::-1]


class OfferCounter:
    """vLLM's ``store_threshold``: offers counted per key in a least-recently-offered
    table of ``max_size`` keys (``CPUOffloadingManager._record_accesses``)."""

    def __init__(self, threshold: int, max_size: int) -> None:
        self.threshold = threshold
        self.max_size = max_size
        self.counts: OrderedDict[bytes, int] = OrderedDict()

    def offer(self, keys: list[bytes]) -> set[bytes]:
        """Count one offer of ``keys``; returns those offered at least ``threshold`` times."""
        counts = self.counts
        seen = [k for k in keys if k in counts]
        for k in seen:
            counts.move_to_end(k)
            counts[k] += 1
        unprotected = len(counts) - len(seen)
        for k in keys:
            if k in counts:
                continue
            if len(counts) >= self.max_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[k] = 1
        return {k for k in keys if counts.get(k, 0) >= self.threshold}


def check_records(core: Any, reqs: Iterable[RequestRecord], pending: Mapping[bytes, StoreRecord]) -> None:
    """The core's invariants, then the manager's records against it: every store in
    flight names live ``writing`` operations and is indexed by its keys, every load holds
    a live pin, every staged node holds a host copy or is being written, and (own-use
    order) every chunk on the host is filed in the eviction order's heap.

    Raises:
        InvariantViolation: from the core.
        KvtierError: a record disagrees with the core.
    """
    core.check_invariants()
    ops = core.operations()
    indexed = 0
    for r in reqs:
        for s in r.stores:
            missing = [o for o in s.op_ids if o not in ops]
            if missing:
                raise KvtierError(f"request {r.req_id!r}: store ops {missing} are not in flight")
            if any(pending.get(k) is not s for k in s.keys):
                raise KvtierError(f"request {r.req_id!r}: a store's keys are not indexed as in flight")
            indexed += len(s.keys)
        for ld in r.loads:
            if (ld.pin is not None and ld.pin.released) or any(lk.released for lk in ld.locks):
                raise KvtierError(f"request {r.req_id!r}: a load's pin or lock was released early")
    if indexed != len(pending):
        raise KvtierError(f"{len(pending)} keys indexed as being stored, {indexed} in the stores in flight")
    orphans = [n.node_id for n in core.nodes() if n.state == "device"]
    if orphans:
        raise KvtierError(f"nodes {orphans[:8]} hold only a staging copy (no host copy, no writeback)")
    check = getattr(core.eviction, "check", None)
    if check is not None:
        check()


def check_manager_args(num_chunks: Any, tokens_per_chunk: Any, sliding_window_groups: Any, enable_events: Any,
                       staging_chunks: Any, store_threshold: Any, max_tracker_size: Any, chain: Any) -> None:
    """Check :class:`~kvtier.adapters.vllm_manager.KvtierOffloadingManager`'s arguments.

    Raises:
        ConfigError: one of wrong type or value (the message names it, its value and what is expected).
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 0:
        raise ConfigError(f"num_chunks must be an int >= 0 (host offload chunks), got {num_chunks!r}")
    if tokens_per_chunk is not None and not isinstance(tokens_per_chunk, Mapping):
        raise ConfigError(f"tokens_per_chunk must be a mapping of group id to tokens, got {tokens_per_chunk!r}")
    if isinstance(sliding_window_groups, (str, bytes)) or not isinstance(sliding_window_groups, Collection) \
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in sliding_window_groups):
        raise ConfigError(f"sliding_window_groups must be a collection of int group ids, got {sliding_window_groups!r}")
    for name, flag in (("enable_events", enable_events), ("chain", chain)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be a bool, got {flag!r}")
    if staging_chunks is not None and (isinstance(staging_chunks, bool) or not isinstance(staging_chunks, int)
                                       or staging_chunks < 0):
        raise ConfigError(f"staging_chunks must be None or an int >= 0, got {staging_chunks!r}")
    for g, t in dict(tokens_per_chunk or {}).items():
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ConfigError(f"tokens_per_chunk[{g!r}] must be an int >= 1, got {t!r}")
    for name, v in (("store_threshold", store_threshold), ("max_tracker_size", max_tracker_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
