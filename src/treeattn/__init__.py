"""treeattn: exact Tree Attention decoding over a sequence-sharded KV cache."""

from .ops import attention_with_lse, merge_states, merge_states_n

__version__ = "0.1.0"

__all__ = ["attention_with_lse", "merge_states", "merge_states_n", "__version__"]
