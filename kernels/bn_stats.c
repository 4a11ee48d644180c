/* Robust BN's statistics pass on the CPU: per channel, the batch mean and biased variance
   of a float32 NCHW activation from one read, and optionally the running statistics moved
   toward them (mean and unbiased variance, PyTorch BN's momentum convention): what
   torch.batch_norm_update_stats does for this layout in several passes.
   Each row (one sample's channel) is summed as d = x - x[row start] and d^2 in float lanes
   over blocks of BLOCK values, the blocks added in double; rows are merged into their
   channel with Chan et al.'s pairwise update (count, mean, M2) in double, so no step
   subtracts two large sums. AVX2 lanes where available (-DDAF_PORTABLE: plain loops). */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
#include <immintrin.h>
#endif

#define BLOCK 512

/* Sums of d = p[i] - k and d^2 over one block of len values, added to *sum, *sumsq. */
static void block_sums(const float *p, int64_t len, float k, double *sum, double *sumsq) {
    int64_t i = 0;
    float s = 0.0f, q = 0.0f;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    const __m256 vk = _mm256_set1_ps(k);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 q0 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();
    for (; i + 16 <= len; i += 16) {
        const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(p + i), vk);
        const __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(p + i + 8), vk);
        s0 = _mm256_add_ps(s0, d0);
        s1 = _mm256_add_ps(s1, d1);
        q0 = _mm256_add_ps(q0, _mm256_mul_ps(d0, d0));
        q1 = _mm256_add_ps(q1, _mm256_mul_ps(d1, d1));
    }
    float ls[8], lq[8];
    _mm256_storeu_ps(ls, _mm256_add_ps(s0, s1));
    _mm256_storeu_ps(lq, _mm256_add_ps(q0, q1));
    for (int j = 0; j < 8; ++j) {
        s += ls[j];
        q += lq[j];
    }
#endif
    for (; i < len; ++i) {
        const float d = p[i] - k;
        s += d;
        q += d * d;
    }
    *sum += s;
    *sumsq += q;
}

/* x: n samples of c channels of hw values, NCHW-contiguous. mean/var: c floats out.
   running_mean/running_var: moved when not NULL. Returns 1 when its scratch cannot be
   allocated. */
int bn_stats(const float *x, int64_t n, int64_t c, int64_t hw, float *mean, float *var,
             float *running_mean, float *running_var, float momentum) {
    double *acc = calloc((size_t)(2 * c), sizeof(double));  /* per channel: mean, M2 */
    if (!acc) return 1;
    for (int64_t b = 0; b < n; ++b)
        for (int64_t j = 0; j < c; ++j) {
            const float *row = x + (b * c + j) * hw;
            double s = 0.0, q = 0.0;
            for (int64_t i = 0; i < hw; i += BLOCK)
                block_sums(row + i, hw - i < BLOCK ? hw - i : BLOCK, row[0], &s, &q);
            const double row_mean = row[0] + s / (double)hw, row_m2 = q - s * s / (double)hw;
            const double seen = (double)(b * hw), delta = row_mean - acc[j];
            acc[j] += delta * (double)hw / (seen + (double)hw);
            acc[c + j] += (row_m2 > 0.0 ? row_m2 : 0.0) + delta * delta * seen * (double)hw /
                          (seen + (double)hw);
        }
    const int64_t count = n * hw;
    for (int64_t j = 0; j < c; ++j) {
        const double v = acc[c + j] / (double)count;
        mean[j] = (float)acc[j];
        var[j] = (float)v;
        if (running_mean) {
            const double unbiased = count > 1 ? acc[c + j] / (double)(count - 1) : v;
            running_mean[j] = (1.0f - momentum) * running_mean[j] + momentum * mean[j];
            running_var[j] = (1.0f - momentum) * running_var[j] + momentum * (float)unbiased;
        }
    }
    free(acc);
    return 0;
}
