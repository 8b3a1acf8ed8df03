"""Helpers of the generated hostile-input tests of the facade (tests/facade/test_hostile_*.py):
a cache in each state that takes ``step_done``, a refusal check that asserts nothing changed
through every public view, and the families of bad values shared by the files.

Layout ``h1`` (tests/core_helpers.py): one history group ``kv``, 2 tokens per page, one
page per unit (alignment 2), 2 layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from core_helpers import h1, snapshot

from kvtier.fsm import Completion
from kvtier.tiered import TieredCache

__all__ = ["ack", "drain", "view", "refused", "seeded", "in_state", "STEP_STATES", "BAD_IDS", "NP_INTS", "h1"]

def ack(c: TieredCache, op: int, ok: bool = True) -> None:
    for rank in range(c.core.world_size):
        c.complete(Completion(op, rank, ok))


def drain(c: TieredCache) -> None:
    """Poll and acknowledge every command until nothing is in flight (bounded)."""
    for _ in range(100):
        cmds = c.poll().commands
        for cmd in cmds:
            ack(c, cmd.op_id)
        if not cmds and not c.core.ops_in_flight():
            c.poll()
            return
    raise AssertionError("did not drain")


def view(c: TieredCache) -> tuple[Any, ...]:
    """Everything observable about the facade and its core, through public views."""
    reqs = [(v, c.page_table(v.request_id), c.unit_keys(v.request_id),
             [c.layer_ready(v.request_id, i) for i in range(c.layout.num_layers)]) for v in c.requests()]
    return (sorted(reqs, key=repr), c.table.pending_events(), c.aborted_by_scheduler, c.outstanding(),
            c.stats(), c.core.pending_commands(), snapshot(c.core))


def refused(c: TieredCache, call: Callable[[], object], error: type[Exception], *fragments: str) -> None:
    """``call`` raises exactly ``error`` (not a subclass), naming ``fragments``, and
    changes nothing; the invariants still hold."""
    before = view(c)
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert view(c) == before, "a refused call changed something"
    c.check_invariants()


def seeded(**kw: Any) -> TieredCache:
    """Host-only ``abcd`` in the tree (a loadback hit), nothing else held."""
    c = TieredCache(h1(), 8, 8, policy="write_through", **kw)
    c.admit("seed", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("seed", 9)
    c.finish("seed")
    drain(c)
    c.core.evict_device({"kv": 8})
    assert [n.state for n in c.core.nodes()] == ["host"]
    return c


def in_state(state: str) -> TieredCache:
    """A cache whose request ``r`` is in ``state`` with one forward result owed (a pass of
    4 tokens reserved), for the states that take ``step_done``."""
    if state == "running":
        c = TieredCache(h1(), 8, 8)
        c.admit("r", list("wxyz"), prompt_tokens=9, chunk_tokens=4)
    else:
        c = seeded()
        adm = c.admit("r", list("abcdef"), prompt_tokens=13, chunk_tokens=4)  # hit: 8 tokens
        assert adm is not None and adm.loadback_op is not None and adm.chunk_tokens == 4
        c.poll()
        if state == "fenced":
            ack(c, adm.loadback_op, ok=False)
        elif state == "aborting":
            c.abort("r")
    assert c.state("r") == state and c.request("r").owed_forward == 1
    c.check_invariants()
    return c


STEP_STATES = ["running", "loading", "fenced", "aborting"]
BAD_IDS: list[object] = [None, 1, "", b"r", ("r",), "nobody"]
NP_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.intp]
