#define _GNU_SOURCE
/* The decode kernel (src/treeattn/ops/_decode_cpu.c) called directly from C, against plain
 * read-only sums over memory, without Python in between. Each repetition first sums a 256 MiB
 * float32 buffer (which also evicts K/V from the caches), then runs the kernel once; the report
 * is the median kernel GB/s and the median of the per-repetition ratios kernel / sum.
 *
 *   gcc -O3 -march=native -fopenmp-simd -std=gnu11 benchmarks/kernel_vs_sum.c \
 *       src/treeattn/ops/_decode_cpu.c -o /tmp/kernel_vs_sum -lm -lpthread
 *   /tmp/kernel_vs_sum [dtype f32|bf16] [Hkv] [rows per KV head] [S] [reps] [threads] [pages huge|4k] [warm]
 *
 * `warm`: each repetition times 50 back-to-back kernel calls after the sums, so K/V come from
 * the caches when they fit (e.g. float32, Hkv=2, S=1024: K and V 1 MiB each, in L2/L3): the kernel's
 * compute ceiling, to set against the memory floor.
 *
 * B = 1, D = Dv = 128, bf16 queries for bf16 K/V (the AVX512-BF16 path where the CPU has it).
 * Two sums are reported: one stream (`omp simd` over the buffer) and two streams (K-sized and
 * V-sized halves read side by side, as the kernel reads K and V). K, V and the sum buffer are
 * on 2 MiB transparent huge pages (madvise, as treeattn's KV cache) unless pages = 4k. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

int treeattn_decode(const float *q, const uint16_t *qb, float scale, const void *k, const void *v, int dtype,
                    int64_t B, int64_t H, int64_t R, int64_t S, int64_t D, int64_t Dv, int64_t ksb, int64_t ksh,
                    int64_t kss, int64_t vsb, int64_t vsh, int64_t vss, const int64_t *lo, const int64_t *hi,
                    float softcap, int nthreads, int64_t block, int64_t split, float *out, float *lse);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static double median(double *x, int n) {
    qsort(x, n, sizeof(double), cmp);
    return x[n / 2];
}

int main(int argc, char **argv) {
    const int bf = argc > 1 && !strcmp(argv[1], "bf16");
    const int64_t H = argc > 2 ? atoll(argv[2]) : 8, R = argc > 3 ? atoll(argv[3]) : 4,
                  S = argc > 4 ? atoll(argv[4]) : 65536, D = 128;
    int reps = argc > 5 ? atoi(argv[5]) : 7;
    const int nth = argc > 6 ? atoi(argv[6]) : 1;
    if (reps > 64) reps = 64;
    const size_t el = bf ? 2 : 4, nkv = (size_t)H * S * D;
    const int huge = !(argc > 7 && !strcmp(argv[7], "4k")), warm = argc > 8 && !strcmp(argv[8], "warm");
    const size_t kvb = (nkv * el + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    char *k = aligned_alloc(2u << 20, kvb), *v = aligned_alloc(2u << 20, kvb);
    if (huge && k && v) madvise(k, kvb, MADV_HUGEPAGE), madvise(v, kvb, MADV_HUGEPAGE);
    float *q = aligned_alloc(64, 4 * H * R * D), *out = aligned_alloc(64, 4 * H * R * D), *lse = malloc(4 * H * R);
    uint16_t *qb = aligned_alloc(64, 2 * H * R * D);
    if (!k || !v || !q || !out || !lse || !qb) return 1;
    srand(1);
    for (size_t i = 0; i < nkv; i++) {
        float a = rand() / (float)RAND_MAX - 0.5f, b = rand() / (float)RAND_MAX - 0.5f;
        if (bf)
            ((uint16_t *)k)[i] = to_bf16(a), ((uint16_t *)v)[i] = to_bf16(b);
        else
            ((float *)k)[i] = a, ((float *)v)[i] = b;
    }
    const float scale = 0.08838834764831845f;
    for (int64_t i = 0; i < H * R * D; i++) {
        qb[i] = to_bf16(2.0f * rand() / (float)RAND_MAX - 1.0f);
        uint32_t u = (uint32_t)qb[i] << 16;
        memcpy(q + i, &u, 4);
        q[i] *= scale;
    }
    const size_t n = (size_t)64 << 20; /* 256 MiB */
    float *x = aligned_alloc(2u << 20, n * 4);
    if (!x) return 1;
    if (huge) madvise(x, n * 4, MADV_HUGEPAGE);
    for (size_t i = 0; i < n; i++) x[i] = (float)(i & 7);
    const double bytes = 2.0 * nkv * el;
    double kgb[64], r1[64], r2[64], s1[64], s2[64];
    float sink = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        float a = 0;
#pragma omp simd reduction(+ : a)
        for (size_t i = 0; i < n; i++) a += x[i];
        double t1 = now();
        float b = 0, c = 0;
#pragma omp simd reduction(+ : b, c)
        for (size_t i = 0; i < n / 2; i++) b += x[i], c += x[i + n / 2];
        const double t2s = now(); /* end of the two-stream sum, before any warm-up call */
        const int calls = warm ? 50 : 1;
        double t2 = t2s;
        for (int it = -warm; it < calls; it++) { /* warm: one untimed call brings K/V into the caches */
            if (it == 0) t2 = now();
            treeattn_decode(q, bf ? qb : NULL, scale, k, v, bf ? 1 : 0, 1, H, R, S, D, D, H * S * D, S * D, D,
                            H * S * D, S * D, D, NULL, NULL, 0.0f, nth, 64, 2048, out, lse);
        }
        double t3 = now();
        sink += a + b + c + out[0];
        s1[r] = n * 4.0 / (t1 - t0) / 1e9, s2[r] = n * 4.0 / (t2s - t1) / 1e9, kgb[r] = calls * bytes / (t3 - t2) / 1e9;
        r1[r] = kgb[r] / s1[r], r2[r] = kgb[r] / s2[r];
    }
    printf("%s Hkv=%ld rows=%ld S=%ld threads=%d %s%s: kernel %.1f GB/s | sum 1 stream %.1f GB/s (kernel %.0f%%) | "
           "sum 2 streams %.1f GB/s (kernel %.0f%%)%s\n",
           bf ? "bf16" : "f32", (long)H, (long)R, (long)S, nth, huge ? "huge pages" : "4k pages",
           warm ? ", warm (50 calls)" : "", median(kgb, reps), median(s1, reps),
           100 * median(r1, reps), median(s2, reps), 100 * median(r2, reps), sink == 1.0f ? " " : "");
    return 0;
}
