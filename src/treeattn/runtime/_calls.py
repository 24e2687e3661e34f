"""A Session call's arguments checked on each rank, then agreed across the ranks: every public
call of :class:`~treeattn.runtime.Session` goes through :func:`checked`, so a bad argument on any
rank, or ranks that passed different ones, raise the same ValueError on every rank before the
model runs (the one all-gather of :func:`treeattn.comm.validate.agree`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..comm.validate import agree
from . import inputs as S


def checked(op: str, validate: Callable[[], tuple[Any, int]], *, check: bool, group, committed: int,
            ids: Tensor | None = None) -> Any:  # fmt: skip
    """``validate()``'s value: it checks this rank's arguments (raising ValueError or TypeError)
    and returns ``(value, checksum of the arguments besides ids)``. With ``check``, the ranks
    agree on ``op``, ``ids`` (shape and checksum), that checksum and the ``committed`` token
    count (collective over ``group``); without, only this rank's error raises."""
    err, value, extra = None, None, -1
    try:
        value, extra = validate()
    except (ValueError, TypeError) as e:
        err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    if check:
        ok = err is None and ids is not None
        agree({"call": op, "batch": ids.shape[0] if ok else -1, "tokens": ids.shape[1] if ok else -1,
               "token ids checksum": S.checksum(ids) if ok else -1, "arguments checksum": extra if err is None else -1,
               "committed tokens": committed}, err, group=group)  # fmt: skip
    elif err is not None:
        raise ValueError(err)
    return value
