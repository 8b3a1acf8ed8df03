"""The request lifecycle (spec ``[request]``): request records and the table that holds
them (:mod:`~kvtier.fsm.request.table`), admission, forward results, batched steps,
completion routing, how a request ends, and the request-side invariants
(:mod:`~kvtier.fsm.request.fence`).

The request records (:mod:`~kvtier.fsm.request.request`) are importable from here, as they
were from ``kvtier.fsm.request`` before the core was grouped by the spec's chapters.
"""

from .request import CALLS, TERMINAL, Admission, Outstanding, PollResult, Request, RequestEvent, RequestView

__all__ = ["Request", "Admission", "RequestEvent", "PollResult", "RequestView", "Outstanding", "CALLS", "TERMINAL"]
