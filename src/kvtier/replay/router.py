"""Routing a trace's requests over N engine instances (the multi-instance replay's router).

Two routers:

- ``round-robin``: request ``i`` goes to instance ``i mod N`` (what a load balancer that
  knows nothing about prefixes does; consecutive turns of a conversation land on different
  instances, so each instance sees only part of every conversation).
- ``conversation``: every turn of a conversation goes to the instance its first turn went
  to, and new conversations are dealt round-robin. The Mooncake format carries no
  conversation id; conversations are recovered from the hash-id chains
  (:func:`conversation_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.fsm import ConfigError

from .trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["ROUTERS", "conversation_ids", "route"]

#: Router names accepted by :func:`route`.
ROUTERS = ("round-robin", "conversation")

_MIN_SHARED_BLOCKS = 2
"""A turn continues an earlier request only when it repeats at least this many of its full
blocks: the first block of every request of the Mooncake conversation trace is one shared
system prompt (block id 0), so one shared block says nothing about the conversation."""


def conversation_ids(requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """One conversation id per request (0, 1, ... in order of first appearance).

    A request continues the conversation of the latest earlier request whose full blocks
    (``hash_ids[:input_length // block]``, i.e. without a partial last block, whose id
    changes once the block is filled by the next turn) are a prefix of its own ``hash_ids``,
    the longest such prefix winning, and at least two blocks long (see
    :data:`_MIN_SHARED_BLOCKS`); any other request starts a new conversation. On the public
    Mooncake conversation trace (12,031 requests) this finds 8,056 conversations, 3,975
    requests continuing one.

    Args:
        requests: the trace's requests in arrival order (:attr:`kvtier.replay.trace.Trace.requests`).
        block_tokens: tokens per hash-id block (:attr:`kvtier.replay.trace.Trace.block_tokens`).

    Returns:
        A list of ``len(requests)`` ints.
    """
    trie: dict[Any, Any] = {}
    out: list[int] = []
    count = 0
    for r in requests:
        node, depth, best = trie, 0, None
        for h in r.hash_ids:
            nxt = node.get(h)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
            if depth >= _MIN_SHARED_BLOCKS and "conv" in node:
                best = node["conv"]
        if best is None:
            best, count = count, count + 1
        out.append(best)
        full = r.input_length // block_tokens
        node = trie
        for h in r.hash_ids[:full]:
            node = node.setdefault(h, {})
        if full >= _MIN_SHARED_BLOCKS:
            node["conv"] = best
    return out


def route(requests: Sequence[TraceRequest], instances: int, router: str,
          block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """The instance index (``0 .. instances - 1``) of every request.

    Raises:
        ConfigError: ``instances`` below 1 or an unknown ``router`` (see :data:`ROUTERS`).
    """
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ConfigError(f"instances must be an int >= 1, got {instances!r}")
    if router == "round-robin":
        return [i % instances for i in range(len(requests))]
    if router == "conversation":
        return [c % instances for c in conversation_ids(requests, block_tokens)]
    raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
