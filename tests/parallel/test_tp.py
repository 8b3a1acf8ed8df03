"""Tensor parallelism of the paged Llama over gloo (issue 21, the CPU part of the GPU run):
the sharded model computes what the whole one does, and serving a conversation slice with
each rank's K/V in its own kvtier pools decides alike on every rank, passes the model's
page checks, and drains clean."""

from __future__ import annotations

import torch

from kvtier.fsm import units_to_pages
from kvtier.model import PagedLlama, config
from kvtier.replay.model_replay import E2ESetup, build_requests, capacities, conversation_slice
from kvtier.parallel import launch
from kvtier.parallel.tp import TPJob, run_tp_rank, shard_config, sharded_logits
from kvtier.replay.trace import load_trace


def test_sharded_model_matches_the_whole_model() -> None:
    cfg = config("tiny")
    tokens = list(range(1, 97))
    whole = PagedLlama(cfg, "cpu").reference_logits(tokens)
    for world in (2,):
        res = launch(sharded_logits, world, (cfg, tokens))
        assert res[0] == res[1]  # every rank holds the same (all-reduced) result
        got = torch.tensor(res[0])
        assert torch.allclose(got, whole, rtol=1e-4, atol=1e-4), float((got - whole).abs().max())
        assert int(got.argmax()) == int(whole.argmax())
    assert shard_config(cfg, 2).n_kv_heads == 1 and shard_config(cfg, 2).ffn == 64


def test_two_rank_serving_on_cpu() -> None:
    cfg = config("tiny")
    model = PagedLlama(cfg, "cpu")
    setup = E2ESetup(device_units=0, host_units=0, max_prompt=1024, max_output=4, token_budget=512,
                     backend="cpu", measured=False)
    sl = conversation_slice(load_trace(), 6000, 1024)
    reqs, prompts, outs = build_requests(sl, model.layout, cfg.vocab, setup)
    caps = capacities(reqs, model.layout.alignment, 0.3, 1.0)
    align = model.layout.alignment
    dev = max((r.prompt_tokens + r.output_tokens) // align + 2 for r in reqs) + 8  # tight: evictions
    job = TPJob(cfg, tuple(reqs), prompts, outs,
                (("device-only", dev, None), ("device+host", dev, caps["host_units"])),
                token_budget=512, measured=False, no_reuse_samples=1)
    res = launch(run_tp_rank, 2, job)
    full = units_to_pages(model.layout, 1)
    assert sum(full.values()) > 0
    for r in res:
        assert r["shard_unit_bytes"] * 2 == r["full_unit_bytes"]
    for c0, c1 in zip(res[0]["configurations"], res[1]["configurations"]):
        assert c0["digest"] == c1["digest"] and c0["decisions"] == c1["decisions"] > 30
        for c in (c0, c1):
            assert c["finished"] == len(reqs) and c["aborts"] == 0
            assert c["checks"]["page_mismatches"] == 0
            assert c["checks"]["rerun_identical"] == c["checks"]["loaded_requests"]
            assert c["drain"]["requests"] == c["drain"]["caller_pages"] == 0
            assert c["agreement"]["exchanges"] > c["steps"] > 0 and c["model_all_reduces"] > 0
            assert c["tokens_generated"] >= len(reqs)
    dh = res[0]["configurations"][1]
    assert dh["loadbacks"] > 0 and dh["checks"]["loaded_requests"] > 0 and dh["checks"]["pages_checksummed"] > 0
