"""The node lifecycle (spec ``[node]``): the radix tree of nodes, their pages on the device
and host tiers, and the operations that move them, composed by :class:`CacheCore`
(:mod:`~kvtier.fsm.node.core`).

The nodes and receipts (:mod:`~kvtier.fsm.node.node`) are importable from here, as they
were from ``kvtier.fsm.node`` before the core was grouped by the spec's chapters.
"""

from .node import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE, LockReceipt, Node, NodeReceipt, PageMap
from .core import CacheCore

__all__ = ["CacheCore", "Node", "NodeReceipt", "LockReceipt", "PageMap", "DEVICE_READABLE", "DEVICE_RESIDENT",
           "HOST_VISIBLE", "HOST_PENDING"]
