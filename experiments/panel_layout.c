/* Experiment, not used by verispec: the few-row linear with W^T stored in 16-column panels and x
 * broadcast (outer-product form), so that each panel is one contiguous stream. Compared with the
 * shipped dot-product kernel by experiments/panel_layout.py. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#define INLINE static inline __attribute__((always_inline))
#define PANEL 16

INLINE __m256 load8(const void *base, long index, int bf16) {
    if (bf16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

/* Panel p of ``w`` holds columns 16p .. 16p + 15 of W^T: w[(p * K + k) * 16 + j] = W[16p + j, k]. */
INLINE void panel_block(const float *x, const void *w, int bf16, float *y, const float *bias, long K, long N,
                        long m0, const int MB, long p) {
    __m256 acc[4][2];
    for (int b = 0; b < MB; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    const float *xb = x + m0 * K;
    long base = p * K * PANEL;
    for (long k = 0; k < K; k++) {
        __m256 w0 = load8(w, base + k * PANEL, bf16), w1 = load8(w, base + k * PANEL + 8, bf16);
        for (int b = 0; b < MB; b++) {
            __m256 xv = _mm256_broadcast_ss(xb + b * K + k);
            acc[b][0] = _mm256_fmadd_ps(w0, xv, acc[b][0]);
            acc[b][1] = _mm256_fmadd_ps(w1, xv, acc[b][1]);
        }
    }
    long n0 = p * PANEL;
    for (int b = 0; b < MB; b++) {
        float out[PANEL];
        _mm256_storeu_ps(out, acc[b][0]);
        _mm256_storeu_ps(out + 8, acc[b][1]);
        float *row = y + (m0 + b) * N;
        for (int j = 0; j < PANEL && n0 + j < N; j++) row[n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

static void run_panels(const float *x, const void *w, int bf16, float *y, const float *bias, long M, long K,
                       long N, int threads) {
    long panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long p = 0; p < panels; p++) {
        long m0 = 0;
        if (bf16) {
            for (; m0 + 4 <= M; m0 += 4) panel_block(x, w, 1, y, bias, K, N, m0, 4, p);
            switch (M - m0) {
            case 3: panel_block(x, w, 1, y, bias, K, N, m0, 3, p); break;
            case 2: panel_block(x, w, 1, y, bias, K, N, m0, 2, p); break;
            case 1: panel_block(x, w, 1, y, bias, K, N, m0, 1, p); break;
            default: break;
            }
        } else {
            for (; m0 + 4 <= M; m0 += 4) panel_block(x, w, 0, y, bias, K, N, m0, 4, p);
            switch (M - m0) {
            case 3: panel_block(x, w, 0, y, bias, K, N, m0, 3, p); break;
            case 2: panel_block(x, w, 0, y, bias, K, N, m0, 2, p); break;
            case 1: panel_block(x, w, 0, y, bias, K, N, m0, 1, p); break;
            default: break;
            }
        }
    }
}

void panels_f32(const float *x, const float *w, float *y, const float *bias, long M, long K, long N, int threads) {
    run_panels(x, w, 0, y, bias, M, K, N, threads);
}
void panels_bf16(const float *x, const uint16_t *w, float *y, const float *bias, long M, long K, long N, int threads) {
    run_panels(x, w, 1, y, bias, M, K, N, threads);
}
