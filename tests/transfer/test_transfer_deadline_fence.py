"""The deadline fence end to end, the node core and a TransferEngine on the fake-async
backend: a copy the core gave up on (its deadline passed) still lands, late, but only in
pages the core kept fenced for it, never in pages it gave to another node or request;
``TransferEngine.cancel`` takes back a queued operation and fences an issued one; a
loadback and a writeback of the same page in one flush are refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.fsm import CacheCore, CacheGroupSpec, ComponentSpec, Direction, GroupTransfer, TransferCommand
from kvtier.fsm import CapacityError, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.transfer import DevicePool, FakeAsyncBackend, HostPool, TransferEngine

KV = CacheGroupSpec("kv", "history", 2, 1, (0, 1), (ComponentSpec("kv", 16),))


def _pair(device_pages: int = 8, host_pages: int = 4, backend: str = "fake-async") -> tuple[CacheCore, TransferEngine]:
    core = CacheCore(CacheLayout("h1", (KV,), 2), device_pages, host_pages, op_deadline_steps=1)
    eng = TransferEngine([KV], HostPool([KV], host_pages, pin=False), DevicePool.allocate([KV], device_pages, "cpu"),
                         backend)
    return core, eng


def _fill(eng: TransferEngine, side: str, pages: list[int], byte: int) -> None:
    eng.write_layers(side, "kv", "kv", pages, torch.full((2, len(pages), 16), byte, dtype=torch.uint8))


def _bytes(eng: TransferEngine, side: str, pages: list[int]) -> set[int]:
    return set(eng.read_layers(side, "kv", "kv", pages).flatten().tolist())


def _put(core: CacheCore, key: str):  # type: ignore[no-untyped-def]
    pages = core.alloc_device({"kv": len(key)}, evict=False)
    return core.insert(tuple(key), pages).node


def _run(core: CacheCore, eng: TransferEngine) -> None:
    for cmd in core.poll_commands():
        eng.submit(cmd)
    eng.flush()


def _deliver(core: CacheCore, eng: TransferEngine) -> list:
    out = []
    for c in eng.poll_completions():
        out += core.complete(c)
    core.check_invariants()
    return out


def test_an_expired_writeback_that_completes_late_never_writes_into_a_reused_host_page() -> None:
    core, eng = _pair()
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    a = _put(core, "ab")
    _fill(eng, "device", a.dev["kv"], 0xA1)
    slow = core.writeback(a)
    _run(core, eng)
    assert slow.transfers[0].dst_pages == (0, 1) and len(fake.pending()) == 1
    core.advance_step(2)  # the copy is slow, not lost: the core gives up, the bytes still move
    core.check_invariants()
    assert a.state == "device" and core.fenced_ops() == (slow.op_id,)
    b = _put(core, "xy")  # another node takes the free host pages: not the fenced ones
    _fill(eng, "device", b.dev["kv"], 0xB2)
    wb = core.writeback(b)
    assert wb.transfers[0].dst_pages == (2, 3)
    _run(core, eng)
    fake.complete_all()  # the slow copy lands after the deadline, then b's
    out = _deliver(core, eng)
    assert [(s.op_id, s.ok) for s in out] == [(wb.op_id, True)]  # the late ack settles nothing
    assert (b.state, b.host, a.state, a.host) == ("backed", {"kv": [2, 3]}, "device", {})
    assert _bytes(eng, "host", [2, 3]) == {0xB2}  # b's host copy holds b's bytes
    assert core.fenced_ops() == () and core.host["kv"].free == 2  # released exactly once
    assert core.stats.fences_released == 1


def test_an_expired_loadback_that_completes_late_never_writes_into_a_request_page() -> None:
    core, eng = _pair(device_pages=4, host_pages=4)
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    a = _put(core, "ab")
    _fill(eng, "device", a.dev["kv"], 0xA1)
    core.writeback(a)
    _run(core, eng)
    fake.complete_all()
    _deliver(core, eng)
    assert core.evict_device({"kv": 2}) == {"kv": 2} and a.state == "host"
    lr = core.load(core.match(list("ab")), "r1")
    _run(core, eng)
    fenced = sorted(lr.command.transfers[0].dst_pages)
    core.advance_step(2)
    core.release(lr.pin)
    core.unlock(lr.lock)
    core.check_invariants()
    # a request takes every free device page: the fenced destination is not among them
    own = core.alloc_device({"kv": 2}, evict=False)
    assert sorted(own["kv"]) == sorted({0, 1, 2, 3} - set(fenced))
    with pytest.raises(CapacityError):  # and nothing more is free
        core.alloc_device({"kv": 1}, evict=False)
    _fill(eng, "device", own["kv"], 0xC3)  # compute writes them: no pending copy touches them
    fake.complete_all()  # the late loadback lands in its fenced pages only
    assert _deliver(core, eng) == []
    assert _bytes(eng, "device", own["kv"]) == {0xC3} and _bytes(eng, "device", fenced) == {0xA1}
    assert (core.fenced_ops(), core.device["kv"].free, a.host_pin) == ((), 2, 0)


def test_cancel_takes_back_a_queued_operation_and_fences_an_issued_one() -> None:
    core, eng = _pair()
    fake = eng.backend
    assert isinstance(fake, FakeAsyncBackend)
    a, b = _put(core, "ab"), _put(core, "cd")
    issued = core.writeback(a)
    _run(core, eng)
    queued = core.writeback(b)
    for cmd in core.poll_commands():
        eng.submit(cmd)  # not flushed
    core.advance_step(2)
    assert core.fenced_ops() == (issued.op_id, queued.op_id)
    assert eng.cancel(queued.op_id) == "cancelled" and eng.queued == ()
    assert eng.cancel(issued.op_id) == "fenced" and len(fake.pending()) == 1  # no wait: still running
    assert _deliver(core, eng) == [] and core.fenced_ops() == (issued.op_id,)  # the cancelled one's failed ack
    assert eng.cancel(issued.op_id, wait=True) == "fenced" and fake.pending() == []
    assert _deliver(core, eng) == [] and core.fenced_ops() == ()
    assert core.host["kv"].free == 4 and core.stats.fences_released == 2
    assert eng.cancel(issued.op_id) == "ended" and eng.cancel(99) == "unknown"


def test_cancel_on_the_cpu_backend_finds_every_copy_ended() -> None:
    core, eng = _pair(backend="cpu")
    a = _put(core, "ab")
    cmd = core.writeback(a)
    _run(core, eng)
    core.advance_step(2)
    assert eng.cancel(cmd.op_id, wait=True) == "fenced"  # issued: synchronous, so already done
    assert _deliver(core, eng) == [] and core.fenced_ops() == ()
    assert eng.cancel(cmd.op_id) == "ended"


@pytest.mark.parametrize("backend", ["cpu", "fake-async"])
def test_a_loadback_and_a_writeback_of_one_device_page_in_one_flush_are_refused(backend: str) -> None:
    _, eng = _pair(backend=backend)
    eng.submit(TransferCommand(1, Direction.LOADBACK, (GroupTransfer("kv", (0, 1), (4, 5)),), ()))
    with pytest.raises(UsageError, match=r"^op 2: device page 5 of cache group 'kv' is read by it and written "
                                         r"by op 1 queued for the same flush \(loadback 1, writeback 2\)"):
        eng.submit(TransferCommand(2, Direction.WRITEBACK, (GroupTransfer("kv", (5, 6), (2, 3)),), ()))
    assert eng.queued == (1,)  # nothing changed: the writeback was not queued
    eng.flush()
    eng.synchronize()
    assert [c.op_id for c in eng.poll_completions() if c.layer is None] == [1]
    # later, in its own flush, the writeback is fine
    eng.submit(TransferCommand(2, Direction.WRITEBACK, (GroupTransfer("kv", (5, 6), (2, 3)),), ()))
    assert eng.queued == (2,)


def test_a_host_page_a_writeback_writes_and_a_loadback_reads_in_one_flush_is_refused() -> None:
    _, eng = _pair(backend="cpu")
    eng.submit(TransferCommand(1, Direction.WRITEBACK, (GroupTransfer("kv", (0,), (3,)),), ()))
    with pytest.raises(UsageError, match=r"^op 2: host page 3 of cache group 'kv' is read by it and written by op 1"):
        eng.submit(TransferCommand(2, Direction.LOADBACK, (GroupTransfer("kv", (3,), (6,)),), ()))
    assert eng.queued == (1,)
