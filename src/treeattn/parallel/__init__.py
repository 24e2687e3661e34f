"""Distributed decode: a local attention op followed by one reduction strategy."""

from .ring import ring_decode
from .tree import tree_decode

__all__ = ["ring_decode", "tree_decode"]
