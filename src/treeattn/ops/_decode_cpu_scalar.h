/* Scalar helpers of the decode kernel (included by _decode_cpu.c): exp for x <= 0, the
 * softcap, fp16 -> float32, software prefetch of rows, and the converting block load
 * (bf16/fp16 K/V rows to float32) of the generic path. */

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
