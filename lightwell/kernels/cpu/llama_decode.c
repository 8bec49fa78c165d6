/* A Llama-shaped model's decode step in one call, for lightwell/kernels/cpu/llama_decode.py.
 *
 * R requests (R <= 8), one new token each: for every layer, the residual add + RMSNorm, the
 * fused QKV matmul on GGUF blocks (blocks of 32 in gguf_blocks.h, K-quant super-blocks in
 * gguf_kquant.c; a matrix may be up to MAX_SEGMENTS runs of rows of different types), the q/k/v
 * bias and per-head q/k RMSNorms where the layer has them (Qwen2, Qwen3), RoPE (neox halves, from the model's cos/sin
 * table), the K/V store into the paged float32 cache, attention over each request's cached keys
 * (its block table; the query heads of a KV head together, the keys in up to KV_SPLITS ranges
 * whose softmax partials are merged), the output matmul, the residual add + RMSNorm, the
 * gate/up matmul with silu(gate) * up, the down matmul; then the final residual add + RMSNorm
 * and, when the model has one here, the LM head on GGUF blocks (logits [R, V]) and each
 * request's greedy token (the first index of the largest logit).
 * The whole step is one OpenMP parallel region of a sequence of phases (per layer: the norm,
 * qkv, RoPE + store, attention ranges, their merge, o, the norm, gate/up, down). A phase is cut
 * into chunks (the matmuls' output rows, the attention's (request, KV head, range) triples and
 * (request, head) merges; one chunk for the small vector steps). Each thread owns a contiguous
 * share of a phase's chunks and takes them from its front, so each thread streams one run of
 * weight rows; a thread whose share is used up takes chunks from the back of the others'. A
 * thread starts on the next phase once every chunk of this one is done (a counter), not once
 * every thread has arrived: a thread the OS has paused between chunks holds nobody up (the
 * others take the rest of its share), and when it runs again it finds the phases it missed
 * finished. The waits spin, then yield the core (on cores shared with other processes,
 * sleeping costs a scheduler wake-up each time). Arithmetic is float32 as in the torch layers
 * (the same block dot products; sums of norms and softmax in another order); with int8_act the
 * inputs of blocks of 32 are rounded to int8 as gguf_cpu.c's gguf_mm does (K-quant rows take
 * the float32 inputs, as gguf_kq_mm does).
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "gguf_blocks.h"

#define MAX_SEGMENTS 3 /* runs of rows of one type a matrix (q, k and v of three types) */

typedef struct {
    const uint8_t *w; /* [rows, row_bytes] GGUF blocks */
    int64_t rows, row_bytes, qtype;
} lw_segment;

typedef struct { /* a matrix's rows: the segments' rows, in order */
    lw_segment seg[MAX_SEGMENTS];
    int64_t nseg, rows;
} lw_linear;

/* gguf_kquant.c's: a K-quant type's super-block bytes (0: not one), and one row's products. */
int gguf_kq_block_bytes(int qtype);
void gguf_kq_row_dot(const uint8_t *wrow, int64_t row_bytes, int qtype, const float *x,
                     int64_t ldx, int R, float *out, int64_t ldo);

typedef struct {
    const float *in_norm, *post_norm; /* [H] */
    const float *qkv_bias;            /* [(Hq + 2 Hkv) D], or NULL (Qwen2's q/k/v biases) */
    const float *q_norm, *k_norm;     /* [D] each, or NULL: RMSNorm of each q / k head (Qwen3) */
    lw_linear qkv, o, gate_up, down;  /* [(Hq + 2 Hkv) D, H], [H, Hq D], [2 I, H], [H, I] */
    float *kv_cache;                  /* [2, num_blocks, block_size, Hkv, D] */
} lw_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size;
    int64_t int8_act; /* the inputs of blocks of 32 (matmuls, LM head) rounded to int8 */
    float eps, scale, qk_eps; /* the layer norms', the attention's, the q / k norms' */
    const float *cos_sin;    /* [positions, D]: the D / 2 cosines, then the D / 2 sines */
    const float *final_norm; /* [H] */
    const lw_layer *layers;  /* [num_layers] */
    lw_linear lm_head;       /* [V, H] blocks, or rows 0: none (logits and tokens not computed) */
} lw_model;

typedef struct { /* one step's inputs and the scratch rows it works in */
    int64_t R, ld_table;
    const int64_t *positions, *slots; /* [R] */
    const int32_t *block_table;       /* [R, ld_table] */
    const int32_t *seq_lens;          /* [R]: cached tokens + this one */
    float *residual, *normed, *qkv, *attn, *act, *partial; /* [R, width of each] */
    float *part; /* [R, Hq, KV_SPLITS, D + 2]: each attention range's (max, sum, values) */
    int8_t *q_normed, *q_attn, *q_act;   /* int8_act: the matmul inputs as int8, [R, width] */
    float *ds_normed, *ds_attn, *ds_act; /* and their (d, s) per block, [R, width / 32 * 2] */
    float *logits;   /* [R, V] (with an LM head) */
    int64_t *tokens; /* [R]: argmax of each row of logits (with an LM head) */
} lw_step;

#define MAX_ROWS 8
#define MAX_HEAD_DIM 256
#define PHASES 9 /* a layer's: norm, qkv, rope_store, attention, merge, o, norm, gate_up, down */
#define TAIL_PHASES 3 /* after the layers: the final norm, the LM head, the argmax */
#define SPINS 2000
#define KEYS_A_TILE 32  /* keys scored at a time in the attention */
#define KEYS_A_SPLIT 64 /* keys a range of the attention, at least */
#define KV_SPLITS 4     /* ranges a (request, KV head)'s keys are attended in, at most */
#define MAX_GROUP 16    /* query heads a KV head */
#define KEYS_AHEAD 8    /* keys ahead of the one scored whose cache lines are prefetched */
#define RING 64         /* key rows looked up, a power of two >= KEYS_A_TILE + KEYS_AHEAD */

typedef struct { /* chunks taken from one thread's share of a phase, on a line of its own */
    _Alignas(64) _Atomic uint64_t taken; /* from its front << 32 | from its back */
} lw_share;

typedef struct { /* one phase of one call */
    atomic_int done; /* chunks finished */
    lw_share *shares; /* [threads]: thread t's share is chunks [n t / T, n (t + 1) / T) */
} lw_phase;

/* Wait until n chunks of the phase are done (their writes visible to this thread). */
static void wait_done(lw_phase *ph, int64_t n) {
    for (int spins = 0; atomic_load_explicit(&ph->done, memory_order_acquire) < n;) {
        if (++spins > SPINS) sched_yield();
    }
}

/* The next chunk of [0, n) for this thread: the front of its own share while any is left, then
 * the back of the next thread's share, and so on; n when every chunk has been taken. */
static inline int64_t take(lw_phase *ph, int64_t n) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int i = 0; i < T; i++) {
        int u = (t + i) % T;
        int64_t start = n * u / T, end = n * (u + 1) / T;
        _Atomic uint64_t *w = &ph->shares[u].taken;
        uint64_t v = atomic_load_explicit(w, memory_order_relaxed);
        while (start + (int64_t)(v >> 32) < end - (int64_t)(v & 0xffffffffu)) {
            uint64_t next = i == 0 ? v + ((uint64_t)1 << 32) : v + 1;
            if (atomic_compare_exchange_weak_explicit(w, &v, next, memory_order_relaxed,
                                                      memory_order_relaxed))
                return i == 0 ? start + (int64_t)(v >> 32) : end - 1 - (int64_t)(v & 0xffffffffu);
        }
    }
    return n;
}

/* Chunk indices [0, n) for this thread, taken until none is left; each counted done after its
 * body (which must not break out of the loop). */
#define FOR_CHUNKS(c, n, ph)                                                                    \
    for (int64_t c = take(ph, n); c < (n);                                                     \
         atomic_fetch_add_explicit(&(ph)->done, 1, memory_order_release), c = take(ph, n))
#define ROWS_A_CHUNK 16 /* a matmul's output rows a chunk, at least */
#define MAX_CHUNKS 256  /* a matmul's chunks, at most (past 4,096 rows, chunks grow) */

/* A matmul's input rows [R, K]: float32, and (int8_act) as int8 blocks. */
typedef struct {
    const float *x;
    int64_t K;
    q8_rows q;
    int int8;
} lw_input;

static lw_input input_of(const lw_model *m, const float *x, const int8_t *q, const float *ds,
                         int64_t K) {
    lw_input in = {x, K, {q, ds, K, K / QK * 2}, (int)m->int8_act};
    return in;
}

/* out[r] = in rows m..m+R (R <= 4) against row n of W. */
static inline void dot_rows(const lw_linear *L, int64_t n, const lw_input *in, int64_t m, int R,
                            float *out, int64_t ldo) {
    const lw_segment *sg = L->seg;
    while (n >= sg->rows) n -= sg->rows, sg++;
    const uint8_t *wrow = sg->w + n * sg->row_bytes;
    int qtype = (int)sg->qtype, bb = block_bytes(qtype);
    if (bb == 0) { /* a K-quant row */
        gguf_kq_row_dot(wrow, sg->row_bytes, qtype, in->x + m * in->K, in->K, R, out, ldo);
    } else if (in->int8) {
        q8_rows q = {in->q.q + m * in->q.ldq, in->q.ds + m * in->q.ldd, in->q.ldq, in->q.ldd};
        row_dot_q8(wrow, (int)(sg->row_bytes / bb), qtype, bb, &q, R, out, ldo);
    } else {
        row_dot(wrow, (int)(sg->row_bytes / bb), qtype, bb, in->x + m * in->K, in->K, R, out,
                ldo);
    }
}

/* out[r * ldo + n] = x[r] . W[n] for the rows n of the chunks this thread takes; returns the
 * phase's number of chunks. */
static int64_t matmul(const lw_linear *L, const lw_input *in, int64_t R, float *out, int64_t ldo,
                      lw_phase *ph) {
    int64_t per = L->rows / MAX_CHUNKS > ROWS_A_CHUNK ? L->rows / MAX_CHUNKS : ROWS_A_CHUNK;
    int64_t chunks = (L->rows + per - 1) / per;
    FOR_CHUNKS(c, chunks, ph) {
        int64_t end = (c + 1) * per < L->rows ? (c + 1) * per : L->rows;
        for (int64_t n = c * per; n < end; n++) {
            for (int64_t m = 0; m < R; m += 4) {
                int rows = R - m < 4 ? (int)(R - m) : 4;
                dot_rows(L, n, in, m, rows, out + m * ldo + n, ldo);
            }
        }
    }
    return chunks;
}

/* act[r, i] = silu(gate[r, i]) * up[r, i], gate rows 0..I-1 and up rows I..2I-1 of W; by
 * blocks of 32 i, each (int8_act) rounded to int8 where it is computed. Returns the chunks. */
static int64_t gate_up_silu(const lw_linear *L, const lw_input *in, const lw_step *s, int64_t I,
                            lw_phase *ph) {
    int64_t R = s->R;
    FOR_CHUNKS(ib, I / QK, ph) {
        for (int64_t i = ib * QK; i < (ib + 1) * QK; i++) {
            float g[MAX_ROWS], u[MAX_ROWS];
            for (int64_t m = 0; m < R; m += 4) {
                int rows = R - m < 4 ? (int)(R - m) : 4;
                dot_rows(L, i, in, m, rows, g + m, 1);
                dot_rows(L, I + i, in, m, rows, u + m, 1);
            }
            for (int64_t r = 0; r < R; r++) s->act[r * I + i] = g[r] / (1.0f + expf(-g[r])) * u[r];
        }
        if (in->int8)
            for (int64_t r = 0; r < R; r++)
                quantize_row_q8(s->act + r * I + ib * QK, QK, s->q_act + r * I + ib * QK,
                                s->ds_act + (r * I + ib * QK) / QK * 2);
    }
    return I / QK;
}

/* residual += partial (first: residual = partial), normed = rmsnorm(residual) * w. */
static void add_norm(const lw_model *m, const lw_step *s, const float *w, int first) {
    int64_t H = m->hidden;
    for (int64_t r = 0; r < s->R; r++) {
        float *res = s->residual + r * H, *out = s->normed + r * H;
        const float *p = s->partial + r * H;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) {
            res[i] = first ? p[i] : res[i] + p[i];
            ss += res[i] * res[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)H + m->eps);
        for (int64_t i = 0; i < H; i++) out[i] = res[i] * inv * w[i];
        if (m->int8_act)
            quantize_row_q8(out, H, s->q_normed + r * H, s->ds_normed + r * H / QK * 2);
    }
}

/* x[0..D) = rmsnorm(x) * w. */
static void head_norm(float *x, const float *w, int64_t D, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) x[i] = x[i] * inv * w[i];
}

/* Each request's q, k, v row: the layer's bias added, its q and k heads normalised (where the
 * layer has either), RoPE on the q and k heads (neox halves), then k and v into the cache. */
static void rope_store(const lw_model *m, const lw_step *s, const lw_layer *L) {
    int64_t D = m->head_dim, half = D / 2, Hq = m->heads, Hkv = m->kv_heads;
    int64_t width = (Hq + 2 * Hkv) * D, plane = m->num_blocks * m->block_size * Hkv * D;
    float *cache = L->kv_cache;
    for (int64_t r = 0; r < s->R; r++) {
        float *row = s->qkv + r * width;
        const float *cs = m->cos_sin + s->positions[r] * D;
        if (L->qkv_bias)
            for (int64_t i = 0; i < width; i++) row[i] += L->qkv_bias[i];
        if (L->q_norm)
            for (int64_t h = 0; h < Hq; h++) head_norm(row + h * D, L->q_norm, D, m->qk_eps);
        if (L->k_norm)
            for (int64_t h = Hq; h < Hq + Hkv; h++) head_norm(row + h * D, L->k_norm, D, m->qk_eps);
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half], c = cs[i], sn = cs[half + i];
                x[i] = x1 * c - x2 * sn;
                x[i + half] = x2 * c + x1 * sn;
            }
        }
        float *k = cache + s->slots[r] * Hkv * D;
        memcpy(k, row + Hq * D, Hkv * D * sizeof(float));
        memcpy(k + plane, row + (Hq + Hkv) * D, Hkv * D * sizeof(float));
    }
}

/* The key ranges request r's keys are attended in: one a KEYS_A_SPLIT keys, 1..KV_SPLITS. */
static inline int64_t splits_of(const lw_step *s, int64_t r) {
    int64_t k = s->seq_lens[r] / KEYS_A_SPLIT;
    return k < 1 ? 1 : k > KV_SPLITS ? KV_SPLITS : k;
}

/* The cache lines of D floats, into L2 (not L1: an L1 prefetch holds one of the core's few
 * L1 miss buffers until its line arrives, and these rows come from memory). */
static inline void prefetch_row(const float *p, int64_t D) {
    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(p + i, 0, 2);
}

/* a . b over D floats. */
static inline float dot_f32(const float *a, const float *b, int64_t D) {
#ifdef GGUF_AVX512
    if (D % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int64_t i = 16; i < D; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; i++) dot += a[i] * b[i];
    return dot;
}

/* a += p * v over D floats. */
static inline void axpy_f32(float *a, float p, const float *v, int64_t D) {
#ifdef GGUF_AVX512
    if (D % 16 == 0) {
        __m512 vp = _mm512_set1_ps(p);
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(a + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + i),
                                                    _mm512_loadu_ps(a + i)));
        return;
    }
#endif
#pragma omp simd
    for (int64_t i = 0; i < D; i++) a[i] += p * v[i];
}

/* Range sp of request r's keys against the G query heads of KV head kvh (each key and value
 * loaded once for the G heads), by tiles of KEYS_A_TILE keys: the tile's scores, one rescale a
 * head when the tile raises its maximum, then the weighted values. The cached rows are read
 * from scattered blocks, a head's slice of each token: the loop prefetches a key KEYS_AHEAD
 * tokens ahead and each scored key's value (the hardware prefetchers miss these strides).
 * Per head, (max, sum, weighted values [D]) go to s->part [R, Hq, KV_SPLITS, D + 2]. */
static void attend_range(const lw_model *m, const lw_step *s, const float *cache, int64_t r,
                         int64_t kvh, int64_t sp) {
    int64_t D = m->head_dim, Hkv = m->kv_heads, B = m->block_size, G = m->heads / Hkv;
    int64_t n = s->seq_lens[r], S = splits_of(s, r), plane = m->num_blocks * B * Hkv * D;
    if (sp >= S) return;
    const float *q = s->qkv + r * (m->heads + 2 * Hkv) * D + kvh * G * D; /* [G, D] */
    const int32_t *table = s->block_table + r * s->ld_table;
    const float *base = cache + kvh * D; /* token t's key: base + (block * B + t % B) * row */
    int64_t row = Hkv * D;
    float acc[MAX_GROUP][MAX_HEAD_DIM], mx[MAX_GROUP], sum[MAX_GROUP];
    float score[MAX_GROUP][KEYS_A_TILE];
    const float *keys[RING]; /* key t's row at keys[(t - start) % RING] */
    for (int64_t g = 0; g < G; g++) {
        mx[g] = -INFINITY, sum[g] = 0.0f;
        for (int64_t i = 0; i < D; i++) acc[g][i] = 0.0f;
    }
    int64_t start = n * sp / S, end = n * (sp + 1) / S;
    int64_t next = start, blk = start / B, off = start % B; /* the next key row to look up */
    for (; next < end && next < start + KEYS_AHEAD; next++) { /* the first keys' prefetches */
        const float *k = base + ((int64_t)table[blk] * B + off) * row;
        prefetch_row(k, D);
        keys[next - start] = k;
        if (++off == B) off = 0, blk++;
    }
    for (int64_t j0 = start; j0 < end; j0 += KEYS_A_TILE) {
        int nj = end - j0 < KEYS_A_TILE ? (int)(end - j0) : KEYS_A_TILE;
        for (int j = 0; j < nj; j++) {
            const float *k = keys[(j0 + j - start) % RING];
            prefetch_row(k + plane, D); /* its value */
            if (next < end) { /* the key KEYS_AHEAD on */
                const float *ahead = base + ((int64_t)table[blk] * B + off) * row;
                prefetch_row(ahead, D);
                keys[(next++ - start) % RING] = ahead;
                if (++off == B) off = 0, blk++;
            }
            for (int64_t g = 0; g < G; g++) score[g][j] = dot_f32(q + g * D, k, D) * m->scale;
        }
        for (int64_t g = 0; g < G; g++) {
            float tile_max = -INFINITY;
            for (int j = 0; j < nj; j++) tile_max = score[g][j] > tile_max ? score[g][j] : tile_max;
            if (tile_max > mx[g]) { /* a new maximum: rescale what came before */
                float c = expf(mx[g] - tile_max);
                sum[g] *= c;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) acc[g][i] *= c;
                mx[g] = tile_max;
            }
            for (int j = 0; j < nj; j++) {
                score[g][j] = expf(score[g][j] - mx[g]);
                sum[g] += score[g][j];
            }
        }
        for (int j = 0; j < nj; j++) {
            const float *v = keys[(j0 + j - start) % RING] + plane;
            for (int64_t g = 0; g < G; g++) axpy_f32(acc[g], score[g][j], v, D);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *o = s->part + ((r * m->heads + kvh * G + g) * KV_SPLITS + sp) * (D + 2);
        o[0] = mx[g], o[1] = sum[g];
        memcpy(o + 2, acc[g], D * sizeof(float));
    }
}

/* Head h of request r: its ranges' (max, sum, weighted values) merged into attn (and int8). */
static void merge_head(const lw_model *m, const lw_step *s, int64_t r, int64_t h) {
    int64_t D = m->head_dim, S = splits_of(s, r), at = r * m->heads * D + h * D;
    const float *p = s->part + (r * m->heads + h) * KV_SPLITS * (D + 2);
    float mx = -INFINITY, sum = 0.0f, out[MAX_HEAD_DIM] = {0};
    for (int64_t sp = 0; sp < S; sp++) mx = p[sp * (D + 2)] > mx ? p[sp * (D + 2)] : mx;
    for (int64_t sp = 0; sp < S; sp++) {
        const float *o = p + sp * (D + 2);
        float c = expf(o[0] - mx);
        sum += c * o[1];
#pragma omp simd
        for (int64_t i = 0; i < D; i++) out[i] += c * o[2 + i];
    }
    for (int64_t i = 0; i < D; i++) s->attn[at + i] = out[i] / sum;
    if (m->int8_act) quantize_row_q8(s->attn + at, D, s->q_attn + at, s->ds_attn + at / QK * 2);
}

/* One layer, on every thread; ph: the layer's PHASES phases. */
static void layer_step(const lw_model *m, const lw_step *s, const lw_layer *L, int first,
                       lw_phase *ph) {
    int64_t H = m->hidden, D = m->head_dim, R = s->R;
    lw_input normed = input_of(m, s->normed, s->q_normed, s->ds_normed, H);
    lw_input attn = input_of(m, s->attn, s->q_attn, s->ds_attn, m->heads * D);
    lw_input act = input_of(m, s->act, s->q_act, s->ds_act, m->inter);
    FOR_CHUNKS(c, 1, &ph[0]) add_norm(m, s, L->in_norm, first);
    wait_done(&ph[0], 1);
    wait_done(&ph[1], matmul(&L->qkv, &normed, R, s->qkv, L->qkv.rows, &ph[1]));
    FOR_CHUNKS(c, 1, &ph[2]) rope_store(m, s, L);
    wait_done(&ph[2], 1);
    int64_t Hkv = m->kv_heads, ranges = R * Hkv * KV_SPLITS;
    FOR_CHUNKS(t, ranges, &ph[3]) {
        attend_range(m, s, L->kv_cache, t / (Hkv * KV_SPLITS), t / KV_SPLITS % Hkv, t % KV_SPLITS);
    }
    wait_done(&ph[3], ranges);
    FOR_CHUNKS(t, R * m->heads, &ph[4]) merge_head(m, s, t / m->heads, t % m->heads);
    wait_done(&ph[4], R * m->heads);
    wait_done(&ph[5], matmul(&L->o, &attn, R, s->partial, H, &ph[5]));
    FOR_CHUNKS(c, 1, &ph[6]) add_norm(m, s, L->post_norm, 0);
    wait_done(&ph[6], 1);
    wait_done(&ph[7], gate_up_silu(&L->gate_up, &normed, s, m->inter, &ph[7]));
    wait_done(&ph[8], matmul(&L->down, &act, R, s->partial, H, &ph[8]));
}

static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) best = x[i] > x[best] ? i : best;
    return best;
}

/* The final norm, then (with an LM head) the logits and each row's greedy token. */
static void tail(const lw_model *m, const lw_step *s, lw_phase *ph) {
    FOR_CHUNKS(c, 1, &ph[0]) add_norm(m, s, m->final_norm, 0);
    wait_done(&ph[0], 1);
    const lw_linear *lm = &m->lm_head;
    if (!lm->rows) return;
    lw_input in = input_of(m, s->normed, s->q_normed, s->ds_normed, m->hidden);
    wait_done(&ph[1], matmul(lm, &in, s->R, s->logits, lm->rows, &ph[1]));
    FOR_CHUNKS(r, s->R, &ph[2]) s->tokens[r] = argmax(s->logits + r * lm->rows, lm->rows);
}

/* A matrix whose rows are not whole blocks of a type these kernels read, of cols values each,
 * or whose segments' rows do not add up to its rows. */
static int bad_linear(const lw_linear *L, int64_t cols) {
    int64_t rows = 0;
    if (L->nseg < 1 || L->nseg > MAX_SEGMENTS) return 1;
    for (int64_t i = 0; i < L->nseg; i++) {
        const lw_segment *sg = &L->seg[i];
        int qtype = (int)sg->qtype, bb = block_bytes(qtype), values = QK;
        if (bb == 0) bb = gguf_kq_block_bytes(qtype), values = 256;
        if (bb == 0 || sg->row_bytes % bb || sg->row_bytes / bb * values != cols) return 1;
        if (sg->rows < 1) return 1;
        rows += sg->rows;
    }
    return rows != L->rows;
}

static int check(const lw_model *m, const lw_step *s) {
    if (s->R < 1 || s->R > MAX_ROWS || m->head_dim > MAX_HEAD_DIM || m->head_dim % 2) return -1;
    if (m->heads % m->kv_heads || m->heads / m->kv_heads > MAX_GROUP) return -1;
    if (m->hidden % QK || m->inter % QK || (m->int8_act && m->head_dim % QK)) return -1;
    int64_t H = m->hidden;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const lw_layer *L = &m->layers[l];
        if (bad_linear(&L->qkv, H) || bad_linear(&L->o, m->heads * m->head_dim) ||
            bad_linear(&L->gate_up, H) || bad_linear(&L->down, m->inter))
            return -2;
    }
    return m->lm_head.rows && bad_linear(&m->lm_head, H) ? -2 : 0;
}

/* out [R, H] = the final norm of the last layer's output; x [R, H]: the token embeddings. */
int lw_llama_decode(const lw_model *m, const lw_step *s, const float *x, float *out,
                    int nthreads) {
    int rc = check(m, s);
    if (rc) return rc;
    memcpy(s->partial, x, s->R * m->hidden * sizeof(float)); /* the first layer's input */
    int64_t L = m->num_layers, P = L * PHASES + TAIL_PHASES;
    nthreads = nthreads < 1 ? 1 : nthreads;
    lw_phase *ph = calloc(P, sizeof(lw_phase));
    lw_share *shares = aligned_alloc(64, P * nthreads * sizeof(lw_share));
    if (!ph || !shares) {
        free(ph), free(shares);
        return -3;
    }
    memset(shares, 0, P * nthreads * sizeof(lw_share));
    for (int64_t p = 0; p < P; p++) ph[p].shares = shares + p * nthreads;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t l = 0; l < L; l++) /* any number of threads finishes the work */
            layer_step(m, s, &m->layers[l], l == 0, ph + l * PHASES);
        tail(m, s, ph + L * PHASES);
    }
    free(ph), free(shares);
    memcpy(out, s->normed, s->R * m->hidden * sizeof(float));
    return 0;
}
