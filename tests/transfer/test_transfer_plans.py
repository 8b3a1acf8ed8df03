"""Coalesced plans: merging, de-duplication, runs, conflicts, chunks, tables, caches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Direction, GroupTransfer, TransferCommand
from kvtier.transfer import DevicePool, HostPool, Planner
from kvtier.transfer.plan import (
    REF_COLS,
    REF_DST,
    REF_ITEM0,
    REF_PAGE_BYTES,
    REF_PIECES,
    REF_RUN0,
    REF_SRC,
    RUN_COLS,
    expand_run_table,
    layers_for,
    split_rows,
    split_runs,
)

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


# ----------------------------------------------------------------------------------------
# the run format (the Numba kernel expands runs x refs x pieces itself)
# ----------------------------------------------------------------------------------------
def _apply(rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = dst.copy()
    for s, d, n in rows.tolist():
        out[d:d + n] = src[s:s + n]
    return out


def _pool_bytes(p: Planner) -> tuple[np.ndarray, np.ndarray]:
    assert p.host.buffer is not None and p.device.buffer is not None
    return p.host.buffer.numpy(), p.device.buffer.numpy()


@pytest.mark.parametrize("piece", [16, 48, 64, 4096])
def test_run_table_expands_to_the_bytes_of_the_row_table(piece: int) -> None:
    p = _planner(chunk_layers=3)
    plan = p.plan(L, [_cmd(1, L, ("kv", [5, 6, 7, 8, 9, 20, 30, 31], [10, 11, 12, 13, 14, 3, 0, 1]),
                            ("c", [1, 2, 3], [7, 8, 9]))])
    rt = p.run_table(plan, piece)
    assert p.run_table(plan, piece) is rt  # cached on the plan
    rng = np.random.default_rng(piece)
    host, dev = _pool_bytes(p)
    host[:] = rng.integers(0, 256, host.shape, dtype=np.uint8)
    dev[:] = rng.integers(0, 256, dev.shape, dtype=np.uint8)
    for chunk in plan.chunks:
        rows = expand_run_table(rt, chunk.index)
        assert rows.shape[0] == rt.chunk_items[chunk.index]
        assert (rows[:, 2] > 0).all() and (rows[:, 2] <= piece).all()
        assert int(rows[:, 2].sum()) == chunk.nbytes
        # destinations never overlap: every byte is written once
        cover = np.zeros(dev.shape[0], dtype=np.int64)
        for _, d, n in rows.tolist():
            cover[d:d + n] += 1
        assert cover.max() == 1
        want = _apply(p.table(plan, chunk, piece_bytes=piece), host, dev)
        assert np.array_equal(_apply(rows, host, dev), want)


def test_run_table_layout_and_size() -> None:
    p = _planner(chunk_layers=4)
    pages = list(range(0, 64, 2))  # 32 runs of one page
    plan = p.plan(L, [_cmd(1, L, ("kv", pages, list(range(32))))])
    rt = p.run_table(plan, 64)
    # the group's largest page is 48 bytes: runs of at most 64 // 48 = 1 page, one piece each
    assert rt.seg_pages == (1,) and rt.runs.shape == (32, RUN_COLS)
    assert rt.runs[:, 0].tolist() == pages and rt.runs[:, 2].tolist() == [1] * 32
    c0 = rt.chunk_refs[0]
    assert c0.shape == (len(plan.chunks[0].refs), REF_COLS)
    assert c0[:, REF_ITEM0].tolist() == [32 * i for i in range(c0.shape[0])]
    assert rt.chunk_ref_word[0] == RUN_COLS * 32
    for r, row in zip(plan.chunks[0].refs, c0.tolist()):
        assert row[REF_SRC] == p.host.region_offset(r.group, r.component, r.layer)
        assert row[REF_DST] == p.device.region_offset(r.group, r.component, r.layer)
        assert row[REF_PAGE_BYTES] == r.page_bytes and row[REF_RUN0] == 0 and row[REF_PIECES] == 1
    # uploaded words: runs once + a row per ref, not runs x refs rows
    n_refs = sum(len(c.refs) for c in plan.chunks)
    assert rt.packed.shape == (RUN_COLS * 32 + REF_COLS * n_refs,) and rt.nbytes == rt.packed.nbytes
    assert rt.nbytes < sum(p.table(plan, c, 64).nbytes for c in plan.chunks) / 4
    # a page larger than a piece: one page per run, several pieces per run
    big = p.run_table(plan, 16)
    assert big.seg_pages == (1,) and big.chunk_refs[0][0, REF_PIECES] == 3  # 48-byte page, 16-byte pieces


def test_run_table_splits_long_runs_and_uses_the_given_buffer() -> None:
    p = _planner()
    plan = p.plan(W, [_cmd(1, W, ("c", list(range(20)), list(range(40, 60))))])  # one run of 20 pages
    seen: list[np.ndarray] = []

    def alloc(words: int) -> np.ndarray:
        seen.append(np.full(words, -1, dtype=np.int64))
        return seen[-1]

    rt = p.run_table(plan, 64, alloc)  # 20-byte pages: runs of at most 3 pages
    assert rt.packed is seen[0] and (rt.packed >= 0).all()
    assert rt.seg_pages == (3,)
    assert rt.runs.tolist() == [[s, 40 + s, min(3, 20 - s)] for s in range(0, 20, 3)]
    with pytest.raises(ConfigError, match=r"alloc\(\d+\) must return a 1-D int64 array"):
        p.run_table(p.plan(W, [_cmd(2, W, ("c", [1], [2]))]), 64, lambda n: np.empty(n, dtype=np.int32))
    with pytest.raises(ConfigError, match=r"multiple of 16, got 40"):
        p.run_table(plan, 40)


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 50)), max_size=12),
       st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_split_runs_covers_every_page_once(runs: list[tuple[int, int, int]], most: int) -> None:
    a = np.array(runs, dtype=np.int64).reshape(-1, 3)
    s, d, n = split_runs(a[:, 0], a[:, 1], a[:, 2], most)
    assert (n <= most).all() and (n > 0).all()
    got = sorted((int(x) + k, int(y) + k) for x, y, m in zip(s, d, n) for k in range(int(m)))
    assert got == sorted((x + k, y + k) for x, y, m in runs for k in range(m))


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_run_table_random_plans_match_the_row_table(data: st.DataObject) -> None:
    comps = data.draw(st.lists(st.sampled_from([1, 3, 16, 20, 37, 48, 64, 100, 128]), min_size=1, max_size=3))
    spec = CacheGroupSpec("g", "history", 4, 1, (0, 1, 2), tuple(ComponentSpec(f"c{i}", b) for i, b in enumerate(comps)))
    p = Planner([spec], HostPool([spec], 24), DevicePool.allocate([spec], 16, "cpu"), chunk_layers=2)
    dst = data.draw(st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True))
    src = data.draw(st.lists(st.integers(0, 23), min_size=len(dst), max_size=len(dst), unique=True))
    piece = data.draw(st.sampled_from([16, 32, 64, 256]))
    plan = p.plan(L, [_cmd(1, L, ("g", sorted(src), sorted(dst)))])
    rt = p.run_table(plan, piece)
    host, dev = _pool_bytes(p)
    host[:] = np.arange(host.shape[0], dtype=np.int64).astype(np.uint8)
    for chunk in plan.chunks:
        rows = expand_run_table(rt, chunk.index)
        assert (rows[:, 2] > 0).all() and (rows[:, 2] <= piece).all()
        assert np.array_equal(_apply(rows, host, dev), _apply(p.table(plan, chunk, piece), host, dev))


def test_check_same_pages_reads_running_marks_of_the_queued_pages() -> None:
    from kvtier.fsm import UsageError

    p = _planner()
    queued = []
    for op in range(40):  # forty queued writebacks: device page op % 16 read, host page op written
        c = _cmd(op, W, ("kv", [op % 16], [op]))
        p.check_same_pages(c, [])
        p.queue(c)
        queued.append(c)
    seen: list[int] = []
    real = p._pages_of
    p._pages_of = lambda c: (seen.append(c.op_id), real(c))[1]  # type: ignore[method-assign]
    # no conflict: only the new command's own pages are read, not the queue's
    p.check_same_pages(_cmd(103, L, ("kv", [50, 51], [20, 21]), ("c", [3], [4])), queued)
    assert seen == [103]
    # a conflict: the queue is searched only to name the op
    with pytest.raises(UsageError, match=r"op 100: device page 15 of cache group 'kv' is written by it and read "
                                         r"by op 15 queued for the same flush \(loadback 100, writeback 15\)"):
        p.check_same_pages(_cmd(100, L, ("kv", [50, 51], [20, 15]), ("c", [0], [5])), queued)
    p._pages_of = real  # type: ignore[method-assign]
    # host side: a loadback reading a host page a queued writeback writes
    with pytest.raises(UsageError, match=r"op 104: host page 12 of cache group 'kv' is read by it and written by op 12"):
        p.check_same_pages(_cmd(104, L, ("kv", [12], [20])), queued)
    # another group's pages never conflict with these
    p.check_same_pages(_cmd(105, L, ("c", [12], [15])), queued)


def test_unqueue_clears_the_marks_and_keeps_the_remaining_commands() -> None:
    from kvtier.fsm import UsageError

    p = _planner()
    a, b = _cmd(1, W, ("kv", [3], [10])), _cmd(2, W, ("kv", [4], [11]))
    for c in (a, b):
        p.queue(c)
    lb = _cmd(5, L, ("kv", [20], [3]))
    with pytest.raises(UsageError, match=r"device page 3 .* by op 1 "):
        p.check_same_pages(lb, [a, b])
    p.unqueue(W, [b])  # op 1 taken out of the queue (a cancel): op 2 stays
    p.check_same_pages(lb, [b])
    with pytest.raises(UsageError, match=r"device page 4 .* by op 2 "):
        p.check_same_pages(_cmd(6, L, ("kv", [20], [4])), [b])
    p.unqueue(W)  # flushed: nothing queued any more
    for side in ("device", "host"):
        assert not p._marks(W, side, "kv").any()
    p.check_same_pages(_cmd(7, L, ("kv", [11], [4])), [])
    # the same pages once more in a later flush are refused again
    p.queue(b)
    with pytest.raises(UsageError, match=r"host page 11 .* written by op 2"):
        p.check_same_pages(_cmd(8, L, ("kv", [11], [9])), [b])
