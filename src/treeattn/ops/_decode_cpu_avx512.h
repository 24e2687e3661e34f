/* AVX-512 kernels of the decode kernel (included by _decode_cpu.c): query rows in groups of
 * 4 sharing each K/V load (block_r4_512), rows of different key ranges (block_ragged_512), and
 * the one-row kernels that give every row a group row's score bits. Defines HAVE_AVX512 and,
 * with AVX512-BF16, HAVE_BF16DP. */

#ifdef HAVE_AVX2
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_BF16DP 1
#endif
/* Keys per group in the AVX-512 4-row path (measured from memory, docs/benchmarks/kernels.md):
 * float32 reads each key's K row (scores) and V row (values of two rows) side by side in
 * groups of 4; bfloat16 computes 16 keys' scores, then their values. Other group
 * sizes measured slower here. */
#ifndef GRP_F32
#define GRP_F32 4
#endif
#ifndef GRP_BF16
#define GRP_BF16 16
#endif

/* Software prefetch in the AVX-512 4-row path, float32 only: each key's K and V rows PF_KEYS
 * keys ahead into L2, one key per iteration (measured from memory at 24 keys: 0.97-1.14x over
 * 9 pairs, median 1.08x; into L1 (T0), in a burst per group, or closer than ~16 keys: up to 2x
 * slower; bfloat16: within noise at 24 keys, much slower closer, so not used there).
 * Prefetching past the end of K/V is harmless: prefetches do not fault. */
#ifndef PF_KEYS
#define PF_KEYS 24
#endif
static inline __attribute__((always_inline)) void prefetch_l2(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

/* scale * horizontal sums of 8 accumulators (rows 0-3 x keys 0-1) into s[r * ss + j] */
static inline __attribute__((always_inline)) void hsum8x_r4(__m512 a00, __m512 a01, __m512 a10, __m512 a11, __m512 a20,
                                                            __m512 a21, __m512 a30, __m512 a31, float scale, float *s,
                                                            int64_t ss) {
    /* fold 512 -> 256 -> 128 bits for pairs of accumulators */
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(a00, a01, 0x44), _mm512_shuffle_f32x4(a00, a01, 0xEE));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(a10, a11, 0x44), _mm512_shuffle_f32x4(a10, a11, 0xEE));
    const __m512 t2 = _mm512_add_ps(_mm512_shuffle_f32x4(a20, a21, 0x44), _mm512_shuffle_f32x4(a20, a21, 0xEE));
    const __m512 t3 = _mm512_add_ps(_mm512_shuffle_f32x4(a30, a31, 0x44), _mm512_shuffle_f32x4(a30, a31, 0xEE));
    /* u0 lanes (128 bit): partials of [a00, a01, a10, a11]; u1: [a20, a21, a30, a31] */
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t2, t3, 0x88), _mm512_shuffle_f32x4(t2, t3, 0xDD));
    __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E)); /* lane l: [sum u0_l, sum u1_l, ...] */
    /* gather [a00 a01 a10 a11 a20 a21 a30 a31] into the low 8 lanes; each row's two scores
     * are one 64-bit store */
    x = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0), x);
    const __m256 y = _mm256_mul_ps(_mm512_castps512_ps256(x), _mm256_set1_ps(scale));
    const __m128 y0 = _mm256_castps256_ps128(y), y1 = _mm256_extractf128_ps(y, 1);
    _mm_storel_pi((__m64 *)s, y0);
    _mm_storeh_pi((__m64 *)(s + ss), y0);
    _mm_storel_pi((__m64 *)(s + 2 * ss), y1);
    _mm_storeh_pi((__m64 *)(s + 3 * ss), y1);
}

/* scale * horizontal sums of a0..a3 into s[0], s[ss], s[2 ss], s[3 ss] */
static inline __attribute__((always_inline)) void hsum4x(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float scale,
                                                         float *s, int64_t ss) {
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E)); /* 128-bit lane l: partials of a_l */
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    const __m512i ix = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    const __m128 y = _mm_mul_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(ix, u)), _mm_set1_ps(scale));
    _mm_store_ss(s, y);
    _mm_store_ss(s + ss, _mm_movehdup_ps(y));
    _mm_store_ss(s + 2 * ss, _mm_movehl_ps(y, y));
    _mm_store_ss(s + 3 * ss, _mm_shuffle_ps(y, y, 3));
}

/* Scores of n <= 4 query rows (qs elements apart) against one key k: s[r * ss] = scale *
 * q_r . k. bf16 (AVX512-BF16): q is bf16 and vdpbf16ps multiplies pairs into float32; float32:
 * q already scaled (scale 1). Rows beyond n are not computed; a row's bits do not depend on n. */
static inline __attribute__((always_inline)) void sc_rn_k1_x(const void *q, int64_t qs, int64_t n, const char *k,
                                                             int64_t D, float scale, float *s, int64_t ss,
                                                             const int bf) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t q1 = n > 1 ? qs : 0, q2 = n > 2 ? 2 * qs : 0, q3 = n > 3 ? 3 * qs : 0;
#ifdef HAVE_BF16DP
    if (bf) {
        const uint16_t *qh = (const uint16_t *)q, *k0 = (const uint16_t *)k;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(k0 + d);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(qh + d), x);
            if (n > 1) a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(qh + q1 + d), x);
            if (n > 2) a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(qh + q2 + d), x);
            if (n > 3) a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(qh + q3 + d), x);
        }
    } else
#endif
    {
        const float *qf = (const float *)q, *k0 = (const float *)k;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 x = _mm512_loadu_ps(k0 + d);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), x, a0);
            if (n > 1) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + q1 + d), x, a1);
            if (n > 2) a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + q2 + d), x, a2);
            if (n > 3) a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + q3 + d), x, a3);
        }
    }
    if (n == 4) {
        hsum4x(a0, a1, a2, a3, scale, s, ss);
        return;
    }
    float t[4];
    hsum4x(a0, a1, a2, a3, scale, t, 1);
    for (int64_t r = 0; r < n; r++) s[r * ss] = t[r];
}

/* the scores of 4 query rows against one key (sc_rn_k1_x) */
static inline __attribute__((always_inline)) void sc1_r4_x(const void *q, int64_t qs, const char *k, int64_t D,
                                                           float scale, float *s, int64_t ss, const int bf) {
    sc_rn_k1_x(q, qs, 4, k, D, scale, s, ss, bf);
}

/* sc1_r4_x for two keys at once (k, k + ks): each q load serves both */
static inline __attribute__((always_inline)) void sc2_r4_x(const void *q, int64_t qs, const char *k, int64_t ks,
                                                           int64_t D, float scale, float *s, int64_t ss, const int bf) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
#ifdef HAVE_BF16DP
    if (bf) {
        const uint16_t *qh = (const uint16_t *)q, *k0 = (const uint16_t *)k, *k1 = (const uint16_t *)(k + ks);
        for (int64_t d = 0; d < D; d += 32) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + d), x1 = (__m512bh)_mm512_loadu_si512(k1 + d);
            __m512bh w = (__m512bh)_mm512_loadu_si512(qh + d);
            a00 = _mm512_dpbf16_ps(a00, w, x0), a01 = _mm512_dpbf16_ps(a01, w, x1);
            w = (__m512bh)_mm512_loadu_si512(qh + qs + d);
            a10 = _mm512_dpbf16_ps(a10, w, x0), a11 = _mm512_dpbf16_ps(a11, w, x1);
            w = (__m512bh)_mm512_loadu_si512(qh + 2 * qs + d);
            a20 = _mm512_dpbf16_ps(a20, w, x0), a21 = _mm512_dpbf16_ps(a21, w, x1);
            w = (__m512bh)_mm512_loadu_si512(qh + 3 * qs + d);
            a30 = _mm512_dpbf16_ps(a30, w, x0), a31 = _mm512_dpbf16_ps(a31, w, x1);
        }
    } else
#endif
    {
        const float *qf = (const float *)q, *k0 = (const float *)k, *k1 = (const float *)(k + ks);
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 x0 = _mm512_loadu_ps(k0 + d), x1 = _mm512_loadu_ps(k1 + d);
            __m512 w = _mm512_loadu_ps(qf + d);
            a00 = _mm512_fmadd_ps(w, x0, a00), a01 = _mm512_fmadd_ps(w, x1, a01);
            w = _mm512_loadu_ps(qf + qs + d);
            a10 = _mm512_fmadd_ps(w, x0, a10), a11 = _mm512_fmadd_ps(w, x1, a11);
            w = _mm512_loadu_ps(qf + 2 * qs + d);
            a20 = _mm512_fmadd_ps(w, x0, a20), a21 = _mm512_fmadd_ps(w, x1, a21);
            w = _mm512_loadu_ps(qf + 3 * qs + d);
            a30 = _mm512_fmadd_ps(w, x0, a30), a31 = _mm512_fmadd_ps(w, x1, a31);
        }
    }
    hsum8x_r4(a00, a01, a10, a11, a20, a21, a30, a31, scale, s, ss);
}

/* Values of n keys (vs bytes apart) for two rows o, o + os: o_r += sum_i p[r * ps + i] v_i on
 * 16 * nz dims, the accumulators in registers for the whole group (one load and store per
 * group instead of per key). float32 V in natural order; bf16 V widened as the even and odd
 * elements of each 32-dim chunk (a shift and a mask, no shuffles), the accumulators permuted
 * to that order on load and back on store. With nk > 0, the scores of 4 rows q (bf16 or
 * float32 as in sc1_r4_x) against nk keys k are computed in the same loop, key i's K row
 * next to its V row (the scores go to s[r * ss + i]). */
static inline __attribute__((always_inline)) void vals2_sc(float *o, int64_t os, const char *v, int64_t vs, int64_t n,
                                                           const float *p, int64_t ps, const int nz, const int bf,
                                                           const void *q, int64_t D, const char *k, int64_t ks,
                                                           int64_t nk, float scale, float *s, int64_t ss) {
    __m512 a[8], c[8];
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
                  io = _mm512_add_epi32(ie, _mm512_set1_epi32(1)),
                  il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
                  ih = _mm512_add_epi32(il, _mm512_set1_epi32(8)), hm = _mm512_set1_epi32((int)0xffff0000u);
    for (int z = 0; z < nz; z++) a[z] = _mm512_loadu_ps(o + 16 * z), c[z] = _mm512_loadu_ps(o + os + 16 * z);
    if (bf)
        for (int z = 0; z < nz; z += 2) {
            __m512 t0 = a[z], t1 = a[z + 1];
            a[z] = _mm512_permutex2var_ps(t0, ie, t1), a[z + 1] = _mm512_permutex2var_ps(t0, io, t1);
            t0 = c[z], t1 = c[z + 1];
            c[z] = _mm512_permutex2var_ps(t0, ie, t1), c[z + 1] = _mm512_permutex2var_ps(t0, io, t1);
        }
    const int64_t nn = n > nk ? n : nk;
    const int pf = !bf && q; /* the float32 pass that also computes scores reads V first */
    for (int64_t i = 0; i < nn; i++) {
        if (pf) { /* K and V rows PF_KEYS keys ahead into L2 */
            if (i < nk) prefetch_l2(k + (i + PF_KEYS) * ks, D * 4);
            if (i < n) prefetch_l2(v + (i + PF_KEYS) * vs, nz * 64);
        }
        if (i < nk) sc1_r4_x(q, D, k + i * ks, D, scale, s + i, ss, bf);
        if (i >= n) continue;
        const __m512 w0 = _mm512_set1_ps(p[i]), w1 = _mm512_set1_ps(p[ps + i]);
        const char *vi = v + i * vs;
        if (bf)
            for (int z = 0; z < nz; z += 2) {
                const __m512i x = _mm512_loadu_si512(vi + 32 * z);
                const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                             od = _mm512_castsi512_ps(_mm512_and_si512(x, hm));
                a[z] = _mm512_fmadd_ps(w0, ev, a[z]), a[z + 1] = _mm512_fmadd_ps(w0, od, a[z + 1]);
                c[z] = _mm512_fmadd_ps(w1, ev, c[z]), c[z + 1] = _mm512_fmadd_ps(w1, od, c[z + 1]);
            }
        else
            for (int z = 0; z < nz; z++) {
                const __m512 x = _mm512_loadu_ps((const float *)vi + 16 * z);
                a[z] = _mm512_fmadd_ps(w0, x, a[z]), c[z] = _mm512_fmadd_ps(w1, x, c[z]);
            }
    }
    if (bf)
        for (int z = 0; z < nz; z += 2) {
            __m512 t0 = a[z], t1 = a[z + 1];
            a[z] = _mm512_permutex2var_ps(t0, il, t1), a[z + 1] = _mm512_permutex2var_ps(t0, ih, t1);
            t0 = c[z], t1 = c[z + 1];
            c[z] = _mm512_permutex2var_ps(t0, il, t1), c[z + 1] = _mm512_permutex2var_ps(t0, ih, t1);
        }
    for (int z = 0; z < nz; z++) _mm512_storeu_ps(o + 16 * z, a[z]), _mm512_storeu_ps(o + os + 16 * z, c[z]);
}

/* vals2_sc on dims [0, Dv) (Dv % 16 == 0, bf16: % 32), 128 at a time; the scores (nk > 0) go
 * with the first 128 */
static inline __attribute__((always_inline)) void vals2_x(float *o, int64_t os, const char *v, int64_t vs, int64_t n,
                                                          const float *p, int64_t ps, int64_t Dv, const int bf,
                                                          const void *q, int64_t D, const char *k, int64_t ks,
                                                          int64_t nk, float scale, float *s, int64_t ss) {
    /* straight-line calls (a loop over the chunk sizes compiled ~10% slower here) */
    const int64_t el = bf ? 2 : 4;
    int64_t d = 0;
#define V2(NZ) vals2_sc(o + d, os, v + d * el, vs, n, p, ps, NZ, bf, q, D, k, ks, nk, scale, s, ss), d += 16 * NZ, nk = 0
    if (Dv >= 128) V2(8);
    for (; d + 128 <= Dv;) V2(8);
    if (d + 64 <= Dv) V2(4);
    if (d + 32 <= Dv) V2(2);
    if (!bf && d + 16 <= Dv) V2(1); /* bf16: Dv % 32 == 0 */
#undef V2
}

/* Scores of one query row q against n <= 4 keys (k, k + ks, ..), into s[0..n): each key's
 * accumulator takes the fused multiply-adds of a row of sc1_r4_x (the same chunks, order and
 * operands) and the same horizontal sum (hsum4x is lane-wise: an accumulator's sum does not
 * depend on the other three). So a row alone, a tail row and a row of a group of 4 get the
 * same score bits: a row's result does not depend on how many rows share its call. */
static inline __attribute__((always_inline)) void sc_r1_k4_x(const void *q, const char *k, int64_t ks, int64_t n,
                                                             int64_t D, float scale, float *s, const int bf) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *k1 = k + (n > 1 ? ks : 0), *k2 = k + (n > 2 ? 2 * ks : 0), *k3 = k + (n > 3 ? 3 * ks : 0);
#ifdef HAVE_BF16DP
    if (bf) {
        const uint16_t *qh = (const uint16_t *)q;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(qh + d);
            a0 = _mm512_dpbf16_ps(a0, w, (__m512bh)_mm512_loadu_si512((const uint16_t *)k + d));
            a1 = _mm512_dpbf16_ps(a1, w, (__m512bh)_mm512_loadu_si512((const uint16_t *)k1 + d));
            a2 = _mm512_dpbf16_ps(a2, w, (__m512bh)_mm512_loadu_si512((const uint16_t *)k2 + d));
            a3 = _mm512_dpbf16_ps(a3, w, (__m512bh)_mm512_loadu_si512((const uint16_t *)k3 + d));
        }
    } else
#endif
    {
        const float *qf = (const float *)q;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 w = _mm512_loadu_ps(qf + d);
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps((const float *)k + d), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps((const float *)k1 + d), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps((const float *)k2 + d), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps((const float *)k3 + d), a3);
        }
    }
    if (n == 4) {
        hsum4x(a0, a1, a2, a3, scale, s, 1);
        return;
    }
    float t[4];
    hsum4x(a0, a1, a2, a3, scale, t, 1);
    for (int64_t i = 0; i < n; i++) s[i] = t[i];
}

/* o += p v on Dv dims (v one key's value row): the same elementwise fused multiply-add as
 * axpy1_x and vals2_sc, 16 lanes at a time where Dv allows */
static inline __attribute__((always_inline)) void axpy1_512(float *o, const char *v, int64_t Dv, float p, int bf) {
    if (Dv % 16) {
        axpy1_x(o, v, Dv, p, bf);
        return;
    }
    const __m512 w = _mm512_set1_ps(p);
    for (int64_t d = 0; d < Dv; d += 16) {
        const __m512 x = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + d))), 16))
                            : _mm512_loadu_ps((const float *)v + d);
        _mm512_storeu_ps(o + d, _mm512_fmadd_ps(w, x, _mm512_loadu_ps(o + d)));
    }
}

/* One key for one row: its score (as sc_r1_k4_x's, into *s) and, with dov, its value row
 * weighted by p into o, the K and V rows read side by side */
static inline __attribute__((always_inline)) void dot_axpy1_512(const void *q, const char *k, int64_t D, float sg,
                                                                float *s, float *o, const char *v, int64_t Dv,
                                                                float p, int dov, const int bf) {
    __m512 a = _mm512_setzero_ps();
    const __m512 z = a, w = _mm512_set1_ps(p);
    if (dov && D == Dv) {
#ifdef HAVE_BF16DP
        if (bf) {
            const uint16_t *qh = (const uint16_t *)q, *kh = (const uint16_t *)k, *vh = (const uint16_t *)v;
            for (int64_t d = 0; d < D; d += 32) {
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(kh + d));
                for (int64_t e = d; e < d + 32; e += 16) {
                    const __m512 x = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vh + e))), 16));
                    _mm512_storeu_ps(o + e, _mm512_fmadd_ps(w, x, _mm512_loadu_ps(o + e)));
                }
            }
        } else
#endif
        {
            const float *qf = (const float *)q, *kf = (const float *)k, *vf = (const float *)v;
            for (int64_t d = 0; d < D; d += 16) {
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), _mm512_loadu_ps(kf + d), a);
                _mm512_storeu_ps(o + d, _mm512_fmadd_ps(w, _mm512_loadu_ps(vf + d), _mm512_loadu_ps(o + d)));
            }
        }
    } else {
        sc_r1_k4_x(q, k, 0, 1, D, sg, s, bf);
        if (dov) axpy1_512(o, v, Dv, p, bf);
        return;
    }
    float t[4];
    hsum4x(a, z, z, z, sg, t, 1);
    *s = t[0];
}

/* 4-row groups (R >= 4, every row the same key range in this block): scores of the nk keys at
 * K into sn, values of the nv keys at V with weights sc into acc, all R rows */
static inline __attribute__((always_inline)) void block_r4_512(const job_t *J, int64_t bh, int64_t r4, const char *K,
                                                               int64_t kst, int64_t nk, float *sn, const char *V,
                                                               int64_t vst, int64_t nv, const float *sc, int64_t ss,
                                                               float *acc, const int bf) {
    const int64_t R = J->R, D = J->D, Dv = J->Dv, G = bf ? GRP_BF16 : GRP_F32;
    const float *q = J->q + bh * R * D;
    const void *qg = bf ? (const void *)(J->qb + bh * R * D) : (const void *)q;
    const int64_t qel = bf ? 2 : 4;
    const float sg = bf ? J->scale : 1.0f;
    for (int64_t ik = 0, iv = 0; ik < nk || iv < nv; ik += G, iv += G) {
        const int64_t gk = ik < nk ? (nk - ik < G ? nk - ik : G) : 0, gv = iv < nv ? (nv - iv < G ? nv - iv : G) : 0;
        int64_t r = 0;
        if (!bf) { /* rows 0-3's scores inside rows 0-1's values */
            vals2_x(acc, Dv, V + iv * vst, vst, gv, sc + iv, ss, Dv, bf, qg, D, K + ik * kst, kst, gk, sg, sn + ik, ss);
            r = 4;
        }
        for (; r < r4; r += 4) {
            const void *qr = (const char *)qg + r * D * qel;
            int64_t j = ik;
            for (; j + 2 <= ik + gk; j += 2) sc2_r4_x(qr, D, K + j * kst, kst, D, sg, sn + r * ss + j, ss, bf);
            if (j < ik + gk) sc1_r4_x(qr, D, K + j * kst, D, sg, sn + r * ss + j, ss, bf);
        }
        for (r = r4; r < R; r++) /* tail rows: a group row's score bits, one row at a time */
            for (int64_t j = ik; j < ik + gk; j += 4)
                sc_r1_k4_x((const char *)qg + r * D * qel, K + j * kst, kst, ik + gk - j < 4 ? ik + gk - j : 4, D, sg,
                           sn + r * ss + j, bf);
        for (r = bf ? 0 : 2; r + 2 <= R; r += 2)
            vals2_x(acc + r * Dv, Dv, V + iv * vst, vst, gv, sc + r * ss + iv, ss, Dv, bf, NULL, D, NULL, 0, 0, 0.0f,
                    NULL, 0);
        if (r < R)
            for (int64_t j = iv; j < iv + gv; j++) axpy1_x(acc + r * Dv, V + j * vst, Dv, sc[r * ss + j], bf);
    }
}

/* The rows of one block with different key ranges (windows, per-row ends): each row's values
 * over its own keys in order (the same fused multiply-adds as vals2_x), each group of 4 rows'
 * scores over the group's keys by sc1_r4_x (a row's score the same bits as block_r4_512's,
 * whatever the other rows), each kept where its row sees it; the R % 4 rows after the last group
 * over their own keys by sc_r1_k4_x (the same bits). So a row's result does not depend on the
 * ranges of the rows that share its call, nor on their number. */
static inline __attribute__((always_inline)) void block_ragged_512(const job_t *J, int64_t bh, const char *kb,
                                                                   int64_t kst, const char *vb, int64_t vst,
                                                                   const int64_t *rng, const float *sc, float *sn,
                                                                   int64_t ss, float *acc, const int bf) {
    const int64_t R = J->R, D = J->D, Dv = J->Dv, qel = bf ? 2 : 4;
    const char *qg = bf ? (const char *)(J->qb + bh * R * D) : (const char *)(J->q + bh * R * D);
    const float sg = bf ? J->scale : 1.0f;
    for (int64_t r = 0; r < R; r++) {
        const char *V = vb + rng[4 * r] * vst;
        for (int64_t i = 0; i < rng[4 * r + 1]; i++) axpy1_x(acc + r * Dv, V + i * vst, Dv, sc[r * ss + i], bf);
    }
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        int64_t a = INT64_MAX, e = INT64_MIN;
        for (int64_t x = r; x < r + 4; x++)
            if (rng[4 * x + 3] > 0) {
                a = rng[4 * x + 2] < a ? rng[4 * x + 2] : a;
                e = rng[4 * x + 2] + rng[4 * x + 3] > e ? rng[4 * x + 2] + rng[4 * x + 3] : e;
            }
        float t[4];
        for (int64_t j = a; j < e; j++) {
            sc1_r4_x(qg + r * D * qel, D, kb + j * kst, D, sg, t, 1, bf);
            for (int64_t x = 0; x < 4; x++) {
                const int64_t o = j - rng[4 * (r + x) + 2];
                if (o >= 0 && o < rng[4 * (r + x) + 3]) sn[(r + x) * ss + o] = t[x];
            }
        }
    }
    for (; r < R; r++)
        for (int64_t j = 0; j < rng[4 * r + 3]; j += 4)
            sc_r1_k4_x(qg + r * D * qel, kb + (rng[4 * r + 2] + j) * kst, kst, rng[4 * r + 3] - j < 4 ? rng[4 * r + 3] - j : 4,
                       D, sg, sn + r * ss + j, bf);
}
#endif
#endif
