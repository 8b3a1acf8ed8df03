"""kvtier as SGLang's prefix cache (SGLang 0.5.23; docs/sglang.md).

:class:`KvtierRadixCache` implements SGLang's ``BasePrefixCache``
(``sglang/srt/mem_cache/base_prefix_cache.py``) and the host-tier hooks of its
``UnifiedRadixCache`` with HiCache (``init_load_back``, ``load_back``,
``ready_to_load_host_cache``, ``loading_check``, ``writing_check``, ``check_hicache_events``)
on kvtier's verified node core (:class:`~kvtier.fsm.CacheCore`): SGLang's scheduler holds it
where it holds a ``UnifiedRadixCache``. SGLang's types stay at the boundary: ``RadixKey`` in,
``MatchResult`` / ``InsertResult`` / ``EvictResult`` out, its ``Req`` objects in
:meth:`~KvtierRadixCache.checkpoint`, its token-to-KV pool indices as device pages.

Selected with ``--radix-cache-backend kvtier`` once :func:`register` ran (kvtier declares it as
an ``sglang.srt.plugins`` entry point, which SGLang's processes load at start).

Importing :mod:`kvtier` or :mod:`kvtier.adapters` imports nothing from SGLang; this module does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm import CacheCore, ConfigError, Direction, UsageError
from kvtier.fsm.lifecycle.names import DEVICE_READABLE, DEVICE_RESIDENT, NODE_STATE as NS
from kvtier.fsm.node import Node
from kvtier.fsm.node.eviction import POLICIES
from kvtier.fsm.node.ops import Settled

from .sglang_host import HiCacheHooks, host_pages_of, shadow_host_key
from .sglang_pages import (GROUP, DevicePageTable, Executor, InstantCompletions, check_token_count, kv_indices,
                           positive_int, sglang_layout)

__all__ = ["KvtierRadixCache", "register"]

#: evict()'s rounds at most (each evicts, hands out writebacks, takes completions back)
_EVICT_ROUNDS = 64

_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
#: states a publish anchor's path may be in (the core's own anchor check: readable, not loading)
_ANCHOR_STATES = DEVICE_READABLE - {NS.loading}


def register() -> None:
    """Register the ``kvtier`` radix-cache backend with SGLang's registry (idempotent):
    ``--radix-cache-backend kvtier`` then builds a :class:`KvtierRadixCache` from the
    server's ``CacheInitParams`` and its HiCache flags (``--hicache-ratio``,
    ``--hicache-size``, ``--hicache-write-policy``)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend  # type: ignore[import-untyped, import-not-found, unused-ignore]

    if get_radix_cache_factory("kvtier") is None:
        register_radix_cache_backend("kvtier", KvtierRadixCache.from_build_context)


class KvtierRadixCache(HiCacheHooks, BasePrefixCache):  # type: ignore[misc, unused-ignore]
    """SGLang prefix cache whose radix tree, host tier, writebacks and loadbacks are kvtier's.

    Args:
        params: SGLang's ``CacheInitParams`` (``token_to_kv_pool_allocator``,
            ``req_to_token_pool``, ``page_size``, ``disable``, ``eviction_policy``);
            the allocator may be ``None`` for a tree without pools (as
            ``RadixCache.create_simulated``), then ``device_pages`` sizes the tree.
        host_pages: host capacity in SGLang pages; ``None`` or 0: device only.
        write_policy: ``"write_through"`` (SGLang's default), ``"write_back"`` or
            ``"write_through_selective"`` (backs a node up on its ``write_threshold``-th hit).
        eviction: kvtier's eviction policy (``"lru"``, ``"lru_turns"``, ``"lru2"``);
            default: SGLang's ``eviction_policy`` when it is ``"lru"``.
        executor: moves the bytes of transfer commands (:class:`~kvtier.adapters.sglang_pages.Executor`);
            default metadata only (:class:`~kvtier.adapters.sglang_pages.InstantCompletions`).
        device_pages: the tree's device capacity in pages when there is no allocator.
        write_threshold: hits before ``write_through_selective`` backs a node up.
        num_layers: model layers (the loadback's layer progress).
        exclusive: an exclusive host tier (host eviction drops loaded-back duplicate
            copies first, and the passed-by host leaves that hold them: docs/sglang.md);
            ``None`` (default): on under ``write_back``, as HiCache reclaims its duplicates
            there, off otherwise.

    Raises:
        ConfigError: a bad capacity, write policy or eviction policy, a ``page_size``,
            ``num_layers``, ``device_pages`` or ``write_threshold`` that is not an int >= 1
            (a numeric string or a float is refused, not converted), ``is_eagle`` (bigram
            keys), or hybrid tree components (SWA, Mamba).
    """

    def __init__(self, params: Any, *, host_pages: int | None = None, write_policy: str = "write_through",
                 eviction: str | None = None, executor: Executor | None = None, device_pages: int = 1 << 20,
                 write_threshold: int = 2, num_layers: int = 1, exclusive: bool | None = None) -> None:
        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = positive_int("page_size", params.page_size)
        num_layers, device_pages, write_threshold = (positive_int(name, v) for name, v in (
            ("num_layers", num_layers), ("device_pages", device_pages), ("write_threshold", write_threshold)))
        if getattr(params, "is_eagle", False):
            raise ConfigError("KvtierRadixCache: is_eagle (bigram keys) is not supported")
        comps = [getattr(c, "name", str(c)) for c in (getattr(params, "tree_components", None) or ())]
        if any(c != "FULL" for c in comps):
            raise ConfigError(f"KvtierRadixCache: only the FULL tree component is supported, got {comps}")
        sglang_policy = str(getattr(params, "eviction_policy", "lru") or "lru").lower()
        if eviction is None:
            if sglang_policy != "lru":
                raise ConfigError(f"KvtierRadixCache: SGLang's eviction_policy={sglang_policy!r} has no kvtier "
                                  f"equivalent; pass eviction= one of {sorted(POLICIES)}")
            eviction = "lru"
        if eviction not in POLICIES:
            raise ConfigError(f"KvtierRadixCache: eviction must be one of {sorted(POLICIES)}, got {eviction!r}")
        if write_policy not in _WRITE_POLICIES:
            raise ConfigError(f"KvtierRadixCache: write_policy must be one of {list(_WRITE_POLICIES)}, "
                              f"got {write_policy!r}")
        if host_pages is not None and (isinstance(host_pages, bool) or not isinstance(host_pages, int)
                                       or host_pages < 0):
            raise ConfigError(f"KvtierRadixCache: host_pages must be None or an int >= 0, got {host_pages!r}")
        alloc = self.token_to_kv_pool_allocator
        dev = getattr(alloc, "device", "cpu") if alloc is not None else "cpu"
        self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        if isinstance(getattr(alloc, "size", None), int):
            device_pages = alloc.size // self.page_size + 1
        self.host_pages = host_pages or None
        self.write_policy = write_policy
        self.eviction = eviction
        self.write_threshold = write_threshold
        self.num_layers = num_layers
        self.exclusive = (write_policy == "write_back") if exclusive is None else bool(exclusive)
        self.executor: Executor = executor if executor is not None else InstantCompletions()
        # the core's device pool: the tree's pages plus one insert's own pages (SGLang's
        # allocator bounds the tree; the core never evicts on its own)
        self._capacity = 2 * device_pages
        self.kv_events = None
        self.reset()

    @classmethod
    def create_simulated(cls, disable: bool = False, mock_allocator: Any = None, page_size: int = 1,
                         enable_kv_cache_events: bool = False, **kwargs: Any) -> KvtierRadixCache:
        """A tree without pools (``RadixCache.create_simulated``'s signature): ``mock_allocator``
        (or none) gets the freed indices; ``kwargs`` go to the constructor.

        Raises:
            ConfigError: ``enable_kv_cache_events`` (kvtier emits no SGLang KV events).
        """
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

        if enable_kv_cache_events:
            raise ConfigError("KvtierRadixCache: enable_kv_cache_events is not supported (no SGLang KV events)")
        params = CacheInitParams(disable=disable, req_to_token_pool=None, token_to_kv_pool_allocator=mock_allocator,
                                 page_size=page_size)
        return cls(params, **kwargs)

    @classmethod
    def from_build_context(cls, ctx: Any) -> KvtierRadixCache:
        """The registry's factory: SGLang's ``TreeCacheBuildContext`` -> a cache sized by
        the server's HiCache flags (host = ``hicache_ratio`` x device, or ``hicache_size``
        GB at the pool's bytes per token; no host tier without either)."""
        sa, params = ctx.server_args, ctx.params
        layers = int(getattr(ctx.model_config, "num_hidden_layers", 1) or 1)
        return cls(params, host_pages=host_pages_of(sa, params.token_to_kv_pool_allocator, params.page_size),
                   write_policy=str(getattr(sa, "hicache_write_policy", "write_through")), num_layers=layers)

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the tree (a new core; SGLang's ``flush_cache``). The allocator is not touched."""
        self.core = CacheCore(sglang_layout(self.page_size, self.num_layers), {GROUP: self._capacity},
                              {GROUP: self.host_pages} if self.host_pages else None,
                              policy=self.write_policy, write_threshold=self.write_threshold, eviction=self.eviction,
                              exclusive=self.exclusive)
        self.root_node = self.core.root
        self.pages = DevicePageTable(self._capacity, self.page_size)
        self._locks: dict[int, list[Any]] = {}
        self._loads: dict[int, Any] = {}  # loadback op id -> its LoadResult (pin + lock until it settles)
        self._freed: list[np.ndarray] = []
        self._unbound: list[list[int]] = []  # core pages freed since the last _free_sglang (unbound there)
        self._last_locked: Node | None = None  # the node of the last inc_lock_ref (insert's anchor)
        self.loads_failed = 0
        self._moved = 0  # commands handed to the executor and completions taken back (evict's progress)
        if self.core.exclusive:
            shadow_host_key(self.core.eviction)
        ledger = self.core.ledger
        release = ledger.release_device

        unbound = self._unbound

        def release_device(*maps: Any) -> dict[str, int]:  # the core freeing tree pages: SGLang's are freed too
            for pm in maps:  # (their KV indices are read and unbound in one go by _free_sglang)
                ps = pm.get(GROUP)
                if ps:
                    unbound.append(ps)
            got: dict[str, int] = release(*maps)
            return got

        ledger.release_device = release_device
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    def _units(self, key: Any) -> list[Any]:
        if not isinstance(key, RadixKey):
            raise UsageError(f"KvtierRadixCache: key must be an SGLang RadixKey, got {key!r}")
        n = len(key) // self.page_size
        if n == 0:
            return []
        if self.page_size == 1 and key.extra_key is None and getattr(key, "cache_salt", None) is None:
            return list(key.token_ids[:n])
        return [key.child_key_at(i * self.page_size, self.page_size) for i in range(n)]

    def _free_sglang(self) -> int:
        """Give the SGLang pages the core freed back to SGLang's allocator; returns tokens."""
        if self._unbound:  # before any rebind of these pages (the core hands them out again only later)
            ps = [p for pages in self._unbound for p in pages]
            self._unbound.clear()
            self._freed.append(self.pages.unbind(ps))
        if not self._freed:
            return 0
        got = self._freed[0] if len(self._freed) == 1 else np.concatenate(self._freed)
        self._freed.clear()
        if got.size and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(torch.from_numpy(got).to(self.device))
        return int(got.size)

    def _pump(self, collect: bool) -> int:
        """Hand every new command to the executor (device side as SGLang indices); with
        ``collect``, deliver the completions that came back. Returns the tokens whose KV
        indices went back to SGLang's allocator."""
        core = self.core
        if core.has_host and core.writebacks:  # (tree writebacks queued)
            core.issue_writebacks()
        if core.has_commands():
            for cmd in core.poll_commands():
                self._moved += 1
                (t,) = cmd.transfers
                dev = t.src_pages if cmd.direction is Direction.WRITEBACK else t.dst_pages
                self.executor.submit(cmd, self.pages.token_indices(dev))
        if collect:
            for c in self.executor.collect():
                self._moved += 1
                for s in core.complete(c):
                    ld = self._loads.pop(s.op_id, None) if isinstance(s, Settled) else None
                    if ld is not None:
                        core.release(ld.pin)
                        core.unlock(ld.lock)
                        if not s.ok:
                            self.loads_failed += 1
                        elif self.exclusive and isinstance(s, Settled):  # the loaded nodes' host children: re-filed for host eviction
                            touch = core.eviction.touch
                            for nid in s.node_ids:  # (still in the tree: locked until just now)
                                for ch in core.node(nid).children.values():
                                    touch(ch)
        return self._free_sglang()

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest usable prefix of ``params.key``: ``device_prefix_len`` tokens on the
        device (their indices: :meth:`path_device_indices` of ``last_device_node``), then
        ``host_hit_length`` tokens on kvtier's host tier up to ``best_match_node``
        (``last_host_node`` is the same node). Page-aligned; splits a node where the key
        diverges inside it, as SGLang's tree does."""
        root = self.core.root
        units = [] if self.disable else self._units(params.key)
        if not units:
            return MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)
        m = self.core.match(units)
        ps = self.page_size
        host = (m.host_units - m.device_units) * ps if m.host_nodes else 0
        end = m.terminal if host else m.device_node
        return MatchResult(device_prefix_len=m.device_units * ps, last_device_node=m.device_node,
                           last_host_node=end, best_match_node=end, host_hit_length=host,
                           full_kv_hit_length=m.device_units * ps + host)

    def touch_prefix(self, key: Any) -> None:
        """Stamp recency along ``key``'s cached device path (a lock taken and released)."""
        if self.disable:
            return
        units = self._units(key)
        if units:
            node = self.core.match(units).device_node
            if node is not self.core.root:
                self.core.unlock(self.core.lock(node))

    def insert(self, params: InsertParams) -> InsertResult:
        """Publish ``params.value`` (the key's KV pool indices) under ``params.key``.

        ``prefix_len`` tokens were already on the device: the caller frees its copies of
        them, as with SGLang's tree; the tree owns the indices past it (indices past a node
        still loading, which kvtier does not publish, are freed here).

        Raises:
            UsageError: ``value`` shorter than the key.
        """
        if self.disable:
            return InsertResult(prefix_len=0)
        anchor = self._last_locked if params.prev_prefix_len > 0 else None
        if anchor is not None and anchor.depth * self.page_size != params.prev_prefix_len:
            anchor = None
        published, prefix_len, node, kept = self._publish(params.key, params.value, anchor)
        if kept.size:
            self._freed.append(kept)
            self._free_sglang()
        return InsertResult(prefix_len=prefix_len, total_len=published, last_device_node=node)

    def _publish(self, key: Any, value: Any, anchor: Node | None = None) -> tuple[int, int, Node, np.ndarray]:
        """(tokens published, tokens that were already there, the deepest node, the KV
        indices not published). ``anchor``: a locked device node whose path may be the
        key's prefix (the prefix the caller matched and locked); when it is, only the units
        past it take pages of the caller's and the core walks from it."""
        units = self._units(key)
        root = self.core.root
        if not units:
            return 0, 0, root, np.empty(0, dtype=np.int64)
        ps = self.page_size
        n_tok = len(units) * ps
        vals = np.asarray(key.token_ids[:n_tok], dtype=np.int64) if value is None else kv_indices(value, n_tok)
        core = self.core
        if self._unbound:  # pages the core freed: unbound before any is handed out again
            self._free_sglang()
        base: list[int] = []
        if anchor is not None and not self._anchors(anchor, units):
            anchor = None
        if anchor is not None:
            base = core.device_pages(anchor)[GROUP]
        own = core.alloc_device({GROUP: len(units) - len(base)}, evict=False)[GROUP] if len(units) > len(base) else []
        res = core.insert(units, {GROUP: base + own}, anchor=anchor)
        canon = res.pages.get(GROUP, [])
        mine = set(own)
        first = next((i for i, p in enumerate(canon) if p in mine), len(canon))
        if any(p not in mine for p in canon[first:]):
            raise AssertionError("kvtier published a device node below a node it only had on the host")
        self.pages.bind(canon[first:], vals[first * ps:len(canon) * ps])
        back = [p for pm in (res.duplicates, res.kept) for p in pm.get(GROUP, ())]
        if back:
            core.free_device({GROUP: back})
        self._pump(collect=False)
        return len(canon) * ps, first * ps, res.node, vals[len(canon) * ps:]

    def _anchors(self, anchor: Node, units: Sequence[Any]) -> bool:
        """Whether ``anchor`` (locked, in the tree, its path readable and not loading) ends
        a prefix of ``units``: the core then walks from it and takes its path's own pages."""
        if anchor.lock_ref <= 0 or anchor.depth > len(units) or not self.core.tree.has(anchor):
            return False
        k = anchor.depth
        for n in anchor.path():  # deepest first
            if n.state not in _ANCHOR_STATES or tuple(units[k - len(n.key):k]) != n.key:
                return False
            k -= len(n.key)
        return True

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert ``req``'s KV up to row position ``up_to`` (SGLang's chunked prefill, finish
        and retract call this), repoint its row onto the tree's pages, move its lock to the
        node the insert ended on and advance ``req.kv.cache_protected_len`` (SGLang's
        ``release_kv_cache`` frees the rest of the row)."""
        if self.disable:
            return
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids[:up_to]
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, : len(token_ids)]
        key = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt).page_aligned(self.page_size)
        published, prefix_len, node, _kept = self._publish(key, row)
        kv.cache_inserted_len = max(kv.cache_inserted_len, published)
        alloc = self.token_to_kv_pool_allocator
        if prefix_len > kv.cache_protected_len:  # the request's copies of what the tree had
            alloc.free_segment(row[kv.cache_protected_len:prefix_len], start_pos=kv.cache_protected_len)
        new = self.path_device_indices(node)
        if len(new) > kv.cache_protected_len:
            self.req_to_token_pool.write((kv.req_pool_idx, slice(kv.cache_protected_len, len(new))),
                                         new[kv.cache_protected_len:])
        kv.cache_protected_len = max(kv.cache_protected_len, len(new))
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    # ------------------------------------------------------------------ locks / sizes
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock ``node`` and its ancestors on the device (the root: a no-op)."""
        if self.disable or node is self.core.root:
            return IncLockRefResult(delta=0)
        if not isinstance(node, Node):
            raise UsageError(f"inc_lock_ref: node must be a node of this cache (match_prefix's), got {node!r}")
        self._locks.setdefault(node.node_id, []).append(self.core.lock(node))
        self._last_locked = node
        return IncLockRefResult(delta=0, node_id=node.node_id)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Release one lock taken on ``node`` by :meth:`inc_lock_ref`.

        Raises:
            UsageError: ``node`` holds no lock taken here (or is another cache's node).
        """
        if self.disable or node is self.core.root:
            return DecLockRefResult(delta=0)
        if not isinstance(node, Node):
            raise UsageError(f"dec_lock_ref: node must be a node of this cache (match_prefix's), got {node!r}")
        held = self._locks.get(node.node_id) if self.core.tree.has(node) else None  # (ids repeat across caches)
        if not held:
            raise UsageError(f"dec_lock_ref: node {node.node_id} holds no lock of this cache")
        self.core.unlock(held.pop())
        if not held:
            del self._locks[node.node_id]
        return DecLockRefResult(delta=0)

    def _device_nodes(self) -> Iterable[Node]:
        return (n for n in self.core.nodes() if n.parent is not None and n.state in DEVICE_RESIDENT)

    def _locked_tokens(self) -> int:
        """Device tokens on the paths of the outstanding locks (each node once): a walk of
        the locked paths only, not of the tree."""
        seen: set[int] = set()
        units = 0
        for r in self.core.receipts.locks():
            for n in r.node.path():  # deepest first: a node seen means its ancestors were
                if n.node_id in seen:
                    break
                seen.add(n.node_id)
                if n.state in DEVICE_RESIDENT:
                    units += len(n.key)
        return units * self.page_size

    def evictable_size(self) -> int:
        """Device tokens in the tree no lock holds."""
        return self.total_size() - self._locked_tokens()

    def protected_size(self) -> int:
        """Device tokens in the tree that locks hold."""
        return self._locked_tokens()

    full_evictable_size = evictable_size
    full_protected_size = protected_size

    def total_size(self) -> int:
        """Device tokens in the tree (the core's device pages in use that no caller holds)."""
        ledger = self.core.ledger
        return int(ledger.device[GROUP].used - ledger.caller_count()) * self.page_size

    def host_size(self) -> int:
        """Tokens with a host copy (kvtier's host pool pages in use x page size)."""
        host = self.core.host
        return int(host[GROUP].used) * self.page_size if host else 0

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def path_device_indices(self, node: Any) -> torch.Tensor:
        """KV pool indices from the root to ``node`` (int64, on the allocator's device)."""
        if node is self.core.root:
            return self._empty
        if not isinstance(node, Node):
            raise UsageError(f"path_device_indices: node must be a node of this cache, got {node!r}")
        idx = self.pages.token_indices(self.core.device_pages(node).get(GROUP, []))
        if idx.size and idx.min() < 0:
            raise UsageError(f"path_device_indices: node {node.node_id} is not on the device")
        return torch.from_numpy(idx).to(self.device)

    def all_values_flatten(self) -> torch.Tensor:
        vals = [self.path_device_indices(n)[-len(n.key) * self.page_size:] for n in self._device_nodes()]
        return torch.cat(vals) if vals else self._empty

    def pretty_print(self) -> None:
        def walk(n: Node, indent: int) -> None:
            for c in n.children.values():
                print(" " * indent, len(c.key) * self.page_size, c.state, f"lock={c.lock_ref}")
                walk(c, indent + 2)
        walk(self.core.root, 0)
        print(f"#tokens: {self.total_size()}")

    # ------------------------------------------------------------------ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens from unlocked leaves in kvtier's
        eviction order (a node with a host copy is demoted; under ``write_back`` a node is
        written back first, parent first, then demoted once written: the call goes on while
        the executor takes copies and hands back completions, at most ``_EVICT_ROUNDS``
        rounds). The freed indices go back to SGLang's allocator."""
        num = check_token_count(params.num_tokens)
        if self.disable or num <= 0:
            return EvictResult()
        want = -(-num // self.page_size) * self.page_size
        freed = self._pump(collect=True)  # writebacks that completed make their nodes demotable
        idle = 0
        write_back = self.write_policy == "write_back"
        for _ in range(_EVICT_ROUNDS):  # a parent is a leaf once its children went; under write_back a
            if freed >= want or idle >= 2:  # chain is written a level a round, then demoted: there a
                break  # round that frees nothing yet hands out or takes back a copy is progress
            moved = self._moved
            self.core.evict_device({GROUP: (want - freed) // self.page_size})
            got = self._free_sglang() + self._pump(collect=True)
            idle = 0 if got or (write_back and self._moved != moved) else idle + 1
            freed += got
        return EvictResult(num_tokens_evicted=freed)
