import pytest
import torch

from reference import max_err, reference
from treeattn.ops.energy import energy, energy_attention, tree_attention_reference, tree_energy


def make(B, Hq, Hkv, Tq, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((B, Hq, Tq, D), (B, Hkv, S, D), (B, Hkv, S, D))]


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_energy_at_zero_is_lse_and_moves_with_zeta(heads):
    q, k, v = make(2, *heads, 3, 20, 8)
    zeta = torch.zeros(2, heads[0], 3, 8, dtype=torch.float64)
    F0 = energy(q, k, v, zeta)
    assert max_err(F0, reference(q, k, v)[1]) < 1e-12
    # F(ζ) = log Σ exp(s + ζ·v): check one entry against a direct sum.
    zeta = torch.randn_like(zeta)
    F = energy(q, k, v, zeta)
    h = heads[0] - 1
    kv = h // (heads[0] // heads[1])  # GQA: query head h reads kv head h // G
    s = (q[0, h] @ k[0, kv].T) / 8**0.5 + zeta[0, h] @ v[0, kv].T
    assert torch.allclose(F[0, h], torch.logsumexp(s, -1))


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_decode_attention_is_energy_gradient(heads):
    q, k, v = make(3, *heads, 1, 50, 16, seed=1)
    out = energy_attention(q, k, v)
    assert max_err(out, reference(q, k, v)[0]) < 1e-12


def test_causal_self_attention_is_gradient_of_F_tot():
    q, k, v = make(2, 4, 2, 12, 12, 8, seed=2)
    out = energy_attention(q, k, v, causal=True)
    assert max_err(out, reference(q, k, v, causal=True)[0]) < 1e-12
    # eq. 26 by hand for one row: only the first i + 1 keys contribute.
    i = 5
    w = torch.softmax(q[0, 0, i] @ k[0, 0, : i + 1].T / 8**0.5, -1)
    assert torch.allclose(out[0, 0, i], w @ v[0, 0, : i + 1])


def test_safe_softmax_shift_invariance():
    """App. F: subtracting any per-query m_i inside the exponent leaves ∂F/∂ζ unchanged,
    while F itself moves by m_i, and it is what keeps float32 from overflowing."""
    q, k, v = make(1, 2, 2, 6, 6, 8, seed=3)
    q = q * 200  # logits in the hundreds: exp overflows float32 without a shift
    base = energy_attention(q, k, v, causal=True)
    for shift in (torch.full((1, 2, 6), 123.0, dtype=torch.float64), torch.randn(1, 2, 6, dtype=torch.float64) * 1e3):
        assert max_err(energy_attention(q, k, v, causal=True, shift=shift), base) < 1e-10
    q32, k32, v32 = q.float(), k.float(), v.float()
    naive = torch.exp(q32 @ k32.transpose(-1, -2) / 8**0.5)
    assert not torch.isfinite(naive).all()  # the unshifted exponentials overflow
    ref = reference(q32, k32, v32, causal=True)[0]
    assert max_err(energy_attention(q32, k32, v32, causal=True), ref) < 1e-4


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_algorithms_1_and_2_equal_direct_attention(p):
    q, k, v = make(2, 6, 3, 2, 37, 16, seed=p)
    out, lse, depth = tree_attention_reference(q, k, v, p)
    ref_o, ref_l = reference(q, k, v)
    assert max_err(out, ref_o) < 1e-12 and max_err(lse, ref_l) < 1e-12
    assert depth == {1: 0, 2: 1, 3: 2, 5: 3, 8: 3}[p]


def test_algorithm_1_with_source_and_empty_chunks():
    q, k, v = make(1, 2, 2, 1, 3, 8, seed=9)
    zeta = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    F, m, depth = tree_energy(q, k, v, 8, zeta=zeta)  # 8 chunks over 3 keys: 5 empty
    assert depth == 3
    assert max_err(F, energy(q, k, v, zeta)) < 1e-12
    s = (q @ k.transpose(-1, -2)) / 8**0.5 + zeta @ v.transpose(-1, -2)
    assert torch.allclose(m, s.amax(-1), rtol=0, atol=1e-12)
