"""More hostile calls for the misuse machine (issue 12): the refusals the first cases of
:data:`kvtier.testing.misuse_machine.CASES` did not take, appended to them.

Each case is a list of variants; a variant is a call, the :class:`KvtierError` class it
must raise and a fragment of the message (the offending value, named). A case that needs
a state the live cache may not be in (an operation in flight, a match gone stale, a
request that ended and was reported, a node only on the host) builds it on a private
cache with the live one's layout and world size, by legal calls only, and then checks
that the refused call left that private cache as it was (the live cache's fingerprint is
checked by the machine, as for every case).

Most variants go through the calls an engine makes (:class:`~kvtier.tiered.TieredCache`,
:class:`~kvtier.fsm.CacheCore`, the records of :mod:`kvtier.fsm`); a few call the public
part that is the only way in: the cache's page allocators (``core.device[g]``,
:class:`~kvtier.fsm.node.pages.PageAllocator`: the core checks counts and ownership first),
``kvtier.fsm.checks.as_int`` with an open lower bound (no kvtier call passes one) and the
spec parser. :func:`run_variant` is what the machine and tests/kit/test_misuse_cases.py call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvtier.fsm import (CacheCore, CacheGroupSpec, ComponentSpec, Completion, Direction, Family, GroupTransfer,
                        TransferCommand)
from kvtier.fsm.checks import as_int
from kvtier.fsm.errors import (CapacityError, ConfigError, GuardRejected, InvariantViolation, KvtierError,
                               SpecNameError, UnknownOperation, UsageError)
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.names import NODE_EVENT, NODE_STATE
from kvtier.fsm.node.pages import MAX_POOL_PAGES, PageAllocator
from kvtier.fsm.presets import preset
from kvtier.fsm.lifecycle.spec import parse_spec, spec_text

from ..tiered import TieredCache
from ._views import fingerprint
from .base import PRESET_PARAMS, kit_layout

__all__ = ["Variant", "VARIANTS", "MORE_CASES", "run_variant", "Hostile"]


class Hostile(Protocol):
    """What a case reads of the machine that makes it (the misuse machine): its live cache."""

    cache: TieredCache


@dataclasses.dataclass(frozen=True)
class Variant:
    """One hostile call: ``call`` on the machine must raise ``error`` (or a subclass) with
    ``says`` in its message (a function of the machine where the value depends on it)."""

    call: Callable[[Hostile], object]
    error: type[KvtierError]
    says: str | Callable[[Hostile], str]

    def expected(self, m: Hostile) -> str:
        """The fragment the message must contain, for machine ``m``."""
        return self.says if isinstance(self.says, str) else self.says(m)


def run_variant(m: Hostile, variant: Variant) -> None:
    """Make the call; raises what it raised when that is ``variant``'s refusal, and
    AssertionError when it was accepted or refused otherwise."""
    says = variant.expected(m)
    try:
        variant.call(m)
    except variant.error as exc:
        if says not in str(exc):
            raise AssertionError(f"refused with {exc!r}, which does not say {says!r}") from exc
        raise
    except KvtierError as exc:
        raise AssertionError(f"refused with {type(exc).__name__} ({exc}), expected "
                             f"{variant.error.__name__} saying {says!r}") from exc
    raise AssertionError(f"accepted; expected {variant.error.__name__} saying {says!r}")


# -- private caches, prepared by legal calls ------------------------------------------------
def _private(m: Hostile, layout: CacheLayout | None = None) -> TieredCache:
    return TieredCache(layout or m.cache.layout, 8, 8, world_size=m.cache.core.world_size)


def _staged(prepare: Callable[[TieredCache], Callable[[], object]],
            layout: Callable[[], CacheLayout] | None = None) -> Callable[[Hostile], object]:
    """A call on a private cache that ``prepare`` brought (legally) into the state the
    hostile call (which ``prepare`` returns) needs; that cache must not change."""

    def call(m: Hostile) -> object:
        cache = _private(m, layout() if layout else None)
        hostile = prepare(cache)
        before = fingerprint(cache)
        try:
            return hostile()  # accepted: run_variant says so
        except KvtierError as exc:
            if fingerprint(cache) != before:
                raise AssertionError(f"refused ({exc}) but changed the (private) cache") from exc
            raise

    return call


def _put(core: CacheCore, key: str, table: dict[str, list[int]] | None = None) -> Any:
    """Publish ``key`` (one unit per letter); ``table``: the canonical prefix pages."""
    ppu = core.pages_per_unit
    have = {g: list((table or {}).get(g, ())) for g in core.history_groups}
    got = core.alloc_device({g: len(key) * ppu[g] - len(have[g]) for g in core.history_groups})
    return core.insert(list(key), {g: have[g] + got.get(g, []) for g in core.history_groups})


def _ack(core: CacheCore, cmd: TransferCommand | None) -> None:
    assert cmd is not None
    for rank in range(core.world_size):
        core.complete(Completion(cmd.op_id, rank, True))


def _units(core: CacheCore, n: int) -> dict[str, int]:
    return {g: n * core.pages_per_unit[g] for g in core.history_groups}


def _host_chain(c: TieredCache) -> tuple[Any, Any]:
    """A = (a, b) backed on the device, B = (a, b, c, d) demoted to the host: a match of
    ``abcd`` is a device hit on A and a host hit on B."""
    core = c.core
    ra = _put(core, "ab")
    _ack(core, core.writeback(ra.node))
    rb = _put(core, "abcd", ra.pages)
    _ack(core, core.writeback(rb.node))
    core.evict_device(_units(core, 2))
    assert (ra.node.state, rb.node.state) == ("backed", "host"), (ra.node, rb.node)
    return ra.node, rb.node


def _stale_demoted(c: TieredCache) -> Callable[[], object]:
    core = c.core
    _host_chain(c)
    m = core.match(list("abcd"))
    core.evict_device(_units(core, 2))  # A is demoted: the device hit is gone
    return lambda: core.load(m, "hostile")


def _stale_split(c: TieredCache) -> Callable[[], object]:
    core = c.core
    _host_chain(c)
    m = core.match(list("abcd"))
    core.match(list("abcx"))  # splits B after c: B's chain from A changed
    return lambda: core.load(m, "hostile")


def _stale_loading(c: TieredCache) -> Callable[[], object]:
    core = c.core
    _host_chain(c)
    m = core.match(list("abcd"))
    core.load(core.match(list("abcd")), "first")  # B is loading now: the older match is stale
    return lambda: core.load(m, "hostile")


def _writeback_in_flight(c: TieredCache, polled: bool = True) -> int:
    core = c.core
    cmd = core.writeback(_put(core, "ab").node)
    assert cmd is not None
    if polled:  # handed out, as an engine would have it (complete() refuses an op poll() has not)
        c.poll()
    return cmd.op_id


def _loadback_in_flight(c: TieredCache) -> int:
    core = c.core
    _host_chain(c)
    cmd = core.load(core.match(list("abcd")), "first").command
    assert cmd is not None
    c.poll()  # handed out (as above)
    return cmd.op_id


def _partial_stage(c: TieredCache, wrong: str) -> Callable[[], object]:
    """An insert whose pages along an existing node (A = (a, b)) are not its canonical
    ones: with ``wrong`` "span" a page there is nobody's; with "tail" the span mixes
    canonical and the caller's pages (legal) and a page past A is not the caller's."""
    core = c.core
    ra = _put(core, "ab")
    ppu = core.pages_per_unit
    own = core.alloc_device(_units(core, 2))
    g = core.history_groups[0]
    canon = ra.pages[g]
    pages: dict[str, list[int]] = {h: list(ra.pages[h]) + own.get(h, []) for h in core.history_groups}
    if wrong == "span":
        pages[g] = canon[:1] + [_nobodys(core, g)] + canon[2:] + own[g]
    else:
        spare = core.alloc_device({g: 1})[g]
        pages[g] = canon[:1] + spare + canon[2:] + own[g][:-1] + [_nobodys(core, g)]
    assert all(len(p) == 4 * ppu[h] for h, p in pages.items())
    return lambda: core.insert(list("abcd"), pages)


def _nobodys(core: CacheCore, g: str) -> int:
    """A device page id of group ``g`` nobody holds (free, never allocated)."""
    return core.device[g].capacity - 1


def _too_few_units(m: Hostile) -> object:
    align = m.cache.layout.alignment
    return m.cache.admit("hostile", ["a"], prompt_tokens=3 * align, chunk_tokens=align)


def _ended(c: TieredCache) -> Callable[[], object]:
    """``r`` ran, finished and was reported by poll(): it is only in the history now."""
    align = c.layout.alignment
    c.admit("r", ["a", "b"], prompt_tokens=2 * align + 1, chunk_tokens=8 * align)
    r = c.table.get("r")
    c.step_done("r", r.reserved - r.tokens)
    c.finish("r")
    c.poll()
    return lambda: c.reserve("r", 1)


def _forward_owed(c: TieredCache) -> Callable[[], object]:
    align = c.layout.alignment
    c.admit("r", ["a", "b"], prompt_tokens=2 * align + 1, chunk_tokens=8 * align)
    return lambda: c.finish("r")


def _partial_checkpoint_layout() -> CacheLayout:
    return preset("deepseek-v4", **PRESET_PARAMS["deepseek-v4"])


def _partial_checkpoint(c: TieredCache) -> Callable[[], object]:
    """An insert with a checkpoint for one of the layout's four state groups."""
    core = c.core
    got = core.alloc_device({**_units(core, 1), core.ckpt_groups[0]: core.layout.state_groups[0].state_pages})
    pages = {g: got[g] for g in core.history_groups}
    ckpt = {core.ckpt_groups[0]: got[core.ckpt_groups[0]]}
    return lambda: core.insert(["a"], pages, ckpt)


def _host_node(c: TieredCache) -> Callable[[], object]:
    _, b = _host_chain(c)
    return lambda: c.core.borrow([b])


def _dunder_then_misspelt(m: Hostile) -> object:
    """A dunder probe (copy, pickle, hasattr) is a plain AttributeError; a misspelt name
    is a SpecNameError naming it."""
    try:
        getattr(NODE_STATE, "__deepcopy__")
    except SpecNameError as exc:
        raise AssertionError("a dunder probe must be a plain AttributeError, not SpecNameError") from exc
    except AttributeError:
        pass
    else:
        raise AssertionError("NODE_STATE answered a dunder probe")
    return getattr(NODE_EVENT, "evict")


def _spec_edit(old: str, new: str) -> Callable[[Hostile], object]:
    def call(m: Hostile) -> object:
        text = spec_text()
        if old not in text:
            raise AssertionError(f"the spec text no longer has {old!r}: update this case")
        return parse_spec(text.replace(old, new, 1))

    return call


def _as_command(deadline: bool) -> Callable[[Hostile], object]:
    """The engine hands back the command (an engine-built copy, validated, with or
    without a deadline) instead of its completion."""

    def call(m: Hostile) -> object:
        core = m.cache.core
        cmd = TransferCommand(7, Direction.WRITEBACK, (GroupTransfer(core.history_groups[0], (0,), (1,)),), (0,),
                              request_id="r0", node_ids=(1,), deadline_step=core.step + 4 if deadline else None)
        m.cache.complete(cmd)  # type: ignore[arg-type]
        return None

    return call


_KV = ComponentSpec("k", 64)


def _g(m: Hostile) -> str:
    return m.cache.core.history_groups[0]


#: case name -> its variants (the loadback cases use the kit's layout without state
#: groups: a prefix hit there needs no checkpoint)
VARIANTS: dict[str, list[Variant]] = {
    "insert pages nobody holds along a node": [
        Variant(_staged(lambda c: _partial_stage(c, "span")), UsageError, "is neither the caller's nor node 1's"),
        Variant(_staged(lambda c: _partial_stage(c, "tail")), UsageError, "are not held by the caller"),
    ],
    "insert a checkpoint of some state groups only": [
        Variant(_staged(_partial_checkpoint, _partial_checkpoint_layout), UsageError,
                "a checkpoint needs every state group ['v4.swa_kv', 'v4.c4a.compressor_state'"),
    ],
    "load a stale match": [
        Variant(_staged(_stale_demoted, kit_layout), KvtierError, "load: match is stale (nodes [1]"),
        Variant(_staged(_stale_split, kit_layout), KvtierError, "load: match is stale (nodes [2]"),
        Variant(_staged(_stale_loading, kit_layout), KvtierError, "load: match is stale (nodes [2]"),
    ],
    "completion of an operation poll() has not handed out": [
        Variant(_staged(lambda c: (lambda op: lambda: c.complete(Completion(op)))(_writeback_in_flight(c, False))),
                UsageError, "completion for op 1: its command has not been handed out by poll() yet"),
    ],
    "completion of an operation in flight, out of range": [
        Variant(_staged(lambda c: (lambda op: lambda: c.complete(Completion(op, c.core.world_size)))(
            _writeback_in_flight(c))), UsageError,
            lambda m: f"completion for op 1: rank {m.cache.core.world_size} outside world size "
                      f"{m.cache.core.world_size}"),
        Variant(_staged(lambda c: (lambda op: lambda: c.complete(Completion(op, 0, True, 0)))(
            _writeback_in_flight(c))), UsageError, "op 1 is a writeback: layer completions are for loadbacks"),
        Variant(_staged(lambda c: (lambda op: lambda: c.complete(Completion(op, 0, True, c.layout.num_layers)))(
            _loadback_in_flight(c)), kit_layout), UsageError, "op 3: layer 3 outside 0..2"),
    ],
    "completion with a numpy bool": [
        Variant(lambda m: m.cache.complete(Completion(10**9, 0, np.bool_(True))),  # type: ignore[arg-type]
                UnknownOperation, "completion for op 1000000000: never issued"),
        Variant(lambda m: Completion(1, 0, np.bool_(False), -2),  # type: ignore[arg-type]
                ConfigError, "layer must be an int >= 0, got -2"),
    ],
    "complete given a command": [
        Variant(_as_command(False), UsageError, "complete() takes a Completion, got TransferCommand(op_id=7"),
        Variant(_as_command(True), UsageError, "complete() takes a Completion, got TransferCommand(op_id=7"),
    ],
    "borrow or pin not a list": [
        Variant(lambda m: m.cache.core.borrow(m.cache.core.root), KvtierError,  # type: ignore[arg-type]
                "borrow takes a list of nodes, got <node 0 root"),
        Variant(lambda m: m.cache.core.pin(5),  # type: ignore[arg-type]
                KvtierError, "pin takes a list of nodes, got 5"),
        Variant(lambda m: m.cache.core.borrow([]), KvtierError, "borrow: no nodes given"),
        Variant(lambda m: m.cache.core.pin(()), KvtierError, "pin: no nodes given"),
    ],
    "borrow a node only on the host": [
        Variant(_staged(_host_node), KvtierError, "borrow: nodes [2] have no device pages")],
    "admit with too few unit keys": [Variant(_too_few_units, UsageError, "prompt tokens need 3 unit keys, got 1")],
    "a request that ended and was reported": [
        Variant(_staged(_ended), UsageError, "request 'r' has ended (finished) and poll() reported it")],
    "finish with a forward result owed": [
        Variant(_staged(_forward_owed), GuardRejected, "event 'finish' refused in state 'running': guard 'settled'")],
    "match or insert a str key": [
        Variant(lambda m: m.cache.core.match("ab"), UsageError,
                "match: key must be a sequence of unit keys (not a str or bytes), got 'ab'"),
        Variant(lambda m: m.cache.core.match(b"ab"), UsageError, "got b'ab'"),
        Variant(lambda m: m.cache.core.insert("ab", {}), UsageError,
                "insert: key must be a non-empty sequence of unit keys (not a str or bytes), got 'ab'"),
    ],
    "free pages of an unknown group": [
        Variant(lambda m: m.cache.core.free_device({"nogroup": [1]}), UsageError,
                "free_device: unknown cache group 'nogroup'")],
    "history_replay with state_recovery": [
        Variant(lambda m: m.cache.core.match(["a"], "state_recovery", history_replay=True), UsageError,
                "history_replay applies to prefix_reuse matches only")],
    "a page allocator asked directly": [
        Variant(lambda m: m.cache.core.device[_g(m)].alloc(-1), ConfigError, "page count must be an int >= 0, got -1"),
        Variant(lambda m: m.cache.core.device[_g(m)].alloc("2"),  # type: ignore[arg-type]
                ConfigError, "page count must be an int >= 0, got '2'"),
        Variant(lambda m: m.cache.core.device[_g(m)].alloc(m.cache.core.device[_g(m)].free + 1), CapacityError,
                lambda m: f"device pool of cache group 'kv': need {m.cache.core.device[_g(m)].free + 1} pages, "
                          f"{m.cache.core.device[_g(m)].free} free"),
        Variant(lambda m: m.cache.core.device[_g(m)].release([10**6]), InvariantViolation,
                "release of pages that are not allocated (or twice): [1000000]"),
        Variant(lambda m: PageAllocator("device", "g", -1), ConfigError, "capacity must be an int >= 0, got -1"),
        Variant(lambda m: CacheCore(m.cache.layout, 2**60), ConfigError,
                f"is above the maximum {MAX_POOL_PAGES}"),
    ],
    "an int check with an open lower bound": [
        Variant(lambda m: as_int("x", "hostile: tokens", minimum=None, maximum=3), UsageError,
                "hostile: tokens must be an int <= 3, got 'x'"),
        Variant(lambda m: as_int(1.5, "hostile: tokens", minimum=None), UsageError,
                "hostile: tokens must be an int, got 1.5"),
    ],
    "a bad layout or group": [
        Variant(lambda m: CacheLayout("l", (CacheGroupSpec("h", Family.HISTORY, 4, 1, (0,), (_KV,)),
                                            CacheGroupSpec("s", Family.STATE, 3, 1, (0,), (_KV,), window=6)), 1),
                ConfigError, "state group 's' has 3 tokens per page, which does not divide the alignment 4"),
        Variant(lambda m: CacheGroupSpec("h", Family.HISTORY, 2, 1, (0,), (_KV,), window=8), ConfigError,
                "window is only for state groups, got 8"),
        Variant(lambda m: CacheLayout("", m.cache.layout.groups, 3), ConfigError,
                "layout name must be a non-empty str, got ''"),
        Variant(lambda m: CacheLayout("l", tuple(g.name for g in m.cache.layout.groups), 3),  # type: ignore[misc]
                ConfigError, "layout 'l': groups must be a tuple of CacheGroupSpec, got ('kv', 'c4'"),
    ],
    "a spec with a duplicate transition or an unused guard": [
        Variant(_spec_edit('event = "writeback_fail"\nsource = ["writing"]',
                           'event = "writeback_ack"\nsource = ["writing"]'),
                ConfigError, "duplicate transition 'writeback_ack' from 'writing'"),
        Variant(_spec_edit("[node.guards.unlocked]",
                           '[node.guards.never_used]\ndoc = "hostile"\n\n[node.guards.unlocked]'),
                ConfigError, "guards declared but never used: ['never_used']"),
    ],
    "a dunder probe, then a misspelt spec name": [
        Variant(_dunder_then_misspelt, SpecNameError, "the spec declares no node event 'evict'; declared: [")],
}


def _case(variants: Sequence[Variant]) -> Callable[[Hostile, int], object]:
    def call(m: Hostile, v: int) -> object:
        run_variant(m, variants[v % len(variants)])
        return None

    return call


#: (name, call(machine, variant)) pairs, appended to the misuse machine's CASES
MORE_CASES: list[tuple[str, Callable[[Hostile, int], Any]]] = [
    (name, _case(variants)) for name, variants in VARIANTS.items()]
