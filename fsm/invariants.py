"""``check_invariants()`` of the tiered cache: every invariant of the spec that can be
read off the cache's state, by name (spec/lifecycle.toml ``[invariants]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InvariantViolation
from .pages import PageAllocator
from .node import DEVICE_READABLE, DEVICE_RESIDENT, HOST_VISIBLE, Node
from .ops import Operation
from .records import Direction

if TYPE_CHECKING:
    from .cache import TieredPrefixCache

__all__ = ["check_cache"]


def _fail(invariant: str, node: Node | None, detail: str) -> InvariantViolation:
    subject = f"node {node.node_id} ({node.state})" if node is not None else "the cache"
    return InvariantViolation(invariant, subject, detail)


def _check_node_resources(cache: TieredPrefixCache, n: Node) -> None:
    hist = cache._history
    ppu = cache._ppu
    units = len(n.key)
    has_dev = bool(n.dev)
    has_host = bool(n.host)
    has_pending = bool(n.pending)
    want_dev = n.state in DEVICE_RESIDENT
    want_host = n.state in HOST_VISIBLE
    want_pending = n.state == "writing"
    if has_host and not want_host:
        raise _fail("host_means_acked", n, "visible host pages without an acknowledged writeback")
    if (has_dev, has_host, has_pending) != (want_dev, want_host, want_pending):
        raise _fail("state_matches_resources", n,
                    f"device pages {has_dev}, host pages {has_host}, pending reservation {has_pending}")
    for attr, present in (("dev", has_dev), ("host", has_host), ("pending", has_pending)):
        if present:
            pm = getattr(n, attr)
            for g in hist:
                if len(pm.get(g, ())) != units * ppu[g]:
                    raise _fail("state_matches_resources", n,
                                f"{attr} pages of {g!r}: {len(pm.get(g, ()))} for {units} units")
    if n.dev_state and not want_dev:
        raise _fail("state_matches_resources", n, "a device checkpoint without device pages")
    if n.host_state and not want_host:
        raise _fail("host_means_acked", n, "a host checkpoint without a visible host copy")
    if n.pending_state and not want_pending:
        raise _fail("host_means_acked", n, "a pending checkpoint outside a writeback")
    for attr in ("dev_state", "host_state", "pending_state"):
        pm = getattr(n, attr)
        if pm and set(pm) != set(cache._state):
            raise _fail("exact_continuation_state", n, f"{attr} covers {sorted(pm)}, not every state group")
        for g, pages in pm.items():
            if len(pages) != cache._state_pages[g]:
                raise _fail("exact_continuation_state", n, f"{attr} of {g!r} has {len(pages)} pages")
    ops = cache._ops
    if n.state == "writing":
        if n.wb_op is None or n.wb_op not in ops:
            raise _fail("writeback_source_immutable", n, "writing without a writeback in flight")
    elif n.wb_op is not None:
        raise _fail("operation_ends_once", n, f"stale writeback op {n.wb_op}")
    if n.state == "loading":
        if n.lb_op is None or n.lb_op not in ops:
            raise _fail("loadback_source_pinned", n, "loading without a loadback in flight")
        if n.host_pin < 1:
            raise _fail("loadback_source_pinned", n, "loading but the host copy is not pinned")
    elif n.lb_op is not None:
        raise _fail("operation_ends_once", n, f"stale loadback op {n.lb_op}")
    if n.host_pin and not want_host:
        raise _fail("loadback_source_pinned", n, "pinned without a host copy")
    if n.borrow_ref and not want_dev:
        raise _fail("borrowed_pages_stay", n, f"borrowed by {n.borrow_ref} but has no device pages")


def check_cache(cache: TieredPrefixCache) -> None:
    """Raise :class:`InvariantViolation` for the first invariant that does not hold."""
    root = cache.root
    seen: dict[int, Node] = {}
    stack = [root]
    while stack:
        p = stack.pop()
        for key, c in p.children.items():
            if c.parent is not p or not c.key or c.key[0] != key:
                raise _fail("split_preserves_ownership", c, "tree links are inconsistent")
            if c.depth != p.depth + len(c.key):
                raise _fail("split_preserves_ownership", c, f"depth {c.depth} != {p.depth} + {len(c.key)}")
            seen[c.node_id] = c
            stack.append(c)
    if set(seen) != set(cache._nodes):
        raise _fail("split_preserves_ownership", None,
                    f"tree and node index disagree: {sorted(set(seen) ^ set(cache._nodes))}")
    lock_count: dict[int, int] = {}
    for r in cache._locks.values():
        if r.node.node_id not in seen:
            raise _fail("counts_with_receipts", r.node, f"{r!r} holds a node that left the tree")
        for n in r.node.path():
            lock_count[n.node_id] = lock_count.get(n.node_id, 0) + 1
    pins: dict[int, int] = {}
    borrows: dict[int, int] = {}
    for rec in cache._receipts.values():
        target = pins if rec.kind == "pin" else borrows
        for n in rec.nodes:
            target[n.node_id] = target.get(n.node_id, 0) + 1
            if n.node_id not in seen:
                raise _fail("borrowed_pages_stay" if rec.kind == "borrow" else "counts_with_receipts", n,
                            f"{rec!r} holds a node that left the tree")
    for n in seen.values():
        for op_id in (n.wb_op, n.lb_op):
            if op_id is not None and op_id in cache._ops and n not in cache._ops[op_id].nodes:
                raise _fail("split_preserves_ownership", n, f"claims op {op_id}, which does not list it")
    for op in cache._ops.values():
        for n in op.nodes:
            if n.node_id not in seen:
                raise _fail("operation_ends_once", n, f"op {op.op_id} holds a node that left the tree")
            if op.direction is Direction.LOADBACK:
                pins[n.node_id] = pins.get(n.node_id, 0) + 1
                if n.state != "loading" or n.lb_op != op.op_id:
                    raise _fail("operation_ends_once", n, f"in loadback op {op.op_id} but not loading it")
            elif n.state != "writing" or n.wb_op != op.op_id:
                raise _fail("operation_ends_once", n, f"in writeback op {op.op_id} but not writing it")
        _check_op_sources(cache, op)
    for n in seen.values():
        _check_node_resources(cache, n)
        if n.lock_ref < 0 or n.borrow_ref < 0 or n.host_pin < 0:
            raise _fail("counts_with_receipts", n, "a negative count")
        if n.lock_ref != lock_count.get(n.node_id, 0):
            raise _fail("counts_with_receipts", n, f"lock count {n.lock_ref} but {lock_count.get(n.node_id, 0)} receipts")
        if n.host_pin != pins.get(n.node_id, 0):
            raise _fail("counts_with_receipts", n, f"pin count {n.host_pin} but {pins.get(n.node_id, 0)} receipts")
        if n.borrow_ref != borrows.get(n.node_id, 0):
            raise _fail("counts_with_receipts", n, f"borrow count {n.borrow_ref} but {borrows.get(n.node_id, 0)} receipts")
        up = n.parent
        assert up is not None
        if (n.state in HOST_VISIBLE or n.state == "writing") and up.parent is not None:
            ok = up.state in HOST_VISIBLE or (up.state == "writing" and n.state == "writing" and up.wb_op == n.wb_op)
            if not ok:
                raise _fail("root_closed_host", n, f"parent {up.node_id} is {up.state}")
        if n.state in DEVICE_RESIDENT and up.parent is not None and up.state not in DEVICE_RESIDENT:
            raise _fail("state_matches_resources", n, f"device set not root-closed: on device under parent {up.node_id} in {up.state}")
        if n.state in DEVICE_READABLE and up.parent is not None and up.state not in DEVICE_READABLE:
            raise _fail("state_matches_resources", n, f"readable under unreadable parent {up.node_id} in {up.state}")
    _check_conservation(cache, seen)


def _check_op_sources(cache: TieredPrefixCache, op: Operation) -> None:
    """Every page an operation copies from is still one of its nodes' pages: device
    pages of a writeback (invariant 3), host pages of a loadback (invariant 4). (A node
    may gain pages meanwhile, e.g. a checkpoint adopted while it is written back.)"""
    writeback = op.direction is Direction.WRITEBACK
    have: dict[str, list[int]] = {}
    for n in op.nodes:
        maps = (n.dev, n.dev_state) if writeback else (n.host,)
        for pm in maps:
            for g, pages in pm.items():
                have.setdefault(g, []).extend(pages)
    if not writeback and op.checkpoint is not None:
        for g, pages in op.checkpoint.host_state.items():
            have.setdefault(g, []).extend(pages)
    want = {t.group: sorted(t.src_pages) for t in op.command.transfers}
    got = {g: sorted(p) for g, p in have.items() if p}
    if any(not set(pages) <= set(got.get(g, ())) for g, pages in want.items()):
        raise _fail("writeback_source_immutable" if writeback else "loadback_source_pinned", op.nodes[0] if op.nodes else None,
                    f"op {op.op_id} copies from {want}, its nodes hold {got}")


def _check_conservation(cache: TieredPrefixCache, nodes: dict[int, Node]) -> None:
    pools: list[tuple[str, dict[str, PageAllocator], tuple[str, ...]]] = [
        ("device", cache.device, ("dev", "dev_state"))]
    if cache.host is not None:
        pools.append(("host", cache.host, ("host", "host_state", "pending", "pending_state")))
    for pool, allocs, attrs in pools:
        for g, alloc in allocs.items():
            owner: dict[int, str] = {}
            for n in nodes.values():
                for attr in attrs:
                    for p in getattr(n, attr).get(g, ()):
                        if p in owner:
                            raise _fail("conservation", n, f"{pool} page {p} of {g!r} also owned by {owner[p]}")
                        owner[p] = f"node {n.node_id}"
            callers = cache._external[g] if pool == "device" else set()
            clash = sorted(callers & owner.keys())
            if clash:
                raise _fail("conservation", None, f"device page {clash[0]} of {g!r}: caller and {owner[clash[0]]}")
            owned = owner.keys() | callers
            free = alloc.free_pages()
            both = free & owned
            if both:
                raise _fail("conservation", None, f"{pool} pages {sorted(both)[:5]} of {g!r} free and owned")
            if len(free) + len(owned) != alloc.capacity:
                raise _fail("conservation", None, f"{pool} pool of {g!r}: {len(free)} free + {len(owned)} owned "
                                                  f"!= capacity {alloc.capacity}")
