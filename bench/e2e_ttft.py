"""Measured time to first token through kvtier with a real model (issue 17).

Serves a Mooncake conversation slice (the embedded trace) through the reference
scheduler, kvtier and a transfer backend, with the paged Llama decoder of
:mod:`kvtier.model` running every forward pass, in three configurations (device only,
device + host, unbounded) at a capacity-bound device size; prints measured TTFT beside
the cost model's (default and fitted constants) and writes the raw JSON.

    python bench/e2e_ttft.py --model llama-8b --tokens 400000 --time-scale 0.06 --out r.json

On a GPU: bf16, ``numba`` backend; on the CPU: float32, ``cpu`` backend (tiny shapes).
``--attention-probe`` also times the gather against the attention and the whole layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch

from kvtier.model import PagedLlama, config
from kvtier.replay.model_replay import E2ESetup, build_requests, capacities, conversation_slice, format_model_table, \
    ratios, run_model
from kvtier.replay.trace import load_trace


def attention_probe(model: PagedLlama, context: int = 16384, chunk: int = 4096, reps: int = 10) -> dict[str, Any]:
    """Per-layer milliseconds of a prefill chunk on top of ``context - chunk`` cached
    tokens: gathering its keys and values from pages, attention over them, and the
    layer's other work (projections, MLP), CUDA-event timed."""
    cfg, dev = model.cfg, model.device
    tpp = cfg.page_tokens
    pages = context // tpp
    kvt = torch.randn(pages * 2, tpp, cfg.n_kv_heads, cfg.head_dim, device=dev).to(model.dtype)
    rows = kvt.view(-1, cfg.n_kv_heads, cfg.head_dim)
    table = torch.randperm(pages * 2, device=dev)[:pages]
    p = torch.arange(context, device=dev)
    idx = table[p // tpp] * tpp + p % tpp
    x = torch.randn(chunk, cfg.hidden, device=dev).to(model.dtype)
    pos = torch.arange(context - chunk, context, device=dev)

    def timed(fn: Any) -> float:
        for _ in range(2):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        s.record()  # type: ignore[no-untyped-call]
        for _ in range(reps):
            fn()
        e.record()  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        return float(s.elapsed_time(e)) / reps  # type: ignore[no-untyped-call]

    q, k, v = model.qkv(1, x, pos)
    kk, vv = rows[idx], rows[idx]
    g = timed(lambda: (rows[idx], rows[idx]))
    a = timed(lambda: model.attend(q, kk, vv, context - chunk, 0, 0))
    rest = timed(lambda: (model.qkv(1, x, pos), model.finish_layer(1, x, q)))
    return {"context": context, "chunk": chunk, "gather_ms": g, "attention_ms": a, "projections_mlp_ms": rest,
            "gather_share": g / (g + a + rest)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=20000, help="prompt tokens of the slice (whole conversations)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-prompt", type=int, default=32768)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--device-frac", type=float, default=0.2, help="device size / working set")
    ap.add_argument("--host-frac", type=float, default=1.0, help="host size / working set")
    ap.add_argument("--chunk-layers", type=int, default=2)
    ap.add_argument("--no-reuse-samples", type=int, default=4)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--attention-probe", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    model = PagedLlama(config(a.model), "cuda" if cuda else "cpu")
    setup = E2ESetup(device_units=0, host_units=0, time_scale=a.time_scale, max_prompt=a.max_prompt,
                     max_output=a.max_output, token_budget=a.token_budget, backend="numba" if cuda else "cpu",
                     chunk_layers=a.chunk_layers, check=not a.no_check, no_reuse_samples=a.no_reuse_samples)
    sl = conversation_slice(load_trace(), a.tokens, a.max_prompt)
    reqs, prompts, outs = build_requests(sl, model.layout, model.cfg.vocab, setup)
    caps = capacities(reqs, model.layout.alignment, a.device_frac, a.host_frac)
    print(f"{a.model}: {len(reqs)} requests, {sum(r.prompt_tokens for r in reqs):,} prompt tokens, "
          f"arrivals over {max(r.arrival_s for r in reqs):.1f} s, capacities {caps}", flush=True)
    # warm-up: kernels, cuBLAS handles, allocator (not on the clock)
    model.reference_logits(prompts[reqs[0].request_id][: min(2048, reqs[0].prompt_tokens)])
    if cuda:
        torch.cuda.synchronize()
    doc = run_model(model, reqs, prompts, outs, caps, setup,
                    progress=lambda n: print(f"  {n} ({time.perf_counter() - t0:.0f} s)", flush=True))
    doc["ratios"] = ratios(doc)
    doc["command"] = " ".join(["python", "bench/e2e_ttft.py", *(argv if argv is not None else sys.argv[1:])])
    doc["commit"] = a.commit
    doc["machine"] = {"gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                      "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    if a.attention_probe and cuda:
        doc["attention"] = attention_probe(model)
    doc["wall_s"] = time.perf_counter() - t0
    print(format_model_table(doc))
    print(json.dumps({"ratios": doc["ratios"], "fitted": doc["fitted_cost_model"]["describe"],
                      "attention": doc.get("attention")}), flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
