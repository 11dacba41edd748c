/* Paged decode attention on the CPU, float32 or bfloat16 (computed in float32): one query token per sequence,
 * keys and values read straight from the block pool (no gather), online softmax per block. Built at first use
 * by engine/kernels/cpu_kernel.py.
 *
 * q      [S, Hkv, G, D]        the decode queries, G query heads per KV head, rows q_stride elements apart
 * k, v   [Hkv, NB, BS, D]      one layer's pool
 * tables [S, table_stride]     block ids, the first `first_block` skipped (a shared prefix attended elsewhere)
 * ctx    [S]                   tokens to attend per sequence, counted from the first attended block
 * out    [S, Hkv, G, D]        softmax(q k^T * scale) v
 * lse    [S, Hkv, G] or NULL   log-sum-exp of each row's scores (to merge with a prefix part)
 *
 * k_scale, v_scale [Hkv] or NULL   FP8 pools: each KV head's scales (a stored byte times its scale is the value)
 *
 * write_kv stores a step's new keys and values into the pools: token i's [Hkv, D] rows (src_stride elements
 * apart per token) at slot slots[i] of every head.
 *
 * FP8 pools (the *_fp8_* variants) hold e4m3 bytes (torch.float8_e4m3fn): write_kv_fp8 divides by the head's scale,
 * saturates at +-448 and rounds to nearest even, as torch's conversion does. The decode kernels widen a tile of key
 * rows once for all the query heads that read it: to bfloat16 for bfloat16 queries (exact; scored by the same bf16
 * dot products as bfloat16 blocks), else to float32; value rows are widened to float32 as they are read; the head's
 * K scale is folded into the scores and its V scale into the output, so its values are never materialised.
 *
 * head_dim 16, 32, 64, 128 or 256 (Gemma 3) takes the vector kernel: LANES keys (16; 8 on AVX2) scored
 * at once per query head (their dot products summed across lanes in one transpose tree), keys and values two
 * blocks ahead prefetched a row at a time while this one is computed (the blocks are scattered over a pool far
 * larger than the caches; a whole block's prefetches at once stalled on full miss queues, 1.25x slower), and
 * with avx512_bf16 the bfloat16 scores as bf16 dot products (exact products, float32 sums). Other head_dims take
 * the scalar kernel. Either way a query's result never depends on the other sequences of the call. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "fast_math.h"

#if defined(__AVX512F__)
#define LANES 16  /* floats per vector (GCC vector extension): one AVX-512 register */
#else
#define LANES 8   /* one AVX2 register: 16 took two */
#endif
#define CACHE_LINE 64
#define PREFETCH_LEVEL 1      /* into L2 (1.3-1.5x faster here than into L1, whose fill buffers it would clog) */
#define PREFETCH_DISTANCE 2   /* blocks ahead */
#define HEADS_TOGETHER_MIN 4  /* sequences per thread from which a task takes all of a sequence's KV heads */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t)), aligned(4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2)));

#if defined(__AVX512F__)
/* One 64-byte load: the memcpy below became two 32-byte stores to the stack and a 64-byte reload, a store-forwarding
 * stall on every key row (Intel; 3x the float32 kernel's time). */
static inline vfloat load_f32(const float *p) { return (vfloat)_mm512_loadu_ps(p); }
#else  /* a plain dereference (the type's alignment is 4): a memcpy went through the stack here too */
static inline vfloat load_f32(const float *p) { return *(const vfloat *)p; }
#endif
static inline vfloat load_bf16(const uint16_t *p) {
    return (vfloat)(__builtin_convertvector(*(const vhalf *)p, vint) << 16);
}

typedef uint8_t vbyte __attribute__((vector_size(LANES), aligned(1)));

#if defined(__F16C__) || defined(__AVX512F__)
/* LANES e4m3 bytes as float32 values 2^-8 times theirs (FP8_LOAD_FACTOR undoes it, folded into the scales): each
 * byte sign-extended and shifted so that its exponent and mantissa land in a float16's fields (its bias is 8 more)
 * and its sign on bit 15, the copy of the sign on bit 14 cleared, then the hardware's exact float16 conversion,
 * which widens subnormals itself (the kernels read float32 subnormals as zero; its float16 inputs are not). The
 * NaN byte (0x7f) reads as 480: write_kv_fp8 never stores it. */
#define FP8_LOAD_FACTOR 256.0f
typedef int8_t vsbyte __attribute__((vector_size(LANES), aligned(1)));
typedef int16_t vshort __attribute__((vector_size(LANES * sizeof(int16_t)), aligned(2)));
static inline vfloat load_fp8(const uint8_t *p) {
    const vshort bits = (__builtin_convertvector(*(const vsbyte *)p, vshort) << 7) & (int16_t)0xbfff;
#if LANES == 16
    return (vfloat)_mm512_cvtph_ps((__m256i)bits);
#else
    return (vfloat)_mm256_cvtph_ps((__m128i)bits);
#endif
}
#else
/* LANES e4m3 bytes as float32, exactly: a normal byte's exponent and mantissa moved into float32's fields with the
 * bias corrected (+120), a subnormal one (exponent 0) as mantissa x 2^-9, without float32 subnormals. */
#define FP8_LOAD_FACTOR 1.0f
static inline vfloat load_fp8(const uint8_t *p) {
    const vint b = __builtin_convertvector(*(const vbyte *)p, vint);
    const vint mag = b & 0x7f, subnormal = mag < 8;
    const vint tiny = (vint)(__builtin_convertvector(mag, vfloat) * (1.0f / 512.0f));
    return (vfloat)((((mag << 20) + (120 << 23)) & ~subnormal) | (tiny & subnormal) | ((b & 0x80) << 24));
}
#endif

/* A tile of e4m3 key rows (n bytes, n a multiple of LANES) widened once, as load_fp8, into `tile`: the dot products
 * then read it for every query head of the KV head (widening per query head cost G times the conversions). */
static inline const float *fp8_rows_f32(const uint8_t *src, float *tile, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) *(vfloat *)(tile + i) = load_fp8(src + i);
    return tile;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 32 e4m3 bytes as bfloat16 values 2^8 times theirs (FP8_BF16_FACTOR undoes it), exactly, for the bf16 dot products:
 * a normal byte's exponent and mantissa shifted into bfloat16's fields under exponent bit 7 (bias 127 against 7, plus
 * 8), its sign from the sign-extended byte; a subnormal one (exponent 0: mantissa x 2^-9) from an 8-entry table.
 * Every value stays a bfloat16 normal (the dot products read subnormals as zero). */
#define FP8_BF16_FACTOR (1.0f / 256.0f)
static const uint16_t FP8_SUBNORMAL_BF16[32] __attribute__((aligned(64))) = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4020, 0x4040, 0x4060};  /* m x 2^-9 x 2^8 = m / 2 */
static inline __m512i fp8_to_bf16(const uint8_t *p, __m512i subnormal_table) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));  /* sign in bits 7-15 */
    const __m512i sign = _mm512_set1_epi16((short)0x8000);
    /* (w << 4) & 0x87f0 | 0x4000: sign, exponent + 128, mantissa */
    __m512i bits = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 4), _mm512_set1_epi16((short)0x87f0),
                                             _mm512_set1_epi16(0x4000), 0xea);
    const __mmask32 subnormal = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
    bits = _mm512_mask_permutexvar_epi16(bits, subnormal, w, subnormal_table);  /* index: w's low 5 bits, m here */
    return _mm512_ternarylogic_epi32(bits, w, sign, 0xf8);  /* bits | (w & 0x8000) */
}

static inline __m512i fp8_subnormal_table(void) { return _mm512_load_si512((const void *)FP8_SUBNORMAL_BF16); }

static inline const uint16_t *fp8_rows_bf16(const uint8_t *src, uint16_t *tile, int64_t n, __m512i table) {
    for (int64_t i = 0; i < n; i += 32) _mm512_storeu_si512((void *)(tile + i), fp8_to_bf16(src + i, table));
    return tile;
}
#endif

#if LANES == 8
/* r[i] = the sum of v[i]'s lanes, for 8 vectors at once: three levels of pairing halves. */
static inline vfloat lane_sums(const vfloat v[LANES]) {
    vfloat x[4], y[2];
    for (int i = 0; i < 4; i++)  /* x[i]: 4 partial sums of v[2i], then 4 of v[2i+1] */
        x[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)  /* y[i]: 2 partial sums each of v[4i .. 4i+3] */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
/* r[i] = the sum of v[i]'s lanes, for 16 vectors at once: four levels of pairing halves. */
static inline vfloat lane_sums(const vfloat v[LANES]) {
    vfloat w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  /* w[i]: 8 partial sums of v[2i], then 8 of v[2i+1] */
        w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)  /* x[i]: 4 partial sums each of v[4i .. 4i+3] */
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)  /* y[i]: 2 partial sums each of v[8i .. 8i+7] */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += CACHE_LINE) __builtin_prefetch((const char *)p + i, 0, PREFETCH_LEVEL);
}

/* Lane partials of q . k for one key row, DV vectors of q (float32, in registers) against k. */
#define DOT_WIDE(LOAD)                                                                                            \
    vfloat part = qv[j][0] * LOAD(krow);                                                                          \
    for (int c = 1; c < dv; c++) part += qv[j][c] * LOAD(krow + c * LANES);

#if defined(__AVX512BF16__)
/* bfloat16 q . k as bf16 dot products: each pair of products exact, summed in float32. */
#define DOT_BF16_NATIVE                                                                                           \
    __m512 acc16 = _mm512_setzero_ps();                                                                           \
    for (int c = 0; c < dv / 2; c++) {                                                                            \
        __m512i kbits = _mm512_loadu_si512((const void *)(krow + c * 2 * LANES));                                 \
        acc16 = _mm512_dpbf16_ps(acc16, qbf[j][c], (__m512bh)kbits);                                              \
    }                                                                                                             \
    vfloat part = (vfloat)acc16;
#define QBF_DECL __m512bh qbf[HG][dv / 2 > 0 ? dv / 2 : 1];
#define QBF_LOAD(src, j)                                                                                          \
    for (int c = 0; c < dv / 2; c++) qbf[j][c] = (__m512bh)_mm512_loadu_si512((const void *)((src) + c * 2 * LANES));
#endif

/* The vector kernel for head_dim = DV * LANES. DOT: a key row's lane partials (`part`) against query head j.
 * A task is one sequence's KV heads [h0, h0 + hc): with many sequences all of them (hc = Hkv), walked block by
 * block together, so their scattered blocks stream from memory side by side; with few, one head each, so every
 * thread has work. A head's arithmetic is the same either way. */
#define PAGED_DECODE_VEC(NAME, T, TK, KT, DV, LOAD, VROW, KFACTOR, VFACTOR, KTILE, KROWS, DOT, QDECL, QLOAD,      \
                         STORE, OUT_DIM)                                                                          \
static void NAME(const T *q, int64_t q_stride, const TK *k, const TK *v, const int32_t *tables,                  \
                 int64_t table_stride, int64_t first_block, const int32_t *ctx, T *out, float *lse, int64_t S,    \
                 int64_t Hkv, int64_t G, int64_t NB, int64_t BS, float scale, const float *k_scale,               \
                 const float *v_scale, int threads) {                                                             \
    const int dv = DV;                                                                                            \
    const int64_t D = DV * LANES, row_bytes = D * (int64_t)sizeof(TK);                                            \
    const int64_t hc = S >= HEADS_TOGETHER_MIN * threads ? Hkv : 1, tasks = S * (Hkv / hc);                      \
    _Pragma("omp parallel num_threads(threads)")                                                                  \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                                   \
        for (int64_t task = 0; task < tasks; task++) {                                                            \
            const int64_t s = task / (Hkv / hc), h0 = task % (Hkv / hc) * hc, HG = hc * G;                        \
            vfloat qv[HG][DV], acc[HG][DV];                                                                       \
            float m[HG], l[HG], p[HG][LANES];                                                                     \
            QDECL                                                                                                 \
            KTILE                                                                                                 \
            for (int64_t j = 0; j < HG; j++) {                                                                    \
                const T *qj = q + s * q_stride + (h0 * G + j) * D;                                                \
                for (int c = 0; c < DV; c++) { qv[j][c] = LOAD(qj + c * LANES); acc[j][c] = (vfloat){0}; }        \
                QLOAD(qj, j)                                                                                      \
                m[j] = -INFINITY;                                                                                 \
                l[j] = 0.0f;                                                                                      \
            }                                                                                                     \
            const int64_t n = ctx[s], blocks = (n + BS - 1) / BS;                                                 \
            const int32_t *table = tables + s * table_stride + first_block;                                       \
            for (int64_t b = 1; b < PREFETCH_DISTANCE && b < blocks; b++)                                         \
                for (int64_t h = h0; h < h0 + hc; h++) {                                                          \
                    prefetch(k + (h * NB + table[b]) * BS * D, BS * row_bytes);                                   \
                    prefetch(v + (h * NB + table[b]) * BS * D, BS * row_bytes);                                   \
                }                                                                                                 \
            for (int64_t b = 0; b < blocks; b++) {                                                                \
                const int64_t tokens = n - b * BS < BS ? n - b * BS : BS;                                         \
                const int64_t next = b + PREFETCH_DISTANCE < blocks ? b + PREFETCH_DISTANCE : b;                  \
                for (int64_t h = h0; h < h0 + hc; h++) {                                                          \
                    const TK *kb = k + (h * NB + table[b]) * BS * D, *vb = v + (h * NB + table[b]) * BS * D;      \
                    const TK *kn = k + (h * NB + table[next]) * BS * D, *vn = v + (h * NB + table[next]) * BS * D;\
                    const float head_scale = k_scale ? scale * (k_scale[h] * KFACTOR) : scale;                    \
                    for (int64_t t0 = 0; t0 < tokens; t0 += LANES) {                                              \
                        const int64_t count = tokens - t0 < LANES ? tokens - t0 : LANES;                          \
                        const KT *krows = KROWS(kb + t0 * D, count);                                              \
                        for (int64_t j = (h - h0) * G; j < (h - h0 + 1) * G; j++) {                               \
                            vfloat parts[LANES];                                                                  \
                            for (int64_t t = 0; t < LANES; t++) {                                                 \
                                if (t >= count) { parts[t] = (vfloat){0}; continue; }                             \
                                const KT *krow = krows + t * D;                                                   \
                                DOT                                                                               \
                                parts[t] = part;                                                                  \
                            }                                                                                     \
                            const vfloat scores = lane_sums(parts) * head_scale;                                  \
                            float top = m[j], sum = 0.0f, *pj = p[j];                                             \
                            for (int64_t t = 0; t < count; t++) top = scores[t] > top ? scores[t] : top;          \
                            for (int64_t t = 0; t < LANES; t++) {                                                 \
                                pj[t] = t < count ? exp_fast(scores[t] - top) : 0.0f;                             \
                                sum += pj[t];                                                                     \
                            }                                                                                     \
                            const float keep = exp_fast(m[j] - top);                                              \
                            l[j] = l[j] * keep + sum;                                                             \
                            m[j] = top;                                                                           \
                            for (int c = 0; c < DV; c++) acc[j][c] *= keep;                                       \
                        }                                                                                         \
                        for (int64_t t = 0; t < count; t++) {                                                     \
                            const TK *vrow = vb + (t0 + t) * D;                                                   \
                            if (next != b) {  /* one key and one value row per row used: no burst to stall on */  \
                                prefetch(kn + (t0 + t) * D, row_bytes);                                           \
                                prefetch(vn + (t0 + t) * D, row_bytes);                                           \
                            }                                                                                     \
                            vfloat row[DV];                                                                       \
                            VROW(row, vrow)                                                                       \
                            for (int64_t j = (h - h0) * G; j < (h - h0 + 1) * G; j++)                             \
                                for (int c = 0; c < DV; c++) acc[j][c] += p[j][t] * row[c];                       \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
            for (int64_t j = 0; j < HG; j++) {                                                                    \
                T *o = out + s * Hkv * G * D + (h0 * G + j) * D;                                                  \
                float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;                                                     \
                if (v_scale) inv *= v_scale[h0 + j / G] * VFACTOR;                                                \
                for (int c = 0; c < DV; c++)                                                                      \
                    for (int i = 0; i < LANES; i++) STORE(o + OUT_DIM(c, i), acc[j][c][i] * inv);                 \
                if (lse) lse[s * Hkv * G + h0 * G + j] = l[j] > 0.0f ? m[j] + logf(l[j]) : -INFINITY;             \
            }                                                                                                     \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

#define NO_QDECL
#define NO_QLOAD(src, j)
#define NO_TILE
#define ROWS_IN_POOL(src, count) (src)
#define F32_TILE float ktile[LANES * D];
#define FP8_ROWS_F32(src, count) fp8_rows_f32(src, ktile, (count) * D)
#define BF16_TILE uint16_t ktile[LANES * D]; const __m512i subnormal_table = fp8_subnormal_table();
#define FP8_ROWS_BF16(src, count) fp8_rows_bf16(src, ktile, (count) * D, subnormal_table)
#define DOT_F32 DOT_WIDE(load_f32)
#define DOT_BF16_WIDE DOT_WIDE(load_bf16)
/* A value row as dv float32 vectors, and where lane i of vector c belongs in the output row. */
#define VROW_F32(row, src) for (int c = 0; c < dv; c++) row[c] = load_f32(src + c * LANES);
#define VROW_BF16(row, src) for (int c = 0; c < dv; c++) row[c] = load_bf16(src + c * LANES);
#define VROW_FP8(row, src) for (int c = 0; c < dv; c++) row[c] = load_fp8(src + c * LANES);
#define IN_ORDER(c, i) ((c) * LANES + (i))
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 32 e4m3 values at a time widened to bfloat16 (2^8 times theirs), then to float32 by halves of each 32-bit lane:
 * even dimensions in vector 2c, odd ones in 2c + 1 (EVEN_ODD puts them back in order at the output). */
#define VROW_FP8_PAIRS(row, src)                                                                                  \
    for (int c = 0; c < dv / 2; c++) {                                                                            \
        const __m512i pair = fp8_to_bf16(src + c * 2 * LANES, subnormal_table);                                   \
        row[2 * c] = (vfloat)_mm512_slli_epi32(pair, 16);                                                         \
        row[2 * c + 1] = (vfloat)_mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u));                    \
    }
#define EVEN_ODD(c, i) ((c) / 2 * 2 * LANES + 2 * (i) + (c) % 2)
#endif

/* Blocks of the queries' dtype, read in place. */
#define PLAIN(NAME, T, DV, LOAD, VROW, DOT, QDECL, QLOAD, STORE)                                                  \
    PAGED_DECODE_VEC(NAME, T, T, T, DV, LOAD, VROW, 1.0f, 1.0f, NO_TILE, ROWS_IN_POOL, DOT, QDECL, QLOAD, STORE, \
                     IN_ORDER)
PLAIN(decode_f32_d16, float, 16 / LANES, load_f32, VROW_F32, DOT_F32, NO_QDECL, NO_QLOAD, f32_put)
PLAIN(decode_f32_d32, float, 32 / LANES, load_f32, VROW_F32, DOT_F32, NO_QDECL, NO_QLOAD, f32_put)
PLAIN(decode_f32_d64, float, 64 / LANES, load_f32, VROW_F32, DOT_F32, NO_QDECL, NO_QLOAD, f32_put)
PLAIN(decode_f32_d128, float, 128 / LANES, load_f32, VROW_F32, DOT_F32, NO_QDECL, NO_QLOAD, f32_put)
PLAIN(decode_f32_d256, float, 256 / LANES, load_f32, VROW_F32, DOT_F32, NO_QDECL, NO_QLOAD, f32_put)
PLAIN(decode_bf16_d16, uint16_t, 16 / LANES, load_bf16, VROW_BF16, DOT_BF16_WIDE, NO_QDECL, NO_QLOAD, bf16_put)
#if defined(__AVX512BF16__)
PLAIN(decode_bf16_d32, uint16_t, 2, load_bf16, VROW_BF16, DOT_BF16_NATIVE, QBF_DECL, QBF_LOAD, bf16_put)
PLAIN(decode_bf16_d64, uint16_t, 4, load_bf16, VROW_BF16, DOT_BF16_NATIVE, QBF_DECL, QBF_LOAD, bf16_put)
PLAIN(decode_bf16_d128, uint16_t, 8, load_bf16, VROW_BF16, DOT_BF16_NATIVE, QBF_DECL, QBF_LOAD, bf16_put)
PLAIN(decode_bf16_d256, uint16_t, 16, load_bf16, VROW_BF16, DOT_BF16_NATIVE, QBF_DECL, QBF_LOAD, bf16_put)
#else
PLAIN(decode_bf16_d32, uint16_t, 32 / LANES, load_bf16, VROW_BF16, DOT_BF16_WIDE, NO_QDECL, NO_QLOAD, bf16_put)
PLAIN(decode_bf16_d64, uint16_t, 64 / LANES, load_bf16, VROW_BF16, DOT_BF16_WIDE, NO_QDECL, NO_QLOAD, bf16_put)
PLAIN(decode_bf16_d128, uint16_t, 128 / LANES, load_bf16, VROW_BF16, DOT_BF16_WIDE, NO_QDECL, NO_QLOAD, bf16_put)
PLAIN(decode_bf16_d256, uint16_t, 256 / LANES, load_bf16, VROW_BF16, DOT_BF16_WIDE, NO_QDECL, NO_QLOAD, bf16_put)
#endif

/* FP8 blocks: each tile of key rows widened once to float32 (float32 dot products), values as they are read. */
#define FP8_WIDE(NAME, T, DV, LOAD, STORE)                                                                        \
    PAGED_DECODE_VEC(NAME, T, uint8_t, float, DV, LOAD, VROW_FP8, FP8_LOAD_FACTOR, FP8_LOAD_FACTOR, F32_TILE,    \
                     FP8_ROWS_F32, DOT_F32, NO_QDECL, NO_QLOAD, STORE, IN_ORDER)
FP8_WIDE(decode_fp8_f32_d16, float, 16 / LANES, load_f32, f32_put)
FP8_WIDE(decode_fp8_f32_d32, float, 32 / LANES, load_f32, f32_put)
FP8_WIDE(decode_fp8_f32_d64, float, 64 / LANES, load_f32, f32_put)
FP8_WIDE(decode_fp8_f32_d128, float, 128 / LANES, load_f32, f32_put)
FP8_WIDE(decode_fp8_f32_d256, float, 256 / LANES, load_f32, f32_put)
FP8_WIDE(decode_fp8_bf16_d16, uint16_t, 16 / LANES, load_bf16, bf16_put)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 queries: key tiles widened to bfloat16 (exact), scored by the bf16 dot products as bfloat16 blocks are. */
#define FP8_BF16(NAME, DV)                                                                                        \
    PAGED_DECODE_VEC(NAME, uint16_t, uint8_t, uint16_t, DV, load_bf16, VROW_FP8_PAIRS, FP8_BF16_FACTOR,           \
                     FP8_BF16_FACTOR, BF16_TILE, FP8_ROWS_BF16, DOT_BF16_NATIVE, QBF_DECL, QBF_LOAD, bf16_put,     \
                     EVEN_ODD)
FP8_BF16(decode_fp8_bf16_d32, 2)
FP8_BF16(decode_fp8_bf16_d64, 4)
FP8_BF16(decode_fp8_bf16_d128, 8)
FP8_BF16(decode_fp8_bf16_d256, 16)
#else
FP8_WIDE(decode_fp8_bf16_d32, uint16_t, 32 / LANES, load_bf16, bf16_put)
FP8_WIDE(decode_fp8_bf16_d64, uint16_t, 64 / LANES, load_bf16, bf16_put)
FP8_WIDE(decode_fp8_bf16_d128, uint16_t, 128 / LANES, load_bf16, bf16_put)
FP8_WIDE(decode_fp8_bf16_d256, uint16_t, 256 / LANES, load_bf16, bf16_put)
#endif

/* A row of D values as float32: float32 rows are read in place, bfloat16 rows are widened into `tmp`. */
static inline const float *f32_row(const float *src, float *tmp, int64_t D) { (void)tmp; (void)D; return src; }

static inline const float *bf16_row(const uint16_t *src, float *tmp, int64_t D) {
    for (int64_t i = 0; i < D; i++) tmp[i] = bf16_get(src + i);
    return tmp;
}

static inline float fp8_get(const uint8_t *p) {  /* one e4m3 byte, as load_fp8 */
    const uint32_t mag = *p & 0x7fu;
    union { uint32_t u; float f; } normal = { .u = (mag << 20) + (120u << 23) };
    const float value = mag < 8 ? (float)mag * (1.0f / 512.0f) : normal.f;
    return *p & 0x80u ? -value : value;
}

static inline const float *fp8_row(const uint8_t *src, float *tmp, int64_t D) {
    for (int64_t i = 0; i < D; i++) tmp[i] = fp8_get(src + i);
    return tmp;
}

/* The scalar kernel, for any head_dim. Per (sequence, KV head): each key and value row is read (and widened)
 * once for the G query heads that share it; scores of a block first, then one online-softmax rescale per block
 * and query head. */
#define PAGED_DECODE_ANY(NAME, T, TK, ROW, KROW, STORE)                                                           \
static void NAME(const T *q, int64_t q_stride, const TK *k, const TK *v, const int32_t *tables,                  \
                 int64_t table_stride, int64_t first_block, const int32_t *ctx, T *out, float *lse, int64_t S,    \
                 int64_t Hkv, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale, const float *k_scale,    \
                 const float *v_scale, int threads) {                                                             \
    _Pragma("omp parallel num_threads(threads)")                                                                  \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for collapse(2) schedule(dynamic, 4)")                                                       \
        for (int64_t s = 0; s < S; s++) {                                                                         \
            for (int64_t h = 0; h < Hkv; h++) {                                                                   \
                float m[G], l[G], acc[G * D], qf[G * D], row[D], scores[G * BS];                                  \
                for (int64_t j = 0; j < G; j++) { m[j] = -INFINITY; l[j] = 0.0f; }                                \
                memset(acc, 0, sizeof(float) * G * D);                                                            \
                const float head_scale = k_scale ? scale * k_scale[h] : scale;                                    \
                for (int64_t j = 0; j < G; j++) {                                                                 \
                    const float *qj = ROW(q + s * q_stride + (h * G + j) * D, row, D);                            \
                    for (int64_t i = 0; i < D; i++) qf[j * D + i] = qj[i] * head_scale;                           \
                }                                                                                                 \
                const int64_t n = ctx[s];                                                                         \
                for (int64_t b = 0; b * BS < n; b++) {                                                            \
                    const int64_t block = tables[s * table_stride + first_block + b];                             \
                    const TK *kb = k + (h * NB + block) * BS * D, *vb = v + (h * NB + block) * BS * D;            \
                    const int64_t tokens = n - b * BS < BS ? n - b * BS : BS;                                     \
                    for (int64_t t = 0; t < tokens; t++) {                                                        \
                        const float *kt = KROW(kb + t * D, row, D);                                               \
                        for (int64_t j = 0; j < G; j++) {                                                         \
                            const float *qj = qf + j * D;                                                         \
                            float dot = 0.0f;                                                                     \
                            for (int64_t i = 0; i < D; i++) dot += qj[i] * kt[i];                                 \
                            scores[j * BS + t] = dot;                                                             \
                        }                                                                                         \
                    }                                                                                             \
                    for (int64_t j = 0; j < G; j++) {                                                             \
                        float *sj = scores + j * BS, top = m[j];                                                  \
                        for (int64_t t = 0; t < tokens; t++) top = sj[t] > top ? sj[t] : top;                     \
                        const float keep = exp_fast(m[j] - top);                                                  \
                        float sum = 0.0f;                                                                         \
                        for (int64_t t = 0; t < tokens; t++) { sj[t] = exp_fast(sj[t] - top); sum += sj[t]; }     \
                        l[j] = l[j] * keep + sum;                                                                 \
                        m[j] = top;                                                                               \
                        if (keep != 1.0f) for (int64_t i = 0; i < D; i++) acc[j * D + i] *= keep;                 \
                    }                                                                                             \
                    for (int64_t t = 0; t < tokens; t++) {                                                        \
                        const float *vt = KROW(vb + t * D, row, D);                                               \
                        for (int64_t j = 0; j < G; j++) {                                                         \
                            const float p = scores[j * BS + t];                                                   \
                            float *aj = acc + j * D;                                                              \
                            for (int64_t i = 0; i < D; i++) aj[i] += p * vt[i];                                   \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
                for (int64_t j = 0; j < G; j++) {                                                                 \
                    T *o = out + ((s * Hkv + h) * G + j) * D;                                                     \
                    float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;                                                 \
                    if (v_scale) inv *= v_scale[h];                                                               \
                    for (int64_t i = 0; i < D; i++) STORE(o + i, acc[j * D + i] * inv);                           \
                    if (lse) lse[(s * Hkv + h) * G + j] = l[j] > 0.0f ? m[j] + logf(l[j]) : -INFINITY;            \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
}

PAGED_DECODE_ANY(decode_f32_any, float, float, f32_row, f32_row, f32_put)
PAGED_DECODE_ANY(decode_bf16_any, uint16_t, uint16_t, bf16_row, bf16_row, bf16_put)
PAGED_DECODE_ANY(decode_fp8_f32_any, float, uint8_t, f32_row, fp8_row, f32_put)
PAGED_DECODE_ANY(decode_fp8_bf16_any, uint16_t, uint8_t, bf16_row, fp8_row, bf16_put)

#define PAGED_DECODE(NAME, T, TK, SUFFIX)                                                                         \
void NAME(const T *q, int64_t q_stride, const TK *k, const TK *v, const int32_t *tables, int64_t table_stride,    \
          int64_t first_block, const int32_t *ctx, T *out, float *lse, int64_t S, int64_t Hkv, int64_t G, int64_t D, \
          int64_t NB, int64_t BS, float scale, const float *k_scale, const float *v_scale, int threads) {         \
    void (*vector)(const T *, int64_t, const TK *, const TK *, const int32_t *, int64_t, int64_t, const int32_t *,\
                   T *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, float, const float *, const float *, \
                   int) =                                                                                         \
        D == 16 ? decode_##SUFFIX##_d16 : D == 32 ? decode_##SUFFIX##_d32 : D == 64 ? decode_##SUFFIX##_d64        \
        : D == 128 ? decode_##SUFFIX##_d128 : D == 256 ? decode_##SUFFIX##_d256 : NULL;                                                               \
    if (vector)                                                                                                   \
        vector(q, q_stride, k, v, tables, table_stride, first_block, ctx, out, lse, S, Hkv, G, NB, BS, scale,     \
               k_scale, v_scale, threads);                                                                        \
    else                                                                                                          \
        decode_##SUFFIX##_any(q, q_stride, k, v, tables, table_stride, first_block, ctx, out, lse, S, Hkv, G, D,  \
                              NB, BS, scale, k_scale, v_scale, threads);                                          \
}

PAGED_DECODE(paged_decode_f32, float, float, f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, uint16_t, bf16)
PAGED_DECODE(paged_decode_fp8_f32, float, uint8_t, fp8_f32)
PAGED_DECODE(paged_decode_fp8_bf16, uint16_t, uint8_t, fp8_bf16)

#define WRITE_KV(NAME, T)                                                                                         \
void NAME(const T *k_src, const T *v_src, int64_t src_stride, T *k, T *v, const int64_t *slots, int64_t tokens,  \
          int64_t Hkv, int64_t D, int64_t pool_slots, int threads) {                                              \
    _Pragma("omp parallel for num_threads(threads) if(tokens >= 64)")                                             \
    for (int64_t i = 0; i < tokens; i++) {                                                                        \
        for (int64_t h = 0; h < Hkv; h++) {                                                                       \
            memcpy(k + (h * pool_slots + slots[i]) * D, k_src + i * src_stride + h * D, D * sizeof(T));           \
            memcpy(v + (h * pool_slots + slots[i]) * D, v_src + i * src_stride + h * D, D * sizeof(T));           \
        }                                                                                                         \
    }                                                                                                             \
}

WRITE_KV(write_kv_f32, float)
WRITE_KV(write_kv_bf16, uint16_t)

/* x (already divided by its scale) as an e4m3 byte: saturated at +-448, rounded to nearest even (torch's
 * `.clamp(-448, 448).to(torch.float8_e4m3fn)`); NaN stays NaN. */
static inline uint8_t fp8_put(float x) {
    union { float f; uint32_t u; } v = { .f = x };
    const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (!(a <= 448.0f)) return a > 448.0f ? sign | 0x7e : 0x7f;
    if (a < 0.015625f) return sign | (uint8_t)rintf(a * 512.0f);  /* subnormal: m x 2^-9 (8 is the smallest normal) */
    v.f = a;
    v.u += 0x7ffffu + ((v.u >> 20) & 1u);  /* round the mantissa to 3 bits, to nearest even */
    return sign | (uint8_t)((v.u >> 20) - (120u << 3));
}

#define WRITE_KV_FP8(NAME, T, GET)                                                                                \
void NAME(const T *k_src, const T *v_src, int64_t src_stride, uint8_t *k, uint8_t *v, const int64_t *slots,      \
          int64_t tokens, int64_t Hkv, int64_t D, int64_t pool_slots, const float *k_scale, const float *v_scale, \
          int threads) {                                                                                          \
    _Pragma("omp parallel for num_threads(threads) if(tokens >= 64)")                                             \
    for (int64_t i = 0; i < tokens; i++) {                                                                        \
        for (int64_t h = 0; h < Hkv; h++) {                                                                       \
            const T *ks = k_src + i * src_stride + h * D, *vs = v_src + i * src_stride + h * D;                   \
            uint8_t *kd = k + (h * pool_slots + slots[i]) * D, *vd = v + (h * pool_slots + slots[i]) * D;         \
            for (int64_t d = 0; d < D; d++) {                                                                     \
                kd[d] = fp8_put(GET(ks + d) / k_scale[h]);                                                        \
                vd[d] = fp8_put(GET(vs + d) / v_scale[h]);                                                        \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

WRITE_KV_FP8(write_kv_fp8_f32, float, f32_get)
WRITE_KV_FP8(write_kv_fp8_bf16, uint16_t, bf16_get)
