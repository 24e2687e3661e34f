/* Compute ceilings of the AVX2 bfloat16 register tiles (src/treeattn/ops/_decode_cpu.c) with
 * their data in L1: 8 keys of D = 128 for 4 query rows (GQA 32/8), the tiles called as
 * block_tile_bf calls them, over and over. Reports ns per key and 256-bit FMAs per ns against
 * the peak this program measures with 10 independent FMA chains, each the best of 7 rounds.
 * AVX2 builds without AVX-512 only (the tiles are not compiled with AVX-512).
 *
 *   gcc -O3 -march=native -fopenmp-simd -std=gnu11 -I src/treeattn/ops benchmarks/tile_micro.c -o /tmp/tile_micro -lm -lpthread
 *   /tmp/tile_micro [iterations per round, default 200000]
 */
#include "_decode_cpu.c"
#include <stdio.h>
#include <time.h>

#if !TILE_BF16
int main(void) {
    puts("tile_micro: this build has no AVX2 bfloat16 tiles (no AVX2, or AVX-512 present)");
    return 0;
}
#else
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint16_t V[8 * 128] __attribute__((aligned(64)));
static float o[4 * 128], p[4 * 16], q[4 * 128], s[4 * 16];

static void run(int mode) {
    if (mode == 0) /* values, 2 rows x 32 dims (4 rows: 2 x 4 tiles) */
        for (int r = 0; r < 4; r += 2)
            for (int d = 0; d < 128; d += 32) val_tile_bf(o + r * 128 + d, 128, (const char *)V + 2 * d, 256, 8, p + r * 16, 16, 2, 4, 0);
    else if (mode == 1) /* values, 1 row x 64 dims */
        for (int r = 0; r < 4; r++)
            for (int d = 0; d < 128; d += 64) val_tile_bf(o + r * 128 + d, 128, (const char *)V + 2 * d, 256, 8, p + r * 16, 16, 1, 8, 0);
    else if (mode == 2) /* scores, 4 rows x 2 keys */
        for (int j = 0; j < 8; j += 2) sc_tile_bf(q, 128, (const char *)V + j * 256, 256, 128, s + j, 16, 4, 2, 0);
    else if (mode == 3) /* scores, 2 rows x 2 keys */
        for (int r = 0; r < 4; r += 2)
            for (int j = 0; j < 8; j += 2) sc_tile_bf(q + r * 128, 128, (const char *)V + j * 256, 256, 128, s + r * 16 + j, 16, 2, 2, 0);
    else if (mode == 4) /* scores, 1 row x 4 keys */
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j += 4) sc_tile_bf(q + r * 128, 128, (const char *)V + j * 256, 256, 128, s + r * 16 + j, 16, 1, 4, 0);
    else if (mode == 6) { /* scores, 4 rows x 3 keys (+ 4 x 2 for the last 2 of 8), as block_tile_bf */
        sc_tile_bf_4x3(q, 128, (const char *)V, 256, 128, s, 16, 0);
        sc_tile_bf_4x3(q, 128, (const char *)V + 3 * 256, 256, 128, s + 3, 16, 0);
        sc_tile_bf(q, 128, (const char *)V + 6 * 256, 256, 128, s + 6, 16, 4, 2, 0);
    } else /* scores, 4 rows x 1 key */
        for (int j = 0; j < 8; j++) sc_tile_bf(q, 128, (const char *)V + j * 256, 256, 128, s + j, 16, 4, 1, 0);
}

/* seconds for n x 10 independent 256-bit FMA chains (latency x throughput on these CPUs) */
static double peak_run(long n, float *sink) {
    __m256 a[10];
    for (int i = 0; i < 10; i++) a[i] = _mm256_set1_ps((float)i);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    const double t0 = now();
    for (long it = 0; it < n; it++)
        for (int i = 0; i < 10; i++) a[i] = _mm256_fmadd_ps(a[i], m, c);
    const double t = now() - t0;
    for (int i = 0; i < 10; i++) *sink += hsum8(a[i]);
    return t;
}

int main(int argc, char **argv) {
    const long iters = argc > 1 ? atol(argv[1]) : 200000;
    for (int i = 0; i < 8 * 128; i++) V[i] = 0x3f80; /* 1.0 */
    for (int i = 0; i < 4 * 16; i++) p[i] = 1e-9f;
    for (int i = 0; i < 4 * 128; i++) q[i] = 1e-3f;
    static const char *names[] = {"values 2x32", "values 1x64", "scores 4x2", "scores 2x2", "scores 1x4", "scores 4x1", "scores 4x3"};
    const double fma = iters * 8.0 * 4 * 128 / 8; /* per run: 8 keys x 4 rows x 128 MACs, 8 lanes per FMA */
    float sink = 0;
    double best[7], pk = 1e30;
    for (int m = 0; m < 7; m++) best[m] = 1e30;
    /* 7 rounds, peak and every tile timed in each; the best of each (interference only adds time) */
    for (int round = 0; round < 7; round++) {
        const double t = peak_run((long)(fma / 10), &sink);
        pk = t < pk ? t : pk;
        for (int m = 0; m < 7; m++) {
            run(m);
            const double t0 = now();
            for (long it = 0; it < iters; it++) {
                run(m);
                __asm__ volatile("" ::: "memory");
            }
            const double tm = now() - t0;
            best[m] = tm < best[m] ? tm : best[m];
        }
    }
    const double peak = fma / pk * 1e-9;
    printf("peak %.2f 256-bit FMA/ns (10 independent chains)\n", peak);
    for (int m = 0; m < 7; m++)
        printf("%-12s %6.2f ns/key  %.2f FMA/ns  %3.0f%% of peak\n", names[m], best[m] / iters / 8 * 1e9,
               fma / best[m] * 1e-9, 100 * pk / best[m]);
    return (o[5] + s[3] + sink) > 1e30f;
}
#endif
