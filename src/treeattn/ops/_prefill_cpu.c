/* Causal prefill attention for CPU (float32, AVX-512): a flash-attention kernel for many
 * query rows over one KV head.  Built into the same shared object as _decode_cpu.c.
 *
 * A task is one row block: PF_RB query positions of one sequence and KV head, for all G query
 * heads of the group (M = G * PF_RB rows share every K/V load).  It reads only the keys
 * [min lo, max hi) of its rows, PF_NB keys at a time:
 *   scores  S^T[j][r] = k_j . q_r (queries transposed once per task, so each key is broadcast
 *           and 16 query rows fill a vector: PF_KT keys x 32 rows in 24 registers; row maxima
 *           and sums are then plain vector ops over j),
 *   softmax online, in base 2 (q pre-scaled by scale * log2 e; exp2 by a degree-7 polynomial
 *           and scalef), keys outside a row's [lo, hi) at -inf (only in blocks that need it),
 *   values  o_r = o_r * alpha_r + sum_j p[j][r] v_j (6 rows x 64 value dims in registers; the
 *           block sum is formed first, then added: two-level summation as in a GEMM).
 * Tasks go to threads (OpenMP, else pthreads) in the caller's order (longest first) through an
 * atomic counter.
 * Keys and values a task reads must be finite (the caller checks): a masked score's p = 0
 * would turn a NaN value into NaN. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#define AI __attribute__((always_inline)) inline
#define PF_RB 32 /* query positions per row block (one 2-vector column tile per group member) */
#define PF_KT 12 /* keys per score tile */
#ifndef PF_NB
#define PF_NB 96
#endif

typedef struct {
    const float *q, *k, *v;
    int64_t B, H, G, T, S, D, Dv;
    int64_t ksb, ksh, kss, vsb, vsh, vss;
    const int64_t *lo, *hi;
    float scale2;
    float *out, *lse;
    int64_t nrb, ntasks;
    int64_t *order;
    int64_t next;
    int err;
    int prefetch; /* few row blocks per KV head: its keys and values are likely still in DRAM */
} pjob_t;

/* 2^x for x <= 0 (NaN stays NaN); 0 below 2^-126 (no denormal results: they take microcode
 * assists, which made a block with one masked row 2-3x slower) */
static AI __m512 exp2v(__m512 x) {
    __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ); /* NaN kept */
    x = _mm512_max_ps(_mm512_set1_ps(-126.f), x);                                     /* NaN kept */
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* st[j][0:32] = sum_d k[j][d] * qt[d][0:32] for nk keys */
static AI void score_tile(float *st, int64_t ldst, const float *qt, int64_t ldq, const float *k, int64_t kss,
                          int64_t D, const int nk) {
    __m512 a0[PF_KT], a1[PF_KT];
#pragma GCC unroll 12
    for (int j = 0; j < nk; j++) a0[j] = a1[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 q0 = _mm512_loadu_ps(qt + d * ldq), q1 = _mm512_loadu_ps(qt + d * ldq + 16);
#pragma GCC unroll 12
        for (int j = 0; j < nk; j++) {
            __m512 kb = _mm512_set1_ps(k[j * kss + d]);
            a0[j] = _mm512_fmadd_ps(kb, q0, a0[j]);
            a1[j] = _mm512_fmadd_ps(kb, q1, a1[j]);
        }
    }
#pragma GCC unroll 12
    for (int j = 0; j < nk; j++) {
        _mm512_storeu_ps(st + j * ldst, a0[j]);
        _mm512_storeu_ps(st + j * ldst + 16, a1[j]);
    }
}

static void score_any(float *st, int64_t ldst, const float *qt, int64_t ldq, const float *k, int64_t kss, int64_t D,
                      int nk) {
    switch (nk) {
#define C(n) case n: score_tile(st, ldst, qt, ldq, k, kss, D, n); break;
        C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8) C(9) C(10) C(11) C(12)
#undef C
    }
}

/* o[i][0:64] = o[i][0:64] * al[i] + sum_j st[j][i] * v[j][0:64], nr rows */
static AI void pv_tile(float *o, int64_t ldo, const float *al, const float *st, int64_t ldst, const float *v,
                       int64_t vss, int64_t nb, const int nr) {
    __m512 c[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 4; u++) c[i][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const float *vj = v + j * vss;
        __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
               v3 = _mm512_loadu_ps(vj + 48);
#pragma GCC unroll 6
        for (int i = 0; i < nr; i++) {
            __m512 p = _mm512_set1_ps(st[j * ldst + i]);
            c[i][0] = _mm512_fmadd_ps(p, v0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(p, v1, c[i][1]);
            c[i][2] = _mm512_fmadd_ps(p, v2, c[i][2]);
            c[i][3] = _mm512_fmadd_ps(p, v3, c[i][3]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < nr; i++) {
        __m512 a = _mm512_set1_ps(al[i]);
        for (int u = 0; u < 4; u++)
            _mm512_storeu_ps(o + i * ldo + 16 * u, _mm512_fmadd_ps(_mm512_loadu_ps(o + i * ldo + 16 * u), a, c[i][u]));
    }
}

static void pv_any(float *o, int64_t ldo, const float *al, const float *st, int64_t ldst, const float *v, int64_t vss,
                   int64_t nb, int nr) {
    switch (nr) {
#define C(n) case n: pv_tile(o, ldo, al, st, ldst, v, vss, nb, n); break;
        C(1) C(2) C(3) C(4) C(5) C(6)
#undef C
    }
}

/* the first `width` floats of n rows `ss` apart towards L1: the next key block's keys and values,
 * requested while this block computes. A decode-shaped call (a batched step's rows over a
 * shared prefix: one or a few row blocks per KV head) reads every key from DRAM once, which
 * otherwise came on top of the arithmetic: 24 rows over 3,861 keys, 30 layers, 27 -> 21 ms */
static AI void prefetch_rows(const float *x, int64_t ss, int64_t n, int64_t width) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < width; c += 16) _mm_prefetch((const char *)(x + j * ss + c), _MM_HINT_T0);
}

typedef struct {
    float *qt, *st, *o, *m, *l, *al;
    int32_t *lo, *hi;
} scratch_t;

static void run_task(pjob_t *J, scratch_t *W, int64_t t) {
    const int64_t G = J->G, T = J->T, D = J->D, Dv = J->Dv, M = G * PF_RB;
    int64_t b = t / (J->H * J->nrb), h = (t / J->nrb) % J->H, i0 = (t % J->nrb) * PF_RB;
    int64_t n = T - i0 < PF_RB ? T - i0 : PF_RB;
    const float *k = J->k + b * J->ksb + h * J->ksh, *v = J->v + b * J->vsb + h * J->vsh;
    int64_t kmin = J->S, kmax = 0;
    for (int64_t r = 0; r < M; r++) {
        int64_t i = r % PF_RB, lo = 0, hi = 0;
        if (i < n) {
            lo = J->lo ? J->lo[b * T + i0 + i] : 0;
            hi = J->hi ? J->hi[b * T + i0 + i] : J->S;
            lo = lo < 0 ? 0 : lo > J->S ? J->S : lo; /* clipped to [0, S] before the int32 store */
            hi = hi < 0 ? 0 : hi > J->S ? J->S : hi;
            if (hi > lo) {
                if (lo < kmin) kmin = lo;
                if (hi > kmax) kmax = hi;
            }
        }
        W->lo[r] = (int32_t)lo, W->hi[r] = (int32_t)hi;
        W->m[r] = -INFINITY, W->l[r] = 0.f;
    }
    /* key blocks at multiples of PF_NB: a row's result does not depend on its block mates' bounds
       (a block that a row does not see leaves its state exactly as it was) */
    kmin -= kmin % PF_NB;
    if (J->prefetch && kmax > kmin) {
        int64_t n0 = kmax - kmin < PF_NB ? kmax - kmin : PF_NB;
        prefetch_rows(k + kmin * J->kss, J->kss, n0, D);
        prefetch_rows(v + kmin * J->vss, J->vss, n0, J->Dv);
    }
    const float *qb = J->q + (b * J->H + h) * G * T * D;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < PF_RB; i++)
            for (int64_t d = 0; d < D; d++)
                W->qt[d * M + g * PF_RB + i] = i < n ? qb[(g * T + i0 + i) * D + d] * J->scale2 : 0.f;
    memset(W->o, 0, sizeof(float) * M * Dv);
    int32_t lomax = 0, himin = INT32_MAX;
    for (int64_t r = 0; r < M; r++) {
        if (W->lo[r] > lomax) lomax = W->lo[r];
        if (W->hi[r] < himin) himin = W->hi[r];
    }
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = kmin; j0 < kmax; j0 += PF_NB) {
        int64_t nb = kmax - j0 < PF_NB ? kmax - j0 : PF_NB;
        for (int64_t jt = 0; jt < nb; jt += PF_KT) {
            int nk = nb - jt < PF_KT ? (int)(nb - jt) : PF_KT;
            int64_t nx = j0 + PF_NB + jt, nn = kmax - nx < PF_KT ? kmax - nx : PF_KT;
            if (J->prefetch && nn > 0) {
                prefetch_rows(k + nx * J->kss, J->kss, nn, D);
                prefetch_rows(v + nx * J->vss, J->vss, nn, J->Dv);
            }
            for (int64_t rt = 0; rt < M; rt += 32)
                score_any(W->st + jt * M + rt, M, W->qt + rt, M, k + (j0 + jt) * J->kss, J->kss, D, nk);
        }
        int mask = j0 < lomax || j0 + nb > himin;
        for (int64_t c = 0; c < M; c += 16) {
            __m512 mx = _mm512_loadu_ps(W->m + c);
            __m512i lo = _mm512_loadu_si512(W->lo + c), hi = _mm512_loadu_si512(W->hi + c);
            for (int64_t j = 0; j < nb; j++) {
                __m512 s = _mm512_loadu_ps(W->st + j * M + c);
                if (mask) {
                    __m512i jj = _mm512_set1_epi32((int32_t)(j0 + j));
                    __mmask16 vis = _mm512_cmple_epi32_mask(lo, jj) & _mm512_cmpgt_epi32_mask(hi, jj);
                    s = _mm512_mask_mov_ps(ninf, vis, s);
                    _mm512_storeu_ps(W->st + j * M + c, s);
                }
                mx = _mm512_max_ps(mx, s);
            }
            __mmask16 none = _mm512_cmpeq_ps_mask(mx, ninf);
            __m512 ms = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
            __m512 al = exp2v(_mm512_sub_ps(_mm512_loadu_ps(W->m + c), ms));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nb; j++) {
                __m512 p = exp2v(_mm512_sub_ps(_mm512_loadu_ps(W->st + j * M + c), ms));
                _mm512_storeu_ps(W->st + j * M + c, p);
                sum = _mm512_add_ps(sum, p);
            }
            _mm512_storeu_ps(W->l + c, _mm512_fmadd_ps(_mm512_loadu_ps(W->l + c), al, sum));
            _mm512_storeu_ps(W->m + c, mx);
            _mm512_storeu_ps(W->al + c, al);
        }
        for (int64_t dc = 0; dc < Dv; dc += 64)
            for (int64_t r = 0; r < M; r += 6) {
                int nr = M - r < 6 ? (int)(M - r) : 6;
                pv_any(W->o + r * Dv + dc, Dv, W->al + r, W->st + r, M, v + j0 * J->vss + dc, J->vss, nb, nr);
            }
    }
    float *ob = J->out + (b * J->H + h) * G * T * Dv;
    float *lb = J->lse + (b * J->H + h) * G * T;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < n; i++) {
            int64_t r = g * PF_RB + i;
            float l = W->l[r];
            float *dst = ob + (g * T + i0 + i) * Dv;
            if (l > 0.f) {
                float inv = 1.f / l;
                for (int64_t d = 0; d < Dv; d++) dst[d] = W->o[r * Dv + d] * inv;
                lb[g * T + i0 + i] = (float)(((double)W->m[r] + log2((double)l)) * 0.6931471805599453);
            } else { /* no visible key: 0 and -inf; a NaN or +inf score made l NaN: NaN */
                float x = l == 0.f ? 0.f : NAN;
                for (int64_t d = 0; d < Dv; d++) dst[d] = x;
                lb[g * T + i0 + i] = l == 0.f ? -INFINITY : NAN;
            }
        }
}

static void *worker(void *arg) {
    pjob_t *J = arg;
    int64_t M = J->G * PF_RB;
    scratch_t W;
    size_t fl = (size_t)(J->D * M + PF_NB * M + M * J->Dv + 3 * M) * sizeof(float) + 2 * M * sizeof(int32_t);
    char *buf = malloc(fl);
    if (!buf) {
        __atomic_store_n(&J->err, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    float *p = (float *)buf;
    W.qt = p, p += J->D * M;
    W.st = p, p += PF_NB * M;
    W.o = p, p += M * J->Dv;
    W.m = p, p += M;
    W.l = p, p += M;
    W.al = p, p += M;
    W.lo = (int32_t *)p;
    W.hi = W.lo + M;
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* flush denormals to zero (FTZ, DAZ) in this thread, restored below */
    for (;;) {
        int64_t i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (i >= J->ntasks) break;
        run_task(J, &W, J->order ? J->order[i] : i);
    }
    _mm_setcsr(csr);
    free(buf);
    return NULL;
}

/* q: [B, H, G*T, D] float32 contiguous (row g*T + i: query i of group member g); k/v: last dim
 * contiguous, element strides over B, H, S; lo/hi: [B, T] key bounds of query i (NULL: 0 and S;
 * clipped to [0, S]); order: the B*H*ceil(T/PF_RB) tasks (b, h, block) to run, or NULL;
 * out: [B, H, G*T, Dv], lse: [B, H, G*T] (natural log; -inf and out 0 for a row with no key).
 * Returns 0, 1 (allocation failed), 2 (bad arguments) or 3 (built without AVX-512). */
int treeattn_prefill(const float *q, const float *k, const float *v, float scale, int64_t B, int64_t H, int64_t G,
                     int64_t T, int64_t S, int64_t D, int64_t Dv, int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb,
                     int64_t vsh, int64_t vss, const int64_t *lo, const int64_t *hi, const int64_t *order,
                     int nthreads, float *out, float *lse) {
    if (Dv % 64 || D <= 0 || G <= 0 || B < 0 || H < 0 || T < 0 || S < 0 || S > INT32_MAX) return 2;
    pjob_t J = {q, k, v, B, H, G, T, S, D, Dv, ksb, ksh, kss, vsb, vsh, vss, lo, hi,
                scale * 1.4426950408889634f, out, lse, (T + PF_RB - 1) / PF_RB, 0, (int64_t *)order, 0, 0};
    J.ntasks = B * H * J.nrb;
    J.prefetch = J.nrb <= 4; /* measured: 2-3 % slower on a 1024-row causal prefill block, whose
                                row blocks find a head's keys in cache after its first */
    if (nthreads > J.ntasks) nthreads = (int)J.ntasks;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    /* torch's own OpenMP pool when the loader resolved libgomp.so.1 to the copy torch loaded:
     * its workers, still spinning after torch's last parallel region, take tasks at once
     * instead of competing with threads of ours for the cores (1.5-2 ms per call here) */
#pragma omp parallel num_threads(nthreads)
    worker(&J);
#else
    pthread_t th[64];
    int started = 0;
    for (int i = 1; i < nthreads && i < 64; i++)
        if (pthread_create(&th[started], NULL, worker, &J) == 0) started++;
    worker(&J);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
#endif
    return J.err;
}

int treeattn_prefill_available(void) { return 1; }
#else
int treeattn_prefill(const float *q, const float *k, const float *v, float scale, int64_t B, int64_t H, int64_t G,
                     int64_t T, int64_t S, int64_t D, int64_t Dv, int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb,
                     int64_t vsh, int64_t vss, const int64_t *lo, const int64_t *hi, const int64_t *order,
                     int nthreads, float *out, float *lse) {
    return 3;
}
int treeattn_prefill_available(void) { return 0; }
#endif
