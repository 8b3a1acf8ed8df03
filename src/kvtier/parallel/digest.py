"""A cheap digest of one core's decisions, compared across tensor-parallel ranks.

Every rank runs its own core over the same inputs, so every rank must take the same
decisions: the same page ids, the same node events (evictions, demotions, splits,
writebacks, loadbacks), the same operation ids, the same victims. :class:`DecisionDigest`
folds those decisions, in the order they are taken, into a running 64-bit BLAKE2b hash;
ranks compare its value once per exchange (:class:`~kvtier.parallel.sync.StepSync`), and
since the hash is chained, the first exchange where two values differ is the first step
where the ranks decided differently.

Only ints and short ASCII strings are hashed (never Python's ``hash()``, which is salted
per process), so the value is equal across processes for equal decisions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from kvtier.fsm import TransferCommand

__all__ = ["DecisionDigest"]


class DecisionDigest:
    """A running hash of decisions (see the module docstring).

    Attributes:
        updates: records folded in so far.
    """

    __slots__ = ("_h", "updates")

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)
        self.updates = 0

    def value(self) -> int:
        """The digest so far, as a signed 64-bit int (it travels in an int64 tensor)."""
        return int.from_bytes(self._h.digest(), "little", signed=True)

    def add(self, *parts: object) -> None:
        """Fold one record (ints, strs, None, bools and flat tuples/lists of them)."""
        self._h.update(repr(parts).encode())
        self.updates += 1

    def add_pages(self, tag: str, owner: str, pages: Mapping[str, Sequence[int]] | None) -> None:
        """Fold a page map (group -> page ids), or ``None`` (refused)."""
        if pages is None:
            self.add(tag, owner, None)
        else:
            self.add(tag, owner, tuple((g, tuple(int(p) for p in ps)) for g, ps in pages.items()))

    def add_command(self, cmd: TransferCommand) -> None:
        """Fold a transfer command: op id, direction, and every group's source and
        destination pages."""
        self.add("cmd", cmd.op_id, cmd.direction.value,
                 tuple((t.group, tuple(int(p) for p in t.src_pages), tuple(int(p) for p in t.dst_pages))
                       for t in cmd.transfers))
