/* Peak rate of the instructions a few-row product could use, one core: 12 independent accumulator chains
 * each, so throughput (not latency) bounds them. Tells whether a CPU's 512-bit units are full width.
 *
 *     cc -O2 -o /tmp/simd_throughput experiments/simd_throughput.c && /tmp/simd_throughput
 *
 * vdpbf16ps zmm (32 bf16 products), vfmadd zmm (16 fp32), vfmadd ymm (8 fp32), vpdpbusd zmm (64 int8).
 * On the Zen 4 EPYC (docs/results.md): 3.5 / 3.5 / 7.2 / 3.6 G instructions/s, i.e. one 512-bit or two
 * 256-bit FMAs a cycle: 16 fp32 products a cycle either way.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 200000000L

/* Time N instructions OP(acc, a, b) over 12 independent accumulators of type T (operands of type TO). */
#define THROUGHPUT(NAME, TARGET, T, TO, ZERO, A, B, OP)                                              \
    __attribute__((target(TARGET))) static void NAME(void) {                                       \
        T a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO;                        \
        T a6 = ZERO, a7 = ZERO, a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;                      \
        TO a = A, b = B;                                                                           \
        double t = now();                                                                          \
        for (long i = 0; i < N / 12; i++) {                                                        \
            a0 = OP(a0, a, b); a1 = OP(a1, a, b); a2 = OP(a2, a, b); a3 = OP(a3, a, b);            \
            a4 = OP(a4, a, b); a5 = OP(a5, a, b); a6 = OP(a6, a, b); a7 = OP(a7, a, b);            \
            a8 = OP(a8, a, b); a9 = OP(a9, a, b); a10 = OP(a10, a, b); a11 = OP(a11, a, b);        \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),      \
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));        \
        }                                                                                          \
        t = now() - t;                                                                             \
        printf("%-10s %.3f ns/instruction (%.1f G/s)\n", #NAME, t / N * 1e9, N / t / 1e9);        \
    }

#define DPBF16(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
#define FMA512(acc, a, b) _mm512_fmadd_ps(a, b, acc)
#define FMA256(acc, a, b) _mm256_fmadd_ps(a, b, acc)
#define DPBUSD(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)

THROUGHPUT(dpbf16_zmm, "avx512f,avx512bf16", __m512, __m512bh, _mm512_setzero_ps(), (__m512bh)_mm512_set1_epi16(0x3f80),
           (__m512bh)_mm512_set1_epi16(0x3f80), DPBF16)
THROUGHPUT(fma_zmm, "avx512f", __m512, __m512, _mm512_setzero_ps(), _mm512_set1_ps(1.0f), _mm512_set1_ps(1e-9f), FMA512)
THROUGHPUT(fma_ymm, "avx2,fma", __m256, __m256, _mm256_setzero_ps(), _mm256_set1_ps(1.0f), _mm256_set1_ps(1e-9f), FMA256)
THROUGHPUT(vnni_zmm, "avx512f,avx512vnni", __m512i, __m512i, _mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_set1_epi8(1),
           DPBUSD)

int main(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16")) dpbf16_zmm();
    if (__builtin_cpu_supports("avx512f")) fma_zmm();
    fma_ymm();
    if (__builtin_cpu_supports("avx512vnni")) vnni_zmm();
    return 0;
}
