"""The L3 tier against a REAL redis-server (started by the fixture on a free loopback port):
objects round-trip byte for byte, a second instance serves a prefix the first computed
(fingerprints of every hit page checked), and faults (server killed and restarted mid-
replay, a slow server, a full server evicting on its own, a torn object) only shorten hits:
requests recompute, nothing wrong is read, and the counters count every failure."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.fsm import CacheCore
from kvtier.fsm.l3 import L3Options, L3Tier, StoreOp
from kvtier.fsm.presets import preset
from kvtier.replay.l3replay import Instance, run_configuration
from kvtier.scheduler import SchedRequest
from kvtier.transfer.store import HostPageIO, StoreDriver, open_store
from kvtier.transfer.store.redis_store import RedisStore

from store_servers import RedisServer

LAYOUT = preset("llama-3-8b", num_layers=2)
A = LAYOUT.alignment


def _req(rid: str, blocks: list[int], tokens: int) -> SchedRequest:
    units = [(b, j) for b in blocks for j in range(512 // A)][: tokens // A]
    return SchedRequest(rid, 0.0, tokens, 1, tuple(units))


def _instances(url: str, n: int = 2, deadline: float = 2.0) -> list[Instance]:
    return [Instance(f"i{i}", LAYOUT, 256, 1024, url, L3Options(model="t", deadline_s=deadline), 1024)
            for i in range(n)]


def test_backend_roundtrip_prefix_and_one_key_per_object(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url)
    assert isinstance(store, RedisStore) and store.lease_s == 0
    assert store.put([("aa", b"x" * 100), ("bb", b"y")]) == [True, True]
    assert store.exists_prefix(["aa", "bb", "cc", "aa"]) == 2
    assert store.get(["bb", "cc", "aa"]) == [b"y", None, b"x" * 100]
    c = redis_server.client()
    assert sorted(c.keys("kvtier:*")) == [b"kvtier:aa", b"kvtier:bb"]  # type: ignore[attr-defined]
    assert store.remove(["aa", "zz"]) == [True, True] and store.exists_prefix(["aa"]) == 0
    store.close()


def test_host_pages_roundtrip_through_redis_byte_for_byte(redis_server: RedisServer) -> None:
    regions = {("g", "kv", 0): np.zeros((8, 64), np.uint8), ("g", "kv", 1): np.zeros((8, 64), np.uint8)}
    from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family
    from kvtier.fsm.layout import CacheLayout
    lay = CacheLayout("t", (CacheGroupSpec("g", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("kv", 64),)),), 2)
    rng = np.random.default_rng(1)
    for r in regions.values():
        r[:] = rng.integers(0, 255, r.shape, dtype=np.uint8)
    io = HostPageIO(lay, regions)
    key = "11" * 16
    blob = io.pack(key, {"g": [3]})
    store = open_store(redis_server.url)
    store.put([(key, blob)])
    [got] = store.get([key])
    assert got is not None
    payload = io.check(key, got)
    want = [r[3].copy() for r in regions.values()]
    for r in regions.values():
        r[5] = 0
    io.unpack(payload, {"g": [5]})
    assert all((r[5] == w).all() for r, w in zip(regions.values(), want))
    from kvtier.transfer.store import ObjectError
    with pytest.raises(ObjectError, match="holds key"):
        io.check("22" * 16, got)
    with pytest.raises(ObjectError, match="digest"):
        io.check(key, got[:-1] + bytes([got[-1] ^ 1]))
    with pytest.raises(ObjectError, match="payload"):
        io.check(key, got[:-10])
    store.close()


def test_second_instance_serves_the_prefix_from_redis_with_fingerprints(redis_server: RedisServer) -> None:
    a, b = _instances(redis_server.url)
    req = _req("r1", [1, 2, 3], 1500)
    a.serve(req)
    a.flush()
    assert a.cache.l3 is not None and a.cache.l3.stats.put_ok == 1500 // A  # every full unit put
    b.serve(_req("r2", [1, 2, 3, 4], 1800))
    assert b.result.l3_hit_tokens == 1500 // A * A and b.result.device_hit_tokens == 0
    for inst in (a, b):
        inst.close()
    assert b.result.fingerprint_pages_checked >= 1500 // A  # every hit page checked
    assert b.result.l3_failures == 0 and b.result.l3["get_ok"] == 1500 // A


def test_server_killed_and_restarted_mid_replay(redis_server: RedisServer) -> None:
    a, b = _instances(redis_server.url, deadline=1.0)
    a.serve(_req("r1", [10, 11], 1024))
    a.flush()
    redis_server.kill()
    b.serve(_req("r2", [10, 11, 12], 1300))  # store down: recompute, count the failure
    assert b.result.l3_hit_tokens == 0 and b.result.hit_tokens == 0
    b.serve(_req("r3", [20], 512))
    redis_server.start()  # back, empty
    b.serve(_req("r4", [10, 11, 13], 1300))  # the data is gone: a miss, not an error
    assert b.result.l3_hit_tokens == 0
    a.serve(_req("r5", [30, 31], 1024))  # puts work again
    a.flush()
    b.serve(_req("r6", [30, 31, 32], 1200))
    assert b.result.l3_hit_tokens == 1024
    for inst in (a, b):
        inst.close()
    sa, sb = a.result.l3, b.result.l3
    assert sb["op_errors"] + sb["expired_ops"] >= 1 and sa["put_ok"] > 0
    assert b.result.fingerprint_pages_checked >= 1024 // A


def test_slow_server_hits_the_deadline_and_recomputes(redis_server: RedisServer) -> None:
    a, b = _instances(redis_server.url, deadline=0.5)
    a.serve(_req("r1", [40, 41], 1024))
    a.serve(_req("r0", [60, 61], 1024))
    a.close()
    t = redis_server.slow(1.5)
    t0 = time.monotonic()
    b.serve(_req("r2", [40, 41, 42], 1200))
    waited = time.monotonic() - t0
    assert b.result.l3_hit_tokens == 0 and waited < 1.4  # the deadline, not the server, ended it
    t.join()
    b.serve(_req("r3", [60, 61, 43], 1200))  # the late answer was absorbed; works again
    assert b.result.l3_hit_tokens == 1024
    b.close()
    s = b.result.l3
    assert s["expired_ops"] >= 1
    assert s["absorbed_late_results"] + s["op_errors"] >= 1


def test_full_server_evicts_and_nothing_wrong_is_read(redis_server: RedisServer) -> None:
    redis_server.fill_limit(2 * 1024 * 1024)
    insts = _instances(redis_server.url, n=2)
    reqs = [_req(f"r{i}", [100 + i, 200 + i, 300 + i], 1536) for i in range(40)]
    for r in reqs:
        insts[0].serve(r)
    for i, r in enumerate(reqs):
        insts[1].serve(SchedRequest(f"s{i}", 0.0, r.prompt_tokens, 1, r.units))
    for inst in insts:
        inst.close()
    info = redis_server.client().info("stats")  # type: ignore[attr-defined]
    assert info["evicted_keys"] > 0  # the server dropped objects on its own
    b = insts[1].result
    assert 0 < b.l3_hit_tokens < b.prompt_tokens  # some survived, some did not: hits shortened
    assert b.fingerprint_pages_checked >= b.l3_hit_tokens // A


def test_torn_or_foreign_object_is_refused_and_removed(redis_server: RedisServer) -> None:
    a, b = _instances(redis_server.url)
    a.serve(_req("r1", [50, 51], 1024))
    a.close()
    assert b.cache.l3 is not None
    keys = b.cache.l3.keys_for(_req("x", [50, 51], 1024).units)
    c = redis_server.client()
    blob = c.get("kvtier:" + keys[3])  # type: ignore[attr-defined]
    c.set("kvtier:" + keys[3], blob[:-5])  # type: ignore[attr-defined]  # truncate one object
    b.serve(_req("r2", [50, 51, 52], 1300))
    assert b.result.l3_hit_tokens == 3 * A  # up to the torn object
    b._pump()
    deadline = time.monotonic() + 2
    while c.exists("kvtier:" + keys[3]) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        b._pump()
        time.sleep(0.05)
    b.close()
    assert b.result.l3["get_corrupt"] == 1 and b.result.l3["remove_keys"] == 1
    assert not c.exists("kvtier:" + keys[3])  # type: ignore[attr-defined]


def test_multi_instance_replay_l3_recovers_routing_loss(redis_server: RedisServer) -> None:
    """A small trace where routing splits every shared prefix: without L3 the instances
    miss what another computed; with L3 they hit it."""
    reqs, ids = [], []
    for i in range(24):
        blocks = [i % 3, 1000 + i]  # rr over 4 instances splits each shared prefix
        reqs.append(_req(f"q{i}", blocks, 900))
        ids.append(blocks)
    no = run_configuration(reqs, ids, LAYOUT, 4, 256, 1024, "rr", None)
    # the L3 tier's clock is the test's (it never runs out), and each request's puts land
    # before the next request: the counts do not depend on the machine's speed or load
    l3 = run_configuration(reqs, ids, LAYOUT, 4, 256, 1024, "rr", redis_server.url,
                           L3Options(model="t", deadline_s=120.0), clock=lambda: 0.0, settle_puts=True)
    one = run_configuration(reqs, ids, LAYOUT, 1, 1024, 4096, "rr", None)
    lost = one[-1].hit_tokens - no[-1].hit_tokens
    assert lost > 0, (one[-1], no[-1])
    assert l3[-1].hit_tokens - no[-1].hit_tokens >= 0.9 * lost
    assert l3[-1].l3_hit_tokens > 0 and l3[-1].l3_failures == 0
