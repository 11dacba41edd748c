/* Paged decode attention on the CPU, float32 or bfloat16 (computed in float32): one query token per sequence,
 * keys and values read straight from the block pool (no gather), online softmax per block. Built at first use
 * by engine/attention/cpu_kernel.py.
 *
 * q      [S, Hkv, G, D]        the decode queries, G query heads per KV head
 * k, v   [Hkv, NB, BS, D]      one layer's pool
 * tables [S, table_stride]     block ids, the first `first_block` skipped (a shared prefix attended elsewhere)
 * ctx    [S]                   tokens to attend per sequence, counted from the first attended block
 * out    [S, Hkv, G, D]        softmax(q k^T * scale) v
 * lse    [S, Hkv, G] or NULL   log-sum-exp of each row's scores (to merge with a prefix part)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float x) { *p = x; }

static inline float bf16_load(const uint16_t *p) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)*p << 16 };
    return v.f;
}

static inline void bf16_store(uint16_t *p, float x) {  /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v = { .f = x };
    if (x != x) { *p = 0x7fc0; return; }
    *p = (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define PAGED_DECODE(NAME, T, LOAD, STORE)                                                                        \
void NAME(const T *q, const T *k, const T *v, const int32_t *tables, int64_t table_stride, int64_t first_block,   \
          const int32_t *ctx, T *out, float *lse, int64_t S, int64_t Hkv, int64_t G, int64_t D, int64_t NB,        \
          int64_t BS, float scale, int threads) {                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 4) num_threads(threads)")                             \
    for (int64_t s = 0; s < S; s++) {                                                                             \
        for (int64_t h = 0; h < Hkv; h++) {                                                                       \
            float m[G], l[G], acc[G * D], qf[G * D], kf[D], scores[BS];                                           \
            for (int64_t j = 0; j < G; j++) { m[j] = -INFINITY; l[j] = 0.0f; }                                    \
            memset(acc, 0, sizeof(float) * G * D);                                                                \
            const T *qh = q + (s * Hkv + h) * G * D;                                                              \
            for (int64_t i = 0; i < G * D; i++) qf[i] = LOAD(qh + i);                                             \
            const int64_t n = ctx[s];                                                                             \
            for (int64_t b = 0; b * BS < n; b++) {                                                                \
                const int64_t block = tables[s * table_stride + first_block + b];                                 \
                const T *kb = k + (h * NB + block) * BS * D, *vb = v + (h * NB + block) * BS * D;                 \
                const int64_t tokens = n - b * BS < BS ? n - b * BS : BS;                                         \
                for (int64_t j = 0; j < G; j++) {                                                                 \
                    const float *qj = qf + j * D;                                                                 \
                    float top = -INFINITY;                                                                        \
                    for (int64_t t = 0; t < tokens; t++) {                                                        \
                        const T *kt = kb + t * D;                                                                 \
                        for (int64_t i = 0; i < D; i++) kf[i] = LOAD(kt + i);                                     \
                        float dot = 0.0f;                                                                         \
                        for (int64_t i = 0; i < D; i++) dot += qj[i] * kf[i];                                     \
                        scores[t] = dot * scale;                                                                  \
                        top = scores[t] > top ? scores[t] : top;                                                  \
                    }                                                                                             \
                    const float new_max = top > m[j] ? top : m[j];                                                \
                    const float keep = expf(m[j] - new_max);                                                      \
                    float *aj = acc + j * D;                                                                      \
                    l[j] *= keep;                                                                                 \
                    for (int64_t i = 0; i < D; i++) aj[i] *= keep;                                                \
                    for (int64_t t = 0; t < tokens; t++) {                                                        \
                        const float p = expf(scores[t] - new_max);                                                \
                        const T *vt = vb + t * D;                                                                 \
                        l[j] += p;                                                                                \
                        for (int64_t i = 0; i < D; i++) aj[i] += p * LOAD(vt + i);                                \
                    }                                                                                             \
                    m[j] = new_max;                                                                               \
                }                                                                                                 \
            }                                                                                                     \
            for (int64_t j = 0; j < G; j++) {                                                                     \
                T *o = out + ((s * Hkv + h) * G + j) * D;                                                         \
                const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;                                               \
                for (int64_t i = 0; i < D; i++) STORE(o + i, acc[j * D + i] * inv);                               \
                if (lse) lse[(s * Hkv + h) * G + j] = l[j] > 0.0f ? m[j] + logf(l[j]) : -INFINITY;                \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

PAGED_DECODE(paged_decode_f32, float, f32_load, f32_store)
PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_load, bf16_store)
