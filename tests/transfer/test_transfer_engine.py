"""TransferEngine on every backend that runs here: random plans copy exactly the right
bytes (checked against a torch reference), completions follow the protocol, bad input
and failures are handled."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.fsm import (
    CacheGroupSpec,
    Completion,
    ComponentSpec,
    ConfigError,
    Direction,
    GroupTransfer,
    TransferCommand,
    UnknownOperation,
)
from kvtier.transfer import (
    POISON_BYTE,
    BackendUnavailable,
    DevicePool,
    FakeAsyncBackend,
    HazardError,
    HostPool,
    NotReadyError,
    PoisonedReadError,
    TransferEngine,
    TransferError,
    choose_backend,
)
from kvtier.transfer.backend import simulator_enabled
from kvtier.transfer.plan import layers_for

L, W = Direction.LOADBACK, Direction.WRITEBACK
SIM = simulator_enabled()
PAGE_SIZES = [1, 3, 16, 20, 37, 48, 64, 100, 128]


# ----------------------------------------------------------------------------------------
# random scenarios and the torch reference
# ----------------------------------------------------------------------------------------
def random_specs(rng: np.random.Generator, max_groups: int = 3) -> list[CacheGroupSpec]:
    specs = []
    for g in range(int(rng.integers(1, max_groups + 1))):
        layers = tuple(sorted(int(x) for x in rng.choice(6, size=int(rng.integers(1, 6)), replace=False)))
        comps = tuple(ComponentSpec(f"c{i}", int(rng.choice(PAGE_SIZES))) for i in range(int(rng.integers(1, 3))))
        specs.append(CacheGroupSpec(f"g{g}", "history", 4, 1, layers, comps))
    return specs


def random_pools(rng: np.random.Generator, specs: list[CacheGroupSpec], registered: bool,
                 device: str = "cpu") -> tuple[HostPool, DevicePool]:
    host = HostPool(specs, {s.name: int(rng.integers(10, 20)) for s in specs})
    dev_pages = {s.name: int(rng.integers(8, 14)) for s in specs}
    if registered:
        tensors: dict[tuple[str, str, int], torch.Tensor] = {}
        for s in specs:
            for layer in s.layers:
                for c in s.components:
                    n = dev_pages[s.name]
                    if c.page_bytes % 4 == 0:
                        t = torch.empty(n, c.page_bytes // 4, dtype=torch.float32, device=device)
                    elif c.page_bytes % 2 == 0:
                        t = torch.empty(n, c.page_bytes // 2, dtype=torch.bfloat16, device=device)
                    else:
                        t = torch.empty(n, c.page_bytes, dtype=torch.float8_e4m3fn, device=device)
                    tensors[(s.name, c.name, layer)] = t
        dev = DevicePool.register(specs, tensors)
    else:
        dev = DevicePool.allocate(specs, dev_pages, device)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    for pool in (host, dev):
        for k in pool.keys():
            r = pool.region(*k)
            r.copy_(torch.randint(0, 256, tuple(r.shape), generator=g, dtype=torch.uint8))
    return host, dev


def random_commands(rng: np.random.Generator, specs: list[CacheGroupSpec], host: HostPool, dev: DevicePool,
                    first_op: int = 1) -> list[TransferCommand]:
    """Loadbacks and writebacks without conflicts or cross-direction hazards, with
    overlapping fragments (pairs repeated across commands) and contiguous runs."""
    cmds: list[TransferCommand] = []
    op = first_op
    free_dev = {s.name: list(rng.permutation(dev.pages(s.name))) for s in specs}
    free_host = {s.name: list(rng.permutation(host.pages(s.name))) for s in specs}
    lb_dev = {s.name: free_dev[s.name][: len(free_dev[s.name]) // 2] for s in specs}
    wb_dev = {s.name: free_dev[s.name][len(free_dev[s.name]) // 2:] for s in specs}
    lb_host = {s.name: free_host[s.name][: len(free_host[s.name]) // 2] for s in specs}
    wb_host = {s.name: free_host[s.name][len(free_host[s.name]) // 2:] for s in specs}
    for direction, n_cmds in ((L, int(rng.integers(1, 4))), (W, int(rng.integers(0, 3)))):
        src_pool_pages, dst_choices = ((lb_host, lb_dev) if direction is L else (wb_dev, wb_host))
        used: dict[str, dict[int, int]] = {s.name: {} for s in specs}  # dst -> src, per group
        for _ in range(n_cmds):
            transfers = []
            for s in specs:
                if rng.random() < 0.25:
                    continue
                pairs: list[tuple[int, int]] = []
                if used[s.name] and rng.random() < 0.5:  # overlapping fragment: repeat earlier pairs
                    old = list(used[s.name].items())
                    for i in rng.choice(len(old), size=min(len(old), 2), replace=False):
                        pairs.append((old[int(i)][1], old[int(i)][0]))
                avail = [d for d in dst_choices[s.name] if d not in used[s.name]]
                k = int(rng.integers(0, min(4, len(avail)) + 1))
                if k and rng.random() < 0.4:  # a contiguous run where the pool allows it
                    d0 = int(rng.integers(0, max(1, dev.pages(s.name) - k)))
                    run = [d0 + i for i in range(k)]
                    if all(d in avail for d in run):
                        s0 = int(rng.integers(0, host.pages(s.name) - k + 1)) if direction is L else d0
                        srcs = [s0 + i for i in range(k)]
                        if all(x in src_pool_pages[s.name] for x in srcs):
                            pairs += list(zip(srcs, run))
                            k = 0
                for d in avail[:k]:
                    pairs.append((int(rng.choice(src_pool_pages[s.name])), int(d)))
                for sp, dp in pairs:
                    used[s.name][dp] = sp
                if pairs:
                    transfers.append(GroupTransfer(s.name, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))
            layers: tuple[int, ...] = ()
            if rng.random() < 0.3:
                layers = tuple(sorted(int(x) for x in rng.choice(6, size=3, replace=False)))
                transfers = [t for t in transfers
                             if layers_for(TransferCommand(0, direction, (), layers), next(
                                 s for s in specs if s.name == t.group))]
            cmds.append(TransferCommand(op, direction, tuple(transfers), layers))
            op += 1
    return cmds


def reference(specs: list[CacheGroupSpec], host: HostPool, dev: DevicePool,
              cmds: list[TransferCommand]) -> tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]]:
    """Expected pool contents after ``cmds``: plain torch indexing on CPU copies."""
    h = {k: host.region(*k).cpu().clone() for k in host.keys()}
    d = {k: dev.region(*k).cpu().clone() for k in dev.keys()}
    by_name = {s.name: s for s in specs}
    for c in cmds:
        src, dst = (h, d) if c.direction is L else (d, h)
        for t in c.transfers:
            spec = by_name[t.group]
            for layer in layers_for(c, spec):
                for comp in spec.components:
                    k = (t.group, comp.name, layer)
                    dst[k][list(t.dst_pages)] = src[k][list(t.src_pages)]
    return h, d


def check_pools(host: HostPool, dev: DevicePool, want: tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]]) -> None:
    for k in host.keys():
        assert torch.equal(host.region(*k).cpu(), want[0][k]), f"host region {k} differs"
    for k in dev.keys():
        assert torch.equal(dev.region(*k).cpu(), want[1][k]), f"device region {k} differs"


def check_protocol(cmds: list[TransferCommand], comps: list[Completion], rank: int = 0) -> None:
    """Per op: layer completions ascending (loadbacks only), then exactly one ack, all ok."""
    for c in cmds:
        mine = [x for x in comps if x.op_id == c.op_id]
        assert all(x.rank == rank and x.ok for x in mine), mine
        acks = [i for i, x in enumerate(mine) if x.layer is None]
        assert acks == [len(mine) - 1], f"op {c.op_id}: {mine}"
        layers = [x.layer for x in mine[:-1]]
        if c.direction is W:
            assert layers == []
        else:
            assert layers == sorted(set(layers))  # type: ignore[type-var]


def run_scenario(seed: int, backend: str, registered: bool = False, options: dict[str, Any] | None = None,
                 max_groups: int = 3) -> None:
    rng = np.random.default_rng(seed)
    specs = random_specs(rng, max_groups)
    host, dev = random_pools(rng, specs, registered)
    eng = TransferEngine(specs, host, dev, backend, backend_options=options, rank=3,
                         chunk_layers=int(rng.integers(1, 4)))
    cmds = random_commands(rng, specs, host, dev)
    want = reference(specs, host, dev, cmds)
    for c in cmds:
        eng.submit(c)
    eng.flush()
    comps: list[Completion] = []
    if isinstance(eng.backend, FakeAsyncBackend):
        fake = eng.backend
        while fake.pending():  # complete in a random order the streams allow
            fake.complete_next(rng.choice([None, L, W]))  # type: ignore[arg-type]
            comps += eng.poll_completions()
    comps += eng.poll_completions()
    check_protocol(cmds, comps, rank=3)
    check_pools(host, dev, want)
    assert eng.in_flight == ()
    if backend == "numba":
        lb = eng.stats()["cumulative"]["loadback"]
        assert lb["kernel_launches"] == (lb["tensor_refs"] if registered else lb["chunks"])


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_cpu(seed: int) -> None:
    run_scenario(seed, "cpu", registered=seed % 2 == 1)


@pytest.mark.parametrize("seed", range(12))
def test_random_plans_fake_async(seed: int) -> None:
    run_scenario(100 + seed, "fake-async", registered=seed % 3 == 0)


@pytest.mark.skipif(not SIM, reason="numba kernel bodies run here only under NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("seed, registered, threads", [(0, False, 8), (1, False, 16), (2, True, 8), (3, False, 32)])
def test_random_plans_numba_simulator(seed: int, registered: bool, threads: int) -> None:
    # allocated pools: one launch per chunk over both pools' single buffers;
    # registered tensors: one launch per tensor bucket (the fallback)
    run_scenario(200 + seed, "numba", registered=registered, max_groups=2,
                 options={"blocks": 1 + seed % 2, "threads": threads, "piece_bytes": 64})


# ----------------------------------------------------------------------------------------
# protocol details on the fake-async backend
# ----------------------------------------------------------------------------------------
def _specs() -> list[CacheGroupSpec]:
    return [CacheGroupSpec("kv", "history", 4, 1, tuple(range(8)), (ComponentSpec("k", 32), ComponentSpec("v", 24))),
            CacheGroupSpec("s", "state", 2, 1, (2, 5), (ComponentSpec("x", 16),), window=4)]


def _engine(backend: str = "fake-async", **kw: Any) -> TransferEngine:
    s = _specs()
    host = HostPool(s, 16)
    dev = DevicePool.allocate(s, 12, "cpu")
    for pool in (host, dev):
        for k in pool.keys():
            pool.region(*k).copy_(torch.randint(0, 256, tuple(pool.region(*k).shape), dtype=torch.uint8))
    return TransferEngine(s, host, dev, backend, **kw)


def _lb(op: int, src: tuple[int, ...], dst: tuple[int, ...], layers: tuple[int, ...] = ()) -> TransferCommand:
    return TransferCommand(op, L, (GroupTransfer("kv", src, dst), GroupTransfer("s", src[:1], dst[:1])), layers)


def test_layer_completions_follow_chunks_then_one_ack() -> None:
    eng = _engine(chunk_layers=3)
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    eng.submit(_lb(7, (1, 2), (3, 4)))
    eng.submit(TransferCommand(8, W, (GroupTransfer("kv", (5,), (9,)),), ()))
    eng.flush()
    assert eng.poll_completions() == []
    assert [(p.stream, p.chunk, p.layers) for p in fake.pending()] == [
        (L, 0, (0, 1, 2)), (L, 1, (3, 4, 5)), (L, 2, (6, 7)), (W, 0, tuple(range(8)))]
    fake.complete_next(W)
    assert eng.poll_completions() == [Completion(8, 0, True)]
    fake.complete(7, 1)  # completes chunk 0 first (stream order)
    assert eng.poll_completions() == [Completion(7, 0, True, 2), Completion(7, 0, True, 5)]
    fake.complete_next()
    assert eng.poll_completions() == [Completion(7, 0, True, 7), Completion(7, 0, True)]
    assert eng.poll_completions() == []
    st = eng.stats()
    assert st["last_flush"]["loadback"]["chunks"] == 3
    assert st["cumulative"]["writeback"]["ops"] == 1
    assert st["cumulative"]["loadback"]["bytes"] == 8 * 2 * (32 + 24) + 2 * 16


def test_destinations_are_poisoned_until_complete_and_waits_are_checked() -> None:
    eng = _engine(chunk_layers=4)
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    src = eng.host.region("kv", "k", 5)[[1, 2]].clone()
    eng.submit(_lb(1, (1, 2), (3, 4)))
    eng.flush()
    assert eng.device.region("kv", "k", 5)[[3, 4]].eq(POISON_BYTE).all()
    with pytest.raises(PoisonedReadError, match=r"device pages \[3, 4\] of cache group 'kv', layer 5"):
        eng.read_pages("device", "kv", "k", 5, [4, 3])
    eng.read_pages("device", "kv", "k", 5, [0, 5])  # other pages are fine
    with pytest.raises(HazardError, match=r"host pages \[2\] .* still reads them"):
        eng.write_pages("host", "kv", "k", 0, [2], torch.zeros(1, 32, dtype=torch.uint8))
    eng.wait_layer(1, -1)  # no layer <= -1: nothing to wait for
    with pytest.raises(NotReadyError, match=r"have not completed"):
        eng.wait_layer(1, 2)
    fake.complete(1, 0)
    eng.wait_layer(1, 3)  # chunk 0 done
    with pytest.raises(NotReadyError):
        eng.wait_layer(1, 4)
    fake.complete_all()
    assert torch.equal(eng.read_pages("device", "kv", "k", 5, [3, 4]), src)
    eng.poll_completions()
    eng.wait_layer(1, 7)  # acknowledged: no-op


def test_wait_with_on_wait_complete_runs_the_stream_up_to_the_chunk() -> None:
    eng = _engine(chunk_layers=2, backend_options={"on_wait": "complete"})
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    eng.submit(_lb(1, (1,), (3,)))
    eng.flush()
    eng.wait_layer(1, 3)
    assert [p.chunk for p in fake.pending()] == [2, 3]
    assert eng.poll_completions() == [Completion(1, 0, True, 1), Completion(1, 0, True, 3)]


def test_wait_layer_errors() -> None:
    eng = _engine()
    with pytest.raises(UnknownOperation, match=r"op 5 is not queued, in flight, or recently finished"):
        eng.wait_layer(5, 0)
    eng.submit(_lb(5, (1,), (1,)))
    with pytest.raises(TransferError, match=r"op 5 is queued but not flushed"):
        eng.wait_layer(5, 0)
    eng.submit(TransferCommand(6, W, (GroupTransfer("kv", (7,), (2,)),), ()))
    eng.flush()
    with pytest.raises(ConfigError, match=r"op 6 is a writeback; only loadbacks have layers"):
        eng.wait_layer(6, 0)


def test_hazard_across_streams_raises_before_issuing_and_keeps_the_queue() -> None:
    eng = _engine()
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    eng.submit(_lb(1, (1, 2), (3, 4)))
    eng.flush()
    eng.submit(TransferCommand(2, W, (GroupTransfer("kv", (4,), (9,)),), ()))  # reads a device page being loaded
    with pytest.raises(HazardError, match=r"reads pages still written by pending copy 0 \(ops \[1\]"):
        eng.flush()
    assert eng.queued == (2,) and len(fake.pending()) == 2
    fake.complete_all()
    eng.flush()
    fake.complete_all()
    comps = eng.poll_completions()
    assert Completion(2, 0, True) in comps and Completion(1, 0, True) in comps
    # loadback and writeback of one flush may not touch the same pages either
    eng.submit(_lb(3, (5,), (6,)))
    eng.submit(TransferCommand(4, W, (GroupTransfer("kv", (6,), (10,)),), ()))
    with pytest.raises(HazardError, match=r"this flush's loadback chunk 0"):
        eng.flush()
    # same stream: ordered, allowed
    eng2 = _engine()
    eng2.submit(_lb(1, (1,), (3,)))
    eng2.flush()
    eng2.submit(_lb(2, (3,), (3,)))
    eng2.flush()


def test_copy_failures_become_failed_acks() -> None:
    eng = _engine(chunk_layers=4)
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    eng.submit(_lb(1, (1,), (3,)))
    eng.flush()
    fake.complete_next()
    fake.fail_next()
    fake.complete_all()
    assert eng.poll_completions() == [Completion(1, 0, True, 3), Completion(1, 0, False)]
    assert eng.device.region("kv", "k", 6)[3].eq(POISON_BYTE).all()  # the failed chunk never wrote
    assert eng.stats()["cumulative"]["loadback"]["failed_ops"] == 1
    # a chunk that raises when issued: earlier chunks complete first, then the failed ack
    eng.submit(_lb(2, (1,), (4,)))
    real = fake.run_chunk
    calls = []

    def flaky(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device fell over")
        return real(*a, **k)

    fake.run_chunk = flaky  # type: ignore[method-assign]
    eng.flush()
    assert eng.poll_completions() == []
    fake.complete_all()
    assert eng.poll_completions() == [Completion(2, 0, True, 3), Completion(2, 0, False)]


def test_conflicting_commands_fail_and_the_rest_proceed() -> None:
    eng = _engine("cpu")
    eng.submit(TransferCommand(1, L, (GroupTransfer("kv", (1,), (3,)),), ()))
    eng.submit(TransferCommand(2, L, (GroupTransfer("kv", (2,), (3,)),), ()))
    eng.submit(TransferCommand(3, L, (GroupTransfer("kv", (5,), (6,)),), ()))
    want = eng.host.region("kv", "v", 7)[5].clone()
    eng.flush()
    comps = eng.poll_completions()
    assert Completion(1, 0, False) in comps and Completion(2, 0, False) in comps
    assert comps[-1] == Completion(3, 0, True)
    assert torch.equal(eng.device.region("kv", "v", 7)[6], want)


def test_submit_validates() -> None:
    eng = _engine("cpu")
    with pytest.raises(ConfigError, match=r"takes a TransferCommand, got dict"):
        eng.submit({})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"op 1: unknown cache group 'zz'"):
        eng.submit(TransferCommand(1, L, (GroupTransfer("zz", (1,), (1,)),), ()))
    with pytest.raises(ConfigError, match=r"op 1: device page 12 of cache group 'kv' is out of range: "
                                          r"the device pool has 12 pages \(ids 0..11\)"):
        eng.submit(TransferCommand(1, L, (GroupTransfer("kv", (1,), (12,)),), ()))
    with pytest.raises(ConfigError, match=r"op 1: host page 16 of cache group 'kv' is out of range"):
        eng.submit(TransferCommand(1, W, (GroupTransfer("kv", (1,), (16,)),), ()))
    with pytest.raises(ConfigError, match=r"moves pages of cache group 's' but none of its layers \[2, 5\]"):
        eng.submit(TransferCommand(1, L, (GroupTransfer("s", (1,), (1,)),), (0, 1)))
    eng.submit(TransferCommand(1, L, (GroupTransfer("kv", (1,), (1,)),), ()))
    with pytest.raises(ConfigError, match=r"op 1 is already queued or in flight on rank 0"):
        eng.submit(TransferCommand(1, W, (), ()))
    assert eng.queued == (1,)


def test_empty_ops_are_acknowledged_at_once() -> None:
    eng = _engine(rank=2)
    eng.submit(TransferCommand(1, L, (), ()))
    eng.submit(TransferCommand(2, W, (GroupTransfer("kv", (), ()),), ()))
    eng.flush()
    assert eng.poll_completions() == [Completion(1, 2, True), Completion(2, 2, True)]
    eng.flush()  # nothing queued: nothing happens


def test_engine_checks_its_arguments() -> None:
    s = _specs()
    host, dev = HostPool(s, 4), DevicePool.allocate(s, 4, "cpu")
    with pytest.raises(ConfigError, match=r"differ from the engine's specs \['kv'\]"):
        TransferEngine(s[:1], host, dev)
    with pytest.raises(ConfigError, match=r"rank must be an int >= 0, got -1"):
        TransferEngine(s, host, dev, rank=-1)
    with pytest.raises(ConfigError, match=r"backend must be one of .* got 'gpu'"):
        TransferEngine(s, host, dev, "gpu")
    with pytest.raises(ConfigError, match=r"backend 'cpu': bad options \['blocks'\]"):
        TransferEngine(s, host, dev, "cpu", backend_options={"blocks": 8})
    with pytest.raises(BackendUnavailable, match=r"backend 'torch' needs a CUDA device pool"):
        TransferEngine(s, host, dev, "torch")
    if not SIM:
        with pytest.raises(BackendUnavailable, match=r"needs the CUDA simulator"):
            TransferEngine(s, host, dev, "numba")
    with pytest.raises(ConfigError, match=r"numba backend: blocks must be a positive int, got 0"):
        TransferEngine(s, host, dev, "numba", backend_options={"blocks": 0})
    assert TransferEngine(s, host, dev).backend.name == "cpu"


def test_automatic_choice_never_picks_numba_under_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_backend(False) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    monkeypatch.delitem(sys.modules, "numba", raising=False)
    assert choose_backend(True) == "torch"


def test_import_does_not_load_numba() -> None:
    code = ("import sys, kvtier.transfer as t; "
            "assert 'numba' not in sys.modules, 'numba imported'; "
            "e = t.TransferEngine; b = t.NumbaBackend; assert 'numba' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
