"""The page-major host layout and the staging path (hybrid backend) under the CUDA simulator.

The staging path gathers a writeback's device pages into a staging slot and copies the
slot to contiguous host extents (a loadback: the mirror); these tests check that the bytes
land exactly where the plain index copies put them, for both host layouts, per layer
chunk, with a ring smaller than the flush, and with both directions in one flush.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Direction
from kvtier.transfer import ArrayCommand, DevicePool, HostPool, PageArrays, TransferEngine
from kvtier.transfer.backends import simulator_enabled
from kvtier.transfer.backends.staging import StagingRing, host_extents, ramp_cap
from kvtier.transfer.scenarios import (check_pools, check_protocol, random_commands, random_pools, random_specs,
                                       reference)

L, W = Direction.LOADBACK, Direction.WRITEBACK

needs_sim = pytest.mark.skipif(not simulator_enabled(), reason="needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")

#: A calibration in which the copy engines win at every size: the staging path is chosen
#: wherever a group can be staged.
CE_WINS = {"sizes": [1], "sm_gbps": {"loadback": [1.0], "writeback": [1.0]},
           "ce_gbps": {"loadback": [100.0], "writeback": [100.0]},
           "ce_pair_gbps": {"loadback": [100.0], "writeback": [100.0]}, "source": "test: copy engines win"}


def staging_options(staging_bytes: int = 16384, slots: int = 2) -> dict[str, object]:
    return {"calibration": CE_WINS, "staging_bytes": staging_bytes, "staging_slots": slots, "staging_min_bytes": 1,
           "staging_one_way": True}


def kv_specs(layers: int = 6, comps: tuple[int, ...] = (64, 32)) -> list[CacheGroupSpec]:
    return [CacheGroupSpec("kv", "history", 16, 1, tuple(range(layers)),
                           tuple(ComponentSpec(f"c{i}", b) for i, b in enumerate(comps)))]


def fill(host: HostPool, dev: DevicePool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in (host, dev):
        assert pool.buffer is not None
        pool.buffer.copy_(torch.randint(0, 256, tuple(pool.buffer.shape), generator=g, dtype=torch.uint8))


def run(eng: TransferEngine, cmds: list[ArrayCommand]) -> list[object]:
    for c in cmds:
        eng.submit(c)
    eng.flush()
    eng.synchronize()
    return list(eng.poll_completions())


def test_page_major_layout_puts_every_layer_of_a_page_together() -> None:
    specs = kv_specs(layers=3, comps=(48, 20))
    specs.append(CacheGroupSpec("s", "state", 1, 1, (1,), (ComponentSpec("x", 16),), window=4))
    host = HostPool(specs, {"kv": 5, "s": 3}, pin=False, layout="page")
    base, stride = host.group_block("kv")
    assert stride == 3 * (48 + 20) // 16 * 16 + 16 == 208  # 204 bytes rounded up to 16
    for p in range(5):
        at = host.base_ptr + base + p * stride
        for layer in range(3):
            assert host.region("kv", "c0", layer)[p].data_ptr() == at + layer * 68
            assert host.region("kv", "c1", layer)[p].data_ptr() == at + layer * 68 + 48
    assert host.page_stride("kv", "c1", 2) == 208 and host.page_major
    s_base, s_stride = host.group_block("s")
    assert s_base % 256 == 0 and s_base >= base + 5 * 208 and s_stride == 16
    assert host.layer_view("kv", "c0") is None  # strided regions: no [layers, pages, bytes] view
    layer_first = HostPool(specs, {"kv": 5, "s": 3}, pin=False)
    assert not layer_first.page_major and layer_first.page_stride("kv", "c1", 2) == 20
    with pytest.raises(ConfigError, match="page-major host pool"):
        layer_first.group_block("kv")
    with pytest.raises(ConfigError, match=r"layout must be one of \('layer', 'page'\), got 'rows'"):
        HostPool(specs, 2, pin=False, layout="rows")


@needs_sim
@pytest.mark.parametrize("backend", ["cpu", "numba", "hybrid"])
@pytest.mark.parametrize("layout", ["layer", "page"])
def test_plain_paths_land_pages_exactly_in_either_host_layout(backend: str, layout: str) -> None:
    for seed in range(4):
        rng = np.random.default_rng(seed)
        specs = random_specs(rng)
        host, dev = random_pools(rng, specs, registered=bool(seed % 2), host_layout=layout)
        opts = {"calibration": "default", "staging_bytes": 0} if backend == "hybrid" else {}
        eng = TransferEngine(specs, host, dev, backend, backend_options=opts, chunk_layers=2)
        cmds = random_commands(rng, specs, host, dev)
        want = reference(specs, host, dev, cmds)
        check_protocol(cmds, run(eng, cmds))  # type: ignore[arg-type]
        check_pools(host, dev, want)


@needs_sim
def test_staging_lands_pages_exactly_where_the_plain_path_does() -> None:
    staged = {L: 0, W: 0}
    for seed in range(10):
        rng = np.random.default_rng(seed)
        specs = random_specs(rng)
        host, dev = random_pools(rng, specs, registered=False, host_layout="page")
        eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(), chunk_layers=2)
        cmds = random_commands(rng, specs, host, dev)
        want = reference(specs, host, dev, cmds)
        check_protocol(cmds, run(eng, cmds))  # type: ignore[arg-type]
        check_pools(host, dev, want)
        cum = eng.stats()["cumulative"]
        for d in (L, W):
            staged[d] += cum[d.value]["stage_bytes"]
    assert staged[L] > 0 and staged[W] > 0


@needs_sim
def test_layerwise_loadback_stages_each_chunk_and_reports_its_layers() -> None:
    specs = kv_specs(layers=6)
    host = HostPool(specs, 40, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 40, "cpu")
    fill(host, dev)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(1 << 20), chunk_layers=2)
    hp = np.arange(10, 30)  # one host extent
    dp = np.random.default_rng(1).permutation(40)[:20]
    want = {(c, layer): host.region("kv", c, layer)[torch.as_tensor(hp)].clone()
            for c in ("c0", "c1") for layer in range(6)}
    comps = run(eng, [ArrayCommand(7, L, (PageArrays("kv", hp, dp),))])
    assert [(c.op_id, c.layer, c.ok) for c in comps] == [(7, 1, True), (7, 3, True), (7, 5, True), (7, None, True)]
    for (c, layer), data in want.items():
        assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(dp)], data), (c, layer)
    last = eng.stats()["last_flush"]["loadback"]
    # per chunk one pitched copy (2 of 6 layers of each host page) and one scatter launch
    assert (last["chunks"], last["stage_bytes"], last["stage_copies"], last["kernel_launches"]) == (3, 20 * 6 * 96,
                                                                                                   3, 3)
    assert last["sm_bytes"] == 0 and last["ce_bytes"] == 0
    eng.wait_layer(7, 3)  # acknowledged: returns at once


@needs_sim
def test_a_flush_larger_than_the_ring_reuses_slots_in_turn() -> None:
    specs = kv_specs(layers=4, comps=(64,))
    host = HostPool(specs, 64, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 64, "cpu")
    fill(host, dev, seed=3)
    # 2 slots of 1024 bytes per direction; a host page is 256 bytes: 4 pages per slot
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(4096, 2))
    dp = np.random.default_rng(2).permutation(64)[:22]
    hp = np.concatenate((np.arange(3, 13), np.arange(40, 52)))  # two extents, 22 pages
    want = [dev.region("kv", "c0", layer)[torch.as_tensor(dp)].clone() for layer in range(4)]
    comps = run(eng, [ArrayCommand(1, W, (PageArrays("kv", dp, hp),))])
    assert [(c.layer, c.ok) for c in comps] == [(None, True)]
    for layer in range(4):
        assert torch.equal(host.region("kv", "c0", layer)[torch.as_tensor(hp)], want[layer])
    staging = eng.stats()["backend"]["staging"]
    assert staging["staging_bytes"] == 4096 and staging["slot_bytes"] == 1024
    assert staging["ramp"] is False  # by default whole slots from the first piece to the last
    assert staging["ring_uses"] == {"loadback": 0, "writeback": 6}  # ceil(22 / 4) pieces over 2 slots
    last = eng.stats()["last_flush"]["writeback"]
    assert last["stage_bytes"] == 22 * 256 and last["stage_copies"] == 7  # 6 pieces, one cut inside an extent


def test_ring_makes_a_slot_wait_for_its_last_use() -> None:
    class Ev:
        def __init__(self, done: bool) -> None:
            self._done = done

        def done(self) -> bool:
            return self._done

    ring = StagingRing(2, 512)
    assert [ring.take()[0] for _ in range(3)] == [0, 1, 0]
    ring.release(0, Ev(False))
    ring.release(1, Ev(True))
    slot, wait = ring.take()  # slot 1: its last use is finished
    assert (slot, wait) == (1, None)
    slot, wait = ring.take()  # slot 0: still in use, the next copy must wait for it
    assert slot == 0 and isinstance(wait, Ev) and ring.waits == 1 and ring.uses == 5
    with pytest.raises(ConfigError, match="slot bytes must be a positive multiple of 256, got 100"):
        StagingRing(2, 100)
    with pytest.raises(ConfigError, match="slots must be an int >= 1, got 0"):
        StagingRing(0, 512)


@needs_sim
def test_both_directions_in_one_flush_are_staged_and_exact() -> None:
    specs = kv_specs(layers=4)
    host = HostPool(specs, 80, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 80, "cpu")
    fill(host, dev, seed=5)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(1 << 16, 3), chunk_layers=4)
    rng = np.random.default_rng(4)
    dev_pages = rng.permutation(80)
    lb_dev, wb_dev = dev_pages[:30], dev_pages[30:60]
    lb_host, wb_host = np.arange(0, 30), np.arange(45, 75)
    want_dev = {(c, layer): host.region("kv", c, layer)[torch.as_tensor(lb_host)].clone()
                for c in ("c0", "c1") for layer in range(4)}
    want_host = {(c, layer): dev.region("kv", c, layer)[torch.as_tensor(wb_dev)].clone()
                 for c in ("c0", "c1") for layer in range(4)}
    comps = run(eng, [ArrayCommand(1, L, (PageArrays("kv", lb_host, lb_dev),)),
                      ArrayCommand(2, W, (PageArrays("kv", wb_dev, wb_host),))])
    assert sorted((c.op_id, c.layer) for c in comps if c.layer is None) == [(1, None), (2, None)]
    for (c, layer), data in want_dev.items():
        assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(lb_dev)], data)
    for (c, layer), data in want_host.items():
        assert torch.equal(host.region("kv", c, layer)[torch.as_tensor(wb_host)], data)
    last = eng.stats()["last_flush"]
    assert last["loadback"]["stage_bytes"] == 30 * 4 * 96 == last["writeback"]["stage_bytes"]
    assert last["loadback"]["sm_bytes"] == 0 == last["writeback"]["sm_bytes"]


def test_flushes_of_one_shape_reuse_the_piece_layout_at_their_own_extents() -> None:
    """Both ways, two flushes whose host pages are one extent each, at other host
    offsets and in other orders: the second reuses the first's piece layout (moved to
    its extents) and lands every page exactly."""
    specs = kv_specs(layers=4)
    host = HostPool(specs, 120, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 80, "cpu")
    fill(host, dev, seed=7)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(1 << 13, 2), chunk_layers=2)
    rng = np.random.default_rng(8)
    op = 0
    for lb0, wb0 in ((0, 60), (31, 90)):
        dev_pages = rng.permutation(80)
        lb_dev, wb_dev = dev_pages[:25], dev_pages[25:50]
        lb_host, wb_host = lb0 + rng.permutation(25), wb0 + rng.permutation(25)
        want_dev = {(c, layer): host.region("kv", c, layer)[torch.as_tensor(lb_host)].clone()
                    for c in ("c0", "c1") for layer in range(4)}
        want_host = {(c, layer): dev.region("kv", c, layer)[torch.as_tensor(wb_dev)].clone()
                     for c in ("c0", "c1") for layer in range(4)}
        comps = run(eng, [ArrayCommand(op + 1, L, (PageArrays("kv", lb_host, lb_dev),)),
                          ArrayCommand(op + 2, W, (PageArrays("kv", wb_dev, wb_host),))])
        op += 2
        assert all(c.ok for c in comps) and sum(c.layer is None for c in comps) == 2
        for (c, layer), data in want_dev.items():
            assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(lb_dev)], data)
        for (c, layer), data in want_host.items():
            assert torch.equal(host.region("kv", c, layer)[torch.as_tensor(wb_host)], data)
        assert eng.stats()["last_flush"]["loadback"]["stage_bytes"] == 25 * 4 * 96
    staging = eng.stats()["backend"]["staging"]
    assert staging["layout_reuses"] == 2  # two directions x the second flush
    assert staging["host_tables"] is False


@needs_sim
def test_both_ways_flush_takes_the_directions_in_turn_one_chunk_each() -> None:
    """With the staging path both directions are prepared first, then issued one chunk
    each in turn (the writeback after the loadback's first chunk, not after its last);
    layer completions still follow the chunks."""
    specs = kv_specs(layers=6)
    host = HostPool(specs, 80, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 80, "cpu")
    fill(host, dev, seed=6)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(1 << 16, 3), chunk_layers=2)
    assert eng.backend.interleave_directions
    order: list[tuple[str, int]] = []
    b = eng.backend
    real_prepare, real_run = b.prepare, b.run_chunk

    def prepare(direction: Direction, plan: object) -> None:
        order.append((direction.value, -1))
        real_prepare(direction, plan)  # type: ignore[arg-type]

    def run_chunk(direction: Direction, plan: object, chunk: object, ops: tuple[int, ...]) -> object:
        order.append((direction.value, chunk.index))  # type: ignore[attr-defined]
        return real_run(direction, plan, chunk, ops)  # type: ignore[arg-type]

    b.prepare, b.run_chunk = prepare, run_chunk  # type: ignore[method-assign]
    dev_pages = np.random.default_rng(8).permutation(80)
    want = {(c, layer): host.region("kv", c, layer)[torch.as_tensor(np.arange(30))].clone()
            for c in ("c0", "c1") for layer in range(6)}
    comps = run(eng, [ArrayCommand(1, L, (PageArrays("kv", np.arange(30), dev_pages[:30]),)),
                      ArrayCommand(2, W, (PageArrays("kv", dev_pages[30:60], np.arange(40, 70)),))])
    assert order == [("loadback", -1), ("writeback", -1), ("loadback", 0), ("writeback", 0), ("loadback", 1),
                     ("loadback", 2)]
    assert [c.layer for c in comps if c.op_id == 1] == [1, 3, 5, None]
    for (c, layer), data in want.items():
        assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(dev_pages[:30])], data)


@needs_sim
def test_scattered_host_pages_stay_on_the_kernel() -> None:
    specs = kv_specs(layers=2, comps=(1024,))
    host = HostPool(specs, 256, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 256, "cpu")
    fill(host, dev, seed=6)
    # the default calibration: copy engines from 64 KiB copies up; a host page is 2 KiB
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options={"calibration": "default",
                                                                     "staging_bytes": 1 << 20,
                                                                     "staging_one_way": True})
    dp = np.arange(0, 128)
    run(eng, [ArrayCommand(1, L, (PageArrays("kv", np.arange(0, 256, 2), dp),))])  # extents of one page
    first = eng.stats()["last_flush"]["loadback"]
    assert first["stage_bytes"] == 0 and first["sm_bytes"] == 128 * 2048
    run(eng, [ArrayCommand(2, L, (PageArrays("kv", np.arange(100, 228), dp),))])  # one extent of 256 KiB
    second = eng.stats()["last_flush"]["loadback"]
    assert second["stage_bytes"] == 128 * 2048 and second["sm_bytes"] == 0
    assert torch.equal(dev.region("kv", "c0", 1)[:128], host.region("kv", "c0", 1)[100:228])
    run(eng, [ArrayCommand(3, L, (PageArrays("kv", np.arange(0, 64), dp[:64]),))])  # 128 KiB: below the minimum
    assert eng.stats()["last_flush"]["loadback"]["stage_bytes"] == 0


@needs_sim
def test_flushes_of_growing_size_land_pages_exactly() -> None:
    """Both ways, flushes of 5, 40 and 12 pages (the ranks of a permutation in host order
    come from one shared array that grows between them): every page lands exactly."""
    specs = kv_specs(layers=2)
    host = HostPool(specs, 100, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 100, "cpu")
    fill(host, dev, seed=3)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=staging_options(1 << 13, 2), chunk_layers=1)
    rng = np.random.default_rng(4)
    op = 0
    for n in (5, 40, 12):
        dev_pages = rng.permutation(100)
        lb_dev, wb_dev = dev_pages[:n], dev_pages[n:2 * n]
        lb_host, wb_host = rng.permutation(n), 50 + rng.permutation(n)
        want_dev = {(c, layer): host.region("kv", c, layer)[torch.as_tensor(lb_host)].clone()
                    for c in ("c0", "c1") for layer in range(2)}
        want_host = {(c, layer): dev.region("kv", c, layer)[torch.as_tensor(wb_dev)].clone()
                     for c in ("c0", "c1") for layer in range(2)}
        comps = run(eng, [ArrayCommand(op + 1, L, (PageArrays("kv", lb_host, lb_dev),)),
                          ArrayCommand(op + 2, W, (PageArrays("kv", wb_dev, wb_host),))])
        op += 2
        assert all(c.ok for c in comps) and sum(c.layer is None for c in comps) == 2
        assert eng.stats()["last_flush"]["loadback"]["stage_bytes"] == n * 2 * 96
        for (c, layer), data in want_dev.items():
            assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(lb_dev)], data)
        for (c, layer), data in want_host.items():
            assert torch.equal(host.region("kv", c, layer)[torch.as_tensor(wb_host)], data)


def test_host_extents_rank_pages_in_host_order() -> None:
    uniq, starts, lens, rank = host_extents(np.array([9, 3, 4, 10, 5, 3], dtype=np.int64))
    assert uniq.tolist() == [3, 4, 5, 9, 10] and starts.tolist() == [0, 3] and lens.tolist() == [3, 2]
    assert rank.tolist() == [3, 0, 1, 4, 2, 0]
    uniq, starts, lens, rank = host_extents(np.array([7, 5, 6], dtype=np.int64))
    assert uniq.tolist() == [5, 6, 7] and starts.tolist() == [0] and lens.tolist() == [3] and rank.tolist() == [2, 0, 1]


@needs_sim
def test_one_direction_alone_stays_on_the_kernel_unless_asked() -> None:
    specs = kv_specs(layers=2, comps=(1024,))
    host = HostPool(specs, 512, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 512, "cpu")
    fill(host, dev, seed=8)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options={"calibration": "default",
                                                                     "staging_bytes": 1 << 20})
    dp = np.arange(0, 256)
    run(eng, [ArrayCommand(1, L, (PageArrays("kv", np.arange(0, 128), dp[:128]),))])
    alone = eng.stats()["last_flush"]["loadback"]
    assert alone["stage_bytes"] == 0 and alone["sm_bytes"] == 128 * 2048
    run(eng, [ArrayCommand(2, L, (PageArrays("kv", np.arange(0, 128), dp[:128]),)),
              ArrayCommand(3, W, (PageArrays("kv", dp[128:], np.arange(300, 428)),))])
    last = eng.stats()["last_flush"]
    assert last["loadback"]["stage_bytes"] == 128 * 2048 == last["writeback"]["stage_bytes"]
    assert torch.equal(host.region("kv", "c0", 1)[300:428], dev.region("kv", "c0", 1)[128:256])


def test_ramp_makes_a_writebacks_first_pieces_and_a_loadbacks_last_pieces_small() -> None:
    slot = 1 << 20
    assert [ramp_cap(i, 10 * slot, slot, False) for i in range(4)] == [slot // 16, slot // 4, slot, slot]
    assert ramp_cap(0, 10 * slot, slot, True) == slot  # a loadback's early pieces are whole slots
    assert ramp_cap(3, slot + slot // 4, slot, True) == slot - slot // 16  # leaves slot/4 + slot/16
    assert ramp_cap(4, slot // 4 + slot // 16, slot, True) == slot // 4
    assert ramp_cap(5, slot // 16, slot, True) == slot // 16


@needs_sim
def test_ramped_pieces_land_pages_exactly() -> None:
    """Both ways, 40 pages of 128 bytes (2 layers x 64) each way, slots of 2 KiB: with the
    ramp the writeback (16 pages a slot) starts with pieces of 1 and 4 pages, and each
    loadback chunk of one layer (32 pages a slot) ends with pieces of 8 and 2, cut at the
    same pages (the second chunk's pieces make no runs of their own); twice (the second
    flush reuses the layout at other extents), every page exact."""
    specs = kv_specs(layers=2, comps=(64,))
    host = HostPool(specs, 120, pin=False, layout="page")
    dev = DevicePool.allocate(specs, 100, "cpu")
    fill(host, dev, seed=9)
    opts = {**staging_options(4 * 16 * 128, 2), "staging_ramp": True}
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=opts, chunk_layers=1)
    stager = eng.backend.stager
    assert stager.describe()["ramp"] is True
    seen: dict[str, list[int]] = {"loadback": [], "writeback": []}
    real = stager._copies

    def copies(direction: Direction, piece: object, *a: object) -> int:
        seen[direction.value].append(piece.nbytes // (128 if direction is W else 64))  # type: ignore[attr-defined]
        return real(direction, piece, *a)  # type: ignore[arg-type]

    stager._copies = copies
    rng = np.random.default_rng(10)
    for op, (lb0, wb0) in enumerate(((0, 60), (13, 75))):
        dev_pages = rng.permutation(100)
        lb_dev, wb_dev = dev_pages[:40], dev_pages[40:80]
        lb_host, wb_host = lb0 + rng.permutation(40), wb0 + rng.permutation(40)
        want_dev = [host.region("kv", "c0", layer)[torch.as_tensor(lb_host)].clone() for layer in range(2)]
        want_host = [dev.region("kv", "c0", layer)[torch.as_tensor(wb_dev)].clone() for layer in range(2)]
        for d in seen.values():
            d.clear()
        comps = run(eng, [ArrayCommand(2 * op + 1, L, (PageArrays("kv", lb_host, lb_dev),)),
                          ArrayCommand(2 * op + 2, W, (PageArrays("kv", wb_dev, wb_host),))])
        assert all(c.ok for c in comps) and sum(c.layer is None for c in comps) == 2
        assert seen == {"writeback": [1, 4, 16, 16, 3], "loadback": [30, 8, 2, 30, 8, 2]}
        stage = eng.backend._split_now[L][1].stage
        assert [len(p.builds) for p in stage.pieces[0]] == [1, 1, 1] and not any(p.builds for p in stage.pieces[1])
        for layer in range(2):
            assert torch.equal(dev.region("kv", "c0", layer)[torch.as_tensor(lb_dev)], want_dev[layer])
            assert torch.equal(host.region("kv", "c0", layer)[torch.as_tensor(wb_host)], want_host[layer])
    assert stager.describe()["layout_reuses"] == 2
