"""kvtier as vLLM's KV offloading tier (vLLM 0.33, extra ``kvtier[vllm]``).

vLLM's ``OffloadingConnector`` loads an out-of-tree ``OffloadingSpec`` named in
``kv_connector_extra_config``: ``spec_name`` ``KvtierOffloadingSpec``, ``spec_module_path``
``kvtier.adapters.vllm`` (this module; ``docs/vllm.md`` gives the ``vllm serve`` flags).

- :class:`KvtierOffloadingSpec`: the spec (``get_manager`` for the scheduler,
  ``get_worker`` for each worker, ``build_metric_definitions`` for ``vllm serve``'s
  Prometheus metrics).
- :class:`~kvtier.adapters.vllm_manager.KvtierOffloadingManager`: the scheduler side. Its
  host-tier bookkeeping is kvtier's verified core (:mod:`kvtier.adapters.vllm_chunks`): a
  radix tree of offload chunks whose every residency change is a lifecycle transition.
- :class:`~kvtier.adapters.vllm_worker.KvtierOffloadingWorker`: the worker side (kvtier's
  ``TransferEngine``).

Keys: vLLM's ``OffloadKey`` (block hash + group index; hash-chained, so a key names its
whole prefix) is the unit key of the tree; one unit = one offload chunk of one KV cache
group. Host capacity is counted in keys of one group each (vLLM #56871).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm import ConfigError
from kvtier.fsm.node.eviction import POLICIES

from .vllm_chunks import GROUP, chunk_layout
from .vllm_manager import KvtierOffloadingManager
from .vllm_stats import CONFIG_INFO_KEYS, metric_definitions
from .vllm_worker import KvtierOffloadingWorker

__all__ = [
    "GROUP",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "MAX_EXTRA_INT",
    "chunk_layout",
]


MAX_EXTRA_INT = 1 << 53
"""Largest number a ``kv_connector_extra_config`` key takes (2**53, the largest integer a JSON
number holds exactly; 8 PiB as ``cpu_bytes_to_use``)."""

_DIGITS = re.compile(r"\s*\+?[0-9]+\s*")


def _int(extra: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    """``extra[key]`` (or ``default``) as an int in ``minimum .. MAX_EXTRA_INT``. As vLLM's CPU
    spec reads its keys with ``int()``, a string of digits and an integral float (``1e10``, as JSON
    from the command line gives) are accepted; a bool, NaN, inf, a fraction or other text is not."""
    value = extra.get(key, default)
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and len(value) <= 40 and _DIGITS.fullmatch(value):
        number = int(value)
    if number is None or not minimum <= number <= MAX_EXTRA_INT:
        raise ConfigError(f"kvtier: kv_connector_extra_config[{key!r}] must be an integer in {minimum} .. "
                          f"{MAX_EXTRA_INT} (an int, a string of digits or an integral float), got {value!r}")
    return number


class KvtierOffloadingSpec(OffloadingSpec):  # type: ignore[misc, unused-ignore]
    """The spec vLLM instantiates from ``kv_connector_extra_config``.

    Extra config keys:
        ``cpu_bytes_to_use`` (int, bytes): host budget. Capacity in chunks = budget //
            (bytes of one chunk of one KV cache group x workers); vLLM's own CPU spec
            divides by all groups' bytes per key instead (vLLM #56871).
        ``num_host_chunks`` (int >= 0): capacity in chunks directly (overrides the
            budget; 0 refuses every store).
        ``kvtier_backend`` (str): the worker's transfer backend (default ``"auto"``).
        ``store_threshold``, ``max_tracker_size`` (int): as vLLM's CPU spec reads them
            (a threshold below 2 stores on the first offer).
        ``kvtier_eviction`` (str): the host eviction policy (``"lru"``, ``"lru_turns"``,
            ``"lru2"``). vLLM's ``eviction_policy`` key is accepted only as ``"lru"``.
        ``kvtier_chain`` (bool): chain a store's run under its stored parent chunk.

    Raises:
        ConfigError: neither capacity key, a budget below one chunk, or a bad value.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The Prometheus metrics the manager's ``get_stats`` emits (vLLM's
        ``OffloadPromMetrics`` refuses undeclared ones)."""
        return metric_definitions(_int(extra_config, "store_threshold", 0, 0))

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info`` the manager fills."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        extra = dict(self.extra_config)
        groups = tuple(config.groups)
        n_groups = max(1, len(groups))
        world = max(1, int(config.parallel.world_size))
        chunks = extra.get("num_host_chunks")
        if chunks is None:
            if extra.get("cpu_bytes_to_use") is None:
                raise ConfigError("kvtier: kv_connector_extra_config needs cpu_bytes_to_use (bytes) "
                                  "or num_host_chunks")
            budget = _int(extra, "cpu_bytes_to_use", 0, 1)
            per_key = max(1, int(config.worker_kv_bytes_per_block) // n_groups) * world * self.blocks_per_chunk
            chunks = budget // per_key
            if chunks < 1:
                raise ConfigError(f"kvtier: cpu_bytes_to_use={budget!r} holds no chunk of {per_key} bytes")
            self.num_chunks = chunks
        else:
            self.num_chunks = _int(extra, "num_host_chunks", 0, 0)
        self.tokens_per_chunk = {g.group_id: g.tokens_per_block * self.blocks_per_chunk for g in groups
                                 if g.sliding_window_size_in_chunks is None}
        self.sparse_groups = {g.group_id for g in groups if g.sliding_window_size_in_chunks is not None}
        self.backend = str(extra.get("kvtier_backend", "auto"))
        self.store_threshold = max(1, _int(extra, "store_threshold", 0, 0))
        self.max_tracker_size = _int(extra, "max_tracker_size", 64_000, 1)
        vllm_policy = extra.get("eviction_policy", "lru")
        if vllm_policy != "lru":
            raise ConfigError(f"kvtier: eviction_policy={vllm_policy!r} names one of vLLM's policies; kvtier's "
                              f"host tier takes kvtier_eviction, one of {sorted(POLICIES)}")
        self.eviction = str(extra.get("kvtier_eviction", "lru"))
        if self.eviction not in POLICIES:
            raise ConfigError(f"kvtier: kvtier_eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        chain = extra.get("kvtier_chain", True)
        if not isinstance(chain, bool):
            raise ConfigError(f"kvtier: kvtier_chain must be a bool, got {chain!r}")
        self.chain = chain
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(
                self.num_chunks, tokens_per_chunk=self.tokens_per_chunk,
                sliding_window_groups=self.sparse_groups,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.store_threshold, max_tracker_size=self.max_tracker_size,
                eviction=self.eviction, chain=self.chain)
        return self._manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(kv_caches, self.num_chunks, self.blocks_per_chunk,
                                                  backend=self.backend)
        return self._worker
