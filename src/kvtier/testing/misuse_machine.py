"""The misuse machine: hostile calls on a live cache, each of which must be refused and
change nothing (registered as ``misuse``).

The GUIDE's rule for bad input: a clear exception naming the value and what was
expected, and an illegal lifecycle call raises and changes nothing. The other machines
call legally, so they never check it. This machine moves a :class:`TieredCache` through
ordinary states (admissions, forward results, finishes, transfers delivered, pressure)
and, between them, makes one hostile call drawn from :data:`CASES`: wrong types and
out-of-range values for every call argument, unknown requests and calls, foreign,
released or fake receipts, completions of unknown operations or ranks, pages the caller
does not hold, calls in states that refuse them, malformed layouts, records, capacities
and lifecycle specs. Each call must raise a :class:`~kvtier.fsm.errors.KvtierError`
(ConfigError, UsageError, LifecycleError, ...), and a fingerprint of the cache (tree,
pages, receipts, operations, requests, clock) must be the same afterwards; the core's
and the requests' invariants are checked after every step as in every machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvtier.fsm import CacheGroupSpec, ComponentSpec, Completion, Direction, Family
from kvtier.fsm.node.core import CacheCore
from kvtier.fsm.errors import DuplicateCompletion, InvariantViolation, KvtierError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.names import NODE_STATE
from kvtier.fsm.presets import preset
from kvtier.fsm.records import GroupTransfer, TransferCommand
from kvtier.fsm.lifecycle.spec import load_spec, parse_spec, spec_text

from ..tiered import TieredCache
from . import _views as views
from ._views import fingerprint
from .base import TERMINAL, KitMachine, kit_layout, recorded
from .corruptions import check_corruptions
from .drain import check_core_drained, evict_to_full_pools
from .models import ModelViolation

__all__ = ["MisuseMachine", "CASES", "fingerprint"]

_ALIGN_KEYS = st.sampled_from(["a", "ab", "abc", "b", "ba"]).map(list)

#: values no int argument accepts, no bool argument, no unit-key list, no request id
BAD_INTS: tuple[object, ...] = (True, 1.5, "3", None, -7, [1])
BAD_BOOLS: tuple[object, ...] = (1, "yes", None, 0.0)
BAD_KEYS: tuple[object, ...] = ("ab", 5, [["x"], ["y"]], b"ab", None)
BAD_IDS: tuple[object, ...] = ("nobody", 5, None, "")


def _spec_edits() -> list[tuple[str, str]]:
    """Malformed lifecycle specs: (text to replace, replacement); each must be refused."""
    return [
        ('initial = "new"', 'initial = "nowhere"'),
        ('resources = ["device_pages", "shared_read"]', 'resources = ["device_pages", "bogus_resource"]'),
        ('admit = ["waiting", "finished", "aborted"]', 'admit = ["waiting", "limbo"]'),
        ('guards = ["parent_readable"]', 'guards = ["parent_readable", "no_such_guard"]'),
        ('source = ["new"]', 'source = ["nowhere"]'),
        ('dest = "device"', 'dest = "nowhere"'),
        ("version = 1", "version = 'one'"),
        ("[node]", "[node\n"),
        ('source = ["new"]', 'source = 5'),
    ]


class MisuseMachine(KitMachine):
    """Hostile calls between ordinary ones; see the module docstring."""

    kit_invariants = ("check_cache_invariants",)

    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredCache
        self.refused = 0
        self.released: list[Any] = []  # receipts released by the ordinary rules

    @initialize(state=st.booleans(), world=st.sampled_from([1, 2]), dev_units=st.integers(4, 8),
                host_units=st.integers(2, 8))
    @recorded
    def setup(self, state: bool, world: int, dev_units: int, host_units: int) -> None:
        self.cache = TieredCache(kit_layout(state), dev_units, host_units, world_size=world)

    # -- ordinary calls (move the cache through states) --------------------------------
    def _align(self) -> int:
        return self.cache.layout.alignment

    @rule(req=st.integers(0, 2), key=_ALIGN_KEYS)
    @recorded
    def admit(self, req: int, key: list[str]) -> None:
        rid = f"r{req}"
        if rid in views.requests(self.cache) and not self.cache.allows(rid, "admit"):
            return
        r = views.requests(self.cache).get(rid)
        if r is not None and not r.settled:
            return
        self.cache.admit(rid, key, prompt_tokens=len(key) * self._align() + 1, chunk_tokens=8 * self._align())

    @rule(req=st.integers(0, 2), finish=st.booleans())
    @recorded
    def forward(self, req: int, finish: bool) -> None:
        """The oldest pass out of ``r<req>`` returns with everything reserved computed;
        with ``finish`` a running request with nothing owed then finishes."""
        rid = f"r{req}"
        r = views.requests(self.cache).get(rid)
        if r is None:
            return
        if r.owed_forward > 0:
            computed = r.reserved - r.tokens if r.state in ("running", "loading") else 0
            self.cache.step_done(rid, max(0, computed))
        elif finish and r.state == "running":
            self.cache.finish(rid)
        elif r.state == "running":
            self.cache.reserve(rid, self._align())

    @rule(ok=st.booleans())
    @recorded
    def pump(self, ok: bool) -> None:
        """Poll, then deliver every command's completions on every rank (``ok``)."""
        self._pump(ok)

    def _pump(self, ok: bool) -> None:
        out = self.cache.poll()
        for cmd in out.commands:
            self._deliver(cmd, ok)
        self.cache.poll()

    def _deliver(self, cmd: TransferCommand, ok: bool) -> None:
        for rank in range(self.cache.core.world_size):
            if cmd.direction is Direction.LOADBACK:
                for layer in cmd.layers:
                    self.cache.complete(Completion(cmd.op_id, rank, ok, layer))
            self.cache.complete(Completion(cmd.op_id, rank, ok))

    def kit_drain(self) -> None:
        """Every request aborted, its passes returned, every transfer succeeding: then the
        cache is quiescent, nothing is left on the core and the tree evicts to full pools."""
        if not hasattr(self, "cache"):
            return
        c = self.cache
        for rid, r in sorted(views.requests(c).items()):
            if r.state not in ("aborting", *TERMINAL):
                c.abort(rid)
        for _ in range(8):
            for rid, r in sorted(views.requests(c).items()):
                while r.owed_forward > 0:
                    c.step_done(rid, 0)
            self._pump(True)
            for o in list(views.ops(c.core).values()):  # handed out by a hostile call's poll
                try:
                    self._deliver(o.command, True)
                except DuplicateCompletion:  # some ranks already delivered: the rest settles it
                    continue
            c.poll()
        if not c.quiescent():
            raise ModelViolation("model_drain", "the misuse machine's cache", f"{c.outstanding()}")
        check_core_drained(c.core, "the misuse machine's core")
        evict_to_full_pools(c.core, lambda: self._pump(True), "the misuse machine's core")

    @rule(i=st.integers(0, 100), borrow=st.booleans())
    @recorded
    def use_and_release(self, i: int, borrow: bool) -> None:
        """Lock (or borrow) a readable node and release it; the spent receipt is kept for
        the hostile calls."""
        core = self.cache.core
        nodes = [n for _, n in sorted(views.nodes(core).items()) if n.state in ("device", "backed", "writing")]
        if not nodes:
            return
        n = nodes[i % len(nodes)]
        r: Any
        if borrow:
            r = core.borrow([n], "hostile")
            core.release(r)
        else:
            r = core.lock(n, "hostile")
            core.unlock(r)
        self.released = (self.released + [r])[-4:]

    @rule()
    @recorded
    def pressure(self) -> None:
        core = self.cache.core
        core.evict_device({g: 2 for g in views.history_groups(core)})

    # -- hostile calls --------------------------------------------------------------------
    @rule(case=st.integers(0, 10_000), v=st.integers(0, 100))
    @recorded
    def hostile(self, case: int, v: int) -> None:
        """One hostile call (:data:`CASES` [``case`` mod its length], variant ``v``): it
        must raise a KvtierError and change nothing."""
        self._hostile(case % len(CASES), v)

    @rule(v=st.sampled_from(range(32)))
    @recorded
    def hostile_sweep(self, v: int) -> None:
        """Every hostile call of :data:`CASES`, with variant ``v``, one after the other."""
        for i in range(len(CASES)):
            self._hostile(i, v)

    def _hostile(self, i: int, v: int) -> None:
        name, call = CASES[i]
        before = fingerprint(self.cache)
        try:
            call(self, v)
        except KvtierError:
            self.refused += 1
        except _Skip:
            return
        else:
            raise AssertionError(f"hostile call {name!r} (variant {v}) was accepted")
        after = fingerprint(self.cache)
        if after != before:
            raise InvariantViolation("state_matches_resources", f"hostile call {name!r} (variant {v})",
                                     "was refused but changed the cache")

    @rule(v=st.sampled_from(range(16)))
    @recorded
    def corrupt(self, v: int) -> None:
        """The invariant checks see what they claim to: every corruption of
        :data:`~kvtier.testing.corruptions.CORRUPTIONS` that applies here (on an object
        chosen by ``v``), each on its own copy of the cache, must make
        ``check_invariants()`` raise the invariant it names; the cache itself is untouched."""
        check_corruptions(self.cache, v)

    def check_cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    # -- helpers for the cases --------------------------------------------------------------
    def some_node(self, v: int, states: tuple[str, ...] | None = None) -> Any:
        nodes = [n for _, n in sorted(views.nodes(self.cache.core).items()) if states is None or n.state in states]
        if not nodes:
            raise _Skip()
        return nodes[v % len(nodes)]

    def some_request(self, v: int, states: tuple[str, ...] | None = None) -> str:
        reqs = [rid for rid, r in sorted(views.requests(self.cache).items()) if states is None or r.state in states]
        if not reqs:
            raise _Skip()
        return reqs[v % len(reqs)]


class _Skip(Exception):
    """The case does not apply in this state (nothing was called)."""


def _pick(values: tuple[object, ...], v: int) -> Any:
    return values[v % len(values)]


def _foreign_node(m: MisuseMachine) -> Any:
    other = CacheCore(m.cache.layout, 4, 4)
    ppu = other.pages_per_unit
    pages = other.alloc_device({g: ppu[g] for g in other.history_groups})
    return other.insert(["x"], pages).node


def _released(m: MisuseMachine, v: int) -> Any:
    if not m.released:
        raise _Skip()
    return m.released[v % len(m.released)]


def _bad_insert(m: MisuseMachine, v: int) -> None:
    core = m.cache.core
    g0 = core.history_groups[0]
    ppu = core.pages_per_unit
    variants: list[Callable[[], Any]] = [
        lambda: core.insert("ab", {}),
        lambda: core.insert([], {}),
        lambda: core.insert(["a"], [1, 2]),  # type: ignore[arg-type]
        lambda: core.insert(["a"], {g0: []}),
        lambda: core.insert(["a"], {**{g: [0] * ppu[g] for g in core.history_groups}, "nogroup": [1]}),
        lambda: core.insert(["a"], {g: list(range(ppu[g])) for g in core.history_groups}, {"nostate": [1]}),
        lambda: core.insert(["a"], {g: [0] * ppu[g] for g in core.history_groups}),  # a page twice / not held
        lambda: core.insert(["q", "q"], {g: list(range(1000, 1000 + 2 * ppu[g])) for g in core.history_groups}),
    ]
    if core.ckpt_groups:
        sg = core.ckpt_groups[0]
        variants.append(lambda: core.insert(["a"], {g: list(range(ppu[g])) for g in core.history_groups},
                                            {sg: [1]}))
    variants[v % len(variants)]()


def _bad_completion(m: MisuseMachine, v: int) -> None:
    core = m.cache.core
    ops = views.ops(core)
    world = core.world_size
    if v % 5 == 0 or not ops:
        m.cache.complete(_pick((999, "op", None), v))
        return
    op = ops[sorted(ops)[v % len(ops)]]
    layers = op.command.layers
    variants = [
        Completion(10**9, 0, True),
        Completion(op.op_id, world + v % 3, True),
        Completion(op.op_id, 0, True, (max(layers) + 1) if layers else 0),
    ]
    if op.command.direction is Direction.WRITEBACK:
        variants.append(Completion(op.op_id, 0, True, 0))
    core.complete(variants[v % len(variants)])


def _bad_layout(v: int) -> None:
    comp = ComponentSpec("k", 64)
    variants: list[Callable[[], Any]] = [
        lambda: ComponentSpec("", 64),
        lambda: ComponentSpec("k", 0),
        lambda: CacheGroupSpec("", Family.HISTORY, 2, 1, (0,), (comp,)),
        lambda: CacheGroupSpec("g", "neither", 2, 1, (0,), (comp,)),  # type: ignore[arg-type]
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, True, (comp,)),  # type: ignore[arg-type]
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, (), (comp,)),
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, (1, 0), (comp,)),
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, (0,), ()),
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, (0,), (comp, comp)),
        lambda: CacheGroupSpec("g", Family.HISTORY, 0, 1, (0,), (comp,)),
        lambda: CacheGroupSpec("g", Family.STATE, 2, 1, (0,), (comp,)),
        lambda: CacheGroupSpec("g", Family.HISTORY, 2, 1, (0, "x"), (comp,)),  # type: ignore[arg-type]
        lambda: CacheLayout("l", (), 1),
        lambda: CacheLayout("l", (CacheGroupSpec("g", Family.HISTORY, 2, 1, (0,), (comp,)),), 0),
        lambda: CacheLayout("l", (CacheGroupSpec("g", Family.HISTORY, 2, 1, (3,), (comp,)),), 2),
        lambda: CacheLayout("l", (CacheGroupSpec("g", Family.HISTORY, 2, 1, (0,), (comp,)),) * 2, 1),
        lambda: kit_layout().chunk_rows(-1, 4),
        lambda: kit_layout().group("nogroup"),
        lambda: preset("llama-3-8b", num_layers=0),
        lambda: preset("no-such-model"),
    ]
    variants[v % len(variants)]()


def _bad_record(v: int) -> None:
    gt = GroupTransfer("kv", (1,), (2,))
    variants: list[Callable[[], Any]] = [
        lambda: GroupTransfer("kv", (1, 2), (3,)),
        lambda: GroupTransfer("kv", (-1,), (2,)),
        lambda: GroupTransfer("kv", (True,), (2,)),
        lambda: TransferCommand(1, "sideways", (gt,), (0,)),  # type: ignore[arg-type]
        lambda: TransferCommand(1, Direction.WRITEBACK, (object(),), (0,)),  # type: ignore[arg-type]
        lambda: TransferCommand(1, Direction.WRITEBACK, (gt,), (1, 0)),
        lambda: TransferCommand(1, Direction.WRITEBACK, (gt,), (0,), request_id=5),  # type: ignore[arg-type]
        lambda: TransferCommand(1, Direction.WRITEBACK, (gt,), (0,), deadline_step=-1),
        lambda: TransferCommand(-1, Direction.WRITEBACK, (gt,), (0,)),
        lambda: Completion(1, 0, "yes"),  # type: ignore[arg-type]
        lambda: Completion(1, -1, True),
        lambda: Completion(1, 0, True, -2),
        lambda: Completion("op", 0, True),  # type: ignore[arg-type]
    ]
    variants[v % len(variants)]()


def _bad_config(m: MisuseMachine, v: int) -> None:
    lay = m.cache.layout
    g0 = lay.groups[0].name
    variants: list[Callable[[], Any]] = [
        lambda: CacheCore("kit", 4),  # type: ignore[arg-type]
        lambda: CacheCore(lay, 4, 4, policy="sometimes"),
        lambda: CacheCore(lay, 4, 4, op_deadline_steps=0),
        lambda: CacheCore(lay, 4, 4, eviction="random"),
        lambda: CacheCore(lay, {g0: "3"}),  # type: ignore[dict-item]
        lambda: CacheCore(lay, {"nogroup": 3}),
        lambda: CacheCore(lay, -1),
        lambda: CacheCore(lay, 4, {g0: True}),
        lambda: CacheCore(lay, 4.5),  # type: ignore[arg-type]
        lambda: TieredCache(lay, 4, 4, finish_writeback="yes"),  # type: ignore[arg-type]
        lambda: TieredCache(lay, 4, 4, history_replay="no"),  # type: ignore[arg-type]
        lambda: TieredCache(lay, 4, 4, max_writebacks_in_flight=0),
    ]
    variants[v % len(variants)]()


def _bad_spec(v: int) -> None:
    text = spec_text()
    old, new = _spec_edits()[v % len(_spec_edits())]
    if old not in text:
        raise _Skip()
    parse_spec(text.replace(old, new, 1))


def _bad_names(v: int) -> None:
    spec = load_spec()
    variants: list[Callable[[], Any]] = [
        lambda: getattr(NODE_STATE, "nowhere"),
        lambda: spec.node.state("nowhere"),
        lambda: spec.node.states_holding("no_resource"),
    ]
    variants[v % len(variants)]()


def _bad_step(m: MisuseMachine, v: int) -> None:
    c = m.cache
    rid = m.some_request(v)
    variants: list[Callable[[], Any]] = [
        lambda: c.step(results="r0", reserve=[]),  # type: ignore[arg-type]
        lambda: c.step(results=[("r0",)], reserve=[]),
        lambda: c.step(results=[], reserve=[(rid, 1), (rid, 1)]),
        lambda: c.step(results=[([1], 0)], reserve=[]),
        lambda: c.step(results=[], reserve=[], stop_on_short="no"),  # type: ignore[arg-type]
        lambda: c.step(results=[(rid, 0), (rid, 0)], reserve=[]),
        lambda: c.step(results=5, reserve=[]),  # type: ignore[arg-type]
    ]
    variants[v % len(variants)]()


def _step_refusing(m: MisuseMachine, v: int) -> None:
    """A batch whose every item is refused: the outcome names the errors, nothing changes."""
    c = m.cache
    rid = m.some_request(v)
    out = c.step(results=[(rid, _pick(BAD_INTS, v))], reserve=[("nobody", 1)])
    if out.errors and not any(s == "ok" for s in out.result_status + out.reserve_status):
        raise KvtierError("refused")  # the expected outcome: counted as a refusal
    raise _Skip()


CASES: list[tuple[str, Callable[[MisuseMachine, int], Any]]] = [
    # the facade's calls
    ("admit bad id", lambda m, v: m.cache.admit(_pick((5, None, ""), v), ["a"], prompt_tokens=9, chunk_tokens=4)),
    ("admit bad units", lambda m, v: m.cache.admit("z", _pick(BAD_KEYS, v), prompt_tokens=9, chunk_tokens=4)),
    ("admit bad prompt", lambda m, v: m.cache.admit("z", ["a"], prompt_tokens=_pick(BAD_INTS + (0,), v),
                                                    chunk_tokens=4)),
    ("admit bad chunk", lambda m, v: m.cache.admit("z", ["a"], prompt_tokens=9, chunk_tokens=_pick(BAD_INTS + (0,), v))),
    ("admit a running request", lambda m, v: m.cache.admit(m.some_request(v, ("running", "loading")), ["a"],
                                                           prompt_tokens=9, chunk_tokens=4)),
    ("step_done unknown", lambda m, v: m.cache.step_done(_pick(BAD_IDS, v), 0)),
    ("step_done bad tokens", lambda m, v: m.cache.step_done(m.some_request(v), _pick(BAD_INTS, v))),
    ("step_done bad units", lambda m, v: m.cache.step_done(m.some_request(v), 0,
                                                           new_units=_pick(BAD_KEYS[:4], v))),
    ("step_done bad checkpoint", lambda m, v: m.cache.step_done(m.some_request(v), 0,
                                                                checkpoint=_pick(BAD_BOOLS, v))),
    ("step_done nothing owed", lambda m, v: m.cache.step_done(
        next((rid for rid, r in sorted(views.requests(m.cache).items()) if r.owed_forward == 0), "nobody"), 0)),
    ("step_done too many tokens", lambda m, v: m.cache.step_done(
        next((rid for rid, r in sorted(views.requests(m.cache).items()) if r.owed_forward > 0
              and r.state == "running"), "nobody"), 10_000)),
    ("reserve bad tokens", lambda m, v: m.cache.reserve(m.some_request(v), _pick(BAD_INTS + (0,), v))),
    ("reserve unknown", lambda m, v: m.cache.reserve(_pick(BAD_IDS, v), 1)),
    ("reserve wrong state", lambda m, v: m.cache.reserve(m.some_request(v, ("waiting", "finished", "aborted",
                                                                            "retracted", "finishing")), 1)),
    ("layer_ready bad layer", lambda m, v: m.cache.layer_ready(m.some_request(v), _pick((-1, 99, "x", True), v))),
    ("layer_ready unknown", lambda m, v: m.cache.layer_ready(_pick(BAD_IDS, v), 0)),
    ("finish wrong state", lambda m, v: m.cache.finish(m.some_request(v, ("waiting", "loading", "finished",
                                                                          "aborted", "retracted", "finishing")))),
    ("retract wrong state", lambda m, v: m.cache.retract(m.some_request(v, ("waiting", "loading", "finished",
                                                                            "aborted", "retracted")))),
    ("resume wrong state", lambda m, v: m.cache.resume(m.some_request(v, ("running", "loading", "finished",
                                                                          "aborted", "finishing")), 4)),
    ("resume bad chunk", lambda m, v: m.cache.resume(m.some_request(v), _pick(BAD_INTS + (0,), v))),
    ("abort bad reason", lambda m, v: m.cache.abort(m.some_request(v), _pick((None, "", 5), v))),
    ("abort unknown", lambda m, v: m.cache.abort(_pick(BAD_IDS, v))),
    ("abort_victim bad", lambda m, v: m.cache.abort_victim(_pick((None, "a", 5), v))),
    ("abort_victim bad reason", lambda m, v: m.cache.abort_victim(["r0"], _pick((None, ""), v))),
    ("allows bad call", lambda m, v: m.cache.allows(m.some_request(v), _pick(("fly", "", 5), v))),
    ("state unknown", lambda m, v: m.cache.state(_pick(BAD_IDS, v))),
    ("request unknown", lambda m, v: m.cache.request(_pick(BAD_IDS, v))),
    ("page_table unknown", lambda m, v: m.cache.page_table(_pick(BAD_IDS, v))),
    ("advance_step bad", lambda m, v: m.cache.advance_step(_pick(BAD_INTS + (0,), v))),
    ("complete bad", _bad_completion),
    ("step bad batch", _bad_step),
    ("step refusing items", _step_refusing),
    # the core's calls
    ("match bad key", lambda m, v: m.cache.core.match(_pick((5, None), v))),
    ("match bad mode", lambda m, v: m.cache.core.match(["a"], _pick(("fuzzy", 5, None), v))),
    ("lock foreign node", lambda m, v: m.cache.core.lock(_pick((None, "node"), v) if v % 3 else _foreign_node(m))),
    ("lock root", lambda m, v: m.cache.core.lock(m.cache.core.root)),
    ("unlock released", lambda m, v: m.cache.core.unlock(_released(m, v))),
    ("unlock not a receipt", lambda m, v: m.cache.core.unlock(_pick((None, 5, "r"), v))),
    ("release not a receipt", lambda m, v: m.cache.core.release(_pick((None, 5, "r"), v))),
    ("release released", lambda m, v: m.cache.core.release(_released(m, v))),
    ("borrow without device pages", lambda m, v: m.cache.core.borrow([m.some_node(v, ("host",))])),
    ("borrow foreign", lambda m, v: m.cache.core.borrow([_foreign_node(m)])),
    ("pin without host copy", lambda m, v: m.cache.core.pin([m.some_node(v, ("device",))])),
    ("poison unknown op", lambda m, v: m.cache.core.poison(10**9 + v)),
    ("free pages not held", lambda m, v: m.cache.core.free_device(
        {m.cache.core.history_groups[0]: [_pick((10**6, -1), v)]})),
    ("free tree pages", lambda m, v: m.cache.core.free_device(
        {g: list(p[:1]) for g, p in m.some_node(v, ("device", "backed")).dev.items()})),
    ("alloc bad need", lambda m, v: m.cache.core.alloc_device(_pick(({"nogroup": 1}, {"kv": -1}, {"kv": "2"}), v))),
    ("insert bad", _bad_insert),
    ("load stale match", lambda m, v: _load_stale(m, v)),
    # configuration, records and the spec
    ("bad layout", lambda m, v: _bad_layout(v)),
    ("bad record", lambda m, v: _bad_record(v)),
    ("bad config", _bad_config),
    ("bad spec", lambda m, v: _bad_spec(v)),
    ("bad names", lambda m, v: _bad_names(v)),
]
from .misuse_cases import MORE_CASES  # noqa: E402  (the refusals the cases above do not take)

CASES += MORE_CASES


def _load_stale(m: MisuseMachine, v: int) -> None:
    core = m.cache.core
    core.load(core.match(["zz", "zz"]), "hostile")  # no host hit to load back
