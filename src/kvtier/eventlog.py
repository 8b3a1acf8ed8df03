"""The lifecycle event log: record what a cache does as JSON lines, for ``kvtier check``.

An :class:`EventRecorder` attached to a :class:`~kvtier.tiered.TieredCache` (or a bare
:class:`~kvtier.fsm.node.core.CacheCore`) writes one JSON object per line: every node
and request transition with the guards the implementation evaluated and the facts they
read, every transfer command issued, every completion received, every operation settled,
every facade call and every invariant check. The format is documented, versioned and
independent of Python (docs/eventlog-format.md), so an engine written in another language can
emit it; ``kvtier check LOG`` (:mod:`kvtier.cli.check`) replays it offline against the spec.

Cost: with no recorder attached nothing is wrapped, and the only code on the hot path is
one ``observer is not None`` test per lifecycle transition (:mod:`kvtier.fsm.lifecycle.machines`).
Attached, the recorder wraps the cache object's public methods (instance attributes, the
class is untouched) and serialises each record; ``bench/eventlog.py`` measures both.

One recorder at a time per process, recording one cache at a time: attaching another
cache starts a new segment of the log (a ``cache`` record). Only the attached cache's nodes
and requests are recorded: transitions of other caches alive in the process (the L3
machine's two instances, the misuse machine's caches) and of other subjects (the kit's raw
lifecycle machines) are left out, and so is everything while no cache is attached.

Example::

    with EventRecorder("run.kvlog") as rec:
        rec.attach(cache)
        ...  # drive the cache
    # then: kvtier check run.kvlog
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvtier.fsm import Completion, ConfigError, Family, KvtierError, TransferCommand
from kvtier.fsm.node.core import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.lifecycle.machines import Lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.node import Node
from kvtier.fsm.node.ops import LayerProgress, Settled
from kvtier.fsm.request import Request
from kvtier.fsm.lifecycle.spec import load_spec

__all__ = ["FORMAT", "VERSION", "EventRecorder", "active_recorder", "attach_active", "record_failure", "recording"]

#: The ``format`` field of the header record.
FORMAT = "kvtier-events"
#: The version of the log format (docs/eventlog-format.md); bumped on any incompatible change.
VERSION = 1

_ACTIVE: EventRecorder | None = None

#: facade methods recorded as ``call`` records (complete and poll are recorded at the core)
#: (not reserve and step_done: one per decoded token; the transitions they cause are recorded)
_FACADE_CALLS = ("admit", "resume", "finish", "retract", "abort", "abort_victim")


def active_recorder() -> EventRecorder | None:
    """The recorder currently installed in this process, or ``None``."""
    return _ACTIVE


def attach_active(cache: Any) -> None:
    """Attach ``cache`` to the active recorder, if any (used by the testing kit so that
    every cache a fuzz campaign or a regression sequence creates is recorded)."""
    if _ACTIVE is not None:
        _ACTIVE.attach(cache)


def record_failure(exc: BaseException, where: str = "kit") -> None:
    """Record a failed check (e.g. the testing kit's own invariant checks) in the active
    recorder's log as an ``invariants`` record with ``"ok": false``; no-op without one."""
    if _ACTIVE is not None and not _ACTIVE._closed:
        name = getattr(exc, "invariant", None)
        _ACTIVE._write({"k": "invariants", "at": where, "ok": False,
                        "invariant": name if isinstance(name, str) else type(exc).__name__,
                        "detail": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})


def _pages(pm: Mapping[str, list[int]]) -> int:
    return sum(len(p) for p in pm.values())


def _arg(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return len(v)  # unit keys: only their count
    return repr(v)


class EventRecorder:
    """Writes the lifecycle event log of the caches attached to it.

    Args:
        sink: a path (the file is created or truncated) or a text stream.
        flush_every: records buffered between flushes to the stream (>= 1).

    Raises:
        ConfigError: ``flush_every`` < 1; KvtierError: another recorder is installed
        (from :meth:`install`, which the constructor calls).
    """

    def __init__(self, sink: str | Path | IO[str], *, flush_every: int = 4096) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ConfigError(f"flush_every must be an int >= 1, got {flush_every!r}")
        self._own = isinstance(sink, (str, Path))
        self._out: IO[str] = open(sink, "w", encoding="utf-8") if isinstance(sink, (str, Path)) else sink
        self._flush_every = flush_every
        self._buf: list[str] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._segments = 0
        self.records = 0
        self._guards: dict[tuple[str, str, str], tuple[str, ...]] = {}
        spec = load_spec()
        for lc in (spec.node, spec.request):
            for t in lc.transitions:
                key = (lc.name, t.source, t.event)
                names = self._guards.get(key, ())
                self._guards[key] = names + tuple(g.name for g in t.guards if g.name not in names)
        self._lcs = (node_lifecycle(), request_lifecycle())
        self._closed = False
        self._call: dict[str, Any] | None = None
        self._tree: Any = None  # the attached core's radix tree, root and (facade) request table
        self._root: Node | None = None
        self._table: Any = None
        self._write({"k": "header", "format": FORMAT, "version": VERSION, "spec_version": spec.version})
        self.install()

    # -- installation --------------------------------------------------------------------
    def install(self) -> None:
        """Make this the process's recorder (its lifecycle observer).

        Raises:
            KvtierError: another recorder is installed.
        """
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            raise KvtierError("another EventRecorder is installed in this process; close it first")
        _ACTIVE = self
        for lc in self._lcs:
            lc.observer = self._transition

    def close(self) -> None:
        """Detach, uninstall, flush and close the file (if the recorder opened it)."""
        global _ACTIVE
        if self._closed:
            return
        self.detach()
        for lc in self._lcs:
            if lc.observer == self._transition:
                lc.observer = None
        if _ACTIVE is self:
            _ACTIVE = None
        self.flush()
        if self._own:
            self._out.close()
        self._closed = True

    def __enter__(self) -> EventRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Write buffered records to the stream."""
        if self._buf:
            self._out.write("".join(self._buf))
            self._buf.clear()
        self._out.flush()

    def _write(self, rec: dict[str, Any]) -> None:
        if self._call is not None:  # a call record is written once the call records anything
            call, self._call = self._call, None
            self._write(call)
        self._buf.append(json.dumps(rec, separators=(",", ":")) + "\n")
        self.records += 1
        if len(self._buf) >= self._flush_every:
            self.flush()

    # -- attaching a cache ---------------------------------------------------------------
    def attach(self, cache: Any) -> None:
        """Record ``cache`` (a TieredCache, or a CacheCore driven directly) from now on:
        starts a new segment, detaching the previous cache.

        Raises:
            ConfigError: not a cache; KvtierError: the recorder is closed.
        """
        if self._closed:
            raise KvtierError("the EventRecorder is closed")
        core = getattr(cache, "core", cache)
        if not isinstance(core, CacheCore):
            raise ConfigError(f"attach() takes a TieredCache or a CacheCore, got {cache!r}")
        self.detach()
        self._tree, self._root = core.tree, core.root
        self._table = cache.table if core is not cache else None
        self._segments += 1
        layout = core.layout
        self._write({
            "k": "cache", "segment": self._segments, "facade": core is not cache, "world_size": core.world_size,
            "policy": core.policy.value, "eviction": core.eviction.name, "exclusive": core.exclusive,
            "layers": layout.num_layers,
            "groups": {g.name: {"family": g.family.value, "pages_per_unit":
                                layout.pages_per_unit(g) if g.family is Family.HISTORY else g.state_pages}
                       for g in layout.groups},
            "device": {g: a.capacity for g, a in core.device.items()},
            "host": {g: a.capacity for g, a in core.host.items()} if core.host is not None else None,
        })
        self._wrap(core, "complete", self._on_complete)
        self._wrap(core, "poll_commands", self._on_commands)
        self._wrap(core, "advance_step", self._on_advance)
        self._wrap(core, "poison", self._on_poison)
        self._wrap(core, "check_invariants", self._on_check("core"))
        if core is not cache:
            for name in _FACADE_CALLS:
                self._wrap(cache, name, self._on_call(cache, name))
            self._wrap(cache, "check_invariants", self._on_check("facade"))

    def detach(self) -> None:
        """Stop recording the attached cache (its methods are restored)."""
        self._tree = self._root = self._table = None
        for obj, name in reversed(self._wrapped):
            try:
                delattr(obj, name)
            except AttributeError:  # pragma: no cover - already restored
                pass
        self._wrapped.clear()

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name))

    # -- wrappers ------------------------------------------------------------------------
    def _on_complete(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def complete(completion: Completion) -> Any:
            rec: dict[str, Any] = {"k": "completion", "op": getattr(completion, "op_id", None),
                                   "rank": getattr(completion, "rank", None),
                                   "layer": getattr(completion, "layer", None), "ok": getattr(completion, "ok", None)}
            self._write(rec)  # before: the transitions it causes follow it
            try:
                out = orig(completion)
            except KvtierError as exc:
                self._write({"k": "refused", "name": "complete", "error": type(exc).__name__})
                raise
            self._settled(out)
            return out
        return complete

    def _settled(self, events: Any) -> None:
        for ev in events:
            if isinstance(ev, Settled):
                self._write({"k": "settled", "op": ev.op_id, "dir": ev.direction.value, "ok": ev.ok,
                             "expired": ev.expired, "request": ev.request_id, "nodes": list(ev.node_ids)})
            elif isinstance(ev, LayerProgress):
                self._write({"k": "layer", "op": ev.op_id, "layer": ev.layer})

    def _on_commands(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def poll_commands() -> Any:
            out: list[TransferCommand] = orig()
            for c in out:
                self._write({"k": "command", "op": c.op_id, "dir": c.direction.value, "request": c.request_id,
                             "nodes": list(c.node_ids), "pages": {t.group: len(t.src_pages) for t in c.transfers},
                             "deadline": c.deadline_step})
            return out
        return poll_commands

    def _on_advance(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def advance_step(steps: int = 1) -> Any:
            self._call = {"k": "call", "name": "advance_step", "args": [_arg(steps)]}
            out = orig(steps)
            self._call = None
            self._settled(out)
            return out
        return advance_step

    def _on_poison(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def poison(op_id: int) -> Any:
            out = orig(op_id)
            self._write({"k": "poison", "op": op_id})
            return out
        return poison

    def _on_check(self, where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def check_invariants() -> Any:
                try:
                    out = orig()
                except InvariantViolation as exc:
                    self._write({"k": "invariants", "at": where, "ok": False, "invariant": exc.invariant,
                                 "detail": str(exc)})
                    raise
                self._write({"k": "invariants", "at": where, "ok": True})
                return out
            return check_invariants
        return make

    def _on_call(self, cache: Any, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self._call = {"k": "call", "name": name,
                              "args": [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in kwargs.items()]}
                try:
                    out = orig(*args, **kwargs)
                except KvtierError as exc:
                    self._call = None
                    self._write({"k": "refused", "name": name, "id": args[0] if args else None,
                                 "error": type(exc).__name__})
                    raise
                if self._call is not None and out is None and name in ("admit", "resume", "abort_victim"):
                    self._call = None  # short of pages (or no victim) and nothing changed: no record
                    return out
                rid = args[0] if args and isinstance(args[0], str) else out if name == "abort_victim" else None
                r = cache.table.find(rid) if isinstance(rid, str) else None  # as the call left it
                if r is not None:
                    self._write({"k": "return", "name": name, "id": rid, "state": r.state, "owed": r.owed_forward,
                                 "ops": sorted(r.ops), "table": _pages(r.canon) + _pages(r.own)})
                return out
            return call
        return make

    # -- the lifecycle observer ----------------------------------------------------------
    def _ours(self, node: Node) -> bool:
        """Whether ``node`` belongs to the attached core: it (or, for a node not linked yet or
        just unlinked, its nearest linked ancestor) is in that core's tree, or under its root."""
        tree = self._tree
        if tree is None:
            return False
        m: Node | None = node
        while m is not None:
            if m is self._root or tree.has(m):
                return True
            m = m.parent
        return False

    def _transition(self, lc: Lifecycle, subject: Any, event: str, source: str, dest: str) -> None:
        guards = self._guards.get((lc.name, source, event), ())
        if lc.name == "node":
            if not isinstance(subject, Node) or not self._ours(subject):
                return  # another cache's node, or the kit's raw lifecycle machines
            n = subject
            p = n.parent
            kids: dict[str, int] = {}
            for c in n.children.values():
                kids[c.state] = kids.get(c.state, 0) + 1
            self._write({
                "k": "node", "id": n.node_id, "ev": event, "from": source, "to": dest,
                "parent": p.node_id if p is not None else None, "pstate": p.state if p is not None else None,
                "pwb": p.wb_op if p is not None else None, "pfetch": p.fetch_op if p is not None else None,
                "units": len(n.key), "lock": n.lock_ref, "borrow": n.borrow_ref, "pin": n.host_pin,
                "wb": n.wb_op, "lb": n.lb_op, "fetch": n.fetch_op,
                "children": kids,
                "pages": {"dev": _pages(n.dev), "host": _pages(n.host), "pending": _pages(n.pending),
                          "dev_state": _pages(n.dev_ckpt), "host_state": _pages(n.host_ckpt),
                          "pending_state": _pages(n.pending_ckpt)},
                "guards": {g: bool(lc.guards[g](n)) for g in guards},
            })
            return
        if not isinstance(subject, Request) or self._table is None \
                or self._table.find(subject.request_id) is not subject:
            return  # another cache's request, or the kit's raw lifecycle machines
        r = subject
        self._write({
            "k": "request", "id": r.request_id, "ev": event, "from": source, "to": dest,
            "owed": r.owed_forward, "ops": sorted(r.ops), "table": _pages(r.canon) + _pages(r.own),
            "tokens": r.tokens,
            "has_loadback": bool(r.has_loadback), "has_own_writeback": bool(r.has_own_writeback),
            "reason": r.reason, "guards": {g: bool(lc.guards[g](r)) for g in guards},
        })


@contextmanager
def recording(path: str | Path | None) -> Iterator[EventRecorder | None]:
    """``with recording(path) as rec:`` installs a recorder writing ``path`` (``None``: no
    recorder, yields ``None``); caches the kit creates meanwhile are attached to it."""
    if path is None:
        yield None
        return
    rec = EventRecorder(path)
    try:
        yield rec
    finally:
        rec.close()
