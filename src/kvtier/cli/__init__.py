"""The ``kvtier`` command line (entry point ``kvtier = "kvtier.cli:main"``).

Modules: :mod:`.main` (the parser, :func:`main` and the small subcommands), :mod:`.argtypes`
(argparse value types), :mod:`.exitcodes` (the exit statuses every subcommand shares),
:mod:`.diagram` (``kvtier diagram``) and :mod:`.check` (``kvtier check``, the event-log
checker). ``kvtier replay`` lives with the replay, in :mod:`kvtier.replay.command`.
Importing this package and building the parser never imports torch, numba or hypothesis.
"""

from __future__ import annotations

from .main import FUZZ_DEFAULT_MACHINES, build_parser, main, shadowed_by

__all__ = ["main", "build_parser", "shadowed_by", "FUZZ_DEFAULT_MACHINES"]
