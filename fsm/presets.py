"""Cache layouts of known models, with their sources.

- ``deepseek-v4``: the six cache groups of DeepSeek V4 (``spec/README.md``, Sources:
  DeepSeek V4 cache groups; read from TokenSpeed's ``build_v4_cache_specs`` and ``DeepseekV4CacheLayout``): page geometry and
  per-layer page bytes per component derived from head_dim 512, rope 64, index_head_dim
  128 (MXFP4 indexer). Layer count, the layers' compression ratios and the sliding window
  are parameters; their defaults (43 layers: 2 sliding-window-only layers, then ratio 4
  and ratio 128 alternating; window 128 tokens) are assumptions, not published values
  (the reference gives geometry only; its tests use window 128).
- ``llama-3-8b``: one full-attention group: 32 layers, 8 KV heads of 128, bf16
  (K and V: 2 x 8 x 128 x 2 B = 4 KiB per token per layer, 128 KiB per token), pages of
  ``page_tokens`` tokens (default 16).
- ``deepseek-v3``: one MLA group: 61 layers, 576 values per token (kv_lora_rank 512 +
  rope 64), bf16 (1,152 B per token per layer), pages of ``page_tokens`` (default 64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .checks import plain_int
from .errors import ConfigError
from .layout import CacheLayout
from .records import CacheGroupSpec, ComponentSpec, Family

__all__ = ["PRESETS", "preset", "deepseek_v4", "llama_3_8b", "deepseek_v3"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _positive(preset_name: str, **values: int) -> None:
    for name, v in values.items():
        iv = plain_int(v)
        if iv is None or iv <= 0:
            raise ConfigError(f"{preset_name}: {name} must be a positive int, got {v!r}")


def deepseek_v4(num_layers: int = 43, ratios: Sequence[int] | None = None, sliding_window: int = 128,
                head_dim: int = 512, rope_dim: int = 64, index_head_dim: int = 128) -> CacheLayout:
    """DeepSeek V4's six cache groups.

    Args:
        num_layers: model layers.
        ratios: compression ratio per layer (1: sliding window only, 4 or 128); default:
            two ratio-1 layers, then 4 and 128 alternating.
        sliding_window: SWA window in tokens.
        head_dim: attention head dimension (default from the reference).
        rope_dim: rotary part of the head dimension (default from the reference).
        index_head_dim: indexer head dimension (default from the reference).

    Page bytes (``spec/README.md``, Sources: DeepSeek V4 cache groups): token stride = nope + 2*rope (nope = head_dim - rope);
    row = stride + nope/64 + 1; a block of n rows = n*row rounded up to a multiple of the
    stride. SWA page (64 rows) and c4 compressed page (64 rows) = 37,440 B; c128 compressed
    page (2 rows) = 1,728 B; MXFP4 indexer row = d/2 + d/32 -> 64 rows = 4,352 B; compressor
    state pages = rows x (state_width*2) float32: 32,768 B for both ratios at the defaults;
    indexer compressor state = 4 x index_head_dim*2*2 float32 = 8,192 B.

    Raises:
        ConfigError: a ratio other than 1, 4 or 128, or ``len(ratios) != num_layers``.
    """
    if ratios is None:
        ratios = [1, 1] + [4 if i % 2 == 0 else 128 for i in range(num_layers - 2)]
    given: list[object] = list(ratios)
    if len(given) != num_layers:
        raise ConfigError(f"deepseek-v4: {len(given)} ratios for {num_layers} layers")
    bad: list[object] = []
    for r in given:  # ints only (numpy ints too): 4.0 is not a ratio
        if plain_int(r) not in (1, 4, 128) and r not in bad:
            bad.append(r)
    if bad:
        raise ConfigError(f"deepseek-v4: compression ratios must be 1, 4 or 128, got {bad}")
    ratios = [plain_int(r) or 0 for r in given]  # plain ints (checked above)
    nope = head_dim - rope_dim
    stride = nope + 2 * rope_dim
    row = stride + nope // 64 + 1

    def block(rows: int) -> int:
        return _round_up(rows * row, stride)

    indexer_row = index_head_dim // 2 + index_head_dim // 32
    every = tuple(range(num_layers))
    r4 = tuple(i for i, r in enumerate(ratios) if r == 4)
    r128 = tuple(i for i, r in enumerate(ratios) if r == 128)
    groups = [CacheGroupSpec("v4.swa_kv", Family.STATE, 64, 1, every, (ComponentSpec("kv", block(64)),),
                             window=sliding_window)]
    if r4:
        groups += [
            CacheGroupSpec("v4.c4a.compressor_state", Family.STATE, 4, 1, r4,
                           (ComponentSpec("state", 4 * head_dim * 2 * 2 * 4),), window=8),
            CacheGroupSpec("v4.c4a.compressed_kv", Family.HISTORY, 64, 4, r4,
                           (ComponentSpec("kv", block(64)), ComponentSpec("indexer_k", 64 * indexer_row))),
            CacheGroupSpec("v4.c4a.indexer_compressor_state", Family.STATE, 4, 1, r4,
                           (ComponentSpec("state", 4 * index_head_dim * 2 * 2 * 4),), window=8),
        ]
    if r128:
        groups += [
            CacheGroupSpec("v4.c128a.compressor_state", Family.STATE, 8, 1, r128,
                           (ComponentSpec("state", 8 * head_dim * 2 * 4),), window=128),
            CacheGroupSpec("v4.c128a.compressed_kv", Family.HISTORY, 2, 128, r128,
                           (ComponentSpec("kv", block(2)),)),
        ]
    return CacheLayout("deepseek-v4", tuple(groups), num_layers,
                       source="spec/README.md, Sources: DeepSeek V4 cache groups (TokenSpeed "
                              "build_v4_cache_specs); layer count, "
                              "ratios and window are assumed defaults")


def llama_3_8b(page_tokens: int = 16, num_layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
               dtype_bytes: int = 2) -> CacheLayout:
    """Llama 3 8B: one full-attention group (K and V per layer: 2 x heads x head_dim x dtype).

    Raises:
        ConfigError: a parameter that is not a positive int.
    """
    _positive("llama-3-8b", page_tokens=page_tokens, num_layers=num_layers, kv_heads=kv_heads,
              head_dim=head_dim, dtype_bytes=dtype_bytes)
    per_token = 2 * kv_heads * head_dim * dtype_bytes
    g = CacheGroupSpec("llama.full_attention", Family.HISTORY, page_tokens, 1, tuple(range(num_layers)),
                       (ComponentSpec("kv", page_tokens * per_token),))
    return CacheLayout("llama-3-8b", (g,), num_layers,
                       source="Llama 3 8B config: 32 layers, 8 KV heads x 128, bf16 (128 KiB per token)")


def deepseek_v3(page_tokens: int = 64, num_layers: int = 61, values_per_token: int = 576,
                dtype_bytes: int = 2) -> CacheLayout:
    """DeepSeek V3: one MLA group (kv_lora_rank 512 + rope 64 = 576 values per token per layer).

    Raises:
        ConfigError: a parameter that is not a positive int.
    """
    _positive("deepseek-v3", page_tokens=page_tokens, num_layers=num_layers,
              values_per_token=values_per_token, dtype_bytes=dtype_bytes)
    g = CacheGroupSpec("v3.mla", Family.HISTORY, page_tokens, 1, tuple(range(num_layers)),
                       (ComponentSpec("kv", page_tokens * values_per_token * dtype_bytes),))
    return CacheLayout("deepseek-v3", (g,), num_layers,
                       source="DeepSeek V3 config: 61 layers, MLA kv_lora_rank 512 + rope 64, bf16")


PRESETS: dict[str, Callable[..., CacheLayout]] = {
    "deepseek-v4": deepseek_v4,
    "llama-3-8b": llama_3_8b,
    "deepseek-v3": deepseek_v3,
}


def preset(name: str, **params: Any) -> CacheLayout:
    """The layout of preset ``name`` with optional parameter overrides.

    Raises:
        ConfigError: unknown preset (the message lists the presets) or bad parameters.
    """
    if not isinstance(name, str):
        raise ConfigError(f"model preset must be a name (str), one of {sorted(PRESETS)}, got {name!r}")
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}") from None
    # numpy integers (anything operator.index takes) become plain ints
    params = {k: v if plain_int(v) is None else plain_int(v) for k, v in params.items()}
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(f"preset {name!r}: {exc}") from exc


