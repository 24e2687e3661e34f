"""Single-device core: attention states, attention with lse, the energy function.

Nothing here imports ``torch.distributed``. The modules whose names start with ``_`` are
private: the other packages import what they need of them from here (the kernels' entry
points for the distributed ops, the server's batched step and the shared-memory merge)."""

from ._bounds import DecodeCall, prepare_decode
from ._decode_cpu import (
    decode_torch,
    kernel_available,
    kernel_features,
    kernel_info,
    merge_packed_cpu,
    shm_gather_merge,
)
from ._prefill_cpu import prefill_states
from .alibi import Alibi, alibi_slopes
from .attention import BACKENDS, attention_state, attention_with_lse, check_attention_inputs
from .state import empty_state, merge_states, merge_states_n, normalize_lse

__all__ = [
    "Alibi",
    "BACKENDS",
    "DecodeCall",
    "alibi_slopes",
    "attention_state",
    "attention_with_lse",
    "check_attention_inputs",
    "decode_torch",
    "empty_state",
    "kernel_available",
    "kernel_features",
    "kernel_info",
    "merge_packed_cpu",
    "merge_states",
    "merge_states_n",
    "normalize_lse",
    "prefill_states",
    "prepare_decode",
    "shm_gather_merge",
]
