"""Adapters that embed kvtier in inference engines.

- :mod:`kvtier.adapters.vllm` (extra ``kvtier[vllm]``): kvtier as vLLM's offloading tier
  (``OffloadingSpec``; the scheduler side in :mod:`~kvtier.adapters.vllm_manager` on
  :mod:`~kvtier.adapters.vllm_chunks`, the worker side in :mod:`~kvtier.adapters.vllm_worker`,
  metrics in :mod:`~kvtier.adapters.vllm_stats`), plugged into vLLM's ``OffloadingConnector``
  through ``kv_connector_extra_config`` (docs/vllm.md).
- The kit (extras ``vllm`` and ``testing``): :mod:`~kvtier.adapters.vllm_engine` runs vLLM's
  real ``OffloadingConnectorScheduler`` and ``KVCacheManager`` in a scheduler loop with a
  simulated worker (the tests, the fuzzing machine :mod:`~kvtier.adapters.vllm_machine`,
  and the trace replay :mod:`~kvtier.adapters.vllm_kit` behind ``bench/vllm_replay.py``).

- :mod:`kvtier.adapters.sglang` (extra ``kvtier[sglang]``): kvtier as SGLang's prefix cache
  (``BasePrefixCache`` with the HiCache hooks), selected with ``--radix-cache-backend kvtier``
  (docs/sglang.md); :mod:`~kvtier.adapters.sglang_pages` maps its pages to SGLang's KV pool.

Importing this package imports nothing from vLLM or SGLang; the submodules do.
"""
