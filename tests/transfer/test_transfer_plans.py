"""Coalesced plans: merging, de-duplication, runs, conflicts, chunks, tables, caches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Direction, GroupTransfer, TransferCommand
from kvtier.transfer import DevicePool, HostPool, Planner
from kvtier.transfer.plan import layers_for, split_rows

L, W = Direction.LOADBACK, Direction.WRITEBACK


def _specs() -> list[CacheGroupSpec]:
    return [
        CacheGroupSpec("kv", "history", 4, 1, tuple(range(10)), (ComponentSpec("k", 48), ComponentSpec("ix", 37))),
        CacheGroupSpec("c", "history", 2, 4, (1, 3, 5, 7, 9), (ComponentSpec("c", 20),)),
    ]


def _planner(chunk_layers: int = 4, cache: int = 16) -> Planner:
    s = _specs()
    return Planner(s, HostPool(s, 64), DevicePool.allocate(s, 32, "cpu"), chunk_layers=chunk_layers,
                   plan_cache_size=cache)


def _cmd(op: int, direction: Direction, *transfers: tuple[str, list[int], list[int]],
         layers: tuple[int, ...] = ()) -> TransferCommand:
    return TransferCommand(op, direction, tuple(GroupTransfer(g, tuple(s), tuple(d)) for g, s, d in transfers),
                           layers)


def test_merge_dedup_sort_and_runs() -> None:
    p = _planner()
    plan = p.plan(L, [
        _cmd(1, L, ("kv", [5, 6, 7, 20], [10, 11, 12, 3])),
        _cmd(2, L, ("kv", [7, 8, 1], [12, 13, 0]), ("c", [4], [4])),
    ])
    assert not plan.rejected
    kv = next(g for g in plan.groups if g.group == "kv")
    assert kv.src.tolist() == [1, 5, 6, 7, 8, 20]
    assert kv.dst.tolist() == [0, 10, 11, 12, 13, 3]
    assert (kv.run_src.tolist(), kv.run_dst.tolist(), kv.run_len.tolist()) == ([1, 5, 20], [0, 10, 3], [1, 4, 1])
    assert kv.pages == 6 and kv.spans == 3
    assert plan.pages == 7 and plan.spans == 4


def test_conflicting_destination_rejects_only_the_commands_involved() -> None:
    p = _planner()
    plan = p.plan(L, [
        _cmd(1, L, ("kv", [1, 2], [5, 6])),
        _cmd(2, L, ("kv", [3], [6])),          # page 6 also from 2: conflict with op 1
        _cmd(3, L, ("kv", [9], [9])),
    ])
    assert sorted(plan.rejected) == [0, 1]
    assert "destination page 6 of cache group 'kv'" in plan.rejected[1]
    kv = plan.groups[0]
    assert kv.src.tolist() == [9] and kv.dst.tolist() == [9]


def test_loadback_chunks_follow_layers_and_writeback_is_one_chunk() -> None:
    p = _planner(chunk_layers=4)
    cmds = [_cmd(1, L, ("kv", [1], [1]), ("c", [2], [2]))]
    plan = p.plan(L, cmds)
    assert [c.layers for c in plan.chunks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    c0 = plan.chunks[0]
    # kv: 4 layers x 2 components, c: layers 1 and 3 x 1 component
    assert c0.tensor_refs == 10
    assert c0.nbytes == 4 * (48 + 37) + 2 * 20
    wb = p.plan(W, [_cmd(2, W, ("kv", [1], [1]))])
    assert len(wb.chunks) == 1 and wb.chunks[0].layers == tuple(range(10))


def test_command_layers_select_group_layers() -> None:
    spec = _specs()[1]
    assert layers_for(_cmd(1, L, layers=(0, 1, 2, 3)), spec) == (1, 3)
    assert layers_for(_cmd(1, L), spec) == spec.layers
    p = _planner(chunk_layers=2)
    plan = p.plan(L, [_cmd(1, L, ("kv", [1], [1]), layers=(4, 5, 6))])
    assert [c.layers for c in plan.chunks] == [(4, 5), (6,)]


def test_table_matches_runs_and_region_offsets() -> None:
    p = _planner()
    plan = p.plan(L, [_cmd(1, L, ("kv", [5, 6, 7, 20], [10, 11, 12, 3]))])
    chunk = plan.chunks[0]
    table = p.table(plan, chunk, piece_bytes=64)
    assert table.dtype == np.int64 and table.flags.c_contiguous
    rows = []
    for r in chunk.refs:
        so = p.host.region_offset(r.group, r.component, r.layer)
        do = p.device.region_offset(r.group, r.component, r.layer)
        for s, d, n in ((5, 10, 3), (20, 3, 1)):
            off = 0
            while off < n * r.page_bytes:
                rows.append((so + s * r.page_bytes + off, do + d * r.page_bytes + off,
                             min(64, n * r.page_bytes - off)))
                off += 64
    assert sorted(map(tuple, table.tolist())) == sorted(rows)
    assert int(table[:, 2].sum()) == chunk.nbytes
    assert p.table(plan, chunk, piece_bytes=64) is table  # cached on the chunk


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 200)), max_size=20),
       st.sampled_from([16, 32, 48, 4096]))
@settings(max_examples=60, deadline=None)
def test_split_rows_covers_every_byte_once(rows: list[tuple[int, int, int]], piece: int) -> None:
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    out = split_rows(arr, piece)
    assert (out[:, 2] <= piece).all() and (out[:, 2] > 0).all()
    got = sorted((int(s), int(d)) for s, d, n in out for s, d in [(s + k, d + k) for k in range(n)])
    want = sorted((s + k, d + k) for s, d, n in rows for k in range(n))
    assert got == want


def test_split_rows_rejects_bad_piece() -> None:
    with pytest.raises(ConfigError, match=r"multiple of 16, got 10"):
        split_rows(np.zeros((1, 3), dtype=np.int64), 10)


def test_plan_cache_hits_on_the_same_transfer_objects_only() -> None:
    p = _planner()
    t = GroupTransfer("kv", (1, 2, 3), (4, 5, 6))
    a = p.plan(L, [TransferCommand(1, L, (t,), ())])
    b = p.plan(L, [TransferCommand(2, L, (t,), ())])     # new op id, same transfer objects
    assert b is a
    c = p.plan(L, [TransferCommand(3, L, (GroupTransfer("kv", (1, 2, 3), (4, 5, 6)),), ())])
    assert c is not a
    assert p.counters["plan_hits"] == 1 and p.counters["plan_misses"] == 2
    p.table(a, a.chunks[0])
    p.table(c, c.chunks[0])
    assert p.counters["address_misses"] == 1 and p.counters["address_hits"] == 1
    p.clear()
    assert p.plan(L, [TransferCommand(4, L, (t,), ())]) is not a
    no_cache = _planner(cache=0)
    assert no_cache.plan(L, [TransferCommand(1, L, (t,), ())]) is not no_cache.plan(L, [TransferCommand(1, L, (t,), ())])


def test_planner_rejects_bad_settings() -> None:
    s = _specs()
    h, d = HostPool(s, 4), DevicePool.allocate(s, 4, "cpu")
    with pytest.raises(ConfigError, match=r"chunk_layers must be a positive int, got 0"):
        Planner(s, h, d, chunk_layers=0)
    with pytest.raises(ConfigError, match=r"plan_cache_size must be an int >= 0, got -1"):
        Planner(s, h, d, plan_cache_size=-1)
