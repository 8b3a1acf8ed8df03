"""The write policy and the queue of tree writebacks it asks for.

The policy decides *when* a device node should get a host copy; the queue holds those
nodes until their parent is on the host (invariant ``root_closed_host``) and the core submits them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from ..lifecycle.names import HOST_VISIBLE, NODE_STATE
from .node import Node

__all__ = ["WritePolicy", "WritebackQueue"]


class WritePolicy(str, enum.Enum):
    """When tree pages are backed up to the host."""

    WRITE_THROUGH = "write_through"  #: back up every newly published node
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  #: once its hit count reaches the threshold
    WRITE_BACK = "write_back"  #: only when device eviction needs the room


class WritebackQueue:
    """Device nodes waiting for a tree writeback, in the order the policy asked.

    Args:
        policy: the write policy.
        threshold: hits before ``write_through_selective`` asks for a node.
        enabled: False without a host tier (then nothing is ever queued).
    """

    def __init__(self, policy: WritePolicy, threshold: int, enabled: bool) -> None:
        self.policy = policy
        self.threshold = threshold
        self.enabled = enabled
        #: whether :meth:`on_hit` can ever queue a node (``write_through_selective`` with a host tier)
        self.wants_hits = enabled and policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        self._queue: dict[int, Node] = {}  # node_id -> node wanting a tree writeback
        # device nodes whose tree writeback the host could not take: under write_back,
        # eviction drops them instead of queueing them again (no queue/refuse livelock)
        self._refused: set[int] = set()

    # -- views ----------------------------------------------------------------------
    def __contains__(self, node_id: object) -> bool:
        return node_id in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def queued(self) -> dict[int, Node]:
        """Queued nodes by node id (a copy)."""
        return dict(self._queue)

    def node_ids(self) -> list[int]:
        """Queued node ids, sorted."""
        return sorted(self._queue)

    def refused(self, node_id: int) -> bool:
        """Whether the host could not take this node's writeback (write_back drops it)."""
        return node_id in self._refused

    # -- what the policy asks ---------------------------------------------------------
    def on_created(self, node: Node) -> None:
        """A node was published: ``write_through`` backs up every new node."""
        if self.enabled and self.policy is WritePolicy.WRITE_THROUGH:
            self._queue[node.node_id] = node

    def on_hit(self, node: Node) -> None:
        """A lock counted a hit: ``write_through_selective`` backs up a node used often enough."""
        if (self.enabled and self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE
                and node.hit_count >= self.threshold and node.state == NODE_STATE.device):
            self._queue[node.node_id] = node

    def write_back_first(self, chain: list[Node]) -> bool:
        """Under ``write_back``, device eviction of a chain's leaf queues the chain (parent
        first) instead of dropping it, unless the host refused one of them. Returns
        whether it queued."""
        if not (self.enabled and self.policy is WritePolicy.WRITE_BACK):
            return False
        if any(a.node_id in self._refused for a in chain):
            return False
        for a in chain:
            self._queue[a.node_id] = a
        return True

    def want(self, node: Node) -> None:
        """Queue ``node`` (its parent's writeback is in flight elsewhere)."""
        self._queue[node.node_id] = node

    # -- bookkeeping -------------------------------------------------------------------
    def submitted(self, node: Node) -> None:
        """``node``'s writeback was submitted: it leaves the queue and the refused set."""
        self._queue.pop(node.node_id, None)
        self._refused.discard(node.node_id)

    def give_up(self, node: Node) -> None:
        """The host cannot take ``node``: it leaves the queue and is marked refused."""
        self._queue.pop(node.node_id, None)
        self._refused.add(node.node_id)

    def forget(self, node_id: int) -> None:
        """A node left the tree."""
        self._queue.pop(node_id, None)
        self._refused.discard(node_id)

    def on_split(self, node: Node, prefix: Node) -> None:
        """A queued node was cut: its new prefix fragment is queued too."""
        if node.node_id in self._queue:
            self._queue[prefix.node_id] = prefix

    def drop_children_of(self, failed: Iterable[Node]) -> None:
        """A writeback of ``failed`` nodes failed: their queued children would break
        invariant ``root_closed_host``, so they leave the queue."""
        ids = {id(n) for n in failed}
        for nid, q in list(self._queue.items()):
            if q.parent is not None and id(q.parent) in ids:
                del self._queue[nid]

    def clear(self) -> None:
        self._queue.clear()

    def ready(self) -> list[Node]:
        """Queued nodes whose parent is the root or on the host, shallowest first; under
        ``write_back`` also those whose parent is ready itself (a chain that an eviction
        queued goes in one operation, parent first, so its pages come free after one round
        instead of one round per level; invariant ``root_closed_host`` holds within the operation). Nodes whose
        parent is only on the device and not queued leave the queue (their parent will not
        be written: invariant ``root_closed_host``); others stay."""
        out: list[Node] = []
        taken: set[int] = set()
        chains = self.policy is WritePolicy.WRITE_BACK
        # (every queued node is a device node of the tree: submitting a writeback and
        # removing a node both take it out of the queue; a parent is shallower, so it is
        # decided before its children)
        for n in sorted(self._queue.values(), key=lambda x: (x.depth, x.node_id)):
            p = n.parent
            assert p is not None
            if p.parent is None or p.state in HOST_VISIBLE or p.node_id in taken:
                out.append(n)
                if chains:
                    taken.add(n.node_id)
            elif p.state == NODE_STATE.device and p.node_id not in self._queue:
                self._queue.pop(n.node_id, None)
        return out
