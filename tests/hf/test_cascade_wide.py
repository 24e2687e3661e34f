"""The batched step's shared-prefix pass (``treeattn.runtime._cascade.prefix_state``): the tokens of
long lines (``wide``) through the float32 prefill kernel, the others through the decode path,
against float64 attention on the full K/V (flash-attn's 2x rule), with and without per-token
window starts; a token's result bitwise the same whatever other tokens share the call, on
either path; non-finite keys or values, and a row whose every key scores -inf, give exactly
what the decode path gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import treeattn.ops._prefill_cpu as T
import treeattn.runtime._cascade as C
from reference import assert_within_tolerance
from treeattn.ops._decode_cpu import kernel_features
from treeattn.ops.attention import attention_state

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


@pytest.mark.parametrize("m", [1, 6, 11, 17, 40])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_prefix_pass_against_float64(monkeypatch, m, window, wide):
    taken = spy(monkeypatch)
    S, a, b = 900, 50, 850  # a segment of a larger cache: strided views
    g, k, v = group(S, a, b, m + 7 * window)
    q = torch.randn(1, 9, m, 64, generator=torch.Generator().manual_seed(m))
    start = torch.randint(0, b - a, (1, m)) if window else None
    end = torch.randint(1, b - a + 1, (1, m))  # each token its own keep
    end[0, 0] = b - a
    for e in (None, end):
        taken.clear()
        out, lse = C.prefix_state(q, g, 0, start, 0.125, None, a, b, wide=wide, end=e)
        assert taken == ([m] if wide else []), taken
        j = torch.arange(b - a)[None, None, :]
        lo = torch.zeros(1, m, 1, dtype=torch.int64) if start is None else start[0][None, :, None]
        mask = (j >= lo) & (j < (b - a if e is None else e[0][None, :, None]))
        assert_within_tolerance(out, lse, q, k, v, scale=0.125, mask=mask)


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("ends", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_a_tokens_result_does_not_depend_on_the_others(window, ends, wide):
    S, m = 700, 40
    g, _, _ = group(S, 0, S, 5)
    q = torch.randn(1, 9, m, 64, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)
    start = torch.randint(0, S - 1, (1, m), generator=gen) if window else None
    end = torch.randint(S // 2, S + 1, (1, m), generator=gen) if ends else None  # prefixes read to other depths
    full = C.prefix_state(q, g, 0, start, 0.125, None, 0, S, wide=wide, end=end)
    for sub in ([0], [5], [3, 4], list(range(3, 20)), list(range(10, 40)), [1, 9, 30, 31, 33]):
        i = torch.tensor(sub)
        st, en = (None if x is None else x[:, i] for x in (start, end))
        got = C.prefix_state(q[:, :, i], g, 0, st, 0.125, None, 0, S, wide=wide, end=en)
        assert torch.equal(got[0], full[0][:, :, i]) and torch.equal(got[1], full[1][:, :, i]), sub


def test_non_finite_values_read_give_the_decode_paths_result(monkeypatch):
    taken = spy(monkeypatch)
    S, m = 400, 40
    g, k, v = group(S, 0, S, 3)
    q = torch.randn(1, 9, m, 64)
    g.cache.v[0][0, 1, 123, 5] = float("nan")
    out, lse = C.prefix_state(q, g, 0, None, 0.125, None, 0, S, wide=True)
    assert taken == [m]  # the kernel ran; its result was not taken
    ro, rl = attention_state(q, k, v, scale=0.125, keep_fp32=True)
    torch.testing.assert_close(out, ro, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(lse, rl, equal_nan=True, rtol=0, atol=0)
    assert bool(out[:, 3:6, :, 5].isnan().all()) and int(out.isnan().sum()) == 3 * m  # KV head 1's query heads, dim 5


def test_an_infinite_value_outside_every_window_is_not_read(monkeypatch):
    taken = spy(monkeypatch)
    S, m = 400, 40
    g, k, v = group(S, 0, S, 4)
    q = torch.randn(1, 9, m, 64)
    g.cache.v[0][0, 2, 10, 7] = float("inf")  # every window starts past key 10's block of 96 keys
    start = torch.randint(96, S + 1, (1, m))
    start[0, :2] = S  # two tokens see no key: (0, -inf), from the kernel
    out, lse = C.prefix_state(q, g, 0, start, 0.125, None, 0, S, wide=True)
    assert taken == [m]
    ko, kl = T.prefill_states(q, k, v, start[0], None, 0.125, None, "auto", min_fill=0.0, min_work=0, check=False)
    assert torch.equal(out, ko) and torch.equal(lse, kl)  # the kernel's result was taken
    assert bool((lse[:, :, :2] == float("-inf")).all()) and not bool(out[:, :, :2].any())
    mask = torch.arange(S)[None, None, :] >= start[0][None, :, None]
    v = v.clone()
    v[0, 2, 10, 7] = 0.0  # (the reference would weigh it by 0 too: inf * 0)
    assert_within_tolerance(out[:, :, 2:], lse[:, :, 2:], q[:, :, 2:], k, v, scale=0.125, mask=mask[:, 2:])


def test_a_row_whose_every_key_scores_minus_inf_gets_nan_as_on_the_decode_path(monkeypatch):
    taken = spy(monkeypatch)
    S, m = 300, 8
    g, k, v = group(S, 0, S, 8)
    q = torch.randn(1, 9, m, 64).abs()  # q . k = -inf for the key below, in every row
    g.cache.k[0][0, :, S - 1, 0] = float("-inf")
    start = torch.randint(0, S - 1, (1, m))
    start[0, 0] = S - 1  # token 0 sees only that key: PyTorch's softmax gives NaN, the kernel (0, -inf)
    out, lse = C.prefix_state(q, g, 0, start, 0.125, None, 0, S, wide=True)
    assert taken == [m]  # the kernel ran; its result was not taken
    ro, rl = attention_state(q, k, v, scale=0.125, kv_start=start, keep_fp32=True)
    torch.testing.assert_close(out, ro, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(lse, rl, equal_nan=True, rtol=0, atol=0)
    assert bool(lse[:, :, 0].isnan().all()) and not bool(lse[:, :, 1:].isnan().any())
