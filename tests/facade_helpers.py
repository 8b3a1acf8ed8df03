"""Helpers of the facade tests (:class:`kvtier.tiered.TieredCache`), imported by the test files
of the facade and of the request lifecycle (tests/facade/, tests/fsm/request/).

Layouts are those of tests/core_helpers.py: ``h1`` has one history group ``kv`` with 2 tokens
per page (alignment 2: one page per unit, 2 layers).
"""

from __future__ import annotations

from typing import Any

from core_helpers import h1, snapshot, src

from kvtier.fsm import Completion
from kvtier.fsm.presets import preset
from kvtier.tiered import TieredCache


def ack(c: TieredCache, op: int, ok: bool = True) -> None:
    """Acknowledge ``op`` on every rank; the invariants hold after each."""
    for rank in range(c.core.world_size):
        c.complete(Completion(op, rank, ok))
        c.check_invariants()


def layer(c: TieredCache, op: int, upto: int, ranks: Any = None) -> None:
    for rank in range(c.core.world_size) if ranks is None else ranks:
        c.complete(Completion(op, rank, True, upto))
        c.check_invariants()


def prefill(c: TieredCache, rid: str, key: str, prompt: int, checkpoint: bool = False) -> None:
    """Admit ``rid`` with its whole prompt as one chunk and report the forward pass."""
    adm = c.admit(rid, list(key), prompt_tokens=prompt, chunk_tokens=prompt)
    assert adm is not None and adm.loadback_op is None
    c.step_done(rid, adm.chunk_tokens, checkpoint=checkpoint)
    c.check_invariants()


def free(c: TieredCache, pool: str = "device") -> dict[str, int]:
    allocs = c.core.device if pool == "device" else c.core.host
    assert allocs is not None
    return {g: a.free for g, a in allocs.items()}


def held(c: TieredCache) -> dict[str, int]:
    """Device pages held outside the tree (by requests), per group."""
    return {g: len(c.core.external_pages(g)) for g in c.core.device}


def only_node(c: TieredCache):
    (n,) = c.core.nodes()
    return n


def seeded(world: int = 1, device: int = 8, **kw: Any) -> TieredCache:
    """h1 cache whose tree holds ``abcd`` (4 units) on the host only (host pages 0-3)."""
    c = TieredCache(h1(), device, 8, policy="write_back", world_size=world, finish_writeback=True, **kw)
    prefill(c, "seed", "abcd", 9)
    c.finish("seed")
    assert c.state("seed") == "finishing"
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id)
    assert [e.state for e in c.poll().events] == ["finished"]
    assert c.core.evict_device({"kv": 8}) == {"kv": 4}
    assert only_node(c).state == "host" and free(c) == {"kv": device}
    c.check_invariants()
    return c


def fsnap(c: TieredCache) -> tuple[Any, ...]:
    """Everything observable about the facade and its core (through public views)."""
    reqs = [(v, c.page_table(v.request_id), c.unit_keys(v.request_id),
             [c.layer_ready(v.request_id, i) for i in range(c.layout.num_layers)]) for v in c.requests()]
    return (sorted(reqs, key=repr), c.table.pending_events(), c.aborted_by_scheduler, snapshot(c.core))


def serve_readme_example(cache: TieredCache) -> None:
    """The README's embedding example (four requests, a host round trip)."""
    def engine_round() -> None:
        for cmd in cache.poll().commands:
            cache.complete(Completion(cmd.op_id))

    def serve(rid: str, units: list[Any], prompt: int) -> None:
        adm = cache.admit(rid, units, prompt_tokens=prompt, chunk_tokens=32)
        assert adm is not None
        tokens, step = adm.start_token, adm.chunk_tokens
        while True:
            engine_round()
            cache.step_done(rid, step)
            tokens += step
            if tokens == prompt + 3:
                break
            step = min(32, prompt - tokens) if tokens < prompt else 1
            assert cache.reserve(rid, step) is not None
        cache.finish(rid)
        engine_round()
        cache.check_invariants()

    system = [("system", i) for i in range(4)]
    serve("a", system, 70)
    serve("b", system, 70)
    serve("c", [("other", i) for i in range(6)], 100)
    serve("d", system, 70)


def readme_cache() -> TieredCache:
    """Llama 3 8B, 8 device and 64 host pages, write_through: the README example's cache."""
    return TieredCache(preset("llama-3-8b"), device_pages=8, host_pages=64, policy="write_through")


def borrowing() -> TieredCache:
    """src(): ``a`` published 2 units with the checkpoint at 8 tokens; ``b`` hit them and
    owes its first pass, which copies that checkpoint (borrowed)."""
    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("a")
    adm = c.admit("b", list("abcd"), prompt_tokens=12, chunk_tokens=4)
    assert adm is not None and adm.checkpoint_pages == {"swa": [4, 5, 6, 7]}
    r = c.table.get("b")
    assert (r.canon, r.own, r.ckpt_pages) == ({"fh": [0, 1]}, {"fh": [2], "swa": [3, 2, 1, 0]}, {"swa": [4, 5, 6, 7]})
    c.check_invariants()
    return c


def two_decoding() -> TieredCache:
    """Requests a and b decoding: prompts of 8 tokens computed and published, 1 more token reserved."""
    c = TieredCache(h1(), 32, None)
    for rid, key in (("a", "abcd"), ("b", "efgh")):
        assert c.admit(rid, list(key), prompt_tokens=8, chunk_tokens=8) is not None
        assert c.step_done(rid, 8) == {}
        assert c.reserve(rid, 1) is not None
    return c


def seen(c: TieredCache) -> tuple[Any, ...]:
    """What a call may change: the counters, every request's record and the tree."""
    recs = [(r.request_id, r.state, r.tokens, r.reserved, r.passes, r.results, list(r.units),
             {g: list(p) for g, p in r.own.items()}) for r in c.table]
    return c.stats(), recs, snapshot(c.core)
