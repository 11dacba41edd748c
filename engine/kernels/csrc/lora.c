/* Multi-LoRA on the CPU: one call adds every row's own adapter to a projection's output for a whole mixed batch
 * (Punica's SGMV): out[t] += (x[t] @ A[s].T) @ B[s] for s = slots[t] >= 0, rows of slot -1 (the base model) left
 * as they are. x and out float32 or bfloat16, rows at any stride; A [S, R, in] and B [S, R, out] float32 (B stored
 * transposed, the scaling folded in). Sums in float32; out's value plus the product rounded to its dtype once.
 *
 * Rows are grouped by slot (a counting sort) into blocks of up to ROWS rows of one slot, so each adapter's A and B
 * are read from memory once per block (about once per call at decode sizes):
 * - shrink: h [rows, R] = x @ A[s].T as dot products, 4 rows against 2 rows of A at a time, the threads splitting
 *   (block, R_CHUNK ranks) tasks;
 * - expand: out += h @ B[s], a block's rows by a tile of columns summed in registers over R, one contiguous load
 *   of each B row's tile serving every row of the block; the threads split the columns.
 * GCC vector extensions (the compiler's vector registers: AVX-512 or AVX2 with -march=native) keep the sums in
 * registers; no intrinsics. Built by engine/kernels/cpu_kernel.py. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "fast_math.h"

#if defined(__AVX512F__)
#define VLEN 16            /* float32 lanes of a vector */
#define TILE_VECS 4        /* vectors per tile row for up to ROWS / 2 rows (half as many past that): 16 sums */
#else
#define VLEN 8
#define TILE_VECS 2        /* 16 registers on AVX2: 8 sums */
#endif
#define ROWS 8             /* rows of one slot per block */
#define R_CHUNK 8          /* ranks per shrink task */
#define PREFETCH_TILES 1   /* the expand prefetches B's rows this many tiles ahead (as many streams as ranks) */
#define PARALLEL_WORK 65536 /* multiply-adds below which one thread does it all */

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

typedef float vec __attribute__((vector_size(VLEN * sizeof(float)), aligned(sizeof(float)), may_alias));

INLINE vec load(const float *p) { return *(const vec *)p; }
INLINE void store(float *p, vec v) { *(vec *)p = v; }
INLINE float lanes_sum(vec v) {
    float sum = 0.0f;
    for (int i = 0; i < VLEN; i++) sum += v[i];
    return sum;
}

typedef struct { int64_t first; int64_t count; int64_t slot; } row_block;

/* Rows grouped by slot (counting sort: `order` lists the rows of slot 0, then 1, ...), cut into blocks of up to
 * ROWS rows of one slot. Returns the number of blocks; rows with a slot outside [0, num_slots) are skipped. */
static int64_t group_rows(const int64_t *slots, int64_t rows, int64_t num_slots, int64_t *order, row_block *blocks,
                          int64_t *active) {
    int64_t *start = calloc((size_t)num_slots + 1, sizeof(int64_t));
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= 0 && slots[t] < num_slots) start[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    *active = start[num_slots];
    int64_t num_blocks = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t p = start[s]; p < start[s + 1]; p += ROWS)
            blocks[num_blocks++] = (row_block){p, MIN(start[s + 1] - p, ROWS), s};
    for (int64_t t = 0; t < rows; t++)  /* start[s]: the next position of slot s */
        if (slots[t] >= 0 && slots[t] < num_slots) order[start[slots[t]]++] = t;
    free(start);
    return num_blocks;
}

/* h[k][r] = x[k] . a[r] for NB rows and ranks r0..r1, two ranks at a time: NB + 2 vector loads for 2 NB
 * multiply-adds. */
INLINE void shrink_rows(const float *const *x, const float *a, int64_t in, int64_t r0, int64_t r1, float *h,
                        int64_t rank, int NB) {
    const float *xk[4];
    for (int k = 0; k < NB; k++) xk[k] = x[k];
    for (int64_t r = r0; r < r1; r += 2) {
        const int pair = r + 1 < r1;
        const float *a0 = a + r * in, *a1 = pair ? a0 + in : a0;
        vec sums[4][2];
        for (int k = 0; k < NB; k++) sums[k][0] = sums[k][1] = (vec){0};
        int64_t i = 0;
        for (; i + VLEN <= in; i += VLEN) {
            const vec v0 = load(a0 + i), v1 = load(a1 + i);
            for (int k = 0; k < NB; k++) {
                const vec xv = load(xk[k] + i);
                sums[k][0] += xv * v0;
                sums[k][1] += xv * v1;
            }
        }
        for (int k = 0; k < NB; k++) {
            float s0 = lanes_sum(sums[k][0]), s1 = lanes_sum(sums[k][1]);
            for (int64_t j = i; j < in; j++) s0 += xk[k][j] * a0[j], s1 += xk[k][j] * a1[j];
            h[k * rank + r] = s0;
            if (pair) h[k * rank + r + 1] = s1;
        }
    }
}

/* A block of up to ROWS rows, 4 at a time (A's rows from L1 the second time). */
static void shrink_block(const float *const *x, const float *a, int64_t in, int64_t r0, int64_t r1, float *h,
                         int64_t rank, int64_t count) {
    for (int64_t k = 0; k < count; k += 4)
        switch (MIN(count - k, 4)) {
        case 4: shrink_rows(x + k, a, in, r0, r1, h + k * rank, rank, 4); break;
        case 3: shrink_rows(x + k, a, in, r0, r1, h + k * rank, rank, 3); break;
        case 2: shrink_rows(x + k, a, in, r0, r1, h + k * rank, rank, 2); break;
        default: shrink_rows(x + k, a, in, r0, r1, h + k * rank, rank, 1); break;
        }
}

/* acc[k][0..NV vectors) = h[k] @ b[:, 0..NV vectors) for NB rows; b: R rows `stride` apart. acc: rows of
 * TILE_VECS vectors. */
INLINE void expand_tile(const float *h, const float *b, int64_t rank, int64_t stride, float *acc, int NB, int NV) {
    vec sums[ROWS][TILE_VECS];
    for (int k = 0; k < NB; k++)
        for (int v = 0; v < NV; v++) sums[k][v] = (vec){0};
    for (int64_t r = 0; r < rank; r++) {
        const float *br = b + r * stride;
        vec bv[TILE_VECS];
        for (int v = 0; v < NV; v++) {
            bv[v] = load(br + v * VLEN);
            if (NV > 1) __builtin_prefetch(br + (PREFETCH_TILES * NV + v) * VLEN);
        }
        for (int k = 0; k < NB; k++) {
            const float hk = h[k * rank + r];
            for (int v = 0; v < NV; v++) sums[k][v] += hk * bv[v];
        }
    }
    for (int k = 0; k < NB; k++)
        for (int v = 0; v < NV; v++) store(acc + (k * TILE_VECS + v) * VLEN, sums[k][v]);
}

#define WIDE(NB) ((NB) > ROWS / 2 ? TILE_VECS / 2 : TILE_VECS)

/* A block's next tile: `narrow`, one vector; else WIDE(count) vectors. */
static void expand_block(const float *h, const float *b, int64_t rank, int64_t stride, float *acc, int64_t count,
                         int narrow) {
#define EXPAND_CASE(NB) case NB: expand_tile(h, b, rank, stride, acc, NB, narrow ? 1 : WIDE(NB)); break;
    switch (count) {
    EXPAND_CASE(8) EXPAND_CASE(7) EXPAND_CASE(6) EXPAND_CASE(5) EXPAND_CASE(4) EXPAND_CASE(3) EXPAND_CASE(2)
    default: expand_tile(h, b, rank, stride, acc, 1, narrow ? 1 : WIDE(1)); break;
    }
#undef EXPAND_CASE
}

/* The last columns, fewer than VLEN. */
static void expand_edge(const float *h, const float *b, int64_t rank, int64_t stride, int64_t width, float *acc,
                        int64_t count) {
    for (int64_t k = 0; k < count; k++)
        for (int64_t j = 0; j < width; j++) acc[k * TILE_VECS * VLEN + j] = 0.0f;
    for (int64_t r = 0; r < rank; r++)
        for (int64_t k = 0; k < count; k++)
            for (int64_t j = 0; j < width; j++) acc[k * TILE_VECS * VLEN + j] += h[k * rank + r] * b[r * stride + j];
}

/* One call: rows grouped by slot; bfloat16 x converted to float32 once; the shrink's tasks split among the threads;
 * then the expand's columns split in chunks of whole vectors (and the blocks too when threads outnumber the
 * vectors), each thread going over its blocks and, for each, over its columns' tiles. */
#define LORA(NAME, T, GET, PUT)                                                                                   \
void NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, const float *lora_a, const float *lora_b,   \
          const int64_t *slots, int64_t rows, int64_t in, int64_t out_features, int64_t rank, int64_t num_slots,  \
          int threads) {                                                                                          \
    if (rows <= 0 || rank <= 0 || num_slots <= 0) return;                                                         \
    int64_t *order = malloc((size_t)rows * sizeof(int64_t)), active;                                              \
    row_block *blocks = malloc((size_t)(rows + num_slots) * sizeof(row_block));                                   \
    const int64_t num_blocks = group_rows(slots, rows, num_slots, order, blocks, &active);                        \
    if (active == 0) {                                                                                            \
        free(blocks);                                                                                             \
        free(order);                                                                                              \
        return;                                                                                                   \
    }                                                                                                             \
    float *h = malloc((size_t)(active * rank) * sizeof(float));                                                   \
    const float **xrows = malloc((size_t)active * sizeof(float *));                                               \
    const int64_t x_row = (in + 15) / 16 * 16; /* converted rows on whole cache lines: unsplit vector loads */    \
    float *converted = sizeof(T) == sizeof(float) ? NULL                                                          \
                       : aligned_alloc(64, (size_t)(active * x_row) * sizeof(float));                             \
    const int64_t r_chunks = (rank + R_CHUNK - 1) / R_CHUNK, vectors = (out_features + VLEN - 1) / VLEN;          \
    const int parallel = active * rank * (in + out_features) >= PARALLEL_WORK && threads > 1;                     \
    _Pragma("omp parallel num_threads(threads) if(parallel)")                                                     \
    {                                                                                                             \
        KERNEL_BEGIN;                                                                                             \
        _Pragma("omp for schedule(static)")                                                                       \
        for (int64_t p = 0; p < active; p++) {                                                                    \
            const T *xr = x + order[p] * x_stride;                                                                \
            if (converted == NULL) {                                                                              \
                xrows[p] = (const float *)xr;                                                                     \
                continue;                                                                                         \
            }                                                                                                     \
            float *xf = converted + p * x_row;                                                                    \
            for (int64_t i = 0; i < in; i++) xf[i] = GET(xr + i);                                                 \
            xrows[p] = xf;                                                                                        \
        }                                                                                                         \
        _Pragma("omp for schedule(static)")                                                                       \
        for (int64_t task = 0; task < num_blocks * r_chunks; task++) {                                            \
            const row_block blk = blocks[task / r_chunks];                                                        \
            const int64_t r0 = task % r_chunks * R_CHUNK;                                                         \
            shrink_block(xrows + blk.first, lora_a + blk.slot * rank * in, in, r0, MIN(r0 + R_CHUNK, rank),       \
                         h + blk.first * rank, rank, blk.count);                                                  \
        }                                                                                                         \
        const int64_t team = omp_get_num_threads(), col_chunks = MIN(vectors, team);                              \
        const int64_t row_chunks = MIN(num_blocks, (team + col_chunks - 1) / col_chunks);                         \
        float acc[ROWS * TILE_VECS * VLEN] __attribute__((aligned(64)));                                          \
        _Pragma("omp for schedule(static)")                                                                       \
        for (int64_t task = 0; task < col_chunks * row_chunks; task++) {                                          \
            const int64_t cc = task % col_chunks, rc = task / col_chunks;                                         \
            const int64_t first = MIN(vectors * cc / col_chunks * VLEN, out_features);                            \
            const int64_t last = MIN(vectors * (cc + 1) / col_chunks * VLEN, out_features);                       \
            for (int64_t bi = num_blocks * rc / row_chunks; bi < num_blocks * (rc + 1) / row_chunks; bi++) {      \
                const row_block blk = blocks[bi];                                                                 \
                const float *hb = h + blk.first * rank;                                                           \
                for (int64_t col = first; col < last;) {                                                          \
                    const float *b = lora_b + blk.slot * rank * out_features + col;                               \
                    int64_t width = WIDE(blk.count) * VLEN;                                                       \
                    if (col + width <= last) expand_block(hb, b, rank, out_features, acc, blk.count, 0);          \
                    else if (col + VLEN <= last) {                                                                \
                        width = VLEN;                                                                             \
                        expand_block(hb, b, rank, out_features, acc, blk.count, 1);                               \
                    } else {                                                                                      \
                        width = last - col;                                                                       \
                        expand_edge(hb, b, rank, out_features, width, acc, blk.count);                            \
                    }                                                                                             \
                    for (int64_t k = 0; k < blk.count; k++) {                                                     \
                        T *o = out + order[blk.first + k] * out_stride + col;                                     \
                        const float *sums = acc + k * TILE_VECS * VLEN;                                           \
                        for (int64_t j = 0; j < width; j++) PUT(o + j, GET(o + j) + sums[j]);                     \
                    }                                                                                             \
                    col += width;                                                                                 \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        KERNEL_END;                                                                                               \
    }                                                                                                             \
    free(converted);                                                                                              \
    free(xrows);                                                                                                  \
    free(h);                                                                                                      \
    free(blocks);                                                                                                 \
    free(order);                                                                                                  \
}

LORA(lora_f32, float, f32_get, f32_put)
LORA(lora_bf16, uint16_t, bf16_get, bf16_put)
