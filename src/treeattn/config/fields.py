"""What a settings field is: its default, its help, its range, written once and used three ways:
``validate`` (each rank, before anything runs), ``encode`` (the cross-rank agreement digests
every field's canonical text) and ``add_arguments`` / ``from_args`` (argparse options)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_META = "treeattn"


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, low: float | None = None,
            high: float | None = None, open_low: bool = False, open_high: bool = False, flag: str | None = None, cli: bool = True,
            zero_is_none: bool = False, invert: bool = False) -> Any:  # fmt: skip
    """A dataclass field of a settings class.

    ``choices``: the valid strings. ``low`` / ``high``: an inclusive range (``open_low``: ``low``
    excluded, ``open_high``: ``high`` excluded). ``flag``: the command-line option (default ``--field-name``); ``cli`` False: no
    option. ``zero_is_none``: on the command line 0 means None (off). ``invert``: a bool field set
    False by its flag (``--fixed-draft`` for ``adaptive``)."""
    meta = dict(help=help, choices=tuple(choices) if choices else None, low=low, high=high, open_low=open_low,
                open_high=open_high, flag=flag, cli=cli, zero_is_none=zero_is_none, invert=invert)  # fmt: skip
    return dataclasses.field(default=default, metadata={_META: meta})


def _kind(cls: type, name: str) -> tuple[type, bool]:
    """(int / float / str / bool, None allowed) of a field's annotation."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) or (hint,)
    base = [a for a in args if a is not type(None)]
    if len(base) != 1 or base[0] not in (int, float, str, bool):
        raise TypeError(f"{cls.__name__}.{name}: a settings field is an int, float, str or bool (or None), got {hint}")
    return base[0], type(None) in args


def check_value(cls: type, f: dataclasses.Field, v: Any) -> Any:
    """``v`` as field ``f`` of ``cls`` holds it (an int given for a float field becomes that
    float, so 1 and 1.0 agree); ValueError naming the field when ``v`` breaks its type,
    choices or range."""
    kind, optional = _kind(cls, f.name)
    m = f.metadata[_META]
    if v is None:
        if not optional:
            raise ValueError(f"{f.name} must be {_what(kind, m)}, got None")
        return v
    if kind is float and type(v) is int:
        v = float(v)
    ok = type(v) is kind and not (kind is float and not math.isfinite(v))
    if ok and m["choices"] is not None and v not in m["choices"]:
        raise ValueError(f"{f.name} must be one of {m['choices']}{' or None' if optional else ''}, got {v!r}")
    if ok and kind in (int, float):
        lo, hi = m["low"], m["high"]
        ok = (lo is None or (v > lo if m["open_low"] else v >= lo)) and (hi is None or (v < hi if m["open_high"] else v <= hi))
    if not ok:
        raise ValueError(f"{f.name} must be {_what(kind, m)}{' or None' if optional else ''}, got {v!r}")
    return v


def _what(kind: type, m: dict) -> str:
    if m["choices"] is not None:
        return f"one of {m['choices']}"
    name = {int: "an int", float: "a finite number", str: "a string", bool: "a bool"}[kind]
    lo, hi = m["low"], m["high"]
    if lo is not None and hi is not None:
        return f"{name} in {'(' if m['open_low'] else '['}{lo}, {hi}{')' if m['open_high'] else ']'}"
    if lo is not None:
        return f"{name} {'>' if m['open_low'] else '>='} {lo}"
    return name


def validate_fields(obj: Any) -> None:
    """:func:`check_value` for every field of a settings dataclass (frozen: normalised in place)."""
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, check_value(type(obj), f, getattr(obj, f.name)))


def encode(value: Any) -> str:
    """The canonical text of a plain value (None, bool, int, float, str, or a tuple / list of
    them): equal texts for equal values, floats exactly (``float.hex``), types told apart."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return f"i{value}"
    if isinstance(value, float):
        return f"f{value.hex()}"
    if isinstance(value, str):
        return f"s{value!r}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(encode(x) for x in value) + ")"
    raise TypeError(f"cannot agree on a {type(value).__name__} value: pass a plain value or a settings dataclass")


def flatten(fields: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, plain value) of every entry; a settings dataclass gives each of its fields under
    its own name (a dataclass's name is only its key)."""
    for key, value in fields.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                yield f.name, getattr(value, f.name)
        else:
            yield key, value


# ------------------------------------------------------------------ argparse


def _option(f: dataclasses.Field) -> str:
    return f.metadata[_META]["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                  skip: Sequence[str] = (), defaults: Mapping[str, Any] | None = None,
                  helps: Mapping[str, str] | None = None, highs: Mapping[str, float] | None = None) -> None:  # fmt: skip
    """One option per field of ``cls`` (except ``skip`` and fields made with ``cli=False``):
    its type, choices, range and default from the field. ``defaults`` / ``helps`` override a
    field's default / help for this command; ``highs`` narrow a field's range (the most this
    command takes)."""
    defaults, helps, highs = dict(defaults or {}), dict(helps or {}), dict(highs or {})
    for f in dataclasses.fields(cls):
        m = f.metadata[_META]
        if f.name in skip or not m["cli"]:
            continue
        kind = _kind(cls, f.name)[0]
        default = defaults.get(f.name, f.default)
        text = helps.get(f.name, m["help"]).replace("%", "%%")  # argparse formats help with %
        dest = f.name  # one namespace per command: the field names of its settings are distinct
        if kind is bool:
            action = "store_false" if m["invert"] else "store_true"
            parser.add_argument(_option(f), dest=dest, action=action, default=default, help=text)
            continue
        shown = f" (default {default})" if default is not None and "default" not in text else ""
        if default is None and m["zero_is_none"]:
            default = 0
        kw: dict[str, Any] = dict(dest=dest, default=default, help=text + shown)
        if m["choices"] is not None:
            kw["choices"] = list(m["choices"])
        else:
            kw["type"], kw["metavar"] = _parse(cls, f, kind, highs.get(f.name)), "N" if kind is int else "X"
        parser.add_argument(_option(f), **kw)


def _parse(cls: type, f: dataclasses.Field, kind: type, high: float | None):
    m = f.metadata[_META]

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {s!r}") from None
        if m["zero_is_none"] and v == 0:
            return v
        try:
            v = check_value(cls, f, v)
        except ValueError:  # argparse names the option itself
            off = " (or 0: off)" if m["zero_is_none"] else ""
            raise argparse.ArgumentTypeError(f"must be {_what(kind, m)}{off}, got {s}") from None
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {s}")
        return v

    parse.__name__ = kind.__name__
    return parse


def from_args(cls: type, ns: argparse.Namespace, **override: Any):
    """The ``cls`` value of the options :func:`add_arguments` added (0 back to None where the
    field says so; fields without an option keep their default unless given in ``override``)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):
            v = getattr(ns, f.name)
            if f.metadata[_META]["zero_is_none"] and v == 0:
                v = None
            kw[f.name] = v
    kw.update(override)
    return cls(**kw)
