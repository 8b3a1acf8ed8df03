"""Corruptions: the invariant checks see what they claim to (the misuse machine's
``corrupt`` rule, :mod:`kvtier.testing.misuse_machine`).

Each :class:`Corruption` spoils a copy of a live :class:`~kvtier.tiered.TieredCache` the
way one kind of bug would (a count without its receipt, a page owned twice, a tree link
cut, an operation that forgets a node, a request that reads pages it no longer holds,
...) and names the invariant of the spec (``spec/lifecycle.toml`` ``[invariants]``) whose
check must catch it: ``check_invariants()`` on the spoiled copy must raise
:class:`~kvtier.fsm.errors.InvariantViolation` with exactly that ``invariant``. There is
one corruption per raising check of ``fsm/node/invariants.py`` and ``fsm/request/fence.py`` (each
chosen so that no earlier check catches it first; ``says`` is a fragment of the message
that check writes, which ``tests/kit/test_corruptions.py`` asserts) but one:
``_check_fenced``'s terminal-state check, which ``check_requests`` always pre-empts (a
terminal state owns nothing, so ``forward_fence`` is raised one check earlier). The node
resource check (``_check_declared_resources``) names a different invariant per resource
held without its state declaring it or lacked while declared: it has one corruption per
such pair a kit cache can reach (a fetching node needs an L3 tier: ``tests/fsm/node/test_invariants_resources.py``).

A corruption applies to the state it finds (a writing node, a request holding pages,
...); where the state has nothing it needs it raises :class:`NotApplicable` and the
copy is dropped. The misuse machine's caches are small and rarely hold loadbacks in
flight or host chains, so :func:`check_corruptions` first grows a copy by legal calls
(:func:`grown`: a chain written back, evicted, loaded back) and spoils copies of that.
The cache itself is never touched: every corruption works on a copy
(:func:`spoiled_copy`) that shares only what the process shares (the lifecycle spec, the
``transitions`` machines, the layout): 1.2 ms instead of 10-13 ms for a plain
``deepcopy`` of a small kit cache (measured on the development machine). Events the
growth fires go through the shared machines, so an observer (the fuzz's lifecycle
coverage) counts them for the running machine.
"""

from __future__ import annotations

import copy as _copy

from kvtier.fsm import Completion
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.lifecycle.machines import l3_lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.lifecycle.spec import load_spec

from ..tiered import TieredCache
from . import _views as views
from .base import kit_layout
from .corruption_cases import CORRUPTIONS, Corruption, NotApplicable

__all__ = ["Corruption", "CORRUPTIONS", "NotApplicable", "spoiled_copy", "grown", "GROWN_LEVELS", "try_corruption",
           "check_corruptions"]


def spoiled_copy(cache: TieredCache) -> TieredCache:
    """A deep copy of ``cache`` that shares the process-wide immutable parts with it: the
    lifecycle spec, the lifecycle machines (built once per process) and the layout."""
    shared: tuple[object, ...] = (load_spec(), node_lifecycle(), request_lifecycle(), l3_lifecycle(), cache.layout)
    return _copy.deepcopy(cache, {id(o): o for o in shared})


def try_corruption(cache: TieredCache, corruption: Corruption, v: int) -> InvariantViolation | None:
    """Spoil a copy of ``cache`` with ``corruption`` (variant ``v``) and check it.

    Returns:
        the InvariantViolation ``check_invariants()`` raised, or ``None`` when the
        corruption does not apply to this state.

    Raises:
        AssertionError: the spoiled copy passed ``check_invariants()``.
    """
    spoiled = spoiled_copy(cache)
    try:
        corruption.spoil(spoiled, v)
    except NotApplicable:
        return None
    try:
        spoiled.check_invariants()
    except InvariantViolation as exc:
        return exc
    raise AssertionError(f"corruption {corruption.name!r} (variant {v}) went unnoticed by check_invariants()")


def check_corruptions(cache: TieredCache, v: int, corruptions: list[Corruption] | None = None) -> int:
    """Every corruption of ``corruptions`` (default :data:`CORRUPTIONS`), each on its own
    copy of ``cache`` grown to level ``1 + v % 4`` (:func:`grown`; each grown copy keeps
    what the cache holds, the growth adds to it), variant ``v``; each that applies must
    raise its own invariant. When the cache's layout has no state group, they run on a
    grown cache of the kit's state layout too (8 device and 8 host units, the cache's
    world size): the checkpoint checks need state groups, and the fuzz's misuse machine
    mostly draws the layout without them.

    Returns:
        how many applied.

    Raises:
        AssertionError: one went unnoticed, or was caught as another invariant than the
            one it names (a check failed to see it and a later one did, or the corruption
            is not the bug it claims to be).
        InvariantViolation: the grown copy itself broke an invariant (legal calls did).
    """
    level = 1 + v % (GROWN_LEVELS - 1)
    bases = [grown(cache, level)]
    if not views.checkpoint_groups(cache.core):  # the checkpoint checks need state groups
        bases.append(grown(TieredCache(kit_layout(True), 8, 8, world_size=cache.core.world_size), level))
    applied = 0
    for base in bases:
        for c in CORRUPTIONS if corruptions is None else corruptions:
            exc = try_corruption(base, c, v)
            if exc is None:
                continue
            if exc.invariant != c.invariant:
                raise AssertionError(f"corruption {c.name!r} (variant {v}) must violate {c.invariant!r}, "
                                     f"but check_invariants() raised: {exc}")
            applied += 1
    return applied


#: levels of :func:`grown`
GROWN_LEVELS = 5


def grown(cache: TieredCache, level: int) -> TieredCache:
    """A copy of ``cache`` grown by legal calls, so that it holds what the corruptions
    need however rare the fuzz makes it (the misuse machine's caches are small and
    their tree often empty). Two requests of fresh units publish a chain ``~p`` <- ``~q``
    and it is written back: level 1 leaves the writeback in flight; 2 completes it (both
    backed); 3 then evicts the device (every unlocked device page, the cache's own nodes'
    too: ``~p`` and ``~q`` host only). At every level a request ``~4`` then computes
    ``~d`` and stays running (a locked device node, its own pages); at level 4 a request
    for ``~p`` loads it back under ``~q``, still on the host. Level 0 is a plain copy. A
    call the copy is too full for ends the growth there; the copy must pass
    ``check_invariants()`` at every level (InvariantViolation otherwise).
    """
    c = spoiled_copy(cache)
    if level > 0:
        _grow(c, level)
        c.check_invariants()
    return c


_GROWN_UNITS = ("~p", "~q", "~d")


def _grow(c: TieredCache, level: int) -> None:
    core = c.core
    if any(n.key[0] in _GROWN_UNITS for n in views.nodes(core).values()) or any(
            rid.startswith("~") for rid in views.requests(c)):
        return  # grown before
    for rid, units in (("~1", ["~p"]), ("~2", ["~p", "~q"])):
        if not _compute(c, rid, units):
            return
        c.finish(rid)
    leaf = next((n for n in views.nodes(core).values() if n.key == ("~q",) and n.state == "device"), None)
    cmd = core.writeback(leaf) if leaf is not None else None
    if cmd is None:
        return
    c.poll()  # hands the writeback out (with whatever else the copy had to hand out)
    if level >= 2:
        for rank in range(core.world_size):
            c.complete(Completion(cmd.op_id, rank, True))
    if level >= 3:
        core.evict_device({g: core.device[g].capacity for g in views.history_groups(core)})
    _compute(c, "~4", ["~d"])  # stays running: a device node under its lock, its own pages
    if level >= 4:
        align = c.layout.alignment
        c.admit("~3", ["~p"], prompt_tokens=align + 1, chunk_tokens=1)


def _compute(c: TieredCache, rid: str, units: list[str]) -> bool:
    """Admit ``rid`` and compute its prompt in one pass (publishing its units); False
    when it could not (no room, or the pass does not reach its end)."""
    align = c.layout.alignment
    tokens = len(units) * align + 1
    a = c.admit(rid, units, prompt_tokens=tokens, chunk_tokens=tokens)
    if a is None or a.loadback_op is not None or a.start_token + a.chunk_tokens != tokens:
        return False
    c.step_done(rid, a.chunk_tokens, checkpoint=bool(views.checkpoint_groups(c.core)))
    return True
