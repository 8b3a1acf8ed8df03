"""Publishing a computed prefix into the tree: ``insert``, validated, then committed.

A request computes KV into its own device pages; publishing hands those pages to tree
nodes (new ones, or ``host`` nodes republished on the device) and gives back the
caller's copies of ranges the tree already held. Validation changes nothing; only the
commit does, and only through node events.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence

from ..errors import UsageError
from ..lifecycle.names import DEVICE_READABLE, NODE_EVENT as EV, NODE_STATE as NS
from .match import has_checkpoint
from .node import Node, PageMap
from .results import InsertResult
from .store import NodeStore

__all__ = ["Publisher"]

#: states an anchor's path may be in: device pages every request may read (a ``loading``
#: node stops a publish and a ``host`` one is republished: those take the full walk).
_ANCHOR_STATES = DEVICE_READABLE - {NS.loading}


class Publisher:
    """``insert`` over one node core's ``store``."""

    def __init__(self, store: NodeStore) -> None:
        self.store = store
        #: state group -> checkpoint pages (the layout's, read once)
        self._sizes = {g.name: g.state_pages for g in store.layout.state_groups}
        self._hist_set = frozenset(store.history_groups)

    def insert(self, key: Sequence[Hashable], pages: Mapping[str, Sequence[int]],
               checkpoint: Mapping[str, Sequence[int]] | None = None, *,
               chunk_checkpoint: bool = False, anchor: Node | None = None) -> InsertResult:
        """Publish a computed prefix: ``pages`` hold, per history group, the caller's device
        page table for the whole ``key`` (canonical pages it borrowed, then its own pages).

        Ranges the tree already holds keep their canonical pages and the caller's copies
        come back as ``duplicates``; a ``host`` node on the way is republished with the
        caller's pages (``backed``); nothing is published at or beyond a node that is
        loading (those pages are ``kept``). ``checkpoint`` (state group -> its
        ``state_pages`` pages for exactly the key's end) gives the terminal node its
        continuation state; ``chunk_checkpoint`` marks it as left by an intermediate
        prefill chunk, so that a later, deeper checkpoint of the same prefix may drop it.

        ``anchor``: a node the caller holds a lock on whose path is ``key``'s prefix (a
        request's last published terminal). When its path's device pages are exactly the
        first pages of ``pages`` (checked: one list comparison per group), the walk starts
        there and only the pages beyond it are checked and compared, so a request that
        publishes unit by unit pays per new unit, not per unit of its whole prefix. Any
        other anchor is ignored (the whole key is walked and checked).

        Raises:
            UsageError: wrong page counts, unknown groups, or pages that are neither the
                caller's nor the canonical ones for their range (nothing changes).
        """
        own, ckpt = self._check_arguments(key, pages, checkpoint)
        base = self._anchored(anchor, key, own)
        if base is None:
            # (checked above; a split on the way is semantically invisible)
            path = self.store.tree.walk(key, self.store.split)
            self._check_pages(path, own, ckpt, 0)
            return self._commit(key, path, own, ckpt, chunk_checkpoint, 0)
        # the anchor's path is the caller's, page for page: walk and check only beyond it
        path = base[::-1] + self.store.tree.walk_from(base[0], key, self.store.split)
        depth = base[0].depth
        self._check_pages(path[len(base):], own, ckpt, depth)
        return self._commit(key, path, own, ckpt, chunk_checkpoint, depth)

    def insert_trusted(self, key: Sequence[Hashable], own: PageMap, anchor: Node,
                       chunk_checkpoint: bool) -> InsertResult:
        """:meth:`insert` without a checkpoint, for arguments the caller vouches for (the
        request layer: its checked unit keys and its page table). ``anchor``: a node of the
        tree the caller holds a lock on, whose path is ``key``'s prefix; ``own``: history
        group -> exactly ``len(key)`` units of pages (lists the call may keep), of which the
        first ``anchor.depth`` units are the anchor path's device pages and the rest the
        caller's own distinct pages. Only the anchor path's states are read (a path through
        a ``loading`` or ``host`` node takes :meth:`insert`'s checked walk); nothing else is
        checked again, and the canonical pages come from the walk, not a second one."""
        base = anchor.path()
        for n in base:
            if n.state not in _ANCHOR_STATES:
                return self.insert(key, own, None, chunk_checkpoint=chunk_checkpoint, anchor=anchor)
        store = self.store
        path = store.tree.walk_from(anchor, key, store.split)
        return self._commit(key, path, own, {}, chunk_checkpoint, anchor.depth, base)

    def _anchored(self, anchor: Node | None, key: Sequence[Hashable], own: PageMap) -> list[Node] | None:
        """``anchor``'s path (deepest first) when it may start the walk, else ``None``."""
        store = self.store
        if anchor is None or anchor.parent is None or anchor.lock_ref <= 0 or not store.tree.has(anchor) \
                or anchor.depth > len(key):
            return None
        base = anchor.path()
        if any(n.state not in _ANCHOR_STATES for n in base):
            return None
        ppu = store.pages_per_unit
        have = store.tree.page_table(anchor, store.history_groups)
        for g in store.history_groups:
            if own[g][:anchor.depth * ppu[g]] != have[g]:
                return None
        k = 0
        for n in reversed(base):  # the anchor's key is key's prefix (C-level tuple compares)
            if tuple(key[k:k + len(n.key)]) != n.key:
                return None
            k += len(n.key)
        return base

    # -- validation -----------------------------------------------------------------
    def _check_arguments(self, key: Sequence[Hashable], pages: Mapping[str, Sequence[int]],
                         checkpoint: Mapping[str, Sequence[int]] | None) -> tuple[PageMap, PageMap]:
        store = self.store
        if (type(key) is not list and type(key) is not tuple and (isinstance(key, (str, bytes))
                                                                 or not isinstance(key, Sequence))) or not key:
            raise UsageError(f"insert: key must be a non-empty sequence of unit keys (not a str or bytes), got {key!r}")
        if type(pages) is not dict and not isinstance(pages, Mapping):
            raise UsageError(f"insert: pages must be a mapping group -> page ids, got {pages!r}")
        units = len(key)
        ppu = store.pages_per_unit
        own = {g: list(pages.get(g, ())) for g in store.history_groups}
        for g in store.history_groups:
            if len(own[g]) != units * ppu[g]:
                raise UsageError(f"insert: group {g!r} needs {units * ppu[g]} pages for {units} units, "
                                 f"got {len(own[g])}")
        if not self._hist_set.issuperset(pages):
            raise UsageError(f"insert: pages given for non-history groups {sorted(set(pages) - self._hist_set)}")
        ckpt = {g: list(p) for g, p in checkpoint.items()} if checkpoint else {}
        sizes = self._sizes
        for g, p in ckpt.items():
            if g not in sizes:
                raise UsageError(f"insert: checkpoint for unknown state group {g!r}")
            if len(p) != sizes[g]:
                raise UsageError(f"insert: checkpoint of {g!r} needs {sizes[g]} pages, got {len(p)}")
        if ckpt and set(ckpt) != set(store.ckpt_groups):
            raise UsageError(f"insert: a checkpoint needs every state group {list(store.ckpt_groups)}, "
                             f"got {sorted(ckpt)}")
        for g in itertools.chain(store.history_groups, ckpt):
            table = own.get(g, []) + ckpt.get(g, [])
            if len(set(table)) != len(table):
                raise UsageError(f"insert: the page table of group {g!r} lists a page twice")
        return own, ckpt

    def _check_pages(self, path: list[Node], own: PageMap, ckpt: PageMap, start: int) -> None:
        """Every page from unit ``start`` on is the canonical one for its position (along
        ``path``, which starts at ``start``) or the caller's own."""
        ledger = self.store.ledger
        ppu = self.store.pages_per_unit
        pos = start
        for n in path:
            lo = pos
            pos = n.depth
            for g in self.store.history_groups:
                span = own[g][lo * ppu[g]:pos * ppu[g]]
                canon = n.dev.get(g, [])
                if span == canon[:len(span)] or ledger.all_held_by_caller(g, span):
                    continue
                for j, page in enumerate(span):
                    if not (ledger.held_by_caller(g, page) or (j < len(canon) and canon[j] == page)):
                        raise UsageError(f"insert: page {page} of group {g!r} at unit {lo + j // ppu[g]} "
                                         f"is neither the caller's nor node {n.node_id}'s")
        for g, ps in itertools.chain(((g, own[g][pos * ppu[g]:]) for g in self.store.history_groups), ckpt.items()):
            if ledger.all_held_by_caller(g, ps):
                continue
            bad = [p for p in ps if not ledger.held_by_caller(g, p)]
            if bad:
                raise UsageError(f"insert: pages {bad} of group {g!r} are not held by the caller")

    # -- commit ---------------------------------------------------------------------
    def _commit(self, key: Sequence[Hashable], path: list[Node], own: PageMap, ckpt: PageMap,
                chunk_checkpoint: bool, anchored: int, base: list[Node] | None = None) -> InsertResult:
        """Publish along ``path``. ``base`` (from :meth:`insert_trusted`): the anchor's
        path, deepest first, whose ``anchored`` units ``own`` starts with; ``path`` then
        holds only the nodes beyond it, and the anchor path is not stamped (the caller's
        lock moves right after, which stamps it)."""
        store = self.store
        ppu = store.pages_per_unit
        hist = store.history_groups
        duplicates: PageMap = {}
        kept: PageMap = {}
        created: list[Node] = []
        store.clock += 1  # (tick)
        stamp = store.clock
        last: Node = store.root if base is None else base[0]
        done = 0 if base is None else anchored
        stopped = False
        through = 0  # nodes of path published through
        for n in path:
            lo, hi = done, n.depth
            if n.state in (NS.loading, NS.fetching):  # not readable by everyone yet
                stopped = True
                break
            if hi <= anchored:  # the caller's canonical pages (checked by _anchored)
                n.last_access = stamp  # (a use raises a node's keys: the index re-files it lazily)
                last = n
                done = hi
                continue
            for g in hist:
                mine = own[g][lo * ppu[g]:hi * ppu[g]]
                if n.state == NS.host:
                    n.dev[g] = mine
                    store.ledger.take_back(g, mine)
                else:
                    dup = [p for p, c in zip(mine, n.dev[g]) if p != c]
                    if dup:
                        duplicates.setdefault(g, []).extend(dup)
            if n.state == NS.host:
                store.trigger(n, EV.republish)
            n.last_access = stamp
            last = n
            done = hi
            through += 1
        units = len(key)
        if not stopped and done < units:
            turns = self._turns(last)
            for n in path:  # the conversation's turn on its whole path (keys only grow)
                n.turns = max(n.turns, turns)
            if base is not None:
                for n in base:
                    if n.turns < turns:
                        n.turns = turns
            node = store.tree.new_leaf(last, tuple(key[done:]))
            node.turns = turns
            for g in hist:
                mine = own[g][done * ppu[g]:]
                node.dev[g] = mine
                store.ledger.take_back(g, mine)
            node.last_access = stamp
            store.trigger(node, EV.create)
            store.tree.link(node)
            created.append(node)
            last = node
            done = units
            if store.writebacks.enabled:
                store.writebacks.on_created(node)
        if done < units:
            for g in hist:
                # only the caller's own pages: canonical pages of a loading node stay the tree's
                rest = [p for p in own[g][done * ppu[g]:] if store.ledger.held_by_caller(g, p)]
                if rest:
                    kept[g] = rest
        if ckpt:
            if done == units and last is not store.root:
                self._adopt_checkpoint(last, ckpt, duplicates, chunk_checkpoint)
            else:
                for g, p in ckpt.items():
                    kept.setdefault(g, []).extend(p)
        if base is None:
            full = store.tree.page_table(last, hist)
            pages = {g: full[g] for g in hist}
        else:  # the anchor path's pages (own's head), then the canonical pages walked through
            beyond = path[:through] + created
            pages = {}
            for g in hist:
                table = own[g][:anchored * ppu[g]]
                for n in beyond:
                    table.extend(n.dev.get(g, ()))
                pages[g] = table
        return InsertResult(last, done, pages, duplicates, kept, tuple(created))

    @staticmethod
    def _turns(last: Node) -> int:
        """The turn of a request publishing new units below ``last``: ``last``'s + 1 when
        ``last`` is a leaf another request used too (the request extends that conversation),
        ``last``'s when only one request used it (this request's own earlier chunk), else 1
        (a branch off a shared prefix, or the root)."""
        if last.parent is None or last.children:
            return 1
        return last.turns + 1 if last.hit_count >= 2 else last.turns

    def _adopt_checkpoint(self, node: Node, ckpt: PageMap, duplicates: PageMap, chunk: bool) -> None:
        store = self.store
        if has_checkpoint(node.dev_ckpt, len(store.ckpt_groups)):
            for g, p in ckpt.items():
                if node.dev_ckpt[g] != p:
                    duplicates.setdefault(g, []).extend(x for x in p if x not in node.dev_ckpt[g])
            if not chunk:
                node.chunk_checkpoint = False
            return
        for g, p in ckpt.items():
            node.dev_ckpt[g] = list(p)
            store.ledger.take_back(g, p)
        node.chunk_checkpoint = chunk
        # ancestors' chunk checkpoints are no longer needed by this prefix; never one whose
        # writeback is in flight (invariant ``writeback_source_immutable``)
        for a in node.path()[1:]:
            if (a.chunk_checkpoint and a.state in (NS.device, NS.backed) and a.lock_ref <= 1
                    and a.borrow_ref == 0 and a.dev_ckpt):
                self.drop_device_checkpoint(a)

    def drop_device_checkpoint(self, node: Node) -> None:
        """Free ``node``'s device checkpoint (a chunk checkpoint a deeper one replaced)."""
        self.store.ledger.release_device(node.dev_ckpt)
        node.dev_ckpt = {}
        node.chunk_checkpoint = False
