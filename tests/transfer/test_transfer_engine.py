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
    UsageError,
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
from kvtier.transfer.backends import simulator_enabled
from kvtier.transfer.plan import layers_for
from kvtier.transfer.scenarios import check_pools, check_protocol, random_commands, random_pools, random_specs, reference

L, W = Direction.LOADBACK, Direction.WRITEBACK
SIM = simulator_enabled()



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
    # loadback and writeback of one flush may not touch the same pages either: refused at submit
    eng.submit(_lb(3, (5,), (6,)))
    with pytest.raises(UsageError, match=r"op 4: device page 6 of cache group 'kv' is read by it and written by op 3"):
        eng.submit(TransferCommand(4, W, (GroupTransfer("kv", (6,), (10,)),), ()))
    assert eng.queued == (3,)
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


def test_prepare_runs_before_the_start_event_and_its_failure_fails_the_ops() -> None:
    from kvtier.transfer import CpuBackend

    calls: list[str] = []

    class Recording(CpuBackend):
        fail = False

        def prepare(self, direction: Direction, plan: Any) -> None:
            calls.append(f"prepare {direction.value} {len(plan.chunks)}")
            if self.fail:
                raise RuntimeError("no table")

        def begin(self, direction: Direction) -> Any:
            calls.append("begin")
            return super().begin(direction)

        def run_chunk(self, direction: Direction, plan: Any, chunk: Any, op_ids: tuple[int, ...]) -> Any:
            calls.append(f"chunk {chunk.index}")
            return super().run_chunk(direction, plan, chunk, op_ids)

    s = _specs()
    backend = Recording()
    eng = TransferEngine(s, HostPool(s, 16), DevicePool.allocate(s, 12, "cpu"), backend, chunk_layers=4)
    eng.submit(_lb(1, (1,), (3,)))
    eng.flush()
    assert calls == ["prepare loadback 2", "begin", "chunk 0", "chunk 1"]
    assert eng.poll_completions()[-1] == Completion(1, 0, True)
    backend.fail = True
    eng.submit(_lb(2, (1,), (3,)))
    eng.flush()
    assert eng.poll_completions() == [Completion(2, 0, False)]


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
    with pytest.raises(ConfigError, match=r"takes a TransferCommand or ArrayCommand, got dict"):
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


def test_cancel_or_flush_of_a_queued_op_frees_its_pages_for_the_other_direction() -> None:
    eng = _engine()
    eng.submit(_lb(3, (5,), (6,)))
    eng.submit(_lb(5, (7,), (8,)))
    wb = TransferCommand(4, W, (GroupTransfer("kv", (6,), (10,)),), ())
    with pytest.raises(UsageError, match=r"op 4: device page 6 of cache group 'kv' is read by it and written by op 3"):
        eng.submit(wb)
    assert eng.cancel(3) == "cancelled"
    eng.submit(wb)  # op 3 left the queue: its device page 6 is free
    with pytest.raises(UsageError, match=r"op 9: device page 8 .* written by op 5"):
        eng.submit(TransferCommand(9, W, (GroupTransfer("kv", (8,), (11,)),), ()))
    eng.flush()
    eng.backend.complete_all()  # type: ignore[attr-defined]
    eng.poll_completions()
    eng.submit(TransferCommand(9, W, (GroupTransfer("kv", (8,), (11,)),), ()))  # flushed: free again
    assert eng.queued == (9,)
