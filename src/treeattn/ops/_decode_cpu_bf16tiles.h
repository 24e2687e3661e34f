/* AVX2 bfloat16 register tiles of the decode kernel (included by _decode_cpu.c): rows that
 * see the same keys, scored and accumulated over groups of keys in registers (block_tile_bf,
 * row1_eo); routed to on AVX2 builds without AVX-512 (TILE_BF16). */

#ifdef HAVE_AVX2
/* ---- bfloat16: AVX2 register tiles over groups of keys (rows that see the same keys) ----
 * The per-key loops above (_decode_cpu_avx2.h) widen every bf16 element with two instructions and
 * load and store each row's value accumulator once per key, which bounds them near half the read
 * bandwidth on AVX2-only CPUs. Here a group of GRP_X keys is done in two short phases that keep the K
 * and V streams side by side: the scores of the next block's keys (tiles of 4 rows x 3 keys,
 * 4 x 2 or 4 x 1 for the rest, or 1 row x 4 keys: each K and q load serves several FMAs),
 * then the values of this block's keys (tiles of 2 rows x 32 dims, or 1 row x 64 dims, whose
 * accumulators stay in registers over the group; V rows re-read from L1). 16 bf16 are
 * widened at once as their even and odd elements (one shift, one and), so q (qp) and the
 * accumulators are kept in that order (perm16). The first row tile prefetches one line PFK_X
 * keys ahead per step. A single row (MHA) streams faster key by key (row1_eo). float32 runs
 * measured slower this way than in the per-key loops (docs/benchmarks/kernels.md, AVX2 only). */
#ifndef GRP_X
#define GRP_X 8
#endif
#ifndef PFK_X
#define PFK_X 16
#endif

/* 16 bf16 at p as two float32 vectors: ev = elements 0, 2, .., 14; od = 1, 3, .., 15 */
#define LDEO(p, ev, od)                                                                              \
    do {                                                                                             \
        const __m256i x_ = _mm256_loadu_si256((const __m256i *)(p));                                 \
        ev = _mm256_castsi256_ps(_mm256_slli_epi32(x_, 16));                                         \
        od = _mm256_castsi256_ps(_mm256_and_si256(x_, _mm256_set1_epi32((int)0xffff0000u)));        \
    } while (0)

/* n floats x (n % 16 == 0) to (to_perm) or from the even/odd order of LDEO, in place */
static void perm16(float *x, int64_t n, int to_perm) {
    float t[16];
    for (int64_t d = 0; d < n; d += 16) {
        for (int i = 0; i < 8; i++) {
            if (to_perm)
                t[i] = x[d + 2 * i], t[8 + i] = x[d + 2 * i + 1];
            else
                t[2 * i] = x[d + i], t[2 * i + 1] = x[d + 8 + i];
        }
        memcpy(x + d, t, sizeof t);
    }
}

/* s[r * ss + j] = q_r . k_j for NR rows (q in even/odd order, qs floats apart) x NK bf16 keys
 * (ks bytes apart), NR * NK <= 8, D % 16 == 0 */
static inline __attribute__((always_inline)) void sc_tile_bf(const float *q, int64_t qs, const char *k, int64_t ks,
                                                             int64_t D, float *s, int64_t ss, const int NR,
                                                             const int NK, const int pf) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m256 x0[4], x1[4];
        for (int j = 0; j < NK; j++) {
            if (pf && !(d & 31)) _mm_prefetch(k + (j + PFK_X) * ks + 2 * d, _MM_HINT_T0);
            LDEO((const uint16_t *)(k + j * ks) + d, x0[j], x1[j]);
        }
        for (int r = 0; r < NR; r++) {
            const __m256 w0 = _mm256_loadu_ps(q + r * qs + d), w1 = _mm256_loadu_ps(q + r * qs + d + 8);
            for (int j = 0; j < NK; j++) {
                const int i = r * NK + j;
                if (NR * NK <= 4) /* two chains per score: FMA latency, not throughput, bounds one */
                    a[i] = _mm256_fmadd_ps(w0, x0[j], a[i]), a[i + 4] = _mm256_fmadd_ps(w1, x1[j], a[i + 4]);
                else
                    a[i] = _mm256_fmadd_ps(w1, x1[j], _mm256_fmadd_ps(w0, x0[j], a[i]));
            }
        }
    }
    if (NR * NK <= 4)
        for (int i = 0; i < 4; i++) a[i] = _mm256_add_ps(a[i], a[i + 4]);
    /* horizontal sums of a[0..8) into t[0..8) */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    float t[8];
    _mm_storeu_ps(t, _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1)));
    if (NR * NK > 4) {
        const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        _mm_storeu_ps(t + 4, _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1)));
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NK; j++) s[r * ss + j] = t[r * NK + j];
}

/* sc_tile_bf for 4 rows x 3 keys: the even halves of 16 dims, then the odd ones, one FMA
 * chain per score (12 accumulators); 1.12x the 4 x 2 tile in L1 (benchmarks/tile_micro.c) */
static inline __attribute__((always_inline)) void sc_tile_bf_4x3(const float *q, int64_t qs, const char *k, int64_t ks,
                                                                 int64_t D, float *s, int64_t ss, const int pf) {
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t d = 0; d < D; d += 16) {
        __m256i raw[3];
        __m256 x[3];
        for (int j = 0; j < 3; j++) {
            if (pf && !(d & 31)) _mm_prefetch(k + (j + PFK_X) * ks + 2 * d, _MM_HINT_T0);
            raw[j] = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(k + j * ks) + d));
            x[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw[j], 16));
        }
        for (int r = 0; r < 4; r++) {
            const __m256 w = _mm256_loadu_ps(q + r * qs + d);
            for (int j = 0; j < 3; j++) a[3 * r + j] = _mm256_fmadd_ps(w, x[j], a[3 * r + j]);
        }
        for (int j = 0; j < 3; j++) x[j] = _mm256_castsi256_ps(_mm256_and_si256(raw[j], odd));
        for (int r = 0; r < 4; r++) {
            const __m256 w = _mm256_loadu_ps(q + r * qs + d + 8);
            for (int j = 0; j < 3; j++) a[3 * r + j] = _mm256_fmadd_ps(w, x[j], a[3 * r + j]);
        }
    }
    float t[12];
    for (int i = 0; i < 12; i += 4) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[i], a[i + 1]), _mm256_hadd_ps(a[i + 2], a[i + 3]));
        _mm_storeu_ps(t + i, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 3; j++) s[r * ss + j] = t[3 * r + j];
}

/* o_r += sum_i p[r * ps + i] v_i for NR rows (os floats apart, even/odd order) on 8 * NZ dims
 * (NZ even), n bf16 keys (vs bytes apart); the NR x NZ accumulators stay in registers */
static inline __attribute__((always_inline)) void val_tile_bf(float *o, int64_t os, const char *v, int64_t vs,
                                                              int64_t n, const float *p, int64_t ps, const int NR,
                                                              const int NZ, const int pf) {
    __m256 a[2][8];
    for (int r = 0; r < NR; r++)
        for (int z = 0; z < NZ; z++) a[r][z] = _mm256_loadu_ps(o + r * os + 8 * z);
    for (int64_t i = 0; i < n; i++) {
        const char *vi = v + i * vs;
        __m256 w[2];
        for (int r = 0; r < NR; r++) w[r] = _mm256_broadcast_ss(p + r * ps + i);
        for (int z = 0; z < NZ; z += 2) {
            __m256 x0, x1;
            if (pf && !(z & 2)) _mm_prefetch(vi + PFK_X * vs + 16 * z, _MM_HINT_T0);
            LDEO((const uint16_t *)vi + 8 * z, x0, x1);
            for (int r = 0; r < NR; r++)
                a[r][z] = _mm256_fmadd_ps(w[r], x0, a[r][z]), a[r][z + 1] = _mm256_fmadd_ps(w[r], x1, a[r][z + 1]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int z = 0; z < NZ; z++) _mm256_storeu_ps(o + r * os + 8 * z, a[r][z]);
}

/* One bf16 row (MHA; q and o in even/odd order), one key at a time, its K row and V row each
 * read front to back side by side and prefetched PF_EO bytes ahead (as the float32 per-key loop,
 * but widened with LDEO): the score of key i into s[i] (i < nk), the value of key i with weight
 * p[i] into o (i < nv); D == Dv, D % 16 == 0. Measured 1.3-1.4x the 1-row tiles from memory
 * (the tiles' split row accesses overlap less with the arithmetic); prefetch 2-16 KiB ahead
 * alike, none 0.85x. */
#ifndef PF_EO
#define PF_EO 4096
#endif
/* key i of row1_eo: score into *s (dok), value with weight p into o (dov); 32 dims a step with
 * two pairs of score chains (FMA latency), a 16-dim tail */
#define ROW1_HALF(d, a0, a1)                                                                          \
    do {                                                                                              \
        if (dok) {                                                                                    \
            LDEO(k + (d), e, od);                                                                     \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (d)), e, a0);                                    \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + (d) + 8), od, a1);                               \
        }                                                                                             \
        if (dov) {                                                                                    \
            LDEO(v + (d), e, od);                                                                     \
            _mm256_storeu_ps(o + (d), _mm256_fmadd_ps(w, e, _mm256_loadu_ps(o + (d))));               \
            _mm256_storeu_ps(o + (d) + 8, _mm256_fmadd_ps(w, od, _mm256_loadu_ps(o + (d) + 8)));       \
        }                                                                                             \
    } while (0)
static inline __attribute__((always_inline)) void row1_key(const float *q, int64_t D, const uint16_t *k, float *s,
                                                           float *o, const uint16_t *v, float p, const int dok,
                                                           const int dov) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e, od;
    const __m256 w = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 32) {
        if (dok) _mm_prefetch((const char *)(k + d) + PF_EO, _MM_HINT_T0);
        if (dov) _mm_prefetch((const char *)(v + d) + PF_EO, _MM_HINT_T0);
        ROW1_HALF(d, a0, a1);
        if (d + 16 >= D) break;
        ROW1_HALF(d + 16, a2, a3);
    }
    if (dok) *s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#undef ROW1_HALF

static void row1_eo(const float *q, int64_t D, const char *K, int64_t kst, int64_t nk, float *s, float *o,
                    const char *V, int64_t vst, int64_t nv, const float *p) {
    for (int64_t i = 0; i < nk || i < nv; i++) {
        const uint16_t *k = (const uint16_t *)(K + i * kst), *v = (const uint16_t *)(V + i * vst);
        if (i < nk && i < nv)
            row1_key(q, D, k, s + i, o, v, p[i], 1, 1);
        else if (i < nk)
            row1_key(q, D, k, s + i, o, v, 0.0f, 1, 0);
        else
            row1_key(q, D, k, s + i, o, v, p[i], 0, 1);
    }
}

/* bf16, all R rows see the same keys in this block: scores of the nk keys at K into sn (rows
 * ss apart), values of the nv keys at V with weights sc into acc, GRP_X keys at a time.
 * q (qp) and acc in even/odd order; D, Dv % 16 == 0. */
static void block_tile_bf(const float *q, int64_t R, int64_t D, int64_t Dv, const char *K, int64_t kst, int64_t nk,
                          float *sn, const char *V, int64_t vst, int64_t nv, const float *sc, int64_t ss, float *acc) {
    if (R == 1 && D == Dv) {
        row1_eo(q, D, K, kst, nk, sn, acc, V, vst, nv, sc);
        return;
    }
    for (int64_t g0 = 0; g0 < nk || g0 < nv; g0 += GRP_X) {
        const int64_t gk = nk - g0 < GRP_X ? (nk > g0 ? nk - g0 : 0) : GRP_X;
        const int64_t gv = nv - g0 < GRP_X ? (nv > g0 ? nv - g0 : 0) : GRP_X;
        const char *Kg = K + g0 * kst;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) {
            int64_t j = 0;
            for (; j + 3 <= gk; j += 3) sc_tile_bf_4x3(q + r * D, D, Kg + j * kst, kst, D, sn + r * ss + g0 + j, ss, !r);
            for (; j + 2 <= gk; j += 2) sc_tile_bf(q + r * D, D, Kg + j * kst, kst, D, sn + r * ss + g0 + j, ss, 4, 2, !r);
            if (j < gk) sc_tile_bf(q + r * D, D, Kg + j * kst, kst, D, sn + r * ss + g0 + j, ss, 4, 1, !r);
        }
        for (; r < R; r++) {
            int64_t j = 0;
            for (; j + 4 <= gk; j += 4) sc_tile_bf(q + r * D, D, Kg + j * kst, kst, D, sn + r * ss + g0 + j, ss, 1, 4, !r);
            for (; j < gk; j++) sc_tile_bf(q + r * D, D, Kg + j * kst, kst, D, sn + r * ss + g0 + j, ss, 1, 1, !r);
        }
        if (!gv) continue;
        const char *Vg = V + g0 * vst;
        for (r = 0; r + 2 <= R; r += 2) {
            float *o = acc + r * Dv;
            const float *p = sc + r * ss + g0;
            int64_t d = 0;
            for (; d + 32 <= Dv; d += 32) val_tile_bf(o + d, Dv, Vg + 2 * d, vst, gv, p, ss, 2, 4, !r);
            if (d < Dv) val_tile_bf(o + d, Dv, Vg + 2 * d, vst, gv, p, ss, 2, 2, !r);
        }
        if (r < R) {
            float *o = acc + r * Dv;
            const float *p = sc + r * ss + g0;
            int64_t d = 0;
            for (; d + 64 <= Dv; d += 64) val_tile_bf(o + d, Dv, Vg + 2 * d, vst, gv, p, ss, 1, 8, !r);
            for (; d + 32 <= Dv; d += 32) val_tile_bf(o + d, Dv, Vg + 2 * d, vst, gv, p, ss, 1, 4, !r);
            if (d < Dv) val_tile_bf(o + d, Dv, Vg + 2 * d, vst, gv, p, ss, 1, 2, !r);
        }
    }
}
#endif
