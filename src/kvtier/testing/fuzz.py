"""``kvtier fuzz``: a long stateful fuzzing campaign over the kit's machines.

The campaign runs the machines of :func:`default_mix` (the core, facade, engine,
``l3tier``, ``reference`` and ``scheduler`` machines, which drive the product; the raw node, request and L3 lifecycle
machines; the ``misuse`` machine of hostile calls; and the ``vllm`` and ``sglang`` adapter
machines where vLLM or SGLang is installed), or those it is given, in rounds
(chunks of examples, each chunk with a seed derived from the campaign seed, so a campaign
is reproducible), with fault injection, until the step budget or the time budget is
spent or an invariant fails. Coverage of the lifecycles
is recorded from the spec (:mod:`kvtier.testing.coverage`). A failure is shrunk by
Hypothesis; the minimal failing run is printed as readable steps and saved as a kvtier
event sequence (:mod:`kvtier.testing.sequence`) that ``kvtier fuzz --replay`` reproduces.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from .coverage import UNREACHABLE_BY_PRODUCT, LifecycleCoverage
from .machines import INVARIANTS, STATS, KitMachine
from .sequence import EventSequence, ReplayResult, SequenceError, classify, machine_class, minimize, replay

__all__ = ["CampaignResult", "campaign", "DEFAULT_MIX", "ADAPTER_MACHINES", "CHILD_MACHINES", "default_mix",
           "replay_file"]

#: machine name -> share of the step budget
DEFAULT_MIX: dict[str, float] = {"core": 0.31, "facade": 0.31, "engine": 0.1, "node": 0.07, "request": 0.08, "l3": 0.05,
                                 "transfer": 0.02, "l3tier": 0.05, "misuse": 0.04, "reference": 0.04, "scheduler": 0.03}
#: The adapters' machines that join the default mix where their engine imports (name -> the
#: machine's module, share; :func:`default_mix`).
ADAPTER_MACHINES: dict[str, tuple[str, float]] = {"vllm": ("kvtier.adapters.vllm_machine", 0.04)}
#: The adapters' machines that run in a process of their own (name -> share): they join the
#: default mix where their engine is installed. SGLang's cache modules import on a CPU box only
#: with placeholder modules for its GPU dependencies (:mod:`kvtier.testing.sglang_cpu`), which
#: would change what vLLM's modules import in the campaign's process; its child process runs the
#: machine's share of the budget beside the campaign (:func:`campaign`).
CHILD_MACHINES: dict[str, float] = {"sglang": 0.04}
LIFECYCLE_DRIVERS = ("core", "facade", "engine")
#: The machines that fire events at the spec's lifecycles directly (not the product).
RAW_MACHINES = ("node", "request", "l3", "transfer")
#: The machine that makes hostile calls (refusals, not lifecycle transitions of the product).
HOSTILE_MACHINES = ("misuse",)


@dataclass
class CampaignResult:
    """What a campaign did."""

    seed: int
    steps: int = 0
    examples: int = 0
    checks: int = 0
    seconds: float = 0.0
    steps_by_machine: dict[str, int] = field(default_factory=dict)
    coverage: LifecycleCoverage = field(default_factory=LifecycleCoverage)
    failure: EventSequence | None = None
    failure_result: ReplayResult | None = None
    saved: Path | None = None
    #: steps run and seconds spent when the first failure came, before the shrinking
    first_failure_step: int | None = None
    first_failure_seconds: float | None = None
    #: examples and checks of the machines run in processes of their own (:data:`CHILD_MACHINES`)
    child_examples: int = 0
    child_checks: int = 0

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def product_sources(self) -> set[str]:
        """The machines of the run that drive the product (every one but the raw lifecycle machines)."""
        return {m for m, n in self.steps_by_machine.items() if m not in RAW_MACHINES + HOSTILE_MACHINES and n}

    @property
    def product_complete(self) -> bool:
        """Every transition and accepting guard value was driven by the product."""
        drivers = self.product_sources
        return bool(drivers) and not self.coverage.product_missing(drivers)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    def report(self, full_coverage: bool = True) -> str:
        """The run as text: steps, invariants, coverage, and last the failure if any (the
        violation, the minimal sequence and where it was saved), so that it ends the output.

        Args:
            full_coverage: list every item never exercised (else only their count).
        """
        by = ", ".join(f"{k} {v:,}" for k, v in self.steps_by_machine.items())
        lines = [
            f"steps run: {self.steps:,} ({by}) in {self.examples:,} examples, {self.seconds:.1f} s "
            f"({self.steps_per_second:,.0f} steps/s)",
            f"invariants checked: {self.checks:,} checks (after every step), each of the "
            f"{len(INVARIANTS)} named invariants: {', '.join(INVARIANTS)}",
            self.coverage.report(by_source=tuple(self.steps_by_machine), full=full_coverage),
        ]
        drivers = self.product_sources
        if drivers:
            req = self.coverage.product_required()
            miss = self.coverage.product_missing(drivers)
            lines.append(f"driven by the product ({', '.join(sorted(drivers))}): {len(req) - len(miss)}/{len(req)} "
                         f"transitions and accepting guard values "
                         f"({len(self.coverage.product_exempt())} refusing guard values exempt)")
            if miss and not full_coverage:
                lines.append(f"  raw machines only (never driven by the product): {len(miss)} items "
                             "(kvtier fuzz --verbose lists them)")
            else:
                lines.append("  raw machines only (never driven by the product): "
                             + (", ".join(i.label for i in miss) or "none"))
            lines.append("  exempt, unreachable by a correct product: "
                         + "; ".join(f"{k} ({v})" for k, v in UNREACHABLE_BY_PRODUCT.items()))
        if self.failure is not None:
            res = self.failure_result
            if self.first_failure_step is not None and self.first_failure_seconds is not None:
                lines.append(f"first failure at step {self.first_failure_step:,} of the campaign, after "
                             f"{self.first_failure_seconds:.1f} s (the shrinking ran "
                             f"{self.steps - self.first_failure_step:,} steps more, "
                             f"{self.seconds - self.first_failure_seconds:.1f} s)")
            lines.append(f"VIOLATION of {res.invariant if res else '?'}: {res.message if res else ''}")
            lines.append(f"minimal failing sequence ({len(self.failure.steps)} steps, machine "
                         f"{self.failure.machine!r}):")
            lines.append(self.failure.render())
            if self.saved is not None:
                lines.append(f"saved as {self.saved} (reproduce: kvtier fuzz --replay {self.saved})")
        else:
            lines.append("result: no violation")
        return "\n".join(lines)


def default_mix() -> dict[str, float]:
    """:data:`DEFAULT_MIX`, plus the machine of each adapter of :data:`ADAPTER_MACHINES` whose
    module imports here (vLLM's where vLLM is installed: it drives the adapter inside vLLM's own
    connector code, with the same core invariants and a drain at the end of every example). An
    engine that is installed but does not import (a missing dependency) leaves its machine out
    rather than failing the campaign. SGLang's machine (:data:`CHILD_MACHINES`) joins where
    SGLang is installed; its child process leaves it out where SGLang's cache modules do not
    load even with the placeholders."""
    from .sglang_cpu import installed

    mix = dict(DEFAULT_MIX)
    for name, (module, share) in ADAPTER_MACHINES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        mix[name] = share
    if installed():
        mix.update(CHILD_MACHINES)
    return mix


def _in_child(name: str, machines: dict[str, type[KitMachine]] | None) -> bool:
    """Whether the campaign runs machine ``name`` in a process of its own (see
    :data:`CHILD_MACHINES`): not where SGLang is loaded here already, nor where the caller gave
    the machine's class."""
    from .sglang_cpu import CHILD_ENV, loaded

    return (name in CHILD_MACHINES and not loaded() and not (machines or {}).get(name)
            and not os.environ.get(CHILD_ENV))


class _Child:
    """A machine's share of a campaign run by ``python -m kvtier.testing.sglang_cpu``."""

    def __init__(self, name: str, *, steps: int | None, minutes: float | None, seed_value: int, faults: float,
                 world_size: int | None, save: Path, shrink: bool) -> None:
        self.name, self.save = name, save
        self.dir = tempfile.TemporaryDirectory(prefix=f"kvtier-fuzz-{name}-")
        self.result = Path(self.dir.name) / "result.json"
        self.saved = Path(self.dir.name) / "failure.json"
        cmd = [sys.executable, "-m", "kvtier.testing.sglang_cpu", "--seed", str(seed_value), "--faults", str(faults),
               "--save", str(self.saved), "--result", str(self.result)]
        if steps is not None:
            cmd += ["--steps", str(steps)]
        if minutes is not None:
            cmd += ["--minutes", str(minutes)]
        if world_size is not None:
            cmd += ["--world-size", str(world_size)]
        if not shrink:
            cmd.append("--no-shrink")
        self.done = False
        self.log = open(Path(self.dir.name) / "log.txt", "w+")
        from .sglang_cpu import CHILD_ENV

        env = dict(os.environ, **{CHILD_ENV: "1"})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        """End the child early (the campaign failed already)."""
        if self.done:
            return
        self.done = True
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        self.log.close()
        self.dir.cleanup()

    def finish(self, res: CampaignResult, t0: float) -> None:
        """Wait for the child and fold what it did into ``res`` (steps, checks, its failure)."""
        self.proc.wait()
        try:
            out = json.loads(self.result.read_text())
        except (OSError, ValueError):
            self.log.seek(0)
            tail = self.log.read()[-4000:]
            self.stop()
            raise RuntimeError(f"kvtier fuzz: the {self.name} machine's process ended with status "
                               f"{self.proc.returncode} and no result:\n{tail}") from None
        if not out.get("available"):
            res.steps_by_machine.pop(self.name, None)  # installed but not loadable: left out
            self.stop()
            return
        res.steps += out["steps"]
        res.steps_by_machine[self.name] = out["steps"]
        res.child_examples += out["examples"]
        res.child_checks += out["checks"]
        if out.get("saved") and res.failure is None:
            trace = EventSequence.load(out["saved"])
            res.failure = trace
            res.saved = trace.save(self.save)
            res.failure_result = ReplayResult("violation", out["steps_run"], out["invariant"], out["message"],
                                              out["failed_step"], out["detail"])
            if out.get("first_failure_step") is not None:
                res.first_failure_step = out["first_failure_step"]
                res.first_failure_seconds = out["first_failure_seconds"]
        self.stop()


def _derive(campaign_seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{campaign_seed}:{name}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def campaign(*, steps: int | None = None, minutes: float | None = None, seed_value: int = 0,
             faults: float = 0.25, world_size: int | None = None, save: str | Path | None = None,
             mix: dict[str, float] | None = None, step_count: int = 100, chunk_examples: int = 10,
             progress: bool = True, stream: TextIO | None = None,
             machines: dict[str, type[KitMachine]] | None = None,
             on_chunk: Callable[[CampaignResult], None] | None = None,
             shrink: bool = True) -> CampaignResult:
    """Run a campaign until ``steps`` steps have run or ``minutes`` have passed (the first
    reached; at least one is needed) or an invariant fails.

    Args:
        steps: step budget (``None``: none).
        minutes: time budget in minutes (``None``: none).
        seed_value: the campaign seed (every chunk's seed is derived from it).
        faults: the campaign's fault rate (0..1): each example draws its own rate from it
            (:data:`~kvtier.testing.base.FAULT_MIX`: none, a fifth, the rate, twice the rate).
        world_size: fix the tensor-parallel ranks (default: drawn from 1 and 2).
        save: where to save a failing sequence (default ``kvtier-fuzz-failure.json``).
        mix: machine name -> share of the step budget (default :func:`default_mix`: the
            adapters' machines join where their engine is installed).
        step_count: steps per example (upper bound).
        chunk_examples: examples per chunk.
        machines: name -> machine class (default: the registered kit machines).
        shrink: shrink a failure (Hypothesis, then reduction to a 1-minimal sequence) before it
            is saved; ``False`` saves the failing example as found, which is much faster when
            only the verdict matters (a CI gate over many planted bugs).
    """
    if steps is None and minutes is None:
        raise ValueError("campaign needs steps or minutes")
    if not 0.0 <= faults <= 1.0:
        raise ValueError(f"faults must be between 0 and 1, got {faults}")
    mix = dict(mix or default_mix())
    children = [name for name in mix if _in_child(name, machines)]
    classes: dict[str, Any] = {name: (machines or {}).get(name) or machine_class(name) for name in mix
                               if name not in children}
    for name, cls in classes.items():
        if not (isinstance(cls, type) and issubclass(cls, KitMachine)):
            raise SequenceError(f"machine {name!r} is not a kvtier.testing state machine "
                                f"(a KitMachine subclass): {cls!r}")
    attrs: dict[str, Any] = {"fault_rate": faults}
    if world_size is not None:
        attrs["world_size"] = world_size
    configured: dict[str, Any] = {name: cls.configured(**attrs) for name, cls in classes.items()}
    out = stream or sys.stdout
    res = CampaignResult(seed=seed_value)
    res.steps_by_machine = {name: 0 for name in mix}
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None
    t0 = time.perf_counter()
    bar: Any = None
    if progress:
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        bar = tqdm(total=steps if steps is not None else int((minutes or 0) * 60), unit=" steps" if steps else " s",
                   file=sys.stderr, dynamic_ncols=True, leave=False, desc="kvtier fuzz")
    base = settings(max_examples=chunk_examples, stateful_step_count=step_count, deadline=None, database=None,
                    derandomize=False, print_blob=False, report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate, Phase.shrink] if shrink
                    else [Phase.explicit, Phase.generate])
    STATS.reset()
    chunk = 0
    total_share = sum(mix.values()) or 1.0
    child_steps = {n: None if steps is None else max(1, round(steps * mix[n] / total_share)) for n in children}
    spawned = [_Child(name, steps=n_steps, minutes=minutes, seed_value=seed_value, faults=faults,
                      world_size=world_size, save=Path(save or "kvtier-fuzz-failure.json"), shrink=shrink)
               for name, n_steps in child_steps.items()]
    local = {name: share for name, share in mix.items() if name not in children}
    budget = None if steps is None else steps - sum(n or 0 for n in child_steps.values())
    local_steps = 0
    with res.coverage.recording():
        while local:
            if budget is not None and local_steps >= budget:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            # the machine furthest behind its share runs next
            name = min(local, key=lambda n: res.steps_by_machine[n] / local[n] if local[n] else float("inf"))
            cls = configured[name]
            # near the end of a step budget the chunks shrink, so that every machine of the
            # mix still gets its share of a small budget
            examples = chunk_examples
            if budget is not None:
                examples = max(1, min(chunk_examples, -(-(budget - local_steps) // (step_count * len(local)))))
            chunk_settings = base if examples == chunk_examples else settings(base, max_examples=examples)
            before = STATS.steps
            with res.coverage.attributed(name):
                try:
                    factory: Any = seed(_derive(seed_value, name, chunk))(lambda: cls())
                    run_state_machine_as_test(factory, settings=chunk_settings)
                except Exception as exc:  # noqa: BLE001 - a failure of the system under test
                    if STATS.failed_at_step is not None and STATS.failed_at is not None:
                        res.first_failure_step = STATS.failed_at_step
                        res.first_failure_seconds = STATS.failed_at - t0
                    current = KitMachine.kit_current()
                    trace = current.kit_sequence(f"fuzz-seed{seed_value}-{name}") if current else None
                    if trace is not None:
                        trace.description = (f"minimal failing sequence found by kvtier fuzz --seed {seed_value} "
                                             f"(machine {name}, chunk {chunk}; shrunk by Hypothesis, then "
                                             f"reduced to a 1-minimal sequence)" if shrink else
                                             f"failing sequence found by kvtier fuzz --seed {seed_value} "
                                             f"(machine {name}, chunk {chunk}; not shrunk: --no-shrink)")
                        # the replay checks the machine's own @invariant methods too, so
                        # an engine's invariant failure is named and reproduced
                        if shrink:
                            trace = minimize(trace)
                        res.failure_result = replay(trace)
                        if res.failure_result.outcome == "violation":
                            trace.expect = {"outcome": "violation", "invariant": res.failure_result.invariant}
                        else:  # never saved as "pass": a replay must fail as the campaign did
                            found, message = classify(exc)
                            trace.expect = {"outcome": "violation", "invariant": found}
                            trace.description += (f"; the campaign failed with {found}: {message}, which "
                                                  f"the replay did not reproduce")
                            res.failure_result = ReplayResult("violation", len(trace.steps), found, message,
                                                              None, "".join(traceback.format_exception(exc)))
                        res.failure = trace
                        res.saved = trace.save(save or "kvtier-fuzz-failure.json")
                    else:  # pragma: no cover - a failure before any machine ran
                        raise
            ran = STATS.steps - before
            res.steps += ran
            local_steps += ran
            res.steps_by_machine[name] += ran
            chunk += 1
            if bar is not None:
                bar.update(ran if steps is not None else 0)
                if steps is None:
                    bar.n = int(time.perf_counter() - t0)
                    bar.refresh()
                bar.set_postfix_str(res.coverage.summary(), refresh=False)
            for child in spawned:  # a child that failed ends the campaign
                if not child.done and child.proc.poll() is not None and res.failure is None:
                    child.finish(res, t0)
            if on_chunk is not None:
                on_chunk(res)
            if res.failure is not None:
                break
    for child in spawned:
        if res.failure is None and not child.done:
            child.finish(res, t0)
        else:
            child.stop()
    if bar is not None:
        bar.close()
    res.seconds = time.perf_counter() - t0
    res.examples = STATS.examples + res.child_examples
    res.checks = STATS.checks + res.child_checks
    _ = out
    return res


def replay_file(path: str | Path, stream: TextIO | None = None) -> ReplayResult:
    """Replay a saved sequence, printing its steps and the outcome."""
    out = stream or sys.stdout
    seq = EventSequence.load(path)
    print(f"replaying {path}: {seq.name!r} on machine {seq.machine!r}, {len(seq.steps)} steps", file=out)
    if seq.description:
        print(f"  {seq.description}", file=out)
    print(seq.render(), file=out)
    result = replay(seq)
    print(result.describe(), file=out)
    want = seq.expect
    verdict = "as expected" if result.matches(want) else "NOT as expected"
    print(f"expected {want.get('outcome', 'pass')}"
          + (f" of {want['invariant']}" if want.get("invariant") else "") + f": {verdict}", file=out)
    return result


def _main_args(ns: Any) -> dict[str, Any]:  # pragma: no cover - thin CLI glue
    return dict(steps=ns.steps, minutes=ns.minutes, seed_value=ns.seed, faults=ns.faults,
                world_size=ns.world_size, save=ns.save)


_ = Sequence
