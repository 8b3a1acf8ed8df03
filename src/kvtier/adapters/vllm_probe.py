"""Helpers of the vLLM kit (extras ``vllm`` and ``testing``): a probe between vLLM's
connector and a manager, vLLM's block hasher, and trace prompts.

:class:`ManagerProbe` is what :class:`~kvtier.adapters.vllm_engine.Engine` hands vLLM's
``OffloadingConnectorScheduler`` as its manager: it forwards every ``OffloadingManager``
call to the manager under test (kvtier's or vLLM's own), times it (the scheduler-side
time), and reports a store the simulated worker failed as ``complete_store(...,
success=False)`` (vLLM 0.33's connector always passes ``True``; its tiering manager
passes failures on like this).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import chain
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager  # type: ignore[import-untyped, import-not-found, unused-ignore]

__all__ = ["ManagerProbe", "SharedHasher", "block_hasher", "prompt_for"]

_HASHERS: dict[tuple[str, int], Any] = {}


def block_hasher(name: str, block_tokens: int) -> Any:
    """vLLM's request block hasher (``get_request_block_hasher``) for hash function
    ``name`` (``"sha256"``: vLLM's default), made once per (name, block size)."""
    if (name, block_tokens) not in _HASHERS:
        from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-untyped, import-not-found, unused-ignore]
        from vllm.v1.core import kv_cache_utils  # type: ignore[import-untyped, import-not-found, unused-ignore]

        fn = get_hash_fn_by_name(name)
        kv_cache_utils.init_none_hash(fn)
        _HASHERS[(name, block_tokens)] = kv_cache_utils.get_request_block_hasher(block_tokens, fn)
    return _HASHERS[(name, block_tokens)]


class ManagerProbe(OffloadingManager):  # type: ignore[misc, unused-ignore]
    """An ``OffloadingManager`` that forwards to ``inner``, timing each call.

    Attributes:
        inner: the manager under test.
        busy_s: seconds spent in ``inner``'s calls.
        calls: calls by method name.
        refused: prepare_store calls answered ``None``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.busy_s = 0.0
        self.calls: Counter[str] = Counter()
        self.refused = 0
        self._slot_key: dict[int, bytes] = {}
        self._failing: set[bytes] = set()

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return getattr(self.inner, name)(*args, **kw)
        finally:
            self.busy_s += time.perf_counter() - t
            self.calls[name] += 1

    def fail_store(self, slots: Iterable[int]) -> None:
        """The worker failed the store job writing ``slots``: its completion reports it."""
        self._failing.update(self._slot_key[s] for s in slots if s in self._slot_key)

    @property
    def lock(self) -> Any:
        return self.inner.lock

    def lookup(self, key: Any, req_context: Any) -> Any:
        return self._call("lookup", key, req_context)

    def get_load_source(self, key: Any, req_context: Any) -> Any:
        return self._call("get_load_source", key, req_context)

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        return self._call("prepare_load", keys, req_context)

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        self._call("touch", keys, req_context)

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        self._call("complete_load", keys, req_context)

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        out = self._call("prepare_store", keys, req_context)
        if out is None:
            self.refused += 1
        else:
            self._slot_key.update(zip((int(s) for s in out.store_spec.block_ids), out.keys_to_store))
        return out

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        keys = list(keys)
        failed = self._failing.intersection(keys)
        self._failing.difference_update(failed)
        self._call("complete_store", keys, req_context, success=success and not failed)

    def on_new_request(self, req_context: Any) -> Any:
        return self._call("on_new_request", req_context)

    def on_request_finished(self, req_context: Any) -> None:
        self._call("on_request_finished", req_context)

    def take_events(self) -> Any:
        return list(self._call("take_events"))

    def on_schedule_end(self, context: Any) -> None:
        self._call("on_schedule_end", context)

    def has_pending_work(self) -> bool:
        return bool(self._call("has_pending_work"))

    def reset_cache(self) -> None:
        self._slot_key.clear()
        self._failing.clear()
        self._call("reset_cache")

    def on_reset_flushed(self) -> None:
        self._call("on_reset_flushed")

    def get_stats(self) -> Any:
        return self._call("get_stats")

    def config_info(self) -> Any:
        return self._call("config_info")

    def shutdown(self) -> None:
        self._call("shutdown")


def prompt_for(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> list[int]:
    """Synthetic token ids for a Mooncake trace record: block ``h`` holds tokens
    ``h * block_tokens ...`` (equal ids give equal vLLM block hashes)."""
    sizes = [block_tokens] * (len(hash_ids) - 1) + [input_length - block_tokens * (len(hash_ids) - 1)]
    return list(chain.from_iterable(range(h * block_tokens, h * block_tokens + n) for h, n in zip(hash_ids, sizes)))


class SharedHasher:
    """vLLM's block hasher, computed once for engines that replay the same requests.

    The first engine to build request ``r`` hashes it (timed in :attr:`hash_s`); the
    other ``users - 1`` get the same hashes (block hashes depend only on the tokens).
    """

    def __init__(self, users: int, hash_name: str = "sha256", block_tokens: int = 512) -> None:
        self.inner: Callable[[Any], Any] = block_hasher(hash_name, block_tokens)
        self.users = users
        self.hash_s = 0.0
        self._memo: dict[tuple[str, int], tuple[Any, int]] = {}

    def __call__(self, req: Any) -> Any:
        key = (req.request_id, len(req.block_hashes))
        got = self._memo.pop(key, None)
        if got is None:
            t = time.perf_counter()
            hashes = self.inner(req)
            self.hash_s += time.perf_counter() - t
            got = (hashes, self.users)
        hashes, left = got
        if left > 1:
            self._memo[key] = (hashes, left - 1)
        return list(hashes)
