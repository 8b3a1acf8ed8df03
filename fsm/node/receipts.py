"""Locks, borrows and pins as counts with receipts (invariant ``counts_with_receipts``); the only place that
changes a node's ``lock_ref``, ``borrow_ref`` or ``host_pin``.

- A *lock* holds a node and all its ancestors on the device (a running request's path).
- A *hold* is a lock without a use: it keeps a path out of an eviction for the length
  of one call and neither counts a hit nor moves the clock.
- A *borrow* marks nodes whose device pages a request reads (invariant ``borrowed_pages_stay``).
- A *pin* keeps host copies in place while a loadback reads them (invariant ``loadback_source_pinned``); an
  operation's own pin has the receipt id ``-op_id``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from ..errors import UsageError
from .node import LockReceipt, Node, NodeReceipt

__all__ = ["ReceiptBook"]

_COUNT = {"pin": "host_pin", "borrow": "borrow_ref"}


class ReceiptBook:
    """Outstanding lock, pin and borrow receipts.

    Args:
        ids: the id counter shared with the tree.
        touch: called with every node a release may make a victim (the eviction index
            re-files it; a lock or a new pin or borrow only protects, and is not reported;
            an unlock reports the nodes it leaves unlocked).
        on_hit: called with every node of a locked path once its hit is counted (the
            writeback queue backs up nodes used often enough); ``None`` when nothing does.
    """

    def __init__(self, ids: Iterator[int], touch: Callable[[Node], None],
                 on_hit: Callable[[Node], None] | None = None) -> None:
        self._ids = ids
        self._hold_ids = itertools.count(-1, -1)  # holds never take an id from the shared counter
        self._touch = touch
        self._on_hit = on_hit  # (None: nothing listens, and the path is not walked again)
        self._locks: dict[int, LockReceipt] = {}
        self._receipts: dict[int, NodeReceipt] = {}

    # -- views ----------------------------------------------------------------------
    def locks(self) -> tuple[LockReceipt, ...]:
        """Every outstanding lock receipt."""
        return tuple(self._locks.values())

    def node_receipts(self) -> tuple[NodeReceipt, ...]:
        """Every outstanding pin and borrow receipt (operations' own pins included)."""
        return tuple(self._receipts.values())

    def get(self, receipt_id: int) -> NodeReceipt:
        """The outstanding pin or borrow receipt ``receipt_id`` (KeyError if none)."""
        return self._receipts[receipt_id]

    def __len__(self) -> int:
        return len(self._locks) + len(self._receipts)

    # -- locks ------------------------------------------------------------------------
    def lock(self, node: Node, owner: str | None, stamp: int) -> LockReceipt:
        """Lock ``node``'s path and stamp it with ``stamp``; a node counts a reuse when
        ``owner`` is not the request that counted its last one (``None`` always counts).
        Every node of the path then goes to ``on_hit``, deepest first."""
        receipt = LockReceipt(next(self._ids), node, owner)
        path = node.path()
        for n in path:
            n.lock_ref += 1
            if owner is None or owner != n.last_owner:
                if n.hit_count:
                    n.prev_use = n.last_access
                n.hit_count += 1
                n.last_owner = owner
            n.last_access = stamp  # (a lock makes nothing a victim and only raises keys: no touch)
        on_hit = self._on_hit
        if on_hit is not None:
            for n in path:
                on_hit(n)
        self._locks[receipt.receipt_id] = receipt
        return receipt

    def hold(self, node: Node) -> LockReceipt:
        """Lock ``node``'s path for the length of one call (no hit, no stamp)."""
        receipt = LockReceipt(next(self._hold_ids), node, None)
        for n in node.path():
            n.lock_ref += 1
        self._locks[receipt.receipt_id] = receipt
        return receipt

    def unlock(self, receipt: LockReceipt, stamp: int | None) -> None:
        """Release a lock (stamping its path with ``stamp``) or a hold (``stamp=None``).

        Raises:
            UsageError: the receipt was already released or is not this cache's (invariant ``counts_with_receipts``).
        """
        self.check_lock(receipt)
        receipt.released = True
        del self._locks[receipt.receipt_id]
        touch = self._touch
        for n in receipt.node.path():
            n.lock_ref -= 1
            if stamp is not None:
                n.last_access = stamp
            if n.lock_ref == 0:  # (a node still locked is no victim: its last unlock re-files it)
                touch(n)

    def check_lock(self, receipt: object) -> None:
        """Raises UsageError unless ``receipt`` is an outstanding lock receipt of this book."""
        if not isinstance(receipt, LockReceipt):
            raise UsageError(f"unlock takes a LockReceipt, got {receipt!r}")
        if receipt.released or self._locks.get(receipt.receipt_id) is not receipt:
            raise UsageError(f"{receipt!r} was already released or is unknown (counts_with_receipts)")

    # -- pins and borrows ---------------------------------------------------------------
    def take(self, kind: str, nodes: list[Node], owner: str | None, receipt_id: int | None = None) -> NodeReceipt:
        """A ``"pin"`` or ``"borrow"`` receipt on ``nodes`` (id from the counter unless given)."""
        rid = next(self._ids) if receipt_id is None else receipt_id
        receipt = NodeReceipt(rid, kind, list(nodes), owner)
        attr = _COUNT[kind]
        for n in receipt.nodes:
            setattr(n, attr, getattr(n, attr) + 1)
            n.add_ref(rid)
        self._receipts[rid] = receipt
        return receipt

    def release(self, receipt: NodeReceipt) -> None:
        """Release a pin or borrow receipt exactly once.

        Raises:
            UsageError: not a receipt, already released or unknown (invariant ``counts_with_receipts``).
        """
        if not isinstance(receipt, NodeReceipt):
            raise UsageError(f"release takes a pin or borrow receipt (NodeReceipt), got {receipt!r}")
        if receipt.released or self._receipts.get(receipt.receipt_id) is not receipt:
            raise UsageError(f"{receipt!r} was already released or is unknown (counts_with_receipts)")
        receipt.released = True
        del self._receipts[receipt.receipt_id]
        attr = _COUNT[receipt.kind]
        for n in receipt.nodes:
            setattr(n, attr, getattr(n, attr) - 1)
            n.discard_ref(receipt.receipt_id)
            self._touch(n)

    def on_split(self, node: Node, prefix: Node) -> None:
        """``node`` was cut and ``prefix`` is its new parent fragment: every receipt listing
        ``node`` now lists ``prefix`` right before it (invariant ``split_preserves_ownership``)."""
        for rid in node.refs:
            prefix.add_ref(rid)
            r = self._receipts[rid]
            r.nodes.insert(r.nodes.index(node), prefix)
