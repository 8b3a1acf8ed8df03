"""An independent reference of vLLM's ``OffloadingManager`` contract (no vLLM import).

Written from the contract vLLM documents for an offloading manager
(``vllm/v1/kv_offload/base.py``), not from kvtier's adapter: a block becomes loadable
when ``complete_store`` reports its store done; a block whose store is in flight is found
but not readable (``HIT_PENDING``, never ``HIT``); ``prepare_store`` returns the blocks to
store and the blocks it evicted (or ``None``: nothing can be stored, nothing changes);
blocks being stored, or prepared to load until ``complete_load``, are protected from
eviction; ``complete_store(success=False)`` removes the blocks not stored.

:class:`OffloadContract` wraps the methods of one manager instance (any object with the
``OffloadingManager`` methods) and checks every answer against its own model: plain sets
and counters of keys. It raises :class:`~kvtier.fsm.errors.InvariantViolation`
(``offload_contract``) on the first answer the contract does not allow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable
from typing import Any

from kvtier.fsm.errors import InvariantViolation

__all__ = ["OffloadContract"]


class OffloadContract:
    """The reference beside ``manager`` (module doc); installs itself on the instance.

    Attributes:
        stored: keys whose store completed and which no eviction reported since.
        storing: key -> stores in flight (returned by ``prepare_store``, not completed).
        loading: key -> ``prepare_load`` pins not yet released by ``complete_load``.
        lookups: lookups checked (a run that checks none has no oracle).
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.stored: set[Hashable] = set()
        self.storing: Counter[Hashable] = Counter()
        self.loading: Counter[Hashable] = Counter()
        self.lookups = 0
        self.gone: set[Hashable] = set()  # keys evicted or whose store failed (probed: never HIT)
        for name in ("lookup", "prepare_load", "complete_load", "prepare_store", "complete_store"):
            setattr(manager, name, self._wrap(name, getattr(manager, name)))

    def _fail(self, where: str, detail: str) -> None:
        raise InvariantViolation("offload_contract", where, detail)

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        check = getattr(self, "_" + name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
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

    def _prepare_load(self, out: Any, keys: Collection[Hashable], *_: Any, **__: Any) -> None:
        for k in keys:
            if k not in self.stored:
                self._fail(f"prepare_load of {k!r}", "the block is not loadable (a lookup never could answer HIT)")
            self.loading[k] += 1

    def _complete_load(self, out: Any, keys: Collection[Hashable], *_: Any, **__: Any) -> None:
        for k in keys:
            if self.loading[k]:
                self.loading[k] -= 1

    def _prepare_store(self, out: Any, keys: Collection[Hashable], *_: Any, **__: Any) -> None:
        if out is None:  # refused: nothing was evicted, nothing is being stored
            return
        asked = set(keys)
        for k in out.keys_to_store:
            if k not in asked:
                self._fail(f"prepare_store of {len(asked)} blocks", f"stores {k!r}, which was not asked for")
            self.storing[k] += 1
        for k in out.evicted_keys:
            if self.loading[k]:
                self._fail(f"prepare_store eviction of {k!r}", "evicted a block pinned by prepare_load")
            if self.storing[k] and k not in out.keys_to_store:
                self._fail(f"prepare_store eviction of {k!r}", "evicted a block whose store is in flight")
            self.stored.discard(k)
            self.gone.add(k)

    def _complete_store(self, out: Any, keys: Collection[Hashable], ctx: Any = None, success: bool = True,
                        **__: Any) -> None:
        for k in keys:
            if not self.storing[k]:
                continue
            self.storing[k] -= 1
            if success:
                self.stored.add(k)
                self.gone.discard(k)
            elif k not in self.stored:
                self.gone.add(k)

    def probe(self, ctx: Any, limit: int = 8) -> None:
        """Look up (with ``ctx``, a request the manager never saw) up to ``limit`` keys
        whose store is in flight, then evicted or failed ones, then stored ones: each answer
        is checked (an engine looks up any block at any time, in flight ones included)."""
        keys = [k for k, n in self.storing.items() if n][:limit]
        keys += sorted(self.gone - set(keys), key=repr)[:max(0, limit - len(keys))]
        keys += sorted(self.stored - set(keys), key=repr)[:max(0, limit - len(keys))]
        for k in keys:
            self.manager.lookup(k, ctx)

    def check_drained(self) -> None:
        """Raise if a load pin or a store is left once every job completed."""
        pins = sorted(repr(k) for k, n in self.loading.items() if n)[:4]
        stores = sorted(repr(k) for k, n in self.storing.items() if n)[:4]
        if pins or stores:
            self._fail("the drained manager", f"loads never completed {pins}, stores never completed {stores}")
