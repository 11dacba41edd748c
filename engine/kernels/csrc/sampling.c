/* The exponential race of engine/sampler.py in C: each row's token is argmax_i g_i with the Gumbel key
 *   g_i = (l_i - max l) / T - log(E_i),   E_i = -log(u_i),   u_i = (h_i + 0.5) / 2^32,
 *   h_i = mix32(mix32(i ^ k0) ^ k1), (k0, k1) the row's 64-bit key (seed and output position, see sampler.py),
 * which draws i with probability softmax(l / T)_i. Logits of -inf (top-k / top-p masks) never win; ties go to the
 * lowest index, as torch's argmax.
 *
 * Only the winner matters, so most tokens are ruled out by a cheap bound: E_i >= 1 - u_i, hence
 * g_i <= d_i - log(1 - u_i), and log(1 - u_i) >= its binary exponent times ln 2, read from a float's bits. That test
 * runs vectorised over chunks of the vocabulary (the compiler's AVX-512 or AVX2, no intrinsics) against the best key
 * so far, starting from the largest logit's (a block whose largest logit cannot win even at the largest noise is
 * skipped whole); the survivors (a handful a row) get their exact key in float64. The max pass compares floats as
 * ordered int32s, which vectorises.
 * The exact keys use only IEEE +, -, *, / and frexp's split, in the same order as sampler.py's torch fallback (this
 * file is built without contraction into fused multiply-adds or reassociation), so both pick bit-identical tokens.
 * Built by engine/kernels/cpu_kernel.py (`sampling_library`). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64    /* tokens tested between updates of the best key */
#define SQRT_HALF 0.7071067811865476
#define LN2 0.6931471805599453
#define LOG_TERMS 12 /* 1/1, 1/3, ..., 1/23: atanh's series, within an ulp or two for |s| <= 0.1716 */
#define SLACK 1e-4f /* the bound's absolute margin over float32 rounding (keys are within [-23, 23]) */

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= x >> 15;
    x *= 0x735a2d97u;
    x ^= x >> 15;
    return x;
}

static inline uint32_t noise_bits(uint32_t token, uint32_t k0, uint32_t k1) { return mix32(mix32(token ^ k0) ^ k1); }

/* log(x) for normal x > 0 (here always >= 2^-33): x = m 2^e with m in [sqrt(1/2), sqrt(2)) (frexp's split, read
 * from the bits, so loops over it vectorise), log m = 2 atanh(s), s = (m - 1) / (m + 1). */
static inline double exact_log(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    const int64_t e = (int64_t)(bits >> 52) - 1022;
    bits = (bits & 0x000fffffffffffffull) | 0x3fe0000000000000ull; /* m in [0.5, 1) */
    double m;
    memcpy(&m, &bits, sizeof m);
    const int small = m < SQRT_HALF;
    m = small ? m * 2.0 : m;
    const double f = m - 1.0;
    const double s = f / (2.0 + f);
    const double z = s * s;
    double p = 1.0 / (2 * LOG_TERMS - 1);
    for (int k = LOG_TERMS - 2; k >= 0; k--)
        p = p * z + 1.0 / (2 * k + 1);
    return (double)(e - small) * LN2 + 2.0 * s * p;
}

static inline double exact_key(float logit, float max, double temperature, uint32_t h) {
    const double u = ((double)h + 0.5) * 0x1p-32;
    const double noise = -exact_log(u);
    return ((double)logit - (double)max) / temperature - exact_log(noise);
}

/* A float's bits as an int32 that orders as the float does (-0 just below +0; NaNs beyond the infinities). */
static inline int32_t ordered(float v) {
    int32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits ^ ((bits >> 31) & 0x7fffffff);
}

static int64_t race_row(const float *x, int64_t vocab, double temperature, uint64_t key) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const int64_t blocks = (vocab + CHUNK - 1) / CHUNK;
    int32_t block_max[blocks]; /* integer max reductions: they vectorise, float ones would not under IEEE flags */
    int32_t max_bits = INT32_MIN, nan = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const float *v = x + b * CHUNK;
        const int n = vocab - b * CHUNK < CHUNK ? (int)(vocab - b * CHUNK) : CHUNK;
        int32_t m = INT32_MIN, bad = 0;
        for (int i = 0; i < n; i++) {
            int32_t bits;
            memcpy(&bits, v + i, sizeof bits);
            const int32_t o = bits ^ ((bits >> 31) & 0x7fffffff); /* as `ordered` */
            m = o > m ? o : m;
            bad |= (bits & 0x7fffffff) > 0x7f800000; /* NaN */
        }
        block_max[b] = m;
        max_bits = m > max_bits ? m : max_bits;
        nan |= bad;
    }
    if (nan)
        return 0; /* the fallback's keys are all NaN: torch's argmax gives 0 */
    int64_t first = 0;
    while (block_max[first] != max_bits)
        first++;
    int64_t at = first * CHUNK;
    while (ordered(x[at]) != max_bits)
        at++;
    const float max = x[at];
    if (!isfinite(max))
        return max > 0 ? at : 0; /* +inf: the first of them (its key NaN, the rest -inf); all -inf: NaN keys, 0 */
    double best = exact_key(x[at], max, temperature, noise_bits((uint32_t)at, k0, k1));
    int64_t best_at = at;
    const float inv_t = (float)(1.0 / temperature);
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * CHUNK;
        const int n = vocab - j0 < CHUNK ? (int)(vocab - j0) : CHUNK;
        const float bar = (float)best - SLACK;
        int32_t top = block_max[b];
        float block_top;
        top ^= (top >> 31) & 0x7fffffff;
        memcpy(&block_top, &top, sizeof top);
        if ((block_top - max) * inv_t * 0.99999f + 33 * (float)LN2 + SLACK <= bar)
            continue; /* no token of the block wins even at the largest noise, 1 - u = 2^-33 */
        int32_t keep[CHUNK];
        int32_t any = 0;
        for (int i = 0; i < n; i++) {
            const uint32_t h = noise_bits((uint32_t)(j0 + i), k0, k1);
            const float w = (float)(int32_t)(~h >> 8); /* 1 - u >= w / 2^24, w < 2^24 exact */
            int32_t bits;
            memcpy(&bits, &w, sizeof bits);
            const int32_t floor_log2 = (bits >> 23) - 151 > -33 ? (bits >> 23) - 151 : -33; /* 1 - u >= 2^-33 */
            const float log_rest = (float)floor_log2 * (float)LN2; /* <= log(1 - u) */
            const float d = (x[j0 + i] - max) * inv_t; /* <= 0, -inf when masked */
            const float bound = d * 0.99999f - log_rest + SLACK;
            keep[i] = !(bound <= bar);
            any |= keep[i];
        }
        if (!any)
            continue;
        for (int i = 0; i < n; i++) {
            if (!keep[i])
                continue;
            const int64_t j = j0 + i;
            const double g = exact_key(x[j], max, temperature, noise_bits((uint32_t)j, k0, k1));
            if (g > best || (g == best && j < best_at)) {
                best = g;
                best_at = j;
            }
        }
    }
    return best_at;
}

/* tokens[r] = the race's winner of row r of logits (float32, rows `stride` apart) at temperature[r] > 0 under the
 * noise of keys[r]. */
void exp_race_f32(const float *logits, int64_t stride, int64_t rows, int64_t vocab, const double *temperature,
                  const uint64_t *keys, int64_t *tokens, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        tokens[r] = race_row(logits + r * stride, vocab, temperature[r], keys[r]);
}

/* noise[r, i] = E_i of keys[r] (as the race draws it), float32, for the rejection sampler's recovered tokens. */
void exp_noise_f32(const uint64_t *keys, int64_t rows, int64_t vocab, float *noise) {
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t k0 = (uint32_t)keys[r], k1 = (uint32_t)(keys[r] >> 32);
        for (int64_t i = 0; i < vocab; i++)
            noise[r * vocab + i] = (float)-exact_log(((double)noise_bits((uint32_t)i, k0, k1) + 0.5) * 0x1p-32);
    }
}
