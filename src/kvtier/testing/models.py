"""Reference models: what the kit's machines check that the spec's invariants cannot see.

The invariants (``check_invariants``) look at one state at a time. These models follow a
run and compare what the system under test answers with what a small, independent
reimplementation says it must answer:

- :class:`LayerModel`: layer readiness per rank. Every layer completion a rank delivers
  is recorded per (loadback, rank); ``TieredCache.layer_ready(rid, layer)`` must be true
  exactly when the request is in a state that reads pages, none of its loadbacks failed
  (a failed completion of any rank, a failed acknowledgement or an expired deadline),
  and every loadback it waits on reached ``layer`` on *every* rank (the slowest rank
  counts; an off-by-one or progress taken from the fastest rank disagrees).
- :func:`eviction_key` / :func:`check_eviction_order`: a shadow of the eviction order.
  The documented policies (``fsm/node/eviction.py``: ``lru``, ``lru2`` and the exclusive host
  tier) are reimplemented here; after an eviction call every node it took must come
  before, in the policy's order, every candidate it left behind.
- Liveness (:func:`liveness_bound`): after a bounded number of rounds of "poll, deliver
  everything successfully", nothing is queued, in flight or waiting: every queued
  writeback was issued or dropped with a reason (the host refused it, or its node left).
- The writeback queue (:func:`check_queue_exits`): a node leaves the queue only when its
  writeback is submitted, it leaves the tree or the device, the host refused it, or its
  parent is a device-only node (whose writeback failed or was never asked for), so that
  nothing queued is silently forgotten (the liveness bound alone cannot see a node that
  left the queue without a writeback).
- Use stamps (:func:`snapshot_use` / :func:`check_use`): a lock or an unlock makes its
  path the most recently used (a stamp newer than every stamp before the call, which the
  eviction order then follows), and a lock counts a reuse (``hit_count``, ``prev_use``
  for LRU-2, what ``write_through_selective`` reads) exactly when its owner is not the
  one that counted the node's last reuse.
- The facade machine adds that an aborted request's own writeback is never published
  and that admission never reuses the whole prompt (its last token is always computed).

Failures raise :class:`ModelViolation` (an :class:`~kvtier.fsm.errors.InvariantViolation`
whose name starts with ``model_``), so the fuzz shrinks and saves them like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import Node

__all__ = ["MODELS", "ModelViolation", "LayerModel", "eviction_key", "check_eviction_order", "liveness_bound",
           "snapshot_use", "check_use", "check_queue_exits", "check_split_queue"]

#: The names a :class:`ModelViolation` carries (what a failure prints).
MODELS: tuple[str, ...] = ("model_layer_ready", "model_eviction_order", "model_liveness",
                           "model_aborted_unpublished", "model_whole_prompt", "model_transfer_hazard",
                           "model_use_stamp", "model_views", "model_pass_reads", "model_reserve",
                           "model_l3_options", "model_l3_counters", "model_l3_fetched", "model_admission",
                           "model_passes", "model_poll", "model_drain", "model_refusal", "model_reference",
                           "model_checkpoint", "model_writeback_queue", "model_counters", "model_scheduler_policy",
                           "model_log_checker", "model_label_bounds", "model_budget",
                           "model_scheduler_stats", "model_engine_stats", "model_metrics")

#: The request states in which ``layer_ready`` may answer true (``[request.calls]`` of the
#: spec, restated here so that the model does not read it from the system under test).
READING_STATES = frozenset({"loading", "running", "finishing", "retracting", "aborting"})
_DEVICE_RESIDENT = frozenset({"device", "writing", "backed", "loading"})


class ModelViolation(InvariantViolation):
    """The system under test disagrees with a reference model (``invariant`` is one of
    :data:`MODELS`)."""


# -- layer readiness ---------------------------------------------------------------------

@dataclass
class LayerModel:
    """Per-rank layer progress of loadbacks and the loadbacks each request waits on.

    Attributes:
        progress: op -> rank -> highest layer that rank delivered successfully.
        failed_ops: loadbacks any rank reported failed (or whose deadline passed).
        waits: request -> loadback op ids its last admission waits on.
        failed: requests one of whose loadbacks failed since their last admission.
    """

    progress: dict[int, dict[int, int]] = field(default_factory=dict)
    failed_ops: set[int] = field(default_factory=set)
    waits: dict[str, set[int]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def admitted(self, rid: str, wait_ops: Iterable[int]) -> None:
        """``rid`` was admitted (or resumed) and waits on ``wait_ops``."""
        self.waits[rid] = set(wait_ops)
        self.failed.discard(rid)

    def delivered(self, op: int, rank: int, layer: int | None, ok: bool) -> None:
        """A completion of loadback ``op`` from ``rank`` was delivered."""
        if not ok:
            self.failed_ops.add(op)
        elif layer is not None:
            ranks = self.progress.setdefault(op, {})
            ranks[rank] = max(ranks.get(rank, -1), layer)

    def settled(self, op: int, ok: bool) -> None:
        """Loadback ``op`` settled (``ok`` False: failed or expired)."""
        if not ok or op in self.failed_ops:
            for rid, ops in self.waits.items():
                if op in ops:
                    self.failed.add(rid)
        for ops in self.waits.values():
            ops.discard(op)
        self.progress.pop(op, None)
        self.failed_ops.discard(op)

    def expect(self, rid: str, state: str, layer: int, world: int, in_flight: Mapping[int, object]) -> bool:
        """What ``layer_ready(rid, layer)`` must answer."""
        if state not in READING_STATES or rid in self.failed:
            return False
        for op in self.waits.get(rid, ()):
            if op not in in_flight:
                continue
            if op in self.failed_ops:
                return False
            ranks = self.progress.get(op, {})
            if min(ranks.get(r, -1) for r in range(world)) < layer:
                return False
        return True


# -- eviction order ----------------------------------------------------------------------

def eviction_key(n: Node, policy: str, tier: str, exclusive: bool, window: int = 0) -> tuple[int, ...]:
    """The documented order of ``fsm/node/eviction.py``, restated: ``lru`` is oldest use first,
    then deepest, then node id; ``lru_turns`` adds ``window x log2(turns)`` (linear
    between powers of two) to the last use, on both tiers; ``lru2`` orders the host by the
    second-to-last use by a distinct request first; an exclusive host tier takes nodes a
    loadback brought back (still on the device) before all others."""
    stamp = n.last_access
    if policy == "lru_turns":
        low = 1 << (n.turns.bit_length() - 1)  # the power of two at or below turns
        stamp += window * (low.bit_length() - 1) + window * (n.turns - low) // low
    base: tuple[int, ...] = (stamp, -n.depth, n.node_id)
    if tier == "host" and policy == "lru2":
        base = (n.prev_use,) + base
    if tier == "host" and exclusive:
        base = (0 if n.reloaded and n.state in _DEVICE_RESIDENT else 1,) + base
    return base


@dataclass(frozen=True)
class _Candidate:
    node: Node
    key: tuple[int, ...]
    state: str
    pages: int


def snapshot_candidates(nodes: Iterable[Node], policy: str, tier: str, exclusive: bool,
                        window: int = 0) -> list[_Candidate]:
    """The eviction candidates before a call, with their keys, states and page counts."""
    out = []
    for n in nodes:
        pm = (n.dev, n.dev_ckpt) if tier == "device" else (n.host, n.host_ckpt)
        out.append(_Candidate(n, eviction_key(n, policy, tier, exclusive, window), n.state,
                              sum(len(p) for m in pm for p in m.values())))
    return out


def check_eviction_order(before: list[_Candidate], tier: str, live: set[int], queued: set[int],
                         queued_before: set[int]) -> None:
    """Every candidate an eviction call took comes before, in the policy's order, every
    candidate it left untouched.

    A candidate was *taken* when it left the tree, changed state, lost pages of the tier
    (the tail of a split) or was queued for writeback (``write_back``: queued instead of
    dropped). ``live``: node ids still in the tree; ``queued``/``queued_before``: the
    writeback queue after and before the call.

    Raises:
        ModelViolation: a candidate left behind precedes one taken.
    """
    taken: list[_Candidate] = []
    left: list[_Candidate] = []
    for c in before:
        n = c.node
        if n.node_id in queued_before and n.node_id in queued:
            continue  # queued before and after (write_back): whether this call pledged it is unseen
        pm = (n.dev, n.dev_ckpt) if tier == "device" else (n.host, n.host_ckpt)
        pages = sum(len(p) for m in pm for p in m.values())
        was_taken = (n.node_id not in live or n.state != c.state or pages < c.pages
                     or (n.node_id in queued and n.node_id not in queued_before))
        (taken if was_taken else left).append(c)
    if not taken or not left:
        return
    last = max(taken, key=lambda c: c.key)
    first_left = min(left, key=lambda c: c.key)
    if first_left.key < last.key:
        raise ModelViolation("model_eviction_order", f"{tier} eviction",
                             f"took node {last.node.node_id} (key {last.key}) but left node "
                             f"{first_left.node.node_id} (key {first_left.key}), which the policy evicts first")


def liveness_bound(nodes: int) -> int:
    """Rounds of "poll, deliver everything" within which everything queued must be done:
    writebacks are issued parent first, one tree level per round at worst."""
    return nodes + 3


# -- use stamps and reuse counts ---------------------------------------------------------

@dataclass(frozen=True)
class _Use:
    node: Node
    hit_count: int
    last_owner: str | None
    last_access: int
    prev_use: int


def snapshot_use(path: Iterable[Node]) -> list[_Use]:
    """The use records of ``path``'s nodes before a lock or an unlock."""
    return [_Use(n, n.hit_count, n.last_owner, n.last_access, n.prev_use) for n in path]


def check_use(before: list[_Use], newest_before: int, owner: str | None, locked: bool, what: str) -> None:
    """After a lock (``locked``) or an unlock of the path ``before`` was taken of:

    - every node of the path carries one stamp, newer than ``newest_before`` (the newest
      stamp of any node before the call): the path is now the most recently used;
    - a lock by ``owner`` counts a reuse (``hit_count`` + 1, ``last_owner`` = owner,
      ``prev_use`` = the stamp before, from the second reuse on) exactly when ``owner``
      is ``None`` or not the node's last counted owner; otherwise those stay as they were;
      an unlock changes none of them.

    Raises:
        ModelViolation: ``model_use_stamp``.
    """
    stamps = {u.node.last_access for u in before}
    if len(stamps) > 1 or (stamps and min(stamps) <= newest_before):
        raise ModelViolation("model_use_stamp", what,
                             f"path stamps {sorted(stamps)} after the call, newest stamp before it "
                             f"{newest_before}: the path is not the most recently used")
    for u in before:
        n = u.node
        counts = locked and (owner is None or owner != u.last_owner)
        want = ((u.hit_count + 1, owner, u.last_access if u.hit_count else u.prev_use) if counts
                else (u.hit_count, u.last_owner, u.prev_use))
        got = (n.hit_count, n.last_owner, n.prev_use)
        if got != want:
            raise ModelViolation("model_use_stamp", f"node {n.node_id} ({what})",
                                 f"(hit_count, last_owner, prev_use) is {got}, expected {want} "
                                 f"(owner {owner!r}, before {(u.hit_count, u.last_owner, u.prev_use)})")


# -- the writeback queue -------------------------------------------------------------------

def check_queue_exits(before: Mapping[int, Node], after: Mapping[int, Node], live: Mapping[int, Node],
                      submitted: set[int], refused: Callable[[int], bool]) -> None:
    """Every node that left the tree-writeback queue between two checks (``before`` ->
    ``after``, node id -> node) left it for a reason: its writeback was submitted (its id
    is in ``submitted``, the node ids of the writeback commands issued meanwhile), it left
    the tree (``live``) or the device state, the host refused it (``refused``), or its
    parent is a device-only node that no writeback will give a host copy to.

    Raises:
        ModelViolation: ``model_liveness``, naming the node and its parent's state.
    """
    for nid, n in before.items():
        if nid in after or nid in submitted or live.get(nid) is not n or n.state != "device" or refused(nid):
            continue
        p = n.parent
        if p is None or p.parent is None or p.state == "device":
            continue
        raise ModelViolation("model_liveness", f"node {nid}",
                             f"left the writeback queue without a writeback, a refusal or leaving the "
                             f"device, while its parent {p.node_id} is {p.state}: it is never written back")


def check_split_queue(live_before: set[int], before: Mapping[int, Node], after: Mapping[int, Node],
                      refused: Callable[[int], bool]) -> None:
    """A queue entry stays with both fragments of a split (spec: Issuing tree writebacks):
    for every node queued at both checks (``before`` -> ``after``), each ancestor created
    since the last check (its id not in ``live_before``: the head fragments cut from it)
    that is still device-only is queued too, unless the host refused it. A head left
    unqueued would make the queued tail's parent device-only, so the tail then leaves the
    queue as "no writeback will back its parent": under ``write_back`` the demand's room is
    never made, under the other policies the host copy is never written.

    Raises:
        ModelViolation: ``model_writeback_queue``, naming the fragments.
    """
    for nid, n in after.items():
        if nid not in before:
            continue
        p = n.parent
        while p is not None and p.parent is not None and p.node_id not in live_before:
            if p.state == "device" and p.node_id not in after and not refused(p.node_id):
                raise ModelViolation("model_writeback_queue", f"node {nid}",
                                     f"is queued for a writeback, but its head fragment {p.node_id} cut by a "
                                     f"split since the last check is device-only and not queued (a queue entry "
                                     f"stays with both fragments)")
            p = p.parent
