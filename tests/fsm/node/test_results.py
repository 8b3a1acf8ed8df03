"""The core's result records and enums (fsm/node/results.py, fsm/node/match.py, fsm/node/writeback.py): frozen, slotted, defaults, wire
values and type hints."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from kvtier.fsm import node
from kvtier.fsm import InsertResult, LoadResult, MatchMode, MatchResult, WritePolicy


def _dummy(cls: type) -> object:
    return cls(**{f.name: None for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING})


@pytest.mark.parametrize("cls", [MatchResult, InsertResult, LoadResult])
def test_results_are_frozen_and_slotted(cls: type) -> None:
    r = _dummy(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(r, dataclasses.fields(cls)[0].name, 1)
    assert not hasattr(r, "__dict__")
    assert "__slots__" in cls.__dict__


def test_insert_result_created_defaults_to_empty() -> None:
    r = InsertResult(node=None, published_units=0, pages={}, duplicates={}, kept={})  # type: ignore[arg-type]
    assert r.created == ()


def test_enum_wire_values() -> None:
    assert [p.value for p in WritePolicy] == ["write_through", "write_through_selective", "write_back"]
    assert WritePolicy("write_through_selective") is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert [m.value for m in MatchMode] == ["prefix_reuse", "state_recovery"]


def test_page_map_alias_and_type_hints() -> None:
    assert node.PageMap == dict[str, list[int]]
    hints = typing.get_type_hints(InsertResult)
    assert hints["pages"] == dict[str, list[int]]
    typing.get_type_hints(MatchResult)
    typing.get_type_hints(LoadResult)


# --- stats, capacities -------------------------------------------------------------------

from core_helpers import h2, src  # noqa: E402

from kvtier.fsm import CacheStats, CacheCore, units_to_pages  # noqa: E402
from kvtier.fsm.errors import ConfigError, UsageError  # noqa: E402


def test_stats_start_at_zero_and_do_not_share_extra() -> None:
    s, t = CacheStats(), CacheStats()
    assert "__dataclass_fields__" in CacheStats.__dict__
    assert all(getattr(s, f.name) == 0 for f in dataclasses.fields(s) if f.name != "extra")
    assert s.extra == {} and s.extra is not t.extra
    assert s == t and dataclasses.asdict(s)["triggers"] == 0
    c = CacheCore(src(), device_pages=8, host_pages=None)
    assert c.stats == CacheStats()


def test_load_result_extra_defaults_to_a_fresh_dict() -> None:
    a = LoadResult(None, (), None, None, {})  # type: ignore[arg-type]
    b = LoadResult(None, (), None, None, {})  # type: ignore[arg-type]
    assert a.extra == {} and a.extra is not b.extra


@pytest.mark.parametrize("units, swa", [(0, 16), (8, 16), (16, 16), (20, 20), (40, 40)])
def test_units_to_pages_checkpoints_default(units: int, swa: int) -> None:
    # state groups get max(4, units // 4) checkpoints of state_pages (4 here) pages each
    assert units_to_pages(src(), units) == {"fh": units, "swa": swa}
    assert units_to_pages(src(), units, checkpoints=1) == {"fh": units, "swa": 4}


def test_capacity_zero_units_is_allowed() -> None:
    c = CacheCore(h2(), device_pages=0, host_pages=0)
    assert c is not None


@pytest.mark.parametrize("value, message", [
    (-1, "device_pages: must be an int >= 0 (units) or a mapping group -> pages, got -1"),
    (True, "device_pages: must be an int >= 0 (units) or a mapping group -> pages, got True"),
    (1.5, "device_pages: must be an int >= 0 (units) or a mapping group -> pages, got 1.5"),
    ({"a": 1, "b": 1, "zz": 2}, "device_pages: unknown cache groups ['zz']"),
    ({"a": 1}, "device_pages: no capacity for cache groups ['b']"),
    ({"a": 1, "b": -1}, "device_pages: pages of group 'b' must be an int >= 0, got -1"),
    ({"a": "3", "b": 1}, "device_pages: pages of group 'a' must be an int >= 0, got '3'"),
    ({"a": 1, "b": True}, "device_pages: pages of group 'b' must be an int >= 0, got True"),
])
def test_capacity_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        CacheCore(h2(), device_pages=value, host_pages=None)  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_a_group_may_have_zero_pages() -> None:
    c = CacheCore(h2(), device_pages={"a": 4, "b": 0}, host_pages=None)
    assert {g: a.capacity for g, a in c.device.items()} == {"a": 4, "b": 0}


# --- constructor validation --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="h2"), "layout must be a CacheLayout (see kvtier.fsm.presets.preset), got 'h2'"),
    (dict(policy="lru"), "write policy must be one of ['write_through', 'write_through_selective', "
                         "'write_back'], got 'lru'"),
    (dict(write_threshold=0), "write_threshold must be an int >= 1, got 0"),
    (dict(write_threshold=True), "write_threshold must be an int >= 1, got True"),
    (dict(world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(op_deadline_steps=0), "op_deadline_steps must be None or an int >= 1, got 0"),
    (dict(op_deadline_steps=True), "op_deadline_steps must be None or an int >= 1, got True"),
    (dict(op_deadline_steps=1.0), "op_deadline_steps must be None or an int >= 1, got 1.0"),
    (dict(host_pages=-2), "host_pages: must be an int >= 0 (units) or a mapping group -> pages, got -2"),
])
def test_constructor_errors(kwargs: dict[str, typing.Any], message: str) -> None:
    args: dict[str, typing.Any] = dict(layout=h2(), device_pages=4, host_pages=None)
    args.update(kwargs)
    layout = args.pop("layout")
    with pytest.raises(ConfigError) as exc:
        CacheCore(layout, **args)
    assert str(exc.value) == message


def test_constructor_accepts_the_boundaries_and_names_pools() -> None:
    c = CacheCore(h2(), device_pages=4, host_pages={"a": 3, "b": 5}, write_threshold=1,
                          world_size=1, op_deadline_steps=1)
    assert (c.write_threshold, c.world_size, c.op_deadline_steps) == (1, 1, 1)
    assert {g: (a.pool, a.group, a.capacity) for g, a in c.device.items()} == \
        {"a": ("device", "a", 8), "b": ("device", "b", 4)}  # 4 units: 2 pages of a, 1 of b each
    assert c.host is not None
    assert {g: (a.pool, a.group, a.capacity) for g, a in c.host.items()} == \
        {"a": ("host", "a", 3), "b": ("host", "b", 5)}
    assert CacheCore(h2(), device_pages=4).host is None


# --- fresh cache: root, ids, counters ----------------------------------------------------

from core_helpers import ack, h1, put  # noqa: E402

from kvtier.fsm.errors import KvtierError  # noqa: E402
from kvtier.fsm.records import Direction  # noqa: E402


def test_fresh_cache_root_clock_and_first_ids() -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through")
    assert (c.root.node_id, c.root.state, c.clock, c.step) == (0, "root", 0, 0)
    assert c.stats.triggers == 0
    with pytest.raises(KvtierError) as exc:
        c.node(12345)
    assert str(exc.value) == "no node 12345 in the tree"
    a = put(c, "ab").node
    assert a.node_id == 1
    # one transition (new -> device) so far: triggers counts fired events one by one
    assert c.stats.triggers == 1
    (cmd,) = c.issue_writebacks()
    assert cmd.op_id == 1 and cmd.direction is Direction.WRITEBACK
    assert c.stats.triggers == 2
    assert (c.ops_in_flight(), c.ops_in_flight(Direction.WRITEBACK), c.ops_in_flight(Direction.LOADBACK)) == (1, 1, 0)
    ack(c, cmd)
    assert c.stats.triggers == 3 and a.state == "backed"
    assert c.ops_in_flight(Direction.WRITEBACK) == 0


# --- alloc_device evicts exactly the shortfall ---------------------------------------------

from core_helpers import free, snapshot, state  # noqa: E402

from kvtier.fsm.errors import CapacityError  # noqa: E402


def test_alloc_device_evicts_only_the_shortfall() -> None:
    c = CacheCore(h1(), device_pages=4, host_pages=None)
    for k in ("a", "b", "c"):
        put(c, k)
    assert free(c) == {"kv": 1} and list(state(c).values()) == ["device"] * 3
    # exactly the free pages: nothing is evicted
    c2 = CacheCore(h1(), device_pages=4, host_pages=None)
    for k in ("a", "b", "c"):
        put(c2, k)
    assert len(c2.alloc_device({"kv": 1})["kv"]) == 1
    assert list(state(c2).values()) == ["device"] * 3 and c2.stats.device_evictions == 0
    # one page short: only the least recently used node goes
    got = c.alloc_device({"kv": 2})
    assert len(got["kv"]) == 2 and free(c) == {"kv": 0}
    assert state(c) == {2: "device", 3: "device"} and c.stats.device_evictions == 1


def test_alloc_device_without_eviction_refuses_and_changes_nothing() -> None:
    c = CacheCore(h1(), device_pages=4, host_pages=None)
    for k in ("a", "b", "c"):
        put(c, k)
    before = snapshot(c)
    with pytest.raises(CapacityError) as exc:
        c.alloc_device({"kv": 2}, evict=False)
    assert str(exc.value) == "device pool of cache group 'kv': need 2 pages, 1 free"
    assert (exc.value.needed, exc.value.free) == (2, 1)
    assert snapshot(c) == before and c.stats.device_evictions == 0


def test_caller_pages_round_trip_and_bad_frees_change_nothing() -> None:
    c = CacheCore(h1(), device_pages=8, host_pages=None)
    put(c, "a")  # the tree holds page 0
    assert c.alloc_device({"kv": 0}) == {}  # nothing asked, no entry
    got = c.alloc_device({"kv": 2})
    assert got == {"kv": [1, 2]} and c.external_pages("kv") == {1, 2} and free(c) == {"kv": 5}
    before = snapshot(c)
    for pages, error, message in [
        ({"zz": [1]}, UsageError, "free_device: unknown cache group 'zz'"),
        ({"kv": [7]}, UsageError, "free_device: pages [7] of group 'kv' are not held by a caller"),
        ({"kv": [0]}, UsageError, "free_device: pages [0] of group 'kv' are not held by a caller"),
        ({"kv": [1, 1]}, UsageError, "free_device: pages [1, 1] of group 'kv' are not held by a caller"),
        ({"kv": [1, 7]}, UsageError, "free_device: pages [7] of group 'kv' are not held by a caller"),
    ]:
        with pytest.raises(error) as exc:
            c.free_device(pages)
        assert type(exc.value) is error and str(exc.value) == message
        assert snapshot(c) == before
    c.free_device({"kv": [2, 1]})
    assert c.external_pages("kv") == frozenset() and free(c) == {"kv": 7}
    c.check_invariants()


@pytest.mark.parametrize(("need", "message"), [
    ({"zz": 1}, "unknown cache group 'zz'; groups: ['kv']"),
    ({"kv": True}, "page count for group 'kv' must be an int >= 0, got True"),
    ({"kv": -1}, "page count for group 'kv' must be an int >= 0, got -1"),
    ({"kv": 1.0}, "page count for group 'kv' must be an int >= 0, got 1.0"),
])
def test_page_counts_are_checked(need: dict, message: str) -> None:
    c = CacheCore(h1(), device_pages=8, host_pages=None)
    for call in (c.alloc_device, c.evict_device):
        with pytest.raises(UsageError) as exc:
            call(need)
        assert str(exc.value) == message
    assert free(c) == {"kv": 8}


def test_logical_clock_advances_by_one_per_use() -> None:
    c = CacheCore(h1(), device_pages=4, host_pages=None)
    assert c.clock == 0
    a = put(c, "a").node
    assert (c.clock, a.last_access) == (1, 1)
    b = put(c, "b").node
    assert (c.clock, b.last_access, a.last_access) == (2, 2, 1)
