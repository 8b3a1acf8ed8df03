"""Run the product and the reference model side by side and fail on the first difference.

The product is a :class:`kvtier.tiered.TieredCache` whose transfers complete at once
(every command :meth:`~kvtier.tiered.TieredCache.poll` hands out is completed, on every
rank, before the next call; the writeback quota is unbounded so that one poll issues
every queued writeback); the model is :class:`kvtier.testing.reference.ReferenceCache`.
Both get the same calls, one request at a time, the way ``bench/bookkeeping.py`` drives
the peers' method: ``admit`` (the whole prompt as one chunk; after a short admission,
drain and try again, three tries), drain, ``step_done``, ``finish``, drain. After every
call the driver compares the admission's hit tokens by tier and the victims of the call
(every ``demote``, ``evict_device``, ``drop_host``, ``evict_host``, by unit path and
size, in order); every ``residency_every`` requests and at the end it compares every
node of the tree (unit path, size, residency).

A difference raises :class:`Divergence` with the request index, the calls so far and
both answers. Usage::

    from kvtier.testing.reference_driver import ReferenceConfig, compare_requests
    result = compare_requests(requests, layout, ReferenceConfig(device=64, host=128, policy="write_back"))
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.fsm import Completion, Family, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.machines import node_lifecycle

from ..tiered import TieredCache
from . import _views
from .reference import Hit, ReferenceCache

__all__ = ["ReferenceConfig", "CompareResult", "Divergence", "Request", "compare_requests", "configs", "conversations"]

#: the node events that take pages from a tier, as the model's victims name them
_VICTIM_EVENTS = frozenset({"demote", "evict_device", "drop_host", "evict_host"})
_TRIES = 3


@dataclass(frozen=True)
class ReferenceConfig:
    """One configuration: capacities in units, the policies of ``TieredCache``."""

    device: int
    host: int | None = None
    policy: str = "write_through"
    eviction: str = "lru"
    exclusive: bool = False
    write_threshold: int = 2

    def label(self) -> str:
        host = f"/{self.host}" if self.host is not None else "/-"
        return (f"{self.device}{host} {self.policy if self.host is not None else '-'} {self.eviction}"
                + (" exclusive" if self.exclusive else ""))


def configs(device: int, hosts: Iterable[int | None]) -> list[ReferenceConfig]:
    """Every legal combination at these capacities: without a host tier the write policy
    and the exclusive tier do not apply (one configuration per eviction policy)."""
    out = []
    for host in hosts:
        for eviction in ("lru", "lru_turns", "lru2"):
            if host is None:
                out.append(ReferenceConfig(device, None, "write_through", eviction))
                continue
            for policy in ("write_through", "write_back", "write_through_selective"):
                for exclusive in (False, True):
                    out.append(ReferenceConfig(device, host, policy, eviction, exclusive))
    return out


@dataclass
class CompareResult:
    """What a run compared: requests, admissions refused (short), evictions, seconds."""

    config: ReferenceConfig
    requests: int = 0
    refused: int = 0
    victims: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    seconds: float = 0.0


class Divergence(AssertionError):
    """The product and the model disagree.

    Attributes:
        index: the request's index in the list compared.
        request_id: its id.
        what: what differed (``admit``, ``victims``, ``residency``).
        calls: every call made so far, as ``(call, arguments)`` tuples (a reproduction).
        product, model: the two answers.
    """

    def __init__(self, index: int, request_id: str, what: str, calls: list[tuple[str, tuple[Any, ...]]],
                 product: Any, model: Any, config: ReferenceConfig) -> None:
        self.index, self.request_id, self.what, self.calls = index, request_id, what, calls
        self.product, self.model, self.config = product, model, config
        recent = "\n".join(f"  {c}{a!r}" for c, a in calls[-12:])
        super().__init__(f"{config.label()}: request #{index} ({request_id!r}) differs in {what} after "
                         f"{len(calls)} calls:\n  product: {_short(product)}\n  model:   {_short(model)}\n"
                         f"last calls:\n{recent}")


class _Product:
    """The product with instant transfers and its victims, observed through the node
    lifecycle's observer (``kvtier.fsm.lifecycle.machines.Lifecycle.observer``)."""

    def __init__(self, layout: CacheLayout, cfg: ReferenceConfig) -> None:
        self.cache = TieredCache(layout, cfg.device, cfg.host, policy=cfg.policy, eviction=cfg.eviction,
                                 exclusive=cfg.exclusive, write_threshold=cfg.write_threshold,
                                 max_writebacks_in_flight=1 << 30, op_deadline_steps=None)
        self.victims: list[tuple[str, tuple[Hashable, ...], int]] = []

    def observe(self, lifecycle: Any, subject: Any, event: str, src: str, dst: str) -> None:
        if event in _VICTIM_EVENTS:
            self.victims.append((event, _path(subject), len(subject.key)))

    def drain(self) -> None:
        while True:
            commands = self.cache.poll().commands
            if not commands:
                return
            for cmd in commands:
                for rank in range(self.cache.core.world_size):
                    self.cache.complete(Completion(cmd.op_id, rank, True, None))

    def residency(self) -> dict[tuple[Hashable, ...], tuple[int, str]]:
        return {_path(n): (len(n.key), str(n.state)) for n in _views.nodes(self.cache.core).values()}


def compare_requests(requests: Sequence[Any], layout: CacheLayout, cfg: ReferenceConfig, *,
                     residency_every: int = 0) -> CompareResult:
    """Drive both on ``requests`` (records with ``request_id``, ``units``, ``prompt_tokens``,
    e.g. :func:`kvtier.replay.trace_requests`); raise :class:`Divergence` on the first
    difference. ``residency_every``: also compare the whole tree every that many requests
    (0: only at the end).

    Raises:
        Divergence: the first difference.
        UsageError: ``layout`` has continuation-state groups (the model has none).
        ConfigError: ``cfg`` is not a legal ``TieredCache`` configuration.
    """
    state = [g.name for g in layout.groups if g.family is not Family.HISTORY]
    if state:
        raise UsageError(f"compare_requests: the reference model has no continuation-state groups; layout has {state}")
    t0 = time.perf_counter()
    product = _Product(layout, cfg)
    model = ReferenceCache(layout.alignment, cfg.device, cfg.host, policy=cfg.policy, eviction=cfg.eviction,
                           exclusive=cfg.exclusive, write_threshold=cfg.write_threshold)
    out = CompareResult(cfg)
    calls: list[tuple[str, tuple[Any, ...]]] = []
    lifecycle = node_lifecycle()
    previous = lifecycle.observer

    def observer(*args: Any) -> None:
        product.observe(*args)
        if previous is not None:
            previous(*args)

    lifecycle.observer = observer
    try:
        for i, r in enumerate(requests):
            rid, units, prompt = r.request_id, tuple(r.units), r.prompt_tokens

            def check(what: str, got: Any, want: Any) -> None:
                if got != want:
                    if isinstance(got, dict) and isinstance(want, dict):
                        got, want = _dict_diff(got, want)
                    raise Divergence(i, rid, what, list(calls), got, want, cfg)

            def victims(call: str) -> None:
                got, want = product.victims, model.take_victims()
                product.victims = []
                out.victims += len(got)
                check(f"victims of {call}", got, want)

            adm = hit = None
            for _ in range(_TRIES):
                calls.append(("admit", (rid, units, prompt, prompt)))
                adm = product.cache.admit(rid, units, prompt, prompt)
                hit = model.admit(rid, units, prompt, prompt)
                got = None if adm is None else Hit(adm.device_hit_tokens, adm.hit_tokens - adm.device_hit_tokens)
                check("admit", got, hit)
                victims("admit")
                if adm is not None:
                    break
                calls.append(("drain", ()))
                product.drain()
                model.drain()
                victims("drain")
            out.requests += 1
            if adm is None or hit is None:
                out.refused += 1
                continue
            out.hit_tokens += hit.hit_tokens
            out.host_hit_tokens += hit.host_tokens
            computed = prompt - adm.start_token
            for call in ("drain", "step_done", "finish", "drain"):
                calls.append((call, (rid, computed) if call == "step_done" else (rid,) if call == "finish" else ()))
                if call == "drain":
                    product.drain()
                    model.drain()
                elif call == "step_done":
                    product.cache.step_done(rid, computed)
                    model.step_done(rid, computed)
                else:
                    product.cache.finish(rid)
                    model.finish(rid)
                victims(call)
            if residency_every and (i + 1) % residency_every == 0:
                check("residency", product.residency(), model.residency())
        if requests:
            last = requests[-1]
            tree, shadow = product.residency(), model.residency()
            if tree != shadow:
                raise Divergence(len(requests) - 1, last.request_id, "residency", list(calls),
                                 *_dict_diff(tree, shadow), cfg)
    finally:
        lifecycle.observer = previous
    out.seconds = time.perf_counter() - t0
    return out


@dataclass(frozen=True)
class Request:
    """One request of :func:`conversations` (the fields ``compare_requests`` reads)."""

    request_id: str
    units: tuple[Hashable, ...]
    prompt_tokens: int


def conversations(count: int, alignment: int, *, chats: int = 12, seed: int = 0) -> list[Request]:
    """A deterministic conversation workload that reuses a lot: ``chats`` conversations on
    three shared system prompts; each request continues one of them (its whole history,
    one to four new units), forks one at a random point, or starts a new one; a prompt
    ends inside a unit, or exactly at a unit's end (the last unit is then recomputed)."""
    rng = random.Random(seed)
    systems = [tuple(("sys", s, i) for i in range(1 + s)) for s in range(3)]
    history: list[tuple[Hashable, ...]] = [systems[rng.randrange(3)] for _ in range(chats)]
    out = []
    for i in range(count):
        c = rng.randrange(chats)
        roll = rng.random()
        if roll < 0.1 or len(history[c]) > 40:
            history[c] = systems[rng.randrange(3)]
        elif roll < 0.2:
            other = history[rng.randrange(chats)]
            history[c] = other[:rng.randint(1, len(other))]
        units = history[c] + tuple(("u", i, j) for j in range(rng.randint(1, 4)))
        tail = 0 if rng.random() < 0.2 else rng.randint(1, alignment - 1)
        out.append(Request(f"c{i}", units, len(units) * alignment - (alignment - tail if tail else 0)))
        history[c] = units + (("a", i),)
    return out


def _path(node: Any) -> tuple[Hashable, ...]:
    """A product node's unit path from the root to its last unit."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(u for part in reversed(parts) for u in part)


def _dict_diff(got: dict[Any, Any], want: dict[Any, Any], limit: int = 4) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The entries where two residencies differ (at most ``limit`` of them)."""
    keys = sorted((k for k in got.keys() | want.keys() if got.get(k) != want.get(k)), key=len)[:limit]
    return {k: got.get(k) for k in keys}, {k: want.get(k) for k in keys}


def _short(x: Any, limit: int = 600) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + " ..."
