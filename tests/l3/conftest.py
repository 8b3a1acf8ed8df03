"""A real redis-server for the L3 tests: started on a free loopback port per test module,
never globally, with hooks for faults (kill, restart, slow, fill so that it evicts)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process on 127.0.0.1 (no persistence)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
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

    def kill(self) -> None:
        """SIGKILL the server (everything it held is lost)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

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


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI") or os.environ.get("KVTIER_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed (scripts/test.sh installs it with apt-get)")
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    srv = RedisServer(binary)
    try:
        yield srv
    finally:
        srv.stop()
