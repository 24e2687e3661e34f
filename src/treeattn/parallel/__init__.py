"""Distributed decode: a local attention op followed by one reduction strategy."""

from .prefill import ring_prefill, tree_prefill
from .ring import ring_decode
from .tree import tree_decode

__all__ = ["ring_decode", "ring_prefill", "tree_decode", "tree_prefill"]
