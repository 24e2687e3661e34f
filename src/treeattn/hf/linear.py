"""Packed linear layers on CPU: a model's float32 ``nn.Linear`` layers with each weight
reordered once for a faster kernel, instead of MKL's GEMM over the plain weight at every call.

Two kernels, the first that this machine has:

- treeattn's own (:mod:`treeattn.ops.linear_cpu`, compiled, AVX-512): the weight becomes one
  stream of 64-output groups. A decode step reads every weight once for a few rows, and this
  kernel reads them faster: SmolLM2-135M's 30 layers of linears at 1 / 8 / 32 rows per call,
  one thread, 20.9 / 26.1 / 72.7 ms against oneDNN's 34.1 / 37.3 / 79.7 and MKL's 41.4 / 58.5
  / 108.6 (``benchmarks/packed_linear.py``, ``docs/benchmarks/session.md``).
- oneDNN's (``torch.ops.mkldnn``), each weight in oneDNN's blocked layout (what
  ``torch.compile`` does when it freezes a CPU model), where the compiled kernel is missing.

Both are batch invariant: a row's output is bitwise the same whatever other rows share the
call (MKL's GEMM picks its blocking by the number of rows, so there it is not). With packed
linears a request batched with others gets exactly the hidden states it gets alone.
treeattn's kernel is so by construction (every output one fixed-order sum). oneDNN has a
kernel of its own for a single row, with other bits on some shapes (SmolLM2's 1536 -> 576 down
projection, 4096 -> 1024), so there calls of 1 to 3 rows run padded to 4 (``_MIN_ROWS``).

The rounding is neither MKL's nor each other's: outputs differ from the plain layer's in the
last bits (the tests hold them within 1e-5). Compare a packed model with a packed model on one
machine.

Only float32 weights on CPU are packed (bfloat16 and float16 were not measured; float64 is not
supported by oneDNN). oneDNN's reorder picks its blocking for 8 rows per call (``_ROWS_HINT``:
1 was 1.6x slower at 8 rows, 64 no faster than 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._host import mapped_from_file, trim_free_memory
from ..ops.linear_cpu import linear_available, pack_weight, packed_linear, unpack_weight

_ROWS_HINT = 8
# Calls of fewer rows run padded to this many. oneDNN runs one row through a kernel of its own
# whose bits differ from a batch's on some shapes (1536 -> 576, 4096 -> 1024); 2 or more rows
# all agree. And 4 rows were the fastest here: SmolLM2's 30 layers, 1 / 2 / 4 rows 38 / 45 / 31
# ms, its LM head 8.2 / 9.7 / 6.7 ms (one thread).
_MIN_ROWS = 4
_ATTR = "_treeattn_packed"


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packing_available() -> bool:
    """Whether linears can be packed here: treeattn's compiled AVX-512 kernel is loaded, or
    this PyTorch build has oneDNN's packed linear ops."""
    return linear_available() or _onednn()


def _dense(m: nn.Linear) -> Tensor:
    packed, shared, _, own = getattr(m, _ATTR)
    if shared:
        return m.weight
    return unpack_weight(packed, m.out_features, m.in_features) if own else packed.to_dense()


def _packable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is nn.Linear and isinstance(w, Tensor) and w.device.type == "cpu"
            and w.dtype == torch.float32 and not w.is_mkldnn and not hasattr(m, _ATTR))  # fmt: skip


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    packed, _, _, own = getattr(self, _ATTR)
    if torch.is_grad_enabled() and (  # the packed ops have no backward
        x.requires_grad or self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
    ):
        return F.linear(x, _dense(self), self.bias)
    if own:
        return packed_linear(x, packed, self.out_features, self.bias)
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
    ``Parameter`` (``requires_grad`` False) in the kernel's layout, so no memory is added (beyond
    treeattn's padding of the outputs to a multiple of 16), but only the layer's own forward
    can read it: treeattn's is a flat float32 tensor, oneDNN's an opaque one of the same shape.
    ``torch.save`` of the state dict and ``load_state_dict`` therefore fail or give tensors no
    other model loads, until :func:`unpack_linears`; ``copy.deepcopy`` works with treeattn's
    kernel and fails with oneDNN's. A weight shared within ``model`` (an LM head tied to the
    embeddings) stays as it is, beside a packed copy that does not follow in-place changes to
    it. Pass the whole model: a weight shared with a module outside ``model`` is taken as
    unshared (the tie is gone, then and after unpacking). First, the model's CPU parameters and
    buffers that are mapped from a file (transformers' safetensors loading) are copied once
    into memory of their own (same values), so that the checkpoint is unmapped rather than kept
    resident beside the packed weights (until it is, both are resident: the process's peak);
    tensors in memory of their own already (``load_split``'s) are not copied. Then the weights
    are packed one at a time, each dense weight let go as its packed copy takes its place, and
    the heap's free pages go back to the OS. A mapped file's pages are shared by the processes that map it, private copies are
    not: on p local ranks, the total moves less than the sum of the ranks' RSS suggests.
    Wherever autograd records (outside ``no_grad``, an input, a dense weight or a bias that
    requires grad) a layer runs ``F.linear`` on the dense weight.
    """
    own = linear_available()
    if not own and not _onednn():
        return 0
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    todo = [m for m in model.modules() if _packable(m)]
    if todo:  # tensors mapped from a file get memory of their own first: the checkpoint is let go
        mapped = mapped_from_file()
        for t in [*model.parameters(), *model.buffers()]:
            if not t.is_mkldnn and t.device.type == "cpu" and t.numel() and mapped(t.data_ptr()):
                t.data = t.data.clone()
    n = 0
    for m in todo:  # one weight at a time: the packed copy replaces it, and it goes
        w = m.weight
        packed = pack_weight(w) if own else torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
        shared = owners[id(w)] > 1
        if not shared:  # the dense weight goes: the packed one takes its place (one object: a deepcopy keeps one)
            m.weight = packed = nn.Parameter(packed, requires_grad=False)
        setattr(m, _ATTR, (packed, shared, w.requires_grad, own))
        m.forward = _forward.__get__(m)
        n += 1
        del w, packed
    if todo:
        trim_free_memory()
    return n



def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears`: every packed layer gets its dense weight back (bitwise the
    original) and its own forward; returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, _ATTR):
            _, shared, grad, _ = getattr(m, _ATTR)
            if not shared:
                m.weight = nn.Parameter(_dense(m), requires_grad=grad)
            delattr(m, _ATTR)
            del m.forward
            n += 1
    return n
