"""The copy kernel's body under the CUDA simulator, on NumPy views, with tiny grids:
random tables (odd sizes, every alignment mix, long and short rows) copy exactly the
right bytes, whatever the grid (the kernel is grid-stride)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.transfer.backends import simulator_enabled

pytestmark = pytest.mark.skipif(not simulator_enabled(),
                                reason="kernel bodies run on CPU only under NUMBA_ENABLE_CUDASIM=1")


def _launch(src: np.ndarray, dst: np.ndarray, table: np.ndarray, blocks: int, threads: int) -> None:
    from kvtier.transfer import kernels

    A = kernels.device_array
    kernels.launch_copy(A(src.view(np.uint32)), A(dst.view(np.uint32)), A(src), A(dst), table, blocks, threads)


def _random_table(rng: np.random.Generator, size: int, rows: int) -> np.ndarray:
    """Rows with disjoint destinations; sources may overlap each other."""
    out = []
    cursor = 0
    for _ in range(rows):
        n = int(rng.choice([1, 3, 15, 16, 17, 31, 32, 64, 100, 160, 257]))
        gap = int(rng.integers(0, 20))
        if cursor + gap + n > size:
            break
        d = cursor + gap
        cursor = d + n
        mode = rng.integers(0, 3)
        if mode == 0:  # same alignment mod 16
            s = int(rng.integers(0, (size - n) // 16)) * 16 + d % 16
        elif mode == 1:  # same alignment mod 4 only
            s = int(rng.integers(0, (size - n) // 4 - 4)) * 4 + d % 4 + 4 * int(rng.integers(1, 3))
            s = min(s, size - n) // 4 * 4 + d % 4 if s + n > size else s
        else:
            s = int(rng.integers(0, size - n))
        out.append((s, d, n))
    return np.array(out, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("seed, blocks, threads", [(0, 1, 8), (1, 1, 32), (2, 2, 16), (3, 2, 8), (4, 1, 1)])
def test_random_tables_copy_exact_bytes(seed: int, blocks: int, threads: int) -> None:
    rng = np.random.default_rng(seed)
    size = 2048
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = rng.integers(0, 256, size, dtype=np.uint8)
    table = _random_table(rng, size, 12)
    want = dst.copy()
    for s, d, n in table:
        want[d:d + n] = src[s:s + n]
    _launch(src, dst, table, blocks, threads)
    assert np.array_equal(dst, want), np.flatnonzero(dst != want)[:20]


def test_every_alignment_pair_and_length() -> None:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1024, dtype=np.uint8)
    rows = []
    d = 0
    for sa in range(0, 16, 3):
        for da in (0, 4, 5, sa):
            n = 70 + sa + da
            rows.append((64 * len(rows) % 512 + sa, d + da, n))
            d += 128
    table = np.array(rows, dtype=np.int64)
    dst = np.zeros(d + 64, dtype=np.uint8)
    want = dst.copy()
    for s, dd, n in rows:
        want[dd:dd + n] = src[s:s + n]
    _launch(src, dst, table, 1, 16)
    assert np.array_equal(dst, want)


def test_empty_and_zero_length_rows() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    _launch(src, dst, np.array([[0, 0, 0], [4, 8, 0]], dtype=np.int64), 1, 8)
    assert not dst.any()


def _launch_runs(src: np.ndarray, dst: np.ndarray, words: np.ndarray, ref_word: int, nrefs: int, items: int,
                 piece: int, blocks: int, threads: int) -> None:
    from kvtier.transfer import kernels

    A = kernels.device_array
    kernels.launch_runs(A(src.view(np.uint32)), A(dst.view(np.uint32)), A(src), A(dst), A(words), A(words),
                        ref_word, nrefs, items, piece, blocks, threads)


@pytest.mark.parametrize("seed, piece, blocks, threads", [(0, 16, 1, 8), (1, 32, 2, 16), (2, 64, 1, 32),
                                                           (3, 48, 3, 4)])
def test_run_tables_of_real_plans(seed: int, piece: int, blocks: int, threads: int) -> None:
    """The kernel expands a planner's run table (runs x refs x pieces) exactly as
    expand_run_table says, whatever the grid."""
    from kvtier.fsm import Direction, TransferCommand
    from kvtier.transfer import DevicePool, HostPool, Planner
    from kvtier.transfer.plan import expand_run_table
    from kvtier.transfer.scenarios import random_specs

    rng = np.random.default_rng(seed)
    specs = random_specs(rng)
    host, dev = HostPool(specs, 24), DevicePool.allocate(specs, 16, "cpu")
    p = Planner(specs, host, dev, chunk_layers=2)
    from kvtier.fsm import GroupTransfer

    transfers = []
    for s in specs:
        n = int(rng.integers(1, 12))
        transfers.append(GroupTransfer(s.name, tuple(int(x) for x in rng.choice(24, n, replace=False)),
                                       tuple(int(x) for x in rng.choice(16, n, replace=False))))
    plan = p.plan(Direction.LOADBACK, [TransferCommand(1, Direction.LOADBACK, tuple(transfers), ())])
    rt = p.run_table(plan, piece)
    assert host.buffer is not None and dev.buffer is not None
    h, d = host.buffer.numpy(), dev.buffer.numpy()
    h[:] = rng.integers(0, 256, h.shape, dtype=np.uint8)
    d[:] = rng.integers(0, 256, d.shape, dtype=np.uint8)
    for chunk in plan.chunks:
        want = d.copy()
        for s_, d_, n in expand_run_table(rt, chunk.index).tolist():
            want[d_:d_ + n] = h[s_:s_ + n]
        _launch_runs(h, d, rt.packed, rt.chunk_ref_word[chunk.index], len(chunk.refs), rt.chunk_items[chunk.index],
                     piece, blocks, threads)
        assert np.array_equal(d, want), np.flatnonzero(d != want)[:20]


def test_refs_without_items_are_skipped() -> None:
    """A ref whose first item equals the next ref's (no runs) is passed over; a piece
    past the end of a short run copies nothing."""
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 512, dtype=np.uint8)
    dst = np.zeros(512, dtype=np.uint8)
    runs = [[0, 0, 2], [5, 3, 1]]  # (src page, dst page, pages)
    refs = [[0, 0, 16, 0, 0, 1, 16, 16],      # 2 runs of 16-byte pages: items 0, 1
            [0, 0, 16, 0, 2, 1, 16, 16],      # no items
            [256, 256, 20, 0, 2, 2, 20, 20]]  # 2 runs of 20-byte pages, 2 pieces each: items 2..5
    words = np.array(sum(runs, []) + sum(refs, []), dtype=np.int64)
    _launch_runs(src, dst, words, 6, 3, 6, 32, 1, 8)
    want = np.zeros(512, dtype=np.uint8)
    want[0:32] = src[0:32]
    want[48:64] = src[80:96]
    want[256:296] = src[256:296]
    want[256 + 60:256 + 80] = src[256 + 100:256 + 120]
    assert np.array_equal(dst, want), np.flatnonzero(dst != want)[:20]
