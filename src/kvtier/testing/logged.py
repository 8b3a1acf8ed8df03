"""A kit machine's run recorded as a lifecycle event log and checked offline.

Some examples of the core and facade machines (their setup's ``logged``) record the
cache they build with a real :class:`~kvtier.eventlog.EventRecorder` (into memory), and at
the end of the example replay the log through ``kvtier check``
(:func:`kvtier.cli.check.check_records`): every node and request transition the recorder saw
must be one of the spec's, with the guards it evaluated, and the operations must end once;
then the same log mutated into illegal ones (:mod:`kvtier.testing.log_mutants`: an operation
that failed settling ok, a completion never handed out, a release before the fence, ...) must
each be rejected by the rule the mutation breaks.
This checks the event log (what an engine ships to ``kvtier check``) against the run that
produced it, and drives the lifecycle observer (:attr:`kvtier.fsm.lifecycle.machines.Lifecycle.observer`).
No example records while another recorder is installed (``kvtier fuzz --event-log``).
"""

from __future__ import annotations

import io
import json
from typing import Any

from ..cli.check import check_records
from ..eventlog import EventRecorder, active_recorder
from .log_mutants import check_mutants_or_fail
from kvtier.fsm.errors import InvariantViolation

__all__ = ["LogCheck"]


class LogCheck:
    """Records ``cache`` (a TieredCache or a CacheCore) into memory from now on."""

    def __init__(self, cache: Any) -> None:
        self._buf = io.StringIO()
        self._rec = EventRecorder(self._buf)
        self._rec.attach(cache)

    @staticmethod
    def start(cache: Any, wanted: bool) -> LogCheck | None:
        """A recording of ``cache`` when ``wanted`` and no recorder is installed, else ``None``."""
        return LogCheck(cache) if wanted and active_recorder() is None else None

    def finish(self) -> int:
        """Stop recording and check the log; returns the transitions it checked.

        Raises:
            InvariantViolation: ``kvtier check`` rejects the log (a violation the kit itself
                recorded, which already failed the example, is not reported twice).
            ModelViolation: ``model_log_checker``, ``kvtier check`` accepts a mutant of the
                log, or rejects it by another rule than the one the mutation breaks.
        """
        self._rec.close()
        lines = self._buf.getvalue().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        result = check_records(enumerate(records, 1))
        v = result.violation
        if v is not None and not (v.record.get("k") == "invariants" and v.record.get("ok") is False):
            raise InvariantViolation(v.rule if v.rule not in ("spec", "guard", "format") else "state_matches_resources",
                                     "the event log", f"kvtier check rejects the recorded run: {v.render()}")
        if v is None:
            check_mutants_or_fail(records)
        return result.transitions
