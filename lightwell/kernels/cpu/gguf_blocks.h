/* GGUF blocks in registers: the helpers shared by gguf_cpu.c, gguf_kquant.c and llama_decode.c.
 *
 * Q4_0 (fp16 d, 16 bytes of nibbles: w = (q - 8) * d), Q4_1 (fp16 d, fp16 m, 16 bytes:
 * w = q * d + m), Q5_0 (fp16 d, 4 bytes qh, 16 bytes of nibbles: w = (q - 16) * d), Q5_1 (fp16
 * d, fp16 m, qh, nibbles: w = q * d + m) or Q8_0 (fp16 d, 32 int8: w = q * d), 32 weights a
 * block. Low nibbles are values 0..15 of a block, high nibbles 16..31; a Q5 value's fifth bit
 * is bit i of the little-endian 32-bit qh. Each weight is dequantized in registers with one
 * fused multiply-add, which gives exactly gguf-py's float32 value (q * d is exact in float32),
 * and accumulated in float32. AVX2 + FMA + F16C where the compiler targets them (one row of x
 * against a row of blocks: AVX-512 where it targets that too), portable C otherwise.
 */
#ifndef GGUF_BLOCKS_H_
#define GGUF_BLOCKS_H_
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX2 1
#ifdef __AVX512F__
#define GGUF_AVX512 1 /* AVX-512 on top of AVX2 + FMA + F16C */
#endif
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };
#define QK 32

static inline float fp16_to_fp32(uint16_t h) {
#ifdef GGUF_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    default: return 0;
    }
}

/* A Q4 / Q5 block's layout: whether it has an offset m (else m = -8 d or -16 d), where its
 * nibbles start, and its qh (Q5; 0 for Q4). */
static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }
static inline int is_q5(int qtype) { return qtype == Q5_0 || qtype == Q5_1; }
static inline int nibbles_at(int qtype) { return (has_min(qtype) ? 4 : 2) + (is_q5(qtype) ? 4 : 0); }
static inline uint32_t qh_of(const uint8_t *b, int qtype) {
    uint32_t qh = 0;
    if (is_q5(qtype)) memcpy(&qh, b + (has_min(qtype) ? 4 : 2), 4);
    return qh;
}
static inline float min_of(const uint8_t *b, int qtype, float d) {
    if (has_min(qtype)) return fp16_to_fp32((uint16_t)(b[2] | b[3] << 8));
    return (is_q5(qtype) ? -16.0f : -8.0f) * d;
}

/* One block's 32 weights as float32, exactly as gguf-py dequantizes them. */
static inline void dequant_block(const uint8_t *b, int qtype, float *w) {
    float d = fp16_to_fp32((uint16_t)(b[0] | b[1] << 8));
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) w[j] = (float)q[j] * d;
        return;
    }
    float m = min_of(b, qtype, d);
    const uint8_t *q = b + nibbles_at(qtype);
    uint32_t qh = qh_of(b, qtype);
    for (int j = 0; j < 16; j++) {
        w[j] = (float)((q[j] & 0xf) | ((qh >> j & 1) << 4)) * d + m;
        w[j + 16] = (float)((q[j] >> 4) | ((qh >> (j + 16) & 1) << 4)) * d + m;
    }
}

#ifdef GGUF_AVX2
static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* Byte i of the result: 16 where bit i of qh is set, else 0 (a Q5 block's fifth bits). */
static inline __m256i q5_high_bits(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* A block's 32 weights in four vectors of 8. */
static inline void dequant_block_avx2(const uint8_t *b, int qtype, __m256 w[4]) {
    __m256 vd = _mm256_set1_ps(_cvtsh_ss((uint16_t)(b[0] | b[1] << 8)));
    if (qtype == Q8_0) {
        const uint8_t *q = b + 2;
        for (int i = 0; i < 4; i++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd);
        }
        return;
    }
    __m256 vm = _mm256_set1_ps(min_of(b, qtype, _mm256_cvtss_f32(vd)));
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + nibbles_at(qtype)));
    const __m128i mask = _mm_set1_epi8(0xf);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if (is_q5(qtype)) {
        __m256i high = q5_high_bits(qh_of(b, qtype));
        lo = _mm_or_si128(lo, _mm256_castsi256_si128(high));
        hi = _mm_or_si128(hi, _mm256_extracti128_si256(high, 1));
    }
    w[0] = _mm256_fmadd_ps(u8x8_to_ps(lo), vd, vm);
    w[1] = _mm256_fmadd_ps(u8x8_to_ps(_mm_unpackhi_epi64(lo, lo)), vd, vm);
    w[2] = _mm256_fmadd_ps(u8x8_to_ps(hi), vd, vm);
    w[3] = _mm256_fmadd_ps(u8x8_to_ps(_mm_unpackhi_epi64(hi, hi)), vd, vm);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#ifdef GGUF_AVX512
/* One row of blocks against one row of x, 16 lanes: a Q4 / Q5 block's 16 bytes widened to 16
 * int32 lanes at once (low nibbles masked, high nibbles shifted down; Q5's fifth bits ORed in
 * under qh's halves as lane masks), Q8_0's 32 bytes as two halves. */
static inline float row_dot_one_512(const uint8_t *wrow, int nb, int qtype, int bb,
                                    const float *x) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0xf), sixteen = _mm512_set1_epi32(16);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = wrow + (int64_t)b * bb;
        const float *xb = x + (int64_t)b * QK;
        __m512 d = _mm512_set1_ps(_cvtsh_ss((uint16_t)(p[0] | p[1] << 8))), w0, w1;
        if (qtype == Q8_0) {
            w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(p + 2)))), d);
            w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128((const __m128i *)(p + 18)))), d);
        } else {
            __m512 m = _mm512_set1_ps(min_of(p, qtype, _mm512_cvtss_f32(d)));
            __m512i q = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(p + nibbles_at(qtype))));
            __m512i q0 = _mm512_and_si512(q, low), q1 = _mm512_srli_epi32(q, 4);
            if (is_q5(qtype)) {
                uint32_t qh = qh_of(p, qtype);
                q0 = _mm512_mask_or_epi32(q0, (__mmask16)qh, q0, sixteen);
                q1 = _mm512_mask_or_epi32(q1, (__mmask16)(qh >> 16), q1, sixteen);
            }
            w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
            w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
        }
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static inline float row_dot_one(const uint8_t *wrow, int nb, int qtype, int bb, const float *x) {
    switch (qtype) { /* one specialised loop per type */
    case Q4_0: return row_dot_one_512(wrow, nb, Q4_0, bb, x);
    case Q4_1: return row_dot_one_512(wrow, nb, Q4_1, bb, x);
    case Q5_0: return row_dot_one_512(wrow, nb, Q5_0, bb, x);
    case Q5_1: return row_dot_one_512(wrow, nb, Q5_1, bb, x);
    default: return row_dot_one_512(wrow, nb, Q8_0, bb, x);
    }
}
#endif

/* out[r * ldo] for r < R: row n of W (nb blocks) against R rows of x (stride ldx). */
static inline void row_dot(const uint8_t *wrow, int nb, int qtype, int bb, const float *x,
                           int64_t ldx, int R, float *out, int64_t ldo) {
#ifdef GGUF_AVX512
    if (R == 1) {
        out[0] = row_dot_one(wrow, nb, qtype, bb, x);
        return;
    }
#endif
    if (R == 1) { /* one row: four independent accumulators */
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++) {
            __m256 w[4];
            dequant_block_avx2(wrow + (int64_t)b * bb, qtype, w);
            const float *xb = x + (int64_t)b * QK;
            for (int i = 0; i < 4; i++)
                a[i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), a[i]);
        }
        out[0] = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        return;
    }
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 w[4];
        dequant_block_avx2(wrow + (int64_t)b * bb, qtype, w);
        const float *xb = x + (int64_t)b * QK;
        for (int r = 0; r < R; r++) {
            const float *xr = xb + r * ldx;
            acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#else
static inline void row_dot(const uint8_t *wrow, int nb, int qtype, int bb, const float *x,
                           int64_t ldx, int R, float *out, int64_t ldo) {
    float acc[4][QK] = {{0}};
    for (int b = 0; b < nb; b++) {
        float w[QK];
        dequant_block(wrow + (int64_t)b * bb, qtype, w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + (int64_t)b * QK;
            for (int j = 0; j < QK; j++) acc[r][j] += w[j] * xr[j];
        }
    }
    for (int r = 0; r < R; r++) {
        float s = 0;
        for (int j = 0; j < QK; j++) s += acc[r][j];
        out[r * ldo] = s;
    }
}
#endif

/* ---- int8 activations (llama.cpp's Q8_1 rows) --------------------------------------------
 * A float32 row quantized by blocks of 32: q = round(x / d) in [-127, 127], d = max|x| / 127,
 * kept with s = d * sum(q). A block of weights against it is one integer dot product:
 * Q4_1 / Q5_1: d_w * d * sum(q_w q) + m_w * s; Q4_0: m_w = -8 d_w; Q5_0: m_w = -16 d_w;
 * Q8_0: d_w * d * sum(q_w q). */
typedef struct {
    const int8_t *q; /* [R, ldq] */
    const float *ds; /* [R, ldd]: (d, s) of each block */
    int64_t ldq, ldd;
} q8_rows;

static inline void quantize_row_q8(const float *x, int64_t K, int8_t *q, float *ds) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)lrintf(xb[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[b * QK + j] = (int8_t)v;
            sum += v;
        }
        ds[2 * b] = d;
        ds[2 * b + 1] = d * (float)sum;
    }
}

#ifdef GGUF_AVX2
/* One block's weights as bytes for maddubs: Q4 values 0..15 and Q5 values 0..31 (unsigned),
 * Q8_0's |w|; *sw: the signs to put on x (Q8_0), *dw / *mw: the block's scale and offset
 * (Q4_0: -8 d, Q5_0: -16 d). */
static inline __attribute__((always_inline)) __m256i q8_weights(const uint8_t *blk, int qtype,
                                                                __m256i *sw, float *dw,
                                                                float *mw) {
    *dw = _cvtsh_ss((uint16_t)(blk[0] | blk[1] << 8));
    if (qtype == Q8_0) {
        *sw = _mm256_loadu_si256((const __m256i *)(blk + 2));
        *mw = 0.0f;
        return _mm256_sign_epi8(*sw, *sw);
    }
    *mw = min_of(blk, qtype, *dw);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + nibbles_at(qtype)));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    both = _mm256_and_si256(both, _mm256_set1_epi8(0xf));
    return is_q5(qtype) ? _mm256_or_si256(both, q5_high_bits(qh_of(blk, qtype))) : both;
}

/* sum(w * x) of a block as 8 float lanes (exact integer sums converted). */
static inline __attribute__((always_inline)) __m256 q8_block_dot(__m256i w, __m256i sw,
                                                                 const int8_t *q, int qtype) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)q);
    if (qtype == Q8_0) xv = _mm256_sign_epi8(xv, sw);
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p);
}

/* Q4_1 against one int8 row, two blocks a step: their (d, m) halves converted by one
 * instruction and multiplied by the row's (d, s) pairs in one, even and odd blocks summed
 * apart; the same operations in the same order as the general loop below (bit-identical). */
static inline __attribute__((always_inline)) float row_dot_q4_1_one(const uint8_t *wrow, int nb,
                                                                    const q8_rows *x) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 macc = _mm_setzero_ps(); /* lanes 1 and 3: the even and odd blocks' m * s */
    const __m256i low = _mm256_set1_epi8(0xf), ones = _mm256_set1_epi16(1);
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *p = wrow + (int64_t)b * 20;
        int32_t h0, h1;
        memcpy(&h0, p, 4), memcpy(&h1, p + 20, 4);
        __m128 sc = _mm_mul_ps(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0)), _mm_loadu_ps(x->ds + 2 * b));
        macc = _mm_add_ps(macc, sc); /* (d0 dx0, m0 sx0, d1 dx1, m1 sx1) */
        __m128i r0 = _mm_loadu_si128((const __m128i *)(p + 4));
        __m128i r1 = _mm_loadu_si128((const __m128i *)(p + 24));
        __m256i w0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r0, 4), r0), low);
        __m256i w1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r1, 4), r1), low);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(x->q + b * QK));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x->q + (b + 1) * QK));
        __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
        __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
        acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(sc), f0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehl_ps(sc, sc)), f1, acc1);
    }
    float m0 = _mm_cvtss_f32(_mm_shuffle_ps(macc, macc, 1));
    float m1 = _mm_cvtss_f32(_mm_shuffle_ps(macc, macc, 3));
    if (b < nb) { /* an odd block count: the last block is an even one */
        __m256i sw;
        float dw, mw;
        __m256i w = q8_weights(wrow + (int64_t)b * 20, Q4_1, &sw, &dw, &mw);
        __m256 f = q8_block_dot(w, sw, x->q + b * QK, Q4_1);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->ds[2 * b]), f, acc0);
        m0 += mw * x->ds[2 * b + 1];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + m0 + m1;
}

static inline __attribute__((always_inline)) void row_dot_q8_typed(
    const uint8_t *wrow, int nb, int qtype, int bb, const q8_rows *x, int R, float *out,
    int64_t ldo) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    float macc[4] = {0};
    if (R == 1 && qtype == Q4_1) {
        out[0] = row_dot_q4_1_one(wrow, nb, x);
        return;
    }
    if (R == 1) { /* two blocks a step, two accumulators */
        int b = 0;
        for (; b < nb; b += 2) {
            for (int u = 0; u < 2 && b + u < nb; u++) {
                __m256i sw;
                float dw, mw;
                __m256i w = q8_weights(wrow + (int64_t)(b + u) * bb, qtype, &sw, &dw, &mw);
                const float *ds = x->ds + 2 * (b + u);
                __m256 f = q8_block_dot(w, sw, x->q + (b + u) * QK, qtype);
                acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ds[0]), f, acc[u]);
                macc[u] += mw * ds[1];
            }
        }
        out[0] = hsum(_mm256_add_ps(acc[0], acc[1])) + macc[0] + macc[1];
        return;
    }
    for (int b = 0; b < nb; b++) {
        __m256i sw;
        float dw, mw;
        __m256i w = q8_weights(wrow + (int64_t)b * bb, qtype, &sw, &dw, &mw);
        for (int r = 0; r < R; r++) {
            const float *ds = x->ds + r * x->ldd + 2 * b;
            __m256 f = q8_block_dot(w, sw, x->q + r * x->ldq + b * QK, qtype);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ds[0]), f, acc[r]);
            macc[r] += mw * ds[1];
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(acc[r]) + macc[r];
}

/* out[r * ldo] for r < R (<= 4): row n of W (nb blocks) against R int8 rows. */
static inline void row_dot_q8(const uint8_t *wrow, int nb, int qtype, int bb, const q8_rows *x,
                              int R, float *out, int64_t ldo) {
    switch (qtype) { /* one specialised loop per type */
    case Q4_0: row_dot_q8_typed(wrow, nb, Q4_0, bb, x, R, out, ldo); break;
    case Q4_1: row_dot_q8_typed(wrow, nb, Q4_1, bb, x, R, out, ldo); break;
    case Q5_0: row_dot_q8_typed(wrow, nb, Q5_0, bb, x, R, out, ldo); break;
    case Q5_1: row_dot_q8_typed(wrow, nb, Q5_1, bb, x, R, out, ldo); break;
    default: row_dot_q8_typed(wrow, nb, Q8_0, bb, x, R, out, ldo); break;
    }
}
#else
static inline void row_dot_q8(const uint8_t *wrow, int nb, int qtype, int bb, const q8_rows *x,
                              int R, float *out, int64_t ldo) {
    float acc[4] = {0};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + (int64_t)b * bb;
        float dw = fp16_to_fp32((uint16_t)(blk[0] | blk[1] << 8)), mw = 0.0f;
        int wq[QK];
        if (qtype == Q8_0) {
            for (int j = 0; j < QK; j++) wq[j] = ((const int8_t *)(blk + 2))[j];
        } else {
            mw = min_of(blk, qtype, dw);
            const uint8_t *n = blk + nibbles_at(qtype);
            uint32_t qh = qh_of(blk, qtype);
            for (int j = 0; j < 16; j++) {
                wq[j] = (n[j] & 0xf) | (qh >> j & 1) << 4;
                wq[j + 16] = (n[j] >> 4) | (qh >> (j + 16) & 1) << 4;
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *q = x->q + r * x->ldq + b * QK;
            const float *ds = x->ds + r * x->ldd + 2 * b;
            int dot = 0;
            for (int j = 0; j < QK; j++) dot += wq[j] * q[j];
            acc[r] += dw * ds[0] * (float)dot + (qtype == Q8_0 ? 0.0f : mw * ds[1]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = acc[r];
}
#endif

#endif
