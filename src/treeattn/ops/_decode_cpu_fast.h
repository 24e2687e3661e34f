/* The software-pipelined fast task of the decode kernel (included by _decode_cpu.c, after
 * the AVX2, bf16-tile and AVX-512 kernels it routes between): float32/bfloat16 with D and Dv
 * multiples of 8, the scores of block b+1 computed in the loop that accumulates the values of
 * block b. Defines TILE_BF16. */

#ifdef HAVE_AVX2
/* bfloat16 tiles (block_tile_bf, row1_eo) where they were measured: AVX2-only CPUs (1.2-1.6x
 * the per-key loops on a Zen 1 EPYC); AVX-512 builds keep their own measured routing */
#ifdef HAVE_AVX512
#define TILE_BF16 0
#else
#define TILE_BF16 1
#endif

/* softmax of row r's block scores s[0..n) into weights, updating its running max/denominator
 * and rescaling its accumulator */
static inline void softmax_block(float *s, int64_t n, float cap, float *mx, double *den, float *o, int64_t Dv) {
    if (cap > 0)
        for (int64_t i = 0; i < n; i++) s[i] = softcap_f(s[i], cap);
    __m256 vb = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vb = _mm256_max_ps(vb, _mm256_loadu_ps(s + i));
    __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(vb), _mm256_extractf128_ps(vb, 1));
    b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
    float bm = _mm_cvtss_f32(_mm_max_ss(b4, _mm_movehdup_ps(b4)));
    for (; i < n; i++) bm = s[i] > bm ? s[i] : bm;
    if (bm > *mx) {
        if (*mx > -INFINITY) {
            float c = exp_neg(*mx - bm);
            *den *= c;
            for (int64_t d = 0; d < Dv; d++) o[d] *= c;
        }
        *mx = bm;
    }
    const __m256 vm = _mm256_set1_ps(*mx);
    __m256 vs = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 x = exp8_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, x);
        vs = _mm256_add_ps(vs, x);
    }
    float sum = hsum8(vs);
    for (; i < n; i++) {
        s[i] = exp_neg(s[i] - *mx);
        sum += s[i];
    }
    *den += sum;
}

/* float32/bfloat16, D and Dv multiples of 8: software-pipelined over blocks, the scores of
 * block b+1 computed in the same loop that accumulates the values of block b. */
static inline __attribute__((always_inline)) void run_task_fast_x(const job_t *J, int64_t t, float *sbuf, int64_t *rng,
                                                                  float *qp, int bf) {
    const int64_t R = J->R, D = J->D, Dv = J->Dv, S = J->S, BS = J->block;
    const int64_t bh = t / J->nsplit, sp = t % J->nsplit, b = bh / J->H, h = bh % J->H;
    const float *q = J->q + bh * R * D;
    float *acc = J->po + t * R * Dv, *mx = J->pm + t * R;
    double *den = J->pl + t * R;
    const int64_t el = bf ? 2 : 4, kst = J->kss * el, vst = J->vss * el;
    const char *kb = (const char *)J->k + (b * J->ksb + h * J->ksh) * el;
    const char *vb = (const char *)J->v + (b * J->vsb + h * J->vsh) * el;
    const int64_t *lo = J->lo ? J->lo + b * R : NULL, *hi = J->hi ? J->hi + b * R : NULL;
    const int64_t s0 = sp * J->chunk, s1 = s0 + J->chunk < S ? s0 + J->chunk : S;
    int64_t ulo, uhi;
    task_start(R, S, Dv, lo, hi, s0, s1, mx, den, acc, &ulo, &uhi);
    if (ulo >= uhi) return;
    /* blocks at multiples of BS from the split's start, not from the rows' first key: a row's
     * blocks (and so its online softmax) do not depend on the other rows' ranges */
    const int64_t base = ulo - (ulo - s0) % BS, nb = (uhi - base + BS - 1) / BS;
    const float cap = J->softcap;
#ifdef HAVE_AVX512
    /* inv: every row's scores by the 4-row groups' arithmetic, in any call (a row's bits do not
     * depend on the number or ranges of the rows beside it); qinv: the rows as the scores take them */
#ifdef HAVE_BF16DP
    const int inv = bf ? J->qb && D % 32 == 0 : D % 16 == 0;
#else
    const int inv = !bf && D % 16 == 0;
#endif
    const char *qinv = bf ? (const char *)(J->qb ? J->qb + bh * R * D : NULL) : (const char *)q;
    const float sg = bf ? J->scale : 1.0f; /* the scores' scale: float32 q is scaled already */
#endif
    /* block_tile_bf keeps q (in qp) and acc in even/odd order; perm: acc currently in it */
    const int tile = TILE_BF16 && bf && D % 16 == 0 && Dv % 16 == 0;
    int perm = 0;
    if (tile) {
        memcpy(qp, q, sizeof(float) * R * D);
        perm16(qp, R * D, 1);
    }
    for (int64_t blk = -1; blk < nb; blk++) {
        /* block blk: weights + values; block blk+1: scores. Rows inside the loop over groups
         * of 4 keys: the first row streams each K/V byte from memory, the others hit L1. */
        const int64_t c0 = base + blk * BS, c1 = c0 + BS < uhi ? c0 + BS : uhi;
        const int64_t n0 = c1, n1 = n0 + BS < uhi ? n0 + BS : uhi; /* next block [n0, n1) */
        int64_t gmax = 0;
        for (int64_t r = 0; r < R; r++) {
            const int64_t a = lo ? lo[r] : 0, e = hi ? hi[r] : S;
            int64_t ca = 0, ce = 0, na = 0, ne = 0;
            if (blk >= 0) {
                ca = a > c0 ? a : c0;
                ce = e < c1 ? e : c1;
                if (ca < ce)
                    softmax_block(sbuf + (r * 2 + (blk & 1)) * BS, ce - ca, cap, mx + r, den + r, acc + r * Dv, Dv);
                else
                    ce = ca;
            }
            if (blk + 1 < nb) {
                na = a > n0 ? a : n0;
                ne = e < n1 ? e : n1;
                if (ne < na) ne = na;
            }
            rng[4 * r] = ca, rng[4 * r + 1] = ce - ca, rng[4 * r + 2] = na, rng[4 * r + 3] = ne - na;
            gmax = ce - ca > gmax ? ce - ca : gmax;
            gmax = ne - na > gmax ? ne - na : gmax;
        }
        /* rows with identical ranges in this block share every K/V load */
        int uni = 1;
        for (int64_t r = 1; r < R && uni; r++)
            uni = rng[4 * r] == rng[0] && rng[4 * r + 1] == rng[1] && rng[4 * r + 2] == rng[2] &&
                  rng[4 * r + 3] == rng[3];
        const int64_t r4 = uni && D == Dv && R >= 4 ? R / 4 * 4 : 0;
        const int64_t ss = 2 * BS;
        float *sc = sbuf + (blk & 1) * BS, *sn = sbuf + ((blk + 1) & 1) * BS; /* this block's, the next's */
#ifdef HAVE_AVX512
        if (r4 && inv) {
            if (perm) perm16(acc, R * Dv, 0), perm = 0;
            block_r4_512(J, bh, r4, kb + rng[2] * kst, kst, rng[3], sn, vb + rng[0] * vst, vst, rng[1], sc, ss, acc, bf);
            continue;
        }
        if (!uni && R >= 4 && D == Dv && inv) {
            if (perm) perm16(acc, R * Dv, 0), perm = 0;
            block_ragged_512(J, bh, kb, kst, vb, vst, rng, sc, sn, ss, acc, bf);
            continue;
        }
        if (inv && uni && R > 1 && R < 4) { /* 2-3 rows: their scores of a key share one horizontal sum */
            if (perm) perm16(acc, R * Dv, 0), perm = 0;
            const int64_t nv = rng[1], nk = rng[3];
            const char *K = kb + rng[2] * kst, *V = vb + rng[0] * vst;
            for (int64_t i = 0; i < nk || i < nv; i++) {
                if (i < nk) sc_rn_k1_x(qinv, D, R, K + i * kst, D, sg, sn + i, ss, bf);
                if (i < nv)
                    for (int64_t r = 0; r < R; r++) axpy1_512(acc + r * Dv, V + i * vst, Dv, sc[r * ss + i], bf);
            }
            continue;
        }
        if (inv) { /* 1-3 rows, or D != Dv: row by row (each its own range), a group row's score bits */
            if (perm) perm16(acc, R * Dv, 0), perm = 0;
            for (int64_t i = 0; i < gmax; i++)
                for (int64_t r = 0; r < R; r++) {
                    const int64_t nv = rng[4 * r + 1], nk = rng[4 * r + 3];
                    float *sc = sbuf + (r * 2 + (blk & 1)) * BS, *sn = sbuf + (r * 2 + ((blk + 1) & 1)) * BS;
                    const char *K = kb + (rng[4 * r + 2] + i) * kst, *V = vb + (rng[4 * r] + i) * vst;
                    const char *qr = qinv + r * D * (bf ? 2 : 4);
                    if (i < nk)
                        dot_axpy1_512(qr, K, D, sg, sn + i, acc + r * Dv, V, Dv, i < nv ? sc[i] : 0.0f, i < nv, bf);
                    else if (i < nv)
                        axpy1_512(acc + r * Dv, V, Dv, sc[i], bf);
                }
            continue;
        }
#endif
        if (uni && tile) {
            if (!perm) perm16(acc, R * Dv, 1), perm = 1;
            block_tile_bf(qp, R, D, Dv, kb + rng[2] * kst, kst, rng[3], sn, vb + rng[0] * vst, vst, rng[1], sc, ss, acc);
            continue;
        }
        if (perm) perm16(acc, R * Dv, 0), perm = 0;
        if (r4) {
            const int64_t nv = rng[1], nk = rng[3];
            const char *K = kb + rng[2] * kst, *V = vb + rng[0] * vst;
            int64_t i = 0;
            if (r4 == R && bf) /* float32: two interleaved rows stream slower than one */
                for (; i + 2 <= nk && i + 2 <= nv; i += 2)
                    for (int64_t r = 0; r < r4; r += 4)
                        dot_axpy2_r4_x(q + r * D, D, K + i * kst, kst, D, sn + r * ss + i, ss, acc + r * Dv, Dv,
                                       V + i * vst, vst, sc + r * ss + i, ss, bf);
            for (; i < nk || i < nv; i++) {
                for (int64_t r = 0; r < r4; r += 4) {
                    if (i < nk)
                        dot_axpy1_r4_x(q + r * D, D, K + i * kst, D, sn + r * ss + i, ss, acc + r * Dv, Dv,
                                       V + i * vst, sc + r * ss + i, ss, i < nv, bf);
                    else
                        for (int64_t rr = r; rr < r + 4; rr++) axpy1_x(acc + rr * Dv, V + i * vst, Dv, sc[rr * ss + i], bf);
                }
                for (int64_t r = r4; r < R; r++) {
                    if (i < nk && i < nv)
                        dot_axpy1_x(q + r * D, K + i * kst, D, sn + r * ss + i, acc + r * Dv, V + i * vst, Dv,
                                    sc[r * ss + i], bf);
                    else if (i < nk)
                        dot1_x(q + r * D, K + i * kst, D, sn + r * ss + i, bf);
                    else
                        axpy1_x(acc + r * Dv, V + i * vst, Dv, sc[r * ss + i], bf);
                }
            }
            continue;
        }
        for (int64_t i = 0; i < gmax; i++)
            for (int64_t r = 0; r < R; r++) {
                const int64_t nv = rng[4 * r + 1], nk = rng[4 * r + 3];
                float *sc = sbuf + (r * 2 + (blk & 1)) * BS, *sn = sbuf + (r * 2 + ((blk + 1) & 1)) * BS;
                const char *K = kb + (rng[4 * r + 2] + i) * kst, *V = vb + (rng[4 * r] + i) * vst;
                if (i < nk && i < nv)
                    dot_axpy1_x(q + r * D, K, D, sn + i, acc + r * Dv, V, Dv, sc[i], bf);
                else if (i < nk)
                    dot1_x(q + r * D, K, D, sn + i, bf);
                else if (i < nv)
                    axpy1_x(acc + r * Dv, V, Dv, sc[i], bf);
            }
    }
    if (perm) perm16(acc, R * Dv, 0);
}

static void run_task_fast_f32(const job_t *J, int64_t t, float *sbuf, int64_t *rng, float *qp) {
    run_task_fast_x(J, t, sbuf, rng, qp, 0);
}
static void run_task_fast_bf16(const job_t *J, int64_t t, float *sbuf, int64_t *rng, float *qp) {
    run_task_fast_x(J, t, sbuf, rng, qp, 1);
}
#endif

#ifndef TILE_BF16
#define TILE_BF16 0 /* no AVX2 */
#endif
