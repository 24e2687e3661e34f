"""The Triton source of backend ``"triton"``: the split-KV attention kernel and the merge of
its splits (:mod:`treeattn.ops._triton_attn` plans and launches them; its docstring has the
semantics). ``triton`` is imported on first use."""

from __future__ import annotations

import functools


@functools.cache
def kernels():
    """``(split_kv_fwd, merge_splits)``, compiled by Triton on first launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kv_fwd(
        Q, K, V, LO, HI, OUT, LSE,
        sqb, sqh, sqr, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        slob, slor, shib, shir,
        sob, soh, sos, sor, sod, slb, slh, sls, slr,
        H, R, S, D, DV, split_len, qk_scale, cap_in, cap_out,
        HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, ROW_BOUNDS: tl.constexpr,
        IEEE: tl.constexpr, F32DOT: tl.constexpr, FMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        # FMA: the products as broadcast multiply-adds over the BLOCK_M real rows (tl.dot pads
        # a few rows to 16, and float32's exact products pay for the padding), else tl.dot
        pid_bh = tl.program_id(0)  # axis 0: up to 2**31 - 1 programs (axes 1 and 2: 65535)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
        h = (pid_bh % H).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < R
        dd = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(
            Q + b * sqb + h * sqh + rows[:, None] * sqr + dd[None, :] * sqd,
            mask=rmask[:, None] & (dd[None, :] < D), other=0.0,
        )  # fmt: skip
        if F32DOT or FMA:
            q = q.to(tl.float32)
        if HAS_LO:
            lo = tl.load(LO + b * slob + rows * slor, mask=rmask, other=S).to(tl.int32)
            lo = tl.maximum(lo, 0)
        else:
            lo = tl.where(rmask, 0, S)
        if HAS_HI:
            hi = tl.load(HI + b * shib + rows * shir, mask=rmask, other=0).to(tl.int32)
            hi = tl.minimum(hi, S)
        else:
            hi = tl.where(rmask, S, 0)
        start = pid_s * split_len
        end = tl.minimum(start + split_len, S)
        lo_min = tl.maximum(start, tl.min(lo, 0))
        n_lo = (lo_min // BLOCK_N) * BLOCK_N
        n_hi = tl.minimum(end, tl.max(hi, 0))
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        bad = tl.zeros([BLOCK_M], tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        v_nan = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        v_pinf = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        v_ninf = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        kbase = K + b * skb + h * skh
        vbase = V + b * svb + h * svh
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = (cols >= lo_min) & (cols < n_hi)
            k = tl.load(kbase + cols[:, None] * sks + dd[None, :] * skd, mask=cmask[:, None] & (dd[None, :] < D), other=0.0)
            if F32DOT or FMA:
                k = k.to(tl.float32)
            if FMA:
                s = tl.sum(q[:, None, :] * k[None, :, :], 2)
            elif IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:  # c * tanh(scale * s / c), in log2 units (cap_out = c * log2 e)
                x = s * cap_in
                s = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
            else:
                s = s * qk_scale
            vis = cmask[None, :] & (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
            undefined = vis & ((s != s) | (s == float("inf")))
            bad = bad | tl.max(undefined.to(tl.int32), 1)
            s = tl.where(vis & ~undefined, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vbase + cols[:, None] * svs + dv[None, :] * svd, mask=cmask[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None]
            if ROW_BOUNDS:  # rows differ in bounds: p == 0 must not meet a non-finite value
                vf = v.to(tl.float32)
                fin = (vf == vf) & (tl.abs(vf) != float("inf"))
                if tl.sum((~fin).to(tl.int32)) > 0:
                    w = (p > 0).to(tl.float32)
                    if FMA:
                        v_nan += tl.sum(w[:, :, None] * (vf != vf).to(tl.float32)[None, :, :], 1)
                        v_pinf += tl.sum(w[:, :, None] * (vf == float("inf")).to(tl.float32)[None, :, :], 1)
                        v_ninf += tl.sum(w[:, :, None] * (vf == float("-inf")).to(tl.float32)[None, :, :], 1)
                    else:
                        v_nan += tl.dot(w, (vf != vf).to(tl.float32), input_precision="ieee")
                        v_pinf += tl.dot(w, (vf == float("inf")).to(tl.float32), input_precision="ieee")
                        v_ninf += tl.dot(w, (vf == float("-inf")).to(tl.float32), input_precision="ieee")
                    v = tl.where(fin, v, 0.0)
            if FMA:  # p unrounded, float32 products
                acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            else:
                pv = p.to(v.dtype)
                if F32DOT:  # the same rounding of p, then a float32 product
                    pv = pv.to(tl.float32)
                    v = v.to(tl.float32)
                if IEEE:
                    acc += tl.dot(pv, v, input_precision="ieee")
                else:
                    acc += tl.dot(pv, v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if ROW_BOUNDS:
            out = tl.where(v_pinf > 0, float("inf"), out)
            out = tl.where(v_ninf > 0, float("-inf"), out)
            out = tl.where((v_nan > 0) | ((v_pinf > 0) & (v_ninf > 0)), float("nan"), out)
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        isbad = bad > 0
        out = tl.where(isbad[:, None], float("nan"), out)
        lse = tl.where(isbad, float("nan"), lse)
        obase = OUT + b * sob + h * soh + pid_s.to(tl.int64) * sos
        tl.store(obase + rows[:, None] * sor + dv[None, :] * sod, out.to(OUT.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))
        tl.store(LSE + b * slb + h * slh + pid_s.to(tl.int64) * sls + rows * slr, lse, mask=rmask)

    @triton.jit
    def merge_splits(
        OP, LP, OUT, LSE, sob, soh, sos, sor, sod, slb, slh, sls, slr, tob, toh, tor, tod, tlb, tlh, tlr,
        H, R, DV, NS, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        # the semantics of ops.state.merge_states_n over the splits, one program per row
        pid = tl.program_id(0)
        r = (pid % R).to(tl.int64)
        bh = pid // R
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        dv = tl.arange(0, BLOCK_DV)
        smask = s < NS
        lse = tl.load(LP + b * slb + h * slh + s * sls + r * slr, mask=smask, other=float("-inf"))
        undefined = tl.max((lse != lse).to(tl.int32), 0) > 0
        lse = tl.where((lse == lse) & (lse != float("inf")), lse, float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        tot = tl.sum(w, 0)
        o = tl.load(OP + b * sob + h * soh + s[:, None] * sos + r * sor + dv[None, :] * sod,
                    mask=smask[:, None] & (dv[None, :] < DV), other=0.0)  # fmt: skip
        num = tl.sum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), 0)
        out = num / tl.where(tot > 0, tot, 1.0)
        res = m + tl.log(tl.where(tot > 0, tot, 0.0))
        out = tl.where(undefined, float("nan"), out)
        res = tl.where(undefined, float("nan"), res)
        tl.store(OUT + b * tob + h * toh + r * tor + dv * tod, out.to(OUT.dtype.element_ty), mask=dv < DV)
        tl.store(LSE + b * tlb + h * tlh + r * tlr, res)

    return split_kv_fwd, merge_splits
