"""The kit's state machine for the SGLang adapter (extras ``sglang`` and ``testing``).

:class:`SglangAdapterMachine` drives :class:`~kvtier.adapters.sglang.KvtierRadixCache` on
SGLang's real pools (``ReqToTokenPool``, ``MHATokenToKVPool``, ``TokenToKVPoolAllocator``)
the way SGLang's scheduler does: requests sharing prefixes are admitted (``match_prefix``,
a loadback of their host hit through ``load_back`` / ``ready_to_load_host_cache`` /
``loading_check``, ``lock``, ``evict`` when the allocator is short, ``alloc``), run, and
finish (``insert`` of the whole prompt, the duplicates freed, ``unlock``) or abort (their own
indices freed, ``unlock``); scheduler steps deliver completions (``check_hicache_events``);
the allocator's user evicts. Transfers complete zero to three steps late and fail at the
campaign's fault rate (:class:`DelayedCompletions`).

Each example draws its write policy, page size (1 or 2 tokens) and host pool, unless the
class fixes them (:meth:`~kvtier.testing.base.KitMachine.configured`).

After every step: the core's invariants, conservation of SGLang's KV pool (free + tree-owned
+ requests' own indices = the pool, each index once), every running request's prefix
indices unchanged under its lock, and the lock accounting of SGLang's contract
(``protected_size`` is the distinct device tokens of the locked prefixes, ``evictable_size``
the rest of the tree). Each ``evict(num_tokens)`` is held to the contract's model: it frees at
least the demand rounded up to whole pages while the tree holds that much it can free without
waiting for a transfer (checked by asking again, with the completions held back, for the rest:
a call that freed less than the demand while more was free to take fails). At the end
everything drains and nothing is left: no operation, lock or pin, and evicting the whole tree
gives the allocator all its indices back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvtier.fsm import Completion, TransferCommand, UsageError
from kvtier.fsm.errors import InvariantViolation

from ..testing.machines import KitMachine, recorded
from .sglang import KvtierRadixCache

__all__ = ["DelayedCompletions", "SglangAdapterMachine"]


class DelayedCompletions:
    """An executor whose commands complete ``delay()`` collects late, failing when ``fail()``
    (each read when the command is submitted)."""

    def __init__(self, delay: Any, fail: Any) -> None:
        self.delay, self.fail = delay, fail
        self.pending: list[list[Any]] = []  # [collects left, op id, ok]
        self.held = False  # while set, collects deliver nothing and time does not pass
        self.delivered = 0  # completions delivered so far

    def submit(self, command: TransferCommand, device_indices: np.ndarray) -> None:
        self.pending.append([int(self.delay()), command.op_id, not self.fail()])

    def collect(self) -> list[Completion]:
        if self.held:
            return []
        out = [Completion(op, 0, ok) for left, op, ok in self.pending if left <= 0]
        self.delivered += len(out)
        self.pending = [[left - 1, op, ok] for left, op, ok in self.pending if left > 0]
        return out


@dataclass
class _Running:
    key: list[int]
    lock: Any
    node: Any
    prefix: list[int]  # tree indices of the matched (and loaded) prefix
    own: torch.Tensor  # the request's own indices past it


class SglangAdapterMachine(KitMachine):
    """Stateful test of the SGLang adapter on SGLang's pools (see the module docstring)."""

    kit_invariants = ("check_adapter",)
    #: fixed by the class, or ``None``: each example draws it
    write_policy: ClassVar[str | None] = None
    page_size: ClassVar[int | None] = None
    host_pages: ClassVar[int | None] = None
    pool_tokens: ClassVar[int] = 48

    def __init__(self) -> None:
        super().__init__()
        self.cache: Any = None
        self.running: dict[int, _Running] = {}
        self.next_id = 0
        self.ps = 1
        self.policy = "write_through"

    @initialize(policy=st.sampled_from(["write_through", "write_back"]), page=st.sampled_from([1, 2]),
                host=st.sampled_from([32, 6]))
    @recorded
    def setup(self, policy: str, page: int, host: int) -> None:
        """Build the cache on fresh SGLang pools (the class's fixed choices win over the draw)."""
        policy = self.write_policy or policy
        page = self.page_size or page
        host = self.host_pages or host
        self.kit_set_args(policy=policy, page=page, host=host)
        self.policy = policy
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # type: ignore[import-untyped, import-not-found, unused-ignore]
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # type: ignore[import-untyped, import-not-found, unused-ignore]
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # type: ignore[import-untyped, import-not-found, unused-ignore]

        ps, n = page, self.pool_tokens
        self.ps = ps
        kv = MHATokenToKVPool(size=n, page_size=ps, dtype=torch.float32, head_num=1, head_dim=1, layer_num=1,
                              device="cpu", enable_memory_saver=False)
        if ps == 1:
            self.alloc = TokenToKVPoolAllocator(size=n, dtype=torch.float32, device="cpu", kvcache=kv,
                                                need_sort=False)
        else:
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # type: ignore[import-untyped, import-not-found, unused-ignore]

            self.alloc = PagedTokenToKVPoolAllocator(size=n, page_size=ps, dtype=torch.float32, device="cpu",
                                                     kvcache=kv, need_sort=False)
        params = CacheInitParams(req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc, page_size=ps,
                                 disable=False)
        self.delay = 0
        self.fail_roll = 999
        self.executor = DelayedCompletions(lambda: self.delay, lambda: self.kit_fail(self.fail_roll))
        self.cache = KvtierRadixCache(params, host_pages=host, write_policy=policy, executor=self.executor)

    # ------------------------------------------------------------------ helpers
    def _key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey  # type: ignore[import-untyped, import-not-found, unused-ignore]

        return RadixKey(tokens)

    def _settle_loads(self) -> None:
        """Deliver completions until no loadback is in flight (SGLang waits for its load
        before the forward pass reads the prefix)."""
        for _ in range(8):
            if not self.cache._loads:
                return
            self.cache.loading_check()
        raise InvariantViolation("operation_ends_once", "the SGLang adapter", "a loadback never settled")

    # ------------------------------------------------------------------ rules
    @rule(family=st.integers(0, 2), shared=st.integers(0, 12), own=st.integers(1, 10), roll=st.integers(0, 999),
          delay=st.integers(0, 3))
    @recorded
    def admit(self, family: int, shared: int, own: int, roll: int, delay: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

        self.delay, self.fail_roll = delay, roll
        rid = self.next_id
        self.next_id += 1
        ps = self.ps
        tokens = [family * 1000 + i for i in range(shared)] + [100_000 + rid * 100 + i for i in range(own)]
        tokens = tokens[: len(tokens) // ps * ps]
        if not tokens:
            return
        cache = self.cache
        m = cache.match_prefix(MatchPrefixParams(key=self._key(tokens)))
        node = m.last_device_node
        if m.host_hit_length and cache.load_back(m.best_match_node):
            cache.ready_to_load_host_cache()
            self._settle_loads()
            m = cache.match_prefix(MatchPrefixParams(key=self._key(tokens)))  # a failed load recomputes
            node = m.last_device_node
        lock = cache.lock(node)
        have = m.device_prefix_len
        need = len(tokens) - have
        if self.alloc.available_size() < need:
            self._evict(need - self.alloc.available_size())
        new = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            cache.unlock(lock)
            return
        prefix = cache.path_device_indices(node).tolist()
        if len(prefix) != have:
            raise InvariantViolation("adapter_records", "the SGLang adapter",
                                     f"a match of {have} tokens has {len(prefix)} indices")
        self.running[rid] = _Running(tokens, lock, node, prefix, new)

    @rule(i=st.integers(0, 7))
    @recorded
    def finish(self, i: int) -> None:
        """The request's KV goes into the tree (``cache_finished_req``)."""
        if not self.running:
            return
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

        rid = sorted(self.running)[i % len(self.running)]
        r = self.running.pop(rid)
        value = torch.cat([torch.tensor(r.prefix, dtype=torch.int64), r.own])
        res = self.cache.insert(InsertParams(key=self._key(r.key), value=value, prev_prefix_len=len(r.prefix)))
        if res.prefix_len > len(r.prefix):
            self.alloc.free(value[len(r.prefix):res.prefix_len])
        self.cache.unlock(r.lock)

    @rule(i=st.integers(0, 7))
    @recorded
    def abort(self, i: int) -> None:
        """The request ends without inserting: its own indices are freed."""
        if not self.running:
            return
        rid = sorted(self.running)[i % len(self.running)]
        r = self.running.pop(rid)
        if len(r.own):
            self.alloc.free(r.own)
        self.cache.unlock(r.lock)

    @rule(steps=st.integers(1, 3))
    @recorded
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.cache.check_hicache_events()

    @rule(tokens=st.integers(1, 24))
    @recorded
    def evict(self, tokens: int) -> None:
        self._evict(tokens)

    def _evict(self, tokens: int) -> int:
        """``evict(num_tokens=tokens)`` held to SGLang's contract: the allocator gets exactly
        what it reports, and it frees at least ``tokens`` rounded up to whole pages unless
        nothing more could be freed without waiting for a transfer. Where no completion was
        delivered during the call (so the tree it left is the tree it saw), asking again for
        the rest with the completions held back must free nothing."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

        before, delivered = self.alloc.available_size(), self.executor.delivered
        got = int(self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted)
        if self.alloc.available_size() != before + got:
            raise InvariantViolation("conservation", "the SGLang adapter",
                                     f"evict reported {got} tokens, the allocator got {self.alloc.available_size() - before}")
        want = -(-tokens // self.ps) * self.ps
        # under write_back an evict starts writebacks that a second call may already demote:
        # the model holds write_through's evicts only
        if got < want and self.executor.delivered == delivered and self.policy == "write_through":
            self.executor.held = True
            try:
                more = int(self.cache.evict(EvictParams(num_tokens=want - got)).num_tokens_evicted)
            finally:
                self.executor.held = False
            if more:
                raise InvariantViolation("evict_frees_the_demand", "the SGLang adapter",
                                         f"evict(num_tokens={tokens}) with pages of {self.ps} tokens freed {got} of "
                                         f"the {want} it owed, yet asking again for the rest freed {more} more "
                                         "with no transfer completed between")
            got += more
        return got

    # ------------------------------------------------------------------ checks
    def check_adapter(self) -> None:
        cache = self.cache
        if cache is None:
            return
        cache.core.check_invariants()
        tree = [cache.path_device_indices(n)[-len(n.key) * self.ps:] for n in cache._device_nodes()]
        held = [torch.as_tensor(x, dtype=torch.int64) for x in tree] + [r.own for r in self.running.values()]
        used = torch.cat(held).tolist() if held else []
        if len(used) != len(set(used)) or len(used) + self.alloc.available_size() != self.pool_tokens:
            raise InvariantViolation("conservation", "the SGLang adapter",
                                     f"{len(used)} indices held ({len(set(used))} distinct), "
                                     f"{self.alloc.available_size()} free, pool of {self.pool_tokens}")
        for r in self.running.values():
            try:
                now = cache.path_device_indices(r.node).tolist()
            except UsageError as e:
                raise InvariantViolation("borrowed_pages_stay", "the SGLang adapter", str(e)) from None
            if now != r.prefix:
                raise InvariantViolation("borrowed_pages_stay", "the SGLang adapter",
                                         f"a locked prefix's indices changed: {r.prefix} -> {now}")
        # SGLang's lock accounting: the locked prefixes' distinct device tokens are protected
        locked = len({i for r in self.running.values() for i in r.prefix})
        total = len(set(used)) - sum(len(r.own) for r in self.running.values())
        if cache.protected_size() != locked or cache.evictable_size() != total - locked \
                or cache.total_size() != total:
            raise InvariantViolation("adapter_records", "the SGLang adapter",
                                     f"sizes protected {cache.protected_size()}, evictable {cache.evictable_size()}, "
                                     f"total {cache.total_size()}; the running requests lock {locked} distinct "
                                     f"device tokens of the tree's {total}")

    def teardown(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # type: ignore[import-untyped, import-not-found, unused-ignore]

        if self.cache is None:
            super().teardown()
            return
        self.fail_roll, self.delay = 999, 0
        self.executor.fail = lambda: False
        for i in range(len(self.running)):
            self.abort(i=0)
        for _ in range(6):
            self.cache.check_hicache_events()
        cache = self.cache
        if cache.has_pending_cache_operations() or self.executor.pending:
            raise InvariantViolation("drained", "the SGLang adapter", "operations left after draining")
        if any(n.lock_ref or n.host_pin or n.borrow_ref for n in cache.core.nodes()) or cache._locks \
                or cache.protected_size():
            raise InvariantViolation("drained", "the SGLang adapter", "a lock or pin left after draining "
                                     f"(inc_lock_ref / dec_lock_ref unbalanced: {len(cache._locks)} nodes hold locks)")
        cache.evict(EvictParams(num_tokens=self.pool_tokens))
        if self.alloc.available_size() != self.pool_tokens:
            raise InvariantViolation("drained", "the SGLang adapter",
                                     f"{self.pool_tokens - self.alloc.available_size()} KV indices not given back")
        cache.core.check_invariants()
        super().teardown()
