"""Batch put / get / exists through kvtier's two L3 backends, measured in one run.

Starts a ``redis-server`` and a ``mooncake_master`` (the wheel's) on free loopback ports,
opens :class:`kvtier.transfer.store.RedisStore` and
:class:`kvtier.transfer.store.mooncake_store.MooncakeStore` on them (one Mooncake client,
which mounts the segment that holds the objects), and for each object size times batches of
``--batch`` objects: put (fresh keys every round), exists (the whole batch present), get.
A ``mooncake raw`` row times Mooncake's own zero-copy calls (``batch_put_from`` /
``batch_get_into`` on the registered buffer, no bytes objects), i.e. what the backend adds.
Rounds interleave the stores (put of each, exists of each, get of each), so a busy machine
slows them alike. Prints a table (median of ``--rounds`` rounds after one warm-up, ms per
batch and MB/s) and the Redis / Mooncake time ratios.

    python bench/l3_stores.py [--sizes 4096 65536] [--batch 200] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    raise SystemExit(f"{what} did not start on port {port}")


def _ok(good: bool) -> None:
    if not good:
        raise SystemExit("a store answered wrongly (a put refused, an object missing or wrong)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536], help="object bytes")
    p.add_argument("--batch", type=int, default=200, help="objects per batch")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import numpy as np

    from kvtier.transfer.store import open_store

    tmp = tempfile.mkdtemp(prefix="kvtier-l3bench-")
    rport, mport = _free_port(), _free_port()
    redis_bin = shutil.which("redis-server")
    master_bin = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if redis_bin is None or not os.path.exists(master_bin):
        raise SystemExit("needs redis-server (apt-get install redis-server) and mooncake_master "
                         "(pip install mooncake-transfer-engine-non-cuda)")
    procs = [
        subprocess.Popen([redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([master_bin, "-rpc_address=127.0.0.1", f"-rpc_port={mport}",
                          f"-metrics_port={_free_port()}", "-logtostderr=false", f"-log_dir={tmp}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    rows: list[dict[str, Any]] = []
    try:
        _wait_port(rport, procs[0], "redis-server")
        _wait_port(mport, procs[1], "mooncake_master")
        per_round = args.batch * max(args.sizes)
        # the backend and the raw calls put fresh keys every round: room for all, far below the
        # master's eviction watermark (90 %), so nothing is evicted while it is measured
        seg_mb = max(64, (per_round * (args.rounds + 1) * 2 * 2 >> 20) + 64)
        stores = {"redis": open_store(f"redis://127.0.0.1:{rport}"),
                  "mooncake": open_store(f"mooncake://127.0.0.1:{mport}?segment_mb={seg_mb}"
                                         f"&buffer_mb={max(8, (per_round >> 20) + 8)}")}
        rng = np.random.default_rng(0)
        mc: Any = stores["mooncake"]
        for size in args.sizes:
            blobs = [rng.integers(0, 255, size, dtype=np.uint8).tobytes() for _ in range(args.batch)]
            nbytes = size * args.batch
            # Mooncake's own zero-copy calls on the backend's registered buffer (no bytes objects)
            client, ptr = mc._client, mc._ptr
            ptrs, sizes = [ptr + i * size for i in range(args.batch)], [size] * args.batch

            def ops(name: str) -> dict[str, Callable[[int], Any]]:
                def keys(r: int) -> list[str]:
                    return [f"{name}-{size}-{r}-{i}" for i in range(args.batch)]

                if name == "mooncake raw":
                    def rput(r: int) -> None:
                        mc._buf[:nbytes] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
                        assert all(c == 0 for c in client.batch_put_from(keys(r), ptrs, sizes))

                    return {"put": rput,
                            "exists": lambda r: _ok(all(c == 1 for c in client.batch_is_exist(keys(r)))),
                            "get": lambda r: _ok(all(c == size for c in client.batch_get_into(keys(r), ptrs, sizes)))}
                st = stores[name]

                def get(r: int) -> None:
                    got = st.get(keys(r))
                    assert got[0] == blobs[0] and got[-1] == blobs[-1]

                return {"put": lambda r: _ok(all(st.put(list(zip(keys(r), blobs))))),
                        "exists": lambda r: _ok(st.exists_prefix(keys(r)) == args.batch),
                        "get": get}

            names = ["redis", "mooncake", "mooncake raw"]
            table = {n: ops(n) for n in names}
            times: dict[tuple[str, str], list[float]] = {(n, o): [] for n in names for o in ("put", "exists", "get")}
            for r in range(-1, args.rounds):  # interleaved, so the machine's load hits every store alike
                for op in ("put", "exists", "get"):
                    for n in names:
                        t0 = time.perf_counter()
                        table[n][op](r)
                        if r >= 0:
                            times[(n, op)].append(time.perf_counter() - t0)
            for n in names:
                rows.append({"store": n, "object_bytes": size, "batch": args.batch,
                             **{f"{o}_ms": statistics.median(times[(n, o)]) * 1e3 for o in ("put", "exists", "get")}})
        for st in stores.values():
            st.close()
    finally:
        for pr in procs:
            pr.kill()
            pr.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"batch of {args.batch} objects, median of {args.rounds} rounds (loopback TCP)")
    print("| store | object | put ms | put MB/s | exists ms | get ms | get MB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mb = r["object_bytes"] * r["batch"] / 1e6
        print(f"| {r['store']} | {r['object_bytes'] // 1024} KiB | {r['put_ms']:.2f} | {mb / r['put_ms'] * 1e3:.0f} | "
              f"{r['exists_ms']:.2f} | {r['get_ms']:.2f} | {mb / r['get_ms'] * 1e3:.0f} |")
    print()
    for size in args.sizes:
        red = next(r for r in rows if r["store"] == "redis" and r["object_bytes"] == size)
        moo = next(r for r in rows if r["store"] == "mooncake" and r["object_bytes"] == size)
        print(f"{size // 1024} KiB: redis / mooncake time: put {red['put_ms'] / moo['put_ms']:.2f}x, "
              f"exists {red['exists_ms'] / moo['exists_ms']:.2f}x, get {red['get_ms'] / moo['get_ms']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
