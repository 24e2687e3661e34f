"""The batched step's shared-prefix pass (``treeattn.hf._cascade.prefix_state``) over many
tokens: blocks of 32 query rows through the float32 prefill kernel, a short tail through
decode_cpu, against float64 attention on the full K/V (flash-attn's 2x rule), with and without
per-token window starts; non-finite keys or values give exactly what the decode path gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import treeattn.hf._cascade as C
from reference import assert_within_tolerance
from treeattn.ops._decode_cpu import kernel_features
from treeattn.ops.attention import _attention

pytestmark = pytest.mark.skipif(
    "prefill512" not in kernel_features(), reason="the prefill kernel needs AVX-512 and a C compiler"
)


def group(S: int, a: int, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 3, S, 64, generator=g)
    v = torch.randn(1, 3, S, 64, generator=g)
    return SimpleNamespace(cache=SimpleNamespace(k=[k], v=[v])), k[:, :, a:b], v[:, :, a:b]


def spy(monkeypatch) -> list[int]:
    taken, real = [], C.prefill_states

    def wrap(q, *a, **kw):
        r = real(q, *a, **kw)
        taken.append(0 if r is None else q.shape[2])
        return r

    monkeypatch.setattr(C, "prefill_states", wrap)
    return taken


@pytest.mark.parametrize("m", [6, 7, 8, 11, 16, 17, 22, 40, 90])
@pytest.mark.parametrize("window", [False, True])
def test_prefix_pass_against_float64(monkeypatch, m, window):
    taken = spy(monkeypatch)
    S, a, b = 900, 50, 850  # a segment of a larger cache: strided views (21 rows x 800 keys: the kernel's least work)
    g, k, v = group(S, a, b, m + 7 * window)
    q = torch.randn(1, 9, m, 64, generator=torch.Generator().manual_seed(m))
    start = torch.randint(0, b - a, (1, m)) if window else None
    out, lse = C.prefix_state(q, g, 0, start, 0.125, None, a, b)
    R = 3 * m  # rows per KV head
    wide = R if R % 32 >= C.WIDE_TAIL else R - R % 32
    assert taken == ([wide] if R >= C.WIDE_MIN else []), f"{m} tokens: the kernel took {taken} rows, expected {wide}"
    mask = None if start is None else (torch.arange(b - a)[None, None, :] >= start[0][None, :, None])
    assert_within_tolerance(out, lse, q, k, v, scale=0.125, mask=mask)


def test_non_finite_values_read_give_the_decode_paths_result(monkeypatch):
    taken = spy(monkeypatch)
    S, m = 400, 40
    g, k, v = group(S, 0, S, 3)
    q = torch.randn(1, 9, m, 64)
    g.cache.v[0][0, 1, 123, 5] = float("nan")
    out, lse = C.prefix_state(q, g, 0, None, 0.125, None, 0, S)
    assert taken == [120]  # the kernel ran; its result was not taken
    ro, rl = _attention(q, k, v, scale=0.125, keep_fp32=True)
    torch.testing.assert_close(out, ro, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(lse, rl, equal_nan=True, rtol=0, atol=0)
    assert bool(out[:, 3:6, :, 5].isnan().all()) and int(out.isnan().sum()) == 3 * m  # KV head 1's query heads, dim 5


def test_an_infinite_value_outside_every_window_is_not_read():
    S, m = 400, 40
    g, k, v = group(S, 0, S, 4)
    q = torch.randn(1, 9, m, 64)
    g.cache.v[0][0, 2, 10, 7] = float("inf")  # every token's window starts past key 10
    start = torch.randint(11, S, (1, m))
    out, lse = C.prefix_state(q, g, 0, start, 0.125, None, 0, S)
    mask = torch.arange(S)[None, None, :] >= start[0][None, :, None]
    v = v.clone()
    v[0, 2, 10, 7] = 0.0  # (the reference would weigh it by 0 too: inf * 0)
    assert_within_tolerance(out, lse, q, k, v, scale=0.125, mask=mask)
