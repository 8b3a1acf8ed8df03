"""The radix tree of cache units: walk, split, add and remove nodes (structure only).

The tree knows keys, parents, children and each node's page lists; it fires no
lifecycle event and owns no allocator. The core (:mod:`kvtier.fsm.node.core`) fires the
``split`` event and tells the other parts (receipts, operations, writeback queue) about
a split; the tree only cuts the node and its page lists.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence

from ..errors import UsageError
from ..lifecycle.names import NODE_STATE
from .node import Node, PageMap

__all__ = ["RadixTree"]

#: Per-node attributes a split copies to the new prefix fragment unchanged.
_SHARED = ("lock_ref", "borrow_ref", "host_pin", "hit_count", "last_owner", "turns", "last_access", "prev_use",
           "wb_op", "lb_op", "fetch_op", "reloaded")


class RadixTree:
    """Nodes keyed by unit keys from a root; each node's pages per history group.

    Args:
        pages_per_unit: history group -> pages per cache unit (how a split cuts page lists).
        ids: the id counter shared with the receipts (node ids are never reused).
    """

    def __init__(self, pages_per_unit: Mapping[str, int], ids: Iterator[int]) -> None:
        self._ppu = dict(pages_per_unit)
        self._ids = ids
        self.root = Node(0, (), None)
        self.root.state = NODE_STATE.root
        self._nodes: dict[int, Node] = {}

    # -- lookups ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def has(self, node: Node) -> bool:
        """Whether ``node`` (this very object) is a node of the tree (the root is not)."""
        return self._nodes.get(node.node_id) is node

    def node(self, node_id: int) -> Node:
        """The node with ``node_id``.

        Raises:
            UsageError: no such node in the tree.
        """
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UsageError(f"no node {node_id} in the tree") from None

    def ids(self) -> frozenset[int]:
        """The ids of every node (root excluded)."""
        return frozenset(self._nodes)

    def members(self, what: str, nodes: Iterable[object]) -> list[Node]:
        """``nodes`` as a list, each checked to be a node of this tree (not the root).

        Raises:
            UsageError: not a list of nodes, an empty list, or a value that is not a node
                of this tree (``what`` names the call).
        """
        if type(nodes) is not list and (isinstance(nodes, Node) or not isinstance(nodes, Iterable)):
            raise UsageError(f"{what} takes a list of nodes, got {nodes!r}")
        out: list[Node] = []
        for n in nodes:
            if type(n) is not Node and not isinstance(n, Node) or self._nodes.get(n.node_id) is not n:
                raise UsageError(f"{what}: {n!r} is not a node of this cache's tree")
            out.append(n)
        if not out:
            raise UsageError(f"{what}: no nodes given")
        return out

    def page_table(self, node: Node, groups: Sequence[str]) -> PageMap:
        """The device page table from the root to ``node``'s end: ``groups``' (history)
        pages along the path, and each state group's checkpoint at ``node`` (if any)."""
        out: PageMap = {g: [] for g in groups}
        for n in reversed(node.path()):
            for g in groups:
                out[g].extend(n.dev.get(g, ()))
        for g, pages in node.dev_ckpt.items():
            out[g] = list(pages)
        return out

    # -- structure ----------------------------------------------------------------
    def walk(self, key: Sequence[Hashable], split: Callable[[Node, int], Node]) -> list[Node]:
        """Nodes matching ``key`` from the root, parent first. Where the key diverges inside
        a node, ``split(node, k)`` cuts it after ``k`` units and the prefix fragment ends
        the path."""
        return self.walk_from(self.root, key, split)

    def walk_from(self, start: Node, key: Sequence[Hashable], split: Callable[[Node, int], Node]) -> list[Node]:
        """Like :meth:`walk`, from ``start`` (a node whose path is ``key[:start.depth]``,
        which the caller vouches for) over ``key[start.depth:]``; ``start`` is not listed."""
        path: list[Node] = []
        node = start
        i = start.depth
        n = len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            ck = child.key
            limit = min(len(ck), n - i)
            # identity first, as the children dict does: a key not equal to itself (NaN)
            # still matches its own node, so lookups and comparisons agree (tuple
            # comparison does the same, element by element, in C: the common whole-node
            # match costs one comparison)
            if limit == len(ck) and ck == tuple(key[i:i + limit]):
                m = limit
            else:
                m = 1
                while m < limit and (ck[m] is key[i + m] or ck[m] == key[i + m]):
                    m += 1
            if m < len(ck):
                child = split(child, m)
            path.append(child)
            i += m
            node = child
            if m < len(ck):
                break
        return path

    def cut(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` units (``0 < k < len(node.key)``): a new prefix fragment
        takes the first ``k`` units and their pages, the same state and counts, and
        becomes ``node``'s parent. Returns the fragment."""
        assert 0 < k < len(node.key)
        parent = node.parent
        assert parent is not None
        prefix = Node(next(self._ids), node.key[:k], parent)
        prefix.state = node.state
        ppu = self._ppu
        for attr in ("dev", "host", "pending"):
            whole: PageMap = getattr(node, attr)
            if not whole:
                continue  # (the prefix's own map is already empty)
            head: PageMap = {}
            for g, pages in whole.items():
                cut = k * ppu[g]
                head[g] = pages[:cut]
                whole[g] = pages[cut:]
            setattr(prefix, attr, head)
        # the _SHARED attributes, one by one (a loop of getattr/setattr costs 3x)
        prefix.lock_ref, prefix.borrow_ref, prefix.host_pin = node.lock_ref, node.borrow_ref, node.host_pin
        prefix.hit_count, prefix.last_owner, prefix.turns = node.hit_count, node.last_owner, node.turns
        prefix.last_access, prefix.prev_use, prefix.wb_op = node.last_access, node.prev_use, node.wb_op
        prefix.lb_op, prefix.fetch_op, prefix.reloaded = node.lb_op, node.fetch_op, node.reloaded
        node.key = node.key[k:]
        parent.children[prefix.key[0]] = prefix
        prefix.children[node.key[0]] = node
        node.parent = prefix
        self._nodes[prefix.node_id] = prefix
        return prefix

    def new_leaf(self, parent: Node, key: tuple[Hashable, ...]) -> Node:
        """A new node under ``parent`` (state ``new``), not yet linked: :meth:`link` it
        after its ``create`` event."""
        return Node(next(self._ids), key, parent)

    def link(self, node: Node) -> None:
        """Hang a created node under its parent and index it."""
        assert node.parent is not None
        node.parent.children[node.key[0]] = node
        self._nodes[node.node_id] = node

    def unlink(self, node: Node) -> None:
        """Take a childless node out of the tree."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[0]]
        del self._nodes[node.node_id]
