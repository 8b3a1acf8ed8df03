"""The L3 tier against a REAL Mooncake Store: a ``mooncake_master`` started by the fixture on
a free loopback port (TCP), the objects held in the segments the kvtier backends mount.
Objects round-trip byte for byte with per-key results, a second instance serves a prefix
the first computed (fingerprints of every hit page checked), read leases are honoured
(no remove is sent while one may hold; the store's own refusal, -706, is a failed remove),
and faults (master killed and restarted mid-replay, a frozen master, a full store evicting
on its own) only shorten hits: requests recompute, nothing wrong is read, and the counters
count every failure. Skipped only when ``mooncake.store`` cannot be imported (failed
instead under KVTIER_REQUIRE_MOONCAKE, as in CI)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from kvtier.fsm.errors import ConfigError
from kvtier.fsm.l3 import L3Options
from kvtier.fsm.presets import preset
from kvtier.replay.l3replay import Instance, run_configuration
from kvtier.scheduler import SchedRequest
from kvtier.transfer.store import HostPageIO, StoreBackend, StoreError, open_store
from kvtier.transfer.store.mooncake_store import MooncakeStore

from store_servers import MooncakeMaster, free_port, mooncake_binary

LAYOUT = preset("llama-3-8b", num_layers=2)
A = LAYOUT.alignment


def _req(rid: str, blocks: list[int], tokens: int) -> SchedRequest:
    units = [(b, j) for b in blocks for j in range(512 // A)][: tokens // A]
    return SchedRequest(rid, 0.0, tokens, 1, tuple(units))


def _instances(m: MooncakeMaster, n: int = 2, deadline: float = 2.0, byte_scale: int = 1024) -> list[Instance]:
    return [Instance(f"i{i}", LAYOUT, 256, 1024, m.url(),
                     L3Options(model="t", deadline_s=deadline, lease_s=m.lease_s), byte_scale)
            for i in range(n)]


def _open(m: MooncakeMaster, **params: object) -> MooncakeStore:
    store = open_store(m.url(**params))
    assert isinstance(store, MooncakeStore)
    return store


def test_backend_roundtrip_per_key_results(mooncake_master: MooncakeMaster) -> None:
    store = _open(mooncake_master)
    assert store.name == "mooncake" and store.lease_s == mooncake_master.lease_s
    big = bytes(range(256)) * 256  # 64 KiB, larger than the 4 KiB slot the first get learns
    assert store.put([("aa", b"x" * 4096), ("bb", b"y" * 4096), ("cc", big)]) == [True, True, True]
    assert store.put([("aa", b"x" * 4096)]) == [True]  # already there: same content, stored
    assert store.exists_prefix(["aa", "bb", "zz", "cc"]) == 2
    assert store.exists_prefix([]) == 0 and store.exists_prefix(["zz", "aa"]) == 0
    assert store.get(["bb", "zz", "aa"]) == [b"y" * 4096, None, b"x" * 4096]
    assert store.get(["aa", "cc", "bb"]) == [b"x" * 4096, big, b"y" * 4096]  # mixed sizes
    other = _open(mooncake_master)  # another client sees the same objects
    assert other.get(["cc", "aa"]) == [big, b"x" * 4096]
    other.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get(["aa"])


def test_batches_larger_than_the_staging_buffer_are_split(mooncake_master: MooncakeMaster) -> None:
    store = _open(mooncake_master, buffer_mb=1)
    blobs = [(f"k{i}", bytes([i]) * (200 << 10)) for i in range(12)]  # 2.4 MiB through a 1 MiB buffer
    assert store.put(blobs) == [True] * 12
    assert store.put([("huge", b"z" * (2 << 20))]) == [False]  # larger than the buffer: not stored
    assert store.exists_prefix([k for k, _ in blobs]) == 12
    assert store.get([k for k, _ in blobs]) == [b for _, b in blobs]
    store.close()


def test_host_pages_roundtrip_through_mooncake_byte_for_byte(mooncake_master: MooncakeMaster) -> None:
    from kvtier.fsm.layout import CacheLayout
    from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family
    from kvtier.transfer.store import ObjectError

    lay = CacheLayout("t", (CacheGroupSpec("g", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("kv", 64),)),), 2)
    regions = {("g", "kv", 0): np.zeros((8, 64), np.uint8), ("g", "kv", 1): np.zeros((8, 64), np.uint8)}
    rng = np.random.default_rng(2)
    for r in regions.values():
        r[:] = rng.integers(0, 255, r.shape, dtype=np.uint8)
    io = HostPageIO(lay, regions)
    key = "33" * 16
    store = _open(mooncake_master)
    assert store.put([(key, io.pack(key, {"g": [2]}))]) == [True]
    [got] = store.get([key])
    assert got is not None
    want = [r[2].copy() for r in regions.values()]
    for r in regions.values():
        r[6] = 0
    io.unpack(io.check(key, got), {"g": [6]})
    assert all((r[6] == w).all() for r, w in zip(regions.values(), want))
    with pytest.raises(ObjectError, match="holds key"):
        io.check("44" * 16, got)
    store.close()


def test_read_lease_refuses_remove_then_allows_it(mooncake_master: MooncakeMaster) -> None:
    a = _open(mooncake_master)
    b = _open(mooncake_master)
    assert a.put([("k1", b"1" * 100), ("k2", b"2" * 100)]) == [True, True]
    time.sleep(mooncake_master.lease_s + 0.1)  # a put may leave a lease too
    assert a.get(["k1"]) == [b"1" * 100]  # the master leases k1 to a
    assert a.lease_holds("k1") and not a.lease_holds("k2")
    assert a.remove(["k1"]) == [False] and a.lease_refusals == 1  # never sent: a's own lease
    assert b.remove(["k1"]) == [False] and b.lease_refusals == 0  # sent; the master refused (-706)
    assert a.exists_prefix(["k1"]) == 1  # still there (and leased again: exists leases too)
    assert b.remove(["k2"]) == [True] and b.exists_prefix(["k2"]) == 0
    time.sleep(mooncake_master.lease_s + 0.1)
    assert not a.lease_holds("k1")
    assert a.remove(["k1", "never-put"]) == [True, True]  # removed; already absent counts as gone
    assert b.exists_prefix(["k1"]) == 0
    a.close()
    b.close()


def test_open_store_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="host and port"):
        open_store("mooncake://127.0.0.1")
    with pytest.raises(ConfigError, match="unknown mooncake URL parameter 'bogus'"):
        open_store("mooncake://127.0.0.1:1?bogus=1")
    with pytest.raises(ConfigError, match="segment_mb=.x. is not a int"):
        open_store("mooncake://127.0.0.1:1?segment_mb=x")
    with pytest.raises(ConfigError, match="at least 16|>= 16"):
        open_store("mooncake://127.0.0.1:1?segment_mb=8")
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the client not installed
    with pytest.raises(ConfigError, match="mooncake-transfer-engine-non-cuda.*libibverbs1"):
        open_store("mooncake://127.0.0.1:1")


@pytest.mark.parametrize(("kw", "message"), [
    ({"lease_s": True}, "mooncake lease_s must be a finite number of seconds >= 0, got True"),
    ({"lease_s": float("inf")}, "mooncake lease_s must be a finite number of seconds >= 0, got inf"),
    ({"lease_s": 10**400}, f"mooncake lease_s must be a finite number of seconds >= 0, got {10**400}"),
    ({"buffer_mb": True}, "mooncake buffer_mb must be a positive integer, got True"),
], ids=["lease-True", "lease-inf", "lease-10**400", "buffer-True"])
def test_a_bad_lease_or_size_is_refused_before_the_client_is_made(kw: dict[str, object], message: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``lease_s=True`` was taken as a 1 s lease and ``inf`` (``?lease_s=inf`` in a URL) as a
    lease that never ends (no remove ever sent), ``buffer_mb=True`` as 1 MiB, and 10**400
    raised OverflowError: each is refused naming the value, before any client is made."""
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # a client made would fail otherwise
    with pytest.raises(ConfigError) as info:
        MooncakeStore("127.0.0.1", 1, **kw)  # type: ignore[arg-type]
    assert str(info.value) == message
    with pytest.raises(ConfigError, match="lease_s must be a finite number"):
        open_store("mooncake://127.0.0.1:1?lease_s=inf")


def test_unreachable_master_fails_at_once() -> None:
    mooncake_binary()  # skips (or fails under KVTIER_REQUIRE_MOONCAKE) without the client
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        open_store(f"mooncake://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert time.monotonic() - t0 < 2  # not Mooncake's own 90 s of setup retries


def test_second_instance_serves_the_prefix_from_mooncake_with_fingerprints(
        mooncake_master: MooncakeMaster) -> None:
    a, b = _instances(mooncake_master)
    a.serve(_req("r1", [1, 2, 3], 1500))
    a.flush()
    assert a.cache.l3 is not None and a.cache.l3.stats.put_ok == 1500 // A  # every full unit put
    b.serve(_req("r2", [1, 2, 3, 4], 1800))
    assert b.result.l3_hit_tokens == 1500 // A * A and b.result.device_hit_tokens == 0
    assert b.cache.l3 is not None
    leased = [o for o in b.cache.l3.objects.values() if o.state == "leased"]
    assert len(leased) == 1500 // A  # every object b read is leased in b's lifecycle
    b.close()
    a.close()
    assert b.result.fingerprint_pages_checked >= 1500 // A  # every hit page checked
    assert b.result.l3_failures == 0 and b.result.l3["get_ok"] == 1500 // A


def test_corrupt_object_is_refused_and_removed_only_after_the_lease(mooncake_master: MooncakeMaster) -> None:
    a, b = _instances(mooncake_master)
    a.serve(_req("r1", [50, 51], 1024))
    a.flush()
    assert b.cache.l3 is not None and b.driver is not None
    keys = b.cache.l3.keys_for(_req("x", [50, 51], 1024).units)
    raw = _open(mooncake_master)
    [blob] = raw.get([keys[3]])
    assert blob is not None
    time.sleep(mooncake_master.lease_s + 0.1)
    assert raw.remove([keys[3]]) == [True]
    assert raw.put([(keys[3], blob[:-5])]) == [True]  # a truncated object under the right key
    time.sleep(mooncake_master.lease_s + 0.1)
    b.serve(_req("r2", [50, 51, 52], 1300))
    assert b.result.l3_hit_tokens == 3 * A  # up to the corrupt object, which was not read
    store = b.driver.write.backend  # the write lane sends the removes
    assert isinstance(store, MooncakeStore)
    b._pump()
    assert b.cache.l3.stats.removes_deferred_by_lease + len(b.cache.l3._pending_removes) >= 1
    assert b.cache.l3.stats.remove_ops == 0  # nothing sent while the lease may hold
    end = time.monotonic() + mooncake_master.lease_s + 3
    while not b.cache.l3.stats.remove_ops and time.monotonic() < end:  # (no exists here: it would lease)
        b._pump()
        time.sleep(0.1)
    b.flush()
    b.close()
    a.close()
    s = b.result.l3
    assert s["get_corrupt"] == 1 and s["remove_keys"] == 1 and store.lease_refusals == 0
    assert raw.exists_prefix([keys[3]]) == 0  # removed once the lease ended
    raw.close()


def _probe(store: StoreBackend) -> bool:
    """A put through ``store`` lands (False while its client is still reconnecting)."""
    try:
        return store.put([("probe", b"p")]) == [True]
    except StoreError:
        return False


def test_master_killed_and_restarted_mid_replay(mooncake_master: MooncakeMaster) -> None:
    a, b = _instances(mooncake_master, deadline=1.0)
    a.serve(_req("r1", [10, 11], 1024))
    a.flush()
    mooncake_master.kill()
    b.serve(_req("r2", [10, 11, 12], 1300))  # master down: recompute, count the failure
    assert b.result.l3_hit_tokens == 0 and b.result.hit_tokens == 0
    a.serve(_req("r3", [20], 512))  # its puts fail
    a.flush()
    mooncake_master.start()  # back, with no metadata: everything stored before is gone
    assert a.driver is not None
    end = time.monotonic() + 15
    while (a.driver.fetch._queued or a.driver.write._queued) and time.monotonic() < end:  # a's late puts still retrying: wait them out
        time.sleep(0.1)
    # the clients mount their segments again on their own (a's driver is idle: probe through it)
    while not _probe(a.driver.write.backend) and time.monotonic() < end:
        time.sleep(0.2)
    b.serve(_req("r4", [10, 11, 13], 1300))  # the data is gone: a miss, not an error
    assert b.result.l3_hit_tokens == 0
    a.serve(_req("r5", [30, 31], 1024))  # puts work again
    a.flush()
    b.serve(_req("r6", [30, 31, 32], 1200))
    assert b.result.l3_hit_tokens == 1024
    b.close()
    a.close()
    sa, sb = a.result.l3, b.result.l3
    assert sb["op_errors"] + sb["expired_ops"] >= 1 and sa["put_failed"] + sa["op_errors"] + sa["expired_ops"] >= 1
    assert sa["put_ok"] >= 1024 // A  # (the first put after the restart may answer after its deadline)
    assert b.result.fingerprint_pages_checked >= 1024 // A


def test_frozen_master_hits_the_deadline_and_recomputes(mooncake_master: MooncakeMaster) -> None:
    a, b = _instances(mooncake_master, deadline=0.5)
    a.serve(_req("r1", [40, 41], 1024))
    a.serve(_req("r0", [60, 61], 1024))
    a.flush()
    t = mooncake_master.slow(1.5)
    t0 = time.monotonic()
    b.serve(_req("r2", [40, 41, 42], 1200))
    waited = time.monotonic() - t0
    assert b.result.l3_hit_tokens == 0 and waited < 1.4  # the deadline, not the master, ended it
    t.join()
    b.flush()
    time.sleep(0.3)
    b._pump()  # the late answer is absorbed
    b.serve(_req("r3", [60, 61, 43], 1200))  # works again
    assert b.result.l3_hit_tokens == 1024
    b.close()
    a.close()
    s = b.result.l3
    assert s["expired_ops"] >= 1
    assert s["absorbed_late_results"] + s["op_errors"] >= 1


def test_full_store_evicts_and_nothing_wrong_is_read(mooncake_master: MooncakeMaster) -> None:
    # two 16 MiB segments; 40 requests x 96 objects x 16 KiB = 60 MiB put
    insts = _instances(mooncake_master, n=2, byte_scale=8)
    reqs = [_req(f"r{i}", [100 + i, 200 + i, 300 + i], 1536) for i in range(40)]
    for r in reqs:
        insts[0].serve(r)
        insts[0].flush()
    assert insts[1].cache.l3 is not None
    first = insts[1].cache.l3.keys_for(reqs[0].units)
    raw = _open(mooncake_master)
    assert raw.exists_prefix(first) < len(first)  # the store dropped objects on its own
    raw.close()  # (its segment, empty, leaves with it)
    for i, r in enumerate(reversed(reqs)):  # newest first: b's own puts make the store evict more
        insts[1].serve(SchedRequest(f"s{i}", 0.0, r.prompt_tokens, 1, r.units))
    for inst in insts:
        inst.close()
    a, b = insts[0].result, insts[1].result
    assert a.l3["put_ok"] > 0 and a.l3["put_ok"] + a.l3["put_failed"] == a.l3["put_keys"]
    assert 0 < b.l3_hit_tokens < b.prompt_tokens  # some survived, some did not: hits shortened
    assert b.fingerprint_pages_checked >= b.l3_hit_tokens // A
    assert b.l3["get_corrupt"] == 0


def test_multi_instance_replay_l3_recovers_routing_loss(mooncake_master: MooncakeMaster) -> None:
    reqs, ids = [], []
    for i in range(24):
        blocks = [i % 3, 1000 + i]
        reqs.append(_req(f"q{i}", blocks, 900))
        ids.append(blocks)
    # the L3 tier's clock is the test's (it never runs out), and each request's puts land
    # before the next request: the counts do not depend on the machine's speed or load
    opts = L3Options(model="t", lease_s=mooncake_master.lease_s, deadline_s=120.0)
    no = run_configuration(reqs, ids, LAYOUT, 4, 256, 1024, "rr", None)
    l3 = run_configuration(reqs, ids, LAYOUT, 4, 256, 1024, "rr", mooncake_master.url(), opts,
                           clock=lambda: 0.0, settle_puts=True)
    one = run_configuration(reqs, ids, LAYOUT, 1, 1024, 4096, "rr", None)
    lost = one[-1].hit_tokens - no[-1].hit_tokens
    assert lost > 0, (one[-1], no[-1])
    assert l3[-1].hit_tokens - no[-1].hit_tokens >= 0.9 * lost
    assert l3[-1].l3_hit_tokens > 0 and l3[-1].l3_failures == 0
