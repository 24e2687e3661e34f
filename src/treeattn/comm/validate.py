"""Agree on a call's metadata across ranks with one small integer collective.

Every rank contributes a fixed-size int64 vector: an error flag, its local error message as
UTF-8 bytes (truncated), and the call's metadata fields. After one all-gather every rank
knows every rank's verdict, so a bad input on any rank raises ``ValueError`` on *all*
ranks before any payload collective — nobody is left waiting in a collective.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from .collectives import all_gather, world

_MSG = 240  # bytes of error message carried per rank
_FIELDS = 16


def float_bits(x: float) -> int:
    """An exact int64 encoding of a float (for metadata comparison)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


def agree(
    fields: dict[str, int],
    local_error: str | None,
    *,
    group: dist.ProcessGroup | None = None,
    show: dict[str, dict[int, str] | str] | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank had a local
    error (the message alone when every rank had the same one, else each bad rank's
    message prefixed by ``rank r:``) or the ranks disagree on a field. ``show`` maps a
    field to a code->name table (or ``"float"``) used to print values. One all-gather of
    ``2 + 240 + 16`` int64 on ``device`` (default: the current CUDA device on an NCCL
    group, else the CPU)."""
    if len(fields) > _FIELDS:
        raise ValueError(f"at most {_FIELDS} metadata fields")
    rank, p = world(group)
    if device is None:
        device = _default_device(group) if p > 1 else "cpu"
    msg = (local_error or "").encode()[:_MSG]
    vec = torch.zeros(2 + _MSG + _FIELDS, dtype=torch.int64)
    vec[0] = local_error is not None
    vec[1] = len(msg)
    if msg:
        vec[2 : 2 + len(msg)] = torch.tensor(list(msg), dtype=torch.int64)
    vec[2 + _MSG : 2 + _MSG + len(fields)] = torch.tensor(list(fields.values()), dtype=torch.int64)
    allv = all_gather(vec.to(device), group).cpu().tolist() if p > 1 else [vec.tolist()]
    bad = [(r, bytes(v[2 : 2 + v[1]]).decode(errors="replace")) for r, v in enumerate(allv) if v[0]]
    if bad:  # the same message on every rank: the error alone if every rank had it, else who said what
        if len(bad) == p and len({m for _, m in bad}) == 1:  # (untruncated when it fit: the same text)
            raise ValueError(local_error if len(local_error.encode()) <= _MSG else bad[0][1])
        raise ValueError("; ".join(f"rank {r}: {m}" for r, m in bad))
    show = show or {}
    for i, name in enumerate(fields):
        vals = [v[2 + _MSG + i] for v in allv]
        if len(set(vals)) > 1:
            fmt = show.get(name)
            if fmt == "float":
                txt = [repr(_bits_float(x)) for x in vals]
            elif isinstance(fmt, dict):
                txt = [fmt.get(x, str(x)) for x in vals]
            else:
                txt = [str(x) for x in vals]
            per = ", ".join(f"rank {r}: {t}" for r, t in enumerate(txt))
            raise ValueError(f"ranks disagree on {name} ({per}); every rank must pass the same {name}")
    del rank


def _default_device(group) -> torch.device | str:
    try:
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except (RuntimeError, ValueError):
        pass
    return "cpu"
