"""A fork server for the mutation runner: pytest without its start-up cost per mutant.

Starting pytest costs about 2 s of CPU per mutant (pytest, its plugins, Hypothesis), more
than most mutants' tests. This process imports those once, and torch, which the stateful
machines' test modules import (about 3 s), but never ``kvtier`` or a test module, which must
be read from disk afresh, mutant applied. For each request on its Unix
socket, it forks a child that runs ``pytest.main(args)`` in the repository root, output
discarded, and answers with the child's exit status. Requests are served one at a time; a
child running past ``LIMIT_S`` is killed (status 1, a hang counts as killed, as with the
per-test timeout). run.sh starts it and stops it; runner.sh uses it when its socket exists
(``client`` below), and runs pytest itself otherwise.

Usage: python forkserver.py serve SOCKET | python forkserver.py client SOCKET ARGS...
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 600


def serve(path: str) -> int:
    import hypothesis  # noqa: F401  (imported once, shared by every child)
    import hypothesis.stateful  # noqa: F401
    import hypothesis.strategies  # noqa: F401
    import pytest
    import pytest_timeout  # noqa: F401
    import transitions  # noqa: F401
    from _hypothesis_pytestplugin import pytest_configure  # noqa: F401

    try:  # torch is never mutated; the stateful machines' modules import it (about 3 s each time)
        import torch  # noqa: F401
    except ImportError:
        pass
    assert not any(m == "kvtier" or m.startswith("kvtier.") for m in sys.modules), "kvtier imported in the server"
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    while True:
        conn, _ = srv.accept()
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            if not data:
                continue
            args = json.loads(data)
            if args == ["--stop"]:
                conn.sendall(b"0\n")
                break
            pid = os.fork()
            if pid == 0:  # child
                srv.close()
                os.chdir(ROOT)
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                try:
                    rc = int(pytest.main(args))
                except BaseException:  # noqa: BLE001  (any failure in the child is a failing run)
                    rc = 3
                os._exit(rc)
            deadline = time.monotonic() + LIMIT_S
            status = None
            while status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(st)
                elif time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = 1
                else:
                    time.sleep(0.02)
            conn.sendall(f"{status}\n".encode())
    srv.close()
    os.unlink(path)
    return 0


def client(path: str, args: list[str]) -> int:
    """The child's exit status, or 99 when no server answers (runner.sh then runs pytest)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        return 99
    s.sendall(json.dumps(args).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(64)
        if not chunk:
            return 99  # the server died: runner.sh then runs pytest itself
        data += chunk
    return int(data)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2]))
    sys.exit(client(sys.argv[2], sys.argv[3:]))
