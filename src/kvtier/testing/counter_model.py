"""The operator counters against counts kept independently (``model_counters``).

:class:`CounterModel` watches one :class:`~kvtier.tiered.TieredCache` from outside: it wraps
the cache's public calls and the core's node trigger on that instance (nothing of the
product is changed) and counts the events each operator counter stands for, from what the
calls answered and what :meth:`~kvtier.tiered.TieredCache.poll` reported:

- ``admissions``, ``prompt_tokens``, ``hit_tokens_device``, ``hit_tokens_host``: the
  admissions ``admit`` accepted, their prompts and the hits their answers carry;
  ``resumptions``: the resumes accepted; ``retractions``: the retracts accepted;
- ``aborts`` by reason: the ``aborted`` ends :meth:`poll` reported with that reason (right
  after every poll, when every end so far has been reported); ``scheduler_aborts``: the
  victims ``abort_victim`` returned plus the ends reported as ``retract writeback failed``;
- ``invariant_checks`` / ``invariant_failures``: the ``check_invariants`` calls made and
  those that raised;
- the core's ``demotions``, ``device_evictions``, ``host_evictions``, ``host_drops`` and
  ``splits``: the node events ``demote``, ``evict_device``, ``evict_host``, ``drop_host`` and
  ``split`` fired; ``triggers``: every node event fired through the store's trigger;
- ``writebacks`` and ``loadbacks`` (and ``pages_written`` / ``pages_loaded``): never fewer
  than the commands :meth:`poll` handed out (their pages); at the drain, the commands handed
  out plus those withdrawn, and at most the expired ones more (an operation can expire before
  its command is handed out);
- ``settled``: every operation issued settles once (checked at the drain: the outcomes add
  up to the operations issued, ``deadline`` never passes the expired ones, and ``ok`` never
  exceeds the operations every rank acknowledged and none failed).

Each counter must move exactly when its event happens, by the right amount: a counter that
counts a refused call, counts twice, takes the wrong size or the wrong reason fails with
:class:`~kvtier.testing.models.ModelViolation` ``model_counters`` at the next check.
:meth:`check_metrics` (after every :attr:`CounterModel.metrics_every` polls that reported
something, and at the facade's drain) compares what the Prometheus collector
(:mod:`kvtier.metrics`, when ``prometheus_client`` is installed) exports with the same counts
and with gauges computed from the pools and the tree: pages used and free per tier and
group, pinned pages (host pages of pinned nodes), locked pages (device pages of nodes with a
lock), requests per state, operations in flight per direction, the totals of
``cache.stats()`` (``model_metrics``); the abort rows by reason with the label bound applied
to the counts (:mod:`kvtier.testing.label_bounds`, ``model_label_bounds``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.fsm import Direction

from . import _views as views
from .engine_stats import page_bytes_by_group
from .label_bounds import check_abort_series
from .models import ModelViolation

if TYPE_CHECKING:
    from ..tiered import TieredCache

__all__ = ["CounterModel"]


class _Wrapped:
    """``owner``'s method ``name`` (looked up on its class at every call, so that a class
    patched later takes effect), or ``inner`` (a callable it replaces), called, then
    ``after(result, *args)``; an object, not a closure, so that a copy of the machine
    (``kvtier verify`` copies and pickles its states) calls its own copy of the cache and
    counts in its own copy of the model."""

    def __init__(self, owner: Any, name: str, after: Callable[..., None], *,
                 inner: Callable[..., Any] | None = None, before: Callable[[], None] | None = None) -> None:
        self.owner, self.name, self.after, self.inner, self.before = owner, name, after, inner, before

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return getattr(type(self.owner), self.name)(self.owner, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
            try:
                out = self._call(*args, **kwargs)
            except BaseException:
                self.after(None, failed=True)
                raise
            self.after(out)
            return out
        out = self._call(*args, **kwargs)
        self.after(out, *args, **kwargs)
        return out


#: node event -> the core counter that counts it
_NODE_COUNTERS = {"demote": "demotions", "evict_device": "device_evictions", "evict_host": "host_evictions",
                  "drop_host": "host_drops", "split": "splits"}
_FACADE = ("admissions", "resumptions", "prompt_tokens", "hit_tokens_device", "hit_tokens_host", "retractions",
           "invariant_checks", "invariant_failures")


class CounterModel:
    """Independent counts of the events behind ``cache.stats()`` (module doc); ``watch``
    installs the wrappers on ``cache`` (an instance: its class is left alone)."""

    #: the exporter is checked after every this many polls that reported something
    metrics_every = 8

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self.n: Counter[str] = Counter()
        self.aborts: Counter[str] = Counter()
        self.victims = 0
        self.node: Counter[str] = Counter()
        self.issued: Counter[str] = Counter()  # direction -> commands handed out
        self.pages: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()  # direction -> bytes of the commands handed out
        self.page_bytes = page_bytes_by_group(cache.layout)
        self.failed_ops: set[int] = set()  # ops some rank reported failed
        self.acked: dict[int, set[int]] = {}  # op -> ranks that acknowledged it ok
        self.op_dir: dict[int, str] = {}
        self.polls = 0  # polls that reported something
        self.engine: tuple[Any, Any] | None = None  # (an engine the exporter reads, its EngineStatsModel)
        self._watch()

    # -- the wrappers ------------------------------------------------------------------
    def _watch(self) -> None:
        cache, core = self.cache, self.cache.core
        for name, after in (("admit", self._admitted), ("resume", self._resumed), ("retract", self._retracted),
                            ("abort_victim", self._victim), ("poll", self._polled), ("complete", self._completed)):
            setattr(cache, name, _Wrapped(cache, name, after))
        cache.check_invariants = _Wrapped(cache, "check_invariants", self._checked,  # type: ignore[method-assign]
                                          before=self._checking)
        core.trigger = _Wrapped(core, "trigger", self._triggered, inner=core.trigger)  # the one it replaces

    def _admitted(self, adm: Any, request_id: str, units: Any, prompt_tokens: int, *a: Any, **k: Any) -> None:
        if adm is not None:
            n = self.n
            n["admissions"] += 1
            n["prompt_tokens"] += int(prompt_tokens)
            n["hit_tokens_device"] += adm.device_hit_tokens
            n["hit_tokens_host"] += adm.hit_tokens - adm.device_hit_tokens

    def _resumed(self, adm: Any, *a: Any, **k: Any) -> None:
        self.n["resumptions"] += adm is not None

    def _retracted(self, _: Any, *a: Any, **k: Any) -> None:
        self.n["retractions"] += 1

    def _victim(self, rid: Any, *a: Any, **k: Any) -> None:
        self.victims += rid is not None

    def _polled(self, out: Any) -> None:
        for c in out.commands:
            d = c.direction.value
            self.issued[d] += 1
            self.pages[d] += sum(len(t.src_pages) for t in c.transfers)
            self.bytes[d] += sum(len(t.src_pages) * self.page_bytes[t.group] for t in c.transfers)
            self.op_dir[c.op_id] = d
        for ev in out.events:
            if ev.state == "aborted":
                self.aborts[ev.reason or "unknown"] += 1
        if out.events or out.commands:  # (an empty poll: the step's own check covers it)
            self.check(after_poll=True)
            self.polls += 1
            if self.polls % self.metrics_every == 0:  # (bounded cost: one collect per metrics_every polls)
                self.check_metrics()

    def _completed(self, _: Any, c: Any) -> None:
        if c.layer is not None:
            return
        if c.ok:
            self.acked.setdefault(c.op_id, set()).add(c.rank)
        else:
            self.failed_ops.add(c.op_id)

    def _checking(self) -> None:
        self.n["invariant_checks"] += 1

    def _checked(self, _: Any, failed: bool = False) -> None:
        self.n["invariant_failures"] += failed

    def _triggered(self, _: Any, node: Any, event: str) -> None:  # after the trigger: a refused one raised
        self.node["triggers"] += 1
        name = _NODE_COUNTERS.get(event)
        if name is not None:
            self.node[name] += 1

    # -- the checks --------------------------------------------------------------------
    def _fail(self, what: str, invariant: str = "model_counters") -> None:
        raise ModelViolation(invariant, "the cache's operator counters" if invariant == "model_counters"
                             else "the Prometheus exporter (KvtierCollector)", what)

    def check(self, *, after_poll: bool = False) -> None:
        """Every counter against the model's count (the abort counts only ``after_poll``)."""
        stats = self.cache.stats()
        fac = stats["facade"]
        for k in _FACADE:
            if fac[k] != self.n[k]:
                self._fail(f"facade counter {k} is {fac[k]}, the calls made {self.n[k]}")
        for k in (*_NODE_COUNTERS.values(), "triggers"):
            if stats[k] != self.node[k]:
                self._fail(f"core counter {k} is {stats[k]}, the node events fired {self.node[k]}")
        wb, lb = Direction.WRITEBACK.value, Direction.LOADBACK.value
        if stats["loadbacks"] < self.issued[lb] or stats["writebacks"] < self.issued[wb]:
            self._fail(f"core counters writebacks={stats['writebacks']} loadbacks={stats['loadbacks']} below the "
                       f"commands handed out ({self.issued[wb]} writebacks, {self.issued[lb]} loadbacks)")
        if stats["pages_written"] < self.pages[wb] or stats["pages_loaded"] < self.pages[lb]:
            self._fail(f"core counters pages_written={stats['pages_written']} pages_loaded={stats['pages_loaded']} "
                       f"below the pages of the commands handed out ({self.pages[wb]}, {self.pages[lb]})")
        if not after_poll:
            return
        if fac["aborts"] != dict(self.aborts):
            self._fail(f"facade counter aborts is {fac['aborts']}, the polls reported {dict(self.aborts)}")
        sched = self.victims + self.aborts["retract writeback failed"]
        if stats["scheduler_aborts"] != sched:
            self._fail(f"scheduler_aborts is {stats['scheduler_aborts']}: abort_victim took {self.victims}, "
                       f"{self.aborts['retract writeback failed']} retract writebacks failed")

    def check_drained(self) -> None:
        """At the drain (nothing in flight, every command handed out): the exact command and
        page counts, and every operation settled once with a possible outcome."""
        self.check(after_poll=True)
        stats = self.cache.stats()
        wb, lb = Direction.WRITEBACK.value, Direction.LOADBACK.value
        issued = stats["writebacks"] + stats["loadbacks"]
        handed = self.issued[wb] + self.issued[lb] + stats["withdrawn_ops"]
        if not handed <= issued <= handed + stats["expired_ops"]:
            self._fail(f"core counters writebacks={stats['writebacks']} loadbacks={stats['loadbacks']}: "
                       f"{self.issued[wb]} + {self.issued[lb]} commands handed out, "
                       f"{stats['withdrawn_ops']} withdrawn, {stats['expired_ops']} expired")
        settled = stats["facade"]["settled"]
        total = sum(settled.values())
        if total != issued:
            self._fail(f"facade counter settled adds up to {total} ({settled}), {issued} operations issued")
        if settled.get(f"{wb}/deadline", 0) + settled.get(f"{lb}/deadline", 0) > stats["expired_ops"]:
            self._fail(f"facade counter settled {settled} counts more deadlines than the "
                       f"{stats['expired_ops']} operations expired")
        world = self.cache.core.world_size
        for d in (wb, lb):
            ok = settled.get(f"{d}/ok", 0)
            could = sum(1 for op, ranks in self.acked.items()
                        if self.op_dir.get(op) == d and len(ranks) == world and op not in self.failed_ops)
            if ok > could:
                self._fail(f"facade counter settled[{d}/ok] is {ok}: only {could} {d} operations were "
                           f"acknowledged ok by every rank")

    def check_metrics(self) -> None:
        """The Prometheus collector's series against the model's counts and the pools
        (skipped without ``prometheus_client``)."""
        try:
            from ..metrics import KvtierCollector
        except ImportError:  # pragma: no cover - the metrics extra is not installed
            return
        got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        engine, engine_model = self.engine if self.engine is not None else (None, None)
        for fam in KvtierCollector(self.cache, engine).collect():
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    got[(s.name, tuple(sorted(s.labels.items())))] = s.value
        stats = self.cache.stats()
        fac = stats["facade"]
        want: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {
            ("kvtier:prompt_tokens_total", ()): self.n["prompt_tokens"],
            ("kvtier:prompt_tokens_cached_total", (("source", "device"),)): self.n["hit_tokens_device"],
            ("kvtier:prompt_tokens_cached_total", (("source", "host"),)): self.n["hit_tokens_host"],
            ("kvtier:requests_admitted_total", ()): self.n["admissions"],
            ("kvtier:requests_resumed_total", ()): self.n["resumptions"],
            ("kvtier:retractions_total", ()): self.n["retractions"],
            ("kvtier:demotions_total", ()): self.node["demotions"],
            ("kvtier:host_drops_total", ()): self.node["host_drops"],
            ("kvtier:lifecycle_transitions_total", ()): self.node["triggers"],
            ("kvtier:evictions_total", (("tier", "device"),)): self.node["device_evictions"],
            ("kvtier:evictions_total", (("tier", "host"),)): self.node["host_evictions"],
            ("kvtier:joined_loadbacks_total", ()): stats["joined_loadbacks"],
            ("kvtier:late_completions_absorbed_total", ()): stats["absorbed_late_completions"],
            ("kvtier:invariant_checks_total", ()): self.n["invariant_checks"],
            ("kvtier:invariant_check_failures_total", ()): self.n["invariant_failures"],
            ("kvtier:transfer_pages_total", (("direction", "writeback"),)): stats["pages_written"],
            ("kvtier:transfer_pages_total", (("direction", "loadback"),)): stats["pages_loaded"],
        }
        check_abort_series({dict(labels)["reason"]: v for (name, labels), v in got.items()
                            if name == "kvtier:aborts_total"}, self.aborts)  # (model_label_bounds)
        for key, v in fac["settled"].items():
            d, o = key.split("/")
            want[("kvtier:operations_total", (("direction", d), ("outcome", o)))] = v
        core = self.cache.core
        tiers = {"device": core.device, "host": core.host or {}}
        for tier, pools in tiers.items():
            for g, alloc in pools.items():
                want[("kvtier:pages_used", (("group", g), ("tier", tier)))] = alloc.used
                want[("kvtier:pages_free", (("group", g), ("tier", tier)))] = alloc.capacity - alloc.used
        pinned: Counter[str] = Counter()
        locked: Counter[str] = Counter()
        for node in views.nodes(core).values():
            if node.host_pin:
                for pm in (node.host, node.host_ckpt):
                    for g, p in pm.items():
                        pinned[g] += len(p)
            if node.lock_ref:
                for pm in (node.dev, node.dev_ckpt):
                    for g, p in pm.items():
                        locked[g] += len(p)
        for g in core.device:
            want[("kvtier:pages_pinned", (("group", g),))] = pinned[g]
            want[("kvtier:pages_locked", (("group", g),))] = locked[g]
        flying: Counter[str] = Counter(o.command.direction.value for o in views.ops(core).values())
        for d in Direction:
            want[("kvtier:operations_in_flight", (("direction", d.value),))] = flying[d.value]
        states: Counter[str] = Counter(r.state for r in views.requests(self.cache).values())
        for name, labels in got:
            if name == "kvtier:requests":
                want[(name, labels)] = states[dict(labels)["state"]]  # (a state no request is in: 0)
        for s, k in states.items():
            want[("kvtier:requests", (("state", s),))] = k
        for d in Direction:  # the engine's bytes (0 without one): exact unless a flush's issue failed
            key = ("kvtier:transfer_bytes_total", (("direction", d.value),))
            lo, hi = engine_model.bytes_range(d.value) if engine_model is not None else (0, 0)
            if not (isinstance(got.get(key), float | int) and lo <= got[key] <= hi):
                self._fail(f"metric {key[0]}{dict(key[1])} exports {got.get(key)}, the engine's flushes copied "
                           f"{lo} to {hi} bytes", "model_metrics")
        for key, v in want.items():
            if got.get(key) != v:
                self._fail(f"metric {key[0]}{dict(key[1])} exports {got.get((key[0], key[1]))}, the model counts {v}",
                           "model_metrics")
