/* DAF's passes on the CPU (tta_kernels.native), in the format tta_kernels.reference
 * defines: fused quantize + bit-pack (per-group min/max, scales and codes in one read of
 * each group, optionally with the 1-bit band mask of the same values), quantize + pack from
 * given minima and reciprocals (the unfused baseline), unpack + dequantize, 1-bit masks.
 * Every float32 operation is rounded as PyTorch's separate kernels round it: compile with
 * -ffp-contract=off and without -ffast-math. -DDAF_PORTABLE leaves out the x86 intrinsics
 * (the generic loops, as on ARM). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
#include <immintrin.h>
#endif

/* This OpenMP thread's index (0 without OpenMP): picks its slice of the scratch. */
static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#define MAGIC 8388608.0f /* 2**23: v + 2**23 rounds v (0 <= v < 2**22) half to even */

/* x: G rows of `group` floats; mn, inv: per row; codes: G * group * bits / 8 bytes.
 * Returns 0, or -1 when the scratch row cannot be allocated. */
int daf_quantize_pack(const float *x, int64_t G, int64_t group, int bits, const float *mn,
                      const float *inv, uint8_t *codes) {
    const int64_t per = 8 / bits, nbytes = group / per;
    uint8_t *q = malloc((size_t)group);
    if (q == NULL) return -1;
    for (int64_t g = 0; g < G; ++g) {
        const float *row = x + g * group;
        const float m = mn[g], s = inv[g];
        for (int64_t i = 0; i < group; ++i) {
            float t = (row[i] - m) * s;
            t = t + MAGIC;
            uint32_t u;
            memcpy(&u, &t, 4);
            q[i] = (uint8_t)u; /* the low mantissa byte holds the code */
        }
        uint8_t *out = codes + g * nbytes;
        if (per == 1) {
            memcpy(out, q, (size_t)group);
        } else if (per == 2) {
            for (int64_t b = 0; b < nbytes; ++b)
                out[b] = (uint8_t)(q[2 * b] | (q[2 * b + 1] << 4));
        } else {
            for (int64_t b = 0; b < nbytes; ++b)
                out[b] = (uint8_t)(q[4 * b] | (q[4 * b + 1] << 2) | (q[4 * b + 2] << 4) |
                                   (q[4 * b + 3] << 6));
        }
    }
    free(q);
    return 0;
}

/* Values of a dequantized ReLU output made to agree with its exact mask (bit j of mask[k]:
 * x[8k + j] > 0): set bit and value <= 0 (a positive x whose code rounded to the group's
 * min 0) -> RELU_TINY; clear bit and value > 0 -> 0; every other value unchanged.
 * RELU_TINY = 2**-64: its products with gradients vanish in any sum, yet are not
 * denormals (FLT_MIN's would be: the conv backward would run at the CPU's slow denormal
 * rate). */
#define RELU_TINY 0x1p-64f
static void relu_agree(float *o, const uint8_t *mask, int64_t len) {
    int64_t k = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    /* eight values per mask byte: lane j selects on bit j, the same two choices */
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 zero = _mm256_setzero_ps(), tiny = _mm256_set1_ps(RELU_TINY);
    for (; 8 * k + 8 <= len; ++k) {
        const __m256i bit = _mm256_and_si256(_mm256_set1_epi32(mask[k]), lane_bit);
        const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane_bit));
        const __m256 a = _mm256_loadu_ps(o + 8 * k);
        const __m256 pos = _mm256_cmp_ps(a, zero, _CMP_GT_OQ);
        const __m256 if_set = _mm256_blendv_ps(tiny, a, pos), if_clear = _mm256_blendv_ps(a, zero, pos);
        _mm256_storeu_ps(o + 8 * k, _mm256_blendv_ps(if_clear, if_set, set));
    }
#endif
    for (; 8 * k < len; ++k) {
        const uint32_t byte = mask[k];
        const int64_t end = len - 8 * k < 8 ? len - 8 * k : 8;
        float *v = o + 8 * k;
        for (int64_t j = 0; j < end; ++j) {
            const float a = v[j];
            v[j] = (byte >> j) & 1 ? (a > 0.0f ? a : RELU_TINY) : (a > 0.0f ? 0.0f : a);
        }
    }
}

/* 2-bit codes of nbytes bytes -> q (4 per byte, low bits first). */
static void unpack2(const uint8_t *in, int64_t nbytes, uint8_t *q) {
    int64_t b = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    const __m128i three = _mm_set1_epi8(3);
    for (; b + 16 <= nbytes; b += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(in + b));
        const __m128i c0 = _mm_and_si128(v, three), c1 = _mm_and_si128(_mm_srli_epi16(v, 2), three);
        const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), three);
        const __m128i c3 = _mm_and_si128(_mm_srli_epi16(v, 6), three);
        const __m128i lo01 = _mm_unpacklo_epi8(c0, c1), hi01 = _mm_unpackhi_epi8(c0, c1);
        const __m128i lo23 = _mm_unpacklo_epi8(c2, c3), hi23 = _mm_unpackhi_epi8(c2, c3);
        _mm_storeu_si128((__m128i *)(q + 4 * b), _mm_unpacklo_epi16(lo01, lo23));
        _mm_storeu_si128((__m128i *)(q + 4 * b + 16), _mm_unpackhi_epi16(lo01, lo23));
        _mm_storeu_si128((__m128i *)(q + 4 * b + 32), _mm_unpacklo_epi16(hi01, hi23));
        _mm_storeu_si128((__m128i *)(q + 4 * b + 48), _mm_unpackhi_epi16(hi01, hi23));
    }
#endif
    for (; b < nbytes; ++b) {
        q[4 * b] = in[b] & 3;
        q[4 * b + 1] = (in[b] >> 2) & 3;
        q[4 * b + 2] = (in[b] >> 4) & 3;
        q[4 * b + 3] = in[b] >> 6;
    }
}

static int unpack_rows(const uint8_t *codes, const float *mn, const float *scale, int64_t G,
                       int64_t group, int bits, const uint8_t *mask, int64_t n, float *out,
                       int threads);

/* codes as above -> out: G * group floats, q * scale + mn (product, then sum). Groups are
 * split among `threads` OpenMP threads (each group's values do not depend on the split). */
int daf_unpack_dequantize(const uint8_t *codes, const float *mn, const float *scale,
                          int64_t G, int64_t group, int bits, float *out, int threads) {
    return unpack_rows(codes, mn, scale, G, group, bits, NULL, 0, out, threads);
}

/* As daf_unpack_dequantize, then the first n values made to agree with a ReLU output's
 * 1-bit mask (relu_agree), row by row while the row is in L1: value > 0 exactly where the
 * mask is set, so one tensor serves the ReLU's backward and the next conv's ∂W. */
int daf_unpack_dequantize_relu(const uint8_t *codes, const float *mn, const float *scale,
                               int64_t G, int64_t group, int bits, const uint8_t *mask,
                               int64_t n, float *out, int threads) {
    return unpack_rows(codes, mn, scale, G, group, bits, mask, n, out, threads);
}

static int unpack_rows(const uint8_t *codes, const float *mn, const float *scale, int64_t G,
                       int64_t group, int bits, const uint8_t *mask, int64_t n, float *out,
                       int threads) {
    const int64_t per = 8 / bits, nbytes = group / per;
    if (threads < 1) threads = 1;
    uint8_t *scratch = malloc((size_t)(group * threads));  /* a code row per thread */
    if (scratch == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < G; ++g) {
        uint8_t *q = scratch + group * thread_index();
        const uint8_t *in = codes + g * nbytes;
        if (per == 1) {
            memcpy(q, in, (size_t)group);
        } else if (per == 2) {
            for (int64_t b = 0; b < nbytes; ++b) {
                q[2 * b] = in[b] & 15;
                q[2 * b + 1] = in[b] >> 4;
            }
        } else {
            unpack2(in, nbytes, q);
        }
        float *o = out + g * group;
        const float s = scale[g], m = mn[g];
        for (int64_t i = 0; i < group; ++i) {
            float p = (float)q[i] * s;
            o[i] = p + m;
        }
        if (mask != NULL && g * group < n) {
            const int64_t len = n - g * group < group ? n - g * group : group;
            relu_agree(o, mask + g * (group / 8), len);
        }
    }
    free(scratch);
    return 0;
}

/* Exact 1-bit activation masks (tta_core.memory.packed.PackedMask): bit j of byte k is
 * lo < x[8k + j] < hi (hi = +inf: x > lo; NaN: 0), the tail byte zero-padded. */
void daf_mask_pack(const float *x, int64_t n, float lo, float hi, uint8_t *out) {
    const int64_t full = n / 8;
    for (int64_t k = 0; k < full; ++k) {
        const float *v = x + 8 * k;
        uint32_t byte = 0;
        for (int j = 0; j < 8; ++j) byte |= (uint32_t)((v[j] > lo) & (v[j] < hi)) << j;
        out[k] = (uint8_t)byte;
    }
    if (n % 8) {
        uint32_t byte = 0;
        for (int64_t i = 8 * full; i < n; ++i)
            byte |= (uint32_t)((x[i] > lo) & (x[i] < hi)) << (i - 8 * full);
        out[full] = (uint8_t)byte;
    }
}

/* Inverse: out[i] = bit * d + l (product, then sum, as the PyTorch decode rounds it): each
 * value is one of two, both computed once; a whole byte expands to 8 selects (AVX2: one
 * compare and blend; a shift by the element index per value does not vectorise). */
void daf_mask_unpack(const uint8_t *bits, int64_t n, float d, float l, float *out) {
    const float zero = 0.0f * d, one = 1.0f * d;
    const float v0 = zero + l, v1 = one + l;
    const int64_t full = n / 8;
    int64_t k = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 w0 = _mm256_set1_ps(v0), w1 = _mm256_set1_ps(v1);
    for (; k < full; ++k) {
        const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[k]), lane);
        const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane));
        _mm256_storeu_ps(out + 8 * k, _mm256_blendv_ps(w0, w1, set));
    }
#endif
    for (; k < full; ++k) {
        const uint32_t byte = bits[k];
        float *o = out + 8 * k;
        for (int j = 0; j < 8; ++j) o[j] = (byte >> j) & 1 ? v1 : v0;
    }
    for (int64_t i = 8 * full; i < n; ++i) out[i] = (bits[i >> 3] >> (i & 7)) & 1 ? v1 : v0;
}

/* ---- fused quantize + pack (one read of each group, DAF §3.2.3 on the CPU) ---------- */

/* A row holding a NaN: its first NaN as both min and max (amin / amax propagate NaN). */
static void row_nan(const float *row, float *mn, float *mx) {
    int64_t i = 0;
    while (row[i] == row[i]) ++i;
    *mn = *mx = row[i];
}

#if defined(__AVX2__) && !defined(DAF_PORTABLE)
/* Min and max of one row (len a multiple of 8) as torch.amin / amax give them (a NaN row:
 * row_nan). AVX2: per 8-float lane min/max (vminps/vmaxps: a < b ? a : b, as the scalar loop), two
 * accumulators, then a log2 tree over the lanes (DAF §3.2.1's tree, in one register). */
static void row_minmax(const float *row, int64_t len, float *mn, float *mx) {
    __m256 lo0 = _mm256_loadu_ps(row), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    __m256 bad = _mm256_cmp_ps(lo0, lo0, _CMP_UNORD_Q);
    int64_t i = 8;
    for (; i + 16 <= len; i += 16) {
        const __m256 v = _mm256_loadu_ps(row + i), w = _mm256_loadu_ps(row + i + 8);
        lo0 = _mm256_min_ps(v, lo0);
        hi0 = _mm256_max_ps(v, hi0);
        lo1 = _mm256_min_ps(w, lo1);
        hi1 = _mm256_max_ps(w, hi1);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, w, _CMP_UNORD_Q));
    }
    if (i < len) {
        const __m256 v = _mm256_loadu_ps(row + i);
        lo0 = _mm256_min_ps(v, lo0);
        hi0 = _mm256_max_ps(v, hi0);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(bad)) {
        row_nan(row, mn, mx);
        return;
    }
    __m128 lo = _mm_min_ps(_mm256_castps256_ps128(_mm256_min_ps(lo0, lo1)),
                           _mm256_extractf128_ps(_mm256_min_ps(lo0, lo1), 1));
    __m128 hi = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(hi0, hi1)),
                           _mm256_extractf128_ps(_mm256_max_ps(hi0, hi1), 1));
    lo = _mm_min_ps(lo, _mm_movehl_ps(lo, lo));
    hi = _mm_max_ps(hi, _mm_movehl_ps(hi, hi));
    lo = _mm_min_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    hi = _mm_max_ss(hi, _mm_shuffle_ps(hi, hi, 1));
    *mn = _mm_cvtss_f32(lo);
    *mx = _mm_cvtss_f32(hi);
}
#else
/* As above; portable: 8 independent lane minima (the compiler vectorises the compare-selects). */
static void row_minmax(const float *row, int64_t len, float *mn, float *mx) {
    float lo[8], hi[8];
    int bad = 0;
    for (int j = 0; j < 8; ++j) lo[j] = hi[j] = row[j];
    for (int64_t i = 0; i < len; i += 8) {
        for (int j = 0; j < 8; ++j) {
            const float v = row[i + j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            bad |= v != v;
        }
    }
    if (bad) {
        row_nan(row, mn, mx);
        return;
    }
    for (int j = 1; j < 8; ++j) {
        lo[0] = lo[j] < lo[0] ? lo[j] : lo[0];
        hi[0] = hi[j] > hi[0] ? hi[j] : hi[0];
    }
    *mn = lo[0];
    *mx = hi[0];
}
#endif

/* One row's codes from its min and reciprocal scale, packed (as daf_quantize_pack):
 * one vectorised loop into the scratch row q, then the packing loop. */
static void row_codes(const float *row, int64_t group, int bits, float m, float s,
                      uint8_t *q, uint8_t *out) {
    const int64_t per = 8 / bits, nbytes = group / per;
    uint8_t *dst = per == 1 ? out : q;
    for (int64_t i = 0; i < group; ++i) {
        float t = (row[i] - m) * s;
        t = t + MAGIC;
        uint32_t u;
        memcpy(&u, &t, 4);
        dst[i] = (uint8_t)u;
    }
    if (per == 2) {
        for (int64_t b = 0; b < nbytes; ++b)
            out[b] = (uint8_t)(q[2 * b] | (q[2 * b + 1] << 4));
    } else if (per == 4) {
        for (int64_t b = 0; b < nbytes; ++b)
            out[b] = (uint8_t)(q[4 * b] | (q[4 * b + 1] << 2) | (q[4 * b + 2] << 4) |
                               (q[4 * b + 3] << 6));
    }
}

/* Packed bits of lo < v < hi for len values (bit j of byte k: value 8k + j), the last
 * byte zero-padded; NaN: 0. */
static void row_mask(const float *row, int64_t len, float lo, float hi, uint8_t *out) {
    int64_t k = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (; 8 * k + 8 <= len; ++k) {
        const __m256 v = _mm256_loadu_ps(row + 8 * k);
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GT_OQ),
                                        _mm256_cmp_ps(v, vhi, _CMP_LT_OQ));
        out[k] = (uint8_t)_mm256_movemask_ps(in);
    }
#endif
    for (; 8 * k < len; ++k) {
        uint32_t byte = 0;
        const int64_t end = len - 8 * k < 8 ? len - 8 * k : 8;
        for (int64_t j = 0; j < end; ++j) {
            const float v = row[8 * k + j];
            byte |= (uint32_t)((v > lo) & (v < hi)) << j;
        }
        out[k] = (uint8_t)byte;
    }
}

/* Fused quantize + pack of flat x (n floats): per group of `group` (a multiple of 8) its
 * min/max, scale and reciprocal exactly as tta_kernels.reference computes them
 * (inv = (1 / rng) * L: PyTorch's scalar / tensor; scale = rng / L), then its codes, while
 * the group is still in L1. The last group is padded with x[n - 1]. With `mask` not NULL,
 * also the packed bits of lo < x < hi (ceil(n / 8) bytes; daf_mask_pack's layout) in the
 * same pass. Groups are split among `threads` OpenMP threads. Returns 0, or -1 when the
 * scratch rows cannot be allocated. */
int daf_quantize_pack_fused(const float *x, int64_t n, int64_t group, int bits,
                            uint8_t *codes, float *mn, float *scale, float lo, float hi,
                            uint8_t *mask, int threads) {
    const int64_t G = (n + group - 1) / group, nbytes = group * bits / 8;
    const float levels = (float)((1 << bits) - 1);
    if (threads < 1) threads = 1;
    /* per thread: a padded row (floats) and a code row (bytes) */
    float *scratch = malloc((size_t)(group * threads) * (sizeof(float) + 1));
    if (scratch == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < G; ++g) {
        float *pad = scratch + group * thread_index();
        uint8_t *q = (uint8_t *)(scratch + group * threads) + group * thread_index();
        const float *row = x + g * group;
        const int64_t valid = n - g * group < group ? n - g * group : group;
        if (valid < group) {
            memcpy(pad, row, (size_t)valid * sizeof(float));
            for (int64_t i = valid; i < group; ++i) pad[i] = x[n - 1];
            row = pad;
        }
        float a, b;
        row_minmax(row, group, &a, &b);
        const float rng = b - a;
        float inv = 0.0f;
        if (rng > 0.0f) {
            const float r = 1.0f / rng;
            inv = r * levels;
        }
        mn[g] = a;
        scale[g] = rng / levels;
        row_codes(row, group, bits, a, inv, q, codes + g * nbytes);
        if (mask != NULL) row_mask(row, valid, lo, hi, mask + g * (group / 8));
    }
    free(scratch);
    return 0;
}
