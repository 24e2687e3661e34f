"""treeattn: exact Tree Attention decoding over a sequence-sharded KV cache."""

from .comm import CommMeter, Topology, metering
from .ops import attention_with_lse, merge_states, merge_states_n
from .parallel import ring_decode, tree_decode

__version__ = "0.1.0"

__all__ = [
    "CommMeter",
    "Topology",
    "__version__",
    "attention_with_lse",
    "merge_states",
    "merge_states_n",
    "metering",
    "ring_decode",
    "tree_decode",
]
