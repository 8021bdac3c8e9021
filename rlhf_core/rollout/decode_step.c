/* One decode step of a Llama-family decoder in float32: every block's small operations in C, around the
 * projections of blocked_linear.c.
 *
 * The lean rollout engine's decode step (rlhf_core/rollout/decode_step.py says why and how it is called;
 * docs/rollout-engine.md has the measurements). With the projections at the memory's speed, what was left
 * of a step in PyTorch was ~60 small operations per block (norms, rotary, the one-query attention, the
 * gated activation, residual adds, views), each a few microseconds of dispatch over a few kilobytes:
 * about a third of a SmolLM2 step on the CPUs measured. Here they are loops over the batch's rows, with
 * the arithmetic of transformers' Llama forward (modeling_llama.py) and of llama_decoder.py:
 * - RMSNorm in float32: x * 1 / sqrt(mean(x^2) + eps), then times the norm's weight;
 * - rotary embedding of q and k: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[h:], x[:h]);
 * - attention of the new column's query over the cached keys 0 .. column (left padding masked out),
 *   scaled by head_dim^-1/2, grouped-query (query head h reads kv head h / (heads / kv_heads));
 * - the gated MLP's activation silu(gate) * up; residual adds.
 * Sums are in other orders than PyTorch's (float32 rounding, ~1e-7 relative), as any two kernels'.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

/* blocked_linear.c: y = x W^T + bias for W in blocks of 16 output columns. */
void blocked_linear(
    const float *x, long m, long k, const float *w, long n_blocks, const float *bias, float *y, int threads);

#define BLOCK 16

struct linear {
    const float *blocks; /* [n_blocks, in, 16] */
    const float *bias;   /* [n_blocks * 16] or NULL */
    long n_blocks;
};

struct layer {
    const float *input_norm, *post_norm; /* [hidden] */
    struct linear qkv;                   /* q | k | v: heads, kv_heads, kv_heads x head_dim outputs */
    struct linear o;                     /* heads x head_dim -> hidden */
    struct linear gate_up;               /* gate | up: intermediate each */
    struct linear down;                  /* intermediate -> hidden */
};

struct model {
    long hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const struct layer *layer; /* one per block */
    const float *norm;         /* the final norm's weight [hidden] */
    struct linear lm_head;
};

/* A rollout's state and workspace; every array float32 and contiguous. */
struct rollout {
    long batch, length;            /* rows; cache columns (prompt + replies) */
    float *keys, *values;          /* [layers, batch, kv_heads, length, head_dim] */
    const float *cos, *sin;        /* [batch, length, head_dim] */
    const unsigned char *key_mask; /* [batch, length]: 0 on left padding; NULL when nothing is padded */
    float *capture;                /* [batch, length, hidden]: residual entering block capture_layer, or NULL */
    long capture_layer;
    /* workspace, per row: */
    float *normed;    /* [batch, hidden] */
    float *qkv;       /* [batch, qkv.n_blocks * 16] */
    float *attended;  /* [batch, heads * head_dim] */
    float *projected; /* [batch, max(o, down).n_blocks * 16] */
    float *gate_up;   /* [batch, gate_up.n_blocks * 16] */
    float *activated; /* [batch, intermediate] */
    float *scores;    /* [heads / kv_heads, length] */
};

static void rms_norm(const float *x, const float *weight, long n, float eps, float *out)
{
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (long i = 0; i < n; i++)
        squares += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(squares / (float)n + eps);
    for (long i = 0; i < n; i++)
        out[i] = weight[i] * (x[i] * inverse);
}

/* x (one head, head_dim values) rotated in place by the angles of cos/sin (head_dim each). */
static void rotate(float *x, const float *cos, const float *sin, long head_dim)
{
    const long half = head_dim / 2;
    for (long i = 0; i < half; i++) {
        const float first = x[i], second = x[i + half];
        x[i] = first * cos[i] - second * sin[i];
        x[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

static float dot(const float *a, const float *b, long n)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (long i = 0; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* The query heads that share one kv head (heads / kv_heads of them, consecutive in `query`) over that
 * head's keys and values 0 .. column in one row's cache, into `out` (those heads' places in `attended`). */
static void attend_group(
    const struct model *m, const struct rollout *r, const float *query, const float *keys, const float *values,
    const unsigned char *key_mask, long column, float *out)
{
    const long group = m->heads / m->kv_heads, dim = m->head_dim;
    const float scale = 1.0f / sqrtf((float)dim);
    for (long h = 0; h < group; h++) {
        float *scores = r->scores + h * r->length, largest = -INFINITY, total = 0.0f;
        for (long j = 0; j <= column; j++) {
            scores[j] = key_mask && !key_mask[j] ? -INFINITY : dot(query + h * dim, keys + j * dim, dim) * scale;
            largest = scores[j] > largest ? scores[j] : largest;
        }
        for (long j = 0; j <= column; j++) {
            scores[j] = expf(scores[j] - largest);
            total += scores[j];
        }
        float *head_out = out + h * dim;
        memset(head_out, 0, dim * sizeof(float));
        for (long j = 0; j <= column; j++) {
            const float weight = scores[j] / total;
            for (long i = 0; i < dim; i++)
                head_out[i] += weight * values[j * dim + i];
        }
    }
}

/* Rotary embedding of the new column's q and k, k and v written to the cache, and the attention of every
 * row, into r->attended. */
static void attention(const struct model *m, const struct rollout *r, long layer, long column)
{
    const long heads = m->heads, kv_heads = m->kv_heads, dim = m->head_dim, group = heads / kv_heads;
    const long width = m->layer[layer].qkv.n_blocks * BLOCK;
    for (long b = 0; b < r->batch; b++) {
        float *query = r->qkv + b * width, *key = query + heads * dim, *value = key + kv_heads * dim;
        const float *cos = r->cos + (b * r->length + column) * dim, *sin = r->sin + (b * r->length + column) * dim;
        for (long h = 0; h < heads; h++)
            rotate(query + h * dim, cos, sin, dim);
        for (long g = 0; g < kv_heads; g++) {
            const long offset = ((layer * r->batch + b) * kv_heads + g) * r->length * dim;
            rotate(key + g * dim, cos, sin, dim);
            memcpy(r->keys + offset + column * dim, key + g * dim, dim * sizeof(float));
            memcpy(r->values + offset + column * dim, value + g * dim, dim * sizeof(float));
            attend_group(
                m, r, query + g * group * dim, r->keys + offset, r->values + offset,
                r->key_mask ? r->key_mask + b * r->length : NULL, column,
                r->attended + (b * heads + g * group) * dim);
        }
    }
}

static void linear(const struct linear *l, const float *x, long rows, long in, float *y, int threads)
{
    blocked_linear(x, rows, in, l->blocks, l->n_blocks, l->bias, y, threads);
}

/* x[b] += delta[b] for every row; delta's rows are `stride` floats apart. */
static void add_rows(float *x, const float *delta, long rows, long n, long stride)
{
    for (long b = 0; b < rows; b++)
        for (long i = 0; i < n; i++)
            x[b * n + i] += delta[b * stride + i];
}

static void keep_residual(const struct model *m, const struct rollout *r, const float *x, long column)
{
    for (long b = 0; b < r->batch; b++)
        memcpy(r->capture + (b * r->length + column) * m->hidden, x + b * m->hidden, m->hidden * sizeof(float));
}

static void block(const struct model *m, const struct rollout *r, long index, long column, float *x, int threads)
{
    const struct layer *l = m->layer + index;
    const long rows = r->batch, hidden = m->hidden, intermediate = m->intermediate;
    for (long b = 0; b < rows; b++)
        rms_norm(x + b * hidden, l->input_norm, hidden, m->eps, r->normed + b * hidden);
    linear(&l->qkv, r->normed, rows, hidden, r->qkv, threads);
    attention(m, r, index, column);
    linear(&l->o, r->attended, rows, m->heads * m->head_dim, r->projected, threads);
    add_rows(x, r->projected, rows, hidden, l->o.n_blocks * BLOCK);
    for (long b = 0; b < rows; b++)
        rms_norm(x + b * hidden, l->post_norm, hidden, m->eps, r->normed + b * hidden);
    linear(&l->gate_up, r->normed, rows, hidden, r->gate_up, threads);
    const long width = l->gate_up.n_blocks * BLOCK;
    for (long b = 0; b < rows; b++) {
        const float *gate = r->gate_up + b * width, *up = gate + intermediate;
        float *out = r->activated + b * intermediate;
        for (long i = 0; i < intermediate; i++)
            out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    linear(&l->down, r->activated, rows, intermediate, r->projected, threads);
    add_rows(x, r->projected, rows, hidden, l->down.n_blocks * BLOCK);
}

/* One new column: x [batch, hidden] holds its tokens' embeddings and leaves with the residual stream after
 * blocks 0 .. run_layers - 1; their keys and values are written at cache column `column`, and with a
 * capture the residual entering block capture_layer is kept. With `logits` ([batch, lm_head.n_blocks * 16])
 * the final norm and the LM head follow. */
void decode_step(
    const struct model *m, const struct rollout *r, long column, float *x, long run_layers, float *logits,
    int threads)
{
    for (long index = 0; index < run_layers; index++) {
        if (r->capture && index == r->capture_layer)
            keep_residual(m, r, x, column);
        block(m, r, index, column, x, threads);
    }
    if (r->capture && r->capture_layer == run_layers)
        keep_residual(m, r, x, column);
    if (logits == NULL)
        return;
    for (long b = 0; b < r->batch; b++)
        rms_norm(x + b * m->hidden, m->norm, m->hidden, m->eps, r->normed + b * m->hidden);
    linear(&m->lm_head, r->normed, r->batch, m->hidden, logits, threads);
}
