"""The kernel registry (treeattn.ops.kernels): every kernel, on every device it claims that is
at hand (CPU here; CUDA in the GPU suite; Triton on CPU under its interpreter), against the
float64 reference on every call shape it says it takes; the calls it refuses raise a
ValueError with its reason (or, for the kernels that say so, run on the torch path)."""

import itertools

import pytest
import torch
from test_window_softcap import check

from treeattn import attention_with_lse
from treeattn.ops.kernels import KERNELS, Call, why_not

# (name, dtype, B, Hq, Hkv, Tq, S, D, Dv, kv_lens, causal, kv_start, softcap)
CALLS = [
    ("decode gqa", torch.float32, 2, 8, 2, 1, 300, 64, 64, False, False, None, None),
    ("ragged + garbage", torch.float32, 3, 4, 4, 1, 300, 32, 32, True, False, None, None),
    ("spec rows, causal", torch.float32, 2, 6, 3, 3, 200, 32, 32, True, True, None, None),
    ("window per row", torch.float32, 2, 8, 2, 2, 200, 32, 32, True, True, "row", None),
    ("softcap", torch.float32, 1, 4, 2, 1, 150, 32, 32, False, False, "seq", 5.0),
    ("Dv != D", torch.float32, 2, 4, 2, 1, 100, 64, 32, True, False, None, None),
    ("bfloat16", torch.bfloat16, 2, 8, 2, 1, 300, 64, 64, True, False, None, None),
    ("float16 rows", torch.float16, 1, 8, 8, 4, 120, 64, 64, False, True, None, None),
]


def _devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


# every kernel on every device at hand that it claims and can run on now (Triton on the CPU: only
# under its interpreter, which tests/conftest.py turns on where there is no CUDA)
CASES = [
    (n, d)
    for n in KERNELS
    for d in _devices()
    if d in KERNELS[n].devices and why_not(n, Call(d, torch.float32, 64, 64)) is None
]


def make_call(dtype, B, Hq, Hkv, Tq, S, D, Dv, ragged, causal, start, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, Tq, D, generator=g) * 2).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    lens = torch.randint(S // 3, S + 1, (B,), generator=g) if ragged else None
    if lens is not None:
        lens[0] = S
        for b in range(1, B):  # unused slots hold garbage that must never be read
            k[b, :, int(lens[b]) :] = float("nan")
            v[b, :, int(lens[b]) :] = float("nan")
    kv_start = None
    if start == "seq":
        kv_start = torch.randint(0, S // 2, (B,), generator=g)
    elif start == "row":
        kv_start = torch.randint(0, S // 2, (B, 1), generator=g) + torch.arange(Tq)
    return q, k, v, lens, kv_start


@pytest.mark.parametrize("name,device", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_kernel_conformance(name, device):
    kern = KERNELS[name]
    ran = 0
    for call in CALLS:
        what, dtype, B, Hq, Hkv, Tq, S, D, Dv, ragged, causal, start, cap = call
        q, k, v, lens, kv_start = make_call(dtype, B, Hq, Hkv, Tq, S, D, Dv, ragged, causal, start, cap)
        kw = dict(kv_lens=lens, causal=causal, kv_start=kv_start, softcap=cap)
        dev = lambda t: None if t is None else t.to(device)  # noqa: E731
        args = (dev(q), dev(k), dev(v))
        dkw = {key: dev(val) if isinstance(val, torch.Tensor) else val for key, val in kw.items()}
        c = Call.of(args[0], args[2], softcap=cap, kv_start=kv_start)
        if why_not(name, c) is not None and not kern.to_torch(c):
            with pytest.raises(ValueError, match=f"backend '{name}'"):
                attention_with_lse(*args, backend=name, **dkw)
            continue
        out, lse = attention_with_lse(*args, backend=name, **dkw)
        assert out.dtype == dtype and lse.dtype == torch.float32, what
        if lens is not None:
            for b in range(1, B):
                k[b, :, int(lens[b]) :] = 0
                v[b, :, int(lens[b]) :] = 0
        check(out.cpu(), lse.cpu(), q, k, v, **kw)
        ran += 1
    assert ran >= 3, f"{name} on {device} took only {ran} of the conformance calls"


def test_registry_claims():
    """Each kernel's claims, spelled out: a kernel never claims a device it cannot run on."""
    f32 = torch.float32
    assert why_not("torch", Call("cuda", torch.float64, 64, 32, mask=True, softcap=True, bounds=True)) is None
    assert "CPU" in why_not("decode_cpu", Call("cuda", f32, 64, 64))
    assert "mask" in why_not("decode_cpu", Call("cpu", f32, 64, 64, mask=True))
    assert "head dims" in why_not("flash_cpu", Call("cpu", f32, 64, 32))
    assert "CUDA" in why_not("fused_cuda", Call("cpu", f32, 64, 64))
    assert "float16" in why_not("triton", Call("cuda", torch.float64, 64, 64))
    assert "head dims" in why_not("triton", Call("cuda", torch.bfloat16, 576, 512))
    # what flash_cpu and fused_cuda hand to the torch path instead of refusing (as before the registry)
    assert KERNELS["flash_cpu"].to_torch(Call("cpu", f32, 64, 32, softcap=True))
    assert KERNELS["fused_cuda"].to_torch(Call("cpu", f32, 64, 64, bounds=True))
    assert KERNELS["fused_cuda"].to_torch(Call("cuda", torch.float64, 64, 64))
    for name, kern in KERNELS.items():
        assert kern.devices and set(kern.devices) <= {"cpu", "cuda"}, name
    assert list(itertools.chain(KERNELS)) == ["torch", "flash_cpu", "decode_cpu", "fused_cuda", "triton"]


def test_the_dispatch_alone_runs_the_chosen_kernel(monkeypatch):
    """Every kernel of the registry has a run; a call asked of a kernel runs that kernel's run (or
    the torch path's, for the calls it hands over), ``auto`` runs what ``pick`` chose, an ALiBi call
    the torch path (the only kernel that adds the bias)."""
    import treeattn.ops.dispatch as D
    from treeattn.ops import Alibi, alibi_slopes
    from treeattn.ops.kernels import pick

    assert set(D.RUNS) == set(KERNELS)
    ran = []
    for name, f in list(D.RUNS.items()):
        monkeypatch.setitem(D.RUNS, name, lambda a, f=f, name=name: (ran.append(name), f(a))[1])
    q, k, v, lens, _ = make_call(torch.float32, 2, 8, 2, 1, 300, 64, 64, True, False, None, None)
    for name, device in CASES:
        if device != "cpu":
            continue
        ran.clear()
        attention_with_lse(q, k, v, kv_lens=lens, backend=name)
        assert ran == [name], (name, ran)
    ran.clear()
    attention_with_lse(q, k, v, kv_lens=lens, softcap=5.0, backend="flash_cpu")  # handed to the torch path
    assert ran == ["torch"]
    ran.clear()
    attention_with_lse(q, k, v)
    assert ran == [pick(q, k, v, plain=True)]
    ran.clear()
    pos = torch.arange(300).expand(2, 300)
    attention_with_lse(q, k, v, alibi=Alibi(alibi_slopes(8), torch.full((2,), 300), pos))
    assert ran == ["torch"]


def test_kernel_run_is_the_dispatch_run():
    """Kernel.run runs the same function the dispatch does (one table)."""
    import treeattn.ops.dispatch as D

    q, k, v, lens, _ = make_call(torch.float32, 1, 4, 2, 1, 50, 32, 32, True, False, None, None)
    a = D.Args(q, k, v, D.scale_of(q, None), kv_lens=lens)
    for name, device in CASES:
        if device == "cpu":
            out, lse = KERNELS[name].run(a)
            ref_out, ref_lse = attention_with_lse(q, k, v, kv_lens=lens, backend=name)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), name
