/* The generic path of the decode kernel (included by _decode_cpu.c): any dtype and head dim,
 * blocks converted to float32 in L1 then plain loops (AVX2 dot4/axpy4 where they apply); and
 * task_start, which the fast path shares. */

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
