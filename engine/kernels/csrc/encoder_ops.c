/* An encoder layer's attention and residual LayerNorm on the CPU, float32 or bfloat16, over a packed batch: rows of
 * tokens one after another, no padding. Built with the other kernels by engine/kernels/cpu_kernel.py.
 *
 * packed_attention: qkv [tokens, 3 * H * D] (q, k, v of each token), rows at starts[r] of lengths[r] tokens;
 *   out [tokens, H * D] = softmax(q k^T * scale) v within each row (bidirectional). One (row, head) per task: its
 *   keys transposed and values laid out once, then every block of queries against them. Sums and softmax in
 *   float32; bfloat16 multiplies bfloat16 pairs with avx512_bf16 where the CPU has it, else widens to float32.
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

/* Keeps one vector of keys' scores for a block of queries: keys from L on (the padding of the last vector) to -inf,
 * each query's running max in top, the n real queries' scores into p [n, Lp] at column j. */
static inline void keep_scores(vfloat *acc, vfloat *top, float *restrict p, int64_t n, int64_t j, int64_t L,
                               int64_t Lp) {
    if (j + LANES > L) {
        vint lane;
        for (int64_t i = 0; i < LANES; i++) lane[i] = (int32_t)(j + i);
        const vint real = lane < (int32_t)L;
        for (int64_t b = 0; b < QUERY_BLOCK; b++)
            acc[b] = (vfloat)(((vint)acc[b] & real) | ((vint)((vfloat){0} - INFINITY) & ~real));
    }
    for (int64_t b = 0; b < QUERY_BLOCK; b++) top[b] = vmax(top[b], acc[b]);
    for (int64_t b = 0; b < n; b++) vstore(p + b * Lp + j, acc[b]);
}

/* p [n, Lp] scores -> exp(score - the query's max) in place (keys from L on: about 1e-38, never read), and 1 / their
 * sum into inv [n]. */
static void exp_rows(const vfloat *top, float *restrict p, float *restrict inv, int64_t n, int64_t Lp) {
    for (int64_t b = 0; b < n; b++) {
        float m = top[b][0], sum = 0.0f, *restrict s = p + b * Lp;
        for (int64_t i = 1; i < LANES; i++) m = top[b][i] > m ? top[b][i] : m;
        for (int64_t j = 0; j < Lp; j++) { s[j] = exp_fast(s[j] - m); sum += s[j]; }
        inv[b] = 1.0f / sum;
    }
}

/* Scores of `n` queries (qf [n, D], pre-scaled) against the keys kt [D, Lp] (transposed, Lp a multiple of LANES),
 * then exp_rows. */
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
        keep_scores(acc, top, p, n, j, L, Lp);
    }
    exp_rows(top, p, inv, n, Lp);
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

/* One (row, head)'s attention in steps, per dtype: KEYS puts the keys k [L rows at stride width, D] into the buffer
 * kt as the scores read them (keys from L to Lp zero), VALUES the values into vf; then per block of n queries q (at
 * stride width) SCORES writes their scores' exp into p and 1 / sums into inv (qf: scratch), and WEIGHTED the
 * normalised sums of values into of (float32 [n, D]). In float32 (and bfloat16 widened): kt [D, Lp] transposed,
 * vf [L, D], scores_exp and weighted_values. */
#define FLOAT_STEPS(KEYS, VALUES, SCORES, WEIGHTED, T, GET)                                                       \
static void KEYS(const T *k, int64_t width, void *buffer, int64_t L, int64_t Lp, int64_t D) {                     \
    float *kt = buffer;                                                                                           \
    for (int64_t d = 0; d < D; d++) {  /* a strided read per key, written as a gather */                          \
        for (int64_t j = 0; j < L; j++) kt[d * Lp + j] = GET(k + j * width + d);                                  \
        for (int64_t j = L; j < Lp; j++) kt[d * Lp + j] = 0.0f;                                                   \
    }                                                                                                             \
}                                                                                                                 \
static void VALUES(const T *v, int64_t width, void *buffer, int64_t L, int64_t D) {                               \
    float *vf = buffer;                                                                                           \
    for (int64_t j = 0; j < L; j++) for (int64_t d = 0; d < D; d++) vf[j * D + d] = GET(v + j * width + d);      \
}                                                                                                                 \
static void SCORES(const T *q, int64_t width, const void *kt, float scale, float *qf, float *p, float *inv,       \
                   int64_t n, int64_t L, int64_t Lp, int64_t D) {                                                 \
    for (int64_t b = 0; b < n; b++) for (int64_t d = 0; d < D; d++) qf[b * D + d] = GET(q + b * width + d) * scale; \
    scores_exp(qf, kt, p, inv, n, L, Lp, D);                                                                      \
}                                                                                                                 \
static void WEIGHTED(float *p, const float *inv, const void *vf, float *of, int64_t n, int64_t L, int64_t Lp,     \
                     int64_t D) {                                                                                 \
    weighted_values(p, inv, vf, of, n, L, Lp, D);                                                                 \
}

FLOAT_STEPS(keys_f32, values_f32, scores_f32, weighted_f32, float, f32_get)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bfloat16 on CPUs with avx512_bf16: one vdpbf16ps does two multiply-adds (exact products, float32 sums) on pairs in
 * 32 bits. Scores: q and keys stay bfloat16, pairs of dims (2i, 2i + 1), kt [D / 2, Lp] transposed. Values: the
 * probabilities rounded to bfloat16 (as torch's and the AMX kernel's attention do), pairs of keys (2i, 2i + 1), the
 * values vf [(L + 1) / 2, D] likewise. Half the instructions of the float32 steps. */
typedef uint32_t bf16_pair __attribute__((aligned(2), may_alias));

static inline uint32_t pair_of(const uint16_t *p) { return *(const bf16_pair *)p; }

static void keys_bf16(const uint16_t *k, int64_t width, void *buffer, int64_t L, int64_t Lp, int64_t D) {
    uint32_t *kt = buffer;
    for (int64_t i = 0; i < D / 2; i++) {
        for (int64_t j = 0; j < L; j++) kt[i * Lp + j] = pair_of(k + j * width + 2 * i);
        for (int64_t j = L; j < Lp; j++) kt[i * Lp + j] = 0;
    }
}

static void values_bf16(const uint16_t *v, int64_t width, void *buffer, int64_t L, int64_t D) {
    uint32_t *vp = buffer;
    for (int64_t i = 0; i < L / 2; i++) {
        const uint16_t *even = v + 2 * i * width, *odd = even + width;
        for (int64_t d = 0; d < D; d++) vp[i * D + d] = (uint32_t)even[d] | (uint32_t)odd[d] << 16;
    }
    if (L % 2)  /* the last key's partner is zero */
        for (int64_t d = 0; d < D; d++) vp[L / 2 * D + d] = v[(L - 1) * width + d];
}

static void scores_bf16(const uint16_t *q, int64_t width, const void *buffer, float scale, float *qf, float *p,
                        float *inv, int64_t n, int64_t L, int64_t Lp, int64_t D) {
    const uint32_t *kt = buffer;
    uint32_t *qp = (uint32_t *)qf;  /* the block's queries as pairs [QUERY_BLOCK, D / 2] */
    for (int64_t b = 0; b < n; b++)
        for (int64_t i = 0; i < D / 2; i++) qp[b * D / 2 + i] = pair_of(q + b * width + 2 * i);
    vfloat top[QUERY_BLOCK];
    for (int64_t b = 0; b < QUERY_BLOCK; b++) top[b] = (vfloat){0} - INFINITY;
    for (int64_t j = 0; j < Lp; j += LANES) {
        __m512 acc[QUERY_BLOCK];
        for (int64_t b = 0; b < QUERY_BLOCK; b++) acc[b] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / 2; i++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i * Lp + j);
            for (int64_t b = 0; b < QUERY_BLOCK; b++)
                acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_set1_epi32((int)qp[b * D / 2 + i]), k);
        }
        vfloat scaled[QUERY_BLOCK];
        for (int64_t b = 0; b < QUERY_BLOCK; b++) scaled[b] = (vfloat)acc[b] * scale;
        keep_scores(scaled, top, p, n, j, L, Lp);
    }
    exp_rows(top, p, inv, n, Lp);
}

/* p [n, Lp] float32 is rounded to bfloat16 in place (each row's first Lp / 2 floats then hold its pairs). */
static void weighted_bf16(float *p, const float *inv, const void *buffer, float *of, int64_t n, int64_t L,
                          int64_t Lp, int64_t D) {
    const uint32_t *vp = buffer;
    for (int64_t b = 0; b < n; b++)
        for (int64_t j = 0; j < Lp; j += LANES)
            _mm256_storeu_si256((__m256i *)((uint16_t *)(p + b * Lp) + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + b * Lp + j)));
    const uint32_t *pp = (const uint32_t *)p;
    for (int64_t c = 0; c < D; c += LANES) {
        __m512 acc[QUERY_BLOCK];
        for (int64_t b = 0; b < QUERY_BLOCK; b++) acc[b] = _mm512_setzero_ps();
        for (int64_t i = 0; i < (L + 1) / 2; i++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + i * D + c);
            for (int64_t b = 0; b < QUERY_BLOCK; b++)
                acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_set1_epi32((int)pp[b * Lp + i]), v);
        }
        for (int64_t b = 0; b < n; b++) _mm512_storeu_ps(of + b * D + c, _mm512_mul_ps(acc[b], _mm512_set1_ps(inv[b])));
    }
}
#else
FLOAT_STEPS(keys_bf16, values_bf16, scores_bf16, weighted_bf16, uint16_t, bf16_get)
#endif

#define PACKED_ATTENTION(NAME, T, PUT, SUFFIX)                                                                    \
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
                keys_##SUFFIX(base + (H + h) * D, width, kt, L, Lp, D);                                           \
                values_##SUFFIX(base + (2 * H + h) * D, width, vf, L, D);                                         \
                for (int64_t i0 = 0; i0 < L; i0 += QUERY_BLOCK) {                                                 \
                    const int64_t n = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK;                                \
                    scores_##SUFFIX(base + i0 * width + h * D, width, kt, scale, qf, p, inv, n, L, Lp, D);        \
                    weighted_##SUFFIX(p, inv, vf, of, n, L, Lp, D);                                               \
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

PACKED_ATTENTION(packed_attention_f32, float, f32_put, f32)
PACKED_ATTENTION(packed_attention_bf16, uint16_t, bf16_put, bf16)
ADD_LAYER_NORM(add_layer_norm_f32, float, f32_get, f32_put)
ADD_LAYER_NORM(add_layer_norm_bf16, uint16_t, bf16_get, bf16_put)
