"""Packed linear layers on CPU: a model's ``nn.Linear`` layers through oneDNN with each weight
reordered once into oneDNN's blocked layout (what ``torch.compile`` does when it freezes a CPU
model), instead of MKL's GEMM over the plain weight at every call.

Two things change, measured on this project's CPU (AMD EPYC, AVX-512, one thread; float32,
SmolLM2-135M's 30 layers of linears plus its 49152 x 576 LM head; ``benchmarks/packed_linear.py``):

- Speed. Rows per call 1 / 8 / 32: the layers 37.9 / 40.0 / 85.5 ms against 45.7 / 66.8 /
  118.9 ms; the LM head 7.3 / 9.0 / 20.2 ms against 11.6 / 22.1 / 37.8 ms. A decode step of 8
  rows gets its linears at about the cost of one row.
- Batch invariance. A row's output is bitwise the same whatever other rows share the call
  (MKL's GEMM picks its blocking by the number of rows, so there it is not). oneDNN has a
  kernel of its own for a single row, with other bits on some shapes (SmolLM2's 1536 -> 576
  down projection, 4096 -> 1024), so calls of 1 to 3 rows run padded to 4 (``_MIN_ROWS``).
  With packed linears, a request batched with others gets exactly the hidden states it gets
  alone.

The rounding is not MKL's: outputs differ from the plain layer's in the last bits (the tests
hold them within 1e-5). Compare a packed model with a packed model.

Only float32 weights on CPU are packed (bfloat16 and float16 were not measured; float64 is not
supported by oneDNN). The reorder picks its blocking for 8 rows per call
(``_ROWS_HINT``: 1 was 1.6x slower at 8 rows, 64 no faster than 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ROWS_HINT = 8
# Calls of fewer rows run padded to this many. oneDNN runs one row through a kernel of its own
# whose bits differ from a batch's on some shapes (1536 -> 576, 4096 -> 1024); 2 or more rows
# all agree. And 4 rows were the fastest here: SmolLM2's 30 layers, 1 / 2 / 4 rows 38 / 45 / 31
# ms, its LM head 8.2 / 9.7 / 6.7 ms (one thread).
_MIN_ROWS = 4
_ATTR = "_treeattn_packed"


def packing_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is nn.Linear and isinstance(w, Tensor) and w.device.type == "cpu"
            and w.dtype == torch.float32 and not w.is_mkldnn and not hasattr(m, _ATTR))  # fmt: skip


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    packed, dense, _ = getattr(self, _ATTR)
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):  # oneDNN's op has no backward
        return F.linear(x, self.weight if dense else packed.to_dense(), self.bias)
    n = x.numel() // max(x.shape[-1], 1)
    if 0 < n < _MIN_ROWS:  # padded with zero rows: the kernel of any batch, and the fastest
        x2 = x.reshape(n, -1)
        x2 = torch.cat([x2, x2.new_zeros(_MIN_ROWS - n, x2.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, self.bias, "none", [], "")
        return y[:n].reshape(*x.shape[:-1], y.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Run every float32 ``nn.Linear`` of ``model`` on CPU through a packed copy of its weight;
    returns how many were packed (0 where :func:`packing_available` is False, on other devices
    and dtypes). Idempotent.

    For inference: a weight that no other module of ``model`` shares is replaced by a new
    ``Parameter`` (same shape and dtype, ``requires_grad`` False) in oneDNN's layout, so no
    memory is added, but only the layer's own forward can read it: ``copy.deepcopy``,
    ``torch.save`` of the state dict and ``load_state_dict`` into the layer fail until
    :func:`unpack_linears`. A weight shared within ``model`` (an LM head tied to the
    embeddings) stays as it is, beside a packed copy that does not follow in-place changes to
    it. Pass the whole model: a weight shared with a module outside ``model`` is taken as
    unshared (the tie is gone, then and after unpacking). First, the model's CPU parameters
    and buffers are copied once into memory of their own (same values), so that a checkpoint
    memory-mapped from its file (transformers' safetensors loading) is unmapped rather than
    kept resident beside the packed weights; until it is, both are resident (the process's
    peak). A mapped file's pages are shared by the processes that map it, private copies are
    not: on p local ranks, the total moves less than the sum of the ranks' RSS suggests.
    Wherever autograd records (outside ``no_grad``, an input or a dense weight that requires
    grad) a layer runs ``F.linear`` on the dense weight.
    """
    if not packing_available():
        return 0
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    todo = [m for m in model.modules() if _packable(m)]
    if todo:  # every tensor gets memory of its own first: a checkpoint mapped from a file is let go
        for t in [*model.parameters(), *model.buffers()]:
            if not t.is_mkldnn and t.device.type == "cpu":
                t.data = t.data.clone()
    n = 0
    for m in todo:
        w = m.weight
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
        shared = owners[id(w)] > 1
        if not shared:  # the dense weight goes: the packed one takes its place
            m.weight = nn.Parameter(packed, requires_grad=False)
        setattr(m, _ATTR, (packed, shared, w.requires_grad))
        m.forward = _forward.__get__(m)
        n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears`: every packed layer gets its dense weight back (bitwise the
    original) and its own forward; returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, _ATTR):
            packed, dense, grad = getattr(m, _ATTR)
            if not dense:
                m.weight = nn.Parameter(packed.to_dense(), requires_grad=grad)
            delattr(m, _ATTR)
            del m.forward
            n += 1
    return n
