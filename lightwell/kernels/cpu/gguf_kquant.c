/* GGUF K-quant blocks x float32 activations on the CPU, for lightwell/kernels/cpu/gguf_kquant.py.
 *
 * out[m, n] = sum_k x[m, k] * W[n, k], W kept as a GGUF file stores it: row n is K / 256
 * super-blocks of Q4_K (144 B), Q5_K (176 B) or Q6_K (210 B), laid out as
 * lightwell/kernels/gguf_blocks.py describes. A super-block is first unpacked into 256 small
 * integers q (0..63) and, per 16 values, a scale D and an offset M, so that w = q * D + M:
 *   Q4_K / Q5_K: D = d * sc[j], M = -(dmin * mn[j]) (sub-block j of 32 values)
 *   Q6_K:        D = d * scales[t], M = -32 * D     (group t of 16 values)
 * Every product here is exact in float32 (fp16 d: 11 bits, 6- or 8-bit scales, 6-bit q), so
 * the one rounding of q * D + M gives exactly gguf-py's float32 value. Up to 4 rows of x share
 * one unpacking; output rows are split over OpenMP threads. AVX2 + FMA + F16C where the
 * compiler targets them, portable C otherwise.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_AVX2 1
#endif

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK_K 256

static inline float fp16_to_fp32(uint16_t h) {
#ifdef KQ_AVX2
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

static inline float rd16(const uint8_t *p) { return fp16_to_fp32((uint16_t)(p[0] | p[1] << 8)); }

static inline int block_bytes(int qtype) {
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

static void unpack_q6k(const uint8_t *b, unpacked *u) {
    float d = rd16(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int t = 0; t < 16; t++) {
        u->d[t] = d * (float)sc[t];
        u->m[t] = -32.0f * u->d[t];
    }
    for (int j = 0; j < 8; j++) { /* j = 4a + g */
        const uint8_t *ql = b + 64 * (j >> 2) + 32 * (j & 1), *qh = b + 128 + 32 * (j >> 2);
        int sl = 4 * ((j & 3) >> 1), sh = 2 * (j & 3);
        uint8_t *q = u->q + 32 * j;
        for (int i = 0; i < 32; i++)
            q[i] = (uint8_t)(((ql[i] >> sl) & 15) | (((qh[i] >> sh) & 3) << 4));
    }
}

static void unpack(const uint8_t *b, int qtype, unpacked *u) {
    if (qtype == Q6_K) {
        unpack_q6k(b, u);
        return;
    }
    float d = rd16(b), dmin = rd16(b + 2);
    const uint8_t *qs = b + (qtype == Q4_K ? 16 : 48), *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min(b + 4, j, &sc, &mn);
        u->d[2 * j] = u->d[2 * j + 1] = d * (float)sc;
        u->m[2 * j] = u->m[2 * j + 1] = -(dmin * (float)mn);
        const uint8_t *src = qs + 32 * (j >> 1);
        int sl = 4 * (j & 1);
        uint8_t *q = u->q + 32 * j;
        if (qtype == Q4_K) {
            for (int i = 0; i < 32; i++) q[i] = (uint8_t)((src[i] >> sl) & 15);
        } else {
            for (int i = 0; i < 32; i++)
                q[i] = (uint8_t)(((src[i] >> sl) & 15) | (((qh[i] >> j) & 1) << 4));
        }
    }
}

#ifdef KQ_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[r * ldo] for r < R: row wrow (nb super-blocks) against R rows of x (stride ldx). */
static void row_dot(const uint8_t *wrow, int64_t nb, int qtype, int bb, const float *x,
                    int64_t ldx, int R, float *out, int64_t ldo) {
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
#else
static void row_dot(const uint8_t *wrow, int64_t nb, int qtype, int bb, const float *x,
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

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W.T, W [N, K / 256 blocks]. */
int gguf_kq_mm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
               int64_t w_row_bytes, int qtype, float *out, int64_t ldo, int nthreads) {
    int bb = block_bytes(qtype);
    if (bb == 0 || K % QK_K || w_row_bytes != K / QK_K * bb) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m = 0; m < M; m += 4) {
            int R = M - m < 4 ? (int)(M - m) : 4;
            row_dot(w + n * w_row_bytes, K / QK_K, qtype, bb, x + m * ldx, ldx, R,
                    out + m * ldo + n, ldo);
        }
    }
    return 0;
}

/* out [R, K] float32 = rows idx[0..R) of W [N, K / 256 blocks] dequantized. */
int gguf_kq_dequant_rows(const uint8_t *w, int64_t K, int64_t w_row_bytes, int qtype,
                         const int64_t *idx, int64_t R, float *out, int nthreads) {
    int bb = block_bytes(qtype);
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
