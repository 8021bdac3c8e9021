/* y = x W^T + bias in float32, for a weight stored in blocks of 16 output columns: [n / 16][k][16].
 *
 * The lean rollout engine's matrix product on CPUs (rlhf_core/rollout/blocked_linear.py says why and how it is
 * built; docs/rollout-engine.md has the measurements). A decode step multiplies a few rows by every weight
 * once, so what matters is streaming the weight at the memory's speed: in this layout one block is one
 * contiguous stream, each of its 64-byte rows (16 output columns at one input index) is used by every row
 * of x through a broadcast multiply-add, and the stream is prefetched well ahead of its use. The same
 * loops run a prefill's hundreds of rows near the core's peak: a tile of rows keeps one accumulator per
 * row and vector of output columns in registers, a pair of blocks (2 x k x 64 bytes) stays in the L1/L2
 * caches while every tile of rows passes over it, and the rows go in chunks of 512 KiB that stay in the L2
 * cache while every pair passes over them.
 *
 * Plain C with GCC/Clang vector extensions of the machine's own vector width (a wider vector type compiles
 * to loads and stores through the stack around every multiply-add: 16x slower than oneDNN on an AVX2
 * EPYC), compiled with -march=native on the machine that runs it. The tile is as large as the registers
 * allow, measured on SmolLM2's projections (docs/rollout-engine.md):
 * - AVX-512, 32 registers of 16 floats: 12 rows x 2 blocks, 24 accumulators;
 * - AVX2, 16 registers of 8 floats: 6 rows x 1 block, 12 accumulators; but up to 8 rows of x (a decode's
 *   batch) go in one tile of 16 accumulators, which spills a register or two yet reads each weight once
 *   (41 ms against 50 ms for 4 + 4 rows and 75 ms for 6 + 2);
 * - other 16-byte vectors: 6 rows x 1 block on AArch64 (32 registers), 3 rows x 1 block elsewhere (SSE).
 */
#include <stddef.h>

#define BLOCK 16          /* output columns per block: 64 bytes of floats */
#if defined(__AVX512F__)
#define VECTOR_FLOATS 16
#define TILE_ROWS 12      /* rows of x per register tile */
#define TILE_BLOCKS 2     /* blocks per register tile */
#define SMALL_ROWS 12     /* at most this many rows of x go in a single tile */
#elif defined(__AVX__)
#define VECTOR_FLOATS 8
#define TILE_ROWS 6
#define TILE_BLOCKS 1
#define SMALL_ROWS 8
#elif defined(__aarch64__)
#define VECTOR_FLOATS 4
#define TILE_ROWS 6
#define TILE_BLOCKS 1
#define SMALL_ROWS 6
#else
#define VECTOR_FLOATS 4
#define TILE_ROWS 3
#define TILE_BLOCKS 1
#define SMALL_ROWS 3
#endif
#define MAX_TILE_ROWS (SMALL_ROWS > TILE_ROWS ? SMALL_ROWS : TILE_ROWS)
#define PARTS (BLOCK / VECTOR_FLOATS) /* vectors per row of a block */
#define PREFETCH_STEPS 64 /* input indices ahead that each block's stream is prefetched (4 KiB) */
#define PARALLEL_WORK (1L << 20) /* multiply-adds below which one thread is faster than forking */
#define CHUNK_BYTES (512L << 10)  /* rows of x per chunk: this many bytes of them (a quarter of an L2) */

typedef float vec __attribute__((vector_size(VECTOR_FLOATS * sizeof(float))));

/* rows (1..MAX_TILE_ROWS) of x times blocks (1 or 2) of w, into y; constant arguments after
 * inlining, so the accumulators live in registers. Vector c of a row covers output columns
 * c * VECTOR_FLOATS ..: part c % PARTS of block c / PARTS. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int blocks, const float *x, long k, const float *w, long block_stride,
    const float *bias, float *y, long ldy)
{
    const int vectors = blocks * PARTS;
    vec acc[MAX_TILE_ROWS][2 * PARTS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < vectors; c++)
            acc[r][c] = bias ? *(const vec *)(bias + VECTOR_FLOATS * c) : (vec){0};
    for (long i = 0; i < k; i++) {
        vec column[2 * PARTS];
        for (int b = 0; b < blocks; b++) {
            __builtin_prefetch(w + b * block_stride + (i + PREFETCH_STEPS) * BLOCK);
            for (int p = 0; p < PARTS; p++)
                column[b * PARTS + p] = *(const vec *)(w + b * block_stride + i * BLOCK + p * VECTOR_FLOATS);
        }
        for (int r = 0; r < rows; r++) {
            const float value = x[r * k + i];
            for (int c = 0; c < vectors; c++)
                acc[r][c] += value * column[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < vectors; c++)
            __builtin_memcpy(y + r * ldy + VECTOR_FLOATS * c, &acc[r][c], sizeof(vec));
}

/* One case of the switch on a tile's rows; `blocks` is the constant 1 where TILE_BLOCKS is 1, so the
 * two-block tile is compiled only where it is used. */
#define TILE_CASE(ROWS)                                                                      \
    case ROWS:                                                                               \
        if (blocks == 2)                                                                     \
            tile(ROWS, 2, x_rows, k, w_tile, block_stride, bias_tile, y_rows, ldy);          \
        else                                                                                 \
            tile(ROWS, 1, x_rows, k, w_tile, block_stride, bias_tile, y_rows, ldy);          \
        break;

/* Rows `start` .. `end` - 1 of x against the pair of blocks `pair` (its second block may not exist), in
 * tiles of `tile_rows` rows. */
static void pair_times_rows(
    long pair, long start, long end, int tile_rows, const float *x, long k, const float *w, long n_blocks,
    const float *bias, float *y)
{
    const long block_stride = k * BLOCK, ldy = n_blocks * BLOCK;
    const long last = 2 * pair + 2 < n_blocks ? 2 * pair + 2 : n_blocks;
    for (long row = start; row < end; row += tile_rows) {
        const int rows = end - row >= tile_rows ? tile_rows : (int)(end - row);
        const float *x_rows = x + row * k;
        for (long first = 2 * pair; first < last; first += TILE_BLOCKS) {
            const int blocks = last - first >= TILE_BLOCKS ? TILE_BLOCKS : 1;
            const float *w_tile = w + first * block_stride;
            const float *bias_tile = bias ? bias + first * BLOCK : NULL;
            float *y_rows = y + row * ldy + first * BLOCK;
            switch (rows) {
                TILE_CASE(1) TILE_CASE(2) TILE_CASE(3)
#if MAX_TILE_ROWS >= 6
                TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
#endif
#if MAX_TILE_ROWS >= 8
                TILE_CASE(7) TILE_CASE(8)
#endif
#if MAX_TILE_ROWS >= 12
                TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
            }
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
    const int tile_rows = m <= SMALL_ROWS ? SMALL_ROWS : TILE_ROWS;
    long chunk = CHUNK_BYTES / (k * (long)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    chunk = chunk > TILE_ROWS ? chunk : TILE_ROWS;
    for (long start = 0; start < m; start += chunk) {
        const long end = m - start > chunk ? start + chunk : m;
        const int parallel = threads > 1 && (end - start) * k * n_blocks * BLOCK >= PARALLEL_WORK;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
        for (long pair = 0; pair < pairs; pair++)
            pair_times_rows(pair, start, end, tile_rows, x, k, w, n_blocks, bias, y);
    }
}
