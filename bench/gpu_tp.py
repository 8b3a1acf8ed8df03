"""Tensor-parallel serving through kvtier's rank-parallel mode (issue 21): measured TTFT and
the per-step cost of the cross-rank agreement.

The paged Llama (:mod:`kvtier.model`) with its attention heads and MLP sharded across rank
processes (:mod:`kvtier.parallel.tp`), each rank's K/V in its own kvtier pools and its own
core (:class:`kvtier.parallel.RankCache`), serving a Mooncake conversation slice in two
configurations (device only, device + host), for each rank count asked (1 = the whole
model in one process, the baseline). Completions and decision digests are exchanged every
step (:class:`kvtier.parallel.StepSync`); the agreement's cost per step is its measured
wall time (exchanges and clock broadcasts) over the scheduler's steps.

Collectives: NCCL when every rank has a GPU of its own; NCCL refuses two ranks on one GPU
("Duplicate GPU detected", since NCCL 2.5), so ranks sharing a GPU go through gloo (the
model's sums staged through host memory). With ``--comm auto`` a 2-rank NCCL probe on the
shared GPU records what NCCL says first.

    python bench/gpu_tp.py --model llama-1b --ranks 1,2 --tokens 60000 --out tp.json
    python bench/gpu_tp.py --model tiny --ranks 1,2 --tokens 3000   # the CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from kvtier.model import config, model_layout
from kvtier.replay.model_replay import E2ESetup, build_requests, capacities, conversation_slice
from kvtier.parallel import StepSync, launch
from kvtier.parallel.tp import TPJob, run_tp_rank
from kvtier.replay.trace import load_trace


def nccl_probe(sync: StepSync, _: Any) -> float:
    """One NCCL all-reduce on this rank's GPU; the sum over ranks."""
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    ap.add_argument("--tokens", type=int, default=3000, help="prompt tokens of the slice")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-prompt", type=int, default=8192)
    ap.add_argument("--max-output", type=int, default=4)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--device-frac", type=float, default=0.2)
    ap.add_argument("--host-frac", type=float, default=1.0)
    ap.add_argument("--comm", choices=("auto", "nccl", "gloo"), default="auto")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout, s")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    cfg = config(a.model)
    layout = model_layout(cfg, 2 if cuda else 4)
    setup = E2ESetup(device_units=0, host_units=0, time_scale=a.time_scale, max_prompt=a.max_prompt,
                     max_output=a.max_output, token_budget=a.token_budget, backend="numba" if cuda else "cpu")
    sl = conversation_slice(load_trace(), a.tokens, a.max_prompt)
    reqs, prompts, outs = build_requests(sl, layout, cfg.vocab, setup)
    caps = capacities(reqs, layout.alignment, a.device_frac, a.host_frac)
    ranks = [int(x) for x in a.ranks.split(",")]
    doc: dict[str, Any] = {"model": cfg.name, "requests": len(reqs), "prompt_tokens": sum(r.prompt_tokens for r in reqs),
                           "capacities": caps, "gpus": gpus, "runs": [], "nccl_probe": None}
    print(f"{cfg.name}: {len(reqs)} requests, {doc['prompt_tokens']:,} prompt tokens, capacities {caps}, "
          f"{gpus} GPU(s)", flush=True)
    if cuda and a.comm == "auto" and max(ranks) > gpus:
        try:
            got = launch(nccl_probe, 2, None, backend="nccl", timeout_s=60, device="cuda:0")
            doc["nccl_probe"] = {"ok": True, "sums": got}
        except Exception as e:  # NCCL refuses ranks sharing a GPU: record what it said
            doc["nccl_probe"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        print(f"NCCL probe, 2 ranks on one GPU: {doc['nccl_probe']}", flush=True)
    configs = (("device-only", caps["device_units"], None), ("device+host", caps["device_units"], caps["host_units"]))
    for n in ranks:
        if a.comm == "auto":
            comm = "nccl" if cuda and n <= gpus else "gloo"
        else:
            comm = a.comm
        shared = cuda and n > gpus
        job = TPJob(cfg, tuple(reqs), prompts, outs, configs, backend=setup.backend, token_budget=a.token_budget,
                    check=not a.no_check, no_reuse_samples=1, measured=True,
                    stage_through_host=cuda and comm == "gloo", gpus=gpus)
        t1 = time.perf_counter()
        try:
            res = launch(run_tp_rank, n, job, backend=comm, timeout_s=a.timeout,
                         device="cpu" if comm == "gloo" else None)
        except Exception:
            doc["runs"].append({"ranks": n, "comm": comm, "error": traceback.format_exc()[-2000:]})
            print(f"ranks {n}: failed\n{doc['runs'][-1]['error']}", flush=True)
            continue
        agree = all(r["configurations"][i]["digest"] == res[0]["configurations"][i]["digest"]
                    for r in res for i in range(len(configs)))
        run = {"ranks": n, "comm": comm, "ranks_share_gpu": shared, "digests_agree": agree,
               "wall_s": time.perf_counter() - t1, "shard_unit_bytes": res[0]["shard_unit_bytes"],
               "full_unit_bytes": res[0]["full_unit_bytes"], "per_rank": res}
        doc["runs"].append(run)
        for c in res[0]["configurations"]:
            ag = c["agreement"]
            print(f"ranks {n} ({comm}{', shared GPU' if shared else ''}) {c['name']}: TTFT mean/p50/p99 "
                  f"{c['ttft']['mean']:.3f}/{c['ttft']['p50']:.3f}/{c['ttft']['p99']:.3f} s, agreement "
                  f"{ag['per_step_us']:.0f} us/step ({ag['share_of_makespan']:.2%} of makespan), "
                  f"{c['steps']} steps, hits {c['hit_tokens']:,} (host {c['host_hit_tokens']:,}), "
                  f"checks rerun {c['checks']['rerun_identical']}/{c['checks']['loaded_requests']} "
                  f"mismatches {c['checks']['page_mismatches']}, digests agree {agree}", flush=True)
    doc["command"] = " ".join(["python", "bench/gpu_tp.py", *(argv if argv is not None else sys.argv[1:])])
    doc["commit"] = a.commit
    doc["machine"] = {"gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                      "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    doc["wall_s"] = time.perf_counter() - t0
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    return 0 if all("error" not in r and r["digests_agree"] for r in doc["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
