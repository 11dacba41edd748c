/* A decoder layer's elementwise steps on the CPU, fused, float32 or bfloat16 (computed in float32, rounded where
 * Hugging Face's bfloat16 model rounds): RMSNorm with the residual add before it, RoPE in place, SiLU(gate) * up.
 * Built with paged_decode.c by engine/kernels/cpu_kernel.py. Rows run in parallel when there are enough. */
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
#if !defined(__AVX512BF16__)
SILU_MUL(silu_mul_bf16, uint16_t, bf16_get, bf16_put, bf16_round)
#endif
#pragma GCC pop_options

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 bf16x16_round(__m512 x) { /* to bfloat16 (nearest even) and back */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* The bfloat16 SiLU(gate) * up in AVX-512: the division by 1 + e^-v as a reciprocal estimate and one Newton step
 * (within an ulp of float32 division, so the bfloat16 results are the same but for rare ties): 50 against 67 us
 * for the compiled loop at 48 rows on a 2-core Intel Xeon. Columns past the last 16 take the scalar formula. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int threads) {
    _Pragma("omp parallel num_threads(threads) if(rows >= PARALLEL_ROWS)")
    {
        KERNEL_BEGIN;
        _Pragma("omp for")
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
            uint16_t *o = out + r * inter;
            int64_t i = 0;
            for (; i + 16 <= inter; i += 16) {
                const __m512 v = bf16x16_load(g + i);
                const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                               exp_fast16(_mm512_sub_ps(_mm512_setzero_ps(), v)));
                __m512 inv = _mm512_rcp14_ps(d);
                inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
                const __m512 silu = bf16x16_round(_mm512_mul_ps(v, inv));
                const __m512 product = _mm512_mul_ps(silu, bf16x16_load(u + i));
                _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(product));
            }
            for (; i < inter; i++) {
                const float v = bf16_get(g + i);
                bf16_put(o + i, bf16_round(v / (1.0f + exp_fast(-v))) * bf16_get(u + i));
            }
        }
        KERNEL_END;
    }
}
#endif
