"""The copy kernel's body under the CUDA simulator, on NumPy views, with tiny grids:
random tables (odd sizes, every alignment mix, long and short rows) copy exactly the
right bytes, whatever the grid (the kernel is grid-stride)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.transfer.backend import simulator_enabled

pytestmark = pytest.mark.skipif(not simulator_enabled(),
                                reason="kernel bodies run on CPU only under NUMBA_ENABLE_CUDASIM=1")


def _launch(src: np.ndarray, dst: np.ndarray, table: np.ndarray, blocks: int, threads: int) -> None:
    from kvtier.transfer import kernels

    A = kernels.device_array
    kernels.launch_copy(A(src.view(np.uint32)), A(dst.view(np.uint32)), A(src), A(dst), A(table),
                        int(table.shape[0]), blocks, threads)


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
