/* GEMMs on AVX-512 vectors for y = x @ w.T (+ bias), for CPUs without AMX: bfloat16 with `_mm512_dpbf16_ps`
 * (avx512_bf16: exact products of bf16 pairs summed in float32) and float32 with FMA. The weight is prepacked once
 * into 32-column slices, k-major, so one step over k reads two full vectors of it. Every output element is summed
 * over k in one fixed chain, the same whatever the number of rows, so a row's result never depends on the rows
 * that came with it (batch-invariant by construction). Rows run in blocks of up to ROW_BLOCK over each slice while
 * the slice sits in L2; threads split the slices. Built without AVX-512, the functions report it. */
#include <stdint.h>

#include "fast_math.h"

#define SLICE 32      /* columns per packed slice: two vectors of 16 */
#define ROW_BLOCK 12  /* rows per micro-kernel call: 24 accumulators, 2 weight vectors and a broadcast */
#define PREFETCH_AHEAD 1024 /* one pass over a slice (up to ROW_BLOCK rows): bytes prefetched ahead of the reads */

#if defined(__AVX512F__)
#define HAVE_AVX512 1
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif

/* 1: float32 kernel built; 2: also the bfloat16 one. */
int avx512_gemm_ready(void) {
#if defined(HAVE_AVX512_BF16)
    return 2;
#elif defined(HAVE_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* w [n, k] row-major bfloat16 -> packed [n / 32][k / 2][32 columns][2]; n % 32 == 0, k % 2 == 0. */
void avx512_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    for (int64_t s = 0; s < n / SLICE; s++)
        for (int64_t pair = 0; pair < k / 2; pair++)
            for (int64_t col = 0; col < SLICE; col++)
                for (int64_t e = 0; e < 2; e++)
                    packed[((s * (k / 2) + pair) * SLICE + col) * 2 + e] = w[(s * SLICE + col) * k + pair * 2 + e];
}

/* w [n, k] row-major float32 -> packed [n / 32][k][32 columns]; n % 32 == 0. */
void avx512_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    for (int64_t s = 0; s < n / SLICE; s++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t col = 0; col < SLICE; col++)
                packed[(s * k + i) * SLICE + col] = w[(s * SLICE + col) * k + i];
}

#ifdef HAVE_AVX512
static inline __m512 bias_or_zero(const float *bias, int half) {
    return bias ? _mm512_loadu_ps(bias + half * 16) : _mm512_setzero_ps();
}

/* ROWS rows of x (row stride k elements) times one packed slice b -> acc, then + bias, stored by `store`. The
 * chain per output element: acc = 0, then one dot step per k step in order; bias added last. Each k step
 * prefetches `pf_lines` lines from pf on: into L1 (`pf_near`) just ahead in this slice, or into L2 a share of the
 * next slice. */
#define MICRO_KERNEL(NAME, ELEM, STEP_ELEMS, LOAD_A, DOT, STORE)                                                    \
    static inline __attribute__((always_inline)) void NAME(const ELEM *x, int64_t k, const ELEM *b,                 \
                                                           const float *bias, ELEM *y, int64_t n, int rows,         \
                                                           const char *pf, int pf_lines, int pf_near) {             \
        __m512 acc[ROW_BLOCK][2];                                                                                   \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROW_BLOCK; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();   \
        const int64_t steps = k / STEP_ELEMS;                                                                       \
        for (int64_t s = 0; s < steps; s++) {                                                                       \
            const ELEM *bs = b + s * STEP_ELEMS * SLICE;                                                            \
            for (int line = 0; line < pf_lines; line++) {                                                           \
                if (pf_near) _mm_prefetch(pf + (s * pf_lines + line) * 64, _MM_HINT_T0);                            \
                else _mm_prefetch(pf + (s * pf_lines + line) * 64, _MM_HINT_T1);                                    \
            }                                                                                                       \
            const __m512 b0 = (__m512)_mm512_loadu_si512(bs), b1 = (__m512)_mm512_loadu_si512(bs + 16 * STEP_ELEMS); \
            _Pragma("GCC unroll 12") for (int r = 0; r < ROW_BLOCK; r++) {                                          \
                if (r < rows) {                                                                                     \
                    const __m512 a = LOAD_A(x + r * k + s * STEP_ELEMS);                                            \
                    acc[r][0] = DOT(acc[r][0], a, b0);                                                              \
                    acc[r][1] = DOT(acc[r][1], a, b1);                                                              \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROW_BLOCK; r++) if (r < rows) {                                \
            STORE(y + r * n, _mm512_add_ps(acc[r][0], bias_or_zero(bias, 0)));                                      \
            STORE(y + r * n + 16, _mm512_add_ps(acc[r][1], bias_or_zero(bias, 1)));                                 \
        }                                                                                                           \
    }

#define LOAD_F32(p) _mm512_set1_ps(*(p))
#define DOT_F32(acc, a, b) _mm512_fmadd_ps(a, b, acc)
#define STORE_F32(p, v) _mm512_storeu_ps(p, v)
MICRO_KERNEL(slice_f32, float, 1, LOAD_F32, DOT_F32, STORE_F32)

#ifdef HAVE_AVX512_BF16
#define LOAD_BF16_PAIR(p) ((__m512)_mm512_set1_epi32(*(const int32_t *)(p)))
#define DOT_BF16(acc, a, b) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))
#define STORE_BF16(p, v) _mm256_storeu_si256((__m256i *)(p), (__m256i)_mm512_cvtneps_pbh(v))
MICRO_KERNEL(slice_bf16, uint16_t, 2, LOAD_BF16_PAIR, DOT_BF16, STORE_BF16)
#endif

/* Each rows-count a constant, so the micro-kernel's row loop unrolls and its accumulators stay in registers. */
#define DISPATCH_ROWS(KERNEL, x, k, b, bias, y, n, rows, pf, pf_lines, pf_near)                                     \
    switch (rows) {                                                                                                 \
    case 12: KERNEL(x, k, b, bias, y, n, 12, pf, pf_lines, pf_near); break;                                         \
    case 11: KERNEL(x, k, b, bias, y, n, 11, pf, pf_lines, pf_near); break;                                         \
    case 10: KERNEL(x, k, b, bias, y, n, 10, pf, pf_lines, pf_near); break;                                         \
    case 9: KERNEL(x, k, b, bias, y, n, 9, pf, pf_lines, pf_near); break;                                           \
    case 8: KERNEL(x, k, b, bias, y, n, 8, pf, pf_lines, pf_near); break;                                           \
    case 7: KERNEL(x, k, b, bias, y, n, 7, pf, pf_lines, pf_near); break;                                           \
    case 6: KERNEL(x, k, b, bias, y, n, 6, pf, pf_lines, pf_near); break;                                           \
    case 5: KERNEL(x, k, b, bias, y, n, 5, pf, pf_lines, pf_near); break;                                           \
    case 4: KERNEL(x, k, b, bias, y, n, 4, pf, pf_lines, pf_near); break;                                           \
    case 3: KERNEL(x, k, b, bias, y, n, 3, pf, pf_lines, pf_near); break;                                           \
    case 2: KERNEL(x, k, b, bias, y, n, 2, pf, pf_lines, pf_near); break;                                           \
    default: KERNEL(x, k, b, bias, y, n, 1, pf, pf_lines, pf_near); break;                                          \
    }

/* Threads split the 32-column slices; each runs all rows over its slice, ROW_BLOCK at a time. With one pass per
 * slice, the pass prefetches its own slice just ahead; with several, each prefetches its share of the next slice into
 * L2, so the weight streams in while the passes compute instead of during the first one alone (a 2-core Xeon, the
 * float32 layers from memory: 16 rows 30.3 -> 26.3 ms, 35 rows 43.7 -> 39.2). */
#define LINEAR(KERNEL, ELEM)                                                                                        \
    const int64_t passes = (m + ROW_BLOCK - 1) / ROW_BLOCK, slice_lines = k * SLICE * (int64_t)sizeof(ELEM) / 64;   \
    const int64_t pass_lines = (slice_lines + passes - 1) / passes, k_steps = k * (int64_t)sizeof(ELEM) / 4;        \
    const int step_lines = (int)((pass_lines + k_steps - 1) / k_steps);                                             \
    _Pragma("omp parallel num_threads(threads)") {                                                                  \
        KERNEL_BEGIN;                                                                                               \
        _Pragma("omp for schedule(static)") for (int64_t s = 0; s < n / SLICE; s++) {                               \
            const ELEM *b = packed + s * k * SLICE;                                                                 \
            const float *slice_bias = bias ? bias + s * SLICE : NULL;                                               \
            const char *next = (const char *)(b + k * SLICE);                                                       \
            for (int64_t first = 0, pass = 0; first < m; first += ROW_BLOCK, pass++) {                              \
                const int rows = m - first < ROW_BLOCK ? (int)(m - first) : ROW_BLOCK;                              \
                DISPATCH_ROWS(KERNEL, x + first * k, k, b, slice_bias, y + first * n + s * SLICE, n, rows,          \
                              passes == 1 ? (const char *)b + PREFETCH_AHEAD : next + pass * pass_lines * 64,       \
                              passes == 1 ? 2 : step_lines, passes == 1);                                           \
            }                                                                                                       \
        }                                                                                                           \
        KERNEL_END;                                                                                                 \
    }
#endif

/* y [m, n] = x [m, k] @ w.T + bias (float32 or NULL); w packed by avx512_pack_f32; n % 32 == 0. */
void avx512_linear_f32(const float *x, const float *packed, const float *bias, float *y, int64_t m, int64_t n,
                       int64_t k, int threads) {
#ifdef HAVE_AVX512
    LINEAR(slice_f32, float)
#endif
}

/* The same in bfloat16 (float32 sums, rounded to nearest even); w packed by avx512_pack_bf16; k % 2 == 0. */
void avx512_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int threads) {
#ifdef HAVE_AVX512_BF16
    LINEAR(slice_bf16, uint16_t)
#endif
}
