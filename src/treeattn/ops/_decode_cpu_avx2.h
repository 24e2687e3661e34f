/* The AVX2+FMA kernels of the decode kernel (_decode_cpu.c, which includes this file first):
 * hsum8, the vector exp (exp8_neg), the float32 4-key dot products and axpys of the generic
 * path (dot4_avx2, axpy4_avx2), and the one-key float32/bfloat16 kernels of the
 * software-pipelined fast task (LD8, dot1_x, axpy1_x, dot_axpy1_x, dot_axpy1_r4_x,
 * dot_axpy2_r4_x). Defines HAVE_AVX2. */

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
#endif
