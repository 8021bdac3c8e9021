/* y = x W^T + bias in float32, for a weight stored in blocks of 16 output columns: [n / 16][k][16].
 *
 * The lean rollout engine's matrix product on CPUs (rlhf_core/ppo/blocked_linear.py says why and how it is
 * built; docs/rollout-engine.md has the measurements). A decode step multiplies a few rows by every weight
 * once, so what matters is streaming the weight at the memory's speed: in this layout one block is one
 * contiguous stream, each of its 64-byte rows (16 output columns at one input index) is used by every row
 * of x through a broadcast multiply-add, and the stream is prefetched well ahead of its use. The same
 * loops run a prefill's hundreds of rows near the core's peak: a tile of 12 rows x 2 blocks keeps 24
 * accumulators in AVX-512's 32 registers (3 rows on machines with fewer, wider-split ones), a pair of
 * blocks (2 x k x 64 bytes) stays in the L1/L2 caches while every tile of rows passes over it, and the rows
 * go in chunks of 512 KiB that stay in the L2 cache while every pair passes over them.
 *
 * Plain C with GCC/Clang vector extensions, compiled with -march=native on the machine that runs it: a
 * 64-byte vector is one AVX-512 register, two AVX2 registers, four NEON registers.
 */
#include <stddef.h>

#define BLOCK 16          /* output columns per block: one 64-byte vector of floats */
#define MAX_TILE_ROWS 12  /* rows of x per register tile: 24 accumulators, 2 weight vectors, 1 broadcast */
#ifdef __AVX512F__
#define TILE_ROWS MAX_TILE_ROWS
#else
#define TILE_ROWS 3       /* AVX2 or NEON: a 64-byte vector takes 2 or 4 of their 16 or 32 registers */
#endif
#define PREFETCH_STEPS 64 /* input indices ahead that each block's stream is prefetched (4 KiB) */
#define PARALLEL_WORK (1L << 20) /* multiply-adds below which one thread is faster than forking */
#define CHUNK_BYTES (512L << 10)  /* rows of x per chunk: this many bytes of them (a quarter of an L2) */

typedef float vec __attribute__((vector_size(64)));

/* rows (1..TILE_ROWS) of x times blocks (1 or 2) of w, into y; constant arguments after inlining, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int blocks, const float *x, long k, const float *w, long block_stride,
    const float *bias, float *y, long ldy)
{
    vec acc[MAX_TILE_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            acc[r][b] = bias ? *(const vec *)(bias + BLOCK * b) : (vec){0};
    for (long i = 0; i < k; i++) {
        vec column[2];
        for (int b = 0; b < blocks; b++) {
            __builtin_prefetch(w + b * block_stride + (i + PREFETCH_STEPS) * BLOCK);
            column[b] = *(const vec *)(w + b * block_stride + i * BLOCK);
        }
        for (int r = 0; r < rows; r++) {
            const float value = x[r * k + i];
            for (int b = 0; b < blocks; b++)
                acc[r][b] += value * column[b];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            __builtin_memcpy(y + r * ldy + BLOCK * b, &acc[r][b], sizeof(vec));
}

#define TILE_CASE(ROWS)                                                          \
    case ROWS:                                                                   \
        if (blocks == 2)                                                         \
            tile(ROWS, 2, x_rows, k, w_pair, block_stride, bias_pair, y_rows, ldy); \
        else                                                                     \
            tile(ROWS, 1, x_rows, k, w_pair, block_stride, bias_pair, y_rows, ldy); \
        break;

/* Rows `start` .. `end` - 1 of x against the pair of blocks `pair` (its second block may not exist). */
static void pair_times_rows(
    long pair, long start, long end, const float *x, long k, const float *w, long n_blocks, const float *bias,
    float *y)
{
    const long block_stride = k * BLOCK, ldy = n_blocks * BLOCK, first = 2 * pair;
    const int blocks = n_blocks - first >= 2 ? 2 : 1;
    const float *w_pair = w + first * block_stride;
    const float *bias_pair = bias ? bias + first * BLOCK : NULL;
    for (long row = start; row < end; row += TILE_ROWS) {
        const int rows = end - row >= TILE_ROWS ? TILE_ROWS : (int)(end - row);
        const float *x_rows = x + row * k;
        float *y_rows = y + row * ldy + first * BLOCK;
        switch (rows) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
            TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
        }
    }
}

/* x [m, k] row-major; w [n_blocks, k, 16], 64-byte aligned; bias [n_blocks * 16] (64-byte aligned) or
 * NULL; y [m, n_blocks * 16]. The rows go in chunks that stay in the L2 cache while every pair of blocks
 * passes over them (a prefill's thousands of rows would otherwise be read from memory once per pair);
 * a chunk's pairs are split between `threads` OpenMP threads. */
void blocked_linear(
    const float *x, long m, long k, const float *w, long n_blocks, const float *bias, float *y, int threads)
{
    const long pairs = (n_blocks + 1) / 2;
    long chunk = CHUNK_BYTES / (k * (long)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    chunk = chunk > TILE_ROWS ? chunk : TILE_ROWS;
    for (long start = 0; start < m; start += chunk) {
        const long end = m - start > chunk ? start + chunk : m;
        const int parallel = threads > 1 && (end - start) * k * n_blocks * BLOCK >= PARALLEL_WORK;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
        for (long pair = 0; pair < pairs; pair++)
            pair_times_rows(pair, start, end, x, k, w, n_blocks, bias, y);
    }
}
