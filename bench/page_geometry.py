"""Page geometries shared by the transfer benchmarks (``bench/transfer.py`` on the GPU,
``bench/transfer_host.py`` on the CPU): 8 layers, one group of pages of one size, or the
DeepSeek V4 mix of per-layer page sizes. Bytes per page per layer and component."""

from __future__ import annotations

from kvtier.fsm import CacheGroupSpec, ComponentSpec

LAYERS = 8


def one_size(name: str, page_bytes: int) -> list[CacheGroupSpec]:
    """One history group ``name`` over ``LAYERS`` layers, one component of ``page_bytes``
    bytes per page and layer."""
    return [CacheGroupSpec(name, "history", 64, 1, tuple(range(LAYERS)), (ComponentSpec("kv", page_bytes),))]


def dsv4_specs() -> list[CacheGroupSpec]:
    """DeepSeek V4 per-layer page sizes (source_system.md 1.2: head_dim 512, rope 64,
    MXFP4 indexer): 8 layers, ratio-4 on even and ratio-128 on odd layers."""
    even, odd, every = tuple(range(0, LAYERS, 2)), tuple(range(1, LAYERS, 2)), tuple(range(LAYERS))
    return [
        CacheGroupSpec("v4.swa_kv", "state", 64, 1, every, (ComponentSpec("kv", 37440),), window=128),
        CacheGroupSpec("v4.c4a.compressed_kv", "history", 64, 4, even,
                       (ComponentSpec("kv", 37440), ComponentSpec("indexer_k", 4352))),
        CacheGroupSpec("v4.c128a.compressed_kv", "history", 2, 128, odd, (ComponentSpec("kv", 1728),)),
        CacheGroupSpec("v4.c4a.compressor_state", "state", 4, 1, even, (ComponentSpec("state", 32768),), window=8),
        CacheGroupSpec("v4.c128a.compressor_state", "state", 8, 1, odd, (ComponentSpec("state", 32768),),
                       window=128),
        CacheGroupSpec("v4.c4a.indexer_compressor_state", "state", 4, 1, even, (ComponentSpec("state", 8192),),
                       window=8),
    ]
