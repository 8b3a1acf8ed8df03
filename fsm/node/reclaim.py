"""Reclaiming pages when a pool runs short: device eviction and demotion, host eviction
and host-copy drops, in the order the eviction index gives, each through a node event.

Eviction is exact: when a victim leaf holds more units than still needed, it is split
first and only its tail (the deepest units, and the checkpoint at its end) is freed, so
a burst of demand frees what it asks for, not whole leaves. Splits are deterministic,
so every rank frees the same pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..lifecycle.names import NODE_EVENT as EV, NODE_STATE as NS
from .node import Node
from .store import NodeStore
from .writeback import WritePolicy

__all__ = ["Reclaimer"]

#: the states device eviction takes a node from (``device``: dropped, ``backed``: demoted)
_VICTIM_STATES = frozenset((NS.device, NS.backed))


class Reclaimer:
    """``evict_device`` and ``evict_host`` over one node core's ``store``."""

    def __init__(self, store: NodeStore) -> None:
        self.store = store

    def evict_device(self, need: Mapping[str, int]) -> dict[str, int]:
        """Free device pages from unlocked, unborrowed device leaves in eviction order.

        A ``backed`` node is demoted (its host copy stays), a ``device`` node is dropped,
        or under ``write_back`` queued for writeback first (freeing nothing now, but its
        pages count toward ``need``: no more leaves are queued than the demand asks for).

        Args:
            need: group -> pages wanted (stops once every group has that many freed).

        Returns:
            group -> pages actually freed (may be less than asked).

        ``need`` is trusted (the core's public ``evict_device`` checks it; the core's own
        callers pass what they computed).
        """
        store = self.store
        freed = dict.fromkeys(store.device, 0)
        pledged = dict.fromkeys(store.device, 0)  # pages of leaves queued for writeback (freed later)
        queued: list[Node] = []
        candidates = store.eviction.device_candidates()
        wb = store.writebacks  # (its chain is walked only when write_back may queue it)
        write_back = wb.enabled and wb.policy is WritePolicy.WRITE_BACK
        wants = tuple(need.items())
        while True:
            for g, k in wants:
                if freed[g] + pledged[g] < k:
                    break
            else:
                break  # every group has what it needs
            n = next(candidates, None)
            if n is None:
                break
            # (device_victim, inline)
            if n.state not in _VICTIM_STATES or n.lock_ref or n.borrow_ref or (n.children and n.has_device_child):
                continue
            if n.state == NS.backed:
                n = self._tail(n, need, freed)
                got = self._release_device(n)
                store.trigger(n, EV.demote)
                store.stats.demotions += 1
            elif write_back and wb.write_back_first(self._device_chain(n)):
                queued.append(n)  # still a candidate: back in the index after this call
                for pm in (n.dev, n.dev_ckpt):  # its demotion, once written, frees these
                    for g, pages in pm.items():
                        pledged[g] += len(pages)
                continue
            else:
                n = self._tail(n, need, freed)
                got = self._release_device(n)
                store.trigger(n, EV.evict_device)
                self._remove(n)
                store.stats.device_evictions += 1
            for g, k in got.items():
                freed[g] += k
        for n in queued:
            store.eviction.touch(n)
        return freed

    def evict_host(self, need: Mapping[str, int], *, protect: Iterable[Node] = (),
                   host_only: bool = False) -> dict[str, int]:
        """Free host pages from host leaves with pin 0 in eviction order (invariant ``host_evict_leaves``): a
        ``host`` node is removed, a ``backed`` node sheds its host copy and stays on device.
        ``protect``-ed nodes are spared; with ``host_only``, ``backed`` nodes are spared too,
        except, with an exclusive host tier, those a loadback brought back (duplicates).

        Returns:
            group -> host pages actually freed.

        Raises:
            UsageError: unknown group or a count that is not an int >= 0 (nothing changes).
        """
        store = self.store
        store.ledger.check_need(need)
        if store.host is None:
            return {}
        freed = {g: 0 for g in store.host}
        keep = {id(n) for n in protect}
        spared: list[Node] = []
        candidates = store.eviction.host_candidates()
        while any(freed[g] < k for g, k in need.items()):
            n = next(candidates, None)
            if n is None:
                break
            if id(n) in keep or (host_only and n.state == NS.backed and not (store.exclusive and n.reloaded)):
                spared.append(n)  # spared this time only: a candidate again after this call
                continue
            if not self.host_victim(n):
                continue
            n = self._tail(n, need, freed)
            got = store.ledger.release_host(n.host, n.host_ckpt)
            n.host = {}
            n.host_ckpt = {}
            if n.state == NS.host:
                store.trigger(n, EV.evict_host)
                self._remove(n)
                store.stats.host_evictions += 1
            else:
                store.trigger(n, EV.drop_host)
                store.stats.host_drops += 1
            for g, k in got.items():
                freed[g] += k
        for n in spared:
            store.eviction.touch(n)
        return freed

    @staticmethod
    def device_victim(n: Node) -> bool:
        """Device eviction may take ``n``: an unlocked, unborrowed device or backed leaf of
        the device set (the guards of ``evict_device`` and ``demote``)."""
        return n.state in _VICTIM_STATES and n.lock_ref == 0 and n.borrow_ref == 0 and not n.has_device_child

    @staticmethod
    def host_victim(n: Node) -> bool:
        """Host eviction may take ``n``'s host copy: an unpinned leaf of the host set, and
        unlocked unless it stays on the device (the guards of ``evict_host`` and ``drop_host``)."""
        return (n.state in (NS.host, NS.backed) and n.host_pin == 0 and not n.has_host_child
                and (n.state == NS.backed or n.lock_ref == 0))

    def _tail(self, n: Node, need: Mapping[str, int], freed: Mapping[str, int]) -> Node:
        """``n``, or its tail after a split when fewer of its units cover what is still
        needed (history groups by pages per unit; a state group by the checkpoint at the
        node's end, which stays with the tail)."""
        units = len(n.key)
        k = 1
        for g, want in need.items():
            left = want - freed.get(g, 0)
            ppu = self.store.pages_per_unit.get(g)
            if left > 0 and ppu is not None:
                k = max(k, -(-left // ppu))
        if k < units:
            self.store.split(n, units - k)  # n keeps the last k units
        return n

    @staticmethod
    def _device_chain(n: Node) -> list[Node]:
        """``n`` and its ancestors up to the first one not in the ``device`` state."""
        out = []
        for a in n.path():
            if a.state != NS.device:
                break
            out.append(a)
        return out

    def _release_device(self, n: Node) -> dict[str, int]:
        got = self.store.ledger.release_device(n.dev, n.dev_ckpt)
        n.dev = {}
        n.dev_ckpt = {}
        n.chunk_checkpoint = False
        return got

    def _remove(self, n: Node) -> None:
        self.store.tree.unlink(n)
        self.store.writebacks.forget(n.node_id)
