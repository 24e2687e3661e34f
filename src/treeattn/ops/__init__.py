"""Single-device core: attention states, attention with lse, the energy function.

Nothing here imports ``torch.distributed``."""

from ._decode_cpu import kernel_features, kernel_info
from .alibi import Alibi, alibi_slopes
from .attention import BACKENDS, attention_with_lse, check_attention_inputs
from .state import empty_state, merge_states, merge_states_n, normalize_lse

__all__ = [
    "Alibi",
    "BACKENDS",
    "alibi_slopes",
    "attention_with_lse",
    "check_attention_inputs",
    "empty_state",
    "kernel_features",
    "kernel_info",
    "merge_states",
    "merge_states_n",
    "normalize_lse",
]
