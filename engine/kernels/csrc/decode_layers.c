/* A Llama-style model's decoder layers over one step's tokens in a single call from Python, for steps whose every
 * token goes through the paged decode kernel (decodes, or every token in batch-invariant mode) and whose every
 * projection runs on our own GEMM (amx_gemm.c, avx512_gemm.c). It calls the same kernels, with the same
 * arguments and in the same order, as the model's Python loop (engine/models/llama.py, forward_fused), so a token's
 * result is bit for bit the same either way; what it saves is Python and ctypes around some 300 kernel calls per
 * step (about a sixth of a decode step's time at 8 sequences on a 2-core Xeon). */
#include <stdint.h>
#include <omp.h>

typedef struct {
    const void *qkv, *o, *gate_up, *down;                      /* packed weights */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32, or NULL */
    const void *input_norm, *post_norm; /* RMSNorm weights: before attention, before the MLP */
    float input_eps, post_eps;
} decoder_layer;

typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, table_stride;
    const int64_t *positions, *slots; /* per token: RoPE position, KV slot */
    const int32_t *tables, *context_lens; /* per token: block table and tokens attended */
    const float *cos_table, *sin_table;
    void *const *k_pools, *const *v_pools; /* per layer: [Hkv, NB, BS, D] */
    /* LoRA adapters (lora.c), or lora_slots NULL: per token its slot (-1: the base model); per layer and projection
     * (qkv, o, gate_up, down) the slots' stacked A [slots, rank, in] and B [slots, rank, out], NULL where no row's
     * adapter changes that projection; per projection its stacked rank */
    const int64_t *lora_slots;
    int64_t lora_num_slots;
    const float *const *lora_a, *const *lora_b;
    const int64_t *lora_rank;
    /* FP8 pools (e4m3 bytes, paged_decode.c), or k_scales NULL: per layer its KV heads' scales [Hkv] */
    const float *const *k_scales, *const *v_scales;
} decode_step;

#define PROTOTYPES(SUFFIX, T)                                                                                     \
void rms_norm_##SUFFIX(const T *x, T *residual, const T *weight, T *out, int64_t rows, int64_t hidden, float eps, \
                       int threads);                                                                              \
void rope_##SUFFIX(T *x, int64_t token_stride, const int64_t *positions, const float *cos_table,                 \
                   const float *sin_table, int64_t tokens, int64_t heads, int64_t D, int threads);                \
void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads);                        \
void write_kv_##SUFFIX(const T *k_src, const T *v_src, int64_t src_stride, T *k, T *v, const int64_t *slots,      \
                       int64_t tokens, int64_t Hkv, int64_t D, int64_t pool_slots, int threads);                  \
void paged_decode_##SUFFIX(const T *q, int64_t q_stride, const T *k, const T *v, const int32_t *tables,           \
                           int64_t table_stride, int64_t first_block, const int32_t *ctx, T *out, float *lse,     \
                           int64_t S, int64_t Hkv, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,     \
                           const float *k_scale, const float *v_scale, int threads);                               \
void write_kv_fp8_##SUFFIX(const T *k_src, const T *v_src, int64_t src_stride, uint8_t *k, uint8_t *v,             \
                           const int64_t *slots, int64_t tokens, int64_t Hkv, int64_t D, int64_t pool_slots,      \
                           const float *k_scale, const float *v_scale, int threads);                              \
void paged_decode_fp8_##SUFFIX(const T *q, int64_t q_stride, const uint8_t *k, const uint8_t *v,                  \
                               const int32_t *tables, int64_t table_stride, int64_t first_block, const int32_t *ctx,\
                               T *out, float *lse, int64_t S, int64_t Hkv, int64_t G, int64_t D, int64_t NB,       \
                               int64_t BS, float scale, const float *k_scale, const float *v_scale, int threads); \
void avx512_linear_##SUFFIX(const T *x, const T *packed, const float *bias, T *y, int64_t m, int64_t n, int64_t k, \
                            int threads);
PROTOTYPES(f32, float)
PROTOTYPES(bf16, uint16_t)
void amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                     int64_t k, int threads);
void lora_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, const float *lora_a,
              const float *lora_b, const int64_t *slots, int64_t rows, int64_t in, int64_t out_features, int64_t rank,
              int64_t num_slots, int threads);
void lora_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, const float *lora_a,
               const float *lora_b, const int64_t *slots, int64_t rows, int64_t in, int64_t out_features,
               int64_t rank, int64_t num_slots, int threads);

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN };

/* y += the rows' adapters' products of x for projection P of layer l, where some row's adapter changes it */
#define LORA_ADD(SUFFIX, P, x, y, in, n)                                                                          \
    if (step->lora_slots && step->lora_a[l * 4 + P])                                                              \
        lora_##SUFFIX(x, in, y, n, step->lora_a[l * 4 + P], step->lora_b[l * 4 + P], step->lora_slots, S, in, n,   \
                      step->lora_rank[P], step->lora_num_slots, threads)

enum { GEMM_SECONDS, ATTENTION_SECONDS, ELEMENTWISE_SECONDS };

/* residual [tokens, hidden] (the embeddings; the residual stream after the last layer on return), normed [tokens,
 * hidden] out: the last layer's output through the next layer's input norm, or after the last, `final_norm`. scratch: tokens x (hidden + qkv + q + 3 inter)
 * elements. seconds[3] (or NULL) += the time in GEMMs, attention and the elementwise kernels. `amx`: the
 * projections are packed for amx_linear_bf16, else for avx512_linear. */
#define DECODE_LAYERS(SUFFIX, T, LINEAR)                                                                          \
void decode_layers_##SUFFIX(const decoder_layer *layers, int64_t num_layers, const T *final_norm, float final_eps,\
                            const decode_step *step, T *residual, T *normed, T *scratch, double *seconds,         \
                            int amx, int threads) {                                                               \
    const int64_t S = step->tokens, H = step->hidden, D = step->head_dim, Hkv = step->kv_heads;                   \
    const int64_t q_size = step->heads * D, kv_size = Hkv * D, width = q_size + 2 * kv_size, I = step->inter;    \
    T *qkv = scratch, *attn = qkv + S * width, *projected = attn + S * q_size, *gate_up = projected + S * H;      \
    T *act = gate_up + S * 2 * I;                                                                                 \
    double spent[3] = {0.0, 0.0, 0.0}, mark = omp_get_wtime();                                                    \
    (void)amx;                                                                                                    \
    rms_norm_##SUFFIX(residual, 0, layers[0].input_norm, normed, S, H, layers[0].input_eps, threads);                                 \
    spent[ELEMENTWISE_SECONDS] += omp_get_wtime() - mark;                                                         \
    for (int64_t l = 0; l < num_layers; l++) {                                                                    \
        const decoder_layer *layer = layers + l;                                                                  \
        void *k_pool = step->k_pools[l], *v_pool = step->v_pools[l];                                              \
        const float *k_scale = step->k_scales ? step->k_scales[l] : 0, *v_scale = step->k_scales ? step->v_scales[l] : 0; \
        mark = omp_get_wtime();                                                                                   \
        LINEAR(normed, layer->qkv, layer->qkv_bias, qkv, S, width, H);                                            \
        LORA_ADD(SUFFIX, LORA_QKV, normed, qkv, H, width);                                                        \
        double now = omp_get_wtime();                                                                             \
        spent[GEMM_SECONDS] += now - mark, mark = now;                                                            \
        rope_##SUFFIX(qkv, width, step->positions, step->cos_table, step->sin_table, S, step->heads + Hkv, D,     \
                      threads);                                                                                   \
        now = omp_get_wtime();                                                                                    \
        spent[ELEMENTWISE_SECONDS] += now - mark, mark = now;                                                     \
        if (k_scale) {                                                                                            \
            write_kv_fp8_##SUFFIX(qkv + q_size, qkv + q_size + kv_size, width, k_pool, v_pool, step->slots, S, Hkv, \
                                  D, step->num_blocks * step->block_size, k_scale, v_scale, threads);            \
            paged_decode_fp8_##SUFFIX(qkv, width, k_pool, v_pool, step->tables, step->table_stride, 0,            \
                                      step->context_lens, attn, 0, S, Hkv, step->heads / Hkv, D, step->num_blocks, \
                                      step->block_size, 1.0f / __builtin_sqrtf((float)D), k_scale, v_scale,       \
                                      threads);                                                                   \
        } else {                                                                                                  \
            write_kv_##SUFFIX(qkv + q_size, qkv + q_size + kv_size, width, k_pool, v_pool, step->slots, S, Hkv, D,\
                              step->num_blocks * step->block_size, threads);                                     \
            paged_decode_##SUFFIX(qkv, width, k_pool, v_pool, step->tables, step->table_stride, 0,                \
                                  step->context_lens, attn, 0, S, Hkv, step->heads / Hkv, D, step->num_blocks,    \
                                  step->block_size, 1.0f / __builtin_sqrtf((float)D), 0, 0, threads);             \
        }                                                                                                         \
        now = omp_get_wtime();                                                                                    \
        spent[ATTENTION_SECONDS] += now - mark, mark = now;                                                       \
        LINEAR(attn, layer->o, layer->o_bias, projected, S, H, q_size);                                           \
        LORA_ADD(SUFFIX, LORA_O, attn, projected, q_size, H);                                                     \
        now = omp_get_wtime();                                                                                    \
        spent[GEMM_SECONDS] += now - mark, mark = now;                                                            \
        rms_norm_##SUFFIX(projected, residual, layer->post_norm, normed, S, H, layer->post_eps, threads);         \
        now = omp_get_wtime();                                                                                    \
        spent[ELEMENTWISE_SECONDS] += now - mark, mark = now;                                                     \
        LINEAR(normed, layer->gate_up, layer->gate_up_bias, gate_up, S, 2 * I, H);                                \
        LORA_ADD(SUFFIX, LORA_GATE_UP, normed, gate_up, H, 2 * I);                                                \
        now = omp_get_wtime();                                                                                    \
        spent[GEMM_SECONDS] += now - mark, mark = now;                                                            \
        silu_mul_##SUFFIX(gate_up, act, S, I, threads);                                                           \
        now = omp_get_wtime();                                                                                    \
        spent[ELEMENTWISE_SECONDS] += now - mark, mark = now;                                                     \
        LINEAR(act, layer->down, layer->down_bias, projected, S, H, I);                                           \
        LORA_ADD(SUFFIX, LORA_DOWN, act, projected, I, H);                                                        \
        now = omp_get_wtime();                                                                                    \
        spent[GEMM_SECONDS] += now - mark, mark = now;                                                            \
        const int last = l + 1 == num_layers;                                                                     \
        rms_norm_##SUFFIX(projected, residual, last ? final_norm : layer[1].input_norm, normed, S, H,              \
                          last ? final_eps : layer[1].input_eps, threads);                                        \
        spent[ELEMENTWISE_SECONDS] += omp_get_wtime() - mark;                                                     \
    }                                                                                                             \
    if (seconds)                                                                                                  \
        for (int i = 0; i < 3; i++) seconds[i] += spent[i];                                                       \
}

#define LINEAR_F32(x, w, bias, y, m, n, k) avx512_linear_f32(x, w, bias, y, m, n, k, threads)
#define LINEAR_BF16(x, w, bias, y, m, n, k)                                                                       \
    (amx ? amx_linear_bf16(x, w, bias, y, m, n, k, threads) : avx512_linear_bf16(x, w, bias, y, m, n, k, threads))

DECODE_LAYERS(f32, float, LINEAR_F32)
DECODE_LAYERS(bf16, uint16_t, LINEAR_BF16)
