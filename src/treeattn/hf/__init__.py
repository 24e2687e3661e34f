"""transformers integration (extra ``[hf]``): the ``"treeattn"`` attention implementation,
a Cache over :class:`treeattn.cache.ShardedKVCache`, and :func:`generate` across ranks."""

from .attention import ATTN_NAME, TreeAttnCache, treeattn_attention
from .families import unsupported_reason
from .generate import generate
from .runner import ModelRunner
from .session import Session
from .split_load import load_split
from .steps import Step
from .tensor_parallel import tensor_parallel

__all__ = [
    "ATTN_NAME",
    "ModelRunner",
    "Session",
    "Step",
    "TreeAttnCache",
    "generate",
    "load_split",
    "tensor_parallel",
    "treeattn_attention",
    "unsupported_reason",
]
