"""The reference model (kvtier.testing.reference): its rules on hand-made cases whose answers
follow from spec/README.md ("Policies"), and its agreement with the product
(kvtier.testing.reference_driver) on the embedded trace slice and on a conversation
workload, for every policy combination, with small pools so that evictions happen a lot."""

from __future__ import annotations

import pytest

from kvtier.fsm.presets import preset
from kvtier.replay import trace_requests
from kvtier.testing import reference_driver
from kvtier.testing.reference import Hit, ReferenceCache, _bonus
from kvtier.testing.reference_driver import Divergence, ReferenceConfig, compare_requests, configs, conversations
from kvtier.replay.trace import load_trace

A = 16  # tokens per unit in the hand-made cases


def keys(name: str, n: int) -> list[tuple[str, int]]:
    return [(name, i) for i in range(n)]


def serve(m: ReferenceCache, rid: str, units: list[tuple[str, int]], tokens: int) -> tuple[Hit | None, list]:
    """The driver's protocol on the model alone: admit (three tries, draining between),
    drain, step_done, finish, drain. Returns the hit and every victim on the way."""
    hit = None
    for _ in range(3):
        hit = m.admit(rid, units, tokens, tokens)
        if hit is not None:
            break
        m.drain()
    if hit is not None:
        m.drain()
        m.step_done(rid, tokens - hit.hit_tokens)
        m.finish(rid)
        m.drain()
    return hit, m.take_victims()


def node(m: ReferenceCache, path: list[tuple[str, int]]):
    (n,) = [n for n in m.nodes.values() if n.path() == tuple(path)]
    return n


# ---------------------------------------------------------------- the model's own rules
def test_admission_always_computes_the_last_prompt_token():
    m = ReferenceCache(A, 10)
    serve(m, "r1", keys("a", 3), 48)
    assert serve(m, "r2", keys("a", 3), 48)[0] == Hit(32, 0)  # 3 units cached, 2 reused
    assert serve(m, "r3", keys("a", 3), 49)[0] == Hit(48, 0)  # the 49th token is computed
    assert m.residency() == {tuple(keys("a", 2)): (2, "device"), tuple(keys("a", 3)): (1, "device")}


def test_a_host_hit_follows_the_device_prefix_and_loads_back():
    m = ReferenceCache(A, 4, 8, policy="write_through")
    serve(m, "r1", keys("a", 2), 32)
    hit, victims = serve(m, "r2", keys("b", 4), 64)
    assert victims == [("demote", tuple(keys("a", 2)), 2)]
    hit, victims = serve(m, "r3", keys("a", 2), 33)
    assert hit == Hit(0, 32)  # loads 2 units back, needs one more page: B's tail is demoted
    assert victims == [("demote", tuple(keys("b", 4)), 3)]
    assert m.residency() == {tuple(keys("a", 2)): (2, "backed"), tuple(keys("b", 1)): (1, "backed"),
                             tuple(keys("b", 4)): (3, "host")}
    assert node(m, keys("a", 2)).reloaded


def test_lru_takes_the_deepest_of_equally_old_leaves_and_only_what_is_needed():
    m = ReferenceCache(A, 6)
    serve(m, "r1", keys("a", 2), 32)
    serve(m, "r2", keys("a", 2) + keys("b", 2), 64)  # one request stamps A and B alike
    assert serve(m, "r3", keys("c", 3), 48)[1] == [("evict_device", tuple(keys("a", 2) + keys("b", 2)), 1)]
    assert serve(m, "r4", keys("d", 3), 48)[1] == [("evict_device", tuple(keys("a", 2) + keys("b", 1)), 1),
                                                   ("evict_device", tuple(keys("a", 2)), 2)]


def test_a_short_admission_keeps_its_evictions():
    m = ReferenceCache(A, 4)
    serve(m, "r1", keys("a", 4), 64)
    hit, victims = serve(m, "r2", keys("b", 5), 80)  # 5 pages can never fit in 4
    assert hit is None
    assert victims == [("evict_device", tuple(keys("a", 4)), 4)]
    assert m.residency() == {}


def test_write_back_pledges_the_victim_and_demotes_it_once_written():
    m = ReferenceCache(A, 8, 16, policy="write_back")
    serve(m, "r1", keys("a", 4), 64)
    serve(m, "r2", keys("b", 4), 64)
    assert m.admit("r3", keys("c", 3), 48, 48) is None  # A queued for writeback, its 4 units pledged
    assert m.take_victims() == []
    m.drain()
    assert m.residency()[tuple(keys("a", 4))] == (4, "backed")
    assert m.admit("r3", keys("c", 3), 48, 48) == Hit(0, 0)
    assert m.take_victims() == [("demote", tuple(keys("a", 4)), 3)]


def test_a_write_back_victim_the_host_refused_is_evicted():
    m = ReferenceCache(A, 4, 2, policy="write_back")
    serve(m, "r1", keys("a", 3), 48)
    hit, victims = serve(m, "r2", keys("b", 2), 32)  # A (3 units) cannot get 2 host units: refused
    assert hit == Hit(0, 0)
    assert victims == [("evict_device", tuple(keys("a", 3)), 1)]
    # the head of the split is a new node, without the refusal: queued, written, demoted
    hit, victims = serve(m, "r3", keys("c", 1), 16)
    assert hit == Hit(0, 0) and victims == [("demote", tuple(keys("a", 2)), 1)]


@pytest.mark.parametrize("exclusive, victim", [(False, ("evict_host", tuple(keys("h", 2)), 1)),
                                               (True, ("drop_host", tuple(keys("a", 2)), 1))])
def test_the_exclusive_tier_drops_a_reloaded_duplicate_first(exclusive, victim):
    m = ReferenceCache(A, 4, 8, policy="write_through", exclusive=exclusive)
    for rid, name in (("r1", "h"), ("r2", "a"), ("r3", "b"), ("r4", "c")):
        serve(m, rid, keys(name, 2), 32)  # H, A demoted in turn; the host holds H, A, B, C
    assert serve(m, "r5", keys("a", 2), 40)[0] == Hit(0, 32)  # A reloaded: a duplicate host copy
    assert serve(m, "r6", keys("e", 1), 16)[1] == [victim]  # e's writeback needs one host unit


@pytest.mark.parametrize("eviction, victim", [("lru", "y"), ("lru2", "z")])
def test_lru2_keeps_the_host_copy_used_by_two_requests(eviction, victim):
    m = ReferenceCache(A, 2, 3, policy="write_through", eviction=eviction)
    serve(m, "r1", keys("y", 1), 17)
    serve(m, "r2", keys("y", 1), 17)  # a second request uses y
    serve(m, "r3", keys("z", 1), 17)
    serve(m, "r4", keys("x", 1), 17)
    assert serve(m, "r5", keys("w", 1), 17)[1] == [("demote", tuple(keys("x", 1)), 1),
                                                   ("evict_host", tuple(keys(victim, 1)), 1)]


def test_turns_grow_when_a_request_continues_a_leaf():
    m = ReferenceCache(A, 10, eviction="lru_turns")
    serve(m, "r1", keys("a", 1), 17)
    serve(m, "r2", keys("a", 1) + keys("b", 1), 33)  # below the leaf a: turn 2
    serve(m, "r3", keys("a", 1) + keys("c", 1), 33)  # a has a child: a new conversation
    assert [node(m, p).turns for p in (keys("a", 1), keys("a", 1) + keys("b", 1), keys("a", 1) + keys("c", 1))] \
        == [2, 2, 1]


def test_the_turns_bonus_interpolates_log2_and_rounds_down():
    assert [_bonus(16, t) for t in range(1, 9)] == [0, 16, 24, 32, 36, 40, 44, 48]
    assert _bonus(7, 3) == 10 and _bonus(7, 6) == 17


def test_write_through_selective_backs_a_node_up_at_its_second_user():
    m = ReferenceCache(A, 8, 8, policy="write_through_selective")
    serve(m, "r1", keys("a", 2), 32)
    assert m.residency() == {tuple(keys("a", 2)): (2, "device")}
    serve(m, "r2", keys("a", 2), 33)
    assert m.residency() == {tuple(keys("a", 2)): (2, "backed")}


# ---------------------------------------------------------------- agreement with the product
SLICE = preset("llama-3-8b", page_tokens=512)  # one trace block per unit
UNITS = preset("llama-3-8b")


@pytest.fixture(scope="module")
def slice_requests():
    return trace_requests(load_trace(None, 1000), SLICE)


@pytest.mark.parametrize("cfg", configs(64, [None, 128]), ids=ReferenceConfig.label)
def test_the_model_agrees_with_the_product_on_the_slice_with_small_pools(cfg, slice_requests):
    result = compare_requests(slice_requests[:300], SLICE, cfg)
    assert result.requests == 300 and result.victims > 200  # prompts of ~27 units against 64


@pytest.mark.parametrize("cfg", configs(256, [1024]), ids=ReferenceConfig.label)
def test_the_model_agrees_with_the_product_on_the_whole_slice(cfg, slice_requests):
    result = compare_requests(slice_requests, SLICE, cfg, residency_every=250)
    assert result.requests == 1000 and result.refused == 0


@pytest.mark.parametrize("cfg", configs(24, [None, 64]) + configs(48, [200]), ids=ReferenceConfig.label)
def test_the_model_agrees_with_the_product_on_conversations(cfg):
    result = compare_requests(conversations(300, UNITS.alignment, seed=0), UNITS, cfg)
    assert result.requests == 300 and result.victims > 100
    if cfg.host is not None and cfg.policy != "write_through_selective":
        assert result.host_hit_tokens > 0


def test_a_divergence_names_the_request_the_calls_and_both_answers(monkeypatch):
    class Wrong(ReferenceCache):
        def admit(self, rid, units, prompt_tokens, chunk_tokens):
            hit = super().admit(rid, units, prompt_tokens, chunk_tokens)
            return Hit(hit.device_tokens + 16, hit.host_tokens) if rid == "c3" and hit else hit

    monkeypatch.setattr(reference_driver, "ReferenceCache", Wrong)
    with pytest.raises(Divergence) as err:
        compare_requests(conversations(10, UNITS.alignment, seed=0), UNITS, ReferenceConfig(64, 64))
    d = err.value
    assert (d.index, d.request_id, d.what) == (3, "c3", "admit")
    assert d.model == Hit(d.product.device_tokens + 16, d.product.host_tokens)
    assert d.calls[-1][0] == "admit" and d.calls[-1][1][0] == "c3"
    assert "request #3 ('c3') differs in admit" in str(d)
