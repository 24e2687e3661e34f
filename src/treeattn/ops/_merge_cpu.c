/* Merge of p attention states packed as buf [p, R, Dv + 1] float32 (each row: out | lse), the
 * semantics of treeattn.ops.state.merge_states_n: an lse of +inf or -inf is an empty state (its
 * out is ignored, NaN or not), a NaN lse makes the row undefined (NaN out and lse), all-empty
 * rows give (0, -inf). One pass per row over the p states, in rank order: deterministic, and
 * the same bits on every rank that merges the same buffer. Part of the shared object built
 * by _decode_cpu.py. */
#include <math.h>
#include <stdint.h>

int treeattn_merge(const float *buf, int64_t p, int64_t R, int64_t Dv, float *out, float *lse) {
    const int64_t W = Dv + 1;
    for (int64_t r = 0; r < R; r++) {
        float m = -INFINITY;
        int undefined = 0;
        for (int64_t j = 0; j < p; j++) {
            float l = buf[(j * R + r) * W + Dv];
            if (isnan(l))
                undefined = 1;
            else if (isfinite(l) && l > m)
                m = l;
        }
        float *o = out + r * Dv;
        if (undefined) {
            for (int64_t d = 0; d < Dv; d++) o[d] = NAN;
            lse[r] = NAN;
            continue;
        }
        for (int64_t d = 0; d < Dv; d++) o[d] = 0.0f;
        if (m == -INFINITY) {
            lse[r] = -INFINITY;
            continue;
        }
        float s = 0.0f;
        for (int64_t j = 0; j < p; j++) {
            const float *x = buf + (j * R + r) * W;
            if (!isfinite(x[Dv])) continue;
            float w = expf(x[Dv] - m);
            if (w == 0.0f) continue;
            s += w;
            for (int64_t d = 0; d < Dv; d++) o[d] += w * x[d];
        }
        for (int64_t d = 0; d < Dv; d++) o[d] /= s;
        lse[r] = m + logf(s);
    }
    return 0;
}
