"""The corruptions of the kit (:mod:`kvtier.testing.corruptions` applies them): one way
each to break a live :class:`~kvtier.tiered.TieredCache` as one kind of bug would, the
invariant of the spec whose check must catch it, and a fragment of that check's message.

:data:`CORRUPTIONS` lists them in the order of the checks of ``fsm/node/invariants.py`` and
``fsm/request/fence.py``; a corruption raises :class:`NotApplicable` where the state has nothing
it needs.
"""


from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.fsm.node import Node
from kvtier.fsm.node.ops import Operation
from kvtier.fsm.records import Direction
from kvtier.fsm.lifecycle.spec import load_spec

from ..tiered import TieredCache
from . import _views as views

__all__ = ["Corruption", "CORRUPTIONS", "NotApplicable"]

T = TypeVar("T")

#: page and node ids no cache of the kit reaches
_FAR = 10**6


class NotApplicable(Exception):
    """The corruption needs something the cache's state does not have (nothing was checked)."""


@dataclass(frozen=True)
class Corruption:
    """One way to break a cache, and the invariant whose check must catch it.

    Attributes:
        name: what it breaks, in words.
        invariant: the spec's invariant name the raised InvariantViolation must carry.
        says: a fragment of the message of the check meant to catch it.
        spoil: ``(copy of the cache, variant)`` -> None: breaks the copy in place (the
            variant picks the node, request or operation); raises :class:`NotApplicable`.
    """

    name: str
    invariant: str
    says: str
    spoil: Callable[[TieredCache, int], None]


# -- what the corruptions pick -------------------------------------------------------------

def _nodes(c: TieredCache, states: tuple[str, ...] | None = None,
           test: Callable[[Node], bool] | None = None) -> list[Node]:
    return [n for _, n in sorted(views.nodes(c.core).items())
            if (states is None or n.state in states) and (test is None or test(n))]


def _pick(items: Sequence[T], v: int) -> T:
    if not items:
        raise NotApplicable()
    return items[v % len(items)]


def _node(c: TieredCache, v: int, states: tuple[str, ...] | None = None,
          test: Callable[[Node], bool] | None = None) -> Node:
    return _pick(_nodes(c, states, test), v)


def _req(c: TieredCache, v: int, test: Callable[[Any], bool]) -> Any:
    return _pick([r for _, r in sorted(views.requests(c).items()) if test(r)], v)


def _ops(c: TieredCache, direction: Direction | None = None) -> list[Operation]:
    return [op for _, op in sorted(views.ops(c.core).items()) if direction is None or op.direction is direction]


def _g(c: TieredCache) -> str:
    return views.history_groups(c.core)[0]


def _set(obj: Any, attr: str, value: Any) -> None:
    setattr(obj, attr, value)


def _ghost() -> Node:
    """A node of no tree."""
    return Node(_FAR, ("ghost",), None)


def _far(pages: list[int]) -> list[int]:
    """Page ids no pool of the kit hands out, as many as ``pages``."""
    return [_FAR + p for p in pages]


def _some_group(c: TieredCache) -> str:
    """A state group's name if the layout has one, else the first history group's."""
    groups = views.checkpoint_groups(c.core)
    return groups[0] if groups else _g(c)


def _readable(n: Node) -> bool:
    return n.state in ("device", "backed", "writing")


def _owns_nothing(c: TieredCache, r: Any) -> bool:
    return r.state in c.table.owns_nothing


def _host_node(c: TieredCache, v: int) -> Node:
    """A node in state ``host``: one there is, else a backed node (unborrowed, its device
    checkpoint dropped) moved there, consistently, by dropping its device pages."""
    hosts = _nodes(c, ("host",))
    if hosts:
        return _pick(hosts, v)
    n = _node(c, v, ("backed",), lambda n: not n.borrow_ref)
    n.dev, n.dev_ckpt, n.state = {}, {}, "host"
    return n


# -- the corruptions ------------------------------------------------------------------------

def _two_device_nodes(c: TieredCache, v: int) -> None:
    nodes = _nodes(c, ("device", "backed"), lambda n: bool(n.dev))
    if len(nodes) < 2:
        raise NotApplicable()
    g = _g(c)
    a, b = nodes[v % len(nodes)], nodes[(v + 1) % len(nodes)]
    b.dev[g] = [a.dev[g][0]] + b.dev[g][1:]


def _alloc_unowned(c: TieredCache, tier: str) -> None:
    pools = c.core.device if tier == "device" else c.core.host
    if not pools or not pools[_g(c)].free:
        raise NotApplicable()
    pools[_g(c)].alloc(1)


def _no_host_tier(c: TieredCache, v: int) -> None:
    """Drop the host tier of a copy whose host tier holds nothing (then it is a cache
    without one), and allocate a device page to nobody."""
    core = c.core
    if any(n.host or n.pending or n.host_ckpt or n.pending_ckpt for n in views.nodes(core).values()) or (
            core.host and any(a.used for a in core.host.values())) or views.ops(core):
        raise NotApplicable()
    core.host = None
    core.ledger.host = None
    _alloc_unowned(c, "device")


def _detach_leaf(c: TieredCache, v: int) -> None:
    n = _node(c, v, None, lambda n: not n.children)
    assert n.parent is not None
    for key, child in list(n.parent.children.items()):
        if child is n:
            del n.parent.children[key]


def _lock_ghost(c: TieredCache, v: int) -> None:
    receipt = c.core.lock(_node(c, v, ("device", "backed", "writing")), "corrupt")
    receipt.node = _ghost()


def _borrow_ghost(c: TieredCache, v: int) -> None:
    receipt = c.core.borrow([_node(c, v, ("device", "backed", "writing"))], "corrupt")
    receipt.nodes.append(_ghost())


def _claim_foreign_op(c: TieredCache, v: int) -> None:
    op = _pick(_ops(c), v)
    n = _node(c, v, None, lambda n: n not in op.nodes)
    if op.direction is Direction.WRITEBACK:
        n.wb_op = op.op_id
    else:
        n.lb_op = op.op_id


def _forget_op(c: TieredCache, v: int, direction: Direction) -> None:
    n = _pick(_pick(_ops(c, direction), v).nodes, v)
    if direction is Direction.WRITEBACK:
        n.wb_op = None
    else:
        n.lb_op = None


def _unpin_loadback(c: TieredCache, v: int) -> None:
    op = _pick(_ops(c, Direction.LOADBACK), v)
    pin = c.core.receipts.get(-op.op_id)
    pin.nodes = pin.nodes[:-1]


def _move_sources(c: TieredCache, v: int, direction: Direction) -> None:
    op = _pick(_ops(c, direction), v)
    attr = "dev" if direction is Direction.WRITEBACK else "host"
    n = _pick([n for n in op.nodes if getattr(n, attr)], v)
    setattr(n, attr, {g: _far(p) for g, p in getattr(n, attr).items()})


def _settle_writeback_op(c: TieredCache, v: int) -> None:
    n = _node(c, v, ("writing",), lambda n: n.wb_op is not None)
    op = c.core.optable.get(n.wb_op) if n.wb_op is not None else None
    if op is None:
        raise NotApplicable()
    c.core.optable.remove(op)


def _forget_settled_loadback(c: TieredCache, v: int) -> None:
    """A loadback leaves the table and its nodes forget it, but they stay loading."""
    op = _pick(_ops(c, Direction.LOADBACK), v)
    c.core.optable.remove(op)
    for n in op.nodes:
        n.lb_op = None


def _forget_settled_writeback(c: TieredCache, v: int) -> None:
    """A writeback leaves the table and its nodes forget it, but they stay writing."""
    op = _pick(_ops(c, Direction.WRITEBACK), v)
    c.core.optable.remove(op)
    for n in op.nodes:
        n.wb_op = None


def _ckpt_wrong_size(c: TieredCache, v: int) -> None:
    sizes = views.checkpoint_pages(c.core)
    if not sizes:
        raise NotApplicable()
    n = _node(c, v, ("device", "backed"))
    n.dev_ckpt = {g: list(range(_FAR, _FAR + k + 1)) for g, k in sizes.items()}


def _host_under_device_parent(c: TieredCache, v: int) -> None:
    """A host-visible node under a parent that loses its host copy (consistently: a
    backed parent becomes device, a host child of the root becomes device)."""
    loaded_ckpts = [op.checkpoint for op in _ops(c, Direction.LOADBACK)]

    def fits(p: Node) -> bool:
        return (not p.host_pin and p not in loaded_ckpts
                and any(ch.state in ("backed", "host", "loading") for ch in p.children.values())
                and (p.state == "backed" or (p.parent is c.core.root and not p.borrow_ref)))

    p = _node(c, v, ("backed", "host"), fits)
    if p.state == "host":
        p.dev = p.host
    p.host, p.host_ckpt, p.state = {}, {}, "device"


def _device_under_host_parent(c: TieredCache, v: int) -> None:
    """A device-resident node under a parent that loses its device pages (consistently:
    it becomes a host node, its host copy kept or its device pages moved to the host)."""
    def fits(p: Node) -> bool:
        return (not p.borrow_ref and (p.state == "backed" or p.parent is c.core.root)
                and any(ch.state in ("device", "backed", "writing", "loading") for ch in p.children.values()))

    p = _node(c, v, ("backed", "device"), fits)
    if p.state == "device":
        p.host = p.dev
    p.dev, p.dev_ckpt, p.state = {}, {}, "host"


def _readable_under_loading(c: TieredCache, v: int) -> None:
    """A host child of a loading node reads as backed (device pages of its own)."""
    child = _pick([ch for p in _nodes(c, ("loading",)) for ch in sorted(p.children.values(), key=lambda n: n.node_id)
                   if ch.state == "host"], v)
    child.dev, child.state = {g: _far(p) for g, p in child.host.items()}, "backed"


def _caller_page_in_node(c: TieredCache, v: int) -> None:
    g = _g(c)
    callers = sorted(c.core.external_pages(g))
    if not callers:
        raise NotApplicable()
    n = _node(c, v, ("device", "backed"), lambda n: bool(n.dev.get(g)))
    n.dev[g] = [callers[v % len(callers)]] + n.dev[g][1:]


def _page_held_twice(c: TieredCache, v: int) -> None:
    g = _g(c)
    r = _req(c, v, lambda r: bool(r.own.get(g)) and not _owns_nothing(c, r))
    r.own[g].append(r.own[g][0])


def _caller_page_held_by_nobody(c: TieredCache, v: int) -> None:
    if not c.core.device[_g(c)].free:
        raise NotApplicable()
    c.core.alloc_device({_g(c): 1}, evict=False)


def _unsettled(c: TieredCache, r: Any) -> bool:
    return not r.settled and not _owns_nothing(c, r)


def _ckpt_without_borrow(c: TieredCache, v: int) -> None:
    r = _req(c, v, lambda r: _unsettled(c, r))
    r.ckpt_pages, r.ckpt_borrow = {_some_group(c): [0]}, None


def _ckpt_left_borrowed_node(c: TieredCache, v: int) -> None:
    r = _req(c, v, lambda r: _unsettled(c, r))
    n = _node(c, v, ("device", "backed", "writing"))
    r.ckpt_borrow = c.core.borrow([n], r.request_id)
    r.ckpt_pages = {_g(c): [_FAR]}


def _canon_moved(c: TieredCache, v: int) -> None:
    r = _req(c, v, lambda r: _unsettled(c, r) and r.lock is not None and any(r.canon.values()))
    g = next(g for g, p in sorted(r.canon.items()) if p)
    r.canon[g] = _far(r.canon[g])


def _bump(obj: Any, attr: str, by: int = 1) -> None:
    setattr(obj, attr, getattr(obj, attr) + by)


_READABLE = ("device", "backed", "writing")
_INV = load_spec().invariants

#: one corruption per raising check of fsm/node/invariants.py and fsm/request/fence.py, and per resource
#: pair of the node resource check (see the module docstring); every one must be caught as
#: its ``invariant``
CORRUPTIONS: list[Corruption] = [
    # the tree (invariants._walk)
    Corruption("a node whose parent link points elsewhere", "split_preserves_ownership", "tree links are inconsistent",
               lambda c, v: _set(_node(c, v), "parent", _ghost())),
    Corruption("a node at the wrong depth", "split_preserves_ownership", "depth",
               lambda c, v: _bump(_node(c, v), "depth")),
    Corruption("a leaf cut from its parent but still indexed", "split_preserves_ownership",
               "tree and node index disagree", _detach_leaf),
    # receipts (invariants._count_receipts)
    Corruption("a lock receipt on a node that left the tree", "counts_with_receipts", "holds a node that left the tree",
               _lock_ghost),
    Corruption("a borrow receipt on a node that left the tree", "borrowed_pages_stay",
               "holds a node that left the tree", _borrow_ghost),
    # operations (invariants._check_ops, _check_op_sources)
    Corruption("a node claiming an operation that does not list it", "split_preserves_ownership",
               "which does not list it", _claim_foreign_op),
    Corruption("an operation on a node that left the tree", "operation_ends_once", "holds a node that left the tree",
               lambda c, v: _pick(_ops(c), v).nodes.append(_ghost())),
    Corruption("a loading node that forgot its loadback", "operation_ends_once", "but not loading it",
               lambda c, v: _forget_op(c, v, Direction.LOADBACK)),
    Corruption("a writing node that forgot its writeback", "operation_ends_once", "but not writing it",
               lambda c, v: _forget_op(c, v, Direction.WRITEBACK)),
    Corruption("a loadback whose pin lost a node", "loadback_source_pinned", "does not pin exactly its nodes",
               _unpin_loadback),
    Corruption("a writeback whose source pages moved", "writeback_source_immutable", "copies pages of",
               lambda c, v: _move_sources(c, v, Direction.WRITEBACK)),
    Corruption("a loadback whose source pages moved", "loadback_source_pinned", "copies pages of",
               lambda c, v: _move_sources(c, v, Direction.LOADBACK)),
    # one node (invariants._check_declared_resources, _check_node)
    Corruption("a device node claiming a writeback op", "operation_ends_once", "holds writeback_op but state",
               lambda c, v: _set(_node(c, v, ("device", "backed")), "wb_op", _FAR)),
    Corruption("a device node in a host state", "state_matches_resources", "holds device_pages but state",
               lambda c, v: _set(_node(c, v, ("device",)), "state", "host")),
    Corruption("a backed node in the host state", "state_matches_resources", "holds device_pages but state",
               lambda c, v: _set(_node(c, v, ("backed",)), "state", "host")),
    Corruption("a host copy without its host pages", "state_matches_resources",
               "declares host_pages but the node has none",
               lambda c, v: _set(_node(c, v, ("backed", "host"), lambda n: bool(n.host)), "host", {})),
    Corruption("a device node with pending host pages", "state_matches_resources", "holds pending_host but state",
               lambda c, v: _set(_node(c, v, ("device",)), "pending", {_g(c): [_FAR]})),
    Corruption("a writing node without its pending host pages", "state_matches_resources",
               "declares pending_host but the node has none",
               lambda c, v: _set(_node(c, v, ("writing",), lambda n: bool(n.pending)), "pending", {})),
    Corruption("loading nodes whose loadback left and was forgotten", "loadback_source_pinned",
               "declares loadback_op but the node has none", _forget_settled_loadback),
    Corruption("a device node with host pages", "host_means_acked", "holds host_pages but state",
               lambda c, v: _set(_node(c, v, ("device",)), "host", {_g(c): [_FAR]})),
    Corruption("writing nodes whose writeback left and was forgotten", "writeback_source_immutable",
               "declares writeback_op but the node has none", _forget_settled_writeback),
    Corruption("a device node claiming a loadback op", "operation_ends_once", "holds loadback_op but state",
               lambda c, v: _set(_node(c, v, ("device", "backed")), "lb_op", _FAR)),
    Corruption("a pin on a node without a visible host copy", "loadback_source_pinned", "holds host_pin but state",
               lambda c, v: _bump(_node(c, v, ("device", "writing")), "host_pin")),
    Corruption("a loading node without its pin", "loadback_source_pinned", "declares host_pin but the node has none",
               lambda c, v: _set(_node(c, v, ("loading",)), "host_pin", 0)),
    Corruption("a device node claiming an L3 get", "l3_get_invisible", "holds fetch_op but state",
               lambda c, v: _set(_node(c, v, ("device", "backed")), "fetch_op", _FAR)),
    Corruption("a device node without its device pages", "state_matches_resources",
               "declares device_pages but the node has none", lambda c, v: _set(_node(c, v, ("device", "backed")),
                                                                               "dev", {})),
    Corruption("a page missing from a node", "state_matches_resources", "units",
               lambda c, v: (n := _node(c, v, ("device", "backed"), lambda n: bool(n.dev.get(_g(c)))))
               .dev.__setitem__(_g(c), n.dev[_g(c)][:-1])),
    Corruption("a device checkpoint on a host node", "state_matches_resources", "a device checkpoint without device",
               lambda c, v: _set(_host_node(c, v), "dev_ckpt", {_some_group(c): [0]})),
    Corruption("a host checkpoint on a device node", "host_means_acked", "a host checkpoint without a visible host",
               lambda c, v: _set(_node(c, v, ("device",)), "host_ckpt", {_some_group(c): [0]})),
    Corruption("a pending checkpoint outside a writeback", "host_means_acked", "a pending checkpoint outside",
               lambda c, v: _set(_node(c, v, ("device",)), "pending_ckpt", {_some_group(c): [0]})),
    Corruption("a checkpoint of a group that is no state group", "exact_continuation_state", "not every state group",
               lambda c, v: _set(_node(c, v, ("device", "backed")), "dev_ckpt", {"nogroup": [0]})),
    Corruption("a checkpoint of the wrong size", "exact_continuation_state", "dev_ckpt of", _ckpt_wrong_size),
    Corruption("a writing node whose writeback settled", "writeback_source_immutable", "is not in flight",
               _settle_writeback_op),
    Corruption("a borrowed node without device pages", "borrowed_pages_stay", "borrowed by",
               lambda c, v: _bump(_host_node(c, v), "borrow_ref")),
    # counts and the shape of the tree (invariants.check_cache)
    Corruption("a negative pin count", "counts_with_receipts", "a negative count",
               lambda c, v: _set(_node(c, v, ("host", "backed")), "host_pin", -1)),
    Corruption("a lock count without a receipt", "counts_with_receipts", "lock count",
               lambda c, v: _bump(_node(c, v, _READABLE), "lock_ref")),
    Corruption("a borrow count without a receipt", "counts_with_receipts", "borrow count",
               lambda c, v: _bump(_node(c, v, ("device", "backed")), "borrow_ref")),
    Corruption("a host copy under a parent without one", "root_closed_host", "parent", _host_under_device_parent),
    Corruption("device pages under a parent without them", "state_matches_resources", "device set not root-closed",
               _device_under_host_parent),
    Corruption("a readable node under a loading parent", "state_matches_resources", "readable under unreadable",
               _readable_under_loading),
    # pages (invariants._check_conservation)
    Corruption("a page owned by two nodes", "conservation", "also owned by", _two_device_nodes),
    Corruption("a caller's page in a node", "conservation", "caller and", _caller_page_in_node),
    Corruption("an owned page freed", "conservation", "free and owned", lambda c, v: c.core.device[_g(c)].release(
        [_node(c, v, ("device", "backed"), lambda n: bool(n.dev.get(_g(c)))).dev[_g(c)][0]])),
    Corruption("a page allocated to nobody", "conservation", "pages allocated",
               lambda c, v: _alloc_unowned(c, "device")),
    Corruption("a host page allocated to nobody", "conservation", "pages allocated",
               lambda c, v: _alloc_unowned(c, "host")),
    Corruption("a device page allocated to nobody, without a host tier", "conservation", "pages allocated",
               _no_host_tier),
    # requests (fence.check_requests, fence._check_fenced)
    Corruption("a request page nobody allocated", "conservation", "is not held by a caller",
               lambda c, v: _req(c, v, lambda r: bool(r.own.get(_g(c)))).own[_g(c)].append(_FAR)),
    Corruption("a page a request holds twice", "conservation", "also held by", _page_held_twice),
    Corruption("an ended request still holding pages", "release_once_after_fence", "but still holds pages",
               lambda c, v: _set(_req(c, v, lambda r: r.state == "running" and r.settled and bool(r.own.get(_g(c)))),
                                 "state", "finished")),
    Corruption("a request that owns nothing but owes an operation", "forward_fence", "but owes",
               lambda c, v: _req(c, v, lambda r: _owns_nothing(c, r) and r.settled).ops.add(_FAR)),
    Corruption("a caller page no request holds", "conservation", "caller pages in the core",
               _caller_page_held_by_nobody),
    Corruption("canonical pages read without a lock", "forward_fence", "without a live lock",
               lambda c, v: _set(_req(c, v, lambda r: _unsettled(c, r) and r.lock is not None
                                         and any(r.canon.values())), "lock", None)),
    Corruption("canonical pages that left the locked path", "forward_fence", "no longer its locked path",
               _canon_moved),
    Corruption("a checkpoint copied without its borrow", "forward_fence", "no longer borrows", _ckpt_without_borrow),
    Corruption("a checkpoint copied from where it no longer is", "forward_fence", "left the borrowed node",
               _ckpt_left_borrowed_node),
    Corruption("a fenced request whose layers read as ready", "forward_fence", "layers read as ready",
               lambda c, v: _set(_req(c, v, lambda r: r.state == "running" and not r.settled), "state", "fenced")),
]

assert all(c.invariant in _INV for c in CORRUPTIONS), [c.invariant for c in CORRUPTIONS if c.invariant not in _INV]
