"""Package data: the embedded default request trace (see README.md here for provenance)."""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["DEFAULT_TRACE_NAME", "default_trace_path"]

DEFAULT_TRACE_NAME = "mooncake_conversation_1000.jsonl.gz"


def default_trace_path() -> Traversable:
    """The embedded default trace: the first 1,000 requests of the Mooncake conversation trace.

    Returns a :class:`~importlib.resources.abc.Traversable`; open it with ``.open("rb")``
    (it is a real file path when the package is installed from a directory).
    """
    return files(__name__) / DEFAULT_TRACE_NAME
