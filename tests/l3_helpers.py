"""Helpers of the L3 tier's tests (kvtier.fsm.l3), imported by tests/fsm/l3/ and by the event
log's tests (tests/facade/test_eventlog_check.py): an in-memory fake store answered at
once, a tier beside an ``h1`` core (tests/core_helpers.py), and ``pump``, which answers
every command until none is left, checking both invariants after each answer."""

from __future__ import annotations

from core_helpers import ack, h1, put

from kvtier.fsm import CacheCore
from kvtier.fsm.l3 import L3Options, L3Tier, StoreCommand, StoreOp, StoreResult
from kvtier.fsm.lifecycle.names import HOST_VISIBLE


class FakeStore:
    """Keys -> page payload stand-ins (the host page ids the object came from)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def answer(self, cmd: StoreCommand, *, drop_after_exists: int | None = None) -> StoreResult:
        if cmd.kind is StoreOp.EXISTS:
            n = 0
            for k in cmd.keys:
                if k not in self.data:
                    break
                n += 1
            return StoreResult(cmd.op_id, present=n)
        if cmd.kind is StoreOp.PUT:
            for k, p in zip(cmd.keys, cmd.pages):
                self.data[k] = p
            return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys), nbytes=len(cmd.keys))
        if cmd.kind is StoreOp.GET:
            return StoreResult(cmd.op_id, ok=tuple(k in self.data for k in cmd.keys))
        for k in cmd.keys:
            self.data.pop(k, None)
        return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys))


def backed(core: CacheCore, key: tuple[str, ...]) -> None:
    res = put(core, key)
    cmd = core.writeback(res.node)
    assert cmd is not None
    ack(core, cmd)
    assert res.node.state in HOST_VISIBLE


def pump(tier: L3Tier, store: FakeStore, now: float = 0.0) -> list[StoreCommand]:
    seen = []
    while cmds := tier.poll_commands():
        for c in cmds:
            seen.append(c)
            tier.complete(store.answer(c), now)
            tier.core.check_invariants()
            tier.check_invariants()
    return seen


def make(lease: float = 0.0, **kw: object) -> tuple[CacheCore, L3Tier]:
    core = CacheCore(h1(), 16, 16)
    return core, L3Tier(core, L3Options(lease_s=lease, deadline_s=1.0, **kw))  # type: ignore[arg-type]


KEY = ("a", "b", "c", "d")


# ------------------------------------------------------------------ L3 helpers
def answer_at_once(store: dict[str, object], cmd: StoreCommand) -> StoreResult:
    """A store answered at once: exists counts the leading keys it holds, put stores
    (16 bytes a key), get serves what it holds, remove drops."""
    if cmd.kind is StoreOp.EXISTS:
        n = 0
        while n < len(cmd.keys) and cmd.keys[n] in store:
            n += 1
        return StoreResult(cmd.op_id, present=n)
    if cmd.kind is StoreOp.PUT:
        store.update(zip(cmd.keys, cmd.pages))
        return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys), nbytes=16 * len(cmd.keys))
    if cmd.kind is StoreOp.GET:
        return StoreResult(cmd.op_id, ok=tuple(k in store for k in cmd.keys))
    for k in cmd.keys:
        store.pop(k, None)
    return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys))


def h1_tier(**kw: object) -> L3Tier:
    return L3Tier(CacheCore(h1(), 16, 16), L3Options(deadline_s=1.0, **kw))  # type: ignore[arg-type]


def one_command(tier: L3Tier) -> StoreCommand:
    [cmd] = tier.poll_commands()
    return cmd


def stored(key: tuple[str, ...]) -> dict[str, object]:
    """A store holding every object of ``key``'s prefix, put by a tier that had it backed."""
    store: dict[str, object] = {}
    ta = h1_tier()
    backed(ta.core, key)
    assert ta.offer(key, 0.0) == len(key)
    ta.complete(answer_at_once(store, one_command(ta)), 0.0)
    return store
