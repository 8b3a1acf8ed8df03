"""The ``kvtier`` command line.

Subcommands import their machinery only when run, so ``kvtier --help`` stays fast and
never imports torch, numba or hypothesis.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main", "build_parser"]

_DEFAULT_DIAGRAM_DIR = Path("diagrams")


def _cmd_diagram(args: argparse.Namespace) -> int:
    from .diagram import DiagramError, check_diagrams, write_diagrams

    out = Path(args.out)
    if args.check:
        problems = check_diagrams(out)
        for line in problems:
            print(line, file=sys.stderr)
        if not problems:
            print(f"diagrams in {out} match the spec")
        return 1 if problems else 0
    formats = tuple(args.format) if args.format else ("dot", "mermaid", "svg")
    try:
        paths = write_diagrams(out, formats)
    except DiagramError as exc:
        print(f"kvtier diagram: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvtier`` command (one subparser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a verified two-tier (GPU device + pinned host) KV cache lifecycle "
                    "with radix-tree prefix reuse.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("diagram", help="draw the node and request lifecycles from the spec",
                       description="Draw both lifecycles from spec/lifecycle.toml with transitions' "
                                   "GraphMachine (guards on edges). svg/png need the Graphviz 'dot' "
                                   "binary; dot and mermaid do not.")
    p.add_argument("--format", action="append", choices=["svg", "png", "dot", "mermaid"],
                   help="output format (repeatable; default: dot, mermaid and svg)")
    p.add_argument("--out", default=str(_DEFAULT_DIAGRAM_DIR), metavar="DIR",
                   help="output folder (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="exit non-zero if the committed .dot/.mmd files in DIR differ from the spec")
    p.set_defaults(func=_cmd_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    return func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
