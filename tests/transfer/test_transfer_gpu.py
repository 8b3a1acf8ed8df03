"""The same checks on a real GPU (skipped elsewhere): random plans on the numba (one
launch over all tensors, and the per-bucket fallback) and torch backends, layer waits
on the compute stream, and a stateful test against real streams while the compute
stream writes at the same time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, Direction, GroupTransfer, TransferCommand
from kvtier.transfer import DevicePool, HostPool, TransferEngine
from kvtier.transfer.backends import simulator_enabled
from kvtier.transfer.scenarios import (
    check_pools,
    check_protocol,
    random_commands,
    random_pools,
    random_specs,
    reference,
)


def _real_gpu() -> bool:
    return not simulator_enabled() and torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _real_gpu(), reason="needs a real CUDA GPU "
                                                   "(not the simulator)")]
L, W = Direction.LOADBACK, Direction.WRITEBACK


def _drain(eng: TransferEngine, n_ops: int) -> list[Completion]:
    comps: list[Completion] = []
    eng.synchronize()
    for _ in range(1000):
        comps += eng.poll_completions()
        if sum(c.layer is None for c in comps) >= n_ops:
            break
    return comps


#: Crossover at 48 B: the random scenarios' page sizes (1-128 B) fall on both sides, so
#: every plan is split between the kernel and cuMemcpyBatchAsync.
_MIXED = {"sizes": [16, 48], "sm_gbps": {"loadback": [50, 50], "writeback": [50, 50]},
          "ce_gbps": {"loadback": [1, 60], "writeback": [1, 60]},
          "ce_pair_gbps": {"loadback": [1, 60], "writeback": [1, 60]}, "source": "test: mixed"}


@pytest.mark.parametrize("backend, options, registered", [
    ("hybrid", {"calibration": _MIXED}, False),
    ("hybrid", {"calibration": _MIXED}, True),
    ("hybrid", {"calibration": _MIXED, "blocks": 1, "threads": 32, "piece_bytes": 48}, True),
    ("numba", {}, False),
    ("numba", {}, True),
    ("numba", {"address_view": False}, True),
    ("numba", {"blocks": 1, "threads": 32, "piece_bytes": 48}, True),
    ("torch", {}, True),
])
@pytest.mark.parametrize("seed", range(6))
def test_gpu_random_plans(backend: str, options: dict[str, Any], registered: bool, seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    specs = random_specs(rng)
    host, dev = random_pools(rng, specs, registered, device="cuda")
    assert host.pinned
    eng = TransferEngine(specs, host, dev, backend, backend_options=options, chunk_layers=int(rng.integers(1, 4)))
    cmds = random_commands(rng, specs, host, dev)
    want = reference(specs, host, dev, cmds)
    for c in cmds:
        eng.submit(c)
    eng.flush()
    comps = _drain(eng, len(cmds))
    check_protocol(cmds, comps)
    check_pools(host, dev, want)
    st_ = eng.stats()["cumulative"]["loadback"]
    if backend == "hybrid":
        for d in ("loadback", "writeback"):
            s_ = eng.stats()["cumulative"][d]
            assert s_["sm_bytes"] + s_["ce_bytes"] == s_["bytes"]
        assert eng.stats()["backend"]["copier"] == "cuMemcpyBatchAsync"
    if backend == "numba":
        view = options.get("address_view", True)
        assert st_["kernel_launches"] == (st_["chunks"] if view else st_["tensor_refs"])


#: The copy engines win at every size: the staging path wherever a group can be staged.
_STAGE = {"calibration": {"sizes": [1], "sm_gbps": {"loadback": [1], "writeback": [1]},
                          "ce_gbps": {"loadback": [60], "writeback": [60]},
                          "ce_pair_gbps": {"loadback": [60], "writeback": [60]}, "source": "test: staging"},
          "staging_bytes": 1 << 14, "staging_slots": 2, "staging_min_bytes": 1, "staging_one_way": True}


@pytest.mark.parametrize("backend, options, registered", [
    ("hybrid", _STAGE, False), ("hybrid", _STAGE, True), ("numba", {}, True),
    ("hybrid", {"calibration": _MIXED}, False), ("hybrid", {**_STAGE, "staging_host_tables": True}, False),
])
@pytest.mark.parametrize("seed", range(4))
def test_gpu_random_plans_page_major_host(backend: str, options: dict[str, Any], registered: bool, seed: int) -> None:
    rng = np.random.default_rng(2000 + seed)
    specs = random_specs(rng)
    host, dev = random_pools(rng, specs, registered, device="cuda", host_layout="page")
    eng = TransferEngine(specs, host, dev, backend, backend_options=options, chunk_layers=int(rng.integers(1, 4)))
    cmds = random_commands(rng, specs, host, dev)
    want = reference(specs, host, dev, cmds)
    for c in cmds:
        eng.submit(c)
    eng.flush()
    comps = _drain(eng, len(cmds))
    check_protocol(cmds, comps)
    check_pools(host, dev, want)
    if backend == "hybrid":
        for d in ("loadback", "writeback"):
            s_ = eng.stats()["cumulative"][d]
            assert s_["sm_bytes"] + s_["ce_bytes"] + s_["stage_bytes"] == s_["bytes"]


def test_gpu_staged_acks_follow_the_copies_both_ways() -> None:
    """Acknowledgements polled without synchronizing: every staged byte is in place
    when the ack arrives (the chunk events cover the copy streams), both directions in
    one flush, a ring smaller than each direction's bytes."""
    specs = [CacheGroupSpec("kv", "history", 16, 1, tuple(range(4)),
                            (ComponentSpec("k", 4096), ComponentSpec("v", 4096)))]
    n = 512
    host = HostPool(specs, 2 * n, layout="page")
    dev = DevicePool.allocate(specs, 2 * n, "cuda")
    assert host.buffer is not None and dev.buffer is not None
    dev.buffer.random_(0, 256)
    host.buffer.copy_(torch.randint_like(host.buffer, 0, 256, device="cuda"))
    opts = dict(_STAGE, staging_bytes=4 << 20, staging_slots=3)
    eng = TransferEngine(specs, host, dev, "hybrid", backend_options=opts, chunk_layers=2)
    rng = np.random.default_rng(7)
    for rep in range(3):
        dp = rng.permutation(2 * n)
        lb = (rng.permutation(n), dp[:n])
        wb = (dp[n:], n + rng.permutation(n))
        want = {(c, layer): (host.region("kv", c, layer)[torch.as_tensor(lb[0])].clone(),
                             dev.region("kv", c, layer)[torch.as_tensor(wb[0]).cuda()].cpu())
                for c in ("k", "v") for layer in range(4)}
        for op, d, (src, dst) in ((10 * rep + 1, L, lb), (10 * rep + 2, W, wb)):
            eng.submit(TransferCommand(op, d, (GroupTransfer("kv", tuple(src.tolist()), tuple(dst.tolist())),), ()))
        eng.flush()
        acked = set()
        while len(acked) < 2:
            acked |= {c.op_id for c in eng.poll_completions() if c.layer is None and c.ok}
        for (c, layer), (h, d) in want.items():
            assert torch.equal(dev.region("kv", c, layer)[torch.as_tensor(lb[1]).cuda()].cpu(), h)
            assert torch.equal(host.region("kv", c, layer)[torch.as_tensor(wb[1])], d)
        last = eng.stats()["last_flush"]
        assert last["loadback"]["stage_bytes"] == n * 4 * 8192 == last["writeback"]["stage_bytes"]
    backend = eng.stats()["backend"]
    assert backend["bound_launch"] is True, backend["bound_error"]
    assert backend["bound_launches"] > 0


def test_gpu_bound_launch_copies_what_the_numba_launch_copies() -> None:
    """The pre-bound launch (cuLaunchKernel with cached parameter words) against
    Numba's own launch of the same kernel: random rows, odd offsets and lengths, two
    grids; and after a new table (new parameter words) again."""
    from kvtier.transfer.backends import kernels
    from kvtier.transfer.backends.driver import BoundKernel

    rng = np.random.default_rng(11)
    n = 1 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    outs = [torch.zeros_like(src), torch.zeros_like(src)]
    views = [kernels.span_arrays(int(t.data_ptr()), n, t) for t in (src, *outs)]
    bound = None
    for rep in range(2):
        for t in outs:
            t.zero_()
        k = 300
        lens = rng.integers(1, 3000, k)
        dst = np.cumsum(lens) - lens + rng.integers(0, 7, k).cumsum()
        rows = np.stack([rng.integers(0, n - 3000, k), dst, lens], axis=1).astype(np.int64)
        runs, refs, piece = kernels.rows_as_runs(rows)
        rt, ft = torch.from_numpy(runs).cuda(), torch.from_numpy(refs).cuda()
        rn, fn = kernels.device_array(rt), kernels.device_array(ft)
        sv, av, bv = views
        if bound is None:
            bound = BoundKernel(kernels, (sv[0], bv[0], sv[1], bv[1], rn, fn))
            assert bound.self_test(src.device) is None
        blocks = 3 + 5 * rep
        kernels.launch_runs(sv[0], av[0], sv[1], av[1], rn, fn, 0, 1, k, piece, blocks, 256, 0)
        bound.launch(sv[0], bv[0], sv[1], bv[1], rn, fn, 0, 1, k, piece, blocks, 256,
                     int(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1])
        r = rows[0]
        assert torch.equal(outs[1][int(r[1]):int(r[1] + r[2])], src[int(r[0]):int(r[0] + r[2])])


def test_gpu_one_launch_covers_separately_allocated_tensors() -> None:
    specs = [CacheGroupSpec("swa", "state", 64, 1, tuple(range(6)), (ComponentSpec("kv", 37440),), window=128),
             CacheGroupSpec("c4", "history", 64, 4, (0, 2, 4), (ComponentSpec("kv", 37440), ComponentSpec("ix", 4352))),
             CacheGroupSpec("c128", "history", 2, 128, (1, 3, 5), (ComponentSpec("kv", 1728),))]
    tensors = {}
    for s in specs:
        for layer in s.layers:
            for c in s.components:
                tensors[(s.name, c.name, layer)] = torch.randint(0, 255, (64, c.page_bytes), dtype=torch.uint8,
                                                                 device="cuda").view(torch.float8_e4m3fn)
    dev = DevicePool.register(specs, tensors)
    host = HostPool(specs, 128)
    for k in host.keys():
        host.region(*k).random_(0, 256)
    eng = TransferEngine(specs, host, dev, "numba", chunk_layers=6)
    rng = np.random.default_rng(0)
    cmd = TransferCommand(1, L, tuple(GroupTransfer(s.name, tuple(int(x) for x in rng.choice(128, 40, replace=False)),
                                                    tuple(int(x) for x in rng.choice(64, 40, replace=False)))
                                      for s in specs), ())
    want = reference(specs, host, dev, [cmd])
    eng.submit(cmd)
    eng.flush()
    _drain(eng, 1)
    check_pools(host, dev, want)
    assert eng.stats()["cumulative"]["loadback"]["kernel_launches"] == 1


def test_gpu_wait_layer_orders_the_compute_stream() -> None:
    spec = CacheGroupSpec("kv", "history", 64, 1, tuple(range(16)), (ComponentSpec("kv", 65536),))
    host = HostPool([spec], 256)
    dev = DevicePool.allocate([spec], 256, "cuda")
    for k in host.keys():
        host.region(*k).random_(0, 256)
    eng = TransferEngine([spec], host, dev, "numba", chunk_layers=4)
    pages = tuple(range(256))
    eng.submit(TransferCommand(1, L, (GroupTransfer("kv", pages, pages[::-1]),), ()))
    dev.buffer.zero_()  # type: ignore[union-attr]
    eng.flush()
    for layer in (0, 5, 15):
        eng.wait_layer(1, layer)
        got = dev.region("kv", "kv", layer).clone()  # on the compute stream, after the wait
        assert torch.equal(got.cpu(), host.region("kv", "kv", layer).cpu().flip(0)), layer
    _drain(eng, 1)


SPEC = CacheGroupSpec("kv", "history", 16, 1, (0, 1, 2, 3, 4, 5), (ComponentSpec("k", 4096), ComponentSpec("x", 1040)))
HOST_PAGES, DEV_PAGES = 48, 32


class RealStreamsMachine(RuleBasedStateMachine):
    """Transfers on real streams while the compute stream writes other pages (after a
    long matrix product, so it lags): data must follow the stream order."""

    @initialize(backend=st.sampled_from(["numba", "torch"]))
    def setup(self, backend: str) -> None:
        self.host = HostPool([SPEC], HOST_PAGES)
        self.dev = DevicePool.allocate([SPEC], DEV_PAGES, "cuda")
        for pool in (self.host, self.dev):
            for k in pool.keys():
                pool.region(*k).random_(0, 256)
        self.model = {("host", k): self.host.region(*k).cpu().clone() for k in self.host.keys()}
        self.model.update({("device", k): self.dev.region(*k).cpu().clone() for k in self.dev.keys()})
        self.eng = TransferEngine([SPEC], self.host, self.dev, backend, chunk_layers=2)
        self.busy: dict[int, set[tuple[str, int]]] = {}  # op -> pages in flight
        self.want: dict[int, list[tuple[str, Any, int]]] = {}
        self.op = 1
        self.acked: set[int] = set()
        self.big = torch.randn(2048, 2048, device="cuda")

    def _free(self, side: str, pages: list[int]) -> bool:
        used = set().union(*self.busy.values()) if self.busy else set()
        return not any((side, p) in used for p in pages)

    @rule(direction=st.sampled_from([L, W]), data=st.data())
    def transfer(self, direction: Direction, data: st.DataObject) -> None:
        n_src, n_dst = (HOST_PAGES, DEV_PAGES) if direction is L else (DEV_PAGES, HOST_PAGES)
        src_side, dst_side = ("host", "device") if direction is L else ("device", "host")
        dst = data.draw(st.lists(st.integers(0, n_dst - 1), min_size=1, max_size=8, unique=True))
        src = data.draw(st.lists(st.integers(0, n_src - 1), min_size=len(dst), max_size=len(dst), unique=True))
        if not (self._free(dst_side, dst) and self._free(src_side, src)) or set(
                (src_side, p) for p in src) & set((dst_side, p) for p in dst):
            return
        op = self.op
        self.op += 1
        self.eng.submit(TransferCommand(op, direction, (GroupTransfer("kv", tuple(src), tuple(dst)),), ()))
        self.eng.flush()
        self.busy[op] = {(src_side, p) for p in src} | {(dst_side, p) for p in dst}
        for k in self.host.keys():  # the model copies at issue time: sources stay untouched while in flight
            self.model[(dst_side, k)][dst] = self.model[(src_side, k)][src]
        self.want[op] = [(dst_side, k, p) for k in self.host.keys() for p in dst]

    @rule(data=st.data())
    def compute_writes(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.integers(0, DEV_PAGES - 1), min_size=1, max_size=4, unique=True))
        if not self._free("device", pages):
            return
        torch.matmul(self.big, self.big)  # keep the compute stream busy, so the write lags
        for k in self.dev.keys():
            vals = torch.randint(0, 256, (len(pages), self.dev.region(*k).shape[1]), dtype=torch.uint8)
            self.dev.region(*k)[pages] = vals.to("cuda", non_blocking=False)
            self.model[("device", k)][pages] = vals

    @precondition(lambda self: bool(self.busy))
    @rule()
    def poll(self) -> None:
        for c in self.eng.poll_completions():
            assert c.ok
            if c.layer is None:
                self.acked.add(c.op_id)
                for side, k, p in self.want.pop(c.op_id):
                    pool = self.host if side == "host" else self.dev
                    assert torch.equal(pool.region(*k)[p].cpu(), self.model[(side, k)][p]), (c.op_id, side, k, p)
                del self.busy[c.op_id]

    @invariant()
    def nothing_acked_twice(self) -> None:
        assert not (set(self.busy) & self.acked)

    def teardown(self) -> None:
        if not hasattr(self, "eng"):
            return
        self.eng.synchronize()
        torch.cuda.synchronize()
        for _ in range(100):
            self.poll() if self.busy else None
        assert not self.busy
        for (side, k), want in self.model.items():
            pool = self.host if side == "host" else self.dev
            assert torch.equal(pool.region(*k).cpu(), want), (side, k)


RealStreamsMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                                suppress_health_check=list(HealthCheck))
TestRealStreams = RealStreamsMachine.TestCase


def test_gpu_hybrid_calibration_and_array_commands() -> None:
    from kvtier.transfer import ArrayCommand, PageArrays
    from kvtier.transfer.backends.hybrid import HybridBackend

    specs = [CacheGroupSpec("kv", "history", 64, 1, (0, 1), (ComponentSpec("kv", 65536),)),
             CacheGroupSpec("s", "history", 64, 1, (0, 1), (ComponentSpec("s", 1024),))]
    host = HostPool(specs, 64)
    dev = DevicePool.allocate(specs, 64, "cuda")
    assert host.buffer is not None and dev.buffer is not None
    host.buffer.random_(0, 256)
    dev.buffer.random_(0, 256)
    backend = HybridBackend(calibration="measure")
    eng = TransferEngine(specs, host, dev, backend)
    cal = backend.calibration
    assert cal is not None and cal.source.startswith("measured")
    for d in (L, W):
        assert all(x > 0.5 for x in cal.sm_gbps[d]) and all(x > 0.05 for x in cal.ce_gbps[d])
    rng = np.random.default_rng(7)
    lb = ArrayCommand(1, L, (PageArrays("kv", rng.permutation(32)[:20], rng.permutation(32)[:20]),
                             PageArrays("s", np.arange(20), np.arange(20))))
    wb = ArrayCommand(2, W, (PageArrays("kv", rng.permutation(32)[:10] + 32, rng.permutation(32)[:10] + 32),))
    for c in (lb, wb):
        eng.submit(c)
    eng.flush()
    comps = _drain(eng, 2)
    assert sorted(c.op_id for c in comps if c.layer is None and c.ok) == [1, 2]
    for c in (lb, wb):
        src_side, dst_side = ("host", "device") if c.direction is L else ("device", "host")
        for t in c.transfers:
            comp = specs[0].components[0].name if t.group == "kv" else "s"
            for layer in (0, 1):
                got = eng.read_pages(dst_side, t.group, comp, layer, t.dst_pages.tolist()).cpu()
                want = eng.read_pages(src_side, t.group, comp, layer, t.src_pages.tolist()).cpu()
                assert torch.equal(got, want)
    cum = eng.stats()["cumulative"]
    assert cum["loadback"]["sm_bytes"] + cum["loadback"]["ce_bytes"] == cum["loadback"]["bytes"]
