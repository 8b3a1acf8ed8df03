"""Trace replay through vLLM 0.33's real offloading connector (extras ``vllm`` and
``testing``), for ``bench/vllm_replay.py``.

:class:`Replayer` runs Mooncake trace records one request at a time, prompt only, instant
transfers, through an :class:`~kvtier.adapters.vllm_engine.Engine` (vLLM's
``OffloadingConnectorScheduler``, ``KVCacheManager``, ``Request`` and block hasher) whose
manager is the one ``kv_connector_extra_config`` configures: kvtier's
(:func:`~kvtier.adapters.vllm_config.kvtier_extra_config`) or vLLM's own CPU manager
(:func:`~kvtier.adapters.vllm_engine.cpu_extra_config`, ``eviction_policy`` ``lru`` or
``arc``). The scheduler-side time is the time spent in the manager's calls
(:class:`~kvtier.adapters.vllm_probe.ManagerProbe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .vllm_engine import Engine, cpu_extra_config
from .vllm_probe import SharedHasher, prompt_for

__all__ = ["Replayer", "SharedHasher", "cpu_extra_config", "prompt_for", "replay"]


class Replayer:
    """One manager's replay of trace records (``hash_ids``, ``input_length``), one
    request at a time: :meth:`step` runs one record to the end (its stores acknowledged),
    :meth:`result` sums up.

    Args:
        extra_config: ``kv_connector_extra_config`` choosing the manager.
        device_blocks: GPU blocks of vLLM's ``KVCacheManager``.
        block_tokens: tokens per block (= per offload chunk).
        hasher: vLLM's block hasher to share with other replayers of the same records.
    """

    def __init__(self, extra_config: dict[str, Any], device_blocks: int, block_tokens: int = 512,
                 hasher: Callable[[Any], Any] | None = None) -> None:
        self.engine = Engine(extra_config, device_blocks, block_tokens, max_model_len=block_tokens * 1024,
                             hasher=hasher)
        self.block_tokens = block_tokens
        self.total = self.dev = self.host = self.n = 0

    def step(self, rid: str, rec: Any) -> None:
        r = self.engine.add(rid, prompt_for(rec.hash_ids, rec.input_length, self.block_tokens))
        self.engine.drain()
        self.total += rec.input_length
        self.n += 1
        self.dev += max(0, r.local)
        self.host += r.external

    def result(self) -> dict[str, Any]:
        e, n, total = self.engine, max(1, self.n), max(1, self.total)
        return {
            "requests": self.n, "prompt_tokens": self.total, "device_hit": self.dev / total,
            "host_hit": self.host / total, "total_hit": (self.dev + self.host) / total,
            "manager_us": e.probe.busy_s / n * 1e6, "kvm_us": e.kvm_s / n * 1e6,
            "manager_calls": dict(e.probe.calls), "refused_stores": e.probe.refused,
        }


def replay(records: Iterable[Any], extra_config: dict[str, Any], device_blocks: int, block_tokens: int = 512,
           progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Replay trace records through one :class:`Replayer`; returns its :meth:`Replayer.result`
    (``device_hit`` / ``host_hit`` / ``total_hit``: fractions of prompt tokens;
    ``manager_us`` / ``kvm_us``: per request)."""
    rp = Replayer(extra_config, device_blocks, block_tokens)
    for i, rec in enumerate(records):
        rp.step(str(i), rec)
        if progress is not None:
            progress(i)
    return rp.result()
