"""Sequence-sharded KV cache: placement of tokens on ranks, local buffers, global positions."""

from .placement import PLACEMENTS, Placement, auto_block
from .rows import RowCache
from .sharded import ShardedKVCache

__all__ = ["PLACEMENTS", "Placement", "RowCache", "ShardedKVCache", "auto_block"]
