"""End-to-end proof with a real model (issue 6): a tiny transformer whose paged KV cache
lives in kvtier's pools generates the same logits with the tiered cache under capacity
pressure as with an unbounded device cache, bit for bit, and close to computing every
prompt from scratch; its forward pass never reads a layer whose loadback has not landed.

Requests run one at a time (so batching cannot change the arithmetic). Prompts share
a 24-token system prompt and extend earlier prompts (conversation turns); the device
holds 16 history pages (64 tokens) while a request needs up to 13, so published
prefixes are demoted to the host (write_through keeps host copies) and loaded back.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.fsm import Direction, TransferCommand
from kvtier.tiered import Admission, TieredCache
from kvtier.model.tiny import FULL_GROUP, SWA_GROUP, GenResult, TinyModel, TinyRunner
from kvtier.transfer import POISON_BYTE, FakeAsyncBackend, NotReadyError, PoisonedReadError

#: |logit difference| allowed against the run without prefix reuse: a prefill over a
#: different number of tokens runs CPU matmuls of other shapes, whose float32 sums may
#: round differently (observed: at most ~5e-7 on logits of magnitude ~1).
NO_REUSE_ATOL = 1e-5
DECODE_STEPS = 3
DEVICE = {FULL_GROUP: 16, SWA_GROUP: 16}  # pages; history pages of 4 tokens
HOST = {FULL_GROUP: 128, SWA_GROUP: 128}
UNBOUNDED = {FULL_GROUP: 1024, SWA_GROUP: 1024}


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)

    def toks(n: int) -> list[int]:
        return [int(x) for x in torch.randint(0, 64, (n,), generator=gen)]

    system, a, b, c, other, d, e, third = toks(24), toks(10), toks(13), toks(9), toks(40), toks(7), toks(6), toks(30)
    return {
        "sys": system,                   # the shared system prompt alone
        "a": system + a,                 # reuses the system prompt (device)
        "b": system + b,
        "a+c": system + a + c,           # the next turn of "a"
        "a again": system + a,           # "a" repeated: its last full unit is reused
        "other": other,                  # unrelated: pushes the prefixes to the host
        "b+d": system + b + d,           # loaded back from the host
        "third": third,
        "a+c+e": system + a + c + e,     # part on the device, the rest loaded back
        "other+d": other + d,            # loaded back
    }


PROMPTS = _prompts()
#: the unbounded cache's hit per request: the deepest earlier prompt's last full unit
#: (a continuation-state checkpoint lives only there) below this prompt's last token
EXPECTED_HITS = {"sys": 0, "a": 24, "b": 24, "a+c": 32, "a again": 32, "other": 0, "b+d": 36, "third": 0,
                 "a+c+e": 40, "other+d": 40}


def _run(runner: TinyRunner) -> dict[str, GenResult]:
    out = {rid: runner.generate(rid, p, DECODE_STEPS) for rid, p in PROMPTS.items()}
    runner.cache.check_invariants()
    assert not runner.cache.in_flight()
    return out


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel()


@pytest.fixture(scope="module")
def tiered(model: TinyModel) -> tuple[TinyRunner, dict[str, GenResult]]:
    runner = TinyRunner(model, DEVICE, HOST, policy="write_through", backend="cpu")
    return runner, _run(runner)


def test_tiered_cache_under_pressure_gives_the_unbounded_logits(
        model: TinyModel, tiered: tuple[TinyRunner, dict[str, GenResult]]) -> None:
    runner, a = tiered
    b = _run(TinyRunner(model, UNBOUNDED, None, backend="cpu"))
    c = _run(TinyRunner(model, UNBOUNDED, None, backend="cpu", prefix_reuse=False))

    # capacity pressure moved prefixes down and back up
    stats = runner.cache.stats()
    assert stats["demotions"] >= 1
    assert stats["loadbacks"] >= 1
    assert stats["device_evictions"] == 0 and stats["host_evictions"] == 0  # nothing was lost
    loaded = [r for r in a.values() if r.loadback]
    assert loaded and all(r.checkpoint_hit and r.hit_tokens > r.device_hit_tokens for r in loaded)
    assert any(r.loadback and r.device_hit_tokens > 0 for r in a.values())  # part device, part host
    assert any(r.hit_tokens and not r.loadback for r in a.values())  # a pure device hit

    # reuse in both groups: every hit read history pages and a window-state checkpoint
    hits = [r for r in a.values() if r.hit_tokens]
    assert len(hits) == 7
    for r in hits:
        assert r.checkpoint_hit and r.history_hit_pages == r.hit_tokens // 4

    # the same hit length as the unbounded cache, request by request
    assert {rid: r.hit_tokens for rid, r in b.items()} == EXPECTED_HITS
    assert {rid: r.hit_tokens for rid, r in a.items()} == EXPECTED_HITS
    assert all(r.hit_tokens == 0 for r in c.values())

    for rid in PROMPTS:
        assert a[rid].logits.shape == (1 + DECODE_STEPS, model.cfg.vocab)
        assert a[rid].logits.dtype == torch.float32
        # bit-identical to the unbounded cache
        assert torch.equal(a[rid].logits, b[rid].logits), rid
        assert a[rid].generated == b[rid].generated
        # close to computing the whole prompt without any reuse
        assert a[rid].generated == c[rid].generated
        diff = float((a[rid].logits - c[rid].logits).abs().max())
        assert diff <= NO_REUSE_ATOL, (rid, diff)


def _prove_layerwise(runner: TinyRunner, backend: FakeAsyncBackend, rid: str, adm: Admission,
                     cmd: TransferCommand) -> None:
    """The request's admission started a loadback that is left pending (its command, which
    poll handed out, is ``cmd``): show that its forward pass reads layer k only after the
    chunk holding layer k has landed."""
    assert cmd.op_id == adm.loadback_op
    op = cmd.op_id
    pending = [p for p in backend.pending() if p.stream is Direction.LOADBACK]
    assert [p.layers for p in pending] == [(0,), (1,), (2,), (3,)]  # one chunk per layer
    loaded = {t.group: list(t.dst_pages) for t in cmd.transfers}
    assert set(loaded) == {FULL_GROUP, SWA_GROUP}  # history pages and the checkpoint
    assert loaded[SWA_GROUP] == adm.checkpoint_pages[SWA_GROUP]

    def poisoned(layer: int) -> bool:
        group = FULL_GROUP if layer in runner.model.cfg.full_layers else SWA_GROUP
        region = runner.device.region(group, "k", layer)
        return bool((region[loaded[group]] == POISON_BYTE).all())

    # nothing has landed: every layer of the hit still holds the poison
    for layer in range(4):
        assert poisoned(layer)
        with pytest.raises(PoisonedReadError):
            runner.read_hit(rid, layer)
    # the forward pass waits for layer 0 first (a real stream would block there)
    with pytest.raises(NotReadyError):
        runner.step(rid)
    # without the layer-wise wait its first read hits poisoned pages
    with pytest.raises(PoisonedReadError):
        runner.step(rid, layer_wait=False)

    seen: list[int] = []

    def before_layer(layer: int) -> None:
        # layers before this one have landed; this one and the later ones have not
        for k in range(4):
            if k < layer:
                runner.read_hit(rid, k)
                assert not poisoned(k)
            else:
                with pytest.raises(PoisonedReadError):
                    runner.read_hit(rid, k)
        assert not runner.cache.layer_ready(rid, layer)
        with pytest.raises(NotReadyError):
            runner.engine.wait_layer(op, layer)
        chunk = next(p.chunk for p in backend.pending() if layer in p.layers)
        done = backend.complete(op, chunk)  # this layer's chunk lands, and only it
        assert [p.layers for p in done] == [(layer,)]
        seen.append(layer)

    runner.step(rid, before_layer=before_layer)
    assert seen == [0, 1, 2, 3]
    assert not backend.pending()


def test_forward_pass_reads_only_landed_layers(model: TinyModel,
                                               tiered: tuple[TinyRunner, dict[str, GenResult]]) -> None:
    backend = FakeAsyncBackend()
    runner = TinyRunner(model, DEVICE, HOST, policy="write_through", backend=backend)
    runner.hold_loadbacks = True  # writebacks complete at once; loadbacks are driven here
    submitted: dict[int, TransferCommand] = {}  # every command poll handed out, by op id
    engine_submit = runner.engine.submit

    def record(cmd: TransferCommand) -> None:
        submitted[cmd.op_id] = cmd
        engine_submit(cmd)

    runner.engine.submit = record  # type: ignore[method-assign]
    proved = []
    results = {}
    for rid, prompt in PROMPTS.items():
        adm = runner.start(rid, prompt, DECODE_STEPS)
        if adm.loadback_op is not None:
            _prove_layerwise(runner, backend, rid, adm, submitted[adm.loadback_op])
            proved.append(rid)
        results[rid] = runner.run_to_end(rid)
    runner.cache.check_invariants()
    assert proved == [rid for rid, r in tiered[1].items() if r.loadback]
    assert len(proved) >= 2
    # after completion, the logits are those of the synchronous run, bit for bit
    for rid, r in tiered[1].items():
        assert results[rid].hit_tokens == r.hit_tokens
        assert torch.equal(results[rid].logits, r.logits), rid


def test_decode_checkpoint_without_its_unit_key_is_not_adopted(model: TinyModel) -> None:
    """A decode step ending on a unit boundary with ``checkpoint=True`` but without the
    new unit's key: the state is at 28 tokens, the request knows keys for 24 only. The
    facade used to adopt the checkpoint at the 24-token node (the engine then filled it
    with its state at 28, which a later hit at 24 would have resumed from)."""
    cache = TieredCache(model.layout, UNBOUNDED, None)
    units = [("u", i) for i in range(6)]
    assert cache.admit("r", units, prompt_tokens=24, chunk_tokens=24) is not None
    assert cache.step_done("r", 24) == {}  # no checkpoint at the prompt's end
    for t in range(25, 29):
        assert cache.reserve("r", 1) is not None
        assert cache.step_done("r", 1, checkpoint=t % 4 == 0) == {}
    cache.finish("r")
    cache.poll()
    adm = cache.admit("s", units + [("x", 0)], prompt_tokens=30, chunk_tokens=30)
    assert adm is not None and adm.hit_tokens == 0 and not adm.checkpoint_pages
    # with the unit's key the checkpoint lands where the state is
    assert cache.step_done("s", 30) == {}
    cache.finish("s")
    cache.poll()
    assert cache.admit("t", units, prompt_tokens=24, chunk_tokens=24) is not None
    cache.step_done("t", 24)
    for t in range(25, 29):
        assert cache.reserve("t", 1) is not None
        got = cache.step_done("t", 1, new_units=[("v", 0)] if t == 28 else (), checkpoint=t % 4 == 0)
    assert set(got) == {SWA_GROUP}
    cache.finish("t")
    cache.poll()
    cache.check_invariants()
