"""``check_invariants()`` of the node core: every invariant of the spec that can be read
off the core's state (its :class:`~kvtier.fsm.node.store.NodeStore`), by name
(spec/lifecycle.toml ``[invariants]``).

It reads the store only through its parts' public views. Its cost grows with the nodes,
receipts, operations and pages in use, never with a pool's capacity.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvariantViolation
from ..lifecycle.names import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE, NODE_STATE as NS
from .node import Node
from .ops import Operation
from .pages import PageAllocator
from ..records import Direction
from ..lifecycle.spec import load_spec
from .store import NodeStore

__all__ = ["check_cache"]

_NODE = load_spec().node

#: resource (spec ``[node.resources]``) -> (does the node hold it?, invariant broken when
#: it holds it without its state declaring it, invariant broken when it lacks a declared one)
_HOLDS: dict[str, tuple[Callable[[Node], bool], str, str]] = {
    "device_pages": (lambda n: bool(n.dev), "state_matches_resources", "state_matches_resources"),
    "host_pages": (lambda n: bool(n.host), "host_means_acked", "state_matches_resources"),
    "pending_host": (lambda n: bool(n.pending), "state_matches_resources", "state_matches_resources"),
    "writeback_op": (lambda n: n.wb_op is not None, "operation_ends_once", "writeback_source_immutable"),
    "loadback_op": (lambda n: n.lb_op is not None, "operation_ends_once", "loadback_source_pinned"),
    "fetch_op": (lambda n: n.fetch_op is not None, "l3_get_invisible", "l3_get_invisible"),
    "host_pin": (lambda n: n.host_pin > 0, "loadback_source_pinned", "loadback_source_pinned"),
}
#: a resource a state may hold without declaring it: pins on any visible host copy
#: (requests waiting to load it), the device-read flag (not a field)
_OPTIONAL = {"host_pin": "host_pages", "shared_read": None}


def _fail(invariant: str, node: Node | None, detail: str) -> InvariantViolation:
    subject = f"node {node.node_id} ({node.state})" if node is not None else "the cache"
    return InvariantViolation(invariant, subject, detail)


def _check_declared_resources(n: Node) -> None:
    """Each resource of the spec's vocabulary is held exactly when the node's state declares it."""
    declared = _NODE.state(n.state).resources
    for res, (holds, extra_inv, missing_inv) in _HOLDS.items():
        held = holds(n)
        if held and res not in declared and not (res in _OPTIONAL and _OPTIONAL[res] in declared):
            raise _fail(extra_inv, n, f"holds {res} but state {n.state!r} declares {list(declared)}")
        if not held and res in declared:
            raise _fail(missing_inv, n, f"state {n.state!r} declares {res} but the node has none")


def _check_node(store: NodeStore, n: Node, sizes: dict[str, int]) -> None:
    _check_declared_resources(n)
    units = len(n.key)
    for attr in ("dev", "host", "pending"):
        pm = getattr(n, attr)
        if pm:
            for g in store.history_groups:
                if len(pm.get(g, ())) != units * store.pages_per_unit[g]:
                    raise _fail("state_matches_resources", n,
                                f"{attr} pages of {g!r}: {len(pm.get(g, ()))} for {units} units")
    if n.dev_ckpt and n.state not in DEVICE_RESIDENT:
        raise _fail("state_matches_resources", n, "a device checkpoint without device pages")
    if n.host_ckpt and n.state not in HOST_VISIBLE:
        raise _fail("host_means_acked", n, "a host checkpoint without a visible host copy")
    if n.pending_ckpt and n.state not in HOST_PENDING:
        raise _fail("host_means_acked", n, "a pending checkpoint outside a writeback")
    for attr in ("dev_ckpt", "host_ckpt", "pending_ckpt"):
        pm = getattr(n, attr)
        if pm and set(pm) != set(store.ckpt_groups):
            raise _fail("exact_continuation_state", n, f"{attr} covers {sorted(pm)}, not every state group")
        for g, pages in pm.items():
            if len(pages) != sizes.get(g, -1):
                raise _fail("exact_continuation_state", n, f"{attr} of {g!r} has {len(pages)} pages")
    for op_id, kind in ((n.wb_op, "writeback"), (n.lb_op, "loadback")):
        if op_id is not None and op_id not in store.optable:
            raise _fail("writeback_source_immutable" if kind == "writeback" else "loadback_source_pinned",
                        n, f"its {kind} op {op_id} is not in flight")
    if n.borrow_ref and n.state not in DEVICE_RESIDENT:
        raise _fail("borrowed_pages_stay", n, f"borrowed by {n.borrow_ref} but has no device pages")


def _walk(store: NodeStore) -> dict[int, Node]:
    seen: dict[int, Node] = {}
    stack = [store.root]
    while stack:
        p = stack.pop()
        for key, c in p.children.items():
            # identity first, as the children dict and the tree's walk compare (a NaN key)
            if c.parent is not p or not c.key or (c.key[0] is not key and c.key[0] != key):
                raise _fail("split_preserves_ownership", c, "tree links are inconsistent")
            if c.depth != p.depth + len(c.key):
                raise _fail("split_preserves_ownership", c, f"depth {c.depth} != {p.depth} + {len(c.key)}")
            seen[c.node_id] = c
            stack.append(c)
    if set(seen) != store.tree.ids():
        raise _fail("split_preserves_ownership", None,
                    f"tree and node index disagree: {sorted(set(seen) ^ store.tree.ids())}")
    return seen


def _count_receipts(store: NodeStore, seen: dict[int, Node]) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    locks: dict[int, int] = {}
    for r in store.receipts.locks():
        if r.node.node_id not in seen:
            raise _fail("counts_with_receipts", r.node, f"{r!r} holds a node that left the tree")
        for n in r.node.path():
            locks[n.node_id] = locks.get(n.node_id, 0) + 1
    pins: dict[int, int] = {}
    borrows: dict[int, int] = {}
    for rec in store.receipts.node_receipts():
        target = pins if rec.kind == "pin" else borrows
        for n in rec.nodes:
            target[n.node_id] = target.get(n.node_id, 0) + 1
            if n.node_id not in seen:
                raise _fail("borrowed_pages_stay" if rec.kind == "borrow" else "counts_with_receipts", n,
                            f"{rec!r} holds a node that left the tree")
    return locks, pins, borrows


def _check_ops(store: NodeStore, seen: dict[int, Node]) -> None:
    for n in seen.values():
        for op_id in (n.wb_op, n.lb_op):
            op = store.optable.get(op_id) if op_id is not None else None
            if op is not None and n not in op.nodes:
                raise _fail("split_preserves_ownership", n, f"claims op {op_id}, which does not list it")
    for op in store.optable:
        for n in op.nodes:
            if n.node_id not in seen:
                raise _fail("operation_ends_once", n, f"op {op.op_id} holds a node that left the tree")
            if op.direction is Direction.LOADBACK:
                if n.state != NS.loading or n.lb_op != op.op_id:
                    raise _fail("operation_ends_once", n, f"in loadback op {op.op_id} but not loading it")
            elif n.state != NS.writing or n.wb_op != op.op_id:
                raise _fail("operation_ends_once", n, f"in writeback op {op.op_id} but not writing it")
        if op.direction is Direction.LOADBACK:
            try:
                pin_nodes = store.receipts.get(-op.op_id).nodes
            except KeyError:
                pin_nodes = []
            if pin_nodes != op.nodes:
                raise _fail("loadback_source_pinned", op.nodes[0] if op.nodes else None,
                            f"loadback op {op.op_id} does not pin exactly its nodes")
        _check_op_sources(op)


def check_cache(store: NodeStore) -> None:
    """Raise :class:`InvariantViolation` for the first invariant that does not hold."""
    seen = _walk(store)
    locks, pins, borrows = _count_receipts(store, seen)
    _check_ops(store, seen)
    sizes = {g.name: g.state_pages for g in store.layout.state_groups}  # checkpoint pages per state group
    for n in seen.values():
        _check_node(store, n, sizes)
        if n.lock_ref < 0 or n.borrow_ref < 0 or n.host_pin < 0:
            raise _fail("counts_with_receipts", n, "a negative count")
        for what, have, want in (("lock", n.lock_ref, locks), ("pin", n.host_pin, pins),
                                 ("borrow", n.borrow_ref, borrows)):
            if have != want.get(n.node_id, 0):
                raise _fail("counts_with_receipts", n, f"{what} count {have} but {want.get(n.node_id, 0)} receipts")
        up = n.parent
        assert up is not None
        if (n.state in HOST_VISIBLE or n.state in HOST_PENDING) and up.parent is not None:
            ok = up.state in HOST_VISIBLE or (up.state in HOST_PENDING and n.state in HOST_PENDING
                                              and up.wb_op == n.wb_op)
            if not ok:
                raise _fail("root_closed_host", n, f"parent {up.node_id} is {up.state}")
        if n.state in DEVICE_RESIDENT and up.parent is not None and up.state not in DEVICE_RESIDENT:
            raise _fail("state_matches_resources", n, f"device set not root-closed: on device under parent {up.node_id} in {up.state}")
        if n.state in DEVICE_READABLE and up.parent is not None and up.state not in DEVICE_READABLE:
            raise _fail("state_matches_resources", n, f"readable under unreadable parent {up.node_id} in {up.state}")
    _check_fences(store, seen)
    _check_conservation(store, seen)


def _check_fences(store: NodeStore, seen: dict[int, Node]) -> None:
    """Invariant ``copy_fence``: a fenced operation (past its deadline, its copy may still
    run) holds exactly its command's destination pages, and its own pin (a loadback) or
    borrow (a writeback) still holds every source page on nodes of the tree."""
    for op in store.optable.fenced():
        first = op.nodes[0] if op.nodes else None
        if op.state != "fenced" or op.op_id in store.optable:
            raise _fail("copy_fence", first, f"op {op.op_id} is fenced but in state {op.state!r}")
        writeback = op.direction is Direction.WRITEBACK
        try:
            hold = store.receipts.get(-op.op_id)
        except KeyError:
            raise _fail("copy_fence", first, f"fenced op {op.op_id}: nothing holds its source pages") from None
        if hold.kind != ("borrow" if writeback else "pin"):
            raise _fail("copy_fence", first, f"fenced op {op.op_id}: its source is held by a {hold.kind}")
        have: dict[str, set[int]] = {}
        for n in hold.nodes:
            if n.node_id not in seen:
                raise _fail("copy_fence", n, f"fenced op {op.op_id} holds a node that left the tree")
            for pm in ((n.dev, n.dev_ckpt) if writeback else (n.host, n.host_ckpt)):
                for g, pages in pm.items():
                    have.setdefault(g, set()).update(pages)
        kept = op.fenced_host if writeback else op.fenced_dev
        other = op.fenced_dev if writeback else op.fenced_host
        if any(other.values()):
            raise _fail("copy_fence", first, f"fenced op {op.op_id} holds pages it never wrote")
        for t in op.command.transfers:
            if not set(t.src_pages) <= have.get(t.group, set()):
                raise _fail("copy_fence", first, f"fenced op {op.op_id}: source pages of {t.group!r} "
                                                 "were let go while its copy may still read them")
            if sorted(kept.get(t.group, ())) != sorted(t.dst_pages):
                raise _fail("copy_fence", first, f"fenced op {op.op_id}: destination pages of {t.group!r} "
                                                 "left the fence while its copy may still write them")


def _check_op_sources(op: Operation) -> None:
    """Every page an operation copies from is still one of its nodes' pages: device
    pages of a writeback (invariant ``writeback_source_immutable``), host pages of a
    loadback (invariant ``loadback_source_pinned``). (A node may gain pages meanwhile,
    e.g. a checkpoint adopted while it is written back.)"""
    writeback = op.direction is Direction.WRITEBACK
    have: dict[str, set[int]] = {}
    for n in op.nodes:
        for pm in ((n.dev, n.dev_ckpt) if writeback else (n.host,)):
            for g, pages in pm.items():
                have.setdefault(g, set()).update(pages)
    if not writeback and op.checkpoint is not None:
        for g, pages in op.checkpoint.host_ckpt.items():
            have.setdefault(g, set()).update(pages)
    for t in op.command.transfers:
        if not set(t.src_pages) <= have.get(t.group, set()):
            raise _fail("writeback_source_immutable" if writeback else "loadback_source_pinned",
                        op.nodes[0] if op.nodes else None,
                        f"op {op.op_id} copies pages of {t.group!r} its nodes no longer hold")


def _check_conservation(store: NodeStore, nodes: dict[int, Node]) -> None:
    """Every allocated page has exactly one owner (a node, a caller or a fence) and every owned page
    is allocated: O(pages in use), never O(capacity)."""
    pools: list[tuple[str, dict[str, PageAllocator], tuple[str, ...]]] = [
        ("device", store.device, ("dev", "dev_ckpt"))]
    if store.host is not None:
        pools.append(("host", store.host, ("host", "host_ckpt", "pending", "pending_ckpt")))
    for pool, allocs, attrs in pools:
        for g, alloc in allocs.items():
            owner: dict[int, str] = {}
            for n in nodes.values():
                for attr in attrs:
                    for p in getattr(n, attr).get(g, ()):
                        if p in owner:
                            raise _fail("conservation", n, f"{pool} page {p} of {g!r} also owned by {owner[p]}")
                        owner[p] = f"node {n.node_id}"
            for op in store.optable.fenced():  # a fence owns its destination pages (copy_fence)
                for p in (op.fenced_dev if pool == "device" else op.fenced_host).get(g, ()):
                    if p in owner:
                        raise _fail("copy_fence", None, f"{pool} page {p} of {g!r} is fenced for op {op.op_id} "
                                                        f"but also owned by {owner[p]}")
                    owner[p] = f"fenced op {op.op_id}"
            callers = store.ledger.caller_pages(g) if pool == "device" else frozenset()
            clash = sorted(callers & owner.keys())
            if clash:
                raise _fail("conservation", None, f"device page {clash[0]} of {g!r}: caller and {owner[clash[0]]}")
            owned = owner.keys() | callers
            free = sorted(p for p in owned if alloc.is_free(p))
            fenced_free = [p for p in free if owner.get(p, "").startswith("fenced op")]
            if fenced_free:
                raise _fail("copy_fence", None, f"{pool} page {fenced_free[0]} of {g!r} is free but "
                                                f"{owner[fenced_free[0]]}'s copy may still write it")
            if free:
                raise _fail("conservation", None, f"{pool} pages {free[:5]} of {g!r} free and owned")
            if len(owned) != alloc.used:
                raise _fail("conservation", None, f"{pool} pool of {g!r}: {alloc.used} pages allocated "
                                                  f"but {len(owned)} owned")
