/* GGUF K-quant blocks x float32 activations on the CPU, for lightwell/kernels/cpu/gguf_cpu.py
 * (gguf_kq_mm, gguf_kq_dequant_rows) and llama_decode.c (gguf_kq_row_dot: one row of W).
 *
 * out[m, n] = sum_k x[m, k] * W[n, k], W kept as a GGUF file stores it: row n is K / 256
 * super-blocks of Q4_K (144 B), Q5_K (176 B) or Q6_K (210 B), laid out as
 * lightwell/kernels/gguf_blocks.py describes. A super-block is first unpacked into 256 small
 * integers q (0..63) and, per 16 values, a scale D and an offset M, so that w = q * D + M:
 *   Q4_K / Q5_K: D = d * sc[j], M = -(dmin * mn[j]) (sub-block j of 32 values)
 *   Q6_K:        D = d * scales[t], M = -32 * D     (group t of 16 values)
 * Every product here is exact in float32 (fp16 d: 11 bits, 6- or 8-bit scales, 6-bit q), so
 * the one rounding of q * D + M gives exactly gguf-py's float32 value. Up to 4 rows of x share
 * one unpacking; gguf_kq_mm splits output rows over OpenMP threads. AVX2 + FMA + F16C where the
 * compiler targets them (one row of x: AVX-512 where it targets that too), portable C
 * otherwise.
 */
#include "gguf_blocks.h" /* fp16_to_fp32, the AVX2 + FMA + F16C test (GGUF_AVX2) */

#ifdef GGUF_AVX2
#define KQ_AVX2 1
#endif

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK_K 256

static inline float rd16(const uint8_t *p) { return fp16_to_fp32((uint16_t)(p[0] | p[1] << 8)); }

static inline int kq_block_bytes(int qtype) {
    return qtype == Q4_K ? 144 : qtype == Q5_K ? 176 : qtype == Q6_K ? 210 : 0;
}

/* A super-block unpacked: w[i] = q[i] * d[i / 16] + m[i / 16]. */
typedef struct {
    uint8_t q[QK_K];
    float d[16], m[16];
} unpacked;

/* Sub-block j's 6-bit scale and min from Q4_K / Q5_K's 12 packed bytes. */
static inline void scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The 6-bit scales and mins of Q4_K / Q5_K (D, M per 16 values) or Q6_K's scales. */
static inline void unpack_scales(const uint8_t *b, int qtype, unpacked *u) {
    if (qtype == Q6_K) {
        float d = rd16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int t = 0; t < 16; t++) {
            u->d[t] = d * (float)sc[t];
            u->m[t] = -32.0f * u->d[t];
        }
        return;
    }
    float d = rd16(b), dmin = rd16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min(b + 4, j, &sc, &mn);
        u->d[2 * j] = u->d[2 * j + 1] = d * (float)sc;
        u->m[2 * j] = u->m[2 * j + 1] = -(dmin * (float)mn);
    }
}

#ifdef KQ_AVX2
static inline __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void st32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* The quants of sub-blocks j = 0..7 (32 values each) into u->q. */
static inline void unpack_q(const uint8_t *b, int qtype, unpacked *u) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    if (qtype == Q6_K) {
        for (int a = 0; a < 2; a++) { /* j = 4a + g */
            __m256i l0 = ld32(b + 64 * a), l1 = ld32(b + 64 * a + 32), h = ld32(b + 128 + 32 * a);
            uint8_t *q = u->q + 128 * a;
            st32(q, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                    _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)));
            st32(q + 32, _mm256_or_si256(_mm256_and_si256(l1, m4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)));
            st32(q + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                         _mm256_and_si256(h, m30)));
            st32(q + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)));
        }
        return;
    }
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48);
    __m256i h = qtype == Q5_K ? ld32(b + 16) : _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
        __m256i v = ld32(qs + 32 * p);
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (qtype == Q5_K) { /* bit j of qh[i] is bit 4 of sub-block j's value i */
            const __m256i b0 = _mm256_set1_epi8((char)(1 << 2 * p));
            const __m256i b1 = _mm256_set1_epi8((char)(1 << (2 * p + 1)));
            const __m256i v16 = _mm256_set1_epi8(16);
            lo = _mm256_or_si256(lo, _mm256_and_si256(
                _mm256_cmpeq_epi8(_mm256_and_si256(h, b0), b0), v16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(
                _mm256_cmpeq_epi8(_mm256_and_si256(h, b1), b1), v16));
        }
        st32(u->q + 64 * p, lo);
        st32(u->q + 64 * p + 32, hi);
    }
}
#else
static void unpack_q(const uint8_t *b, int qtype, unpacked *u) {
    for (int j = 0; j < 8; j++) {
        uint8_t *q = u->q + 32 * j;
        if (qtype == Q6_K) { /* j = 4a + g */
            const uint8_t *ql = b + 64 * (j >> 2) + 32 * (j & 1), *qh = b + 128 + 32 * (j >> 2);
            int sl = 4 * ((j & 3) >> 1), sh = 2 * (j & 3);
            for (int i = 0; i < 32; i++)
                q[i] = (uint8_t)(((ql[i] >> sl) & 15) | (((qh[i] >> sh) & 3) << 4));
            continue;
        }
        const uint8_t *src = b + (qtype == Q4_K ? 16 : 48) + 32 * (j >> 1), *qh = b + 16;
        int sl = 4 * (j & 1), hb = qtype == Q5_K;
        for (int i = 0; i < 32; i++)
            q[i] = (uint8_t)(((src[i] >> sl) & 15) | (hb * ((qh[i] >> j) & 1) << 4));
    }
}
#endif

static inline void unpack(const uint8_t *b, int qtype, unpacked *u) {
    unpack_scales(b, qtype, u);
    unpack_q(b, qtype, u);
}

#ifdef KQ_AVX2
/* out[r * ldo] for r < R: row wrow (nb super-blocks) against R rows of x (stride ldx).
 * Inlined per constant R, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void kq_row_dot_r(
    const uint8_t *wrow, int64_t nb, int qtype, int bb, const float *x, int64_t ldx, int R,
    float *out, int64_t ldo) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    unpacked u;
    for (int64_t b = 0; b < nb; b++) {
        unpack(wrow + b * bb, qtype, &u);
        const float *xb = x + b * QK_K;
        for (int t = 0; t < 16; t++) { /* 16 values sharing one scale */
            __m256 vd = _mm256_set1_ps(u.d[t]), vm = _mm256_set1_ps(u.m[t]);
            __m128i q = _mm_loadu_si128((const __m128i *)(u.q + 16 * t));
            __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), vd, vm);
            __m256 w1 = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))), vd, vm);
            for (int r = 0; r < R; r++) {
                const float *xr = xb + r * ldx + 16 * t;
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#ifdef GGUF_AVX512
/* One row of x: each 16 values sharing a scale dequantized in one 16-lane vector. */
static inline __attribute__((always_inline)) float kq_row_dot_one_512(const uint8_t *wrow,
                                                                      int64_t nb, int qtype,
                                                                      int bb, const float *x) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    unpacked u;
    for (int64_t b = 0; b < nb; b++) {
        unpack(wrow + b * bb, qtype, &u);
        const float *xb = x + b * QK_K;
        for (int t = 0; t < 16; t += 2) {
            __m512 q0 = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u.q + 16 * t))));
            __m512 q1 = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u.q + 16 * t + 16))));
            __m512 w0 = _mm512_fmadd_ps(q0, _mm512_set1_ps(u.d[t]), _mm512_set1_ps(u.m[t]));
            __m512 w1 =
                _mm512_fmadd_ps(q1, _mm512_set1_ps(u.d[t + 1]), _mm512_set1_ps(u.m[t + 1]));
            a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + 16 * t), a0);
            a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16 * t + 16), a1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

static void kq_row_dot(const uint8_t *wrow, int64_t nb, int qtype, int bb, const float *x,
                    int64_t ldx, int R, float *out, int64_t ldo) {
#ifdef GGUF_AVX512
    if (R == 1) { /* one specialised loop per type */
        switch (qtype) {
        case Q4_K: out[0] = kq_row_dot_one_512(wrow, nb, Q4_K, bb, x); return;
        case Q5_K: out[0] = kq_row_dot_one_512(wrow, nb, Q5_K, bb, x); return;
        default: out[0] = kq_row_dot_one_512(wrow, nb, Q6_K, bb, x); return;
        }
    }
#endif
    switch (R) {
    case 1: kq_row_dot_r(wrow, nb, qtype, bb, x, ldx, 1, out, ldo); break;
    case 2: kq_row_dot_r(wrow, nb, qtype, bb, x, ldx, 2, out, ldo); break;
    case 3: kq_row_dot_r(wrow, nb, qtype, bb, x, ldx, 3, out, ldo); break;
    default: kq_row_dot_r(wrow, nb, qtype, bb, x, ldx, 4, out, ldo); break;
    }
}
#else
static void kq_row_dot(const uint8_t *wrow, int64_t nb, int qtype, int bb, const float *x,
                    int64_t ldx, int R, float *out, int64_t ldo) {
    float acc[4][16] = {{0}};
    unpacked u;
    for (int64_t b = 0; b < nb; b++) {
        unpack(wrow + b * bb, qtype, &u);
        for (int i = 0; i < QK_K; i++) {
            float w = (float)u.q[i] * u.d[i >> 4] + u.m[i >> 4];
            for (int r = 0; r < R; r++) acc[r][i & 15] += w * x[r * ldx + b * QK_K + i];
        }
    }
    for (int r = 0; r < R; r++) {
        float s = 0;
        for (int j = 0; j < 16; j++) s += acc[r][j];
        out[r * ldo] = s;
    }
}
#endif

/* For llama_decode.c: a type's super-block bytes (0: not a K-quant), and out[r * ldo] for
 * r < R (<= 4): one row of row_bytes of super-blocks against R rows of x (stride ldx). */
int gguf_kq_block_bytes(int qtype) { return kq_block_bytes(qtype); }

void gguf_kq_row_dot(const uint8_t *wrow, int64_t row_bytes, int qtype, const float *x,
                     int64_t ldx, int R, float *out, int64_t ldo) {
    int bb = kq_block_bytes(qtype);
    kq_row_dot(wrow, row_bytes / bb, qtype, bb, x, ldx, R, out, ldo);
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W.T, W [N, K / 256 blocks]. */
int gguf_kq_mm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
               int64_t w_row_bytes, int qtype, float *out, int64_t ldo, int nthreads) {
    int bb = kq_block_bytes(qtype);
    if (bb == 0 || K % QK_K || w_row_bytes != K / QK_K * bb) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m = 0; m < M; m += 4) {
            int R = M - m < 4 ? (int)(M - m) : 4;
            kq_row_dot(w + n * w_row_bytes, K / QK_K, qtype, bb, x + m * ldx, ldx, R,
                    out + m * ldo + n, ldo);
        }
    }
    return 0;
}

/* out [R, K] float32 = rows idx[0..R) of W [N, K / 256 blocks] dequantized. */
int gguf_kq_dequant_rows(const uint8_t *w, int64_t K, int64_t w_row_bytes, int qtype,
                         const int64_t *idx, int64_t R, float *out, int nthreads) {
    int bb = kq_block_bytes(qtype);
    if (bb == 0 || K % QK_K || w_row_bytes != K / QK_K * bb) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 8)
    for (int64_t r = 0; r < R; r++) {
        unpacked u;
        for (int64_t b = 0; b < K / QK_K; b++) {
            unpack(w + idx[r] * w_row_bytes + b * bb, qtype, &u);
            float *o = out + r * K + b * QK_K;
            for (int i = 0; i < QK_K; i++) o[i] = (float)u.q[i] * u.d[i >> 4] + u.m[i >> 4];
        }
    }
    return 0;
}
