/* bfloat16 GEMM on Intel AMX tiles for y = x @ w.T (+ bias): the weight prepacked once into 16-column blocks of 32
 * k each (1 KiB, the layout a B tile loads), streamed once per call with software prefetch a few blocks ahead; every
 * output tile sums over k in the same order whatever the number of rows, so a row's result never depends on the
 * rows that came with it (batch-invariant by construction). Rows run in pairs of 16-row tiles over each 32-column
 * slice of the weight (2 x 2 tiles) while that slice is in cache; more than 256 rows take one pass over the weight
 * per 256, so those rows of x stay in L2. Also an encoder's attention on the tiles (amx_packed_attention_bf16).
 * Built without AMX, the functions report it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_math.h"

#define TILE_M 16
#define TILE_N 16
#define TILE_K 32
#define BLOCK_ELEMS (TILE_K * TILE_N)
#define PREFETCH_BLOCKS 8 /* blocks ahead, into L2: prefetched into L1 instead, one block's 16 lines held every L1
                             fill buffer, so a core had one block in flight (a 2-core Xeon: 30 layers at 35 rows
                             18.5 -> 12.6 ms, 64 rows 21.5 -> 14.5) */
#define CHUNK_TILES 16    /* rows per pass over the weight (x 16): a pass's rows of x stay in L2 */

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

/* 1 when this build has the AMX kernel and Linux lets this process use the tiles (asked once per process). */
int amx_gemm_ready(void) {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* w [n, k] row-major -> packed [n / 16][k / 32][16 pairs of k][16 columns][2]; n % 16 == 0, k % 32 == 0. */
void amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t k_blocks = k / TILE_K;
    for (int64_t nb = 0; nb < n / TILE_N; nb++)
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint16_t *block = packed + (nb * k_blocks + kb) * BLOCK_ELEMS;
            for (int64_t pair = 0; pair < TILE_K / 2; pair++)
                for (int64_t col = 0; col < TILE_N; col++)
                    for (int64_t e = 0; e < 2; e++)
                        block[(pair * TILE_N + col) * 2 + e] = w[(nb * TILE_N + col) * k + kb * TILE_K + pair * 2 + e];
        }
}

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3 accumulate (16 x 16 float32), 4-5 hold rows of x, 6-7 weight blocks; all 16 rows of 64 bytes. */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = TILE_M;
    }
    _tile_loadconfig(&config);
}

static inline void prefetch_block(const uint16_t *block) {
    for (int line = 0; line < BLOCK_ELEMS * 2; line += 64) _mm_prefetch((const char *)block + line, _MM_HINT_T1);
}

/* `rows` rows of `cols` float32 sums (row stride ldc) plus bias, rounded to bfloat16 (nearest even) into y. */
static inline void store_rows(const float *c, int64_t ldc, const float *bias, uint16_t *y, int64_t ldy, int64_t rows,
                              int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t col = 0; col < cols; col += 16) {
            __m512 sums = _mm512_loadu_ps(c + r * ldc + col);
            if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias + col));
            _mm256_storeu_si256((__m256i *)(y + r * ldy + col), (__m256i)_mm512_cvtneps_pbh(sums));
        }
}

/* One k block: C tiles 0-1 += x tile a0 by weight blocks b0, b1 (and 2-3 += a1 by them when count == 2). */
static inline void pair_step(const uint16_t *a0, const uint16_t *a1, int count, int64_t stride, const uint16_t *b0,
                             const uint16_t *b1) {
    _tile_loadd(4, a0, stride);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (count == 2) {
        _tile_loadd(5, a1, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* One or two 16-row tiles of x times a 32-column weight slice (blocks b0, b1): C tiles 0-1 (and 2-3). */
static inline void rows2_x_pair(const uint16_t *const a[2], int count, const uint16_t *b0, const uint16_t *b1,
                                int64_t k_blocks, int64_t stride, float *c) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        prefetch_block(b0 + (kb + PREFETCH_BLOCKS) * BLOCK_ELEMS);
        prefetch_block(b1 + (kb + PREFETCH_BLOCKS) * BLOCK_ELEMS);
        pair_step(a[0] + kb * TILE_K, a[1] + kb * TILE_K, count, stride, b0 + kb * BLOCK_ELEMS, b1 + kb * BLOCK_ELEMS);
    }
    _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
}
#endif

/* y [m, n] (row stride n) = x [m, k] @ w.T + bias (float32, or NULL); bfloat16 x and y, w packed by amx_pack_bf16;
 * n % 32 == 0, k % 32 == 0. Threads split the weight's 32-column slices. */
void amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                     int64_t k, int threads) {
#ifdef HAVE_AMX
    const int64_t k_blocks = k / TILE_K, stride = k * 2, slices = n / (2 * TILE_N);
    const int64_t slice_size = 2 * k_blocks * BLOCK_ELEMS;
    const int64_t full = m / TILE_M, tail = m % TILE_M, row_tiles = full + (tail ? 1 : 0);
    uint16_t *padded = NULL; /* the last, partial row tile, zero-filled to 16 rows; the threads share it */
    if (tail) {
        padded = aligned_alloc(64, TILE_M * k * 2);
        memcpy(padded, x + full * TILE_M * k, tail * k * 2);
        memset(padded + tail * k, 0, (TILE_M - tail) * k * 2);
    }
    _Pragma("omp parallel num_threads(threads)")
    {
        KERNEL_BEGIN;
        configure_tiles();
        float c[2 * TILE_M * 2 * TILE_N] __attribute__((aligned(64)));
        for (int64_t chunk = 0; chunk < row_tiles; chunk += CHUNK_TILES) {
            const int64_t chunk_end = chunk + CHUNK_TILES < row_tiles ? chunk + CHUNK_TILES : row_tiles;
            _Pragma("omp for schedule(static)")
            for (int64_t s = 0; s < slices; s++) {
                const uint16_t *b = packed + s * slice_size;
                for (int64_t first = chunk; first < chunk_end; first += 2) {
                    const int count = chunk_end - first < 2 ? 1 : 2;
                    const uint16_t *a[2] = {padded, padded};
                    int64_t rows[2] = {0, 0};
                    for (int i = 0; i < count; i++) {
                        const int64_t tile = first + i;
                        a[i] = tile < full ? x + tile * TILE_M * k : padded;
                        rows[i] = tile < full ? TILE_M : tail;
                    }
                    uint16_t *out = y + first * TILE_M * n + s * 2 * TILE_N;
                    rows2_x_pair(a, count, b, b + k_blocks * BLOCK_ELEMS, k_blocks, stride, c);
                    for (int i = 0; i < count; i++)
                        store_rows(c + i * 512, 2 * TILE_N, bias ? bias + s * 2 * TILE_N : NULL, out + i * TILE_M * n,
                                   n, rows[i], 2 * TILE_N);
                }
            }
        }
        _tile_release();
        KERNEL_END;
    }
    free(padded);
#endif
}

/* float32 GEMMs on the bfloat16 tiles, as exact splits: every float32 is the sum of `parts` bfloat16 numbers (hi, then
 * what hi left, ...: 3 parts hold all 24 bits of its significand) and x @ w.T is the sum of the products of parts
 * whose order adds up to at most parts - 1 (0 = hi). Products of bfloat16s are exact in float32 and the tiles sum
 * in float32, so 3 parts (6 products) are as accurate as a float32 GEMM: each product loses what lies below
 * 2^-24 of it; 2 parts (3 products) keep about 16 bits, PyTorch's "high" float32 matmul precision. */

/* x [m, k] float32 -> parts [m][parts][k] bfloat16, each part the nearest bfloat16 to what the ones before left. */
void amx_split_f32(const float *x, uint16_t *out, int64_t m, int64_t k, int parts, int threads) {
#ifdef HAVE_AMX
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t r = 0; r < m; r++)
        for (int64_t col = 0; col < k; col += 16) {
            __m512 rest = _mm512_loadu_ps(x + r * k + col);
            for (int p = 0; p < parts; p++) {
                const __m256i part = (__m256i)_mm512_cvtneps_pbh(rest);
                _mm256_storeu_si256((__m256i *)(out + (r * parts + p) * k + col), part);
                rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part), 16)));
            }
        }
#endif
}

#define SPLIT_CHUNK_BYTES (1 << 19) /* what one pass over the weight keeps in L2: a chunk's rows of x or their sums */
#define SPLIT_K_BLOCKS 12 /* k blocks per pass over a chunk's rows: that much of a weight slice, 24 KiB, stays in L1 */

#ifdef HAVE_AMX
/* C tiles 0-3 for a pair of row tiles (a[1] unused when count == 1) by a 32-column slice (b0, b1), over `blocks`
 * k blocks: started from the bias (or zero) on the first pass, else from the sums in c[i] (row stride ldc
 * floats), and stored back there. */
static inline void split_tiles(const uint16_t *const a[2], int count, int64_t a_stride, const uint16_t *b0,
                               const uint16_t *b1, int64_t blocks, int first, const float *bias, float *const c[2],
                               int64_t ldc) {
    if (first && bias) { /* stride 0: the bias row in all 16 rows */
        _tile_loadd(0, bias, 0); _tile_loadd(1, bias + 16, 0); _tile_loadd(2, bias, 0); _tile_loadd(3, bias + 16, 0);
    } else if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, c[0], ldc * 4); _tile_loadd(1, c[0] + 16, ldc * 4);
        _tile_loadd(2, c[1], ldc * 4); _tile_loadd(3, c[1] + 16, ldc * 4);
    }
    for (int64_t kb = 0; kb < blocks; kb++) {
        pair_step(a[0] + kb * TILE_K, a[1] + kb * TILE_K, count, a_stride, b0 + kb * BLOCK_ELEMS,
                  b1 + kb * BLOCK_ELEMS);
    }
    _tile_stored(0, c[0], ldc * 4); _tile_stored(1, c[0] + 16, ldc * 4);
    if (count == 2) { _tile_stored(2, c[1], ldc * 4); _tile_stored(3, c[1] + 16, ldc * 4); }
}
#endif

#ifdef HAVE_AMX
typedef struct {
    const uint16_t *x, *a_tail, *packed;
    const int32_t *x_part;
    const float *bias;
    float *y, *c_tail;
    int64_t n, k, k_blocks, width, full, terms;
} split_gemm;

/* Rows tiles [first_tile, end_tile) by slice s over segment t's k blocks [kb0, kb0 + SPLIT_K_BLOCKS). */
static void split_pass(const split_gemm *g, int64_t s, int t, int64_t kb0, int64_t first_tile, int64_t end_tile) {
    const int64_t blocks = g->k_blocks - kb0 < SPLIT_K_BLOCKS ? g->k_blocks - kb0 : SPLIT_K_BLOCKS;
    const int64_t block = (t * g->k_blocks + kb0) * BLOCK_ELEMS;
    const uint16_t *b0 = g->packed + s * 2 * g->terms * g->k * TILE_N + block;
    const uint16_t *b1 = b0 + g->terms * g->k * TILE_N;
    for (int64_t tile = first_tile; tile < end_tile; tile += 2) {
        const int count = end_tile - tile < 2 ? 1 : 2;
        const uint16_t *a[2];
        float *c[2];
        for (int i = 0; i < 2; i++) {
            const int64_t row_tile = tile + (i < count ? i : 0);
            a[i] = (row_tile < g->full ? g->x + row_tile * TILE_M * g->width : g->a_tail) + g->x_part[t] * g->k
                   + kb0 * TILE_K;
            c[i] = (row_tile < g->full ? g->y + row_tile * TILE_M * g->n : g->c_tail) + s * 2 * TILE_N;
        }
        split_tiles(a, count, g->width * 2, b0, b1, blocks, t == 0 && kb0 == 0,
                    g->bias ? g->bias + s * 2 * TILE_N : NULL, c, g->n);
    }
}
#endif

/* y [m, n] float32 = x @ w.T + bias (float32, or NULL) from x split by amx_split_f32 into `parts` ([m][parts][k])
 * and the weight packed by amx_pack_bf16 as `terms` segments of k along its depth, segment t holding the weight's
 * part that multiplies x's part x_part[t]; n % 32 == 0, k % 32 == 0. Rows go in chunks, each a pass over the
 * weight: a slice of the weight at a time over all its depth while the chunk's parts stay in cache, or, where more
 * rows fit that way (a wide k and a narrow n), a depth range at a time over all slices while the chunk's sums stay
 * in cache. Every output sums its segments and blocks in one order at any m. Threads split the 32-column slices. */
void amx_linear_split_f32(const uint16_t *x, const uint16_t *packed, const int32_t *x_part, int terms, int parts,
                          const float *bias, float *y, int64_t m, int64_t n, int64_t k, int threads) {
#ifdef HAVE_AMX
    const int64_t k_blocks = k / TILE_K, width = parts * k, slices = n / (2 * TILE_N);
    const int64_t full = m / TILE_M, tail = m % TILE_M, row_tiles = full + (tail ? 1 : 0);
    const int64_t by_slice = SPLIT_CHUNK_BYTES / (TILE_M * width * 2);
    const int64_t by_depth = SPLIT_CHUNK_BYTES / (TILE_M * (n * 4 + SPLIT_K_BLOCKS * TILE_K * 2));
    const int depth_outer = by_depth > by_slice;
    int64_t chunk_tiles = (depth_outer ? by_depth : by_slice) / 2 * 2;
    if (chunk_tiles < 2) chunk_tiles = 2;
    uint16_t *a_tail = NULL; /* the partial last row tile, zero-filled to 16 rows, and its sums */
    float *c_tail = NULL;
    if (tail) {
        a_tail = aligned_alloc(64, TILE_M * width * 2);
        memcpy(a_tail, x + full * TILE_M * width, tail * width * 2);
        memset(a_tail + tail * width, 0, (TILE_M - tail) * width * 2);
        c_tail = aligned_alloc(64, TILE_M * n * 4);
    }
    const split_gemm g = {x, a_tail, packed, x_part, bias, y, c_tail, n, k, k_blocks, width, full, terms};
    _Pragma("omp parallel num_threads(threads)")
    {
        KERNEL_BEGIN;
        configure_tiles();
        for (int64_t chunk = 0; chunk < row_tiles; chunk += chunk_tiles) {
            const int64_t end = chunk + chunk_tiles < row_tiles ? chunk + chunk_tiles : row_tiles;
            if (depth_outer) {
                for (int t = 0; t < terms; t++)
                    for (int64_t kb0 = 0; kb0 < k_blocks; kb0 += SPLIT_K_BLOCKS) {
                        _Pragma("omp for schedule(static) nowait") /* the same slices every pass */
                        for (int64_t s = 0; s < slices; s++) split_pass(&g, s, t, kb0, chunk, end);
                    }
            } else {
                _Pragma("omp for schedule(static) nowait")
                for (int64_t s = 0; s < slices; s++)
                    for (int t = 0; t < terms; t++)
                        for (int64_t kb0 = 0; kb0 < k_blocks; kb0 += SPLIT_K_BLOCKS) split_pass(&g, s, t, kb0, chunk, end);
            }
        }
        _tile_release();
        KERNEL_END;
    }
    if (tail) memcpy(y + full * TILE_M * n, c_tail, tail * n * 4);
    free(a_tail);
    free(c_tail);
#endif
}

/* An encoder's bidirectional attention over packed rows on the tiles, bfloat16, for head_dim a multiple of 32 (one
 * tile's depth): the same contract as packed_attention_bf16 in encoder_ops.c. Per (row, head): keys packed into B
 * tiles (16 keys by 32 dims, the pairs of dims interleaved), S = Q K^T in 16 x 16 float32 tiles, softmax in float32
 * with the probabilities rounded to bfloat16, values packed into B tiles (16 pairs of keys by 16 dims) and
 * O = P V, divided by the row's sum. Returns 0 (doing nothing) where the build has no AMX. */
int amx_packed_attention_bf16(const uint16_t *qkv, uint16_t *out, const int64_t *starts, const int64_t *lengths,
                              int64_t rows, int64_t longest, int64_t H, int64_t D, float scale, int threads) {
#ifdef HAVE_AMX
    const int64_t width = 3 * H * D, chunks = D / TILE_K, d_tiles = D / TILE_N;
    const int64_t max16 = (longest + 15) / 16 * 16, max32 = (longest + 31) / 32 * 32;
    _Pragma("omp parallel num_threads(threads)")
    {
        KERNEL_BEGIN;
        configure_tiles();
        uint16_t *k_tiles = aligned_alloc(64, (max16 / 16) * chunks * BLOCK_ELEMS * 2);
        uint16_t *v_tiles = aligned_alloc(64, (max32 / 32) * d_tiles * BLOCK_ELEMS * 2);
        uint16_t *p = aligned_alloc(64, max16 * max32 * 2);          /* probabilities, [query][key], bf16 */
        uint16_t *q_tail = aligned_alloc(64, TILE_M * D * 2);        /* a last, partial block of queries */
        float *s = aligned_alloc(64, max16 * max16 * 4);             /* scores, [query][key] */
        float *inv = aligned_alloc(64, max16 * 4), o[TILE_M * TILE_N] __attribute__((aligned(64)));
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < H; h++) {
                const int64_t L = lengths[r], L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
                const uint16_t *base = qkv + starts[r] * width;
                /* keys: tile (key block kb, dim chunk c) as int32 pairs [pair][key] = K[key][pair] */
                for (int64_t kb = 0; kb < L16 / 16; kb++)
                    for (int64_t c = 0; c < chunks; c++) {
                        uint32_t *tile = (uint32_t *)(k_tiles + (kb * chunks + c) * BLOCK_ELEMS);
                        for (int64_t n = 0; n < 16; n++) {
                            const int64_t key = kb * 16 + n;
                            const uint32_t *k = (const uint32_t *)(base + key * width + (H + h) * D + c * TILE_K);
                            for (int64_t pair = 0; pair < 16; pair++) tile[pair * 16 + n] = key < L ? k[pair] : 0;
                        }
                    }
                /* values: tile (key chunk kc, dim tile dt) as [key pair][dim][2]: two keys' rows interleaved */
                for (int64_t kc = 0; kc < L32 / 32; kc++)
                    for (int64_t dt = 0; dt < d_tiles; dt++) {
                        uint16_t *tile = v_tiles + (kc * d_tiles + dt) * BLOCK_ELEMS;
                        for (int64_t pair = 0; pair < 16; pair++) {
                            const int64_t key = kc * 32 + pair * 2;
                            const uint16_t *v = base + key * width + (2 * H + h) * D + dt * TILE_N;
                            const __m256i zero = _mm256_setzero_si256();
                            const __m256i even = key < L ? _mm256_loadu_si256((const __m256i *)v) : zero;
                            const __m256i odd = key + 1 < L ? _mm256_loadu_si256((const __m256i *)(v + width)) : zero;
                            const __m256i low = _mm256_unpacklo_epi16(even, odd);
                            const __m256i high = _mm256_unpackhi_epi16(even, odd);
                            __m256i *row = (__m256i *)(tile + pair * 32);
                            _mm256_storeu_si256(row, _mm256_permute2x128_si256(low, high, 0x20));
                            _mm256_storeu_si256(row + 1, _mm256_permute2x128_si256(low, high, 0x31));
                        }
                    }
                for (int64_t qb = 0; qb < L16 / 16; qb++) {
                    const uint16_t *q = base + qb * 16 * width + h * D;
                    int64_t q_stride = width * 2;
                    if (qb * 16 + 16 > L) { /* rows past the end of the row (maybe of the buffer): zeros */
                        const int64_t n = L - qb * 16;
                        for (int64_t i = 0; i < TILE_M; i++)
                            for (int64_t d = 0; d < D; d++) q_tail[i * D + d] = i < n ? q[i * width + d] : 0;
                        q = q_tail, q_stride = D * 2;
                    }
                    for (int64_t kb = 0; kb < L16 / 16; kb++) {
                        _tile_zero(0);
                        for (int64_t c = 0; c < chunks; c++) {
                            _tile_loadd(4, q + c * TILE_K, q_stride);
                            _tile_loadd(6, k_tiles + (kb * chunks + c) * BLOCK_ELEMS, 64);
                            _tile_dpbf16ps(0, 4, 6);
                        }
                        _tile_stored(0, s + qb * 16 * L16 + kb * 16, L16 * 4);
                    }
                    for (int64_t i = qb * 16; i < qb * 16 + 16; i++) { /* softmax, 16 keys a vector */
                        const float *si = s + i * L16;
                        uint16_t *pi = p + i * L32;
                        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
                        for (int64_t j = 0; j < L16; j += 16) {
                            const __mmask16 real = j + 16 <= L ? 0xffff : (__mmask16)((1u << (L - j)) - 1);
                            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), real, si + j));
                        }
                        const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top)), by = _mm512_set1_ps(scale);
                        for (int64_t j = 0; j < L16; j += 16) {
                            const __mmask16 real = j + 16 <= L ? 0xffff : (__mmask16)((1u << (L - j)) - 1);
                            const __m512 e = _mm512_maskz_mov_ps(real, exp_fast16(_mm512_mul_ps(
                                _mm512_sub_ps(_mm512_loadu_ps(si + j), peak), by)));
                            const __m256bh rounded = _mm512_cvtneps_pbh(e);
                            _mm256_storeu_si256((__m256i *)(pi + j), (__m256i)rounded);
                            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(rounded));
                        }
                        for (int64_t j = L16; j < L32; j += 16)
                            _mm256_storeu_si256((__m256i *)(pi + j), _mm256_setzero_si256());
                        inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
                    }
                    for (int64_t dt = 0; dt < d_tiles; dt++) {
                        _tile_zero(1);
                        for (int64_t kc = 0; kc < L32 / 32; kc++) {
                            _tile_loadd(5, p + qb * 16 * L32 + kc * 32, L32 * 2);
                            _tile_loadd(7, v_tiles + (kc * d_tiles + dt) * BLOCK_ELEMS, 64);
                            _tile_dpbf16ps(1, 5, 7);
                        }
                        _tile_stored(1, o, TILE_N * 4);
                        for (int64_t i = 0; i < 16 && qb * 16 + i < L; i++) {
                            uint16_t *dst = out + (starts[r] + qb * 16 + i) * H * D + h * D + dt * TILE_N;
                            const __m512 row = _mm512_mul_ps(_mm512_load_ps(o + i * TILE_N),
                                                             _mm512_set1_ps(inv[qb * 16 + i]));
                            _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(row));
                        }
                    }
                }
            }
        }
        free(k_tiles); free(v_tiles); free(p); free(q_tail); free(s); free(inv);
        _tile_release();
        KERNEL_END;
    }
    return 1;
#else
    (void)qkv; (void)out; (void)starts; (void)lengths; (void)rows; (void)longest; (void)H; (void)D; (void)scale;
    (void)threads;
    return 0;
#endif
}
