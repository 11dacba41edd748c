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

#include "fast_math.h"

/* A row of D values as float32: float32 rows are read in place, bfloat16 rows are widened into `tmp`. */
static inline const float *f32_row(const float *src, float *tmp, int64_t D) { (void)tmp; (void)D; return src; }

static inline const float *bf16_row(const uint16_t *src, float *tmp, int64_t D) {
    for (int64_t i = 0; i < D; i++) tmp[i] = bf16_get(src + i);
    return tmp;
}

/* Per (sequence, KV head): each key and value row is read (and widened) once for the G query heads that share
 * it; scores of a block first, then one online-softmax rescale per block and query head. */
#define PAGED_DECODE(NAME, T, ROW, STORE)                                                                         \
void NAME(const T *q, const T *k, const T *v, const int32_t *tables, int64_t table_stride, int64_t first_block,   \
          const int32_t *ctx, T *out, float *lse, int64_t S, int64_t Hkv, int64_t G, int64_t D, int64_t NB,        \
          int64_t BS, float scale, int threads) {                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 4) num_threads(threads)")                             \
    for (int64_t s = 0; s < S; s++) {                                                                             \
        for (int64_t h = 0; h < Hkv; h++) {                                                                       \
            float m[G], l[G], acc[G * D], qf[G * D], row[D], scores[G * BS];                                      \
            for (int64_t j = 0; j < G; j++) { m[j] = -INFINITY; l[j] = 0.0f; }                                    \
            memset(acc, 0, sizeof(float) * G * D);                                                                \
            for (int64_t j = 0; j < G; j++) {                                                                     \
                const float *qj = ROW(q + ((s * Hkv + h) * G + j) * D, row, D);                                   \
                for (int64_t i = 0; i < D; i++) qf[j * D + i] = qj[i] * scale;                                    \
            }                                                                                                     \
            const int64_t n = ctx[s];                                                                             \
            for (int64_t b = 0; b * BS < n; b++) {                                                                \
                const int64_t block = tables[s * table_stride + first_block + b];                                 \
                const T *kb = k + (h * NB + block) * BS * D, *vb = v + (h * NB + block) * BS * D;                 \
                const int64_t tokens = n - b * BS < BS ? n - b * BS : BS;                                         \
                for (int64_t t = 0; t < tokens; t++) {                                                            \
                    const float *kt = ROW(kb + t * D, row, D);                                                    \
                    for (int64_t j = 0; j < G; j++) {                                                             \
                        const float *qj = qf + j * D;                                                             \
                        float dot = 0.0f;                                                                         \
                        for (int64_t i = 0; i < D; i++) dot += qj[i] * kt[i];                                     \
                        scores[j * BS + t] = dot;                                                                 \
                    }                                                                                             \
                }                                                                                                 \
                for (int64_t j = 0; j < G; j++) {                                                                 \
                    float *sj = scores + j * BS, top = m[j];                                                      \
                    for (int64_t t = 0; t < tokens; t++) top = sj[t] > top ? sj[t] : top;                         \
                    const float keep = exp_fast(m[j] - top);                                                          \
                    float sum = 0.0f;                                                                             \
                    for (int64_t t = 0; t < tokens; t++) { sj[t] = exp_fast(sj[t] - top); sum += sj[t]; }             \
                    l[j] = l[j] * keep + sum;                                                                     \
                    m[j] = top;                                                                                   \
                    if (keep != 1.0f) for (int64_t i = 0; i < D; i++) acc[j * D + i] *= keep;                     \
                }                                                                                                 \
                for (int64_t t = 0; t < tokens; t++) {                                                            \
                    const float *vt = ROW(vb + t * D, row, D);                                                    \
                    for (int64_t j = 0; j < G; j++) {                                                             \
                        const float p = scores[j * BS + t];                                                       \
                        float *aj = acc + j * D;                                                                  \
                        for (int64_t i = 0; i < D; i++) aj[i] += p * vt[i];                                       \
                    }                                                                                             \
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

PAGED_DECODE(paged_decode_f32, float, f32_row, f32_put)
PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_row, bf16_put)
