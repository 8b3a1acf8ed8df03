"""Shared fixtures of the core unit tests (tests/test_core_*.py): tiny hand-built
layouts, a publish helper, completion helpers and a snapshot for "nothing changed".

Layouts (all page ids and counts in the tests follow from these):

- ``h1()``: one history group ``kv``: 2 tokens per page; alignment 2, 1 page per unit.
- ``h2()``: history ``a`` (2 tokens per page) and ``b`` (4 tokens per page);
  alignment 4, so 2 ``a`` pages and 1 ``b`` page per unit.
- ``src()``: source_system.md section 5's fixture: ``fh`` history rows 4 stride 1
  (4 tokens per page, alignment 4, 1 page per unit) and ``swa`` state rows 2 stride 1
  (2 tokens per page) window 8, so a checkpoint is 4 ``swa`` pages; 2 layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from kvtier.fsm import CacheCore, InsertResult
from kvtier.fsm.errors import InvariantViolation, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import CacheGroupSpec, Completion, ComponentSpec, Family, TransferCommand


def h1() -> CacheLayout:
    kv = CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1), (ComponentSpec("kv", 16),))
    return CacheLayout("h1", (kv,), 2)


def h2() -> CacheLayout:
    a = CacheGroupSpec("a", Family.HISTORY, 2, 1, (0,), (ComponentSpec("kv", 8),))
    b = CacheGroupSpec("b", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 8),))
    return CacheLayout("h2", (a, b), 1)


def src() -> CacheLayout:
    fh = CacheGroupSpec("fh", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("kv", 16),))
    swa = CacheGroupSpec("swa", Family.STATE, 2, 1, (0, 1), (ComponentSpec("kv", 8),), window=8)
    return CacheLayout("src", (fh, swa), 2)


def put(cache: CacheCore, key: Sequence[str], table: Mapping[str, Sequence[int]] | None = None, *,
        ckpt: bool = False, chunk: bool = False) -> InsertResult:
    """Publish ``key``: ``table`` is the caller's canonical prefix pages (per history
    group); the rest of the key (and a checkpoint if ``ckpt``) is freshly allocated."""
    layout = cache.layout
    have = {g.name: list((table or {}).get(g.name, ())) for g in layout.history_groups}
    need = {g.name: len(key) * layout.pages_per_unit(g) - len(have[g.name]) for g in layout.history_groups}
    if ckpt:
        need.update({g.name: g.state_pages for g in layout.state_groups})
    got = cache.alloc_device(need, evict=False)
    pages = {g: have[g] + got.get(g, []) for g in have}
    checkpoint = {g.name: got[g.name] for g in layout.state_groups} if ckpt else None
    res = cache.insert(tuple(key), pages, checkpoint, chunk_checkpoint=chunk)
    cache.check_invariants()
    return res


def ack(cache: CacheCore, cmd: TransferCommand | int, ok: bool | Sequence[bool] = True) -> list:
    """Acknowledge ``cmd`` on every rank (``ok`` per rank or for all); returns what the
    last acknowledgement returned. Checks the invariants after each one."""
    op_id = cmd if isinstance(cmd, int) else cmd.op_id
    oks = [ok] * cache.world_size if isinstance(ok, bool) else list(ok)
    out: list = []
    for rank, r_ok in enumerate(oks):
        out = cache.complete(Completion(op_id, rank=rank, ok=r_ok))
        cache.check_invariants()
    return out


def backed_chain(policy: str = "write_through_selective") -> tuple[CacheCore, object, object]:
    """h1 cache (8 device / 8 host units): A=(a,b) pages 0,1 and B=(c,d) pages 2,3, both backed."""
    c = CacheCore(h1(), 8, 8, policy=policy)
    ra = put(c, "ab")
    ack(c, c.writeback(ra.node))
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    return c, ra.node, rb.node


def free(cache: CacheCore, pool: str = "device") -> dict[str, int]:
    allocs = cache.device if pool == "device" else cache.host
    assert allocs is not None
    return {g: a.free for g, a in allocs.items()}


def state(cache: CacheCore) -> dict[int, str]:
    return {n.node_id: n.state for n in cache.nodes()}


def snapshot(cache: CacheCore) -> tuple:
    """Everything observable about the cache, to assert that a refused call changed nothing."""
    nodes = {}
    for n in cache.nodes():
        assert n.parent is not None
        nodes[n.node_id] = (
            n.state, n.key, n.parent.node_id, n.depth,
            {g: list(p) for g, p in n.dev.items()}, {g: list(p) for g, p in n.host.items()},
            {g: list(p) for g, p in n.pending.items()}, {g: list(p) for g, p in n.dev_ckpt.items()},
            {g: list(p) for g, p in n.host_ckpt.items()}, {g: list(p) for g, p in n.pending_ckpt.items()},
            n.lock_ref, n.borrow_ref, n.host_pin, n.hit_count, n.last_access, n.wb_op, n.lb_op,
            n.chunk_checkpoint, sorted(n.refs))
    ops = {i: (sorted(o.acked), o.ok, dict(o.layers), sorted(o.seen, key=repr), [n.node_id for n in o.nodes])
           for i, o in cache.operations().items()}
    dev_free = {g: sorted(a.free_pages()) for g, a in cache.device.items()}
    host_free = {g: sorted(a.free_pages()) for g, a in (cache.host or {}).items()}
    external = {g.name: sorted(cache.external_pages(g.name)) for g in cache.layout.groups}
    return (nodes, ops, dev_free, host_free, external, cache.queued_writebacks(), cache.clock, cache.step,
            sorted(r.receipt_id for r in cache.receipts.locks()),
            sorted(r.receipt_id for r in cache.receipts.node_receipts()))


def fake_async_engine(chunk_layers: int):  # type: ignore[no-untyped-def]
    """A TransferEngine on the fake-asynchronous backend: one history group of 8 layers,
    16 host and 12 device pages of random bytes (skips the test without torch)."""
    torch = pytest.importorskip("torch")
    from kvtier.transfer import DevicePool, HostPool, TransferEngine

    specs = [CacheGroupSpec("kv", "history", 4, 1, tuple(range(8)), (ComponentSpec("k", 32),))]
    host, dev = HostPool(specs, 16), DevicePool.allocate(specs, 12, "cpu")
    for pool in (host, dev):
        for k in pool.keys():
            pool.region(*k).copy_(torch.randint(0, 256, tuple(pool.region(*k).shape), dtype=torch.uint8))
    return TransferEngine(specs, host, dev, "fake-async", chunk_layers=chunk_layers)


def keys(prefix: str, n: int) -> tuple[str, ...]:
    """``n`` unit keys ``prefix0``, ``prefix1``, ...."""
    return tuple(f"{prefix}{i}" for i in range(n))


def violation(c: CacheCore) -> tuple[str, str]:
    """The invariant ``check_invariants`` names and its message (it must raise)."""
    with pytest.raises(InvariantViolation) as e:
        c.check_invariants()
    return e.value.invariant, str(e.value)


def says(call: object, message: str, error: type[Exception] = UsageError) -> None:
    """``call()`` raises exactly ``error`` with exactly ``message``."""
    with pytest.raises(error) as exc:
        call()  # type: ignore[operator]
    assert type(exc.value) is error and str(exc.value) == message
