/* Linear layers for decode on CPU (float32, AVX-512): y = x W^T (+ b) over a weight packed once.
 *
 * A decode step multiplies a few rows by every weight of the model, so it streams the weights
 * from memory once per step. The packed weight is one stream: groups of 64 outputs, each group
 * [K][64] (the last group [K][16 * panels], zero-padded to whole 16-wide panels), so one k reads
 * 256 contiguous bytes. A register tile of up to 6 rows x 64 outputs runs over k.
 *
 * Every output is the same sum whatever the rows of the call, the tile or the thread: FMA chains
 * over k in blocks of KC (from 0, in order), the blocks' sums added in order, then the bias. So
 * a row's output does not depend on its batch (and the short chains round better than one long
 * one). Threads (OpenMP, torch's pool) split the (group, row tile) tasks, not the sums. */
#include <stdint.h>

#define KC 64
#define TR 6

/* wp [16 * ceil(N / 16) * K] from w [N, K] (row-major). */
void treeattn_linear_pack(const float *w, int64_t N, int64_t K, float *wp) {
    int64_t np = (N + 15) / 16;
    for (int64_t g = 0; 4 * g < np; g++) {
        int64_t wd = 16 * (np - 4 * g < 4 ? np - 4 * g : 4);
        float *dst = wp + g * K * 64;
        for (int64_t c = 0; c < wd; c++) {
            int64_t n = 64 * g + c;
            for (int64_t k = 0; k < K; k++) dst[k * wd + c] = n < N ? w[n * K + k] : 0.f;
        }
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *p, int64_t K,
                                                       int nj, int nr, __m512 tot[TR][4]) {
    int64_t wd = 16 * nj;
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nj; q++) tot[r][q] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = k0 + KC < K ? k0 + KC : K;
        __m512 acc[TR][4];
        for (int r = 0; r < nr; r++)
            for (int q = 0; q < nj; q++) acc[r][q] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m512 wv[4];
            for (int q = 0; q < nj; q++) wv[q] = _mm512_loadu_ps(p + k * wd + 16 * q);
            for (int r = 0; r < nr; r++) {
                __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
                for (int q = 0; q < nj; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int q = 0; q < nj; q++) tot[r][q] = _mm512_add_ps(tot[r][q], acc[r][q]);
    }
}

#define T4(NR) tile(x, ldx, p, K, 4, NR, tot)
static void run_tile(const float *x, int64_t ldx, const float *p, int64_t K, int nj, int nr, __m512 tot[TR][4]) {
    if (nj < 4) {
        tile(x, ldx, p, K, nj, nr, tot);
        return;
    }
    switch (nr) {  /* constant tile shapes: the accumulators stay in registers */
    case 1: T4(1); break;
    case 2: T4(2); break;
    case 3: T4(3); break;
    case 4: T4(4); break;
    case 5: T4(5); break;
    default: T4(6);
    }
}

static void task(const float *x, int64_t M, int64_t K, int64_t N, const float *wp, const float *b, float *y,
                 int64_t ldx, int64_t ldy, int64_t t, int64_t ntile) {
    int64_t g = t / ntile, m0 = (t % ntile) * TR, np = (N + 15) / 16;
    int nj = np - 4 * g < 4 ? (int)(np - 4 * g) : 4, nr = M - m0 < TR ? (int)(M - m0) : TR;
    __m512 tot[TR][4];
    run_tile(x + m0 * ldx, ldx, wp + g * K * 64, K, nj, nr, tot);
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nj; q++) {
            int64_t n0 = 64 * g + 16 * q;
            int left = N - n0 < 16 ? (int)(N - n0) : 16;
            __mmask16 mk = (__mmask16)((1u << left) - 1u);
            __m512 a = tot[r][q];
            if (b) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mk, b + n0));
            _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, mk, a);
        }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T + b (b may be NULL), wp from
 * treeattn_linear_pack. Returns 0, or 2 on bad arguments. */
int treeattn_linear(const float *x, int64_t M, int64_t K, int64_t N, const float *wp, const float *b, float *y,
                    int64_t ldx, int64_t ldy, int nthreads) {
    if (M < 0 || K < 0 || N < 0 || ldx < K || ldy < N) return 2;
    if (M == 0 || N == 0) return 0;
    int64_t ntile = (M + TR - 1) / TR, ntasks = ((N + 63) / 64) * ntile;
    if (nthreads > ntasks) nthreads = (int)ntasks;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
#endif
    for (int64_t t = 0; t < ntasks; t++) task(x, M, K, N, wp, b, y, ldx, ldy, t, ntile);
    return 0;
}

int treeattn_linear_available(void) { return 1; }
#else
int treeattn_linear(const float *x, int64_t M, int64_t K, int64_t N, const float *wp, const float *b, float *y,
                    int64_t ldx, int64_t ldy, int nthreads) {
    return 3;
}

int treeattn_linear_available(void) { return 0; }
#endif
