"""An independent reference of vLLM's ``OffloadingManager`` contract (no vLLM import).

Written from the contract vLLM documents for an offloading manager
(``vllm/v1/kv_offload/base.py``), not from kvtier's adapter: a block becomes loadable
when ``complete_store`` reports its store done; a block whose store is in flight is found
but not readable (``HIT_PENDING``, never ``HIT``); ``prepare_store`` returns the blocks to
store and the blocks it evicted (or ``None``: nothing can be stored, nothing changes);
blocks being stored, or prepared to load until ``complete_load``, are protected from
eviction; ``complete_store(success=False)`` removes the blocks not stored. A block whose
store completed and that no eviction reported stays found (a lookup answering ``MISS`` for it
lost it). A refused ``prepare_store`` and a call that raises change nothing: the lookups of a
sample of the blocks stored and in flight answer the same after it as before it (a
``complete_store`` whose keys cover one prepared store whole and another in part must raise,
settling neither: :meth:`OffloadContract.complete_mixed`).

:class:`OffloadContract` wraps the methods of one manager instance (any object with the
``OffloadingManager`` methods) and checks every answer against its own model: plain sets
and counters of keys. It raises :class:`~kvtier.fsm.errors.InvariantViolation`
(``offload_contract``) on the first answer the contract does not allow.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Hashable
from typing import Any

from kvtier.fsm.errors import InvariantViolation

#: keys evicted or failed that the probe and the model remember (the oldest are forgotten)
GONE_CAP = 64
#: blocks stored and blocks in flight whose lookups a call that must change nothing compares
SAMPLE = 8

__all__ = ["OffloadContract"]


class OffloadContract:
    """The reference beside ``manager`` (module doc); installs itself on the instance.

    Attributes:
        stored: keys whose store completed and which no eviction reported since.
        storing: key -> stores in flight (returned by ``prepare_store``, not completed).
        loading: key -> ``prepare_load`` pins not yet released by ``complete_load``.
        lookups: lookups checked (a run that checks none has no oracle).
        gone: keys evicted or whose store failed (probed: never HIT), the last
            :data:`GONE_CAP` (insertion ordered).
        stores: the prepared stores in flight: (keys not completed yet, the request's context).
        probe_ctx: the context of the lookups that compare the manager before and after a
            call that must change nothing (``None``: no comparison).
    """

    def __init__(self, manager: Any, probe_ctx: Any = None) -> None:
        self.manager = manager
        self.stored: set[Hashable] = set()
        self.storing: Counter[Hashable] = Counter()
        self.loading: Counter[Hashable] = Counter()
        self.lookups = 0
        self.gone: dict[Hashable, None] = {}
        self.stores: list[tuple[set[Hashable], Any]] = []
        self.probe_ctx = probe_ctx
        self._lookup_orig = manager.lookup
        for name in ("lookup", "prepare_load", "complete_load", "prepare_store", "complete_store"):
            setattr(manager, name, self._wrap(name, getattr(manager, name)))

    def _fail(self, where: str, detail: str) -> None:
        raise InvariantViolation("offload_contract", where, detail)

    def _forget(self, key: Hashable) -> None:
        self.gone.pop(key, None)

    def _lost(self, key: Hashable) -> None:
        self.gone.pop(key, None)
        self.gone[key] = None
        while len(self.gone) > GONE_CAP:
            del self.gone[next(iter(self.gone))]

    def _snapshot(self) -> dict[Hashable, str] | None:
        """The lookup answers of a sample of the stored and in-flight blocks (unchecked)."""
        if self.probe_ctx is None:
            return None
        keys = heapq.nsmallest(SAMPLE, self.stored, key=repr) + [k for k, n in self.storing.items() if n][:SAMPLE]
        out = {}
        for k in keys:
            res = self._lookup_orig(k, self.probe_ctx)
            out[k] = getattr(res, "name", str(res))
        return out

    def _unchanged(self, before: dict[Hashable, str] | None, what: str) -> None:
        after = self._snapshot() if before is not None else None
        if before is None or after is None:
            return
        diff = [f"{k!r}: {before[k]} -> {after.get(k)}" for k in before if after.get(k) != before[k]][:4]
        if diff:
            self._fail(what, f"changed what the manager answers: {diff}")

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        check = getattr(self, "_" + name)
        guarded = name != "lookup"

        def call(*args: Any, **kwargs: Any) -> Any:
            before = self._snapshot() if guarded else None
            try:
                out = orig(*args, **kwargs)
            except Exception as exc:
                if not isinstance(exc, InvariantViolation):
                    self._unchanged(before, f"{name} that raised {type(exc).__name__}")
                raise
            if name == "prepare_store" and out is None:
                self._unchanged(before, "a refused prepare_store (it returned None)")
            check(out, *args, **kwargs)
            return out
        return call

    def _lookup(self, out: Any, key: Hashable, *_: Any, **__: Any) -> None:
        self.lookups += 1
        res = getattr(out, "name", str(out))
        if res == "HIT" and key not in self.stored:
            state = "its store is in flight" if self.storing[key] else "no store of it completed (or it was evicted)"
            self._fail(f"lookup of {key!r}", f"answered HIT, but {state}")
        if res == "HIT_PENDING" and not self.storing[key]:
            self._fail(f"lookup of {key!r}", "answered HIT_PENDING, but no store of it is in flight")
        if res == "MISS" and key in self.stored and not self.storing[key]:
            self._fail(f"lookup of {key!r}", "answered MISS, but its store completed and no eviction reported it")

    def _prepare_load(self, out: Any, keys: Collection[Hashable], *_: Any, **__: Any) -> None:
        for k in keys:
            if k not in self.stored:
                self._fail(f"prepare_load of {k!r}", "the block is not loadable (a lookup never could answer HIT)")
            self.loading[k] += 1

    def _complete_load(self, out: Any, keys: Collection[Hashable], *_: Any, **__: Any) -> None:
        for k in keys:
            if self.loading[k]:
                self.loading[k] -= 1

    def _prepare_store(self, out: Any, keys: Collection[Hashable], ctx: Any = None, *_: Any, **kw: Any) -> None:
        if out is None:  # refused: nothing was evicted, nothing is being stored
            return
        asked = set(keys)
        for k in out.keys_to_store:
            if k not in asked:
                self._fail(f"prepare_store of {len(asked)} blocks", f"stores {k!r}, which was not asked for")
            self.storing[k] += 1
        if out.keys_to_store:
            self.stores.append((set(out.keys_to_store), ctx if ctx is not None else kw.get("req_context")))
        for k in out.evicted_keys:
            if self.loading[k]:
                self._fail(f"prepare_store eviction of {k!r}", "evicted a block pinned by prepare_load")
            if self.storing[k] and k not in out.keys_to_store:
                self._fail(f"prepare_store eviction of {k!r}", "evicted a block whose store is in flight")
            self.stored.discard(k)
            self._lost(k)

    def _complete_store(self, out: Any, keys: Collection[Hashable], ctx: Any = None, success: bool = True,
                        **__: Any) -> None:
        done = set(keys)
        for k in keys:
            if not self.storing[k]:
                continue
            self.storing[k] -= 1
            if success:
                self.stored.add(k)
                self._forget(k)
            elif k not in self.stored:
                self._lost(k)
        self.stores = [(left - done, c) for left, c in self.stores if left - done]

    def complete_mixed(self, i: int) -> bool:
        """Call ``complete_store`` with the keys of one prepared store in flight whole and one
        key of another (``i`` picks the pair): the contract completes a store's blocks together,
        so the call must raise and settle neither (the wrapper compares the lookups before and
        after). Returns whether there was such a pair."""
        whole = [(k, c) for k, c in self.stores]
        part = [(k, c) for k, c in self.stores if len(k) > 1]
        pairs = [(a, b) for a in whole for b in part if a[0].isdisjoint(b[0])]
        if not pairs:
            return False
        (a, ctx), (b, _) = pairs[i % len(pairs)]
        keys = sorted(a, key=repr) + sorted(b, key=repr)[:1]
        try:
            self.manager.complete_store(keys, ctx)
        except InvariantViolation:
            raise
        except Exception:  # noqa: BLE001 - refused, as the contract asks (the wrapper checked nothing changed)
            return True
        self._fail(f"complete_store of {len(keys)} blocks", f"accepted keys covering a store of {len(a)} blocks "
                   f"whole and one of {len(b)} blocks in part (a store's blocks complete together)")
        return True

    def probe(self, ctx: Any, limit: int = 8) -> None:
        """Look up (with ``ctx``, a request the manager never saw) up to ``limit`` keys
        whose store is in flight, then evicted or failed ones, then stored ones: each answer
        is checked (an engine looks up any block at any time, in flight ones included)."""
        keys = [k for k, n in self.storing.items() if n][:limit]
        keys += sorted(set(self.gone) - set(keys), key=repr)[:max(0, limit - len(keys))]
        keys += sorted(self.stored - set(keys), key=repr)[:max(0, limit - len(keys))]
        for k in keys:
            self.manager.lookup(k, ctx)

    def check_drained(self) -> None:
        """Raise if a load pin or a store is left once every job completed."""
        pins = sorted(repr(k) for k, n in self.loading.items() if n)[:4]
        stores = sorted(repr(k) for k, n in self.storing.items() if n)[:4]
        if pins or stores:
            self._fail("the drained manager", f"loads never completed {pins}, stores never completed {stores}")
