"""What treeattn needs of a transformers model and its inputs, with no state of its own: the
model check, the LM head's logits, the cache keyword of its forward, the placement block,
prefill windows, token trees, right-padded masks, checksums, and the argument checks that
:class:`treeattn.hf.Session`, :func:`treeattn.hf.generate` and the batched runner share."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import Tensor

from ._head import split_head
from .alibi import alibi_layers, prepare
from .families import unsupported_reason


def lm_logits(model: torch.nn.Module, hidden: Tensor, group=None, split: bool = False) -> Tensor:
    """float32 logits (float64 for a float64 model) of the LM head for hidden states
    ``[..., hidden]`` (the model's own final-logit softcapping, e.g. Gemma-2, applied as its
    ``forward`` does). ``split``: every rank of ``group`` holds the same ``hidden`` and calls
    this alike; on CPUs each computes a slice of the vocabulary (:mod:`treeattn.hf._head`)."""
    logits = split_head(model, hidden, group) if split else None
    if logits is None:
        logits = model.get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@functools.cache
def _cache_name(forward_cls: type) -> str:
    names = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def cache_kw(decoder: torch.nn.Module, cache) -> dict:
    """The cache keyword of the decoder's forward: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values``."""
    return {_cache_name(type(decoder)): cache}


_P = (1 << 31) - 1
_W: list[Tensor] = [torch.zeros(0, dtype=torch.int64)]


def checksum(t: Tensor) -> int:
    """An integer digest of an integer tensor's shape and values, for comparing across ranks:
    a sum of ``(value + 1) * w_i mod (2^31 - 1)`` with fixed pseudo-random weights per index
    (the same on every rank), so two different tensors collide only by chance (~2^-31)."""
    t = t.detach().cpu().to(torch.int64).reshape(-1)
    n = t.numel()
    if len(_W[0]) < n:
        _W[0] = torch.randint(1, _P, (max(n, 2 * len(_W[0]), 1024),), generator=torch.Generator().manual_seed(20))
    h = int((((t + 1) % _P) * _W[0][:n] % _P).sum()) % _P
    return h * 64 + n % 64 if n else 0


def model_problem(model: torch.nn.Module) -> str | None:
    """Why treeattn cannot run ``model`` exactly, or None. An ALiBi family's attention layers
    (BLOOM, MPT) get treeattn's forward here (:func:`treeattn.hf.alibi.prepare`)."""
    if getattr(model, "config", None) is None:
        return f"model must be a transformers model with a .config, got {type(model).__name__}"
    why = unsupported_reason(model.config, training=model.training)
    if why is None and alibi_layers(model):  # their layers take treeattn's forward
        return prepare(model)
    if why is None and not getattr(model, "_supports_attention_backend", False):
        why = (
            f"{type(model).__name__}: its attention does not go through transformers' attention interface, "
            "so treeattn cannot run it"
        )
    return why


def prefill_windows(positions: list[Tensor], lo: int, hi: int, chunk: int | None) -> list[tuple[int, int]]:
    """Split the global positions ``[lo, hi)`` into consecutive windows in which no rank holds
    more than ``chunk`` tokens (``positions[r]``: rank r's sorted positions in ``[lo, hi)``;
    None: one window). Causal attention needs the windows in position order: a query may
    only run once every earlier key exists. Interleaved placement gives every rank
    ``chunk`` tokens per window; contiguous placement runs the ranks' chunks one after another."""
    if not chunk:
        return [(lo, hi)]
    out = []
    while lo < hi:
        end = hi
        for x in positions:
            i = int(torch.searchsorted(x, lo))
            if i + chunk < len(x):
                end = min(end, int(x[i + chunk]))
        out.append((lo, end))
        lo = end
    return out


def right_padded(mask: Tensor, B: int, T: int, dims: str = "[B, T]") -> Tensor:
    """Lengths ``[B]`` (host int64) of the rows of a right-padding mask ``[B, T]``."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"attention_mask must be a {dims} tensor, got {type(mask).__name__}")
    m = mask.detach().cpu().to(torch.int64)
    if m.shape != (B, T):
        raise ValueError(f"attention_mask must be {dims}={(B, T)}, got {tuple(m.shape)}")
    lens = m.sum(1)
    if not torch.equal(m, (torch.arange(T)[None, :] < lens[:, None]).to(torch.int64)):
        raise ValueError(
            "attention_mask must describe right padding (1...1 0...0 per row); left padding is not supported"
        )
    return lens


def tree_of(parents: Sequence[int] | None, T: int) -> tuple[list[int], Tensor, Tensor]:
    """``(parents, depth [T], sees [T, T] bool)`` of a block; ``sees[i, j]``: j is i or an
    ancestor of i. Raises ValueError for a parent that points forward or out of range."""
    if parents is None:
        parents = list(range(-1, T - 1))
    else:
        if isinstance(parents, Tensor):
            parents = parents.tolist()
        if not isinstance(parents, Sequence) or isinstance(parents, str):
            raise ValueError(f"parents must be a sequence of {T} ints or None, got {type(parents).__name__}")
        parents = list(parents)
        if len(parents) != T or not all(isinstance(x, int) and not isinstance(x, bool) for x in parents):
            raise ValueError(f"parents must be {T} ints (one per token), got {parents!r}")
        bad = [i for i, x in enumerate(parents) if not -1 <= x < i]
        if bad:
            i = bad[0]
            raise ValueError(
                f"parents[{i}] = {parents[i]}: a token's parent must be an earlier token of the block "
                f"(0 <= parent < {i}) or -1 (the last committed token)"
            )
    depth = torch.zeros(T, dtype=torch.int64)
    sees = torch.eye(T, dtype=torch.bool)
    for i, a in enumerate(parents):
        if a >= 0:
            depth[i] = depth[a] + 1
            sees[i] |= sees[a]
    return parents, depth, sees


def check_ids(ids, what: str, V: int, values: bool = True) -> None:
    """ValueError unless ``ids`` is a ``[B, T]`` integer tensor with B, T >= 1 (and, with
    ``values``, ids in ``[0, V)``: a host sync on a GPU)."""
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] < 1:
        got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{what} must be a [B, T] integer tensor with B, T >= 1, got {got}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{what} must be integer token ids, got {ids.dtype}")
    if values and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{what} must lie in [0, {V}) (the model's vocabulary)")


def check_path(path, parents: list[int]) -> list[int]:
    """``path`` as a list, or ValueError unless it runs from the root of the tree ``parents`` down."""
    if isinstance(path, Tensor):
        path = path.tolist()
    if not isinstance(path, Sequence) or isinstance(path, str):
        raise ValueError(f"path must be a list of indices into the last step, got {type(path).__name__}")
    path = list(path)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(parents) for x in path):
        raise ValueError(f"path must be indices in [0, {len(parents)}) of the last step, got {path!r}")
    for i, x in enumerate(path):
        want = path[i - 1] if i else -1
        if parents[x] != want:
            raise ValueError(
                f"path {path} is not a root-to-leaf path of the last step: token {x} hangs off {parents[x]}, not {want}"
            )
    return path
