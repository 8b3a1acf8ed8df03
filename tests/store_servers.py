"""Real stores for the L3 tests: a redis-server and a mooncake_master, each started on a free
loopback port per test, never globally, with hooks for faults (kill, restart, slow, fill so
that it evicts). The fixtures that start them (``redis_server``, ``mooncake_master``) are in
tests/conftest.py; the store tests (tests/transfer/store/) and the multi-instance replay
(tests/replay/) use them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _ChildServer:
    """A store server run as a child process: ``start`` (by the subclass), ``kill`` (SIGKILL:
    everything it held in memory is lost) and ``restart``."""

    proc: subprocess.Popen[bytes] | None

    def start(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()


class RedisServer(_ChildServer):
    """A redis-server child process on 127.0.0.1 (no persistence)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, timeout: float = 5.0) -> object:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout)

    def start(self) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--enable-debug-command", "local", "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    if self.client().ping():  # type: ignore[attr-defined]
                        return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def slow(self, seconds: float) -> threading.Thread:
        """Block the server for ``seconds`` (DEBUG SLEEP from a side connection)."""
        c = self.client(timeout=seconds + 5)
        t = threading.Thread(target=lambda: c.execute_command("DEBUG", "SLEEP", seconds), daemon=True)  # type: ignore[attr-defined]
        t.start()
        time.sleep(0.1)
        return t

    def fill_limit(self, max_bytes: int) -> None:
        """Cap memory so the server evicts on its own (allkeys-lru)."""
        c = self.client()
        c.config_set("maxmemory-policy", "allkeys-lru")  # type: ignore[attr-defined]
        c.config_set("maxmemory", str(max_bytes))  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self.proc is not None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeMaster(_ChildServer):
    """A ``mooncake_master`` child process on 127.0.0.1 over TCP (RPC and metrics on free
    ports, the read lease set by ``lease_ms``). The clients (kvtier's backends) mount the
    memory segments that hold the objects."""

    def __init__(self, binary: str, lease_ms: int = 1000) -> None:
        self.binary = binary
        self.lease_ms = lease_ms
        self.port = free_port()
        self.metrics_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtier-mooncake-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def lease_s(self) -> float:
        return self.lease_ms / 1000

    def url(self, **params: object) -> str:
        q = "&".join(f"{k}={v}" for k, v in {"lease_s": self.lease_s, "segment_mb": 16, "buffer_mb": 8,
                                              **params}.items())
        return f"mooncake://127.0.0.1:{self.port}?{q}"

    def start(self) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [self.binary, "-rpc_address=127.0.0.1", f"-rpc_port={self.port}", f"-metrics_port={self.metrics_port}",
             f"-default_kv_lease_ttl={self.lease_ms}", "-client_ttl=2", "-rpc_thread_num=2",
             "-logtostderr=false", f"-log_dir={self.dir}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not start on port {self.port} (logs in {self.dir})")

    def slow(self, seconds: float) -> threading.Thread:
        """Freeze the master for ``seconds`` (SIGSTOP, then SIGCONT)."""
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        t = threading.Thread(target=lambda: (time.sleep(seconds), os.kill(pid, signal.SIGCONT)), daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def mooncake_binary() -> str:
    """The ``mooncake_master`` of the installed wheel (skip, or fail under
    KVTIER_REQUIRE_MOONCAKE / CI, when the client cannot be imported)."""
    required = os.environ.get("KVTIER_REQUIRE_MOONCAKE")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        msg = (f"mooncake.store cannot be imported ({exc}): pip install mooncake-transfer-engine-non-cuda "
               f"and apt-get install libibverbs1")
        if required:
            pytest.fail(msg + " (KVTIER_REQUIRE_MOONCAKE is set)")
        pytest.skip(msg)
    binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(binary):
        pytest.fail(f"mooncake.store imports but its mooncake_master is not on PATH nor at {binary}")
    return binary
