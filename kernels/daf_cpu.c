/* DAF's per-element passes on the CPU (tta_kernels.native): quantize + bit-pack and
 * unpack + dequantize, in the format tta_kernels.reference defines. The per-group min/max
 * and scales come from PyTorch (so NaN handling and the reciprocal's rounding are PyTorch's);
 * these loops do the two float32 operations of each direction exactly as PyTorch's separate
 * kernels round them: compile with -ffp-contract=off and without -ffast-math. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* codes as above -> out: G * group floats, q * scale + mn (product, then sum). */
int daf_unpack_dequantize(const uint8_t *codes, const float *mn, const float *scale,
                          int64_t G, int64_t group, int bits, float *out) {
    const int64_t per = 8 / bits, nbytes = group / per;
    uint8_t *q = malloc((size_t)group);
    if (q == NULL) return -1;
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *in = codes + g * nbytes;
        if (per == 1) {
            memcpy(q, in, (size_t)group);
        } else if (per == 2) {
            for (int64_t b = 0; b < nbytes; ++b) {
                q[2 * b] = in[b] & 15;
                q[2 * b + 1] = in[b] >> 4;
            }
        } else {
            for (int64_t b = 0; b < nbytes; ++b) {
                q[4 * b] = in[b] & 3;
                q[4 * b + 1] = (in[b] >> 2) & 3;
                q[4 * b + 2] = (in[b] >> 4) & 3;
                q[4 * b + 3] = in[b] >> 6;
            }
        }
        float *o = out + g * group;
        const float s = scale[g], m = mn[g];
        for (int64_t i = 0; i < group; ++i) {
            float p = (float)q[i] * s;
            o[i] = p + m;
        }
    }
    free(q);
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

/* Inverse: out[i] = bit * d + l (product, then sum, as the PyTorch decode rounds it). */
void daf_mask_unpack(const uint8_t *bits, int64_t n, float d, float l, float *out) {
    for (int64_t i = 0; i < n; ++i) {
        float b = (float)((bits[i >> 3] >> (i & 7)) & 1);
        float p = b * d;
        out[i] = p + l;
    }
}
