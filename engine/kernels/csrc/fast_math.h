/* Shared by the CPU kernels: float32 and bfloat16 element access, and a vectorizable exp. */
#ifndef TOKENMILL_FAST_MATH_H
#define TOKENMILL_FAST_MATH_H
#include <math.h>
#include <stdint.h>

/* exp(x) in plain arithmetic, so the compiler vectorizes the loops that call it (libm's expf is a scalar
 * call): Cody-Waite range reduction and Cephes' degree-6 polynomial, within 2 ulp of expf. x below -87 (and
 * -inf) gives about 1e-38 instead of 0, which the softmax sums never notice. */
#define EXP_MIN -87.0f
#define EXP_MAX 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 = HI - LO, split so n * HI is exact */
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f /* the polynomial's coefficients, highest degree first */
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_fast(float x) {
    x = x < EXP_MIN ? EXP_MIN : (x > EXP_MAX ? EXP_MAX : x);
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    const float r = x - n * EXP_LN2_HI + n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return (p * r * r + r + 1.0f) * scale.f;
}

/* Subnormals flushed to zero and read as zero while a kernel runs. On Intel cores every vector op that meets a
 * subnormal takes a microcode assist of over a hundred cycles, and they are common here: the compiler computes the
 * clamped arms of exp_fast for every lane (silu_mul divided all its inputs by e^88 and ran 10x slower), and tiny
 * softmax weights times values make them. The mode is per thread, and OpenMP's threads are torch's too (one
 * libgomp): every thread of a parallel region sets it at the region's start (KERNEL_BEGIN) and puts its own back at
 * the end (KERNEL_END). A subnormal is below 1.2e-38: no sum here notices it. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define KERNEL_BEGIN const unsigned int caller_csr = _mm_getcsr(); _mm_setcsr(caller_csr | 0x8040u)
#define KERNEL_END _mm_setcsr(caller_csr)
#else
#define KERNEL_BEGIN ((void)0)
#define KERNEL_END ((void)0)
#endif

static inline float f32_get(const float *p) { return *p; }
static inline void f32_put(float *p, float x) { *p = x; }

static inline float bf16_get(const uint16_t *p) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)*p << 16 };
    return v.f;
}

static inline void bf16_put(uint16_t *p, float x) {  /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v = { .f = x };
    *p = x != x ? 0x7fc0 : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_fast on 16 lanes: the same reduction and polynomial, with fused multiply-adds and 2^n by scalef. */
static inline __m512 exp_fast16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX)), _mm512_set1_ps(EXP_MIN));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

#endif
