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
 * Built on first use by _decode_cpu.py (gcc -O3 -march=native -fopenmp-simd). */
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


#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
static inline float hsum8(__m256 x) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
/* s[0..3] = q . k_i for 4 keys k_i = k + i * ks, D % 8 == 0 */
static inline void dot4_avx2(const float *q, const float *k, int64_t ks, int64_t D, float *s, int pf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *k1 = k + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    for (int64_t d = 0; d < D; d += 8) {
        if (pf && !(d & 15)) {
            _mm_prefetch((const char *)(k + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(k1 + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(k2 + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(k3 + d) + PF_BYTES, _MM_HINT_T0);
        }
        __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), a3);
    }
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h = _mm256_hadd_ps(h01, h23); /* lanes: [0 1 2 3 | 0 1 2 3] partial */
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s, r);
}
/* o += p0 v0 + p1 v1 + p2 v2 + p3 v3, v_i = v + i * vs, Dv % 8 == 0 */
static inline void axpy4_avx2(float *o, const float *v, int64_t vs, int64_t Dv, const float *p, int pf) {
    const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(p[1]), p2 = _mm256_set1_ps(p[2]),
                 p3 = _mm256_set1_ps(p[3]);
    const float *v1 = v + vs, *v2 = v1 + vs, *v3 = v2 + vs;
    for (int64_t d = 0; d < Dv; d += 8) {
        if (pf && !(d & 15)) {
            _mm_prefetch((const char *)(v + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(v1 + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(v2 + d) + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(v3 + d) + PF_BYTES, _MM_HINT_T0);
        }
        __m256 x = _mm256_loadu_ps(o + d);
        x = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + d), x);
        x = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + d), x);
        x = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v2 + d), x);
        x = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v3 + d), x);
        _mm256_storeu_ps(o + d, x);
    }
}
static inline __m256 exp8_neg(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* in this order a NaN score stays NaN */
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* exp for x <= 0 (Cephes-style range reduction + degree-6 polynomial), branch-free so
 * that loops calling it vectorise. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* c * tanh(x / c), branch-free (Cephes tanhf: odd polynomial below 0.625, else 1 - 2/(e^2y + 1)). */
static inline float softcap_f(float x, float c) {
    float y = x / c;
    float a = fabsf(y);
    float z = y * y;
    float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                    1.33314422036e-1f) * z - 3.33332819422e-1f) * z * y + y;
    float aa = a > 9.0f ? 9.0f : a;
    float e = 1.0f / exp_neg(-2.0f * aa); /* e^(2|y|) */
    float big = 1.0f - 2.0f / (e + 1.0f);
    big = y < 0 ? -big : big;
    return c * (a < 0.625f ? small : big);
}

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (ex == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = ex == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((ex + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ask for `rows` rows of `bytes` bytes each, `stride` bytes apart, to be brought into cache:
 * the hardware prefetcher alone leaves this loop far below the read bandwidth */
static inline void prefetch_rows(const char *p, int64_t stride, int64_t rows, int64_t bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + r * stride + o, 0, 0);
}

/* rows [j0, j1) of a [S, n] slice with row stride `ss` (elements), to float32 [j1-j0, n] */
static void load_block(float *restrict dst, const void *base, int dtype, int64_t ss, int64_t j0, int64_t j1,
                       int64_t n) {
    for (int64_t j = j0; j < j1; j++) {
        float *restrict d = dst + (j - j0) * n;
        prefetch_rows((const char *)base + (j + PF_AHEAD) * ss * 2, 0, 1, n * 2);
        if (dtype == DT_BF16) {
            const uint16_t *restrict s = (const uint16_t *)base + j * ss;
#ifdef HAVE_AVX2
            if (n % 8 == 0) {
                for (int64_t i = 0; i < n; i += 8)
                    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i))), 16)));
                continue;
            }
#endif
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                uint32_t b = (uint32_t)s[i] << 16;
                float f;
                memcpy(&f, &b, 4);
                d[i] = f;
            }
        } else {
            const uint16_t *restrict s = (const uint16_t *)base + j * ss;
            int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
            for (; i < n; i++) d[i] = h2f(s[i]);
        }
    }
}

/* start task [s0, s1) of one (b, h): running maxima -inf, denominators and accumulators 0;
 * returns the union [*ulo, *uhi) of the rows' key ranges within the split (empty: ulo >= uhi) */
static void task_start(int64_t R, int64_t S, int64_t Dv, const int64_t *lo, const int64_t *hi, int64_t s0, int64_t s1,
                       float *mx, double *den, float *acc, int64_t *ulo, int64_t *uhi) {
    *ulo = s1, *uhi = s0;
    for (int64_t r = 0; r < R; r++) {
        int64_t a = lo ? lo[r] : 0, e = hi ? hi[r] : S;
        a = a < s0 ? s0 : a;
        e = e > s1 ? s1 : e;
        if (a < e) {
            *ulo = a < *ulo ? a : *ulo;
            *uhi = e > *uhi ? e : *uhi;
        }
        mx[r] = -INFINITY;
        den[r] = 0.0;
    }
    /* a split no row reads: its accumulators are never read (the merge skips it), and not
     * touching them leaves the untouched pages of a large scratch buffer unmapped */
    if (*ulo < *uhi) memset(acc, 0, sizeof(float) * R * Dv);
}

static void run_task(const job_t *J, int64_t t, float *kbuf, float *vbuf, float *sbuf, int64_t *ivs) {
    const int64_t R = J->R, D = J->D, Dv = J->Dv, S = J->S, BS = J->block;
    const int64_t bh = t / J->nsplit, sp = t % J->nsplit, b = bh / J->H, h = bh % J->H;
    const float *q = J->q + bh * R * D;
    float *acc = J->po + t * R * Dv, *mx = J->pm + t * R;
    double *den = J->pl + t * R;
    const int64_t elk = J->dtype == DT_F32 ? 4 : 2;
    const char *kb = (const char *)J->k + (b * J->ksb + h * J->ksh) * elk;
    const char *vb = (const char *)J->v + (b * J->vsb + h * J->vsh) * elk;
    const int64_t *lo = J->lo ? J->lo + b * R : NULL, *hi = J->hi ? J->hi + b * R : NULL;
    int64_t s0 = sp * J->chunk, s1 = s0 + J->chunk < S ? s0 + J->chunk : S;
    int64_t ulo, uhi;
    task_start(R, S, Dv, lo, hi, s0, s1, mx, den, acc, &ulo, &uhi);
    /* merged, sorted intervals of the rows' ranges within the split (for the converting loads) */
    int64_t niv = 0;
    for (int64_t r = 0; r < R; r++) {
        int64_t a = lo ? lo[r] : 0, e = hi ? hi[r] : S;
        a = a < s0 ? s0 : a;
        e = e > s1 ? s1 : e;
        if (a >= e) continue;
        int64_t i = niv++;
        while (i > 0 && ivs[2 * (i - 1)] > a) {
            ivs[2 * i] = ivs[2 * (i - 1)], ivs[2 * i + 1] = ivs[2 * i - 1];
            i--;
        }
        ivs[2 * i] = a, ivs[2 * i + 1] = e;
    }
    int64_t nm = 0;
    for (int64_t i = 0; i < niv; i++) {
        if (nm && ivs[2 * i] <= ivs[2 * nm - 1]) {
            if (ivs[2 * i + 1] > ivs[2 * nm - 1]) ivs[2 * nm - 1] = ivs[2 * i + 1];
        } else {
            ivs[2 * nm] = ivs[2 * i], ivs[2 * nm + 1] = ivs[2 * i + 1];
            nm++;
        }
    }
    niv = nm;
    const float cap = J->softcap;
    for (int64_t j0 = ulo; j0 < uhi; j0 += BS) {
        const int64_t j1 = j0 + BS < uhi ? j0 + BS : uhi;
        const float *K, *V;
        int64_t kst, vst;
        if (J->dtype == DT_F32) {
            K = (const float *)kb + j0 * J->kss, kst = J->kss;
            V = (const float *)vb + j0 * J->vss, vst = J->vss;
        } else {
            /* convert only the keys some row sees: a gap between rows' ranges stays unread */
            for (int64_t i = 0; i < niv; i++) {
                int64_t a = ivs[2 * i] > j0 ? ivs[2 * i] : j0, e = ivs[2 * i + 1] < j1 ? ivs[2 * i + 1] : j1;
                if (a >= e) continue;
                load_block(kbuf + (a - j0) * D, kb, J->dtype, J->kss, a, e, D);
                load_block(vbuf + (a - j0) * Dv, vb, J->dtype, J->vss, a, e, Dv);
            }
            K = kbuf, kst = D;
            V = vbuf, vst = Dv;
        }
        int first = J->dtype == DT_F32;
        for (int64_t r = 0; r < R; r++) {
            int64_t a = lo ? lo[r] : 0, e = hi ? hi[r] : S;
            a = a < j0 ? j0 : a;
            e = e > j1 ? j1 : e;
            if (a >= e) continue;
            const int pf = first;
            first = 0;
            const float *restrict qr = q + r * D;
            float *restrict s = sbuf;
            const int64_t n = e - a;
            const float *Ka = K + (a - j0) * kst, *Va = V + (a - j0) * vst;
            int64_t j = 0;
#ifdef HAVE_AVX2
            if (D % 8 == 0)
                for (; j + 4 <= n; j += 4) {
                    dot4_avx2(qr, Ka + j * kst, kst, D, s + j, pf);
                }
#endif
            for (; j + 4 <= n; j += 4) {
                const float *restrict k0 = Ka + j * kst, *restrict k1 = k0 + kst, *restrict k2 = k1 + kst,
                                      *restrict k3 = k2 + kst;
                float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t d = 0; d < D; d++) {
                    a0 += qr[d] * k0[d];
                    a1 += qr[d] * k1[d];
                    a2 += qr[d] * k2[d];
                    a3 += qr[d] * k3[d];
                }
                s[j] = a0, s[j + 1] = a1, s[j + 2] = a2, s[j + 3] = a3;
            }
            for (; j < n; j++) {
                const float *restrict k0 = Ka + j * kst;
                float a0 = 0;
#pragma omp simd reduction(+ : a0)
                for (int64_t d = 0; d < D; d++) a0 += qr[d] * k0[d];
                s[j] = a0;
            }
            if (cap > 0) {
#pragma omp simd
                for (int64_t i = 0; i < n; i++) s[i] = softcap_f(s[i], cap);
            }
            float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
            for (int64_t i = 0; i < n; i++) bm = s[i] > bm ? s[i] : bm;
            float *restrict o = acc + r * Dv;
            if (bm > mx[r]) {
                if (mx[r] > -INFINITY) {
                    float c = exp_neg(mx[r] - bm);
                    den[r] *= c;
#pragma omp simd
                    for (int64_t d = 0; d < Dv; d++) o[d] *= c;
                }
                mx[r] = bm;
            }
            const float m = mx[r];
            float sum = 0;
            int64_t i0 = 0;
#ifdef HAVE_AVX2
            {
                __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
                for (; i0 + 8 <= n; i0 += 8) {
                    __m256 x = exp8_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i0), vm));
                    _mm256_storeu_ps(s + i0, x);
                    vs = _mm256_add_ps(vs, x);
                }
                sum = hsum8(vs);
            }
#endif
#pragma omp simd reduction(+ : sum)
            for (int64_t i = i0; i < n; i++) {
                s[i] = exp_neg(s[i] - m);
                sum += s[i];
            }
            den[r] += sum;
            j = 0;
#ifdef HAVE_AVX2
            if (Dv % 8 == 0)
                for (; j + 4 <= n; j += 4) {
                    axpy4_avx2(o, Va + j * vst, vst, Dv, s + j, pf);
                }
#endif
            for (; j + 4 <= n; j += 4) {
                const float *restrict v0 = Va + j * vst, *restrict v1 = v0 + vst, *restrict v2 = v1 + vst,
                                      *restrict v3 = v2 + vst;
                const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
            for (; j < n; j++) {
                const float *restrict v0 = Va + j * vst;
                const float p0 = s[j];
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) o[d] += p0 * v0[d];
            }
        }
    }
}


#ifdef HAVE_AVX2
/* 8 floats from row p (float32, or bfloat16 widened by a 16-bit shift) at element i */
#define LD8(p, i, bf)                                                                                     \
    ((bf) ? _mm256_castsi256_ps(_mm256_slli_epi32(                                                      \
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i)))), 16)) \
          : _mm256_loadu_ps((const float *)(p) + (i)))

static inline __attribute__((always_inline)) void dot1_x(const float *q, const char *k, int64_t D, float *s, int bf) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), LD8(k, d, bf), a0);
    *s = hsum8(a0);
}

static inline __attribute__((always_inline)) void axpy1_x(float *o, const char *v, int64_t Dv, float p, int bf) {
    const __m256 p0 = _mm256_set1_ps(p);
    for (int64_t d = 0; d < Dv; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p0, LD8(v, d, bf), _mm256_loadu_ps(o + d)));
}

/* one key's score (k row, sequential) and one value row accumulated (v row, sequential) in the
 * same pass: two sequential streams side by side (K of the next block, V of this one) */
static inline __attribute__((always_inline)) void dot_axpy1_x(const float *q, const char *k, int64_t D, float *s,
                                                              float *o, const char *v, int64_t Dv, float p, int bf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    const __m256 p0 = _mm256_set1_ps(p);
    if (D == Dv && D % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), LD8(k, d, bf), a0);
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p0, LD8(v, d, bf), _mm256_loadu_ps(o + d)));
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), LD8(k, d + 8, bf), a1);
            _mm256_storeu_ps(o + d + 8, _mm256_fmadd_ps(p0, LD8(v, d + 8, bf), _mm256_loadu_ps(o + d + 8)));
        }
        *s = hsum8(_mm256_add_ps(a0, a1));
        return;
    }
    dot1_x(q, k, D, s, bf);
    axpy1_x(o, v, Dv, p, bf);
}

/* dot_axpy1_x for 4 query rows that see the same key: each K/V element is loaded (and
 * widened) once for the 4 rows. q rows qs apart, o rows os apart, scores s[r * ss]. */
static inline __attribute__((always_inline)) void dot_axpy1_r4_x(const float *q, int64_t qs, const char *k, int64_t D,
                                                                 float *s, int64_t ss, float *o, int64_t os,
                                                                 const char *v, const float *p, int64_t ps, int dov,
                                                                 int bf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(p[ps]), p2 = _mm256_set1_ps(p[2 * ps]),
                 p3 = _mm256_set1_ps(p[3 * ps]);
    for (int64_t d = 0; d < D; d += 8) {
        if (!bf && !(d & 15)) { /* float32: K and V rows 1 KiB ahead (measured: +10-15% here) */
            _mm_prefetch(k + 4 * d + 1024, _MM_HINT_T0);
            _mm_prefetch(v + 4 * d + 1024, _MM_HINT_T0);
        }
        const __m256 x = LD8(k, d, bf);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), x, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + qs + d), x, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * qs + d), x, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * qs + d), x, a3);
        if (dov) {
            const __m256 y = LD8(v, d, bf);
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p0, y, _mm256_loadu_ps(o + d)));
            _mm256_storeu_ps(o + os + d, _mm256_fmadd_ps(p1, y, _mm256_loadu_ps(o + os + d)));
            _mm256_storeu_ps(o + 2 * os + d, _mm256_fmadd_ps(p2, y, _mm256_loadu_ps(o + 2 * os + d)));
            _mm256_storeu_ps(o + 3 * os + d, _mm256_fmadd_ps(p3, y, _mm256_loadu_ps(o + 3 * os + d)));
        }
    }
    s[0] = hsum8(a0), s[ss] = hsum8(a1), s[2 * ss] = hsum8(a2), s[3 * ss] = hsum8(a3);
}

/* dot_axpy1_r4_x for two consecutive keys: halves the accumulator loads/stores per key,
 * which bound the 4-row case */
static inline __attribute__((always_inline)) void dot_axpy2_r4_x(const float *q, int64_t qs, const char *k, int64_t ks,
                                                                 int64_t D, float *s, int64_t ss, float *o, int64_t os,
                                                                 const char *v, int64_t vs, const float *p, int64_t ps,
                                                                 int bf) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const __m256 p00 = _mm256_set1_ps(p[0]), p01 = _mm256_set1_ps(p[1]), p10 = _mm256_set1_ps(p[ps]),
                 p11 = _mm256_set1_ps(p[ps + 1]), p20 = _mm256_set1_ps(p[2 * ps]), p21 = _mm256_set1_ps(p[2 * ps + 1]),
                 p30 = _mm256_set1_ps(p[3 * ps]), p31 = _mm256_set1_ps(p[3 * ps + 1]);
    const char *k1 = k + ks, *v1 = v + vs;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x0 = LD8(k, d, bf), x1 = LD8(k1, d, bf);
        __m256 w = _mm256_loadu_ps(q + d);
        a00 = _mm256_fmadd_ps(w, x0, a00), a01 = _mm256_fmadd_ps(w, x1, a01);
        w = _mm256_loadu_ps(q + qs + d);
        a10 = _mm256_fmadd_ps(w, x0, a10), a11 = _mm256_fmadd_ps(w, x1, a11);
        w = _mm256_loadu_ps(q + 2 * qs + d);
        a20 = _mm256_fmadd_ps(w, x0, a20), a21 = _mm256_fmadd_ps(w, x1, a21);
        w = _mm256_loadu_ps(q + 3 * qs + d);
        a30 = _mm256_fmadd_ps(w, x0, a30), a31 = _mm256_fmadd_ps(w, x1, a31);
        const __m256 y0 = LD8(v, d, bf), y1 = LD8(v1, d, bf);
        float *od = o + d;
        _mm256_storeu_ps(od, _mm256_fmadd_ps(p01, y1, _mm256_fmadd_ps(p00, y0, _mm256_loadu_ps(od))));
        od += os;
        _mm256_storeu_ps(od, _mm256_fmadd_ps(p11, y1, _mm256_fmadd_ps(p10, y0, _mm256_loadu_ps(od))));
        od += os;
        _mm256_storeu_ps(od, _mm256_fmadd_ps(p21, y1, _mm256_fmadd_ps(p20, y0, _mm256_loadu_ps(od))));
        od += os;
        _mm256_storeu_ps(od, _mm256_fmadd_ps(p31, y1, _mm256_fmadd_ps(p30, y0, _mm256_loadu_ps(od))));
    }
    s[0] = hsum8(a00), s[1] = hsum8(a01), s[ss] = hsum8(a10), s[ss + 1] = hsum8(a11);
    s[2 * ss] = hsum8(a20), s[2 * ss + 1] = hsum8(a21), s[3 * ss] = hsum8(a30), s[3 * ss + 1] = hsum8(a31);
}


/* ---- bfloat16: AVX2 register tiles over groups of keys (rows that see the same keys) ----
 * The per-key loops above widen every bf16 element with two instructions and load and store
 * each row's value accumulator once per key, which bounds them near half the read bandwidth
 * on AVX2-only CPUs. Here a group of GRP_X keys is done in two short phases that keep the K
 * and V streams side by side: the scores of the next block's keys (tiles of 4 rows x 3 keys,
 * 4 x 2 or 4 x 1 for the rest, or 1 row x 4 keys: each K and q load serves several FMAs),
 * then the values of this block's keys (tiles of 2 rows x 32 dims, or 1 row x 64 dims, whose
 * accumulators stay in registers over the group; V rows re-read from L1). 16 bf16 are
 * widened at once as their even and odd elements (one shift, one and), so q (qp) and the
 * accumulators are kept in that order (perm16). The first row tile prefetches one line PFK_X
 * keys ahead per step. A single row (MHA) streams faster key by key (row1_eo). float32 runs
 * measured slower this way than in the per-key loops (docs/benchmarks.md section 9.1). */
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

#if defined(__AVX512F__)
#define HAVE_AVX512 1
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_BF16DP 1
#endif
/* Keys per group in the AVX-512 4-row path (measured from memory, docs/benchmarks.md §9):
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
