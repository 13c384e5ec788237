/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few input rows M (decode and verification passes).
 *
 * MKL's GEMM handles M = 1..16 poorly on AVX2 (an 8-row product costs ~2x a 1-row one although the
 * weights, the dominant memory traffic, are the same). Here every weight is read from memory once per
 * call and used for all M rows while it sits in L1, and weights may be bf16 (bf16 -> fp32 is exact: a
 * bf16 value is the high half of a float), halving the traffic of a bf16 checkpoint, or a GGUF file's
 * Q4_1 / Q8_0 blocks, multiplied by exactly their dequantized values (see load_w_q4_1).
 *
 * Shape letters: M input rows, K input features (multiple of 8; of 32 for blocks), N output features.
 * The outer loop walks blocks of 4 weight rows (4 * K values, L1-resident; see weight_rows_per_block)
 * and, inside, chunks of at most 6 input rows (GGUF blocks against 3 or more rows: 3 weight rows
 * dequantized into a panel, see panel_block). A block keeps NB x MB x KU accumulators of 8 lanes
 * (partial dot products over a strided subset of k), reduced horizontally once at the end; NB, MB and
 * KU are compile-time constants after inlining. KU is 1 everywhere so that every output is summed in
 * the same order whatever M is: a row's result does not depend on which other rows share the call
 * (verification and plain decoding see bit-identical projections).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* Software prefetch distance in weight rows (4 blocks ahead). Each row is a short stream (K values),
 * too short for the hardware prefetcher to ramp up on: measured 3.7 -> 3.0 ms for the embedded
 * target's projections at M = 1 (experiments/small_m_kernel.py). Prefetching past the end of
 * the weights is harmless (prefetches never fault). Into L2 (_MM_HINT_T1), not L1: prefetched into L1
 * the stream stalled at ~9 GB/s on the Zen 4 EPYC, where into L2 it ran at ~17 (SmolLM2's projections
 * as bf16 weights at one row: 28.5 -> 15.6 ms; the tiny target's decode step 4.27 -> 2.33 ms, its
 * 8-row pass 5.69 -> 5.32; GGUF blocks, bound by dequantizing, level or slightly faster). */
#ifndef PREFETCH_ROWS  /* -DPREFETCH_ROWS=N tries another distance (experiments/kernel_ab.py WORK:-D...) */
#define PREFETCH_ROWS 16
#endif

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

/* int8 weights (``quantize_int8``): each row is its fp32 scale (4 bytes) followed by K int8 values,
 * w[n][k] = scale[n] * q[n][k]; a row stride of K + 4 bytes. Only draft models are quantized (their
 * weights decide what is proposed, never what is committed), and at these row counts a pass is bound
 * by reading the weights: a quarter of fp32's bytes, half of bf16's. */
INLINE __m256 load_w_i8(const void *base, long index) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + index))));
}

/* GGUF block weights (llama.cpp's formats, a GGUF file's rows as stored): each row is K / 32 blocks of
 * 32 weights.
 *   Q4_1 (wt 5), 20 bytes a block: fp16 d, fp16 m, 16 bytes qs; weight j (0..15) is the low nibble of
 *        qs[j], weight j + 16 its high nibble; value d * q + m.
 *   Q8_0 (wt 6), 34 bytes a block: fp16 d, 32 int8 q; value d * q.
 * The values are exactly gguf-py's dequantized float32 ones (``d.astype(f32) * q + m``): d * q is exact
 * in fp32 (11 x 8 significant bits at most), so one fused multiply-add rounds d * q + m once, as its
 * separate add does. The kernel multiplies x by those values; at 4.5 / 8.5 bits a weight a one-row
 * pass reads a quarter (Q4_1) or half (Q8_0) of bf16's bytes. Lanes g of a block: weights 8g .. 8g + 7. */
INLINE __m256 load_w_q4_1(const char *block, int g) {
    int32_t header;
    memcpy(&header, block, 4);
    const __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(header));  /* d, m, d, m, ... */
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 4 + 8 * (g & 1))));
    /* Bytes widened to 32 bits: the high nibble is the byte shifted, the low one needs the mask. */
    q = g >= 2 ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_permute_ps(dm, 0x00), _mm256_cvtepi32_ps(q), _mm256_permute_ps(dm, 0x55));
}

/* Q4_1 in pairs (wt 7): two consecutive GGUF Q4_1 blocks of a row repacked for the AVX-512 loop's
 * lookups (``load16_q4_1_pairs``), 48 bytes for 64 weights, the values unchanged: d0, d1, m0, m1 as
 * fp32 (the blocks' fp16 scales converted, exact), then 16 uint16 lanes, lane i the first block's qs[i]
 * in its low byte and the second block's in its high byte, so bits 4j .. 4j + 3 of lane i hold weight
 * 16 j + i of the pair. Here, 8 lanes at a time: lanes g (0..3) of the pair's block ``half`` are its
 * weights 8g .. 8g + 7, valued d * q + m with one fused multiply-add as load_w_q4_1. */
INLINE __m256 load_w_q4_1_pairs(const char *pair, int half, int g) {
    const float *scales = (const float *)pair;
    __m256i q = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(pair + 16 + 16 * (g & 1))));
    q = _mm256_and_si256(_mm256_srli_epi32(q, 4 * (2 * half + (g >> 1))), _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_set1_ps(scales[half]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(scales[2 + half]));
}

INLINE __m256 load_w_q8_0(const char *block, int g) {
    int16_t d;
    memcpy(&d, block, 2);
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * g)));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16(d)), _mm256_cvtepi32_ps(q));
}

/* Q6_K rows (wt 10): a GGUF Q6_K row repacked (``q6_k_rows``), 40 bytes per 32 weights, the values
 * unchanged: the fp32 scales of weights 0..15 and 16..31 (d * sc, exact), then 32 int8 q (-32..31); value
 * scale * q, rounded once as gguf-py's float32 product rounds it. Lanes g: weights 8g .. 8g + 7. */
INLINE __m256 load_w_q6_k(const char *block, int g) {
    float scale;
    memcpy(&scale, block + 4 * (g >> 1), 4);
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 + 8 * g)));
    return _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(q));
}

/* Lanes g (weights 8g .. 8g + 7) of the GGUF block at ``block`` (input k's block; wt 5, 6, 7 or 10). */
INLINE __m256 load_w_block(const char *block, int wt, long k, int g) {
    return wt == 5 ? load_w_q4_1(block, g) : wt == 7 ? load_w_q4_1_pairs(block, (int)(k / 32 % 2), g)
         : wt == 10 ? load_w_q6_k(block, g) : load_w_q8_0(block, g);
}

/* GGUF block formats (dequantized by load_w_block). */
INLINE int is_block_format(int wt) { return wt == 5 || wt == 6 || wt == 7 || wt == 10; }

/* Bytes per 32 weights of the block formats: Q4_1 (5), Q8_0 (6), Q4_1 pairs (7, half a pair), Q6_K rows (10). */
INLINE long block_bytes(int wt) { return wt == 5 ? 20 : wt == 7 ? 24 : wt == 10 ? 40 : 34; }

/* Bytes of one weight row of K inputs (int8 rows: with their scale). */
INLINE long row_bytes(int wt, long K) {
    return wt == 0 ? 4 * K : wt == 1 ? 2 * K : wt == 3 ? K + 4 : K / 32 * block_bytes(wt);
}

/* The weight rows n0 .. n0 + NB - 1 a block reads (rows >= N read row N - 1): where each starts (int8
 * rows past their scale), its scale (int8 rows: their own; other formats 1) and the prefetch distance,
 * PREFETCH_ROWS rows in bytes. Made by weight_rows; shared by block() and block16(). */
typedef struct {
    const char *start[8];
    float scale[8];
    long ahead;
} WeightRows;

INLINE WeightRows weight_rows(const void *w, int wt, long K, long N, long n0, const int NB) {
    WeightRows rows;
    const long stride = row_bytes(wt, K);
    rows.ahead = PREFETCH_ROWS * stride;
    for (int a = 0; a < NB; a++) {
        rows.start[a] = (const char *)w + (n0 + a < N ? n0 + a : N - 1) * stride + (wt == 3 ? 4 : 0);
        rows.scale[a] = 1.0f;
        if (wt == 3) memcpy(&rows.scale[a], rows.start[a] - 4, 4);
    }
    return rows;
}

/* Byte ``offset`` of each of the NB rows, PREFETCH_ROWS rows ahead, into L2. */
INLINE void prefetch_rows(const WeightRows *rows, const int NB, long offset) {
    for (int a = 0; a < NB; a++) _mm_prefetch(rows->start[a] + rows->ahead + offset, _MM_HINT_T1);
}

/* acc[a][b] += w lanes of row a * x lanes k .. k + 7 of input row b. */
INLINE void accumulate(__m256 acc[8][8], const __m256 wv[8], const float *xb, long K, long k, const int MB,
                       const int NB) {
    for (int b = 0; b < MB; b++) {
        __m256 xv = _mm256_loadu_ps(xb + b * K + k);
        for (int a = 0; a < NB; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
    }
}

/* Weight rows n0 .. n0 + NB - 1 (rows >= N are computed from row N - 1 and not stored) against input
 * rows m0 .. m0 + MB - 1. wt: 0 fp32, 1 bf16, 3 int8 rows with their scale (see load_w_i8), 5 Q4_1 and
 * 6 Q8_0 blocks (see load_w_q4_1), 7 Q4_1 pairs (see load_w_q4_1_pairs), 10 Q6_K rows (see load_w_q6_k).
 * Block weights are dequantized
 * 8 lanes at a time, once for all MB rows. */
INLINE void block(const float *x, const void *w, int wt, float *y, const float *bias, long K, long N,
                  long m0, const int MB, long n0, const int NB) {
    const WeightRows rows = weight_rows(w, wt, K, N, n0, NB);
    __m256 acc[8][8];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm256_setzero_ps();
    const float *xb = x + m0 * K;
    __m256 wv[8];
    if (is_block_format(wt)) {
        const long size = block_bytes(wt);
        for (long k = 0; k < K; k += 32) {
            const long at = wt == 7 ? k / 64 * 48 : k / 32 * size;
            /* The block's last byte PREFETCH_ROWS rows ahead: that covers every line of the row (a block
             * spans at most two lines, and the line of its first byte holds its predecessor's last byte).
             * Unconditional: a check for a new line cost as much as the repeats. */
            prefetch_rows(&rows, NB, at + (wt == 7 ? 47 : size - 1));
            /* One or two input rows (more go through panel_block): each weight row's block dequantized
             * and multiplied in turn, 8 independent FMA chains (NB 8 at one row, 4 x 2 at two) kept busy,
             * where dequantizing all NB rows first left one row's 4 chains waiting on their latency (Zen 3
             * EPYC, one thread, SmolLM2: decode 19.7 -> 18.3 ms, a 2-position pass ~25.5 -> 23.3). Each
             * output sums lanes k mod 8 in ascending k, as panel_block's do. */
            for (int a = 0; a < NB; a++)
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    const __m256 w8 = load_w_block(rows.start[a] + at, wt, k, g);
                    for (int b = 0; b < MB; b++)
                        acc[a][b] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(xb + b * K + k + 8 * g), acc[a][b]);
                }
        }
    } else {
        const long esize = wt == 0 ? 4 : wt == 1 ? 2 : 1;
        for (long k = 0; k < K; k += 8) {
            if (((k * esize) & 63) == 0) prefetch_rows(&rows, NB, k * esize);  /* once per cache line */
            for (int a = 0; a < NB; a++) {
                const char *row = rows.start[a];
                wv[a] = wt == 1 ? load_w_bf16(row, k) : wt == 3 ? load_w_i8(row, k) : load_w_f32(row, k);
            }
            accumulate(acc, wv, xb, K, k, MB, NB);
        }
    }
    for (int b = 0; b < MB; b++) {
        float *out = y + (m0 + b) * N;
        for (int a = 0; a < NB; a++)
            if (n0 + a < N) out[n0 + a] = hsum(acc[a][b]) * rows.scale[a] + (bias ? bias[n0 + a] : 0.0f);
    }
}

/* Input rows from which GGUF blocks go through panel_block rather than block (Zen 3 EPYC,
 * experiments/one_row_ab.py, 1536 x 576, 576 x 1536 and 8192 x 576: Q4_1 1.1-1.3x faster from 4 rows,
 * Q8_0 level at 3-4 rows, 1.15-1.25x at 6-8, both 1.3-1.9x at 17-64), in slices of at most
 * PANEL_MAX_ROWS rows (the accumulators a panel keeps). */
#define PANEL_MIN_ROWS 3
#define PANEL_MAX_ROWS 64
INLINE int use_panel(int wt, long M) { return is_block_format(wt) && M >= PANEL_MIN_ROWS; }

/* Weight rows a weight_block covers: 4; 8 for one input row of int8 or GGUF rows (8 FMA chains, see
 * block); 3 for GGUF rows against PANEL_MIN_ROWS or more (see panel_block). fp32 and bf16 rows keep 4 at
 * one row (experiments/one_row_ab.py, Zen 3 EPYC): bf16 1.1-1.2x faster at 4, fp32 1.02-1.06x at
 * 1536x576 / 576x1536 but ~0.93x at 8192x576. */
INLINE long weight_rows_per_block(int wt, long M) {
    if (use_panel(wt, M)) return 3;
    return M == 1 && wt != 0 && wt != 1 ? 8 : 4;
}

/* Inputs a panel holds at most per weight row (a multiple of 64: whole Q4_1 pairs). K is cut into equal
 * panels of whole multiples of 64: one panel up to PANEL_K (a short last panel cost its accumulators'
 * reloads for few FMAs). */
#ifndef PANEL_K
#define PANEL_K 1024
#endif
/* acc[a][b] += panel rows a (3 dequantized weight rows, PANEL_K apart) x input rows m0 + b over the
 * panel's kt inputs (xb: the inputs' first column), 8 lanes at a time; acc is kept in ``saved`` between
 * panels (first: the first panel, acc starts at zero). */
INLINE void panel_chunk(__m256 saved[3][PANEL_MAX_ROWS], int first, const float *panel, const float *xb, long K,
                        long kt, long m0, const int MB) {
    __m256 acc[8][8];
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = first ? _mm256_setzero_ps() : saved[a][m0 + b];
    for (long j = 0; j < kt; j += 8) {
        __m256 wv[8];
        for (int a = 0; a < 3; a++) wv[a] = _mm256_loadu_ps(panel + a * PANEL_K + j);
        accumulate(acc, wv, xb + m0 * K, K, j, MB, 3);
    }
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < MB; b++) saved[a][m0 + b] = acc[a][b];
}

/* GGUF weight rows n0 .. n0 + 2 (rows >= N computed from row N - 1 and not stored) against M input rows
 * (1 .. PANEL_MAX_ROWS), a panel of at most PANEL_K inputs at a time: the three rows' blocks are
 * dequantized once into fp32 (12 KB, in L1), then multiplied by the input rows 4 at a time: 3 x 4 = 12
 * accumulators and 7 loads per 12 FMAs. Of the register blockings tried (experiments/register_blocks.c,
 * 8 rows) that one ran at ~36 G lane FMAs/s, 2 x 6 at ~27 and 1 x 8 at ~22; dequantizing in the loop held 1 x 8 to
 * 15-18. Each output still sums its lanes k mod 8 in ascending k, as block does: the same bits as a pass
 * of one row. */
INLINE void panel_block(const float *x, const void *w, int wt, float *y, const float *bias, long M, long K,
                        long N, long n0) {
    const WeightRows rows = weight_rows(w, wt, K, N, n0, 3);
    float panel[3 * PANEL_K] __attribute__((aligned(32)));
    __m256 saved[3][PANEL_MAX_ROWS];
    const long size = block_bytes(wt);
    const long panels = (K + PANEL_K - 1) / PANEL_K;
    const long width = panels == 1 ? K : (K / panels + 63) / 64 * 64;
    for (long k0 = 0; k0 < K; k0 += width) {
        const long kt = K - k0 < width ? K - k0 : width;
        for (long k = k0; k < k0 + kt; k += 32) {
            const long at = wt == 7 ? k / 64 * 48 : k / 32 * size;
            prefetch_rows(&rows, 3, at + (wt == 7 ? 47 : size - 1));  /* as in block */
            for (int a = 0; a < 3; a++)
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    const __m256 values = load_w_block(rows.start[a] + at, wt, k, g);
                    _mm256_store_ps(panel + a * PANEL_K + (k - k0) + 8 * g, values);
                }
        }
        const float *xb = x + k0;
        const int first = k0 == 0;
        /* Chunks of 4 rows; 5 and 6 left over go as 3 + 2 and 3 + 3 (9 accumulators or more keep the
         * pipes busy, a chunk of 1 or 2 rows leaves them waiting on their latency). */
        for (long m0 = 0; m0 < M;) {
            const long left = M - m0;
            switch (left == 5 || left == 6 ? 3 : left < 4 ? left : 4) {
            case 4: panel_chunk(saved, first, panel, xb, K, kt, m0, 4); m0 += 4; break;
            case 3: panel_chunk(saved, first, panel, xb, K, kt, m0, 3); m0 += 3; break;
            case 2: panel_chunk(saved, first, panel, xb, K, kt, m0, 2); m0 += 2; break;
            default: panel_chunk(saved, first, panel, xb, K, kt, m0, 1); m0 += 1; break;
            }
        }
    }
    for (long b = 0; b < M; b++) {
        float *out = y + b * N;
        for (int a = 0; a < 3; a++)
            if (n0 + a < N) out[n0 + a] = hsum(saved[a][b]) + (bias ? bias[n0 + a] : 0.0f);
    }
}

/* Weight rows n0 .. n0 + 3 against every input row, in chunks of at most 6 input rows: 2 x 6 = 12
 * accumulators keep both FMA pipes busy through their latency (an 8-row pass was 2 x 4-row chunks).
 * One input row: weight_rows_per_block rows in one block; GGUF blocks against PANEL_MIN_ROWS or more:
 * rows n0 .. n0 + 2 through panel_block, PANEL_MAX_ROWS input rows at a time. */
INLINE void weight_block(const float *x, const void *w, int wt, float *y, const float *bias,
                         long M, long K, long N, long n0) {
    if (M == 1) {
        if (weight_rows_per_block(wt, 1) == 8) block(x, w, wt, y, bias, K, N, 0, 1, n0, 8);
        else block(x, w, wt, y, bias, K, N, 0, 1, n0, 4);
        return;
    }
    if (use_panel(wt, M)) {
        for (long m0 = 0; m0 < M; m0 += PANEL_MAX_ROWS)
            panel_block(x + m0 * K, w, wt, y + m0 * N, bias, M - m0 < PANEL_MAX_ROWS ? M - m0 : PANEL_MAX_ROWS, K,
                        N, n0);
        return;
    }
    long m0 = 0;
    for (; M - m0 >= 6; m0 += 6) {
        block(x, w, wt, y, bias, K, N, m0, 6, n0, 2);
        block(x, w, wt, y, bias, K, N, m0, 6, n0 + 2, 2);
    }
    switch (M - m0) {
    case 5:
        block(x, w, wt, y, bias, K, N, m0, 5, n0, 2);
        block(x, w, wt, y, bias, K, N, m0, 5, n0 + 2, 2);
        break;
    case 4:
        block(x, w, wt, y, bias, K, N, m0, 4, n0, 2);
        block(x, w, wt, y, bias, K, N, m0, 4, n0 + 2, 2);
        break;
    case 3:
        block(x, w, wt, y, bias, K, N, m0, 3, n0, 2);
        block(x, w, wt, y, bias, K, N, m0, 3, n0 + 2, 2);
        break;
    case 2: block(x, w, wt, y, bias, K, N, m0, 2, n0, 4); break;
    case 1: block(x, w, wt, y, bias, K, N, m0, 1, n0, 4); break;
    default: break;
    }
}

/* ---- AVX-512 path (F/BW/VL/DQ): the same products 16 lanes at a time ------------------------------
 * Chosen at load (``set_avx512``) on CPUs with AVX-512 where the self-check passes, for every weight
 * type of the AVX2 loop (fp32, bf16, int8, Q4_1, Q8_0) when K % 16 == 0 (else that call runs the AVX2
 * loop). The values multiplied are the same (Q4_1 and Q8_0 dequantized exactly as in load_w_q4_1);
 * each output again has its own accumulator whose lanes sum k mod 16 in k order, reduced in one fixed
 * order, so a row's result does not depend on which other rows share the call. With 32 vector
 * registers a block holds up to 2 x 8 accumulators for GGUF blocks (8 input rows share one
 * dequantization) and 4 x 6 for row formats (each input vector feeds 4 FMAs); see weight_block16. On
 * CPUs that split 512-bit operations in two (AMD Zen 4) the FMA rate equals AVX2's; the gain there is
 * fewer instructions and loads per product. */
#ifndef VERISPEC_NO_AVX512
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define INLINE512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

INLINE512 __m512 load16_w(const char *row, int wt, long k) {
    if (wt == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k))), 16));
    if (wt == 3)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + k))));
    return _mm512_loadu_ps((const float *)row + k);
}

/* Lanes of a GGUF block (see load_w_q4_1): half 0 weights 0..15, half 1 weights 16..31. */
INLINE512 void load16_q4_1(const char *block, __m512 out[2]) {
    uint16_t d, m;
    memcpy(&d, block, 2);
    memcpy(&m, block + 2, 2);
    const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d)), mv = _mm512_set1_ps(_cvtsh_ss(m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 4)));
    out[0] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), mv);
    out[1] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), mv);
}

/* The 64 weights of a Q4_1 pair (see load_w_q4_1_pairs), 16 lanes at a time: out[j] weights 16 j ..
 * 16 j + 15. A 4-bit weight of a block takes one of 16 values, d * i + m (i = 0..15): those are made
 * once (one fused multiply-add, the same rounding as load_w_q4_1's) and each weight looked up by its
 * nibble (vpermps reads the low 4 bits of each index lane). Converting and scaling each weight instead
 * made Zen 4's shuffle and FMA pipes the limit of a one-row pass: the pairs took 5.2 cycles a block of
 * one weight row there against 6.5 for load16_q4_1 (one row, 1536 x 576; experiments/q4_1_pairs.py). */
INLINE512 void load16_q4_1_pairs(const char *pair, __m512 out[4]) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const float *scales = (const float *)pair;
    const __m512 first = _mm512_fmadd_ps(_mm512_set1_ps(scales[0]), iota, _mm512_set1_ps(scales[2]));
    const __m512 second = _mm512_fmadd_ps(_mm512_set1_ps(scales[1]), iota, _mm512_set1_ps(scales[3]));
    const __m512i q = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pair + 16)));
    out[0] = _mm512_permutexvar_ps(q, first);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), first);
    out[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 8), second);
    out[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 12), second);
}

INLINE512 void load16_q6_k(const char *block, __m512 out[2]) {
    const float *scales = (const float *)block;
    for (int h = 0; h < 2; h++)
        out[h] = _mm512_mul_ps(_mm512_set1_ps(scales[h]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(block + 8 + 16 * h)))));
}

INLINE512 void load16_q8_0(const char *block, __m512 out[2]) {
    uint16_t d;
    memcpy(&d, block, 2);
    const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d));
    out[0] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2)))));
    out[1] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18)))));
}

INLINE512 void accumulate16(__m512 acc[4][8], const __m512 wv[4], const float *xb, long K, long k, const int MB,
                            const int NB) {
    for (int b = 0; b < MB; b++) {
        __m512 xv = _mm512_loadu_ps(xb + b * K + k);
        for (int a = 0; a < NB; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);
    }
}

/* The lane sums of 16 accumulators in one vector, by a tree of 4 shuffle-and-add steps that sums every
 * accumulator in the same order whatever its neighbours (unused inputs are zero vectors, which the
 * compiler folds away): lanes i, i + 8 first, then i, i + 4, then 2 by 2. Lane 4 * (j % 4) + j / 4 of
 * the result holds the sum of v[j]. Per accumulator ~3 instructions where one reduction costs ~9. */
INLINE512 __m512 reduce16(const __m512 v[16]) {
    __m512 p[8], q[4], r[2];
    for (int i = 0; i < 8; i++)  /* lanes 0-7: v[2i]'s halves summed, lanes 8-15 v[2i + 1]'s */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter c: 4 partial sums of v[4i + c] */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* quarter c: 2 partial sums of v[8i + c], 2 of v[8i + 4 + c] */
        r[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
}

/* block() with 16 lanes: weight rows n0 .. n0 + NB - 1 against input rows m0 .. m0 + MB - 1
 * (NB * MB <= 24). */
INLINE512 void block16(const float *x, const void *w, int wt, float *y, const float *bias, long K, long N,
                       long m0, const int MB, long n0, const int NB) {
    const WeightRows rows = weight_rows(w, wt, K, N, n0, NB);
    __m512 acc[4][8];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm512_setzero_ps();
    const float *xb = x + m0 * K;
    __m512 wv[4];
    if (wt == 7) {
        for (long k = 0; k < K; k += 64) {  /* a pair of blocks at a time; the same order of products */
            const long at = k / 64 * 48;
            __m512 dequantized[4][4];
            prefetch_rows(&rows, NB, at + 47);
            for (int a = 0; a < NB; a++) load16_q4_1_pairs(rows.start[a] + at, dequantized[a]);
            for (int g = 0; g < 4; g++) {
                for (int a = 0; a < NB; a++) wv[a] = dequantized[a][g];
                accumulate16(acc, wv, xb, K, k + 16 * g, MB, NB);
            }
        }
    } else if (wt == 5 || wt == 6 || wt == 10) {
        const long size = block_bytes(wt);
        for (long k = 0; k < K; k += 32) {
            const long at = k / 32 * size;
            __m512 dequantized[4][2];
            prefetch_rows(&rows, NB, at + size - 1);  /* as in block() */
            for (int a = 0; a < NB; a++) {
                if (wt == 5) load16_q4_1(rows.start[a] + at, dequantized[a]);
                else if (wt == 10) load16_q6_k(rows.start[a] + at, dequantized[a]);
                else load16_q8_0(rows.start[a] + at, dequantized[a]);
            }
            for (int g = 0; g < 2; g++) {
                for (int a = 0; a < NB; a++) wv[a] = dequantized[a][g];
                accumulate16(acc, wv, xb, K, k + 16 * g, MB, NB);
            }
        }
    } else {
        const long esize = wt == 0 ? 4 : wt == 1 ? 2 : 1;
        for (long k = 0; k < K; k += 16) {
            if (((k * esize) & 63) == 0) prefetch_rows(&rows, NB, k * esize);
            for (int a = 0; a < NB; a++) wv[a] = load16_w(rows.start[a], wt, k);
            accumulate16(acc, wv, xb, K, k, MB, NB);
        }
    }
    float sums[32];  /* NB * MB <= 24: reduced 16 at a time, each accumulator by the same tree */
    for (int first = 0; first < NB * MB; first += 16) {
        __m512 all[16];
        for (int j = 0; j < 16; j++)
            all[j] = first + j < NB * MB ? acc[(first + j) / MB][(first + j) % MB] : _mm512_setzero_ps();
        _mm512_storeu_ps(sums + first, reduce16(all));
    }
    for (int b = 0; b < MB; b++) {
        float *out = y + (m0 + b) * N;
        for (int a = 0; a < NB; a++) {
            const int j = a * MB + b, at = j / 16 * 16 + 4 * (j % 4) + j % 16 / 4;
            if (n0 + a < N) out[n0 + a] = sums[at] * rows.scale[a] + (bias ? bias[n0 + a] : 0.0f);
        }
    }
}

/* Weight rows n0 .. n0 + 3 against every input row. Row formats (fp32, bf16, int8), cheap to convert:
 * 4 weight rows by chunks of 4 input rows, the last chunk up to 6 (24 accumulators), so each input
 * vector feeds 4 FMAs (measured on the tiny target's 5-8-row passes: 10-19% faster than 2 weight rows
 * by 8 input rows). GGUF blocks, costly to dequantize: 8 input rows share each dequantized pair of
 * weight rows (16 accumulators), the rest by 2 (5-7 rows) or 4 weight rows (1-4 rows). */
INLINE512 void weight_block16(const float *x, const void *w, int wt, float *y, const float *bias,
                              long M, long K, long N, long n0) {
    long m0 = 0;
    if (wt != 5 && wt != 6 && wt != 7 && wt != 10) {
        for (; M - m0 > 6; m0 += 4) block16(x, w, wt, y, bias, K, N, m0, 4, n0, 4);
        switch (M - m0) {
        case 6: block16(x, w, wt, y, bias, K, N, m0, 6, n0, 4); break;
        case 5: block16(x, w, wt, y, bias, K, N, m0, 5, n0, 4); break;
        case 4: block16(x, w, wt, y, bias, K, N, m0, 4, n0, 4); break;
        case 3: block16(x, w, wt, y, bias, K, N, m0, 3, n0, 4); break;
        case 2: block16(x, w, wt, y, bias, K, N, m0, 2, n0, 4); break;
        case 1: block16(x, w, wt, y, bias, K, N, m0, 1, n0, 4); break;
        default: break;
        }
        return;
    }
    for (; M - m0 >= 8; m0 += 8) {
        block16(x, w, wt, y, bias, K, N, m0, 8, n0, 2);
        block16(x, w, wt, y, bias, K, N, m0, 8, n0 + 2, 2);
    }
    switch (M - m0) {
    case 7: block16(x, w, wt, y, bias, K, N, m0, 7, n0, 2); block16(x, w, wt, y, bias, K, N, m0, 7, n0 + 2, 2); break;
    case 6: block16(x, w, wt, y, bias, K, N, m0, 6, n0, 2); block16(x, w, wt, y, bias, K, N, m0, 6, n0 + 2, 2); break;
    case 5: block16(x, w, wt, y, bias, K, N, m0, 5, n0, 2); block16(x, w, wt, y, bias, K, N, m0, 5, n0 + 2, 2); break;
    case 4: block16(x, w, wt, y, bias, K, N, m0, 4, n0, 4); break;
    case 3: block16(x, w, wt, y, bias, K, N, m0, 3, n0, 4); break;
    case 2: block16(x, w, wt, y, bias, K, N, m0, 2, n0, 4); break;
    case 1: block16(x, w, wt, y, bias, K, N, m0, 1, n0, 4); break;
    default: break;
    }
}

AVX512_TARGET static void run16(const float *x, const void *w, int wtype, float *y, const float *bias, long M,
                                long K, long N, int threads) {
    long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long i = 0; i < blocks; i++) {
        switch (wtype) {
        case 1: weight_block16(x, w, 1, y, bias, M, K, N, 4 * i); break;
        case 3: weight_block16(x, w, 3, y, bias, M, K, N, 4 * i); break;
        case 5: weight_block16(x, w, 5, y, bias, M, K, N, 4 * i); break;
        case 6: weight_block16(x, w, 6, y, bias, M, K, N, 4 * i); break;
        case 7: weight_block16(x, w, 7, y, bias, M, K, N, 4 * i); break;
        case 10: weight_block16(x, w, 10, y, bias, M, K, N, 4 * i); break;
        default: weight_block16(x, w, 0, y, bias, M, K, N, 4 * i); break;
        }
    }
}
static const int avx512_built = 1;
#else
static void run16(const float *x, const void *w, int wtype, float *y, const float *bias, long M, long K, long N,
                  int threads) {
    (void)x; (void)w; (void)wtype; (void)y; (void)bias; (void)M; (void)K; (void)N; (void)threads;
}
static const int avx512_built = 0;
#endif

static int use_avx512 = 0;

/* Turn the AVX-512 path on (1) or off (0) for later calls; returns whether it is now on (0 where the
 * library was built without it). The caller checks the CPU's flags first. */
int set_avx512(int on) {
    use_avx512 = on && avx512_built;
    return use_avx512;
}

int avx512_on(void) { return use_avx512; }

/* Weight types: 0 fp32, 1 bf16 row-major, 2 bf16 tiled for AMX (run_amx below), 3 int8 rows with
 * their scale, 4 int8 tiled for AMX (run_amx_i8), 5 Q4_1 and 6 Q8_0 GGUF block rows (K % 32 == 0), 7 Q4_1
 * rows in pairs of blocks (K % 64 == 0, see load_w_q4_1_pairs), 8 Q4_1 and 9 Q8_0 blocks tiled for AMX
 * (run_amx_blocks), 10 Q6_K rows (see load_w_q6_k). 1 when scratch memory could not be allocated (AMX only). */
static int run_amx(const float *x, const uint16_t *w, float *y, const float *bias, long M, long K, long N,
                   int threads);

static int run_amx_i8(const float *x, const int8_t *w, float *y, const float *bias, long M, long K, long N,
                      int threads);

static int run_amx_blocks(const float *x, const uint8_t *w, int q8, float *y, const float *bias, long M, long K,
                          long N, int threads);

static int run(const float *x, const void *w, int wtype, float *y, const float *bias, long M, long K,
               long N, int threads) {
    if (wtype == 2) return run_amx(x, (const uint16_t *)w, y, bias, M, K, N, threads);
    if (wtype == 4) return run_amx_i8(x, (const int8_t *)w, y, bias, M, K, N, threads);
    if (wtype == 8 || wtype == 9) return run_amx_blocks(x, (const uint8_t *)w, wtype == 9, y, bias, M, K, N, threads);
    if (use_avx512 && K % 16 == 0) {
        run16(x, w, wtype, y, bias, M, K, N, threads);
        return 0;
    }
    const long per_block = weight_rows_per_block(wtype, M);
    long blocks = (N + per_block - 1) / per_block;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long i = 0; i < blocks; i++) {
        switch (wtype) {  /* each type its own inlined copy: wt is a constant in block() */
        case 1: weight_block(x, w, 1, y, bias, M, K, N, per_block * i); break;
        case 3: weight_block(x, w, 3, y, bias, M, K, N, per_block * i); break;
        case 5: weight_block(x, w, 5, y, bias, M, K, N, per_block * i); break;
        case 6: weight_block(x, w, 6, y, bias, M, K, N, per_block * i); break;
        case 7: weight_block(x, w, 7, y, bias, M, K, N, per_block * i); break;
        case 10: weight_block(x, w, 10, y, bias, M, K, N, per_block * i); break;
        default: weight_block(x, w, 0, y, bias, M, K, N, per_block * i); break;
        }
    }
    return 0;
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for w of weight type wtype (see run); the layouts: fp32 and bf16
 * row-major, int8 rows from quantize_int8 (see load_w_i8), GGUF blocks (see load_w_q4_1), AMX tiles from
 * pack_amx and pack_amx_i8. 1 when scratch memory could not be allocated (AMX), else 0. */
int small_m_linear(const float *x, const void *w, int wtype, float *y, const float *bias, long M, long K, long N,
                   int threads) {
    return run(x, w, wtype, y, bias, M, K, N, threads);
}

/* ---- AMX (Intel Advanced Matrix Extensions) path for bf16 weights ----------------------------------
 *
 * On CPUs with AMX-BF16 a tile multiply takes 16 rows x 32 bf16 of x against 32 x 16 of weights in
 * one instruction, so the cost of a pass hardly depends on its rows (1..16): verification of K + 1
 * positions costs about what decoding one does. Weights must be bf16 (exact for a bf16 checkpoint)
 * and stored tiled (``pack_amx``): for each block of 16 output features and each chunk of 32 input
 * features, a 16 x 32 tile whose row kk holds, for n = 0..15, the pair w[n][2kk], w[n][2kk + 1] (the
 * layout the tile multiply reads). Blocks are contiguous in n, so a (N, K) array in this order can be
 * cut and joined along N at multiples of 16 like a row-major one.
 *
 * x is fp32: each value is split exactly into three bf16 parts, x = hi + mid + lo (truncation keeps
 * the top 8 significant bits, twice, and the last 8 are exact), and the three products are
 * accumulated: every product is exact (8 x 8 bits), only the fp32 accumulation rounds, as in an fp32
 * GEMM. Each output element is accumulated over the chunks in the same order whatever the rows of the
 * call: a row's result does not depend on which other rows share it.
 *
 * Shapes: K % 32 == 0 and N % 16 == 0 (``pack_amx`` checks; other layers keep the AVX2 path). */

#include <sys/syscall.h>
#include <unistd.h>

#ifndef VERISPEC_NO_AMX  /* a compiler without AMX intrinsics builds with -DVERISPEC_NO_AMX */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the AMX tile state (process-wide); 1 when granted. */
int amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* w (N, K) bf16 row-major -> out in the tiled order above. */
void pack_amx(const uint16_t *w, uint16_t *out, long N, long K) {
    const long chunks = K / 32;
    for (long nb = 0; nb < N / 16; nb++)
        for (long c = 0; c < chunks; c++) {
            uint16_t *tile = out + (nb * chunks + c) * 512;
            for (long kk = 0; kk < 16; kk++)
                for (long n = 0; n < 16; n++) {
                    const uint16_t *src = w + (nb * 16 + n) * K + c * 32 + 2 * kk;
                    tile[kk * 32 + 2 * n] = src[0];
                    tile[kk * 32 + 2 * n + 1] = src[1];
                }
        }
}

/* x rows (M x K fp32, K % 32 == 0) -> parts[p] (M x K bf16, p = hi, mid, lo: the top 8 significant bits,
 * the next 8 and the rest, each exact) and, with sums, the sum of each row's 32 inputs of each chunk
 * (sums[m * K / 32 + c], in a fixed order). A CPU with AMX has AVX-512. */
__attribute__((target("avx512f"))) static void split3_sums(const float *x, uint16_t *parts, float *sums, long M, long K) {
    const long size = M * K;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (long i = 0; i < size; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
        const __m512 rest = _mm512_sub_ps(v, hi);  /* exact: the bits below hi's */
        const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
        const __m512 lo = _mm512_sub_ps(rest, mid);  /* exact, and at most 8 significant bits */
        _mm256_storeu_si256((__m256i *)(parts + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
        _mm256_storeu_si256((__m256i *)(parts + size + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(mid), 16)));
        _mm256_storeu_si256((__m256i *)(parts + 2 * size + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
    }
    if (sums)
        for (long j = 0; j < size / 32; j++)
            sums[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + 32 * j), _mm512_loadu_ps(x + 32 * j + 16)));
}

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f")))

/* The calling OpenMP thread's share of ``blocks`` output blocks of 16: whole groups of ``multiple`` blocks (4 where
 * a path multiplies 4 blocks at a time). */
static void my_blocks(long blocks, long multiple, long *begin, long *end) {
    const long team = omp_get_num_threads(), me = omp_get_thread_num();
    const long per = ((blocks + team - 1) / team + multiple - 1) / multiple * multiple;
    *begin = me * per < blocks ? me * per : blocks;
    *end = *begin + per < blocks ? *begin + per : blocks;
}

/* Up to 4 blocks of 16 outputs (tiles 0-3) for one chunk of <= 16 rows: A parts in tiles 4-6, B in 7. */
#define AMX_BLOCK(J)                                                                             \
    if (J < blocks) {                                                                            \
        _tile_loadd(7, w + ((nb + J) * chunks + c) * 512, 64);                                   \
        _tile_dpbf16ps(J, 4, 7);                                                                 \
        _tile_dpbf16ps(J, 5, 7);                                                                 \
        _tile_dpbf16ps(J, 6, 7);                                                                 \
    }
#define AMX_STORE(J) \
    if (J < blocks) _tile_stored(J, y + m0 * N + (nb + J) * 16, N * 4);

INLINE void configure(tile_config *config, long rows) {
    memset(config, 0, sizeof *config);
    config->palette = 1;
    for (int t = 0; t < 7; t++) {
        config->rows[t] = (uint8_t)rows;
        config->colsb[t] = 64;
    }
    config->rows[7] = 16;
    config->colsb[7] = 64;
}

/* Output blocks nb_begin .. nb_end - 1 (of 16 features) for all M rows, 4 blocks at a time (tiles
 * 0-3), each group of 4 blocks against every chunk of <= 16 rows in turn (A parts in tiles 4-6, B in
 * 7): a group's weights (4 x K x 16 bf16) are read from memory once and stay in L2 for the other row
 * chunks, so 64 rows do not read the weights 4 times. */
AMX_TARGET static void amx_blocks(const uint16_t *parts, long M, const uint16_t *w, float *y, long K, long N,
                                  long nb_begin, long nb_end) {
    tile_config full, tail;
    configure(&full, 16);
    configure(&tail, M % 16);
    const long chunks = K / 32, part_stride = M * K, whole = M / 16 * 16;
    for (long nb = nb_begin; nb < nb_end; nb += 4) {
        const long blocks = nb_end - nb < 4 ? nb_end - nb : 4;
        for (long m0 = 0; m0 < M; m0 += 16) {
            if (m0 == 0 || m0 == whole) _tile_loadconfig(m0 < whole ? &full : &tail);
            const uint16_t *rows = parts + m0 * K;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (long c = 0; c < chunks; c++) {
                _tile_loadd(4, rows + c * 32, K * 2);
                _tile_loadd(5, rows + part_stride + c * 32, K * 2);
                _tile_loadd(6, rows + 2 * part_stride + c * 32, K * 2);
                AMX_BLOCK(0) AMX_BLOCK(1) AMX_BLOCK(2) AMX_BLOCK(3)
            }
            AMX_STORE(0) AMX_STORE(1) AMX_STORE(2) AMX_STORE(3)
        }
    }
    _tile_release();
}

/* y[M, N] = x[M, K] @ w^T (+ bias), w tiled by pack_amx. Returns 1 when scratch memory failed. */
static int run_amx(const float *x, const uint16_t *w, float *y, const float *bias, long M, long K, long N,
                   int threads) {
    uint16_t *parts = aligned_alloc(64, (sizeof(uint16_t) * 3 * M * K + 63) / 64 * 64);  /* whole cache lines per tile row */
    if (!parts) return 1;
    split3_sums(x, parts, NULL, M, K);
    const long blocks = N / 16;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        long begin, end;
        my_blocks(blocks, 4, &begin, &end);
        if (begin < end) amx_blocks(parts, M, w, y, K, N, begin, end);
    }
    free(parts);
    if (bias)
        for (long m = 0; m < M; m++)
            for (long n = 0; n < N; n++) y[m * N + n] += bias[n];
    return 0;
}

/* ---- AMX int8 (draft models): int8 weights and int8 input rows -------------------------------------
 *
 * ``quantize`` (Python) gives a draft model int8 weights; with AMX-INT8 they are stored for tile
 * multiplies (``pack_amx_i8``): per block of 16 output features, their 16 fp32 scales (64 bytes),
 * then for each chunk of 64 input features a 16 x 64-byte tile whose row kk holds, for n = 0..15, the
 * four values w[n][4kk .. 4kk + 3]. A block is 64 + 16 K bytes, so blocks cut and join along N like
 * rows of a (N, K + 4) byte array. Each input row is quantised to int8 on the fly with its own scale
 * (max |x| / 127); products accumulate exactly in int32 and are scaled once, so a row's result does
 * not depend on the other rows of the pass. Shapes: K % 64 == 0, N % 16 == 0. */

#define AMX_I8_TARGET __attribute__((target("amx-tile,amx-int8,avx512f")))

void pack_amx_i8(const int8_t *q, const float *scales, int8_t *out, long N, long K) {
    const long chunks = K / 64, block_bytes = 64 + 16 * K;
    for (long nb = 0; nb < N / 16; nb++) {
        int8_t *block = out + nb * block_bytes;
        memcpy(block, scales + nb * 16, 64);
        for (long c = 0; c < chunks; c++) {
            int8_t *tile = block + 64 + c * 1024;
            for (long kk = 0; kk < 16; kk++)
                for (long n = 0; n < 16; n++)
                    memcpy(tile + kk * 64 + 4 * n, q + (nb * 16 + n) * K + c * 64 + 4 * kk, 4);
        }
    }
}

/* Block J's weight tile goes to tile B (5, 6, 7, then 5 again): distinct tiles let the next load
 * start while the previous multiply runs (one tile for all four waited on each load in turn). */
#define AMX_I8_BLOCK(J, B)                                                                       \
    if (J < blocks) {                                                                            \
        _tile_loadd(B, w + (nb + J) * block_bytes + 64 + c * 1024, 64);                          \
        _tile_dpbssd(J, 4, B);                                                                   \
    }

/* Tiles 0-3 accumulate (rows: the chunk's), 4 holds the chunk's inputs, 5-7 weights (16 rows). */
INLINE void configure_i8(tile_config *config, long rows) {
    configure(config, rows);
    config->rows[5] = config->rows[6] = 16;
}

AMX_I8_TARGET static void amx_i8_blocks(const int8_t *xq, const float *xs, long M, const int8_t *w, float *y,
                                        const float *bias, long K, long N, long nb_begin, long nb_end) {
    tile_config full, tail;
    configure_i8(&full, 16);
    configure_i8(&tail, M % 16);
    const long chunks = K / 64, block_bytes = 64 + 16 * K, whole = M / 16 * 16;
    int32_t acc[4][16 * 16];
    for (long nb = nb_begin; nb < nb_end; nb += 4) {
        const long blocks = nb_end - nb < 4 ? nb_end - nb : 4;
        for (long m0 = 0; m0 < M; m0 += 16) {
            const long rows = M - m0 < 16 ? M - m0 : 16;
            if (m0 == 0 || m0 == whole) _tile_loadconfig(m0 < whole ? &full : &tail);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (long c = 0; c < chunks; c++) {
                _tile_loadd(4, xq + m0 * K + c * 64, K);
                AMX_I8_BLOCK(0, 5) AMX_I8_BLOCK(1, 6) AMX_I8_BLOCK(2, 7) AMX_I8_BLOCK(3, 5)
            }
            if (0 < blocks) _tile_stored(0, acc[0], 64);
            if (1 < blocks) _tile_stored(1, acc[1], 64);
            if (2 < blocks) _tile_stored(2, acc[2], 64);
            if (3 < blocks) _tile_stored(3, acc[3], 64);
            for (long j = 0; j < blocks; j++) {
                const float *ws = (const float *)(w + (nb + j) * block_bytes);
                const long n0 = (nb + j) * 16;
                for (long r = 0; r < rows; r++) {
                    const float sx = xs[m0 + r];
                    float *out = y + (m0 + r) * N + n0;
                    for (long n = 0; n < 16; n++)
                        out[n] = (float)acc[j][r * 16 + n] * (sx * ws[n]) + (bias ? bias[n0 + n] : 0.0f);
                }
            }
        }
    }
    _tile_release();
}

/* y[M, N] = x[M, K] @ w^T (+ bias), w from pack_amx_i8. Returns 1 when scratch memory failed. */
static int run_amx_i8(const float *x, const int8_t *w, float *y, const float *bias, long M, long K, long N,
                      int threads) {
    int8_t *xq = aligned_alloc(64, (M * K + 63) / 64 * 64);
    float *xs = malloc(sizeof(float) * (M > 0 ? M : 1));
    if (!xq || !xs) {
        free(xq); free(xs);
        return 1;
    }
    for (long m = 0; m < M; m++) {  /* each row to int8 with its own scale */
        const float *row = x + m * K;
        float top = 0.0f;
        for (long k = 0; k < K; k++) top = fmaxf(top, fabsf(row[k]));
        const float scale = top > 0.0f ? top / 127.0f : 1.0f, inverse = 1.0f / scale;
        xs[m] = scale;
        for (long k = 0; k < K; k++) xq[m * K + k] = (int8_t)lrintf(row[k] * inverse);
    }
    const long blocks = N / 16;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        long begin, end;
        my_blocks(blocks, 4, &begin, &end);
        if (begin < end) amx_i8_blocks(xq, xs, M, w, y, bias, K, N, begin, end);
    }
    free(xq); free(xs);
    return 0;
}


/* ---- AMX for GGUF blocks (a GGUF file's Q4_1 / Q8_0 rows; the target model's own weights) --------
 *
 * A Q4_1 weight is d * q + m with q a 4-bit integer and d, m the block's fp16 scales; a Q8_0 weight is
 * d * q with q an int8. Every such q is exact in bf16 (at most 8 significant bits), so a tile multiply
 * of x's three exact bf16 parts (split3_sums above) by the q of one block of 32 inputs gives, per output,
 * the block's sum of q * x with exact products and fp32 accumulation. An AVX-512 epilogue then adds
 * d * that sum + m * (the block's sum of x) into the output, block by block in k order:
 *     y[r][n] = sum over blocks c of (d[n][c] * C_c[r][n] + m[n][c] * X[r][c]),  X[r][c] = sum of x[r][32c..32c+31]
 * which is sum over k of (d * q + m) * x in exact arithmetic, and those are exactly the dequantized
 * weights wherever d * q + m is exact in fp32 (``_pack_blocks`` checks this before choosing the path).
 * Only where fp32 rounds differs from the AVX-512 loop. Every output of a row is summed in the same
 * order whatever the rows of the call: a row's result does not depend on the other rows.
 *
 * Layout (``pack_amx_blocks``): for each block of 16 output features nb and each chunk c of 32 inputs
 * (one GGUF block of each of the 16 rows), a record: for Q4_1 d[16] and m[16] as the file's fp16 and 256
 * bytes of nibbles (wt 8, 320 bytes: 20 a block, as in the file), for Q8_0 d[16] fp32 and 512 int8
 * values (wt 9, 576 bytes). Q4_1's scales stay fp16 (converted exactly in the epilogue): a pass at one
 * row reads the weights' bytes once and little else, and fp32 scales made its records 384 bytes. Word i of tile row
 * kk (the layout a tile multiply reads for its second operand) is the weight of output n = i / 2 and
 * input 32c + 2kk + i % 2; Q4_1: the low nibble of byte 32t + i is word i of tile row 2t, its high
 * nibble word i of row 2t + 1; Q8_0: byte 32kk + i is word i of row kk. Records are nb-major: 16 rows of
 * 20 (Q4_1) or 36 (Q8_0) bytes a block, so the array cuts and joins along N at multiples of 16.
 * A pass unpacks each record into a bf16 tile once (for every chunk of 16 rows of x) and keeps four
 * accumulator tiles in flight, so a block's epilogue runs while the next blocks multiply. */

/* GGUF rows raw (N x K / 32 blocks) -> out in the layout above. Returns how many Q4_1 weights d * q + m
 * are not exact in fp32 (the path then computes other values than the dequantized ones; 0 for Q8_0). */
#define AMXQ_RECORD(q8) ((q8) ? 576 : 320)  /* bytes of a record: 16 outputs x 32 inputs */

long pack_amx_blocks(const uint8_t *raw, uint8_t *out, long N, long K, int q8) {
    const long chunks = K / 32, in_bytes = q8 ? 34 : 20, rec = AMXQ_RECORD(q8);
    long inexact = 0;
    for (long nb = 0; nb < N / 16; nb++)
        for (long c = 0; c < chunks; c++) {
            uint8_t *record = out + (nb * chunks + c) * rec;
            float scales[32];
            uint16_t halves[32];
            uint8_t *values = record + 64;
            memset(values, 0, q8 ? 512 : 256);
            for (long n = 0; n < 16; n++) {
                const uint8_t *block = raw + ((nb * 16 + n) * chunks + c) * in_bytes;
                uint16_t half;
                memcpy(&half, block, 2);
                halves[n] = half;
                scales[n] = _cvtsh_ss(half);
                memcpy(&half, block + 2, 2);
                halves[16 + n] = half;
                scales[16 + n] = _cvtsh_ss(half);
            }
            if (q8) memcpy(record, scales, 64);  /* Q8_0: d as fp32 */
            else memcpy(record, halves, 64);  /* Q4_1: d, m as the file's fp16 */
            for (long kk = 0; kk < 16; kk++)
                for (long i = 0; i < 32; i++) {
                    const long n = i / 2, k = 2 * kk + i % 2;
                    const uint8_t *block = raw + ((nb * 16 + n) * chunks + c) * in_bytes;
                    if (q8) {
                        values[32 * kk + i] = block[2 + k];
                    } else {
                        const uint8_t q = k < 16 ? block[4 + k] & 15 : block[4 + k - 16] >> 4;
                        values[32 * (kk / 2) + i] |= (uint8_t)(q << (4 * (kk % 2)));
                        const double exact = (double)scales[n] * q + (double)scales[16 + n];
                        inexact += (double)(float)exact != exact;
                    }
                }
        }
    return inexact;
}

#define AMXQ_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AMXQ_INLINE static inline __attribute__((always_inline, target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* A record's values -> one bf16 tile (16 rows x 32 words, see the layout above). */
AMXQ_INLINE void unpack_record(const uint8_t *record, int q8, uint16_t *tile) {
    if (q8) {
        const int8_t *q = (const int8_t *)(record + 64);
        for (int kk = 0; kk < 16; kk++) {
            const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * kk))));
            const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * kk + 16))));
            _mm512_store_si512((__m512i *)(tile + 32 * kk), (__m512i)_mm512_cvtne2ps_pbh(high, low));  /* exact: |q| <= 128 */
        }
        return;
    }
    /* bf16 bit patterns of 0..15, twice (vpermw reads 5 index bits; the indices are < 16) */
    const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                           0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160,
                                           0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                                           0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const uint8_t *nibbles = record + 64;
    for (int t = 0; t < 8; t++) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(nibbles + 32 * t)));
        _mm512_store_si512((__m512i *)(tile + 64 * t), _mm512_permutexvar_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(15)), table));
        _mm512_store_si512((__m512i *)(tile + 64 * t + 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
    }
}

/* acc[r] += d * C[r] (+ m * X[r][c]) for the ROWS rows of one block's accumulator tile, stored at C. */
AMXQ_INLINE void block_epilogue(const float *C, const uint8_t *record, int q8, const float *sums, long chunks,
                                long c, __m512 acc[16], const int ROWS) {
    if (q8) {
        const __m512 d = _mm512_loadu_ps((const float *)record);
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(C + 16 * r), d, acc[r]);
        return;
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)record));  /* exact */
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 32)));
    for (int r = 0; r < ROWS; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * chunks + c]), m,
                                 _mm512_fmadd_ps(_mm512_load_ps(C + 16 * r), d, acc[r]));
}

#define AMXQ_ROWS_GROUP 16  /* rows a tile holds: amxq_block's rows per pass over a block's chunks */
#define AMXQ_AHEAD 2  /* records unpacked ahead of the one multiplied: 0.082 -> 0.058 ms for 1536 x 576 at one row */
/* Records prefetched ahead into L2 (a block's records, then the next block's, are one stream): from memory
 * a pass of SmolLM2's products at one row took 11.4 ms without and 8.2-10 ms with 8-256 records ahead,
 * no distance clearly best (Xeon, one thread, a C harness over its 121 matrices). */
#ifndef AMXQ_PREFETCH
#define AMXQ_PREFETCH 16
#endif
#ifndef AMXQ_PREFETCH_HINT
#define AMXQ_PREFETCH_HINT _MM_HINT_T1
#endif
#ifndef AMXQ_PREFETCH_STEP
#define AMXQ_PREFETCH_STEP 64
#endif

/* The lines of the record at ``at`` (prefetching past the weights' end is harmless: prefetches never fault). */
AMXQ_INLINE void amxq_prefetch(const uint8_t *at, long rec) {
    for (long line = 0; line < rec; line += AMXQ_PREFETCH_STEP) _mm_prefetch((const char *)at + line, AMXQ_PREFETCH_HINT);
}

static __thread uint16_t *amxq_tiles = NULL;  /* a thread's unpacked tiles of one block of 16 outputs */
static __thread long amxq_tiles_size = 0;

/* Step c of the pipeline on accumulator tile S (c % 4 == S): store tile S (chunk c - 4's sums), add
 * chunk c - 5's (stored one step earlier, so the store has landed) into acc, then unpack chunk
 * c + AMXQ_AHEAD (first chunk of rows only; later chunks reuse the tiles) and multiply chunk c into S. */
#define AMXQ_STEP(S)                                                                                    \
    {                                                                                                   \
        const long c = base + S;                                                                        \
        if (c >= 4 && c - 4 < chunks) _tile_stored(S, stored[S], 64);                                   \
        if (c >= 5 && c - 5 < chunks)                                                                   \
            block_epilogue(stored[(S + 3) & 3], records + (c - 5) * rec, q8, row_sums, chunks, c - 5, acc, ROWS); \
        if (c < chunks) {                                                                               \
            if (fill) amxq_prefetch(records + (c + AMXQ_PREFETCH) * rec, rec);                          \
            if (fill && c + AMXQ_AHEAD < chunks)                                                        \
                unpack_record(records + (c + AMXQ_AHEAD) * rec, q8, tiles + ((c + AMXQ_AHEAD) & slots) * 512); \
            _tile_zero(S);                                                                              \
            _tile_loadd(7, tiles + (c & slots) * 512, 64);                                              \
            _tile_loadd(4, a + c * 32, K * 2);                                                          \
            _tile_loadd(5, a + part_stride + c * 32, K * 2);                                            \
            _tile_loadd(6, a + 2 * part_stride + c * 32, K * 2);                                        \
            _tile_dpbf16ps(S, 4, 7);                                                                    \
            _tile_dpbf16ps(S, 5, 7);                                                                    \
            _tile_dpbf16ps(S, 6, 7);                                                                    \
        }                                                                                               \
    }

/* Outputs nb * 16 .. nb * 16 + 15 of ROWS rows from m0 (the tile configuration loaded for ROWS rows),
 * their accumulators in registers; with fill, the block's records are unpacked into tiles on the way. */
AMXQ_INLINE void amxq_rows(const uint16_t *parts, const float *sums, long M, long m0, const uint8_t *records,
                           int q8, float *y, const float *bias, long K, long N, long nb, uint16_t *tiles, int fill,
                           const int ROWS) {
    const long chunks = K / 32, rec = AMXQ_RECORD(q8), part_stride = M * K;
    float stored[4][16 * 16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    const uint16_t *a = parts + m0 * K;
    const float *row_sums = sums ? sums + m0 * chunks : NULL;
    /* One group of rows reads each tile once: a ring of 4 slots (AMXQ_AHEAD + 2) keeps the unpacked
     * tiles in L1 instead of writing K / 32 KiB a block (48 KiB for K = 1536, L1's size). */
    const long slots = M <= AMXQ_ROWS_GROUP ? 3 : -1;
    if (fill)
        for (long c = 0; c < AMXQ_AHEAD && c < chunks; c++) unpack_record(records + c * rec, q8, tiles + (c & slots) * 512);
    for (long base = 0; base < chunks + 5; base += 4) {
        AMXQ_STEP(0) AMXQ_STEP(1) AMXQ_STEP(2) AMXQ_STEP(3)
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(y + (m0 + r) * N + nb * 16, _mm512_add_ps(acc[r], b));
}

/* Outputs nb * 16 .. nb * 16 + 15 of all M rows, 16 rows at a time (the block's tiles unpacked once). */
AMXQ_TARGET static void amxq_block(const uint16_t *parts, const float *sums, long M, const uint8_t *w, int q8,
                                   float *y, const float *bias, long K, long N, long nb, uint16_t *tiles,
                                   long *configured) {
    const uint8_t *records = w + nb * (K / 32) * AMXQ_RECORD(q8);
    for (long m0 = 0; m0 < M; m0 += AMXQ_ROWS_GROUP) {
        const long rows = M - m0 < AMXQ_ROWS_GROUP ? M - m0 : AMXQ_ROWS_GROUP;
        if (rows != *configured) {
            tile_config config;
            configure(&config, rows);
            _tile_loadconfig(&config);
            *configured = rows;
        }
        const int fill = m0 == 0;
        switch (rows) {
#define AMXQ_CASE(R) case R: amxq_rows(parts, sums, M, m0, records, q8, y, bias, K, N, nb, tiles, fill, R); break;
        AMXQ_CASE(1) AMXQ_CASE(2) AMXQ_CASE(3) AMXQ_CASE(4) AMXQ_CASE(5) AMXQ_CASE(6) AMXQ_CASE(7) AMXQ_CASE(8)
        AMXQ_CASE(9) AMXQ_CASE(10) AMXQ_CASE(11) AMXQ_CASE(12) AMXQ_CASE(13) AMXQ_CASE(14) AMXQ_CASE(15)
        AMXQ_CASE(16)
#undef AMXQ_CASE
        default: break;
        }
    }
}

AMXQ_TARGET static void amxq_blocks(const uint16_t *parts, const float *sums, long M, const uint8_t *w, int q8,
                                    float *y, const float *bias, long K, long N, long begin, long end,
                                    uint16_t *tiles) {
    if (begin >= end) return;
    long configured = 0;
    for (long nb = begin; nb < end; nb++) amxq_block(parts, sums, M, w, q8, y, bias, K, N, nb, tiles, &configured);
    _tile_release();
}

/* y[M, N] = x[M, K] @ w^T (+ bias), w from pack_amx_blocks (wt 8: Q4_1, 9: Q8_0). 1 when scratch failed. */
static int run_amx_blocks(const float *x, const uint8_t *w, int q8, float *y, const float *bias, long M, long K,
                          long N, int threads) {
    uint16_t *parts = aligned_alloc(64, (sizeof(uint16_t) * 3 * M * K + 63) / 64 * 64);
    float *sums = q8 ? NULL : malloc(sizeof(float) * (M * K / 32 > 0 ? M * K / 32 : 1));
    if (!parts || (!q8 && !sums)) {
        free(parts); free(sums);
        return 1;
    }
    split3_sums(x, parts, sums, M, K);
    const long blocks = N / 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        const long bytes = K / 32 * 1024;
        if (amxq_tiles_size < bytes) {
            free(amxq_tiles);
            amxq_tiles = aligned_alloc(64, bytes);
            amxq_tiles_size = amxq_tiles ? bytes : 0;
        }
        if (!amxq_tiles) {
            failed = 1;
        } else {
            long begin, end;
            my_blocks(blocks, 1, &begin, &end);
            amxq_blocks(parts, sums, M, w, q8, y, bias, K, N, begin, end, amxq_tiles);
        }
    }
    free(parts); free(sums);
    return failed;
}

#else
int amx_init(void) { return 0; }
long pack_amx_blocks(const uint8_t *raw, uint8_t *out, long N, long K, int q8) {
    (void)raw; (void)out; (void)N; (void)K; (void)q8;
    return -1;
}
static int run_amx_blocks(const float *x, const uint8_t *w, int q8, float *y, const float *bias, long M, long K,
                          long N, int threads) {
    (void)x; (void)w; (void)q8; (void)y; (void)bias; (void)M; (void)K; (void)N; (void)threads;
    return 1;
}

void pack_amx(const uint16_t *w, uint16_t *out, long N, long K) { (void)w; (void)out; (void)N; (void)K; }
void pack_amx_i8(const int8_t *q, const float *scales, int8_t *out, long N, long K) {
    (void)q; (void)scales; (void)out; (void)N; (void)K;
}
static int run_amx_i8(const float *x, const int8_t *w, float *y, const float *bias, long M, long K, long N,
                      int threads) {
    (void)x; (void)w; (void)y; (void)bias; (void)M; (void)K; (void)N; (void)threads;
    return 1;
}
static int run_amx(const float *x, const uint16_t *w, float *y, const float *bias, long M, long K, long N,
                   int threads) {
    (void)x; (void)w; (void)y; (void)bias; (void)M; (void)K; (void)N; (void)threads;
    return 1;
}
#endif



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

/* ---- one whole decoder layer for few new tokens --------------------------------------------------
 *
 * Decoding runs a layer as ~20 small torch ops whose dispatch costs more than their arithmetic at
 * these sizes (the embedded target: ~5 of 8.5 ms per token). decoder_layer does the same arithmetic
 * in one call: x += attn(norm(x)); x += mlp(norm(x)), for B batch rows of T new tokens each (M = B * T
 * rows of x, row m = b * T + t), writing the new keys/values into the KV cache.
 *
 * Cache layout of the layer: keys/values (B, Hkv, max_len, D), contiguous per row; new token t of row b
 * goes to slot lengths[b] + t. Token (b, t) attends to the slots s < S with mask[(b * T + t) * S + s]
 * != 0, or, when mask is NULL, causally: to the slots s <= lengths[b] + t (its row's prefix, the
 * pass's earlier tokens of that row and itself; trees and staged nodes pass a mask). Each
 * query row is computed on its own with slots in ascending order, so a token's output does not depend
 * on which other tokens share the call (like the projections above).
 *
 * Returns 0, or 1 when its scratch memory could not be allocated (nothing written then).
 * Weight types (see run), 4 bits each in wtypes: bits 0-3 qkv, 4-7 o, 8-11 gate|up, 12-15 down. qkv is (q | k | v) rows,
 * gate|up is (gate | up) rows. cos/sin: (M, D) rotate-half tables already gathered per token. */

static void rotate(float *v, const float *cos, const float *sin, long D) {
    long half = D / 2;
    for (long d = 0; d < half; d++) {
        float a = v[d], b = v[d + half];
        v[d] = a * cos[d] - b * sin[d];
        v[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* Eight keys' 8-lane accumulators reduced together (a transpose of horizontal adds instead of 8
 * separate horizontal sums): lane i of the result is key i's sum, a fixed tree over its own lanes. */
INLINE __m256 reduce8(const __m256 acc[8]) {
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* q . k[i] for 8 keys at once (n % 8 == 0): one accumulator per key, reduced by reduce8. */
INLINE __m256 dot8(const float *q, const float *const k[8], long n) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (long d = 0; d < n; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), acc[i]);
    }
    return reduce8(acc);
}

/* exp(x) lane by lane, |relative error| ~2e-7 for x in [-87, 88] (inputs are clamped there): x = n ln2 + r
 * with |r| <= ln2 / 2 (ln2 split in two for the reduction), exp(r) by the degree-6 minimax polynomial
 * of the Cephes library's expf, 2^n through the exponent bits. One body for 8 lanes (exp8) and 16
 * (exp16), P the intrinsics' prefix: the same operations, so each lane gets the same result in both
 * widths (cvtps2dq rounds to nearest under the default MXCSR in both). */
#define EXP_LANES(V, VI, P, ROUND, CAST)                                                                \
    x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                             \
    const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                                 \
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                    \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                               \
    r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                              \
    V p = P##_set1_ps(1.9875691500e-4f);                                                                \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                              \
    p = P##_add_ps(P##_fmadd_ps(p, P##_mul_ps(r, r), r), P##_set1_ps(1.0f));                            \
    const VI scale = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);        \
    return P##_mul_ps(p, CAST(scale));

INLINE __m256 exp8(__m256 x) { EXP_LANES(__m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps) }

/* exp over n floats in place (any n: the tail goes through a padded copy). */
static void exp_in_place(float *v, long n, float shift) {
    long j = 0;
    const __m256 sv = _mm256_set1_ps(shift);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(v + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + j), sv)));
    if (j < n) {
        float tail[8] = {0};
        for (long i = j; i < n; i++) tail[i - j] = v[i];
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), sv)));
        for (long i = j; i < n; i++) v[i] = tail[i - j];
    }
}

/* add_values for ``lanes`` x 8 dimensions from d0 on; inlined with a constant ``lanes`` (8 for each
 * whole 64 dimensions), so that the accumulators live in registers: with a count known only at run
 * time, GCC kept them in memory (copied in with rep movsq and flagged per store; SmolLM2's 8-token pass
 * after 3000 tokens took 148.5 instead of 123.7 ms on the AVX2 EPYC). Returns the cursor after the
 * query's weights for these slots. */
INLINE long add_value_lanes(const float *row, float *out, long from, const float *vbase, const long *slots,
                            const uint8_t *seen, long j0, long last, long D, long d0, const long lanes) {
    __m256 acc[8];
    long at = from;  /* the next of the query's weights */
    for (long c = 0; c < lanes; c++) acc[c] = _mm256_loadu_ps(out + d0 + 8 * c);
    for (long j = j0; j < last; j++) {
        if (seen && !seen[slots[j]]) continue;
        const __m256 p = _mm256_set1_ps(row[at++]);
        const float *v = vbase + slots[j] * D + d0;
        for (long c = 0; c < lanes; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (long c = 0; c < lanes; c++) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
    return at;
}

/* Values of one query's weights added into its output (att), slots j0 .. last - 1 in ascending order,
 * those it sees (seen: its mask row over slots, NULL when causal and last already caps them); cursor is
 * the index of its next weight in the compacted row. 8 accumulators in registers per 64 dimensions. */
static void add_values(const float *row, float *out, long *cursor, const float *vbase, const long *slots,
                       const uint8_t *seen, long j0, long last, long D) {
    const long from = *cursor;
    long at = from;
    for (long d0 = 0; d0 < D; d0 += 64)
        at = D - d0 >= 64 ? add_value_lanes(row, out, from, vbase, slots, seen, j0, last, D, d0, 8)
                          : add_value_lanes(row, out, from, vbase, slots, seen, j0, last, D, d0, (D - d0) / 8);
    *cursor = at;
}

#ifndef KV_PREFETCH  /* -DKV_PREFETCH=N tries another distance in slots (experiments/kernel_ab.py WORK:-D...) */
#define KV_PREFETCH 16
#endif

/* Every cache line of the key or value vectors (D floats each) at slots[from .. to - 1] (to capped at n)
 * into L2: the scores and the value sums each stream the cache once, KV_PREFETCH slots ahead. */
static void prefetch_slots(const float *base, const long *slots, long from, long to, long n, long D) {
    if (KV_PREFETCH <= 0) return;  /* -DKV_PREFETCH=0: none */
    for (long j = from; j < (to < n ? to : n); j++)
        for (long d = 0; d < D; d += 16) _mm_prefetch((const char *)(base + slots[j] * D + d), _MM_HINT_T1);
}

/* Attention pairs (AVX-512): two queries' 8-lane accumulators side by side in one 512-bit register, each
 * half doing exactly what dot8 and add_values do for one query (the same FMAs on the same lanes in the
 * same order), so results are bit-identical to the 8-lane code with half the FMA instructions. On by
 * default where the AVX-512 loop is on; set_attention_pairs switches it (A/B runs and tests). */
static int attend_pairs = 1;

#ifndef VERISPEC_NO_AVX512
/* One level of reduce8's tree for two queries at once: lanes of a and b (each 8 lanes of query A, then 8
 * of query B) summed in adjacent pairs, a's sums before b's within each query's half. Three levels over
 * 8 keys' accumulators give, per query, reduce8's sums: the same additions in the same tree. */
INLINE512 __m512 pair_sums(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 17, 19, 21, 23, 9, 11, 13, 15, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

/* The scores of queries 0 .. 2 * (queries / 2) - 1 (query q: head q % group of token q / group, its row
 * q of scores) against the n visible slots, two queries per 512-bit register: per query exactly dot8's
 * FMAs and reduce8's additions (pair_sums), times scale. Causally (rows NULL) a pair skips the 8 slots
 * that neither of its tokens sees; scores a token does not see are written but never read. Returns the
 * number of queries done. */
AVX512_TARGET static long scores_pairs(const float *qkv, long b, long T, long g, long group, long width, long D,
                                       const float *kbase, const long *slots, long n, long stride,
                                       long length, int causal, float scale, float *scores) {
    const long done = T * group / 2 * 2;
    const __m512 sv = _mm512_set1_ps(scale);
    for (long j = 0; j < n; j += 8) {
        prefetch_slots(kbase, slots, j + KV_PREFETCH, j + KV_PREFETCH + 8, n, D);
        const float *k[8];
        for (int i = 0; i < 8; i++) k[i] = kbase + slots[j + i < n ? j + i : n - 1] * D;
        for (long q = 0; q < done; q += 2) {
            if (causal && j > length + (q + 1) / group) continue;
            const float *qa = qkv + (b * T + q / group) * width + (g * group + q % group) * D;
            const float *qb = qkv + (b * T + (q + 1) / group) * width + (g * group + (q + 1) % group) * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (long d = 0; d < D; d += 8) {
                const __m512 qv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + d)),
                                                     _mm256_loadu_ps(qb + d), 1);
#define KEY(i) _mm512_broadcast_f32x8(_mm256_loadu_ps(k[i] + d))
                a0 = _mm512_fmadd_ps(qv, KEY(0), a0);
                a1 = _mm512_fmadd_ps(qv, KEY(1), a1);
                a2 = _mm512_fmadd_ps(qv, KEY(2), a2);
                a3 = _mm512_fmadd_ps(qv, KEY(3), a3);
                a4 = _mm512_fmadd_ps(qv, KEY(4), a4);
                a5 = _mm512_fmadd_ps(qv, KEY(5), a5);
                a6 = _mm512_fmadd_ps(qv, KEY(6), a6);
                a7 = _mm512_fmadd_ps(qv, KEY(7), a7);
#undef KEY
            }
            const __m512 sums = _mm512_mul_ps(pair_sums(pair_sums(pair_sums(a0, a1), pair_sums(a2, a3)),
                                                        pair_sums(pair_sums(a4, a5), pair_sums(a6, a7))), sv);
            _mm256_storeu_ps(scores + q * stride + j, _mm512_castps512_ps256(sums));
            _mm256_storeu_ps(scores + (q + 1) * stride + j, _mm512_extractf32x8_ps(sums, 1));
        }
    }
    return done;
}

/* add_values with 16 lanes: each output dimension is its own chain of FMAs in slot order, so 512-bit
 * registers give add_values' results bit for bit with half the instructions (D % 16 == 8: the last 8
 * dimensions in a 256-bit register). */
AVX512_TARGET static void add_values16(const float *row, float *out, long *cursor, const float *vbase,
                                       const long *slots, const uint8_t *seen, long j0, long last, long D) {
    const long from = *cursor;
    long at = from;
    for (long d0 = 0; d0 < D; d0 += 64) {
        const long wide = D - d0 < 64 ? (D - d0) / 16 : 4, tail = D - d0 < 64 && (D - d0) % 16;
        __m512 acc[4];
        __m256 rest = tail ? _mm256_loadu_ps(out + d0 + 16 * wide) : _mm256_setzero_ps();
        at = from;
        for (long c = 0; c < wide; c++) acc[c] = _mm512_loadu_ps(out + d0 + 16 * c);
        for (long j = j0; j < last; j++) {
            if (seen && !seen[slots[j]]) continue;
            const float *v = vbase + slots[j] * D + d0;
            const __m512 p = _mm512_set1_ps(row[at++]);
            if (wide == 4)
                for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]);
            else
                for (long c = 0; c < wide; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]);
            if (tail) rest = _mm256_fmadd_ps(_mm512_castps512_ps256(p), _mm256_loadu_ps(v + 16 * wide), rest);
        }
        for (long c = 0; c < wide; c++) _mm512_storeu_ps(out + d0 + 16 * c, acc[c]);
        if (tail) _mm256_storeu_ps(out + d0 + 16 * wide, rest);
    }
    *cursor = at;
}

/* add_values for two queries that see the same slots (two q heads of one token) in one 512-bit register
 * per 8 dimensions (query a's lanes, then b's): one weight cursor for both. */
AVX512_TARGET static void add_values_pair(const float *row_a, const float *row_b, float *out_a, float *out_b,
                                          long *cursor_a, long *cursor_b, const float *vbase, const long *slots,
                                          const uint8_t *seen, long j0, long last, long D) {
    const long from = *cursor_a;
    long at = from;
    for (long d0 = 0; d0 < D; d0 += 64) {
        const long lanes = D - d0 < 64 ? (D - d0) / 8 : 8;
        __m512 acc[8];
        at = from;
        for (long c = 0; c < lanes; c++)
            acc[c] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(out_a + d0 + 8 * c)),
                                        _mm256_loadu_ps(out_b + d0 + 8 * c), 1);
        for (long j = j0; j < last; j++) {
            if (seen && !seen[slots[j]]) continue;
            const __m512 p = _mm512_insertf32x8(_mm512_set1_ps(row_a[at]), _mm256_set1_ps(row_b[at]), 1);
            at++;
            const float *v = vbase + slots[j] * D + d0;
            if (lanes == 8)
                for (int c = 0; c < 8; c++)
                    acc[c] = _mm512_fmadd_ps(p, _mm512_broadcast_f32x8(_mm256_loadu_ps(v + 8 * c)), acc[c]);
            else
                for (long c = 0; c < lanes; c++)
                    acc[c] = _mm512_fmadd_ps(p, _mm512_broadcast_f32x8(_mm256_loadu_ps(v + 8 * c)), acc[c]);
        }
        for (long c = 0; c < lanes; c++) {
            _mm256_storeu_ps(out_a + d0 + 8 * c, _mm512_castps512_ps256(acc[c]));
            _mm256_storeu_ps(out_b + d0 + 8 * c, _mm512_extractf32x8_ps(acc[c], 1));
        }
    }
    *cursor_a = *cursor_b = at;
}

INLINE512 __m512 exp16(__m512 x) { EXP_LANES(__m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps) }

/* exp_in_place over whole groups of 16, the rest (fewer than 16) by exp_in_place: the same values. */
AVX512_TARGET static void exp_in_place16(float *v, long n, float shift) {
    long j = 0;
    const __m512 sv = _mm512_set1_ps(shift);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(v + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(v + j), sv)));
    exp_in_place(v + j, n - j, shift);
}
#else
static long scores_pairs(const float *qkv, long b, long T, long g, long group, long width, long D,
                         const float *kbase, const long *slots, long n, long stride, long length, int causal,
                         float scale, float *scores) {
    (void)qkv; (void)b; (void)T; (void)g; (void)group; (void)width; (void)D; (void)kbase; (void)slots; (void)n;
    (void)stride; (void)length; (void)causal; (void)scale; (void)scores;
    return 0;
}
static void add_values16(const float *row, float *out, long *cursor, const float *vbase, const long *slots,
                         const uint8_t *seen, long j0, long last, long D) {
    (void)row; (void)out; (void)cursor; (void)vbase; (void)slots; (void)seen; (void)j0; (void)last; (void)D;
}
static void exp_in_place16(float *v, long n, float shift) { exp_in_place(v, n, shift); }
static void add_values_pair(const float *row_a, const float *row_b, float *out_a, float *out_b, long *cursor_a,
                            long *cursor_b, const float *vbase, const long *slots, const uint8_t *seen, long j0,
                            long last, long D) {
    (void)row_a; (void)row_b; (void)out_a; (void)out_b; (void)cursor_a; (void)cursor_b; (void)vbase; (void)slots;
    (void)seen; (void)j0; (void)last; (void)D;
}
#endif

/* Turn attention pairs on (1) or off (0) for later calls; returns whether they now run (only with the
 * AVX-512 loop on). Results are the same either way. */
int set_attention_pairs(int on) {
    attend_pairs = on;
    return attend_pairs && use_avx512;
}

/* Attention of row b's T new tokens to KV head g with its q heads (att rows b * T + t). Each key and
 * value vector is read once for all T x group queries, so verifying T tokens moves about as much of
 * the cache as decoding one: first the scores of every slot visible to any of the tokens, then per
 * query a softmax over its own visible slots, then the weighted values in blocks of VALUE_BLOCK slots
 * that stay in L1 while every query adds its share.
 * A query's arithmetic does not depend on the others: a key's score is dot8's, whose reduction uses
 * only that key's lanes (the last group of 8 is padded by repeating a key); each query's visible
 * scores are moved to the front of its row, in slot order, before the softmax, so its max, its sum
 * (8 lanes over that compact list) and its weights see only its own slots; the value sum runs over
 * them in ascending order (held in att between blocks, which is exact). So a token's output is the
 * same whatever shares the call. With the AVX-512 loop on (and set_attention_pairs), the scores, the
 * exponentials and the value sums run on 512-bit registers holding two queries or 16 dimensions,
 * operation for operation as the 8-lane code (scores_pairs, exp_in_place16, add_values_pair,
 * add_values16): the same bits, fewer instructions.
 * Scratch: scores (S + 8) x group x T floats, slots S + 8 longs, cursors group x T longs. */
#define VALUE_BLOCK 32
static void attend_row(const float *qkv, float *att, const float *keys, const float *values, long b, long g,
                       long T, long heads, long kv_heads, long D, long max_len, const long *lengths, long S,
                       const uint8_t *mask, float scale, float *scores, long *slots, long *cursors) {
    const long group = heads / kv_heads, width = (heads + 2 * kv_heads) * D;
    const float *kbase = keys + (b * kv_heads + g) * max_len * D;
    const float *vbase = values + (b * kv_heads + g) * max_len * D;
    const uint8_t *rows = mask ? mask + b * T * S : NULL;  /* token t sees slot s if rows[t * S + s] */
    long n = 0;  /* slots visible to any token, ascending */
    if (rows) {
        for (long s = 0; s < S; s++)
            for (long t = 0; t < T; t++)
                if (rows[t * S + s]) { slots[n++] = s; break; }
    } else {
        n = lengths[b] + T;  /* causally token t sees slots 0 .. lengths[b] + t */
        for (long s = 0; s < n; s++) slots[s] = s;
    }
    const long stride = (n + 7) / 8 * 8;
#define QUERY(t, i) (qkv + (b * T + (t)) * width + (g * group + (i)) * D)
#define SEES(t, j) (rows ? rows[(t) * S + slots[j]] != 0 : (j) <= lengths[b] + (t))
    const int pairs = attend_pairs && use_avx512;
    /* query q is head q % group of token q / group; its scores are row q */
    const long paired = pairs ? scores_pairs(qkv, b, T, g, group, width, D, kbase, slots, n, stride,
                                             rows ? 0 : lengths[b], !rows, scale, scores) : 0;
    for (long j = 0; paired < T * group && j < n; j += 8) {  /* the queries left unpaired, one at a time */
        if (!paired) prefetch_slots(kbase, slots, j + KV_PREFETCH, j + KV_PREFETCH + 8, n, D);
        const float *k[8];
        for (int i = 0; i < 8; i++) k[i] = kbase + slots[j + i < n ? j + i : n - 1] * D;
        for (long q = paired; q < T * group; q++) {
            if (!rows && j > lengths[b] + q / group) continue;  /* causal: none of these 8 visible */
            _mm256_storeu_ps(scores + q * stride + j, _mm256_mul_ps(dot8(QUERY(q / group, q % group), k, D),
                                                                    _mm256_set1_ps(scale)));
        }
    }
    prefetch_slots(vbase, slots, 0, VALUE_BLOCK, n, D);  /* the first block of values, during the softmax */
    for (long t = 0; t < T; t++)
        for (long i = 0; i < group; i++) {  /* softmax over the query's own visible slots, compacted */
            float *row = scores + (t * group + i) * stride;
            long count = 0;
            if (rows) {
                for (long j = 0; j < n; j++)
                    if (SEES(t, j)) row[count++] = row[j];
            } else {
                count = lengths[b] + t + 1;
            }
            const long whole = count / 8 * 8;
            for (long j = count; j < (count + 7) / 8 * 8; j++) row[j] = -INFINITY;  /* pad: exp gives 0 */
            __m256 top8 = _mm256_set1_ps(-INFINITY);
            for (long j = 0; j < count; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
            float lanes[8], top = -INFINITY;
            _mm256_storeu_ps(lanes, top8);
            for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
            (pairs ? exp_in_place16 : exp_in_place)(row, count, top);
            for (long j = count; j < (count + 7) / 8 * 8; j++) row[j] = 0.0f;
            __m256 sum8 = _mm256_setzero_ps();
            for (long j = 0; j < count; j += 8) sum8 = _mm256_add_ps(sum8, _mm256_loadu_ps(row + j));
            const float total = hsum(sum8);  /* weights: divided exactly, 8 lanes or one at a time alike */
            for (long j = 0; j < whole; j += 8)
                _mm256_storeu_ps(row + j, _mm256_div_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(total)));
            for (long j = whole; j < count; j++) row[j] /= total;
            memset(att + (b * T + t) * heads * D + (g * group + i) * D, 0, sizeof(float) * D);
            cursors[t * group + i] = 0;
        }
    for (long j0 = 0; j0 < n; j0 += VALUE_BLOCK) {
        const long j1 = j0 + VALUE_BLOCK < n ? j0 + VALUE_BLOCK : n;
        prefetch_slots(vbase, slots, j1, j1 + VALUE_BLOCK, n, D);  /* the next block, while this one is summed */
        for (long t = 0; t < T; t++) {
            const long last = rows ? j1 : (j1 < lengths[b] + t + 1 ? j1 : lengths[b] + t + 1);
            const uint8_t *seen = rows ? rows + t * S : NULL;
#define OUT(i) (att + (b * T + t) * heads * D + (g * group + (i)) * D)
            long i = 0;
            for (; pairs && i + 1 < group; i += 2)  /* two heads of token t see the same slots */
                add_values_pair(scores + (t * group + i) * stride, scores + (t * group + i + 1) * stride, OUT(i),
                                OUT(i + 1), cursors + t * group + i, cursors + t * group + i + 1, vbase, slots,
                                seen, j0, last, D);
            for (; i < group; i++)
                if (pairs)
                    add_values16(scores + (t * group + i) * stride, OUT(i), cursors + t * group + i, vbase, slots,
                                 seen, j0, last, D);
                else
                    add_values(scores + (t * group + i) * stride, OUT(i), cursors + t * group + i, vbase, slots,
                               seen, j0, last, D);
#undef OUT
        }
    }
#undef QUERY
#undef SEES
}

/* Scratch memory for decoder_layer, kept per calling thread and grown as needed, never given back: a
 * layer's buffers (about 160 KB for SmolLM2 at 5 rows) allocated and freed per layer crossed glibc's
 * heap-trim threshold (128 KB) from 5 rows on, so every layer returned the heap top to the kernel and
 * faulted it back in (verify(5) 1.4-1.6x verify(4) in some processes, against 1.22x for the products). */
static __thread char *scratch_base = NULL;
static __thread size_t scratch_size = 0;

static void *scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_base);
        scratch_size = (bytes + 4095) / 4096 * 4096;
        scratch_base = aligned_alloc(64, scratch_size);
        if (!scratch_base) scratch_size = 0;
    }
    return scratch_base;
}

/* Bytes of n elements of ``size`` rounded up to a cache line, so that each scratch buffer starts on one. */
static size_t lines(size_t n, size_t size) { return (n * size + 63) / 64 * 64; }

int decoder_layer(float *x, long B, long T, long H, long heads, long kv_heads, long D, long I, float eps,
                   const float *attn_norm, const void *w_qkv, const float *b_qkv, const void *w_o,
                   const float *b_o, const float *mlp_norm, const void *w_gu, const float *b_gu,
                   const void *w_down, const float *b_down, int wtypes, const float *cos,
                   const float *sin, float *keys, float *values, long max_len, const long *lengths, long S,
                   const uint8_t *mask, int threads) {
    const long M = B * T, width = (heads + 2 * kv_heads) * D, group = heads / kv_heads;
    const long teams = threads > 1 ? threads : 1;  /* attention scratch per thread */
    const size_t sizes[9] = {lines(M * H, 4), lines(M * width, 4), lines(M * heads * D, 4), lines(M * H, 4),
                             lines(M * 2 * I, 4), lines(M * I, 4), lines((S + 8) * group * T * teams, 4),
                             lines((S + 8) * teams, sizeof(long)), lines(group * T * teams, sizeof(long))};
    size_t total = 0;
    for (int i = 0; i < 9; i++) total += sizes[i];
    char *base = scratch(total);
    if (!base) return 1;  /* out of memory: x and the cache untouched */
    char *parts[9];
    for (int i = 0; i < 9; i++) {
        parts[i] = base;
        base += sizes[i];
    }
    float *h = (float *)parts[0], *qkv = (float *)parts[1], *att = (float *)parts[2], *o = (float *)parts[3];
    float *gu = (float *)parts[4], *act = (float *)parts[5], *all_scores = (float *)parts[6];
    long *all_slots = (long *)parts[7], *all_cursors = (long *)parts[8];

    rms_norm(x, attn_norm, h, M, H, eps);
    if (run(h, w_qkv, wtypes & 15, qkv, b_qkv, M, H, width, threads)) return 1;
    for (long m = 0; m < M; m++) {
        long b = m / T, t = m % T, slot = lengths[b] + t;
        float *row = qkv + m * width;
        for (long j = 0; j < heads + kv_heads; j++) rotate(row + j * D, cos + m * D, sin + m * D, D);
        for (long g = 0; g < kv_heads; g++) {
            long at = ((b * kv_heads + g) * max_len + slot) * D;
            memcpy(keys + at, row + (heads + g) * D, sizeof(float) * D);
            memcpy(values + at, row + (heads + kv_heads + g) * D, sizeof(float) * D);
        }
    }
    const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const long me = omp_get_thread_num();
        float *scores = all_scores + me * (S + 8) * group * T;
        long *slots = all_slots + me * (S + 8), *cursors = all_cursors + me * group * T;
#pragma omp for schedule(static)
        for (long job = 0; job < B * kv_heads; job++)  /* one row and one KV head with its q heads */
            attend_row(qkv, att, keys, values, job / kv_heads, job % kv_heads, T, heads, kv_heads, D, max_len,
                       lengths, S, mask, scale, scores, slots, cursors);
    }
    if (run(att, w_o, (wtypes >> 4) & 15, o, b_o, M, heads * D, H, threads))
        return 1;  /* the cache already holds this pass's keys and values: the caller raises */
    for (long i = 0; i < M * H; i++) x[i] += o[i];

    rms_norm(x, mlp_norm, h, M, H, eps);
    if (run(h, w_gu, (wtypes >> 8) & 15, gu, b_gu, M, H, 2 * I, threads)) return 1;
    for (long m = 0; m < M; m++)  /* SiLU(gate) * up, 8 lanes (I % 8 == 0: the down projection's K) */
        for (long i = 0; i < I; i += 8) {
            const __m256 gate = _mm256_loadu_ps(gu + m * 2 * I + i), up = _mm256_loadu_ps(gu + m * 2 * I + I + i);
            const __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate)));
            _mm256_storeu_ps(act + m * I + i, _mm256_mul_ps(_mm256_div_ps(gate, sig), up));
        }
    if (run(act, w_down, (wtypes >> 12) & 15, o, b_down, M, I, H, threads)) return 1;
    for (long i = 0; i < M * H; i++) x[i] += o[i];
    return 0;
}

/* One decoder layer's weights for ``decoder_layers`` (the arguments ``decoder_layer`` takes per layer). */
typedef struct {
    const float *attn_norm;
    const void *w_qkv;
    const float *b_qkv;
    const void *w_o;
    const float *b_o;
    const float *mlp_norm;
    const void *w_gu;
    const float *b_gu;
    const void *w_down;
    const float *b_down;
    long wtypes;
} layer_weights;

/* Layers 0 .. count - 1 of ``layers`` in turn, as ``decoder_layer`` each, in one call: a pass of few
 * rows otherwise pays Python's per-layer dispatch (~10-15 us a layer on the Xeon, a draft layer's own
 * arithmetic is ~30 us). Layer i's cache is keys / values + i * layer_stride. Returns the first
 * failing layer's status (layers before it are applied). */
int decoder_layers(float *x, long B, long T, long H, long heads, long kv_heads, long D, long I, float eps,
                   const layer_weights *layers, long count, const float *cos, const float *sin, float *keys,
                   float *values, long layer_stride, long max_len, const long *lengths, long S,
                   const uint8_t *mask, int threads) {
    for (long i = 0; i < count; i++) {
        const layer_weights *l = layers + i;
        int status = decoder_layer(x, B, T, H, heads, kv_heads, D, I, eps, l->attn_norm, l->w_qkv, l->b_qkv,
                                   l->w_o, l->b_o, l->mlp_norm, l->w_gu, l->b_gu, l->w_down, l->b_down,
                                   (int)l->wtypes, cos, sin, keys + i * layer_stride, values + i * layer_stride,
                                   max_len, lengths, S, mask, threads);
        if (status) return status;
    }
    return 0;
}

/* A whole model pass of one row of T tokens in one call: embedding rows, layers (``decoder_layers``),
 * the final norm and the LM head, for the last token (last_only) or every token. What the Python
 * forward does with these same functions, so the same bits, without its per-step dispatch (a third of
 * a draft step on the Xeon). The head's first head_rows outputs are computed into logits rows of
 * vocab values; the rest are -inf (a draft limited to its first ids). With ``features`` (T x H, or NULL)
 * every token's final-normed hidden state is written there too (what the head reads). Returns 0; 2 when a token id is
 * outside 0 .. embed_rows - 1 (nothing done); 1 when scratch memory failed. The cache's length is the
 * caller's either way. */
int model_pass(const long *tokens, long T, const float *embedding, long embed_rows, long H, long heads,
               long kv_heads, long D,
               long I, float eps, const layer_weights *layers, long count, const float *cos, const float *sin,
               float *keys, float *values, long layer_stride, long max_len, const long *lengths, long S,
               const float *final_norm, float norm_eps, const void *w_head, int head_type, long head_rows,
               long vocab, int last_only, float *logits, float *features, int threads) {
    for (long t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= embed_rows) return 2;
    const long rows = last_only ? 1 : T;
    float *x = malloc(sizeof(float) * T * H), *h = features ? NULL : malloc(sizeof(float) * rows * H);
    float *part = head_rows < vocab ? malloc(sizeof(float) * rows * head_rows) : logits;
    int status = 1;
    if (!x || (!h && !features) || !part) goto done;
    for (long t = 0; t < T; t++) memcpy(x + t * H, embedding + tokens[t] * H, sizeof(float) * H);
    if (decoder_layers(x, 1, T, H, heads, kv_heads, D, I, eps, layers, count, cos, sin, keys, values, layer_stride,
                       max_len, lengths, S, NULL, threads))
        goto done;
    if (features) rms_norm(x, final_norm, features, T, H, norm_eps);  /* every token's, for a feature drafter */
    else rms_norm(x + (T - rows) * H, final_norm, h, rows, H, norm_eps);
    if (run(features ? features + (T - rows) * H : h, w_head, head_type, part, NULL, rows, H, head_rows, threads))
        goto done;
    if (part != logits)
        for (long r = 0; r < rows; r++) {
            memcpy(logits + r * vocab, part + r * head_rows, sizeof(float) * head_rows);
            for (long v = head_rows; v < vocab; v++) logits[r * vocab + v] = -INFINITY;
        }
    status = 0;
done:
    free(x); free(h);
    if (part != logits) free(part);
    return status;
}
