"""The transformers adapter (extra ``[hf]``): the ``"treeattn"`` attention implementation and
a Cache over :class:`treeattn.cache.ShardedKVCache` (:mod:`.attention`, :mod:`.alibi`), what
treeattn needs of a model (:mod:`.model`, :mod:`.families`), loading (:mod:`.models`,
:mod:`.split_load`) and the weights' split over the ranks, applied from outside
(:mod:`.tensor_parallel`). What runs a model over the sharded cache is :mod:`treeattn.runtime`;
decoding methods are :mod:`treeattn.decoding`."""

from .attention import ATTN_NAME, Step, TreeAttnCache, treeattn_attention
from .families import unsupported_reason
from .split_load import load_split
from .tensor_parallel import tensor_parallel

__all__ = [
    "ATTN_NAME",
    "Step",
    "TreeAttnCache",
    "load_split",
    "tensor_parallel",
    "treeattn_attention",
    "unsupported_reason",
]
