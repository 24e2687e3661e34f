/* One all-gather round of packed attention states through the /dev/shm segments of
 * treeattn/comm/shm_small.py, and their merge (treeattn_merge): a decode step's state reduction
 * between the ranks of one host in one call, instead of a dozen Python-level steps (~50 us a
 * call at p = 2 here, 30 calls a token). The protocol is shm_small's, byte for byte, so a rank
 * on this path and a rank on the Python one exchange with each other:
 *   a segment: int64 header [0] = the last round its owner published; slot (round % 2) at
 *   `off`: int64 tag [round, payload bytes] (-1, -1 while written), the payload 64 bytes in.
 * The payload is this rank's k states, k R rows of [out (Dv floats) | lse], as torch.cat([out,
 * lse[..., None]], -1) lays them out. Part of the shared object built by _decode_cpu.py. */
#include <stdint.h>
#include <string.h>

int treeattn_merge(const float *buf, int64_t p, int64_t R, int64_t Dv, float *out, float *lse);

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* segs[j]: rank j's segment (this rank's writable, the peers' read-only); round: this round's
 * number; o [k, R, Dv], l [k, R]: this rank's k states (float32, contiguous); buf [p, k, R, Dv +
 * 1]: the gathered states (this rank's written here too); out [R, Dv], lse [R]: the merge of the
 * p k states, rank after rank, each rank's in their order.
 * Returns 0: done. 1: a peer has not yet published round - 1, so this rank's slot may still be
 * read: nothing written. 2: published, but a peer did not publish this round within `spins`
 * checks, or its slot's tag is not this round's: the caller waits (with its timeout and liveness
 * checks), reads the peers' slots into buf and merges. */
int treeattn_shm_gather_merge(char *const *segs, int64_t p, int64_t rank, int64_t round, int64_t off,
                              const float *o, const float *l, int64_t k, int64_t R, int64_t Dv, int64_t spins,
                              float *buf, float *out, float *lse) {
    const int64_t W = Dv + 1, KR = k * R, bytes = KR * W * (int64_t)sizeof(float);
    for (int64_t j = 0; j < p; j++)
        if (j != rank && __atomic_load_n((const int64_t *)segs[j], __ATOMIC_ACQUIRE) < round - 1) return 1;
    int64_t *tag = (int64_t *)(segs[rank] + off);
    float *mine = buf + rank * KR * W, *pay = (float *)(segs[rank] + off + 64);
    for (int64_t r = 0; r < KR; r++) {
        memcpy(mine + r * W, o + r * Dv, Dv * sizeof(float));
        mine[r * W + Dv] = l[r];
    }
    __atomic_store_n(&tag[0], -1, __ATOMIC_RELAXED);
    __atomic_store_n(&tag[1], -1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(pay, mine, bytes);
    __atomic_store_n(&tag[0], round, __ATOMIC_RELEASE);
    __atomic_store_n(&tag[1], bytes, __ATOMIC_RELEASE);
    __atomic_store_n((int64_t *)segs[rank], round, __ATOMIC_RELEASE);
    for (int64_t j = 0; j < p; j++) {
        if (j == rank) continue;
        const int64_t *head = (const int64_t *)segs[j], *tj = (const int64_t *)(segs[j] + off);
        for (int64_t n = 0; __atomic_load_n(head, __ATOMIC_ACQUIRE) < round; n++) {
            if (n >= spins) return 2;
            spin_pause();
        }
        memcpy(buf + j * KR * W, segs[j] + off + 64, bytes);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&tj[0], __ATOMIC_RELAXED) != round || __atomic_load_n(&tj[1], __ATOMIC_RELAXED) != bytes)
            return 2;
    }
    treeattn_merge(buf, p * k, R, Dv, out, lse);
    return 0;
}
