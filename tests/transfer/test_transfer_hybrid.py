"""Array page ids end to end, the hybrid backend's selection logic, its split between
the SM kernel (the CUDA simulator) and batched copies (``memmove`` on CPU pools), and
its statistics."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, ConfigError, Direction, GroupTransfer, \
    TransferCommand
from kvtier.transfer import (
    ArrayCommand,
    BackendUnavailable,
    Calibration,
    DevicePool,
    DriverBatchCopier,
    HostBatchCopier,
    HostPool,
    PageArrays,
    Planner,
    TransferEngine,
)
from kvtier.transfer.arrays import as_array_command
from kvtier.transfer.backends import simulator_enabled
from kvtier.transfer.backends.hybrid_choice import CE, DEFAULT_CALIBRATION, SM, copy_bytes, engine_for
from kvtier.transfer.scenarios import check_pools, check_protocol, random_commands, random_pools, random_specs, reference

L, W = Direction.LOADBACK, Direction.WRITEBACK
SIM = simulator_enabled()
needs_sim = pytest.mark.skipif(not SIM, reason="the kernel part runs here only under NUMBA_ENABLE_CUDASIM=1")


def _cal(sm: float = 50.0, ce: tuple[float, ...] = (5.0, 40.0, 60.0),
         pair: tuple[float, ...] = (4.0, 30.0, 50.0)) -> Calibration:
    """Sizes 16, 64, 256 bytes (the test pools' page sizes)."""
    return Calibration((16, 64, 256), {L: (sm,) * 3, W: (sm,) * 3}, {L: ce, W: ce}, {L: pair, W: pair},
                       source="test")


# ----------------------------------------------------------------------------------------
# selection logic (pure)
# ----------------------------------------------------------------------------------------
def test_crossovers_alone_and_busy() -> None:
    c = _cal()
    # alone: batched copies win from 256 B (60 >= 50); busy: from 64 B (30 >= 1/(1/50+1/50) = 25)
    assert c.crossover(L, busy=False) == 256 and c.crossover(W, busy=False) == 256
    assert c.crossover(L, busy=True) == 64 and c.crossover(W, busy=True) == 64
    assert c.crossovers() == {"loadback": 256, "loadback_busy": 64, "writeback": 256, "writeback_busy": 64}
    assert engine_for(255.9, L, False, c) == SM and engine_for(256, L, False, c) == CE
    assert engine_for(63, W, True, c) == SM and engine_for(64, W, True, c) == CE
    assert engine_for(1 << 20, L, False, None) == SM


def test_crossover_needs_every_larger_size_to_win_and_can_be_none() -> None:
    # a win at 16 B that is lost at 64 B does not count: the crossover is 256
    c = Calibration((16, 64, 256), {L: (5, 50, 50), W: (5, 50, 50)}, {L: (6, 40, 60), W: (6, 40, 60)},
                    {L: (0, 0, 0), W: (0, 0, 0)})
    assert c.crossover(L, False) == 256
    assert c.crossover(L, True) is None  # batched copies both ways never measured faster
    assert engine_for(10_000, W, True, c) == SM


def test_calibration_round_trip_and_errors() -> None:
    c = _cal()
    d = c.as_dict()
    assert d["crossovers"]["writeback_busy"] == 64 and d["source"] == "test"
    back = Calibration.from_dict(d)
    assert back.sizes == c.sizes and back.ce_gbps == c.ce_gbps and back.crossovers() == c.crossovers()
    with pytest.raises(ConfigError, match=r"sizes must be positive and ascending, got \(64, 16\)"):
        Calibration((64, 16), {L: (1, 1), W: (1, 1)}, {L: (1, 1), W: (1, 1)}, {L: (1, 1), W: (1, 1)})
    with pytest.raises(ConfigError, match=r"ce_gbps\[writeback\] must be 2 finite GB/s values"):
        Calibration((16, 64), {L: (1, 1), W: (1, 1)}, {L: (1, 1), W: (1,)}, {L: (1, 1), W: (1, 1)})
    with pytest.raises(ConfigError, match=r"sm_gbps has no row for loadback"):
        Calibration((16,), {W: (1,)}, {L: (1,), W: (1,)}, {L: (1,), W: (1,)})
    with pytest.raises(ConfigError, match=r"malformed calibration data"):
        Calibration.from_dict({"sizes": [16]})


def test_default_calibration_follows_the_measured_h200_figures() -> None:
    # bench/RESULTS.md: batched copies 5 GB/s at 4 KiB (kernel ~50), 55 GB/s at 64 KiB
    assert DEFAULT_CALIBRATION.crossover(L, False) == 64 * 1024
    assert DEFAULT_CALIBRATION.crossover(L, True) == 32 * 1024
    assert engine_for(copy_bytes(8192, 8192, 4096), L, True, DEFAULT_CALIBRATION) == SM
    assert engine_for(copy_bytes(100, 50, 16384), L, True, DEFAULT_CALIBRATION) == CE  # runs of 2 x 16 KiB


# ----------------------------------------------------------------------------------------
# array records and the planner's array path
# ----------------------------------------------------------------------------------------
def test_page_arrays_copy_and_validate() -> None:
    src = np.array([3, 1, 2], dtype=np.int32)
    pa = PageArrays("kv", src, [7, 8, 9])
    src[0] = 99  # the record holds its own copy
    assert pa.src_pages.tolist() == [3, 1, 2] and pa.dst_pages.dtype == np.int64 and pa.pages == 3
    assert not pa.src_pages.flags.writeable
    assert PageArrays("kv", torch.tensor([1, 2]), np.array([1, 2], dtype=np.uint16)).src_pages.tolist() == [1, 2]
    assert PageArrays("kv", [], []).pages == 0
    for bad, msg in [((np.array([1.0]), [1]), r"src_pages must hold integer page ids, got dtype float64"),
                     ((np.array([True]), [1]), r"src_pages must hold integer page ids, got dtype bool"),
                     ((np.zeros((2, 2), dtype=np.int64), [1, 2]), r"src_pages must be one-dimensional"),
                     (([1, -4], [1, 2]), r"src_pages holds page id -4"),
                     (([1], np.array([2**40])), r"dst_pages holds page id 1099511627776"),
                     (([1, 2], [1]), r"2 source pages but 1 destination pages"),
                     (("ab", [1, 2]), r"src_pages must hold integer page ids")]:
        with pytest.raises(ConfigError, match=msg):
            PageArrays("kv", *bad)
    with pytest.raises(ConfigError, match=r"group must be a str"):
        PageArrays(3, [1], [1])  # type: ignore[arg-type]


def test_array_command_checks_and_converts() -> None:
    c = ArrayCommand(5, "loadback", (GroupTransfer("kv", (1, 2), (3, 4)),), (0, 2))  # type: ignore[arg-type]
    assert c.direction is L and isinstance(c.transfers[0], PageArrays) and c.transfers[0].dst_pages.tolist() == [3, 4]
    for args, msg in [((-1, L, ()), r"op_id must be an int >= 0, got -1"),
                      ((True, L, ()), r"op_id must be an int >= 0, got True"),
                      ((1, "up", ()), r"direction must be 'writeback' or 'loadback', got 'up'"),
                      ((1, L, ("x",)), r"transfers must be PageArrays \(or GroupTransfer\) records, got str"),
                      ((1, L, (), (2, 1)), r"layers must be sorted and unique, got \(2, 1\)"),
                      ((1, L, (), (-1,)), r"layers must be layer indices")]:
        with pytest.raises(ConfigError, match=msg):
            ArrayCommand(*args)  # type: ignore[arg-type]
    tc = TransferCommand(9, W, (GroupTransfer("kv", (1,), (2,)),), ())
    ac = as_array_command(tc)
    assert ac.op_id == 9 and ac.direction is W and ac.transfers[0].src_pages.tolist() == [1]
    assert as_array_command(ac) is ac
    with pytest.raises(ConfigError, match=r"expected a TransferCommand or ArrayCommand, got int"):
        as_array_command(3)  # type: ignore[arg-type]


def _planner() -> Planner:
    s = [CacheGroupSpec("kv", "history", 4, 1, tuple(range(4)), (ComponentSpec("k", 48),))]
    return Planner(s, HostPool(s, 64), DevicePool.allocate(s, 32, "cpu"))


def test_distinct_destinations_keep_their_order_and_find_runs_unsorted() -> None:
    p = _planner()
    cmd = ArrayCommand(1, L, (PageArrays("kv", [9, 10, 11, 3, 40, 41], [5, 6, 7, 0, 20, 21]),))
    g = p.plan(L, [cmd]).groups[0]
    assert g.src.tolist() == [9, 10, 11, 3, 40, 41]  # no sort
    assert (g.run_src.tolist(), g.run_dst.tolist(), g.run_len.tolist()) == ([9, 3, 40], [5, 0, 20], [3, 1, 2])
    # two commands: runs continue across them; a repeated destination takes the sorting path
    two = [ArrayCommand(2, L, (PageArrays("kv", [1, 2], [1, 2]),)), ArrayCommand(3, L, (PageArrays("kv", [3], [3]),))]
    g = p.plan(L, two).groups[0]
    assert (g.run_src.tolist(), g.run_len.tolist()) == ([1], [3])
    dup = [ArrayCommand(4, L, (PageArrays("kv", [8, 1], [4, 2]),)), ArrayCommand(5, L, (PageArrays("kv", [8], [4]),))]
    g = p.plan(L, dup).groups[0]
    assert g.src.tolist() == [1, 8] and g.dst.tolist() == [2, 4]
    bad = [ArrayCommand(6, L, (PageArrays("kv", [8], [4]),)), ArrayCommand(7, L, (PageArrays("kv", [9], [4]),))]
    assert sorted(p.plan(L, bad).rejected) == [0, 1]


@pytest.mark.parametrize("backend", ["cpu", "fake-async", pytest.param("numba", marks=needs_sim),
                                     pytest.param("hybrid", marks=needs_sim)])
def test_array_commands_move_the_same_bytes(backend: str) -> None:
    for seed in range(3):
        rng = np.random.default_rng(400 + seed)
        specs = random_specs(rng, 2)
        host, dev = random_pools(rng, specs, registered=False)
        opts: dict[str, Any] = {"threads": 8, "piece_bytes": 64} if backend in ("numba", "hybrid") else {}
        if backend == "hybrid":
            opts["calibration"] = _cal()
        eng = TransferEngine(specs, host, dev, backend, backend_options=opts, chunk_layers=2)
        cmds = random_commands(rng, specs, host, dev)
        want = reference(specs, host, dev, cmds)
        for c in cmds:
            eng.submit(as_array_command(c))
        eng.flush()
        comps: list[Completion] = []
        fake = getattr(eng.backend, "complete_all", None)
        if fake is not None:
            fake()
        comps += eng.poll_completions()
        check_protocol(cmds, comps)
        check_pools(host, dev, want)


def test_submit_checks_array_pages_against_the_pools() -> None:
    s = [CacheGroupSpec("kv", "history", 4, 1, (0, 1), (ComponentSpec("k", 16),))]
    eng = TransferEngine(s, HostPool(s, 8), DevicePool.allocate(s, 4, "cpu"), "cpu")
    with pytest.raises(ConfigError, match=r"op 1: device page 4 of cache group 'kv' is out of range"):
        eng.submit(ArrayCommand(1, L, (PageArrays("kv", [0, 1], [3, 4]),)))
    with pytest.raises(ConfigError, match=r"submit\(\) takes a TransferCommand or ArrayCommand, got dict"):
        eng.submit({})  # type: ignore[arg-type]
    assert eng.queued == ()


# ----------------------------------------------------------------------------------------
# batch copiers
# ----------------------------------------------------------------------------------------
def test_host_batch_copier_copies_exact_ranges() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    src = np.array([0, 100, 1000, 4000], dtype=np.uint64) + np.uint64(a.ctypes.data)
    dst = np.array([3000, 0, 50, 10], dtype=np.uint64) + np.uint64(b.ctypes.data)
    sizes = np.array([96, 17, 1, 0], dtype=np.uint64)
    assert HostBatchCopier().copy(L, dst, src, sizes, 0) == 1
    want = np.zeros(4096, dtype=np.uint8)
    want[3000:3096] = a[0:96]
    want[0:17] = a[100:117]
    want[50] = a[1000]
    assert np.array_equal(b, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA driver")
def test_driver_copier_without_a_driver_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match=r"copy engines: no cuMemcpyBatchAsync"):
        DriverBatchCopier(0)


# ----------------------------------------------------------------------------------------
# the hybrid backend under the simulator: split, busy state, waits, statistics
# ----------------------------------------------------------------------------------------
def _hybrid_engine(cal: Calibration, page_bytes: tuple[int, ...] = (16, 256), **opts: Any) -> TransferEngine:
    s = [CacheGroupSpec("g", "history", 4, 1, (0, 1, 2, 3), tuple(ComponentSpec(f"c{b}", b) for b in page_bytes))]
    host, dev = HostPool(s, 32), DevicePool.allocate(s, 32, "cpu")
    g = torch.Generator().manual_seed(5)
    for pool in (host, dev):
        buf = pool.single_buffer()
        assert buf is not None
        buf.copy_(torch.randint(0, 256, tuple(buf.shape), generator=g, dtype=torch.uint8))
    return TransferEngine(s, host, dev, "hybrid", chunk_layers=2,
                          backend_options={"threads": 8, "piece_bytes": 64, "calibration": cal, **opts})


def _cmd(op: int, d: Direction, src: list[int], dst: list[int]) -> ArrayCommand:
    return ArrayCommand(op, d, (PageArrays("g", src, dst),))


def _check_moved(eng: TransferEngine, cmds: list[ArrayCommand]) -> None:
    for c in cmds:
        src_side, dst_side = ("host", "device") if c.direction is L else ("device", "host")
        t = c.transfers[0]
        for comp in eng.specs["g"].components:
            for layer in range(4):
                got = eng.read_pages(dst_side, "g", comp.name, layer, t.dst_pages.tolist())
                want = eng.read_pages(src_side, "g", comp.name, layer, t.src_pages.tolist())
                assert torch.equal(got, want), (c.op_id, comp.name, layer)


@needs_sim
def test_alone_small_refs_on_the_kernel_large_on_the_copy_engines() -> None:
    eng = _hybrid_engine(_cal())
    cmd = _cmd(1, L, [5, 9, 2], [0, 1, 30])
    eng.submit(cmd)
    eng.flush()
    comps = eng.poll_completions()
    assert [c.op_id for c in comps if c.layer is None] == [1]
    _check_moved(eng, [cmd])
    st = eng.stats()
    lb = st["cumulative"]["loadback"]
    # 16 B pages on the kernel, 256 B pages (>= the 256 B crossover) as batched copies
    assert lb["sm_bytes"] == 3 * 16 * 4 and lb["ce_bytes"] == 3 * 256 * 4
    assert lb["sm_bytes"] + lb["ce_bytes"] == lb["bytes"]
    assert lb["ce_copies"] == 3 * 4 and lb["ce_calls"] == 2 and lb["kernel_launches"] == 2
    assert lb["max_blocks"] == 6 and lb["waits"] == 0  # 6 work items (3 runs x 2 layers), one block each at 8 threads
    b = st["backend"]
    assert b["name"] == "hybrid" and b["copier"] == "memmove"
    assert b["calibration"]["crossovers"]["loadback"] == 256


@needs_sim
def test_both_directions_busy_lower_the_crossover() -> None:
    eng = _hybrid_engine(_cal(), page_bytes=(64,))
    eng.submit(_cmd(1, L, [1, 2], [3, 4]))
    eng.flush()
    assert eng.stats()["last_flush"]["loadback"]["ce_bytes"] == 0  # alone: 64 B < 256 B
    cmds = [_cmd(2, L, [5, 6], [7, 8]), _cmd(3, W, [9, 10], [11, 12])]
    for c in cmds:
        eng.submit(c)
    eng.flush()
    last = eng.stats()["last_flush"]
    assert last["loadback"]["ce_bytes"] == 2 * 64 * 4 and last["loadback"]["sm_bytes"] == 0
    assert last["writeback"]["ce_bytes"] == 2 * 64 * 4
    eng.poll_completions()
    _check_moved(eng, cmds)


class _Pending:
    """A loadback event that has not completed yet."""

    def done(self) -> bool:
        return False

    @property
    def error(self) -> BaseException | None:
        return None


@needs_sim
def test_writeback_kernel_part_waits_for_a_running_loadback() -> None:
    eng = _hybrid_engine(_cal(), page_bytes=(16,))
    backend: Any = eng.backend
    backend._last[L] = _Pending()
    eng.submit(_cmd(1, W, [1, 2], [3, 4]))
    eng.flush()
    wb = eng.stats()["last_flush"]["writeback"]
    assert wb["waits"] == 1 and wb["sm_bytes"] == 2 * 16 * 4
    # a loadback never waits, and a writeback without a running loadback does not either
    eng.poll_completions()
    eng.submit(_cmd(2, L, [1], [1]))
    eng.flush()
    assert eng.stats()["last_flush"]["loadback"]["waits"] == 0
    eng.submit(_cmd(3, W, [5], [6]))
    eng.flush()
    assert eng.stats()["last_flush"]["writeback"]["waits"] == 0
    off = _hybrid_engine(_cal(), page_bytes=(16,), writeback_waits=False)
    b2: Any = off.backend
    b2._last[L] = _Pending()
    off.submit(_cmd(1, W, [1], [2]))
    off.flush()
    assert off.stats()["last_flush"]["writeback"]["waits"] == 0


@needs_sim
@pytest.mark.parametrize("seed", range(4))
def test_random_plans_hybrid_simulator(seed: int) -> None:
    rng = np.random.default_rng(600 + seed)
    specs = random_specs(rng, 3)
    host, dev = random_pools(rng, specs, registered=seed == 3)
    # crossover at 48 B alone: the scenario's page sizes (1-128 B) fall on both sides
    cal = Calibration((16, 48), {L: (50, 50), W: (50, 50)}, {L: (1, 60), W: (1, 60)}, {L: (1, 60), W: (1, 60)})
    eng = TransferEngine(specs, host, dev, "hybrid", chunk_layers=int(rng.integers(1, 4)),
                         backend_options={"threads": 8, "piece_bytes": 32, "calibration": cal})
    cmds = random_commands(rng, specs, host, dev)
    want = reference(specs, host, dev, cmds)
    for c in cmds:
        eng.submit(c)
    eng.flush()
    check_protocol(cmds, eng.poll_completions())
    check_pools(host, dev, want)
    for d in ("loadback", "writeback"):
        s = eng.stats()["cumulative"][d]
        assert s["sm_bytes"] + s["ce_bytes"] == s["bytes"]


@needs_sim
def test_hybrid_settings_are_checked() -> None:
    s = [CacheGroupSpec("g", "history", 4, 1, (0,), (ComponentSpec("c", 16),))]
    host, dev = HostPool(s, 4), DevicePool.allocate(s, 4, "cpu")
    with pytest.raises(ConfigError, match=r"calibration must be 'auto', 'measure', 'default'"):
        TransferEngine(s, host, dev, "hybrid", backend_options={"calibration": "fast"})
    with pytest.raises(ConfigError, match=r"calibration='measure' needs a GPU"):
        TransferEngine(s, host, dev, "hybrid", backend_options={"calibration": "measure"})
    with pytest.raises(ConfigError, match=r"copier must be a BatchCopier"):
        TransferEngine(s, host, dev, "hybrid", backend_options={"copier": object()})
    eng = TransferEngine(s, host, dev, "hybrid", backend_options={"calibration": _cal().as_dict()})
    assert eng.stats()["backend"]["calibration"]["source"] == "test"
    assert TransferEngine(s, host, dev, "hybrid").stats()["backend"]["calibration"]["source"].startswith("default")
