/* A decoder layer's elementwise steps on the CPU, fused, float32 or bfloat16 (computed in float32, rounded where
 * Hugging Face's bfloat16 model rounds): RMSNorm with the residual add before it, RoPE in place, SiLU(gate) * up.
 * Built with paged_decode.c by engine/attention/cpu_kernel.py. Rows run in parallel when there are enough. */
#include <math.h>
#include <stdint.h>

#include "fast_math.h"

#define PARALLEL_ROWS 16

static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) {
    uint16_t b;
    bf16_put(&b, x);
    return bf16_get(&b);
}

/* residual (if not NULL) += x, then out = weight * normalize(residual or x), as HF's LlamaRMSNorm: the sum of
 * squares in float32, the normalized row rounded to the model's dtype before the weight multiplies it. */
#define RMS_NORM(NAME, T, GET, PUT, ROUND)                                                                        \
void NAME(const T *x, T *residual, const T *weight, T *out, int64_t rows, int64_t hidden, float eps,             \
          int threads) {                                                                                          \
    _Pragma("omp parallel num_threads(threads) if(rows >= PARALLEL_ROWS)")                                        \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for")                                                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            const T *xr = x + r * hidden;                                                                         \
            T *src = (T *)xr;                                                                                     \
            if (residual) {                                                                                       \
                src = residual + r * hidden;                                                                      \
                for (int64_t i = 0; i < hidden; i++) PUT(src + i, GET(src + i) + GET(xr + i));                    \
            }                                                                                                     \
            float squares = 0.0f;                                                                                 \
            for (int64_t i = 0; i < hidden; i++) { const float v = GET(src + i); squares += v * v; }              \
            const float scale = 1.0f / sqrtf(squares / (float)hidden + eps);                                      \
            T *o = out + r * hidden;                                                                              \
            for (int64_t i = 0; i < hidden; i++) PUT(o + i, GET(weight + i) * ROUND(GET(src + i) * scale));       \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

/* x: `heads` rows of D per token, tokens `token_stride` apart, in place: x * cos + rotate_half(x) * sin, cos and
 * sin [positions, D] float32 tables rounded to the model's dtype, each product rounded as HF's model rounds it. */
#define ROPE(NAME, T, GET, PUT, ROUND)                                                                            \
void NAME(T *x, int64_t token_stride, const int64_t *positions, const float *cos_table, const float *sin_table,  \
          int64_t tokens, int64_t heads, int64_t D, int threads) {                                                \
    const int64_t half = D / 2;                                                                                   \
    _Pragma("omp parallel num_threads(threads) if(tokens >= PARALLEL_ROWS)")                                      \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for")                                                                                        \
        for (int64_t t = 0; t < tokens; t++) {                                                                    \
            const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;                     \
            for (int64_t h = 0; h < heads; h++) {                                                                 \
                T *row = x + t * token_stride + h * D;                                                            \
                float a[half], b[half];                                                                           \
                for (int64_t i = 0; i < half; i++) { a[i] = GET(row + i); b[i] = GET(row + half + i); }           \
                for (int64_t i = 0; i < half; i++) {                                                              \
                    PUT(row + i, ROUND(a[i] * ROUND(c[i])) + ROUND(-b[i] * ROUND(s[i])));                         \
                    PUT(row + half + i, ROUND(b[i] * ROUND(c[half + i])) + ROUND(a[i] * ROUND(s[half + i])));     \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

/* gate_up [rows, 2 * inter] -> out [rows, inter] = silu(gate) * up, silu rounded to the model's dtype first. */
#define SILU_MUL(NAME, T, GET, PUT, ROUND)                                                                        \
void NAME(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {                                   \
    _Pragma("omp parallel num_threads(threads) if(rows >= PARALLEL_ROWS)")                                        \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for")                                                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                                                 \
            T *o = out + r * inter;                                                                               \
            for (int64_t i = 0; i < inter; i++) {                                                                 \
                const float v = GET(g + i);                                                                       \
                PUT(o + i, ROUND(v / (1.0f + exp_fast(-v))) * GET(u + i));                                        \
            }                                                                                                     \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  /* no fused multiply-adds: round each product as torch does */
RMS_NORM(rms_norm_f32, float, f32_get, f32_put, f32_round)
RMS_NORM(rms_norm_bf16, uint16_t, bf16_get, bf16_put, bf16_round)
ROPE(rope_f32, float, f32_get, f32_put, f32_round)
ROPE(rope_bf16, uint16_t, bf16_get, bf16_put, bf16_round)
SILU_MUL(silu_mul_f32, float, f32_get, f32_put, f32_round)
SILU_MUL(silu_mul_bf16, uint16_t, bf16_get, bf16_put, bf16_round)
#pragma GCC pop_options
