"""Adapters that embed kvtier in inference engines.

- :mod:`kvtier.adapters.vllm` (extra ``kvtier[vllm]``): kvtier as vLLM's offloading
  manager (``OffloadingSpec``, ``OffloadingManager``, ``OffloadingWorker``), plugged into
  vLLM's ``OffloadingConnector`` through ``kv_connector_extra_config``.
- :mod:`kvtier.adapters.vllm_kit` (extras ``vllm`` and ``testing``): drives the adapter
  through vLLM's own ``KVCacheManager`` with the calls and order of vLLM's
  ``OffloadingConnectorScheduler`` (the replay, the tests and the fuzzing machine).

Importing this package imports nothing from vLLM; the submodules do.
"""
