"""The shared records (kvtier.fsm.records): validation messages name the record, the field
and the value; derived sizes are hand-computed; records are frozen."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtier.fsm import (
    CacheGroupSpec,
    ComponentSpec,
    Completion,
    ConfigError,
    Direction,
    Family,
    GroupTransfer,
    TransferCommand,
)

KV = ComponentSpec("kv", 1024)
IDX = ComponentSpec("indexer_k", 128)


def group(**overrides: Any) -> CacheGroupSpec:
    fields: dict[str, Any] = dict(name="c4a", family="history", rows=64, stride=4, layers=(1, 3, 5),
                                  components=(KV, IDX))
    fields.update(overrides)
    return CacheGroupSpec(**fields)


def command(**overrides: Any) -> TransferCommand:
    fields: dict[str, Any] = dict(op_id=7, direction="loadback",
                                  transfers=(GroupTransfer("c4a", (1, 2), (8, 9)),), layers=(0, 2))
    fields.update(overrides)
    return TransferCommand(**fields)


# --- derived values ------------------------------------------------------------------------


def test_history_group_sizes() -> None:
    g = group()
    assert g.family is Family.HISTORY and g.window is None
    assert g.tokens_per_page == 256  # 64 rows x 4 tokens
    assert g.layer_page_bytes == 1152  # 1024 + 128
    assert g.page_bytes == 3456  # 1152 x 3 layers
    assert g.state_pages == 0


@pytest.mark.parametrize("window, pages", [(1, 1), (128, 1), (129, 2), (256, 2), (257, 3)])
def test_state_group_pages_cover_the_window(window: int, pages: int) -> None:
    g = group(name="swa", family="state", rows=128, stride=1, layers=[0], components=[KV], window=window)
    assert g.family is Family.STATE and g.tokens_per_page == 128
    assert g.state_pages == pages
    assert g.layers == (0,) and g.components == (KV,)  # lists become tuples
    assert g.page_bytes == g.layer_page_bytes == 1024


def test_transfer_sizes_and_normalisation() -> None:
    t = GroupTransfer("kv", [3, 4, 5], [0, 1, 2])
    assert t.src_pages == (3, 4, 5) and t.dst_pages == (0, 1, 2) and t.pages == 3
    c = command(transfers=[t, GroupTransfer("s", (9,), (1,))], layers=[1, 4], node_ids=[2, 3])
    assert c.direction is Direction.LOADBACK and c.pages == 4
    assert c.transfers == (t, GroupTransfer("s", (9,), (1,))) and c.layers == (1, 4) and c.node_ids == (2, 3)
    assert command(transfers=(), layers=()).pages == 0  # empty layers: every layer involved


def test_completion_ack_and_layer() -> None:
    assert Completion(3).is_ack and Completion(3) == Completion(3, rank=0, ok=True, layer=None)
    assert not Completion(3, rank=1, ok=True, layer=5).is_ack


@pytest.mark.parametrize("record", [
    KV, group(), GroupTransfer("kv", (1,), (2,)), command(), Completion(1),
], ids=lambda r: type(r).__name__)
def test_records_are_frozen(record: object) -> None:
    field = dataclasses.fields(record)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, getattr(record, field))
    with pytest.raises((AttributeError, TypeError)):  # slots: no new attributes either
        record.extra = 1  # type: ignore[attr-defined]
    assert hash(record) == hash(dataclasses.replace(record))  # type: ignore[type-var]


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "", "page_bytes": 1}, "component name must be a non-empty str, got ''"),
    ({"name": 3, "page_bytes": 1}, "component name must be a non-empty str, got 3"),
    ({"name": "kv", "page_bytes": True}, "component 'kv': page_bytes must be a positive int, got True"),
    ({"name": "kv", "page_bytes": 0}, "component 'kv': page_bytes must be a positive int, got 0"),
    ({"name": "kv", "page_bytes": -64}, "component 'kv': page_bytes must be a positive int, got -64"),
    ({"name": "kv", "page_bytes": 1.5}, "component 'kv': page_bytes must be a positive int, got 1.5"),
])
def test_component_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ComponentSpec(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("overrides, message", [
    ({"name": ""}, "cache group name must be a non-empty str, got ''"),
    ({"family": "sliding"}, "cache group 'c4a': family must be 'history' or 'state', got 'sliding'"),
    ({"rows": True}, "cache group 'c4a': rows must be a positive int, got True"),
    ({"rows": 0}, "cache group 'c4a': rows must be a positive int, got 0"),
    ({"stride": -4}, "cache group 'c4a': stride must be a positive int, got -4"),
    ({"layers": ()}, "cache group 'c4a': layers must be a non-empty sequence of ints >= 0, got ()"),
    ({"layers": (0, -1)}, "cache group 'c4a': layers must be a non-empty sequence of ints >= 0, got (0, -1)"),
    ({"layers": (False, 1)}, "cache group 'c4a': layers must be a non-empty sequence of ints >= 0, got (False, 1)"),
    ({"layers": (3, 1)}, "cache group 'c4a': layers must be sorted and unique, got (3, 1)"),
    ({"layers": [1, 1, 2]}, "cache group 'c4a': layers must be sorted and unique, got [1, 1, 2]"),
    ({"components": ()}, "cache group 'c4a': components must be a non-empty sequence of ComponentSpec, got ()"),
    ({"components": ("kv",)},
     "cache group 'c4a': components must be a non-empty sequence of ComponentSpec, got ('kv',)"),
    ({"components": (KV, ComponentSpec("kv", 8))},
     "cache group 'c4a': component names must be unique, got ['kv', 'kv']"),
    ({"family": "state"},
     "cache group 'c4a': window (tokens, required for state groups) must be a positive int, got None"),
    ({"family": "state", "window": 0},
     "cache group 'c4a': window (tokens, required for state groups) must be a positive int, got 0"),
    ({"family": "state", "window": True},
     "cache group 'c4a': window (tokens, required for state groups) must be a positive int, got True"),
    ({"window": 128}, "cache group 'c4a': window is only for state groups, got 128"),
])
def test_cache_group_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        group(**overrides)
    assert str(info.value) == message


@pytest.mark.parametrize("src, dst, message", [
    ((1, 2), (3,), "transfer of group 'kv': 2 source pages but 1 destination pages"),
    ((), (0,), "transfer of group 'kv': 0 source pages but 1 destination pages"),
    ((1, -2), (3, 4), "transfer of group 'kv': src_pages must hold page ids (ints >= 0), got -2"),
    ((1, 2), (True, 4), "transfer of group 'kv': dst_pages must hold page ids (ints >= 0), got True"),
    ((1, "2"), (3, 4), "transfer of group 'kv': src_pages must hold page ids (ints >= 0), got '2'"),
])
def test_group_transfer_rejects(src: Any, dst: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        GroupTransfer("kv", src, dst)
    assert str(info.value) == message


@pytest.mark.parametrize("overrides, message", [
    ({"op_id": True}, "transfer command: op_id must be an int >= 0, got True"),
    ({"op_id": -1}, "transfer command: op_id must be an int >= 0, got -1"),
    ({"direction": "sideways"}, "op 7: direction must be 'writeback' or 'loadback', got 'sideways'"),
    ({"transfers": (("kv", (1,), (2,)),)},
     "op 7: transfers must be GroupTransfer records, got (('kv', (1,), (2,)),)"),
    ({"layers": (2, 0)}, "op 7: layers must be sorted and unique, got (2, 0)"),
    ({"layers": (0, 0)}, "op 7: layers must be sorted and unique, got (0, 0)"),
    ({"layers": (0, -3)}, "op 7: layers must hold layer indices (ints >= 0), got -3"),
    ({"layers": (True,)}, "op 7: layers must hold layer indices (ints >= 0), got True"),
    ({"request_id": 5}, "op 7: request_id must be a str or None, got 5"),
    ({"node_ids": (4, -1)}, "op 7: node_ids must hold node ids (ints >= 0), got -1"),
    ({"deadline_step": -2}, "op 7: deadline_step must be an int >= 0, got -2"),
    ({"deadline_step": False}, "op 7: deadline_step must be an int >= 0, got False"),
])
def test_transfer_command_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        command(**overrides)
    assert str(info.value) == message


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        ComponentSpec("kv", 0)
