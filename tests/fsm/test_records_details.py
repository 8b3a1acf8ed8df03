"""Record details the main record tests (test_records.py) leave open: enum values, slots,
zero indices, exact messages, type hints."""

from __future__ import annotations

import typing

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


def test_enum_values_are_the_wire_names() -> None:
    assert [d.value for d in Direction] == ["writeback", "loadback"]
    assert Direction("writeback") is Direction.WRITEBACK
    assert Direction("loadback") is Direction.LOADBACK
    assert [f.value for f in Family] == ["history", "state"]
    assert TransferCommand(0, "writeback", (), (0,)).direction is Direction.WRITEBACK


@pytest.mark.parametrize("record", [
    KV,
    CacheGroupSpec("g", "history", 4, 1, (0,), (KV,)),
    GroupTransfer("g", (0,), (1,)),
    TransferCommand(0, "loadback", (), (0,)),
    Completion(0),
])
def test_records_use_slots(record: object) -> None:
    assert not hasattr(record, "__dict__")
    assert "__slots__" in type(record).__dict__


def test_zero_indices_are_valid() -> None:
    cmd = TransferCommand(op_id=0, direction="loadback", transfers=(GroupTransfer("g", (0,), (0,)),),
                          layers=(0,), node_ids=(0,), deadline_step=0)
    assert (cmd.op_id, cmd.layers, cmd.node_ids, cmd.deadline_step) == (0, (0,), (0,), 0)
    with pytest.raises(ConfigError, match=r"^transfer command: op_id must be an int >= 0, got -1$"):
        TransferCommand(op_id=-1, direction="loadback", transfers=(), layers=(0,))
    with pytest.raises(ConfigError, match=r"^op 3: deadline_step must be an int >= 0, got -1$"):
        TransferCommand(op_id=3, direction="loadback", transfers=(), layers=(0,), deadline_step=-1)


def test_non_iterable_layers_message() -> None:
    with pytest.raises(ConfigError) as exc:
        CacheGroupSpec("g", "history", 4, 1, 5, (KV,))  # type: ignore[arg-type]
    assert str(exc.value) == "cache group 'g': layers must be a sequence of ints >= 0, got 5"


def test_type_hints_resolve() -> None:
    hints = typing.get_type_hints(CacheGroupSpec)
    assert hints["window"] == int | None
    assert hints["layers"] == tuple[int, ...]
    for cls in (ComponentSpec, GroupTransfer, TransferCommand, Completion):
        typing.get_type_hints(cls)
    assert typing.get_type_hints(TransferCommand)["deadline_step"] == int | None
    assert typing.get_type_hints(Completion)["layer"] == int | None


def test_optional_fields_default_to_none() -> None:
    cmd = TransferCommand(1, "writeback", (), (0,))
    assert cmd.request_id is None and cmd.deadline_step is None and cmd.node_ids == ()
    assert typing.get_type_hints(TransferCommand)["request_id"] == str | None
    c = Completion(1)
    assert (c.rank, c.ok, c.layer, c.is_ack) == (0, True, None, True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"op_id": "1"}, "completion for op '1': op_id must be an int >= 0, got '1'"),
    ({"op_id": True}, "completion for op True: op_id must be an int >= 0, got True"),
    ({"op_id": 1.0}, "completion for op 1.0: op_id must be an int >= 0, got 1.0"),
    ({"op_id": -1}, "completion for op -1: op_id must be an int >= 0, got -1"),
    ({"op_id": 1, "rank": 0.0}, "completion for op 1: rank must be an int >= 0, got 0.0"),
    ({"op_id": 1, "rank": -1}, "completion for op 1: rank must be an int >= 0, got -1"),
    ({"op_id": 1, "ok": "no"}, "completion for op 1: ok must be True or False, got 'no'"),
    ({"op_id": 1, "ok": 0}, "completion for op 1: ok must be True or False, got 0"),
    ({"op_id": 1, "ok": None}, "completion for op 1: ok must be True or False, got None"),
    ({"op_id": 1, "layer": True}, "completion for op 1: layer must be an int >= 0, got True"),
])
def test_completion_fields_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        Completion(**kwargs)
    assert str(exc.value) == message
    assert Completion(0, 0, False, 0) == Completion(op_id=0, rank=0, ok=False, layer=0)
