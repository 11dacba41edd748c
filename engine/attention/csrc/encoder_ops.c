/* An encoder layer's attention and residual LayerNorm on the CPU, float32 or bfloat16 (computed in float32), over
 * a packed batch: rows of tokens one after another, no padding. Built with the other kernels by
 * engine/attention/cpu_kernel.py.
 *
 * packed_attention: qkv [tokens, 3 * H * D] (q, k, v of each token), rows at starts[r] of lengths[r] tokens;
 *   out [tokens, H * D] = softmax(q k^T * scale) v within each row (bidirectional). One (row, head) per task:
 *   its keys transposed and values widened to float32 once, then every query against them.
 * add_layer_norm: out = LayerNorm(x + residual) * weight + bias, the sum rounded to the dtype first (as torch). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fast_math.h"

#define PARALLEL_ROWS 16
#if defined(__AVX512F__)
#define LANES 16        /* floats per vector (GCC vector extension): one AVX-512 register */
#else
#define LANES 8         /* one AVX2 register: 16 took two, spilled the query block's accumulators (4x slower) */
#endif
#define QUERY_BLOCK 8   /* queries per pass: each key and value vector is loaded once for all of them */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t)), aligned(4)));

/* Plain dereferences (the type's alignment is 4): a memcpy became 16-byte moves through the stack and a wide reload,
 * a store-forwarding stall on every vector (AMD Zen 3: 2.3x the kernel's time). */
static inline vfloat vload(const float *p) { return *(const vfloat *)p; }
static inline void vstore(float *p, vfloat v) { *(vfloat *)p = v; }
static inline vfloat vmax(vfloat a, vfloat b) {
    const vint a_wins = a > b;
    return (vfloat)(((vint)a & a_wins) | ((vint)b & ~a_wins));
}

/* Scores of `n` queries (qf [n, D], pre-scaled) against the keys kt [D, Lp] (transposed, Lp a multiple of LANES),
 * then exp(score - the query's max) into p [n, Lp] (keys from L on: about 1e-38, never read) and 1 / their sum
 * into inv [n]. */
static void scores_exp(const float *restrict qf, const float *restrict kt, float *restrict p, float *restrict inv,
                       int64_t n, int64_t L, int64_t Lp, int64_t D) {
    vfloat top[QUERY_BLOCK];
    for (int64_t b = 0; b < QUERY_BLOCK; b++) top[b] = (vfloat){0} - INFINITY;
    for (int64_t j = 0; j < Lp; j += LANES) {
        vfloat acc[QUERY_BLOCK] = {0};
        for (int64_t d = 0; d < D; d++) {
            const vfloat k = vload(kt + d * Lp + j);
            for (int64_t b = 0; b < QUERY_BLOCK; b++) acc[b] += qf[b * D + d] * k;
        }
        if (j + LANES > L) {  /* the last vector: keys from L on are padding */
            vint lane;
            for (int64_t i = 0; i < LANES; i++) lane[i] = (int32_t)(j + i);
            const vint real = lane < (int32_t)L;
            for (int64_t b = 0; b < QUERY_BLOCK; b++)
                acc[b] = (vfloat)(((vint)acc[b] & real) | ((vint)((vfloat){0} - INFINITY) & ~real));
        }
        for (int64_t b = 0; b < QUERY_BLOCK; b++) top[b] = vmax(top[b], acc[b]);
        for (int64_t b = 0; b < n; b++) vstore(p + b * Lp + j, acc[b]);
    }
    for (int64_t b = 0; b < n; b++) {
        float m = top[b][0], sum = 0.0f, *restrict s = p + b * Lp;
        for (int64_t i = 1; i < LANES; i++) m = top[b][i] > m ? top[b][i] : m;
        for (int64_t j = 0; j < Lp; j++) { s[j] = exp_fast(s[j] - m); sum += s[j]; }
        inv[b] = 1.0f / sum;
    }
}

/* of[b] = p[b] @ vf * inv[b] for n queries: p [n, Lp], vf [L, D] (D a multiple of LANES) -> of [n, D]. */
static void weighted_values(const float *restrict p, const float *restrict inv, const float *restrict vf,
                            float *restrict of, int64_t n, int64_t L, int64_t Lp, int64_t D) {
    for (int64_t c = 0; c < D; c += LANES) {
        vfloat acc[QUERY_BLOCK] = {0};
        for (int64_t j = 0; j < L; j++) {
            const vfloat v = vload(vf + j * D + c);
            for (int64_t b = 0; b < QUERY_BLOCK; b++) acc[b] += p[b * Lp + j] * v;
        }
        for (int64_t b = 0; b < n; b++) vstore(of + b * D + c, acc[b] * inv[b]);
    }
}

#define PACKED_ATTENTION(NAME, T, GET, PUT)                                                                       \
void NAME(const T *qkv, T *out, const int64_t *starts, const int64_t *lengths, int64_t rows, int64_t longest,    \
          int64_t H, int64_t D, float scale, int threads) {                                                       \
    const int64_t width = 3 * H * D, Lmax = (longest + LANES - 1) / LANES * LANES;                               \
    _Pragma("omp parallel num_threads(threads)")                                                                  \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        float *kt = calloc(D * Lmax + Lmax * D + QUERY_BLOCK * (Lmax + 2 * D + 1), sizeof(float));               \
        float *vf = kt + D * Lmax, *p = vf + Lmax * D, *qf = p + QUERY_BLOCK * Lmax, *of = qf + QUERY_BLOCK * D;  \
        float *inv = of + QUERY_BLOCK * D;                                                                        \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                                       \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            for (int64_t h = 0; h < H; h++) {                                                                     \
                const int64_t L = lengths[r], Lp = (L + LANES - 1) / LANES * LANES;                               \
                const T *base = qkv + starts[r] * width;                                                          \
                for (int64_t j = 0; j < L; j++) {                                                                 \
                    const T *k = base + j * width + (H + h) * D, *v = base + j * width + (2 * H + h) * D;         \
                    for (int64_t d = 0; d < D; d++) { kt[d * Lp + j] = GET(k + d); vf[j * D + d] = GET(v + d); }  \
                }                                                                                                 \
                for (int64_t d = 0; d < D; d++) for (int64_t j = L; j < Lp; j++) kt[d * Lp + j] = 0.0f;           \
                for (int64_t i0 = 0; i0 < L; i0 += QUERY_BLOCK) {                                                 \
                    const int64_t n = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK;                                \
                    for (int64_t b = 0; b < n; b++) {                                                             \
                        const T *q = base + (i0 + b) * width + h * D;                                             \
                        for (int64_t d = 0; d < D; d++) qf[b * D + d] = GET(q + d) * scale;                       \
                    }                                                                                             \
                    scores_exp(qf, kt, p, inv, n, L, Lp, D);                                                      \
                    weighted_values(p, inv, vf, of, n, L, Lp, D);                                                 \
                    for (int64_t b = 0; b < n; b++) {                                                             \
                        T *o = out + (starts[r] + i0 + b) * H * D + h * D;                                        \
                        for (int64_t d = 0; d < D; d++) PUT(o + d, of[b * D + d]);                                \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        free(kt);                                                                                                 \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

#define ADD_LAYER_NORM(NAME, T, GET, PUT)                                                                         \
void NAME(const T *x, const T *residual, const T *weight, const T *bias, T *out, int64_t rows, int64_t hidden,   \
          float eps, int threads) {                                                                               \
    _Pragma("omp parallel num_threads(threads) if(rows >= PARALLEL_ROWS)")                                        \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for")                                                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            const T *xr = x + r * hidden, *rr = residual + r * hidden;                                            \
            float sum[hidden], mean = 0.0f, var = 0.0f;                                                           \
            for (int64_t i = 0; i < hidden; i++) {                                                                \
                T rounded;                                                                                        \
                PUT(&rounded, GET(xr + i) + GET(rr + i));                                                         \
                sum[i] = GET(&rounded);                                                                           \
                mean += sum[i];                                                                                   \
            }                                                                                                     \
            mean /= (float)hidden;                                                                                \
            for (int64_t i = 0; i < hidden; i++) { const float c = sum[i] - mean; var += c * c; }                 \
            const float inv = 1.0f / sqrtf(var / (float)hidden + eps);                                            \
            T *o = out + r * hidden;                                                                              \
            for (int64_t i = 0; i < hidden; i++)                                                                  \
                PUT(o + i, (sum[i] - mean) * inv * GET(weight + i) + GET(bias + i));                              \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

PACKED_ATTENTION(packed_attention_f32, float, f32_get, f32_put)
PACKED_ATTENTION(packed_attention_bf16, uint16_t, bf16_get, bf16_put)
ADD_LAYER_NORM(add_layer_norm_f32, float, f32_get, f32_put)
ADD_LAYER_NORM(add_layer_norm_bf16, uint16_t, bf16_get, bf16_put)
