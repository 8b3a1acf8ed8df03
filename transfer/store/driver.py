"""Runs store operations on a thread of their own; results wait for the scheduler's thread.

The scheduler's thread submits :class:`~kvtier.fsm.l3.StoreCommand` records (from
:meth:`kvtier.fsm.l3.L3Tier.poll_commands`) and collects :class:`~kvtier.fsm.l3.StoreResult`
records with :meth:`StoreDriver.poll`, which it hands to
:meth:`kvtier.fsm.l3.L3Tier.complete`: nothing reaches the core from the driver's thread.

Host pages are touched only under the driver's lock and only for an operation that was
not cancelled: a put copies its pages into objects before it sends them (the pages are
pinned until then), a get checks every object and then writes it into its reserved pages.
:meth:`StoreDriver.cancel`, called by :meth:`kvtier.fsm.l3.L3Tier.expire` before an expired
operation's pages are let go, waits for a copy in progress and stops any later one.

Deadlines are the caller's alone: a command's ``deadline`` is a value of the caller's clock,
which the L3 tier compares with the ``now`` it is given (``L3Tier.expire``); the driver never
reads it, so a caller whose clock is not this process's monotonic clock (a test's clock, a
clock hours behind) loses nothing.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

from kvtier.fsm.errors import ConfigError, UsageError
from kvtier.fsm.records import StoreCommand, StoreOp, StoreResult

from .base import StoreBackend, StoreError
from .hostio import HostPageIO, ObjectError

__all__ = ["StoreDriver"]


class StoreDriver:
    """One thread running a backend's operations in submission order.

    Args:
        backend: the store backend (used from the driver's thread only).
        io: packs and unpacks objects from the host pool's pages.
        max_queued: commands accepted and not yet done (a bound, an int >= 1; :meth:`submit`
            fails an operation beyond it at once).

    Raises:
        ConfigError: ``max_queued`` not an int >= 1.
    """

    def __init__(self, backend: StoreBackend, io: HostPageIO, *, max_queued: int = 4096) -> None:
        self.backend = backend
        self.io = io
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ConfigError(f"store driver: max_queued must be an int >= 1, got {max_queued!r}")
        self.max_queued = max_queued
        self._closed = False
        self._todo: queue.Queue[StoreCommand | None] = queue.Queue()
        self._done: collections.deque[StoreResult] = collections.deque()
        self._ready = threading.Condition()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._queued = 0
        self._thread = threading.Thread(target=self._run, name=f"kvtier-l3-{backend.name}", daemon=True)
        self._thread.start()

    # -- the scheduler's thread ------------------------------------------------------
    def submit(self, commands: list[StoreCommand]) -> None:
        """Queue commands (non-blocking).

        Raises:
            UsageError: ``commands`` not a list or tuple of :class:`StoreCommand` (none is queued).
            StoreError: the driver is closed.
        """
        if self._closed:
            raise StoreError("store driver is closed: no command runs after close()")
        # (a None would stop the driver's thread, any other object kill it: checked before any is queued)
        bad = [commands] if type(commands) not in (list, tuple) else [c for c in commands
                                                                      if not isinstance(c, StoreCommand)]
        if bad:
            raise UsageError(f"store driver submit: commands must be a list of StoreCommand "
                             f"(L3Tier.poll_commands()), got {bad[0]!r}")
        for cmd in commands:
            if self._queued >= self.max_queued:
                self._push(StoreResult(cmd.op_id, error="queue: the store driver is saturated"))
                continue
            self._queued += 1
            self._todo.put(cmd)

    def poll(self) -> list[StoreResult]:
        """Results ready now (non-blocking)."""
        out = []
        with self._ready:
            while self._done:
                out.append(self._done.popleft())
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds until a result is ready; whether one is."""
        with self._ready:
            if not self._done:
                self._ready.wait(timeout_s)
            return bool(self._done)

    def cancel(self, op_id: int) -> None:
        """Stop operation ``op_id`` from touching host pages (waits for a copy in progress)."""
        with self._lock:
            self._cancelled.add(op_id)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the queued commands and close the backend (once; a second
        call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._todo.put(None)
        self._thread.join(timeout_s)
        self.backend.close()

    # -- the driver's thread ---------------------------------------------------------
    def _push(self, res: StoreResult) -> None:
        with self._ready:
            self._done.append(res)
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            cmd = self._todo.get()
            if cmd is None:
                return
            t0 = time.perf_counter()
            try:
                res = self._execute(cmd)
            except Exception as exc:  # the store failed the operation: report, never raise here
                res = StoreResult(cmd.op_id, error=f"{type(exc).__name__}: {exc}")
            res = StoreResult(res.op_id, res.ok, res.present, res.corrupt, res.nbytes,
                              time.perf_counter() - t0, res.error)
            with self._lock:
                self._cancelled.discard(cmd.op_id)
            self._queued -= 1
            self._push(res)

    def _execute(self, cmd: StoreCommand) -> StoreResult:
        if cmd.kind is StoreOp.EXISTS:
            return StoreResult(cmd.op_id, present=self.backend.exists_prefix(cmd.keys))
        if cmd.kind is StoreOp.REMOVE:
            return StoreResult(cmd.op_id, ok=tuple(self.backend.remove(cmd.keys)))
        if cmd.kind is StoreOp.PUT:
            with self._lock:
                if cmd.op_id in self._cancelled:
                    return StoreResult(cmd.op_id, error="cancelled")
                items = [(k, self.io.pack(k, p)) for k, p in zip(cmd.keys, cmd.pages)]
            ok = self.backend.put(items)
            return StoreResult(cmd.op_id, ok=tuple(ok), nbytes=sum(len(b) for _, b in items))
        blobs = self.backend.get(cmd.keys)
        oks: list[bool] = []
        corrupt: list[str] = []
        payloads = []
        nbytes = 0
        for k, b in zip(cmd.keys, blobs):
            if b is None:
                break
            try:
                payloads.append(self.io.check(k, b))
            except ObjectError:
                corrupt.append(k)
                break
            nbytes += len(b)
        with self._lock:
            if cmd.op_id in self._cancelled:
                return StoreResult(cmd.op_id, error="cancelled")
            for payload, pages in zip(payloads, cmd.pages):
                self.io.unpack(payload, pages)
                oks.append(True)
        oks.extend([False] * (len(cmd.keys) - len(oks)))
        return StoreResult(cmd.op_id, ok=tuple(oks), corrupt=tuple(corrupt), nbytes=nbytes)
