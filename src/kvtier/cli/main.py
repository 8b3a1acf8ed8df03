"""The ``kvtier`` command line.

Subcommands import their machinery only when run, so ``kvtier --help`` stays fast and
never imports torch, numba or hypothesis. Exit statuses: :class:`kvtier.cli.exitcodes.ExitCode`
(0 success, 1 a check failed, 2 bad input, 3 stopped before the end, 4 internal error,
130 interrupted), the same for every subcommand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .argtypes import fraction, int_in_range, positive_float, positive_int
from .exitcodes import ExitCode, LineFormatter, epilog

__all__ = ["main", "build_parser", "shadowed_by"]

_DEFAULT_DIAGRAM_DIR = Path("diagrams")
#: kvtier.cli.check.MAX_CONTEXT (the parser imports no checker; tests/cli/test_check_hostile.py ties the two)
_MAX_CONTEXT = 10_000


def _cmd_diagram(args: argparse.Namespace) -> int:
    from .diagram import DiagramError, check_diagrams, write_diagrams

    out = Path(args.out)
    if args.check:
        problems = check_diagrams(out)
        for line in problems:
            print(line, file=sys.stderr)
        if not problems:
            print(f"diagrams in {out} match the spec")
        return ExitCode.FAILED if problems else ExitCode.OK
    formats = tuple(args.format) if args.format else ("dot", "mermaid", "svg")
    try:
        paths = write_diagrams(out, formats)
    except DiagramError as exc:
        print(f"kvtier diagram: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    for p in paths:
        print(p)
    return ExitCode.OK


_TESTING_HINT = "needs the testing extra (Hypothesis): pip install 'kvtier[testing]'"


def _cmd_fuzz(args: argparse.Namespace) -> int:
    try:
        from ..testing.fuzz import campaign, replay_file
    except ImportError as exc:
        print(f"kvtier fuzz {_TESTING_HINT} ({exc})", file=sys.stderr)
        return ExitCode.USAGE
    from ..eventlog import recording

    with recording(args.event_log):
        return _fuzz(args, campaign, replay_file)


def _fuzz(args: argparse.Namespace, campaign: Any, replay_file: Any) -> int:
    if args.replay:
        result = replay_file(args.replay)
        return ExitCode.OK if result.outcome == "pass" else ExitCode.FAILED
    steps = args.steps
    if steps is None and args.minutes is None:
        steps = 10_000
    if args.machine:  # unknown or unimportable machines are bad input, before any output
        from ..testing.fuzz import CHILD_MACHINES
        from ..testing.machines import KitMachine
        from ..testing.sequence import SequenceError, machine_class

        for name in args.machine:
            if name in CHILD_MACHINES and len(args.machine) > 1:
                continue  # run in a process of its own, which says whether it loads
            cls = machine_class(name)
            if not (isinstance(cls, type) and issubclass(cls, KitMachine)):
                raise SequenceError(f"machine {name!r} is not a kvtier.testing state machine (a KitMachine "
                                    f"subclass): {cls!r}")
    world = f"{args.world_size}" if args.world_size else "1 and 2"
    print(f"kvtier fuzz: seed {args.seed}, faults {args.faults}, world size {world}, "
          + (f"{steps:,} steps" if steps is not None else f"{args.minutes} minutes"))
    res = campaign(steps=steps, minutes=args.minutes, seed_value=args.seed, faults=args.faults,
                   world_size=args.world_size, save=args.save,
                   progress=not args.no_progress and sys.stderr.isatty(),
                   mix={m: 1.0 for m in args.machine} if args.machine else None,
                   shrink=not args.no_shrink)
    print(res.report(full_coverage=args.verbose or args.require_coverage))
    if res.failure is not None:
        return ExitCode.FAILED
    if args.require_coverage and not res.coverage.complete:
        print("kvtier fuzz: coverage is not complete (--require-coverage)", file=sys.stderr)
        return ExitCode.INCOMPLETE
    if args.require_coverage and not res.product_complete:
        print("kvtier fuzz: some transitions or accepting guard values were never driven by the product "
              "(--require-coverage)", file=sys.stderr)
        return ExitCode.INCOMPLETE
    return ExitCode.OK


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import check_log

    result = check_log(args.log, context=args.context)
    print(result.report())
    return ExitCode.OK if result.ok else ExitCode.FAILED


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        from ..testing.machines import FacadeMachine
        from ..testing.verify import verify
    except ImportError as exc:
        print(f"kvtier verify {_TESTING_HINT} ({exc})", file=sys.stderr)
        return ExitCode.USAGE
    machine: type[FacadeMachine] = FacadeMachine
    meta: Any = type(FacadeMachine)
    if args.prompts:
        prompts = tuple(tuple(p) for p in args.prompts.split(","))
        if not all(prompts):
            print(f"kvtier verify: --prompts needs non-empty prompts separated by commas, got {args.prompts!r}",
                  file=sys.stderr)
            return ExitCode.USAGE
        machine = meta("FacadeMachine", (FacadeMachine,),
                       {"verify_prompts": prompts, "verify_max_units": args.max_units or 1,
                        "verify_tail": args.tail})
    elif args.requests == 1:
        machine = meta("FacadeMachine", (FacadeMachine,),  # one request, prompt 'a', 1 unit
                       {"verify_prompts": (("a",),), "verify_max_units": 1, "verify_tail": args.tail})
    elif args.tail or args.max_units:
        machine = meta("FacadeMachine", (FacadeMachine,),
                       {"verify_tail": args.tail, "verify_max_units": args.max_units or FacadeMachine.verify_max_units})
    setup = machine.verify_setup(world=args.world_size, policy=args.policy, dev_units=args.device_units,
                                 host_units=args.host_units, deadline=args.deadline)
    shown = " and ".join(repr("".join(p) + ("+1" if machine.verify_tail else "")) for p in machine.verify_prompts)
    print(f"kvtier verify: depth {args.depth}, facade with {len(machine.verify_prompts)} request(s) "
          f"(prompts {shown}, at most {machine.verify_max_units} unit(s) each), "
          f"2 cache groups, {setup.render()}")

    def progress(level: int, frontier: int, states: int) -> None:
        if not args.quiet:
            print(f"  depth {level}: {states:,} states, {frontier:,} new", file=sys.stderr, flush=True)

    from ..testing.coverage import LifecycleCoverage

    cov = LifecycleCoverage()
    with cov.recording():
        res = verify(args.depth, machine=machine, setup=setup, seconds=args.max_seconds, progress=progress,
                     check_merges=1 if args.check_merges else 0)
    print(res.report())
    hit = {i.label for i in cov.covered("transition")}
    reach = [name for name, label in (("device", "node: new --create [parent_readable]--> device"),
                                      ("host", "node: writing --writeback_ack--> backed"),
                                      ("loadback", "node: loading --loadback_ack--> backed")) if label in hit]
    print(f"lifecycle transitions taken: {len(hit)}/{cov.totals()['transition'][1]}; "
          f"exercises: {', '.join(reach) or 'nothing'}")
    if res.violation is not None:
        path = res.violation.save(args.save)
        print(f"saved as {path} (reproduce: kvtier fuzz --replay {path})")
        return ExitCode.FAILED
    if res.merge_mismatch is not None:
        return ExitCode.FAILED
    if res.stopped:
        print(f"kvtier verify: the bound was not completed ({res.stopped})", file=sys.stderr)
        return ExitCode.INCOMPLETE
    return ExitCode.OK


#: The machines of ``kvtier fuzz``'s default mix, for its help text: the keys of
#: ``kvtier.testing.fuzz.DEFAULT_MIX`` (not imported, so ``kvtier --help`` never imports
#: hypothesis; ``tests/kit/test_kit.py`` checks that the two agree).
FUZZ_DEFAULT_MACHINES = ("core", "facade", "engine", "node", "request", "l3", "transfer", "l3tier", "misuse", "reference",
                         "scheduler")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvtier`` command (one subparser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a verified two-tier (GPU device + pinned host) KV cache lifecycle "
                    "with radix-tree prefix reuse.",
        epilog=epilog(), formatter_class=LineFormatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from ..replay.command import add_parser as add_replay

    add_replay(sub)

    p = sub.add_parser("diagram", help="draw the lifecycles (node, request, l3, transfer) from the spec",
                       epilog=epilog(), formatter_class=LineFormatter,
                       description="Draw every lifecycle from spec/lifecycle.toml with transitions' "
                                   "GraphMachine (guards on edges). svg/png need the Graphviz 'dot' "
                                   "binary; dot and mermaid do not.")
    p.add_argument("--format", action="append", choices=["svg", "png", "dot", "mermaid"],
                   help="output format (repeatable; default: dot, mermaid and svg)")
    p.add_argument("--out", default=str(_DEFAULT_DIAGRAM_DIR), metavar="DIR",
                   help="output folder (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="exit non-zero if the committed .dot/.mmd files in DIR differ from the spec")
    p.set_defaults(func=_cmd_diagram)

    p = sub.add_parser("fuzz", help="stateful fuzzing campaign of the kit's state machines (needs kvtier[testing])",
                       epilog=epilog(), formatter_class=LineFormatter,
                       description="Run the Hypothesis state machines of the default mix ("
                                   + ", ".join(FUZZ_DEFAULT_MACHINES) + ") or those named by --machine "
                                   "as one campaign with fault injection; print the steps run, the invariants "
                                   "checked and the lifecycle coverage computed from the spec. A failure is "
                                   "shrunk, saved as a kvtier event sequence (JSON) and printed last, as "
                                   "readable steps.")
    p.add_argument("--steps", type=positive_int, help="stop after this many steps (default 10000 without --minutes)")
    p.add_argument("--minutes", type=positive_float, help="stop after this many minutes")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (default %(default)s)")
    p.add_argument("--faults", type=fraction, default=0.25, metavar="RATE",
                   help="the campaign's fault rate: each example draws its own from it (none, a fifth, "
                        "the rate, twice the rate), the chance that a delivered completion fails "
                        "(default %(default)s)")
    p.add_argument("--world-size", type=int, choices=[1, 2, 3, 4], help="fix the tensor-parallel ranks")
    p.add_argument("--save", default="kvtier-fuzz-failure.json", metavar="FILE",
                   help="where a failing sequence is saved (default %(default)s)")
    p.add_argument("--replay", metavar="FILE", help="replay a saved event sequence exactly and exit: status 1 if it ends in "
                   "a violation (the bug reproduces), 0 if it passes; the printed verdict "
                   "compares the outcome with the file's expected one")
    p.add_argument("--machine", action="append", metavar="NAME",
                   help="run only this machine (repeatable): a built-in one, or an engine's kit machine as "
                        "module:Class, importable from the current environment (e.g. PYTHONPATH=.) "
                        "(default: the built-in mix: " + ", ".join(FUZZ_DEFAULT_MACHINES) + ")")
    p.add_argument("--require-coverage", action="store_true",
                   help="exit 3 unless every transition, guard value and rejection was exercised, and "
                        "every transition and accepting guard value was driven by the product (every machine "
                        "but the raw lifecycle and misuse ones: core, facade, engine, l3tier, an engine's own); "
                        "meant for the built-in mix: an engine's machine alone cannot reach every transition. "
                        "Lists everything never exercised")
    p.add_argument("--no-shrink", action="store_true",
                   help="save and print a failure as found, without shrinking it (much faster when only "
                        "the verdict matters: a CI gate over many planted bugs)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every item never exercised (default: their count only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    p.add_argument("--event-log", metavar="FILE", default=None,
                   help="record every cache the run creates as a lifecycle event log (JSON lines; "
                        "check it with kvtier check FILE)")
    p.set_defaults(func=_cmd_fuzz)

    p = sub.add_parser("check", help="check a lifecycle event log against the spec and the invariants",
                       epilog=epilog(), formatter_class=LineFormatter,
                       description="Replay a lifecycle event log (JSON lines, docs/eventlog-format.md; written by "
                                   "kvtier.eventlog.EventRecorder, kvtier replay/fuzz --event-log, or an engine "
                                   "that emits the format) offline against spec/lifecycle.toml and the "
                                   "invariants. Prints the first event the spec does not allow or the first "
                                   "invariant broken, with the events leading to it. Exit status: 0 the log "
                                   "conforms; 1 it does not (a broken rule, a malformed record, a line past "
                                   "the trace reader's limits, invalid or truncated gzip data); 2 the file "
                                   "cannot be opened.")
    p.add_argument("log", metavar="LOG", help="the event log (.jsonl, or .gz)")
    p.add_argument("--context", type=int_in_range(1, _MAX_CONTEXT), default=12, metavar="N",
                   help=f"events shown before a violation, 1 to {_MAX_CONTEXT:,} (default %(default)s)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("verify", help="exhaustive bounded exploration of a small configuration (needs kvtier[testing])",
                       epilog=epilog(), formatter_class=LineFormatter,
                       description="Breadth-first over every interleaving of admissions, forward results, "
                                   "finishes, retractions, resumptions, aborts, completions (success and "
                                   "failure) and polls of two requests on a small facade, merging equivalent "
                                   "states by a canonical hash; every invariant is checked in every state.")
    p.add_argument("--depth", type=positive_int, default=6, help="bound on steps (default %(default)s)")
    p.add_argument("--world-size", type=int, default=1, choices=[1, 2], help="ranks (default %(default)s)")
    p.add_argument("--requests", type=int, default=2, choices=[1, 2],
                   help="2: prompts 'ab' and 'ac' (default); 1: prompt 'a' only. Fixpoints (every "
                        "reachable state): --requests 1 --tail --device-units 2 --host-units 2 (316 states); "
                        "--prompts a,a --tail --device-units 2 --host-units 1 (2 requests, 5,412 states)")
    p.add_argument("--prompts", metavar="P1,P2", help="the requests' prompts as unit letters, comma-separated "
                   "(e.g. 'a,a': two requests sharing the prefix 'a'); overrides --requests")
    p.add_argument("--tail", action="store_true", help="prompts end one token past their last unit (their "
                   "units may be reused whole: a later request loads them back)")
    p.add_argument("--max-units", type=positive_int, default=None, help="units a request may reserve "
                   "(default 3 for --requests 2, else 1)")
    p.add_argument("--policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--device-units", type=positive_int, default=4, help="device capacity in units (default %(default)s)")
    p.add_argument("--host-units", type=positive_int, default=4, help="host capacity in units (default %(default)s)")
    p.add_argument("--deadline", type=positive_int, default=None, help="operation deadline in steps (default: none)")
    p.add_argument("--max-seconds", type=positive_float, default=None, help="stop early after this long (exit status 3: the bound was not completed)")
    p.add_argument("--check-merges", action="store_true", help="cross-check the canonical state one step "
                   "ahead (about 3x slower): every state merged into another must have the same successors")
    p.add_argument("--save", default="kvtier-verify-violation.json", metavar="FILE",
                   help="where a violating trace is saved (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-level progress")
    p.set_defaults(func=_cmd_verify)
    return parser


def shadowed_by() -> str | None:
    """The folder that shadows the installed package, or ``None``.

    From the directory that holds a clone named ``kvtier``, ``python`` imports the clone's
    folder (no ``__init__.py`` at its root) as an empty namespace package ahead of an
    editable install: submodules still resolve through the install's finder, but names of
    the package itself do not (``from kvtier import Completion`` fails with "unknown
    location", before any kvtier code runs). The command line can tell, and does.
    """
    pkg = sys.modules.get("kvtier")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return None
    return ", ".join(str(p) for p in getattr(pkg, "__path__", ())) or "an unknown location"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (:class:`kvtier.cli.exitcodes.ExitCode`).

    Bad input is reported in one line on stderr with status 2; errors that kvtier's own
    checks find during a run (an invariant violation, a fingerprint mismatch, a stalled
    scheduler) with status 1; any other exception is a kvtier bug: its traceback is printed
    with status 4. Ctrl-C gives status 130. Run as ``python -m kvtier`` from a directory
    holding a folder named ``kvtier`` (such as a clone) that shadows the installed package,
    it says so with status 2 (:func:`shadowed_by`).
    """
    shadow = shadowed_by()
    if shadow is not None:
        print(f"kvtier: the package 'kvtier' was imported from {shadow} as an empty namespace package: a "
              f"folder named kvtier in the current directory (a clone?) hides the installed package. Run "
              f"from another directory (e.g. cd into the clone), or use the 'kvtier' command", file=sys.stderr)
        return ExitCode.USAGE
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with status 2 on a bad option or value
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return ExitCode.OK
    from kvtier.fsm import ConfigError, KvtierError

    name = f"kvtier {args.command}"
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except KvtierError as exc:
        if isinstance(exc, _check_failures()):
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return ExitCode.FAILED
        if isinstance(exc, ConfigError):  # bad input: a message, not a traceback
            print(f"{name}: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        return _internal(name)  # any other kvtier error escaping a command is a bug
    except (OSError, ValueError) as exc:  # files, and values the argparse types cannot see
        print(f"{name}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except Exception:
        return _internal(name)


def _check_failures() -> tuple[type[BaseException], ...]:
    """The errors that mean "a check failed" (exit status 1): an invariant violation, a
    fingerprint mismatch, a stalled scheduler. Looked up only in modules already imported, so
    a subcommand never imports torch for this."""
    from kvtier.fsm import InvariantViolation

    found: list[type[BaseException]] = [InvariantViolation]
    for module, name in (("kvtier.replay.fingerprint", "FingerprintMismatch"),
                         ("kvtier.scheduler.requests", "SchedulerStalled")):
        loaded = sys.modules.get(module)
        if loaded is not None:
            found.append(getattr(loaded, name))
    return tuple(found)


def _internal(name: str) -> int:
    import traceback

    traceback.print_exc()
    print(f"{name}: internal error (exit status {int(ExitCode.INTERNAL)}); this is a kvtier bug, please report "
          f"it with the traceback above", file=sys.stderr)
    return ExitCode.INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
