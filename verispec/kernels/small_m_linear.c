/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few input rows M (decode and verification passes).
 *
 * MKL's GEMM handles M = 1..16 poorly on AVX2 (an 8-row product costs ~2x a 1-row one although the
 * weights, the dominant memory traffic, are the same). Here every weight is read from memory once per
 * call and used for all M rows while it sits in L1, and weights may be bf16 (bf16 -> fp32 is exact: a
 * bf16 value is the high half of a float), halving the traffic of a bf16 checkpoint.
 *
 * Shape letters: M input rows, K input features (multiple of 8), N output features.
 * The outer loop walks blocks of 4 weight rows (4 * K values, L1-resident) and, inside, blocks of at
 * most 4 input rows. A block keeps NB x MB x KU accumulators of 8 lanes (partial dot products over a
 * strided subset of k), reduced horizontally once at the end; NB, MB and KU are compile-time constants
 * after inlining. KU is 1 everywhere so that every output is summed in the same order whatever M is:
 * a row's result does not depend on which other rows share the call (verification and plain decoding
 * see bit-identical projections). One row is memory-bound anyway, so its 4 FMA chains suffice.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

/* Software prefetch distance in weight rows (4 blocks ahead). Each row is a short stream (K values),
 * too short for the hardware prefetcher to ramp up on: measured 3.7 -> 3.0 ms for the embedded
 * target's projections at M = 1 (docs/experiments/small_m_kernel.py). Prefetching past the end of
 * the weights is harmless (prefetches never fault). */
#define PREFETCH_ROWS 16

INLINE __m256 load_w_f32(const void *base, long index) {
    return _mm256_loadu_ps((const float *)base + index);
}

INLINE __m256 load_w_bf16(const void *base, long index) {
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weight rows n0 .. n0 + NB - 1 (rows >= N are computed from row N - 1 and not stored) against input
 * rows m0 .. m0 + MB - 1. */
INLINE void block(const float *x, const void *w, int bf16, float *y, const float *bias, long K, long N,
                  long m0, const int MB, long n0, const int NB) {
    __m256 acc[4][4];
    long rows[4];
    for (int a = 0; a < NB; a++) {
        rows[a] = (n0 + a < N ? n0 + a : N - 1) * K;
        for (int b = 0; b < MB; b++) acc[a][b] = _mm256_setzero_ps();
    }
    const float *xb = x + m0 * K;
    const long esize = bf16 ? 2 : 4;
    for (long k = 0; k < K; k += 8) {
        if (((k * esize) & 63) == 0)  /* once per cache line: the same line of rows PREFETCH_ROWS ahead */
            for (int a = 0; a < NB; a++)
                _mm_prefetch((const char *)w + (rows[a] + PREFETCH_ROWS * K + k) * esize, _MM_HINT_T0);
        __m256 wv[4];
        for (int a = 0; a < NB; a++)
            wv[a] = bf16 ? load_w_bf16(w, rows[a] + k) : load_w_f32(w, rows[a] + k);
        for (int b = 0; b < MB; b++) {
            __m256 xv = _mm256_loadu_ps(xb + b * K + k);
            for (int a = 0; a < NB; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int b = 0; b < MB; b++) {
        float *out = y + (m0 + b) * N;
        for (int a = 0; a < NB; a++)
            if (n0 + a < N) out[n0 + a] = hsum(acc[a][b]) + (bias ? bias[n0 + a] : 0.0f);
    }
}

/* Weight rows n0 .. n0 + 3 against every input row: 8 accumulators per block whatever M is. */
INLINE void weight_block(const float *x, const void *w, int bf16, float *y, const float *bias,
                         long M, long K, long N, long n0) {
    long m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) {
        block(x, w, bf16, y, bias, K, N, m0, 4, n0, 2);
        block(x, w, bf16, y, bias, K, N, m0, 4, n0 + 2, 2);
    }
    switch (M - m0) {
    case 3:
        block(x, w, bf16, y, bias, K, N, m0, 3, n0, 2);
        block(x, w, bf16, y, bias, K, N, m0, 3, n0 + 2, 2);
        break;
    case 2: block(x, w, bf16, y, bias, K, N, m0, 2, n0, 4); break;
    case 1: block(x, w, bf16, y, bias, K, N, m0, 1, n0, 4); break;
    default: break;
    }
}

static void run(const float *x, const void *w, int bf16, float *y, const float *bias, long M, long K,
                long N, int threads) {
    long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long i = 0; i < blocks; i++) {
        if (bf16) weight_block(x, w, 1, y, bias, M, K, N, 4 * i);
        else weight_block(x, w, 0, y, bias, M, K, N, 4 * i);
    }
}

void linear_f32(const float *x, const float *w, float *y, const float *bias, long M, long K, long N,
                int threads) {
    run(x, w, 0, y, bias, M, K, N, threads);
}

void linear_bf16(const float *x, const uint16_t *w, float *y, const float *bias, long M, long K, long N,
                 int threads) {
    run(x, w, 1, y, bias, M, K, N, threads);
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for each of ``rows`` rows of n values (n % 8 == 0):
 * torch's rms_norm is six small ops on CPU, ~30 us for one 384-value row; this is one call. */
void rms_norm(const float *x, const float *weight, float *y, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        __m256 acc = _mm256_setzero_ps();
        for (long k = 0; k < n; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float scale = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
        __m256 s = _mm256_set1_ps(scale);
        for (long k = 0; k < n; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), s),
                                                   _mm256_loadu_ps(weight + k)));
    }
}
