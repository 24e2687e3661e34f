"""treeattn.config: settings checked when made, canonical encodings for the agreement, and the
command-line options generated from the fields (choices, ranges and defaults written once)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from treeattn.config import Layout, Sampling, Serving, Speculation, add_arguments, encode, flatten, from_args

ALL = (Layout, Sampling, Speculation, Serving)


@pytest.mark.parametrize(
    "cls, kw, text",
    [
        (Layout, dict(attention="flash"), "attention must be one of ('tree', 'ring'), got 'flash'"),
        (Layout, dict(prefill_chunk=0), "prefill_chunk must be an int >= 1 or None, got 0"),
        (Layout, dict(block=True), "block must be an int >= 1 or None, got True"),
        (Layout, dict(cuda_graph=1), "cuda_graph must be a bool, got 1"),
        (Sampling, dict(top_p=1.5), "top_p must be a finite number in (0, 1] or None, got 1.5"),
        (Sampling, dict(top_p=0.0), "top_p must be a finite number in (0, 1]"),
        (Sampling, dict(eta_cutoff=1.0), "eta_cutoff must be a finite number in [0, 1) or None, got 1.0"),
        (Sampling, dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (Sampling, dict(temperature=None), "temperature must be a finite number >= 0, got None"),
        (Sampling, dict(top_k=-1), "top_k must be an int >= 0 or None, got -1"),
        (Sampling, dict(seed="0"), "seed must be an int, got '0'"),
        (Speculation, dict(speculate="medusa"), "speculate must be one of ('prompt-lookup', 'draft') or None, got 'medusa'"),
        (Speculation, dict(num_draft_tokens=0), "num_draft_tokens must be an int >= 1, got 0"),
        (Serving, dict(max_batch=0), "max_batch must be an int >= 1, got 0"),
    ],
)
def test_a_bad_field_is_named(cls, kw, text):
    with pytest.raises(ValueError) as e:
        cls(**kw)
    assert str(e.value).startswith(text), str(e.value)


def test_frozen_and_normalised():
    s = Sampling(temperature=1, top_p=1)  # ints for float fields: the same settings as 1.0
    assert s == Sampling(temperature=1.0, top_p=1.0) and type(s.temperature) is float
    assert encode(s.top_p) == encode(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.top_p = 0.5  # type: ignore[misc]


def test_encode_tells_values_and_types_apart():
    # each a different setting (1 and 1.0 are one only as fields of a float, normalised when made)
    vals = [None, True, False, 0, 1, 0.0, -0.0, 1.0, 0.1, 0.30000000000000004, 0.3, "0", "", "None", (1, 2), (1, 2.0),
            (12,), (1, 2, 3)]  # fmt: skip
    assert len({encode(v) for v in vals}) == len(vals)
    assert encode(0.1) == encode(0.1) and encode(float("inf")) != encode(float("-inf"))
    with pytest.raises(TypeError, match="cannot agree on a dict"):
        encode({})


def test_flatten_names_every_field():
    names = [n for n, _ in flatten({"a": 1, "layout": Layout(), "s": Sampling()})]
    assert names == ["a", *(f.name for f in dataclasses.fields(Layout)), *(f.name for f in dataclasses.fields(Sampling))]


def _parser(*classes) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    for c in classes:
        add_arguments(p, c)
    return p


def test_defaults_round_trip_through_the_command_line():
    a = _parser(*ALL).parse_args([])
    for c in ALL:
        assert from_args(c, a) == c(), c.__name__


def test_options_from_fields():
    a = _parser(*ALL).parse_args(["--prefill-chunk", "0", "--placement", "contiguous", "--sample", "--top-p", "0.5",
                                  "--top-k", "0", "--eta-cutoff", "0", "--fixed-draft", "--speculate", "draft",
                                  "--max-batch", "3"])  # fmt: skip
    assert from_args(Layout, a) == Layout(prefill_chunk=None, placement="contiguous")
    assert from_args(Sampling, a, seed=4) == Sampling(do_sample=True, top_p=0.5, seed=4)
    assert from_args(Speculation, a) == Speculation(speculate="draft", adaptive_draft=False)
    assert from_args(Serving, a).max_batch == 3
    assert "--seed" not in _parser(Sampling).format_help()  # cli=False: the command's own --seed


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--top-p", "2"], "argument --top-p: must be a finite number in (0, 1]"),
        (["--top-p", "x"], "argument --top-p: not a number: 'x'"),
        (["--num-draft-tokens", "0"], "argument --num-draft-tokens: must be an int >= 1"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    ],
)
def test_bad_options_are_refused_by_argparse(argv, text):
    with pytest.raises(argparse.ArgumentError) as e:
        _parser(*ALL).parse_args(argv)
    assert text in str(e.value), str(e.value)


def test_one_process_agreement():
    from treeattn.comm.validate import agree

    agree({"layout": Layout(), "n": 3}, None)  # p = 1: nothing to disagree with
    with pytest.raises(ValueError, match="^bad$"):
        agree({"layout": Layout()}, "bad")
    with pytest.raises(ValueError, match="cannot agree on a set"):
        agree({"x": {1}}, None)
    with pytest.raises(RuntimeError, match="share a name"):
        agree({"a": Layout(), "b": Layout()}, None)



def test_memory_sizes():
    """``--kv-cache-memory``: sizes with binary and decimal units or in bytes, fractions in (0, 1),
    and what is neither refused."""
    from treeattn._argtypes import memory_size

    assert memory_size("8GiB")[:2] == ("bytes", 8 * 2**30) and memory_size("2G")[:2] == ("bytes", 2 * 2**30)
    assert memory_size("512 MiB")[:2] == ("bytes", 512 * 2**20) and memory_size("1.5GB")[:2] == ("bytes", 1.5e9)
    assert memory_size("4096")[:2] == ("bytes", 4096) and memory_size("1")[:2] == ("bytes", 1)
    assert memory_size("0.25") == ("fraction", 0.25, "0.25")
    for bad in ("lots", "0", "-1GiB", "1.5", "2 parsecs", "", "nan", "inf", "GiB", "2e"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)
