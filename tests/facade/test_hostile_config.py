"""Generated hostile configurations and keys for the facade: every constructor option x
bad value and every capacity spelling up to and past ``MAX_POOL_PAGES`` (memory grows with
use only), and unit keys not equal to themselves (NaN) through the whole lifecycle.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hostile_api_helpers import drain, h1

from kvtier.fsm import ConfigError
from kvtier.fsm.node.pages import MAX_POOL_PAGES
from kvtier.tiered import TieredCache


# ---------------------------------------------------------------------------- the constructor
CTOR_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("device-negative", {"device_pages": -1}, "device_pages: must be an int >= 0 (units)"),
    ("device-float", {"device_pages": 8.0}, "device_pages: must be an int >= 0 (units)"),
    ("device-str", {"device_pages": "8"}, "device_pages: must be an int >= 0 (units)"),
    ("device-bool", {"device_pages": True}, "device_pages: must be an int >= 0 (units)"),
    ("device-absurd-units", {"device_pages": 10**30}, "above the maximum 9007199254740992"),
    ("device-over-max", {"device_pages": MAX_POOL_PAGES + 1}, "above the maximum 9007199254740992"),
    ("device-map-over-max", {"device_pages": {"kv": 2**60}}, "above the maximum"),
    ("device-map-negative", {"device_pages": {"kv": -1}}, "pages of group 'kv' must be an int >= 0"),
    ("device-map-unknown", {"device_pages": {"kv": 8, "zz": 1}}, "unknown cache groups ['zz']"),
    ("device-map-missing", {"device_pages": {}}, "no capacity for cache groups ['kv']"),
    ("host-absurd-units", {"host_pages": 10**30}, "host pool of group 'kv'"),
    ("host-nan", {"host_pages": math.nan}, "host_pages: must be an int >= 0 (units)"),
    ("deadline-zero", {"op_deadline_steps": 0}, "op_deadline_steps must be None or an int >= 1, got 0"),
    ("deadline-float", {"op_deadline_steps": 5.0}, "op_deadline_steps must be None or an int >= 1, got 5.0"),
    ("deadline-bool", {"op_deadline_steps": True}, "op_deadline_steps must be None or an int >= 1, got True"),
    ("history-negative", {"ended_history": -1}, "ended_history must be an int >= 0, got -1"),
    ("history-float", {"ended_history": 1.5}, "ended_history must be an int >= 0, got 1.5"),
    ("world-zero", {"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ("threshold-str", {"write_threshold": "2"}, "write_threshold must be an int >= 1, got '2'"),
    ("wb-limit-zero", {"max_writebacks_in_flight": 0}, "max_writebacks_in_flight must be an int >= 1, got 0"),
    ("policy", {"policy": "sometimes"}, "write policy must be one of"),
    ("finish-writeback", {"finish_writeback": "yes"}, "finish_writeback (or None) must be True or False"),
    ("history-replay", {"history_replay": 1}, "history_replay must be True or False, got 1"),
]


@pytest.mark.parametrize(("kw", "fragment"), [c[1:] for c in CTOR_BAD], ids=[c[0] for c in CTOR_BAD])
def test_constructor_refuses_bad_options_and_absurd_capacities(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"device_pages": 8, "host_pages": 8, **kw}
    with pytest.raises(ConfigError) as info:
        TieredCache(h1(), **args)
    assert type(info.value) is ConfigError and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("pages", [0, 1, 10**6, 10**14, MAX_POOL_PAGES])
def test_capacities_up_to_the_maximum_cost_memory_by_use_only(pages: int) -> None:
    """Up to MAX_POOL_PAGES a capacity is accepted, and a full lifecycle with its
    invariant checks and the quiescence report costs the same at any capacity."""
    c = TieredCache(h1(), {"kv": max(pages, 8)}, {"kv": pages}, policy="write_through")
    adm = c.admit("a", list("abcd"), 9, 9)
    assert adm is not None
    c.step_done("a", 9)
    c.check_invariants()
    c.finish("a")
    drain(c)
    c.check_invariants()
    assert c.quiescent() and c.state("a") == "finished"


# ---------------------------------------------------------------------------- unit keys not equal to themselves
def test_nan_unit_keys_keep_the_tree_consistent() -> None:
    """A key not equal to itself (NaN) matches itself by identity, as the tree's dict
    lookups do: publish, hit, split and evict keep every invariant; a different NaN
    object is a different unit."""
    nan = float("nan")
    c = TieredCache(h1(), 16, 16, policy="write_through")
    for rid, key in (("a", [nan, "x", nan, "y"]), ("b", [nan, "x", nan, "z"]), ("c", [nan, "x"])):
        adm = c.admit(rid, key, 2 * len(key) + 1, 2 * len(key) + 1)
        assert adm is not None
        c.check_invariants()
        c.step_done(rid, adm.chunk_tokens)
        c.check_invariants()
        c.finish(rid)
        drain(c)
        c.check_invariants()
    assert c.request("b").hit_tokens == 6 and c.request("c").hit_tokens == 4  # a's nan, x, nan; then nan, x
    other = float("nan")  # equal to nothing, not even the first NaN: no hit
    adm = c.admit("d", [other, "x"], 5, 5)
    assert adm is not None and adm.hit_tokens == 0
    c.step_done("d", 5)
    c.finish("d")
    drain(c)
    c.core.evict_device({"kv": 16})
    c.core.evict_host({"kv": 16})
    c.check_invariants()
    assert c.quiescent()
