"""The paged Llama decoder (issue 17) on tiny CPU shapes: the same properties the H200
replay checks, in CI.

Requests go through the reference scheduler, kvtier and the ``cpu`` (or ``fake-async``)
backend. Prompts are conversation turns sharing a system prompt; the device holds 12
units (16 tokens each) while the working set is several times that, so published
prefixes are demoted to the host (write_through) and loaded back.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from kvtier.fsm import ConfigError, Direction
from kvtier.fsm import units_to_pages
from kvtier.model import CONFIGS, ModelExecutor, PagedLlama, WallClock, config, prompt_tokens_for
from kvtier.replay.model_replay import E2ESetup, build_requests, capacities, conversation_slice, ratios, run_model
from kvtier.scheduler import ReferenceScheduler, SchedRequest
from kvtier.tiered import TieredCache
from kvtier.replay.trace import load_trace
from kvtier.transfer import FakeAsyncBackend

#: |logits - logits computed from scratch| / |logits from scratch| (L2) allowed: float32
#: matmuls over other shapes round differently (observed here: below 1e-6).
NO_REUSE_REL_TOL = 1e-4
DEVICE_UNITS = 12
HOST_UNITS = 96


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)

    def toks(n: int) -> list[int]:
        return [int(x) for x in torch.randint(0, 512, (n,), generator=g)]

    sys_ = toks(40)
    p = {"a": sys_ + toks(30)}
    p["x"] = toks(100)
    p["b"] = p["a"] + toks(50)            # next turn of "a"
    p["y"] = toks(120)                    # unrelated: pushes "a" and "b" down to the host
    p["c"] = p["b"] + toks(20)            # loaded back from the host
    p["z"] = sys_ + toks(90)
    p["d"] = p["c"] + toks(9)             # loaded back again
    p["e"] = p["y"] + toks(7)
    return p


PROMPTS = _prompts()


def _requests(align: int) -> list[SchedRequest]:
    out = []
    for i, (rid, p) in enumerate(PROMPTS.items()):
        keys: list[Hashable] = [tuple(p[j * align:(j + 1) * align]) for j in range(len(p) // align)]
        out.append(SchedRequest(rid, float(i), len(p), 2, tuple(keys)))
    return out


def _serve(model: PagedLlama, device_units: int, host_units: int | None, executor_cls: type[ModelExecutor] = ModelExecutor,
           **kw: object) -> tuple[ModelExecutor, TieredCache]:
    lay = model.layout
    dev = units_to_pages(lay, device_units)
    host = units_to_pages(lay, host_units) if host_units else None
    ex = executor_cls(model, dev, host, PROMPTS, {k: 2 for k in PROMPTS}, no_reuse_samples=8, keep_logits=True,
                      **kw)  # type: ignore[arg-type]
    cache = TieredCache(lay, dev, host, policy="write_through")
    # modeled time: the schedule (and so every pass) does not depend on this machine's speed
    stats = ReferenceScheduler(cache, ex, token_budget=64).run(_requests(lay.alignment))
    assert stats.finished == len(PROMPTS) and stats.aborts == 0
    cache.check_invariants()
    return ex, cache


@pytest.fixture(scope="module", params=["tiny", "tiny-swa"])
def model(request: pytest.FixtureRequest) -> PagedLlama:
    return PagedLlama(config(request.param))


def test_loaded_prefixes_give_bit_identical_logits_and_agree_with_no_reuse(model: PagedLlama) -> None:
    ex, cache = _serve(model, DEVICE_UNITS, HOST_UNITS)
    stats = cache.stats()
    assert stats["demotions"] >= 1 and stats["loadbacks"] >= 1
    c = ex.checks
    assert c.loaded_requests >= 1
    assert c.rerun_different == [] and c.rerun_identical == c.loaded_requests
    assert c.page_mismatches == [] and c.pages_checksummed >= 2
    assert c.no_reuse_compared == c.loaded_requests
    assert c.no_reuse_top1_agree == c.no_reuse_compared
    assert c.no_reuse_max_rel <= NO_REUSE_REL_TOL
    per = ex.per_request()
    loaded = [rid for rid, p in per.items() if p["loaded"]]
    assert loaded and all(per[rid]["hit_tokens"] > per[rid]["device_hit_tokens"] for rid in loaded)
    if model.cfg.window:  # a state-group checkpoint came back from the host with its history
        assert any(per[rid]["hit_tokens"] % model.cfg.page_tokens == 0 for rid in loaded)
    # every request's first token, loaded or not, close to computing its prompt from scratch
    for rid, p in PROMPTS.items():
        ref = model.reference_logits(p)
        got = ex.first_logits[rid]
        assert float((got - ref).norm() / ref.norm()) <= NO_REUSE_REL_TOL, rid
        assert int(got.argmax()) == int(ref.argmax())
        assert per[rid]["generated"] == 2 and per[rid]["first_token_s"] is not None


def test_same_tokens_with_host_tier_as_unbounded(model: PagedLlama) -> None:
    a, _ = _serve(model, DEVICE_UNITS, HOST_UNITS)
    b, _ = _serve(model, 200, None)
    for rid in PROMPTS:
        assert a.request(rid).tokens == b.request(rid).tokens, rid


class _FakeAsyncExecutor(ModelExecutor):
    """Writebacks complete at each collect; loadbacks only when the forward pass waits."""

    def collect(self) -> list:  # type: ignore[type-arg]
        b = self.engine.backend
        assert isinstance(b, FakeAsyncBackend)
        while b.complete_next(Direction.WRITEBACK) is not None:
            pass
        return super().collect()


def test_forward_pass_reads_a_layer_only_after_its_loadback_landed() -> None:
    model = PagedLlama(config("tiny-swa"))
    ok, _ = _serve(model, DEVICE_UNITS, HOST_UNITS, _FakeAsyncExecutor,
                   backend=FakeAsyncBackend(on_wait="complete"), chunk_layers=1)
    assert ok.checks.loaded_requests >= 1 and ok.checks.rerun_different == []

    class NoWait(_FakeAsyncExecutor):
        def _wait(self, r, layer):  # type: ignore[no-untyped-def]
            return None

    bad, _ = _serve(model, DEVICE_UNITS, HOST_UNITS, NoWait, backend=FakeAsyncBackend(on_wait="complete"),
                    chunk_layers=1)
    # reading poisoned (not yet copied) pages changes the logits; the re-run after the
    # copies landed shows it, request by request
    assert bad.checks.loaded_requests >= 1
    assert len(bad.checks.rerun_different) == bad.checks.loaded_requests


def test_replay_driver_on_a_mooncake_slice() -> None:
    model = PagedLlama(config("tiny"))
    setup = E2ESetup(device_units=0, host_units=0, time_scale=0.01, max_prompt=640, max_output=2, token_budget=256,
                     no_reuse_samples=2, measured=False)
    sl = conversation_slice(load_trace(), 5000, setup.max_prompt)
    reqs, prompts, outs = build_requests(sl, model.layout, model.cfg.vocab, setup)
    caps = capacities(reqs, model.layout.alignment, 0.25, 1.0)
    assert caps["working_set_units"] == 64 and len(reqs) == 10
    caps["device_units"] = 56  # seven eighths of the working set (48 makes the scheduler abort 3)
    doc = run_model(model, reqs, prompts, outs, caps, setup)
    names = [r["name"] for r in doc["configurations"]]
    assert names == ["device-only", "device+host", "unbounded"]
    do, dh, ub = doc["configurations"]
    for r in doc["configurations"]:
        assert r["finished"] == len(reqs) and r["aborts"] == 0
        assert r["tokens_generated"] == sum(outs.values())
        # modeled schedule here (measured=False): the times are wall-clock stamps, only present
        assert all(p["first_token_s"] is not None and p["generated"] == outs[rid]
                   for rid, p in r["per_request"].items())
        assert r["modeled_default"]["hit_tokens"] == r["hit_tokens"]
        assert r["checks"]["rerun_different"] == [] and r["checks"]["page_mismatches"] == []
    assert dh["host_hit_tokens"] > 0 and dh["hit_tokens"] > do["hit_tokens"]
    assert dh["checks"]["loaded_requests"] >= 1
    assert dh["prefill_tokens"] < do["prefill_tokens"]
    assert set(ratios(doc)) == {"mean_dh_over_do", "p99_dh_over_do", "mean_dh_over_unbounded",
                                "p99_dh_over_unbounded"}


def test_configs_and_bad_input() -> None:
    assert CONFIGS["llama-8b"].n_layers == 32 and CONFIGS["llama-8b"].hidden == 4096
    assert CONFIGS["llama-1b"].n_kv_heads == 8 and CONFIGS["llama-1b"].head_dim == 64
    swa = CONFIGS["llama-1b-swa"]
    assert swa.window_layers == tuple(range(0, 16, 2)) and swa.full_layers == tuple(range(1, 16, 2))
    lay = PagedLlama(config("tiny-swa")).layout
    assert [g.name for g in lay.groups] == ["model.full_kv", "model.swa_kv"]
    assert lay.group("model.swa_kv").window == 32 + 16
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        config("nope")
    with pytest.raises(ConfigError, match="n_kv_heads"):
        config("tiny", n_kv_heads=3)
    with pytest.raises(ConfigError, match="window"):
        config("tiny", window=12)
    assert prompt_tokens_for([3, 4], 600, 512)[:512] == prompt_tokens_for([3], 512, 512)
    with pytest.raises(ConfigError, match="needs 2 block ids"):
        prompt_tokens_for([3], 600, 512)
