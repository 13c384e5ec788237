/* Lane FMAs a second of the few-row kernel's inner loop for each register blocking (NB weight rows x MB
 * input rows, NB * MB accumulators of 8 lanes), with both operands already fp32 and in cache: the ceiling
 * a layout can reach once its weights are dequantized. Chose panel_block's 3 x 4 in small_m_linear.c.
 *
 *     cc -O3 -mavx2 -mfma -o /tmp/register_blocks experiments/register_blocks.c && /tmp/register_blocks
 *
 * Zen 3 EPYC (AVX2, one core, ~44 G lane FMAs/s peak by simd_throughput.c), two runs at K = 256 / 576 /
 * 1536: 3 x 4 30-37 G at every K; 2 x 6 26-30; 1 x 8 18-26; 2 x 4, 4 x 2, 6 x 2 and 2 x 5 21-35 (wide
 * spread between runs on that VM).
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define INLINE static inline __attribute__((always_inline))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* out[a * 8 + b] += (a sum of lanes of) w row a . x row b over K, as the kernel's block() sums them. */
INLINE void blocked(const float *w, const float *x, long K, const int MB, const int NB, float *out) {
    __m256 acc[8][8];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        __m256 wv[8];
        for (int a = 0; a < NB; a++) wv[a] = _mm256_loadu_ps(w + a * K + k);
        for (int b = 0; b < MB; b++) {
            const __m256 xv = _mm256_loadu_ps(x + b * K + k);
            for (int a = 0; a < NB; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[a][b]);
            out[a * 8 + b] += lanes[0] + lanes[7];  /* keeps every accumulator live */
        }
}

#define VARIANT(NB, MB) \
    __attribute__((noinline)) static void nb##NB##_mb##MB(const float *w, const float *x, long K, float *out) { \
        blocked(w, x, K, MB, NB, out);                                                                   \
    }
VARIANT(3, 4)
VARIANT(2, 6)
VARIANT(1, 8)
VARIANT(2, 4)
VARIANT(4, 2)
VARIANT(6, 2)
VARIANT(2, 5)

static float W[8 * 2048] __attribute__((aligned(64))), X[8 * 2048] __attribute__((aligned(64)));

int main(void) {
    for (int i = 0; i < 8 * 2048; i++) {
        W[i] = i * 1e-4f;
        X[i] = 1e-3f * (i % 7);
    }
    float out[64] = {0};
    const struct {
        const char *name;
        void (*run)(const float *, const float *, long, float *);
        int nb, mb;
    } variants[] = {{"3 x 4", nb3_mb4, 3, 4}, {"2 x 6", nb2_mb6, 2, 6}, {"1 x 8", nb1_mb8, 1, 8},
                    {"2 x 4", nb2_mb4, 2, 4}, {"4 x 2", nb4_mb2, 4, 2}, {"6 x 2", nb6_mb2, 6, 2},
                    {"2 x 5", nb2_mb5, 2, 5}};
    const long widths[] = {256, 576, 1536};
    for (int i = 0; i < 3; i++)
        for (int v = 0; v < 7; v++) {
            const long K = widths[i], fmas = K * variants[v].nb * variants[v].mb;
            const long repeats = 1600000000L / fmas;
            const double began = now();
            for (long r = 0; r < repeats; r++) variants[v].run(W, X, K, out);
            printf("K %4ld  NB x MB %s: %.1f G lane FMAs/s\n", K, variants[v].name,
                   repeats * (double)fmas / (now() - began) / 1e9);
        }
    printf("(checksum %f)\n", out[0]);
    return 0;
}
