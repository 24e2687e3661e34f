"""Agree on a call's settings across ranks: one small int64 all-gather, nothing pickled.

Every rank contributes a fixed-size vector: an error flag, its local error message as UTF-8
bytes (truncated), the number of fields and a 128-bit digest of every field's name and
canonical value (:func:`treeattn.config.encode`; no cap on the fields). After the all-gather
every rank knows every rank's verdict, so a bad input on any rank raises ``ValueError`` on
*all* ranks before any payload collective: nobody is left waiting in a collective. Only when
the digests differ (an error is on its way) do two more all-gathers find the first field
that differs and show every rank's value of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..config.fields import encode, flatten
from .collectives import all_gather, world

_MSG = 240  # bytes of error message (or of a field's name and value) carried per rank
_HEAD = 2 + _MSG + 3  # flag, length, message, field count, digest (2 x int64)


def _int64(b: bytes) -> int:
    return int.from_bytes(b, "little", signed=True)


def items(fields: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """(name, canonical text, value) of every field, settings dataclasses flattened."""
    out = [(name, encode(value), value) for name, value in flatten(fields)]
    if len({n for n, _, _ in out}) != len(out):
        raise RuntimeError(f"two settings fields share a name: {[n for n, _, _ in out]}")  # the same on every rank
    return out


def agree(
    fields: Mapping[str, Any],
    local_error: str | None,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank had a local error
    (the message alone when every rank had the same one, else each bad rank's message
    prefixed by ``rank r:``) or the ranks disagree on a field (``ranks disagree on NAME (rank
    0: V0, rank 1: V1, ...)``).

    ``fields`` maps names to plain values (None, bool, int, float, str, tuples of them) or to
    settings dataclasses, whose every field is compared under its own name. One all-gather of
    245 int64 on ``device`` (default: the current CUDA device on an NCCL group, else the CPU)
    when the ranks agree."""
    p = world(group)[1]
    try:
        its = items(fields)
    except TypeError as e:  # a value of no canonical text: this rank's error, shared like any other
        its, local_error = [], local_error or f"TypeError: {e}"
    if p == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    if device is None:
        device = _default_device(group)

    def gather(vec: torch.Tensor) -> list[list[int]]:
        return all_gather(vec.to(device), group).cpu().tolist()

    whole = hashlib.blake2b(digest_size=16)
    for name, text, _ in its:
        whole.update(f"{name}\0{text}\0".encode())
    d = whole.digest()
    msg = (local_error or "").encode()[:_MSG]
    vec = torch.zeros(_HEAD, dtype=torch.int64)
    vec[0], vec[1] = local_error is not None, len(msg)
    if msg:
        vec[2 : 2 + len(msg)] = torch.tensor(list(msg), dtype=torch.int64)
    vec[_HEAD - 3 :] = torch.tensor([len(its), _int64(d[:8]), _int64(d[8:])], dtype=torch.int64)
    allv = gather(vec)
    bad = [(r, bytes(v[2 : 2 + v[1]]).decode(errors="replace")) for r, v in enumerate(allv) if v[0]]
    if bad:  # the same message on every rank: the error alone if every rank had it, else who said what
        if len(bad) == p and len({m for _, m in bad}) == 1:  # (untruncated when it fit: the same text)
            raise ValueError(local_error if len(local_error.encode()) <= _MSG else bad[0][1])
        raise ValueError("; ".join(f"rank {r}: {m}" for r, m in bad))
    counts = [v[_HEAD - 3] for v in allv]
    if len(set(counts)) > 1:  # different code on the ranks
        per = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ValueError(f"ranks disagree on the number of settings ({per}); every rank must run the same treeattn")
    if len({tuple(v[_HEAD - 2 :]) for v in allv}) == 1:
        return
    # the digests differ: which field, and every rank's value of it
    hashes = [_int64(hashlib.blake2b(f"{n}\0{t}".encode(), digest_size=8).digest()) for n, t, _ in its]
    allh = gather(torch.tensor(hashes, dtype=torch.int64))
    i = next(j for j in range(len(its)) if len({h[j] for h in allh}) > 1)
    name, _, value = its[i]
    shown = f"{name}\0{value}".encode()[:_MSG]
    sv = torch.zeros(1 + _MSG, dtype=torch.int64)
    sv[0] = len(shown)
    sv[1 : 1 + len(shown)] = torch.tensor(list(shown), dtype=torch.int64)
    alls = [bytes(v[1 : 1 + v[0]]).decode(errors="replace").split("\0", 1) + [""] for v in gather(sv)]
    name = alls[0][0]
    per = ", ".join(f"rank {r}: {s[1]}" for r, s in enumerate(alls))
    raise ValueError(f"ranks disagree on {name} ({per}); every rank must pass the same {name}")


def _default_device(group) -> torch.device | str:
    try:
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except (RuntimeError, ValueError):
        pass
    return "cpu"
