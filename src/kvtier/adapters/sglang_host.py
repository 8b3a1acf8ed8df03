"""The HiCache hooks of :class:`~kvtier.adapters.sglang.KvtierRadixCache` (SGLang 0.5.23's
``UnifiedRadixCache`` names): admission's ``init_load_back`` and ``load_back``, the per-step
``ready_to_load_host_cache``, ``loading_check``, ``writing_check`` and ``check_hicache_events``;
the host pages HiCache's flags ask for (:func:`host_pages_of`); and the exclusive host tier's
eviction key (:func:`shadow_host_key`).

SGLang's contract cannot say that a layer is ready (its ``layer_done_counter`` events are
the HiCache controller's): the loadback's layer progress stays inside kvtier's core, and a
loaded prefix is readable once :meth:`HiCacheHooks.loading_check` settled it (the scheduler
calls it before the forward pass, as with HiCache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvtier.fsm import UsageError
from kvtier.fsm.lifecycle.names import DEVICE_RESIDENT, NODE_STATE as NS
from kvtier.fsm.node import Node

from .sglang_pages import GROUP

__all__ = ["HiCacheHooks", "host_pages_of", "shadow_host_key"]


def host_pages_of(server_args: Any, alloc: Any, page_size: int) -> int | None:
    """Host pages for SGLang's HiCache flags: ``hicache_size`` GB at the device pool's bytes
    per token, else ``hicache_ratio`` x the device pool's tokens; ``None`` (no host tier)
    without either, or without an allocator."""
    dev_tokens = int(alloc.size) if alloc is not None else 0
    host_tokens = 0
    if getattr(server_args, "hicache_size", 0) and alloc is not None:
        kv = alloc.get_kvcache()
        per_token = int(kv.get_kv_size_bytes()[0] + kv.get_kv_size_bytes()[1]) // max(1, dev_tokens)
        host_tokens = int(server_args.hicache_size * 1e9) // max(1, per_token)
    elif getattr(server_args, "hicache_ratio", 0):
        host_tokens = int(dev_tokens * float(server_args.hicache_ratio))
    return host_tokens // int(page_size) or None


def shadow_host_key(index: Any) -> None:
    """With an exclusive host tier, host eviction takes, with the loaded-back duplicate
    copies, every host-only leaf hanging from one that its last use passed by (used before
    the duplicate was). kvtier's host set is prefix-closed, so a duplicate's host copy can
    go only once it has no host child; HiCache's host set is not prefix-closed and drops the
    duplicate copy alone. In a conversation such a leaf is the previous turn's last page,
    which the next turn diverged from: dropping it frees the duplicate above it too."""
    base = index.host_key
    host, resident = NS.host, DEVICE_RESIDENT

    def host_key(n: Node) -> tuple[int, ...]:
        k: tuple[int, ...] = base(n)
        p = n.parent
        if (k[0] and p is not None and p.reloaded and not n.children and n.state == host and p.state in resident
                and n.last_access < p.last_access):
            return (0,) + k[1:]
        return k

    index.host_key = host_key


class HiCacheHooks:
    """Mixed into :class:`~kvtier.adapters.sglang.KvtierRadixCache` (uses its ``core``,
    ``pages``, ``token_to_kv_pool_allocator``, ``evict``, ``_pump`` and ``_loads``)."""

    core: Any
    pages: Any
    page_size: int
    token_to_kv_pool_allocator: Any
    _loads: dict[int, Any]
    _unbound: list[Any]

    if TYPE_CHECKING:  # the cache's own
        def evict(self, params: Any) -> Any: ...

        def _pump(self, collect: bool) -> int: ...

        def _free_sglang(self) -> int: ...

    def init_load_back(self, params: Any) -> tuple[int, Any]:
        """SGLang's admission hook: load the host part of the match back and return
        (tokens loaded, the new last device node), or ``(0, req.last_node)`` when nothing was loaded."""
        req = params.req
        last = req.last_node if req is not None else self.core.root
        if params.host_hit_length > 0 and self.load_back(params.best_match_node, params.mem_quota, req=req):
            return params.host_hit_length, params.best_match_node
        return 0, last

    def load_back(self, node: Any, mem_quota: int | None = None, req: Any = None) -> bool:
        """Start loading back the host-only nodes on the path to ``node``: SGLang KV pool
        indices are allocated for them (evicting unlocked device leaves if short), the host
        copies are pinned and the path locked until the loadback settles. The command goes
        to the executor at :meth:`ready_to_load_host_cache`; it settles at :meth:`loading_check`.

        Returns:
            ``False`` (nothing changed) without a host tier, when the path needs no loadback,
            when it exceeds ``mem_quota`` tokens, or when the allocator has no room.

        Raises:
            UsageError: ``node`` is not a node (e.g. ``None``), ``mem_quota`` not None or an int.
        """
        if not isinstance(node, Node):
            raise UsageError(f"load_back: node must be a node of this cache (match_prefix's), got {node!r}")
        if mem_quota is not None and (isinstance(mem_quota, bool) or not isinstance(mem_quota, int)):
            raise UsageError(f"load_back: mem_quota must be None or an int (tokens), got {mem_quota!r}")
        core = self.core
        if not core.has_host or node is core.root or not core.tree.has(node):
            return False
        m = core.match(self._path_key(node))
        if not m.host_nodes or m.terminal is not node:
            return False
        tokens = (m.host_units - m.device_units) * self.page_size
        if mem_quota is not None and tokens > mem_quota:
            return False
        alloc = self.token_to_kv_pool_allocator
        # the eviction that makes room must keep both halves of the hit: the device part
        # (locked) and the host copies to load (pinned: under write_back, the writebacks of
        # the nodes it evicts would otherwise take host room from this very path)
        lock = core.lock(m.device_node) if m.device_node is not core.root else None
        pin = core.pin(m.host_nodes)
        try:
            if alloc.available_size() < tokens:
                self.evict(_evict_params(tokens - alloc.available_size()))
            got = alloc.alloc(tokens)
        finally:
            core.release(pin)
            if lock is not None:
                core.unlock(lock)
        if got is None:
            return False
        m = core.match(self._path_key(node))  # the eviction changed the tree: match again
        if not m.host_nodes or m.terminal is not node:
            alloc.free(got)
            return False
        if self._unbound:  # pages the core freed: unbound before any is handed out again
            self._free_sglang()
        ld = core.load(m, evict=False)
        pages = ld.device_pages[GROUP][m.device_units:]
        self.pages.bind(pages, got.to("cpu", torch.int64).numpy())
        if ld.command is None:  # joined loads already under way
            core.release(ld.pin)
            core.unlock(ld.lock)
        else:
            self._loads[ld.command.op_id] = ld
        return True

    @staticmethod
    def _path_key(node: Node) -> list[Any]:
        parts = [n.key for n in reversed(node.path())]
        return [k for part in parts for k in part]

    def ready_to_load_host_cache(self) -> int:
        """Hand the loadbacks started since the last call to the executor; returns -1 (no
        per-layer consumer index: kvtier tracks layer progress itself)."""
        self._pump(collect=False)
        return -1

    def loading_check(self, finish_count: int | None = None) -> None:
        """Deliver the completions that arrived (loadbacks settle: pins and locks released)."""
        self._pump(collect=True)

    def writing_check(self, write_back: bool = False, finish_count: int | None = None) -> None:
        """Deliver the completions that arrived (writebacks settle)."""
        self._pump(collect=True)

    def check_hicache_events(self) -> None:
        """Per scheduler step: submit queued writebacks, deliver completions, advance the
        operation deadlines' step."""
        self._pump(collect=True)
        self.core.advance_step()
        self._free_sglang()  # (operations past their deadline may have freed device pages)

    def has_pending_cache_operations(self) -> bool:
        return bool(self.core.operations()) or bool(self._loads)

    def release_host_resources(self) -> None:
        """Nothing pinned outside the executor's buffers."""


def _evict_params(tokens: int) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

    return EvictParams(num_tokens=tokens)
