"""Presets and layout arithmetic (issue 3, "Cache groups and presets"): DeepSeek V4's six
groups with the page geometry and per-layer page bytes of source_system.md 1.1-1.2,
Llama 3 8B and DeepSeek V3, the prefix alignment, ``chunk_rows`` and
``replay_span_tokens`` computed by hand, and bad parameters."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.fsm.errors import ConfigError
from kvtier.fsm.layout import CacheLayout, ChunkRows
from kvtier.fsm.presets import PRESETS, deepseek_v3, deepseek_v4, llama_3_8b, preset
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family

V4_NAMES = ["v4.swa_kv", "v4.c4a.compressor_state", "v4.c4a.compressed_kv",
            "v4.c4a.indexer_compressor_state", "v4.c128a.compressor_state", "v4.c128a.compressed_kv"]


def test_preset_names():
    assert sorted(PRESETS) == ["deepseek-v3", "deepseek-v4", "llama-3-8b"]


def test_deepseek_v4_groups_and_geometry():
    lay = preset("deepseek-v4")
    assert lay.name == "deepseek-v4"
    assert lay.num_layers == 43
    assert [g.name for g in lay.groups] == V4_NAMES
    geometry = {g.name: (g.family, g.rows, g.stride, g.tokens_per_page, g.window) for g in lay.groups}
    assert geometry == {
        "v4.swa_kv": (Family.STATE, 64, 1, 64, 128),
        "v4.c4a.compressor_state": (Family.STATE, 4, 1, 4, 8),
        "v4.c4a.compressed_kv": (Family.HISTORY, 64, 4, 256, None),
        "v4.c4a.indexer_compressor_state": (Family.STATE, 4, 1, 4, 8),
        "v4.c128a.compressor_state": (Family.STATE, 8, 1, 8, 128),
        "v4.c128a.compressed_kv": (Family.HISTORY, 2, 128, 256, None),
    }
    assert [g.name for g in lay.history_groups] == ["v4.c4a.compressed_kv", "v4.c128a.compressed_kv"]
    assert lay.alignment == 256


def test_deepseek_v4_page_bytes_per_component():
    lay = deepseek_v4()
    comps = {g.name: tuple((c.name, c.page_bytes) for c in g.components) for g in lay.groups}
    assert comps == {
        "v4.swa_kv": (("kv", 37_440),),
        "v4.c4a.compressor_state": (("state", 32_768),),
        # the CSA indexer keys share the ratio-4 compressed group's page ids (MXFP4: 64 x 68 B)
        "v4.c4a.compressed_kv": (("kv", 37_440), ("indexer_k", 4_352)),
        "v4.c4a.indexer_compressor_state": (("state", 8_192),),
        "v4.c128a.compressor_state": (("state", 32_768),),
        "v4.c128a.compressed_kv": (("kv", 1_728),),
    }
    g = lay.group("v4.c4a.compressed_kv")
    assert g.layer_page_bytes == 41_792


def test_deepseek_v4_layers_and_totals():
    lay = deepseek_v4()
    r4 = tuple(range(2, 43, 2))  # 21 layers
    r128 = tuple(range(3, 43, 2))  # 20 layers
    layers = {g.name: g.layers for g in lay.groups}
    assert layers == {
        "v4.swa_kv": tuple(range(43)),
        "v4.c4a.compressor_state": r4,
        "v4.c4a.compressed_kv": r4,
        "v4.c4a.indexer_compressor_state": r4,
        "v4.c128a.compressor_state": r128,
        "v4.c128a.compressed_kv": r128,
    }
    pb = {g.name: g.page_bytes for g in lay.groups}
    assert pb == {
        "v4.swa_kv": 1_609_920,  # 37,440 x 43
        "v4.c4a.compressor_state": 688_128,  # 32,768 x 21
        "v4.c4a.compressed_kv": 877_632,  # 41,792 x 21
        "v4.c4a.indexer_compressor_state": 172_032,  # 8,192 x 21
        "v4.c128a.compressor_state": 655_360,  # 32,768 x 20
        "v4.c128a.compressed_kv": 34_560,  # 1,728 x 20
    }
    sp = {g.name: g.state_pages for g in lay.state_groups}
    assert sp == {"v4.swa_kv": 2, "v4.c4a.compressor_state": 2, "v4.c4a.indexer_compressor_state": 2,
                  "v4.c128a.compressor_state": 16}
    assert [lay.pages_per_unit(g) for g in lay.groups] == [0, 0, 1, 0, 0, 1]
    assert lay.unit_bytes() == 912_192  # 877,632 + 34,560
    # 2 x 1,609,920 + 2 x 688,128 + 2 x 172,032 + 16 x 655,360
    assert lay.checkpoint_bytes() == 15_425_920
    assert lay.replay_span_tokens() == 43 * 128


def test_deepseek_v4_byte_formulas_other_geometry():
    # head_dim 256, rope 64: nope 192, stride 320, row 320 + 3 + 1 = 324;
    # 64 rows = 20,736 -> 20,800 (65 x 320); 2 rows = 648 -> 960 (3 x 320)
    # indexer (d = 64): 32 + 2 = 34 B per row -> 2,176; compressor states: 4 x 512 x 2 x 4 = 16,384 (ratio 4),
    # 8 x 256 x 2 x 4 = 16,384 (ratio 128); indexer state 4 x 64 x 2 x 2 x 4 = 4,096
    lay = deepseek_v4(num_layers=3, ratios=[1, 4, 128], head_dim=256, rope_dim=64, index_head_dim=64)
    comps = {g.name: tuple(c.page_bytes for c in g.components) for g in lay.groups}
    assert comps == {
        "v4.swa_kv": (20_800,),
        "v4.c4a.compressor_state": (16_384,),
        "v4.c4a.compressed_kv": (20_800, 2_176),
        "v4.c4a.indexer_compressor_state": (4_096,),
        "v4.c128a.compressor_state": (16_384,),
        "v4.c128a.compressed_kv": (960,),
    }
    assert {g.name: g.layers for g in lay.groups} == {
        "v4.swa_kv": (0, 1, 2), "v4.c4a.compressor_state": (1,), "v4.c4a.compressed_kv": (1,),
        "v4.c4a.indexer_compressor_state": (1,), "v4.c128a.compressor_state": (2,),
        "v4.c128a.compressed_kv": (2,)}


def test_deepseek_v4_row_bytes_without_rounding_slack():
    # head_dim 64, rope 0: nope 64, stride 64, row 64 + 1 + 1 = 66 B; 64 rows = 4,224 B, already a
    # multiple of the stride, so every byte of the row formula shows; 2 rows = 132 -> 192 (3 x 64)
    lay = deepseek_v4(num_layers=2, ratios=[4, 128], head_dim=64, rope_dim=0, index_head_dim=64)
    comps = {g.name: g.components[0].page_bytes for g in lay.groups}
    assert (comps["v4.swa_kv"], comps["v4.c4a.compressed_kv"], comps["v4.c128a.compressed_kv"]) == (4_224, 4_224, 192)


def test_deepseek_v4_only_present_ratios():
    only4 = deepseek_v4(num_layers=3, ratios=[1, 4, 4])
    assert [g.name for g in only4.groups] == V4_NAMES[:4]
    assert only4.alignment == 256
    only128 = deepseek_v4(num_layers=2, ratios=[1, 128])
    assert [g.name for g in only128.groups] == ["v4.swa_kv", "v4.c128a.compressor_state", "v4.c128a.compressed_kv"]
    assert only128.alignment == 256


def test_replay_span_by_hand():
    # window 16: layer 0 swa 16; layer 1 max(16, 8, 8) = 16; layer 2 max(16, 128) = 128
    assert deepseek_v4(num_layers=3, ratios=[1, 4, 128], sliding_window=16).replay_span_tokens() == 160
    h = CacheGroupSpec("h", Family.HISTORY, 4, 1, (0, 1, 2, 3), (ComponentSpec("kv", 1),))
    s1 = CacheGroupSpec("s1", Family.STATE, 2, 1, (0, 2), (ComponentSpec("kv", 1),), window=6)
    s2 = CacheGroupSpec("s2", Family.STATE, 4, 1, (2, 3), (ComponentSpec("kv", 1),), window=12)
    # layer 0: 6, layer 1: none, layer 2: max(6, 12), layer 3: 12
    assert CacheLayout("x", (h, s1, s2), 4).replay_span_tokens() == 30
    assert CacheLayout("y", (h,), 4).replay_span_tokens() == 0


def test_chunk_rows_by_hand():
    lay = deepseek_v4()
    c4, c128 = "v4.c4a.compressed_kv", "v4.c128a.compressed_kv"
    # 256 cached + 300: end 556; ratio 4: rows 64..138 (75), residue 0; ratio 128: rows 2..3 (2), residue 44
    assert lay.chunk_rows(256, 300) == (ChunkRows(c4, 64, 75, 0), ChunkRows(c128, 2, 2, 44))
    # first chunk of 130 tokens: 32 rows + 2 residue; 1 row + 2 residue
    assert lay.chunk_rows(0, 130) == (ChunkRows(c4, 0, 32, 2), ChunkRows(c128, 0, 1, 2))
    # next chunk from 130 to 256: the partial rows 32 and 1 are completed first
    assert lay.chunk_rows(130, 126) == (ChunkRows(c4, 32, 32, 0), ChunkRows(c128, 1, 1, 0))
    # an empty chunk completes nothing and keeps the residue
    assert lay.chunk_rows(130, 0) == (ChunkRows(c4, 32, 0, 2), ChunkRows(c128, 1, 0, 2))
    assert lay.chunk_rows(3, 1) == (ChunkRows(c4, 0, 1, 0), ChunkRows(c128, 0, 0, 4))
    assert llama_3_8b().chunk_rows(10, 7) == (ChunkRows("llama.full_attention", 10, 7, 0),)
    with pytest.raises(ConfigError):
        lay.chunk_rows(-1, 4)
    with pytest.raises(ConfigError):
        lay.chunk_rows(0, -4)


def test_llama_3_8b():
    lay = preset("llama-3-8b")
    (g,) = lay.groups
    assert (g.name, g.family, g.tokens_per_page, lay.num_layers, len(g.layers)) == (
        "llama.full_attention", Family.HISTORY, 16, 32, 32)
    assert g.layer_page_bytes == 16 * 4096  # K and V: 2 x 8 x 128 x 2 B per token per layer
    assert g.page_bytes // g.tokens_per_page == 128 * 1024  # 128 KiB per token
    assert g.page_bytes == 2 * 1024 * 1024
    assert lay.alignment == 16
    assert lay.state_groups == ()
    assert preset("llama-3-8b", page_tokens=32).alignment == 32


def test_deepseek_v3():
    lay = preset("deepseek-v3")
    (g,) = lay.groups
    assert (g.name, g.tokens_per_page, lay.num_layers, len(g.layers)) == ("v3.mla", 64, 61, 61)
    assert g.layer_page_bytes // g.tokens_per_page == 576 * 2  # 576 bf16 values per token per layer
    assert g.page_bytes == 64 * 576 * 2 * 61
    assert lay.alignment == 64
    assert deepseek_v3(page_tokens=16).alignment == 16


@pytest.mark.parametrize(("make", "message"), [
    (lambda: preset("gpt-5"), "unknown model preset 'gpt-5'; expected one of ['deepseek-v3', 'deepseek-v4', 'llama-3-8b']"),
    (lambda: preset("llama-3-8b", bogus=1),
     "preset 'llama-3-8b': llama_3_8b() got an unexpected keyword argument 'bogus'"),
    (lambda: deepseek_v4(num_layers=2, ratios=[1, 2]), "deepseek-v4: compression ratios must be 1, 4 or 128, got [2]"),
    (lambda: deepseek_v4(num_layers=3, ratios=[1, 4]), "deepseek-v4: 2 ratios for 3 layers"),
    (lambda: deepseek_v4(num_layers=4, ratios=[4.0, 4, 3, 3]), "deepseek-v4: compression ratios must be 1, 4 or 128, "
     "got [4.0, 3]"),
    (lambda: deepseek_v4(num_layers=2, ratios=[True, 4]), "deepseek-v4: compression ratios must be 1, 4 or 128, "
     "got [True]"),
    (lambda: deepseek_v4(num_layers=2, ratios=[1, 1]), "layout 'deepseek-v4': needs at least one history group"),
    (lambda: deepseek_v4(sliding_window=0),
     "cache group 'v4.swa_kv': window (tokens, required for state groups) must be a positive int, got 0"),
    (lambda: llama_3_8b(page_tokens=0), "llama-3-8b: page_tokens must be a positive int, got 0"),
    (lambda: llama_3_8b(num_layers=True), "llama-3-8b: num_layers must be a positive int, got True"),
    (lambda: llama_3_8b(dtype_bytes=1.5), "llama-3-8b: dtype_bytes must be a positive int, got 1.5"),
    (lambda: deepseek_v3(page_tokens=-64), "deepseek-v3: page_tokens must be a positive int, got -64"),
    (lambda: deepseek_v3(values_per_token=0), "deepseek-v3: values_per_token must be a positive int, got 0"),
])
def test_bad_parameters_raise_config_error(make, message):
    with pytest.raises(ConfigError) as exc:
        make()
    assert str(exc.value) == message


def test_smallest_positive_parameters_and_component_names():
    lay = llama_3_8b(page_tokens=1, num_layers=1, kv_heads=1, head_dim=1, dtype_bytes=1)
    assert [(c.name, c.page_bytes) for c in lay.groups[0].components] == [("kv", 2)]
    v3 = deepseek_v3(page_tokens=1, num_layers=1, values_per_token=1, dtype_bytes=1)
    assert [(c.name, c.page_bytes) for c in v3.groups[0].components] == [("kv", 1)]


def test_presets_name_their_source():
    assert preset("deepseek-v4").source == ("spec/README.md, Sources: DeepSeek V4 cache groups (TokenSpeed "
                                            "build_v4_cache_specs); layer count, "
                                            "ratios and window are assumed defaults")
    assert preset("llama-3-8b").source == "Llama 3 8B config: 32 layers, 8 KV heads x 128, bf16 (128 KiB per token)"
    assert preset("deepseek-v3").source == "DeepSeek V3 config: 61 layers, MLA kv_lora_rank 512 + rope 64, bf16"
    assert [preset(n).name for n in PRESETS] == list(PRESETS)


def test_layout_validation():
    h = CacheGroupSpec("h", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 1),))
    s3 = CacheGroupSpec("s", Family.STATE, 3, 1, (0,), (ComponentSpec("kv", 1),), window=6)
    h01 = CacheGroupSpec("h", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("kv", 1),))
    for make, message in [
        (lambda: CacheLayout("x", (h, s3), 1),
         "layout 'x': state group 's' has 3 tokens per page, which does not divide the alignment 4"),
        (lambda: CacheLayout("x", (h, h), 1), "layout 'x': duplicate cache group names ['h', 'h']"),
        (lambda: CacheLayout("x", (h,), 0), "layout 'x': num_layers must be a positive int, got 0"),
        (lambda: CacheLayout("x", (h,), True), "layout 'x': num_layers must be a positive int, got True"),
        (lambda: CacheLayout("x", (h,), 1.0), "layout 'x': num_layers must be a positive int, got 1.0"),
        (lambda: CacheLayout("x", (h01,), 1), "layout 'x': group 'h' uses layer 1 but the model has 1 layers"),
        (lambda: CacheLayout("x", (CacheGroupSpec("h", Family.HISTORY, 4, 1, (0, 1, 2), (ComponentSpec("kv", 1),)),), 2),
         "layout 'x': group 'h' uses layer 2 but the model has 2 layers"),
        (lambda: CacheLayout("x", (s3,), 1), "layout 'x': needs at least one history group"),
        (lambda: CacheLayout("", (h,), 1), "layout name must be a non-empty str, got ''"),
        (lambda: CacheLayout(5, (h,), 1), "layout name must be a non-empty str, got 5"),  # type: ignore[arg-type]
        (lambda: CacheLayout("x", ("h",), 1),  # type: ignore[arg-type]
         "layout 'x': groups must be a tuple of CacheGroupSpec, got ('h',)"),
        (lambda: CacheLayout("x", None, 1),  # type: ignore[arg-type]
         "layout 'x': groups must be a tuple of CacheGroupSpec, got None"),
        (lambda: CacheLayout("x", (h,), 1).group("nope"), "layout 'x' has no cache group 'nope'; groups: ['h']"),
        (lambda: CacheLayout("x", (h,), 1).chunk_rows(-1, 2),
         "chunk_rows: token counts must be >= 0, got cached=-1, chunk=2"),
        (lambda: CacheLayout("x", (h,), 1).chunk_rows(0, -2),
         "chunk_rows: token counts must be >= 0, got cached=0, chunk=-2"),
    ]:
        with pytest.raises(ConfigError) as exc:
            make()
        assert str(exc.value) == message
    assert CacheLayout("x", (h01,), 2).group("h") is h01
    s4 = CacheGroupSpec("s", Family.STATE, 4, 1, (0,), (ComponentSpec("kv", 1),), window=4)
    assert CacheLayout("x", (h, s4), 1).state_groups == (s4,)  # 4 divides the alignment 4
    h6 = CacheGroupSpec("h6", Family.HISTORY, 6, 1, (0,), (ComponentSpec("kv", 1),))
    assert CacheLayout("x", (h, h6), 1).alignment == 12

def test_layout_records_are_frozen_and_slotted():
    h = CacheGroupSpec("h", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 1),))
    lay = CacheLayout("x", (h,), 1)
    assert lay.source == ""
    rows = lay.chunk_rows(0, 4)
    assert rows == (ChunkRows("h", 0, 4, 0),)
    for record, field in ((lay, "name"), (rows[0], "rows")):
        assert not hasattr(record, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, 1)
