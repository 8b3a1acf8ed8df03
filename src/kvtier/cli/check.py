"""``kvtier check LOG``: replay a lifecycle event log offline against the spec and the invariants.

The log is the JSON-lines format of docs/eventlog-format.md (written by
:class:`kvtier.eventlog.EventRecorder`, or by any engine that emits it). The checker keeps
its own shadow of every node, request and operation, built only from the log, and
reports the first record that breaks a rule, with the records leading to it:

* **spec**: the event is allowed in the subject's state (spec/lifecycle.toml), the state
  recorded as the source is the one the log left the subject in, and the destination is
  the one the spec gives for the guard values.
* **guards**: every guard is recomputed from the facts the record carries (counts, the
  parent's state and writeback op, the children's states) with the spec's definitions;
  a guard the implementation evaluated differently is a violation (a broken guard
  function lets the event through).
* **invariants** read off the records: a node's resources agree with its state
  (``state_matches_resources``, ``host_means_acked``), a node with a host copy has a
  parent with one (``root_closed_host``), a loading node is pinned
  (``loadback_source_pinned``), an operation is issued once and settles once, no
  completion is taken for an operation never handed out (no ``command`` record) nor twice
  while it is in flight (``operation_ends_once``; a settled
  operation's late or duplicate completions are absorbed), a failed operation never
  acknowledges a node and no operation settles ok before every rank acknowledged it
  (``failure_not_success``), an aborting request keeps its pages until
  the fence (``release_once_after_fence``), and a facade call leaves a request in the
  state its transitions say (``return`` records).
* **recorded checks**: an ``invariants`` record with ``"ok": false`` (the producer's own
  ``check_invariants()`` failed) rejects the log too, naming the invariant.
* **format**: one header, first; every other record inside a segment (after a ``cache``
  record); the fields the checker reads hold values of their type
  (:data:`kvtier.cli.logreader.FIELDS`: a ``world_size`` >= 1, a completion's rank below it);
  the file within the trace reader's input limits (:func:`kvtier.cli.logreader.read_log`).

Exit status of the command: 0 the log conforms; 1 it does not (a broken rule, a malformed
record, a line past a limit, invalid or truncated gzip data); 2 the file cannot be opened.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.fsm import ConfigError
from kvtier.fsm.checks import as_int
from kvtier.fsm.lifecycle.names import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE
from kvtier.fsm.lifecycle.spec import INTERNAL, LifecycleSpec, TransitionSpec, load_spec

from .logreader import LogFormatError, brief, read_log, record_problem
from ..replay.trace_lines import MAX_DECOMPRESSED_BYTES

__all__ = ["MAX_CONTEXT", "CheckResult", "Violation", "check_log", "check_records", "read_log"]  # read_log: kvtier.cli.logreader

#: The most records a violation shows before it (``context``): the checker keeps that many in
#: memory, so the bound keeps its memory bounded whatever the log's length.
MAX_CONTEXT = 10_000

# The guards' meanings, as spec/lifecycle.toml's [node.guards] docs state them, over the
# node state sets the spec's [node.resources] declare (kvtier.fsm.lifecycle.names derives them):
#: parent_readable: its device pages may be read by any request (device, writing, backed)
_READABLE = DEVICE_READABLE
#: parent_on_device / has_device_child: holds device pages (also loading)
_RESIDENT = DEVICE_RESIDENT
#: parent_on_host: a visible host copy (backed, host, loading)
_HOST = HOST_VISIBLE
#: a host reservation being filled (writing: a writeback; fetching: an L3 get)
_PENDING = HOST_PENDING


@dataclass(frozen=True)
class Violation:
    """The first rule a log breaks.

    Attributes:
        line: 1-based line number of the offending record.
        rule: ``spec``, ``guard``, or the invariant's name (spec/lifecycle.toml).
        message: what is wrong.
        record: the offending record.
        context: the records leading to it (oldest first), as (line, record).
    """

    line: int
    rule: str
    message: str
    record: dict[str, Any]
    context: tuple[tuple[int, dict[str, Any]], ...] = ()

    def render(self) -> str:
        out = [f"line {self.line}: {self.rule}: {self.message}", "events leading to it:"]
        for ln, rec in self.context:
            out.append(f"  {ln:>7}  {brief(rec)}")
        shown = brief(self.record) if self.record else "(no record: the line is unreadable)"
        out.append(f"> {self.line:>7}  {shown}")
        return "\n".join(out)


@dataclass
class CheckResult:
    """What :func:`check_records` found.

    Attributes:
        records: records read; segments: caches recorded.
        transitions: node and request transitions checked; ops: operations seen.
        invariant_checks: ``invariants`` records read.
        violation: the first violation, or ``None`` when the log conforms.
    """

    records: int = 0
    segments: int = 0
    transitions: int = 0
    ops: int = 0
    invariant_checks: int = 0
    violation: Violation | None = None

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        head = (f"{self.records:,} records, {self.segments:,} cache segment(s), {self.transitions:,} transitions, "
                f"{self.ops:,} operations, {self.invariant_checks:,} recorded invariant checks")
        if self.violation is None:
            return f"{head}: the log conforms to the spec and the invariants"
        return f"{head}\nREJECTED at {self.violation.render()}"


def _same_op(rec: dict[str, Any]) -> bool:
    """The node and its pending parent are filled by the same writeback (or L3 get)."""
    return any(rec.get(p) is not None and rec.get(p) == rec.get(k) for p, k in (("pwb", "wb"), ("pfetch", "fetch")))


class _Bad(Exception):
    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message


@dataclass
class _Op:
    direction: str | None = None
    issued: bool = False
    seen: set[tuple[int, int | None]] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    failed: bool = False
    poisoned: bool = False
    settled: bool = False
    expired: bool = False
    absorbed: int = 0


class _Lifecycle:
    def __init__(self, spec: LifecycleSpec) -> None:
        self.spec = spec
        self.rows: dict[tuple[str, str], list[TransitionSpec]] = {}
        for t in spec.transitions:
            self.rows.setdefault((t.source, t.event), []).append(t)

    def step(self, source: str, event: str, guards: dict[str, bool]) -> str:
        rows = self.rows.get((source, event))
        if rows is None:
            raise _Bad("spec", f"event {event!r} is not allowed in state {source!r} ({self.spec.name} lifecycle)")
        for t in rows:
            if all(guards.get(g.name, False) != g.negated for g in t.guards):
                return source if t.dest == INTERNAL else t.dest
        raise _Bad("spec", f"{event!r} in {source!r}: no transition of the spec has its guards hold ({guards})")


class _Checker:
    def __init__(self, context: int) -> None:
        spec = load_spec()
        self.spec_version = spec.version
        self.node_lc = _Lifecycle(spec.node)
        self.req_lc = _Lifecycle(spec.request)
        self.result = CheckResult()
        self.context: deque[tuple[int, dict[str, Any]]] = deque(maxlen=context)
        self.header = False
        self._reset()

    def _reset(self) -> None:
        self.nodes: dict[int, str] = {}
        self.node_ops: dict[int, tuple[int | None, int | None]] = {}
        self.requests: dict[str, str] = {}
        self.aborting_own: dict[str, int] = {}
        self.ops: dict[int, _Op] = {}
        self.splits = 0
        self.world = 1

    def feed(self, line: int, rec: dict[str, Any]) -> None:
        self.result.records += 1
        try:
            problem = record_problem(rec)
            if problem is not None:
                raise _Bad("format", f"malformed {rec.get('k') if isinstance(rec, dict) else None!r} record: "
                                     f"{problem}")
            try:
                self._record(rec)
            except (KeyError, TypeError, ValueError) as exc:
                raise _Bad("format", f"malformed {rec.get('k')!r} record ({type(exc).__name__}: {exc})") from None
        except _Bad as bad:
            self.result.violation = Violation(line, bad.rule, bad.message, rec if isinstance(rec, dict) else {},
                                              tuple(self.context))
            return
        self.context.append((line, rec))

    def _op(self, op_id: int) -> _Op:
        op = self.ops.get(op_id)
        if op is None:
            op = self.ops[op_id] = _Op()
            self.result.ops += 1
        return op

    def _record(self, rec: dict[str, Any]) -> None:
        k = rec.get("k")
        if not self.header:
            if k != "header" or rec.get("format") != "kvtier-events":
                raise _Bad("format", "the first record must be the header {\"k\": \"header\", \"format\": "
                                     "\"kvtier-events\", ...}")
            if rec.get("version") != 1 or isinstance(rec.get("version"), bool):
                raise _Bad("format", f"log format version {rec.get('version')!r}: this kvtier reads version 1")
            if rec.get("spec_version") != self.spec_version or isinstance(rec.get("spec_version"), bool):
                raise _Bad("format", f"log written against spec version {rec.get('spec_version')!r}, "
                                     f"the spec here is version {self.spec_version}")
            self.header = True
            return
        if k == "header":
            raise _Bad("format", "a second header record (one log per file: two logs concatenated?)")
        if k == "cache":
            self._reset()
            self.world = rec.get("world_size", 1)
            self.result.segments += 1
            return
        if not self.result.segments and k != "invariants":
            raise _Bad("format", f"a {k!r} record before the first 'cache' record (whose cache is it?)")
        if k == "node":
            self._node(rec)
        elif k == "request":
            self._request(rec)
        elif k == "command":
            op = self._op(rec["op"])
            if op.issued:
                raise _Bad("operation_ends_once", f"op {rec['op']} issued twice")
            op.issued = True
            op.direction = rec.get("dir")
        elif k == "completion":
            self._completion(rec)
        elif k == "poison":
            self._op(rec["op"]).poisoned = True
        elif k == "settled":
            op = self._op(rec["op"])
            if op.settled:
                raise _Bad("operation_ends_once", f"op {rec['op']} settled twice")
            op.settled = True
            op.expired = bool(rec.get("expired"))
            if rec.get("ok") and (op.failed or op.poisoned or op.expired):
                raise _Bad("failure_not_success", f"op {rec['op']} settled ok although "
                                                  f"{'it was poisoned' if op.poisoned else 'a rank reported failure'}")
            if rec.get("ok") and len(op.acked) < self.world:
                raise _Bad("failure_not_success", f"op {rec['op']} settled ok with {len(op.acked)} of "
                                                  f"{self.world} ranks' acknowledgements")
        elif k == "invariants":
            self.result.invariant_checks += 1
            if rec.get("ok") is False:
                raise _Bad(str(rec.get("invariant") or "invariant"),
                           f"the producer's check_invariants() failed: {rec.get('detail')}")
        elif k == "return":
            self._return(rec)
        elif k in ("call", "refused", "layer"):
            return
        else:
            raise _Bad("format", f"unknown record kind {k!r}")

    def _completion(self, rec: dict[str, Any]) -> None:
        if rec.get("refused"):
            return  # the implementation refused it: nothing changed
        op = self._op(rec["op"])
        if op.settled:
            # a settled operation's late or duplicate completions are absorbed (invariant 7):
            # it may not settle again nor move a node (both checked when recorded)
            op.absorbed += 1
            return
        if not op.issued:  # the engine completes only what it was handed (a command record)
            raise _Bad("operation_ends_once", f"op {rec['op']}: a completion taken for an operation never "
                                              f"handed out (no command record in this segment)")
        key = (rec["rank"], rec.get("layer"))
        if key[0] >= self.world:
            raise _Bad("format", f"op {rec['op']}: a completion from rank {key[0]} taken, but the cache has "
                                 f"world_size {self.world} (ranks 0 .. {self.world - 1})")
        if key in op.seen or key[0] in op.acked:
            raise _Bad("operation_ends_once", f"op {rec['op']}: completion from rank {key[0]} layer {key[1]} "
                                              f"accepted twice (or after that rank's ack)")
        op.seen.add(key)
        if key[1] is None:
            op.acked.add(key[0])
        if rec.get("ok") is False:
            op.failed = True

    def _node(self, rec: dict[str, Any]) -> None:
        self.result.transitions += 1
        nid, ev, src, dst = rec["id"], rec["ev"], rec["from"], rec["to"]
        known = self.nodes.get(nid)
        if known is None:
            if src != "new" and not self.splits:
                raise _Bad("spec", f"node {nid} first appears in state {src!r} (no create, no split before)")
        elif known != src:
            raise _Bad("spec", f"node {nid}: event {ev!r} recorded from {src!r}, but the log left it {known!r}")
        facts = self._node_guards(rec)
        for g, v in (rec.get("guards") or {}).items():
            if g in facts and facts[g] != bool(v):
                raise _Bad("guard", f"node {nid}: guard {g!r} evaluated {bool(v)} by the implementation, "
                                    f"but the recorded facts make it {facts[g]}")
        want = self.node_lc.step(src, ev, facts)
        if want != dst:
            raise _Bad("spec", f"node {nid}: {ev!r} from {src!r} goes to {want!r} by the spec, recorded {dst!r}")
        if ev == "split":
            self.splits += 1
        parent = rec.get("parent")
        if parent is not None and parent in self.nodes and rec.get("pstate") not in (None, "root") \
                and self.nodes[parent] != rec.get("pstate"):
            raise _Bad("spec", f"node {nid}: parent {parent} recorded in {rec.get('pstate')!r}, "
                               f"but the log left it {self.nodes[parent]!r}")
        self._resources(nid, dst, rec)
        # operations: a node acknowledged by a failed or poisoned op
        prev_wb, prev_lb = self.node_ops.get(nid, (None, None))
        if ev in ("writeback_ack", "loadback_ack"):
            op_id = prev_wb if ev == "writeback_ack" else prev_lb
            if op_id is not None:
                op = self._op(op_id)
                if op.failed or op.poisoned:
                    raise _Bad("failure_not_success", f"node {nid}: {ev} for op {op_id}, which "
                                                      f"{'was poisoned' if op.poisoned else 'a rank reported failed'}")
                if len(op.acked) < self.world:
                    raise _Bad("host_means_acked" if ev == "writeback_ack" else "failure_not_success",
                               f"node {nid}: {ev} for op {op_id} before every rank acknowledged it "
                               f"({len(op.acked)} of {self.world})")
        self.node_ops[nid] = (rec.get("wb"), rec.get("lb"))
        self.nodes[nid] = dst

    @staticmethod
    def _node_guards(rec: dict[str, Any]) -> dict[str, bool]:
        root = rec.get("parent") in (None, 0) or rec.get("pstate") == "root"
        pstate = rec.get("pstate")
        kids = rec.get("children") or {}
        return {
            "parent_on_host": root or pstate in _HOST or (pstate in _PENDING and _same_op(rec)),
            "parent_on_device": root or pstate in _RESIDENT,
            "parent_readable": root or pstate in _READABLE,
            "unlocked": rec.get("lock", 0) == 0,
            "unborrowed": rec.get("borrow", 0) == 0,
            "unpinned": rec.get("pin", 0) == 0,
            "has_device_child": any(n and s in _RESIDENT for s, n in kids.items()),
            "has_host_child": any(n and (s in _HOST or s in _PENDING) for s, n in kids.items()),
        }

    def _resources(self, nid: int, state: str, rec: dict[str, Any]) -> None:
        pages = rec.get("pages") or {}
        if state == "removed":
            return
        dev, host, pending = pages.get("dev", 0) > 0, pages.get("host", 0) > 0, pages.get("pending", 0) > 0
        if (host or pages.get("host_state", 0) > 0) and state not in _HOST:
            raise _Bad("host_means_acked", f"node {nid} in {state!r} has visible host pages without an "
                                           f"acknowledged writeback")
        want = (state in _RESIDENT, state in _HOST, state in _PENDING)
        if (dev, host, pending) != want:
            raise _Bad("state_matches_resources", f"node {nid} in {state!r}: device pages {dev}, host pages "
                                                  f"{host}, pending reservation {pending}")
        if state == "loading" and (rec.get("pin", 0) < 1 or rec.get("lb") is None):
            raise _Bad("loadback_source_pinned", f"node {nid} loading without a pin or a loadback op")
        if state == "writing" and rec.get("wb") is None:
            raise _Bad("writeback_source_immutable", f"node {nid} writing without a writeback op")
        if state == "fetching" and rec.get("fetch") is None:
            raise _Bad("state_matches_resources", f"node {nid} fetching without an L3 get in flight")
        if (state in _HOST or state in _PENDING) and not (rec.get("parent") in (None, 0)
                                                         or rec.get("pstate") == "root"):
            ps = rec.get("pstate")
            # a pending parent is filled by the same operation (acknowledged parent first)
            if not (ps in _HOST or (ps in _PENDING and state in _PENDING and _same_op(rec))
                    or (ps in _PENDING and rec.get("ev") in ("writeback_ack", "fetch_ack"))):
                raise _Bad("root_closed_host", f"node {nid} in {state!r} under parent {rec.get('parent')} in {ps!r}")

    def _request(self, rec: dict[str, Any]) -> None:
        self.result.transitions += 1
        rid, ev, src, dst = rec["id"], rec["ev"], rec["from"], rec["to"]
        known = self.requests.get(rid)
        if known is None or known in ("finished", "aborted"):
            if src != "waiting" and known is None:
                raise _Bad("spec", f"request {rid!r} first appears in state {src!r}, not 'waiting'")
        elif known != src:
            raise _Bad("spec", f"request {rid!r}: event {ev!r} recorded from {src!r}, but the log left it {known!r}")
        facts = {"settled": rec.get("owed", 0) == 0 and not rec.get("ops")}
        recorded = {g: bool(v) for g, v in (rec.get("guards") or {}).items()}
        if "settled" in recorded and recorded["settled"] != facts["settled"]:
            raise _Bad("guard", f"request {rid!r}: guard 'settled' evaluated {recorded['settled']}, but "
                                f"{rec.get('owed')} forward result(s) and ops {rec.get('ops')} are owed")
        guards = {**recorded, **facts}
        want = self.req_lc.step(src, ev, guards)
        if want != dst:
            raise _Bad("spec", f"request {rid!r}: {ev!r} from {src!r} goes to {want!r} by the spec, recorded {dst!r}")
        if src == "aborting" and ev != "loadback_fail":
            # (a failed loadback gives its nodes' destination pages back: the table keeps
            # only the locked path's readable prefix, recorded with that event)
            self._fence(rid, rec)
        if dst == "aborting":
            self.aborting_own[rid] = int(rec.get("table", 0))
        elif rid in self.aborting_own and dst != "aborting":
            del self.aborting_own[rid]
        self.requests[rid] = dst

    def _fence(self, rid: str, rec: dict[str, Any]) -> None:
        held = self.aborting_own.get(rid)
        if held is not None and rec.get("table", 0) != held:
            raise _Bad("release_once_after_fence", f"request {rid!r}: its page table went from {held} to "
                                                   f"{rec.get('table', 0)} pages while aborting (released before "
                                                   f"its work in flight ended)")

    def _return(self, rec: dict[str, Any]) -> None:
        rid = rec["id"]
        known = self.requests.get(rid)
        if known in ("finished", "aborted") and rec.get("name") == "admit" and rec.get("state") == "waiting":
            # an ended id admitted again with device pages short: a new record, still waiting
            # (no transition fired; the facade had forgotten the ended one)
            known = self.requests[rid] = "waiting"
        if known is not None and known != rec.get("state"):
            raise _Bad("spec", f"request {rid!r}: {rec.get('name')} returned in state {rec.get('state')!r}, "
                               f"but the log left it {known!r}")
        if rec.get("state") == "aborting":
            self._fence(rid, rec)


def check_records(records: Iterable[tuple[int, dict[str, Any]]], context: int = 12) -> CheckResult:
    """Check (line, record) pairs; stops at the first violation. A
    :class:`~kvtier.cli.logreader.LogFormatError` raised by ``records`` (:func:`read_log`'s) is
    a ``format`` violation at its line.

    Args:
        context: how many earlier records a violation shows (an int in 0 .. :data:`MAX_CONTEXT`).

    Raises:
        kvtier.fsm.ConfigError: ``context`` not an int >= 0, or above :data:`MAX_CONTEXT`.
    """
    context = as_int(context, "context", minimum=0, error=ConfigError)
    if context > MAX_CONTEXT:
        raise ConfigError(f"context must be at most {MAX_CONTEXT} records, got {context}")
    c = _Checker(context)
    held: tuple[int, dict[str, Any]] | None = None  # a completion, until we know it was not refused
    unreadable: LogFormatError | None = None
    try:
        for line, rec in records:
            if held is not None:
                if isinstance(rec, dict) and rec.get("k") == "refused" and rec.get("name") == "complete":
                    # refused: it changed nothing (the caller's record is left as it is)
                    held = (held[0], {**held[1], "refused": rec.get("error") or True})
                c.feed(*held)
                held = None
                if c.result.violation is not None:
                    return c.result
            if isinstance(rec, dict) and rec.get("k") == "completion" and not rec.get("refused"):
                held = (line, rec)
                continue
            c.feed(line, rec)
            if c.result.violation is not None:
                return c.result
    except LogFormatError as exc:
        unreadable = exc
    if held is not None:
        c.feed(*held)
    if c.result.violation is None and unreadable is not None:
        c.result.violation = Violation(unreadable.line, "format", unreadable.detail, {}, tuple(c.context))
    elif c.result.violation is None and not c.header:
        c.result.violation = Violation(0, "format", "empty log: no header record", {})
    return c.result


def check_log(path: str | Path, context: int = 12, *,
              max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> CheckResult:
    """Check the log file at ``path`` (see :func:`check_records`), read by :func:`read_log`
    (plain or gzip, within the trace reader's input limits): a line past a limit, not a
    JSON object, or invalid or truncated gzip data is a ``format`` violation.

    Raises:
        kvtier.fsm.ConfigError: ``context`` or ``max_decompressed_bytes`` out of range.
        OSError: the file cannot be opened or read.
    """
    return check_records(read_log(path, max_decompressed_bytes=max_decompressed_bytes), context)
