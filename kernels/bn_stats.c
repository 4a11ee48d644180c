/* Robust BN's statistics pass on the CPU: per channel, the batch mean and biased variance
   of a float32 NCHW activation from one read, and optionally the running statistics moved
   toward them (mean and unbiased variance, PyTorch BN's momentum convention): what
   torch.batch_norm_update_stats does for this layout in several passes.
   Each row (one sample's channel) is summed as d = x - x[row start] and d^2 in float lanes
   over blocks of BLOCK values, the blocks added in double; rows are merged into their
   channel with Chan et al.'s pairwise update (count, mean, M2) in double, so no step
   subtracts two large sums. AVX2 lanes where available (-DDAF_PORTABLE: plain loops).
   bn_stats_nhwc does the same for a channels-last activation (rows of c channels): each
   channel is summed about its value in the first row, in float lanes across channels over
   blocks of ROWS rows, the blocks added in double (PyTorch's pass there reads x twice). */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
#include <immintrin.h>
#endif

#define BLOCK 512
#define ROWS 64

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

/* Moves the running statistics toward a batch's (mean, unbiased variance), PyTorch BN's
   momentum convention. */
static void move_running(int64_t c, const float *mean, const double *m2, int64_t count,
                         float *running_mean, float *running_var, float momentum) {
    for (int64_t j = 0; j < c; ++j) {
        const double unbiased = count > 1 ? m2[j] / (double)(count - 1) : m2[j] / (double)count;
        running_mean[j] = (1.0f - momentum) * running_mean[j] + momentum * mean[j];
        running_var[j] = (1.0f - momentum) * running_var[j] + momentum * (float)unbiased;
    }
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
        mean[j] = (float)acc[j];
        var[j] = (float)(acc[c + j] / (double)count);
    }
    if (running_mean) move_running(c, mean, acc + c, count, running_mean, running_var, momentum);
    free(acc);
    return 0;
}

/* Float sums of d = x - k and d^2 per channel over `rows` rows of c values each, added
   into s and q (c floats each). */
static void rows_sums(const float *x, int64_t rows, int64_t c, const float *k, float *s,
                      float *q) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * c;
        int64_t j = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
        for (; j + 8 <= c; j += 8) {
            const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(k + j));
            _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(s + j), d));
            _mm256_storeu_ps(q + j, _mm256_add_ps(_mm256_loadu_ps(q + j), _mm256_mul_ps(d, d)));
        }
#endif
        for (; j < c; ++j) {
            const float d = row[j] - k[j];
            s[j] += d;
            q[j] += d * d;
        }
    }
}

/* x: n_rows rows of c channels, channels-last (NHWC-contiguous: n_rows = N*H*W).
   mean/var: c floats out; running_mean/running_var moved when not NULL. Returns 1 when its
   scratch cannot be allocated. */
int bn_stats_nhwc(const float *x, int64_t n_rows, int64_t c, float *mean, float *var,
                  float *running_mean, float *running_var, float momentum) {
    double *acc = calloc((size_t)(2 * c), sizeof(double));  /* per channel: sum d, sum d^2 */
    float *blk = malloc((size_t)(2 * c) * sizeof(float));
    if (!acc || !blk) {
        free(acc);
        free(blk);
        return 1;
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += ROWS) {
        const int64_t rows = n_rows - r0 < ROWS ? n_rows - r0 : ROWS;
        for (int64_t j = 0; j < 2 * c; ++j) blk[j] = 0.0f;
        rows_sums(x + r0 * c, rows, c, x, blk, blk + c);
        for (int64_t j = 0; j < 2 * c; ++j) acc[j] += blk[j];
    }
    for (int64_t j = 0; j < c; ++j) {
        const double s = acc[j], m2 = acc[c + j] - s * s / (double)n_rows;
        acc[c + j] = m2 > 0.0 ? m2 : 0.0;
        mean[j] = (float)(x[j] + s / (double)n_rows);
        var[j] = (float)(acc[c + j] / (double)n_rows);
    }
    if (running_mean) move_running(c, mean, acc + c, n_rows, running_mean, running_var, momentum);
    free(acc);
    free(blk);
    return 0;
}
