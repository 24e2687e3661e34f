/* Streaming decode attention for CPU: one pass over each KV head's K/V serves all
 * R = G*Tq query rows of that head (GQA).  Online softmax over blocks of keys, float32
 * accumulation.  Each row r only touches keys in [lo[r], hi[r]); keys outside every row's
 * range are never read.  S is cut in splits of a fixed size; (sequence, head, split) tasks go to
 * pthreads and each row's partial states are merged in order here.
 *
 * Fast path (AVX2+FMA, float32/bfloat16, D and Dv multiples of 8), software-pipelined: the
 * loop that accumulates block b's values also computes block b+1's scores, one key at a
 * time with each K and V row read sequentially, so two sequential streams (K and V) are in
 * flight together; measured here, interleaving 4 rows at once or one phase at a time
 * reached only about half the read bandwidth.  bf16 is widened in registers (a 16-bit
 * shift); runs of 4 rows with the same key range share each K/V load.  With AVX-512 such
 * runs (GQA) take block_r4_512: the value accumulators of two rows stay in registers over a
 * group of keys (one load/store per group, not per key, which bounded the AVX2 loop): float32
 * always, bfloat16 only with bf16 queries on CPUs with AVX512-BF16 (vdpbf16ps scores; other
 * bf16 cases take the AVX2 loop).  Where those groups run, every other row's scores (tail rows,
 * calls of 1-3 rows, rows of their own ranges) take the same arithmetic one row at a time
 * (sc_r1_k4_x, sc_rn_k1_x, dot_axpy1_512), and values are elementwise fused multiply-adds in key
 * order everywhere: a row's bits do not depend on the rows that share its call.  AVX2 builds
 * without AVX-512 run bf16 rows that see the same keys as register tiles over groups of keys
 * instead (block_tile_bf; D, Dv % 16 == 0).  Generic path (fp16, other head dims, no AVX2):
 * blocks converted to float32 in L1, then plain loops.
 * Built on first use by _decode_cpu.py (gcc -O3 -march=native -fopenmp-simd).
 *
 * One translation unit: this file (the job, the threads and the entry points) includes, in
 * this order, _decode_cpu_avx2.h (AVX2 kernels), _decode_cpu_scalar.h (scalar helpers),
 * _decode_cpu_generic.h (the generic path), _decode_cpu_bf16tiles.h (AVX2 bf16 register
 * tiles), _decode_cpu_avx512.h (AVX-512 kernels) and _decode_cpu_fast.h (the pipelined fast
 * task), so the compiler inlines across them as in one file. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define PF_AHEAD 64 /* keys ahead to prefetch (converting loads) */
#ifndef PF_BYTES
#define PF_BYTES 16384 /* bytes ahead to prefetch in the fp32 loops */
#endif

typedef struct {
    const float *q; /* [B, H, R, D] float32, already multiplied by the scale */
    const uint16_t *qb; /* the same rows in bfloat16, unscaled (bf16 q only; else NULL) */
    float scale;
    const void *k, *v;
    int dtype;
    int64_t B, H, R, S, D, Dv;
    int64_t ksb, ksh, kss, vsb, vsh, vss; /* element strides of k/v over B, H, S */
    const int64_t *lo, *hi;               /* [B, R] or NULL */
    float softcap;                        /* <= 0: none */
    int64_t nsplit, chunk, block;
    float *po, *pm; /* partial out [T, R, Dv] (unnormalised), running max [T, R] */
    double *pl;     /* partial denominators [T, R] */
    int64_t ntasks;
    int nthreads;
} job_t;

#include "_decode_cpu_avx2.h"
#include "_decode_cpu_scalar.h"
#include "_decode_cpu_generic.h"
#include "_decode_cpu_bf16tiles.h"
#include "_decode_cpu_avx512.h"
#include "_decode_cpu_fast.h"

typedef struct {
    const job_t *J;
    int tid;
    int err;
} worker_t;

static void *worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    const job_t *J = w->J;
    const int64_t BS = J->block;
    /* scores: 2 blocks per row (+1 spare) */
    float *kbuf = NULL, *vbuf = NULL, *sbuf = (float *)malloc(sizeof(float) * (BS * 2 * (J->R + 1) + 16));
    int64_t *ivs = (int64_t *)malloc(sizeof(int64_t) * 4 * (J->R + 1));
    /* bf16 tiles: q in even/odd order */
    float *qp = TILE_BF16 && J->dtype == DT_BF16 ? (float *)malloc(sizeof(float) * J->R * J->D) : NULL;
    if (J->dtype != DT_F32) {
        kbuf = (float *)malloc(sizeof(float) * BS * J->D);
        vbuf = (float *)malloc(sizeof(float) * BS * J->Dv);
    }
    if (!sbuf || !ivs || (TILE_BF16 && J->dtype == DT_BF16 && !qp) || (J->dtype != DT_F32 && (!kbuf || !vbuf))) {
        w->err = 1;
    } else {
        /* contiguous ranges of tasks per thread: neighbouring S splits stay on one core */
        int64_t per = (J->ntasks + J->nthreads - 1) / J->nthreads;
        int64_t t0 = w->tid * per, t1 = t0 + per < J->ntasks ? t0 + per : J->ntasks;
#ifdef HAVE_AVX2
        const int fast = J->D % 8 == 0 && J->Dv % 8 == 0 && J->dtype != DT_F16;
        if (fast && J->dtype == DT_F32)
            for (int64_t t = t0; t < t1; t++) run_task_fast_f32(J, t, sbuf, ivs, qp);
        else if (fast)
            for (int64_t t = t0; t < t1; t++) run_task_fast_bf16(J, t, sbuf, ivs, qp);
        else
#endif
            for (int64_t t = t0; t < t1; t++) run_task(J, t, kbuf, vbuf, sbuf, ivs);
    }
    free(kbuf);
    free(vbuf);
    free(sbuf);
    free(ivs);
    free(qp);
    return NULL;
}

/* Which fast paths this build has: bit 0 AVX2+FMA, bit 1 AVX512-BF16 (bf16 dot products),
 * bit 2 AVX-512 (block_r4_512), bit 3 bf16 register tiles (block_tile_bf, AVX2-only builds). */
int treeattn_features(void) {
    int f = 0;
#ifdef HAVE_AVX2
    f |= 1 | (TILE_BF16 ? 8 : 0);
#endif
#ifdef HAVE_AVX512
    f |= 4;
#endif
#ifdef HAVE_BF16DP
    f |= 2;
#endif
    return f;
}

/* q: [B, H, R, D] float32 rows times the scale; qb: the same rows as bf16 without the scale
 * (bf16 queries with bf16 K/V; NULL otherwise), scale: applied to the scores computed from qb.
 * Returns 0 on success, 1 on allocation failure, 2 on bad arguments. */
int treeattn_decode(const float *q, const uint16_t *qb, float scale, const void *k, const void *v, int dtype,
                    int64_t B, int64_t H, int64_t R, int64_t S, int64_t D, int64_t Dv, int64_t ksb, int64_t ksh,
                    int64_t kss, int64_t vsb, int64_t vsh, int64_t vss, const int64_t *lo, const int64_t *hi,
                    float softcap, int nthreads, int64_t block, int64_t split, float *out, float *lse) {
    if (dtype < 0 || dtype > 2 || B < 0 || H < 0 || R < 0 || S < 0 || D <= 0 || Dv <= 0 || block <= 0)
        return 2;
    if (nthreads < 1) nthreads = 1;
    if (split < block) split = block;
    const int64_t BH = B * H;
    if (BH * R == 0) return 0;
    /* S in splits of a fixed size (a multiple of the block) whatever B, H, R, S and the threads:
     * a row's blocks, splits and merge order, hence its bits, depend on its own key range alone
     * (not on the other sequences of the call, the padded S or the thread count) */
    int64_t chunk = (split + block - 1) / block * block;
    int64_t nsplit = S ? (S + chunk - 1) / chunk : 1;
    if (nsplit == 1) chunk = S ? S : 1;
    job_t J = {q, qb, scale, k, v, dtype, B, H, R, S, D, Dv, ksb, ksh, kss, vsb, vsh, vss, lo, hi, softcap,
               nsplit, chunk, block, NULL, NULL, NULL, BH * nsplit, nthreads};
    if (J.nthreads > J.ntasks) J.nthreads = (int)J.ntasks;
    const int own = nsplit > 1;
    /* partial outputs 64-byte aligned: a 512-bit accumulator split over two cache lines
     * defeats store-to-load forwarding in the loops that update it */
    void *po_raw = own ? malloc(sizeof(float) * J.ntasks * R * Dv + 64) : NULL;
    J.po = own ? (po_raw ? (float *)(((uintptr_t)po_raw + 63) & ~(uintptr_t)63) : NULL) : out;
    J.pm = (float *)malloc(sizeof(float) * J.ntasks * R);
    J.pl = (double *)malloc(sizeof(double) * J.ntasks * R);
    int err = (!J.po || !J.pm || !J.pl);
    if (!err) {
        worker_t ws[256];
        pthread_t th[256];
        int nt = J.nthreads > 256 ? 256 : J.nthreads;
        J.nthreads = nt;
        int started[256] = {0};
        for (int i = 0; i < nt; i++) ws[i] = (worker_t){&J, i, 0};
        for (int i = 1; i < nt; i++) started[i] = pthread_create(&th[i], NULL, worker, &ws[i]) == 0;
        worker(&ws[0]);
        for (int i = 1; i < nt; i++) {
            if (started[i]) pthread_join(th[i], NULL);
            else worker(&ws[i]); /* could not start a thread: do its share here */
        }
        for (int i = 0; i < nt; i++) err |= ws[i].err;
    }
    if (!err) {
        for (int64_t bh = 0; bh < BH; bh++)
            for (int64_t r = 0; r < R; r++) {
                float M = -INFINITY;
                for (int64_t sp = 0; sp < nsplit; sp++) {
                    float m = J.pm[(bh * nsplit + sp) * R + r];
                    M = m > M ? m : M;
                }
                double L = 0;
                float *o = out + (bh * R + r) * Dv;
                int first = 1;
                for (int64_t sp = 0; sp < nsplit; sp++) {
                    int64_t t = bh * nsplit + sp;
                    float m = J.pm[t * R + r];
                    if (m == -INFINITY && J.pl[t * R + r] == 0) continue; /* empty; a NaN sum must reach L */
                    float c = own ? exp_neg(m - M) : 1.0f;
                    L += J.pl[t * R + r] * c;
                    if (own) { /* the first split assigned (not 0 + x: a -0.0 stays -0.0, as with one split) */
                        const float *restrict po = J.po + (t * R + r) * Dv;
                        if (first)
                            for (int64_t d = 0; d < Dv; d++) o[d] = c * po[d];
                        else
                            for (int64_t d = 0; d < Dv; d++) o[d] += c * po[d];
                    }
                    first = 0;
                }
                if (L > 0) {
                    float inv = (float)(1.0 / L);
                    for (int64_t d = 0; d < Dv; d++) o[d] *= inv;
                    lse[bh * R + r] = M + (float)log(L);
                } else if (L != L) { /* a NaN (or an inf - inf) among the row's visible scores */
                    for (int64_t d = 0; d < Dv; d++) o[d] = NAN;
                    lse[bh * R + r] = NAN;
                } else {
                    memset(o, 0, sizeof(float) * Dv);
                    lse[bh * R + r] = -INFINITY;
                }
            }
    }
    free(po_raw);
    free(J.pm);
    free(J.pl);
    return err ? 1 : 0;
}

/* n bytes at a 64-byte boundary inside a malloc'ed block; *raw: the block (to free) */
static void *alloc64(size_t n, void **raw) {
    *raw = malloc(n + 64);
    return *raw ? (void *)(((uintptr_t)*raw + 63) & ~(uintptr_t)63) : NULL;
}

/* treeattn_decode on the caller's queries as they are: q [B, H, R0, D] contiguous float32
 * (qdtype 0) or bfloat16 (qdtype 1, passed on unscaled as qb when the K/V are bf16 too),
 * scaled here; the rows padded with zero rows to R (>= R0; the pad rows take row R0-1's
 * bounds) and out [B, H, R0, Dv], lse [B, H, R0] written for the R0 rows only. */
int treeattn_decode_rows(const void *q, int qdtype, float scale, const void *k, const void *v, int dtype,
                         int64_t B, int64_t H, int64_t R0, int64_t R, int64_t S, int64_t D, int64_t Dv,
                         int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb, int64_t vsh, int64_t vss,
                         const int64_t *lo0, const int64_t *hi0, float softcap, int nthreads, int64_t block,
                         int64_t split, float *out, float *lse) {
    if (qdtype < 0 || qdtype > 1 || R0 < 0 || R < R0 || (R > R0 && R0 == 0) || B < 0 || H < 0 || D <= 0 || Dv <= 0)
        return 2;
    const int64_t BH = B * H, pad = R - R0;
    if (BH * R0 == 0) return 0; /* no rows: nothing to write (torch's empty tensors have no data) */
    const int qbf = qdtype == 1 && dtype == 1;
    /* 64-byte aligned, as torch's buffers: a 512-bit row or accumulator split over two cache
     * lines costs the kernel's loops (store-to-load forwarding) */
    void *raw[4] = {NULL, NULL, NULL, NULL};
    float *q32 = (float *)alloc64(sizeof(float) * BH * R * D, &raw[0]);
    uint16_t *qb = qbf ? (uint16_t *)alloc64(sizeof(uint16_t) * BH * R * D, &raw[1]) : NULL;
    int64_t *lo = pad && lo0 ? (int64_t *)malloc(sizeof(int64_t) * B * R) : NULL;
    int64_t *hi = pad && hi0 ? (int64_t *)malloc(sizeof(int64_t) * B * R) : NULL;
    float *o = pad ? (float *)alloc64(sizeof(float) * BH * R * Dv, &raw[2]) : out;
    float *l = pad ? (float *)alloc64(sizeof(float) * BH * R, &raw[3]) : lse;
    int rc = 1;
    if (!q32 || (qbf && !qb) || (pad && lo0 && !lo) || (pad && hi0 && !hi) || (pad && (!o || !l))) goto done;
    for (int64_t bh = 0; bh < BH; bh++) {
        float *dst = q32 + bh * R * D;
        if (qdtype == 0) {
            const float *src = (const float *)q + bh * R0 * D;
            for (int64_t i = 0; i < R0 * D; i++) dst[i] = src[i] * scale;
        } else {
            const uint16_t *src = (const uint16_t *)q + bh * R0 * D;
            for (int64_t i = 0; i < R0 * D; i++) {
                uint32_t u = (uint32_t)src[i] << 16;
                float f;
                memcpy(&f, &u, 4);
                dst[i] = f * scale;
            }
            if (qbf) {
                memcpy(qb + bh * R * D, src, sizeof(uint16_t) * R0 * D);
                memset(qb + bh * R * D + R0 * D, 0, sizeof(uint16_t) * pad * D);
            }
        }
        memset(dst + R0 * D, 0, sizeof(float) * pad * D);
    }
    for (int64_t b = 0; pad && b < B; b++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t s = r < R0 ? r : R0 - 1;
            if (lo) lo[b * R + r] = lo0[b * R0 + s];
            if (hi) hi[b * R + r] = hi0[b * R0 + s];
        }
    rc = treeattn_decode(q32, qb, scale, k, v, dtype, B, H, R, S, D, Dv, ksb, ksh, kss, vsb, vsh, vss,
                         pad ? lo : lo0, pad ? hi : hi0, softcap, nthreads, block, split, o, l);
    if (rc == 0 && pad)
        for (int64_t bh = 0; bh < BH; bh++) {
            memcpy(out + bh * R0 * Dv, o + bh * R * Dv, sizeof(float) * R0 * Dv);
            memcpy(lse + bh * R0, l + bh * R, sizeof(float) * R0);
        }
done:
    for (int i = 0; i < 4; i++) free(raw[i]);
    free(lo);
    free(hi);
    return rc;
}
