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
   blocks of ROWS rows, the blocks added in double (PyTorch's pass there reads x twice).
   Both can write x normalised by eval-mode BN with the running statistics as they were,
   in the same read (robust BN with a one-batch lag), and split the pass among OpenMP
   threads: channels for NCHW, runs of row blocks for channels-last. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
#include <immintrin.h>
#endif

#define BLOCK 512
#define ROWS 64
#define WIDE 512
#define SUB_ROWS 8
#define STREAM_VALUES (1 << 19)  /* 2 MiB of floats */

/* Sums of d = p[i] - k and d^2 over one block of len values, added to *sum, *sumsq; with
   o, also writes o[i] = p[i] * a + b (the normalised block) in the same read. */
static void block_sums(const float *p, float *o, int64_t len, float k, float a, float b,
                       double *sum, double *sumsq) {
    int64_t i = 0;
    float s = 0.0f, q = 0.0f;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    const __m256 vk = _mm256_set1_ps(k), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 q0 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();
    for (; i + 16 <= len; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(p + i), x1 = _mm256_loadu_ps(p + i + 8);
        const __m256 d0 = _mm256_sub_ps(x0, vk), d1 = _mm256_sub_ps(x1, vk);
        if (o) {
            _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(x0, va), vb));
            _mm256_storeu_ps(o + i + 8, _mm256_add_ps(_mm256_mul_ps(x1, va), vb));
        }
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
        if (o) o[i] = p[i] * a + b;
        s += d;
        q += d * d;
    }
    *sum += s;
    *sumsq += q;
}

/* Moves the running statistics toward a batch's (mean, unbiased variance), PyTorch BN's
   momentum convention; old (2c floats, or NULL) receives them as they were. */
static void move_running(int64_t c, const float *mean, const double *m2, int64_t count,
                         float *running_mean, float *running_var, float momentum,
                         float *old) {
    for (int64_t j = 0; j < c; ++j) {
        if (old) {
            old[j] = running_mean[j];
            old[c + j] = running_var[j];
        }
        const double unbiased = count > 1 ? m2[j] / (double)(count - 1) : m2[j] / (double)count;
        running_mean[j] = (1.0f - momentum) * running_mean[j] + momentum * mean[j];
        running_var[j] = (1.0f - momentum) * running_var[j] + momentum * (float)unbiased;
    }
}

/* Per channel, eval-mode BN as one multiply-add: a = w / sqrt(running_var + eps),
   b = bias - running_mean * a (w 1 and bias 0 where NULL). */
static void affine(int64_t c, const float *running_mean, const float *running_var,
                   const float *weight, const float *bias, float eps, float *a, float *b) {
    for (int64_t j = 0; j < c; ++j) {
        const double inv = 1.0 / sqrt((double)running_var[j] + (double)eps);
        a[j] = (float)((weight ? (double)weight[j] : 1.0) * inv);
        b[j] = (float)((bias ? (double)bias[j] : 0.0) - (double)running_mean[j] * a[j]);
    }
}

/* x: n samples of c channels of hw values, NCHW-contiguous. mean/var: c floats out.
   running_mean/running_var: moved when not NULL. out (NULL: statistics only): x normalised
   by eval-mode BN with the running statistics as they were before this call (weight, bias
   NULL where the layer has none), written in the same read. threads: channels are split
   among this many OpenMP threads (each channel's sums do not depend on the split). old
   (2c floats, or NULL): the running statistics before the move. Returns 1 when its scratch
   cannot be allocated. */
int bn_stats(const float *x, int64_t n, int64_t c, int64_t hw, float *mean, float *var,
             float *running_mean, float *running_var, float momentum, float *out,
             const float *weight, const float *bias, float eps, int threads, float *old) {
    double *acc = calloc((size_t)(2 * c), sizeof(double));  /* per channel: mean, M2 */
    float *ab = out ? malloc((size_t)(2 * c) * sizeof(float)) : NULL;
    if (!acc || (out && !ab)) {
        free(acc);
        free(ab);
        return 1;
    }
    if (out) affine(c, running_mean, running_var, weight, bias, eps, ab, ab + c);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t j = 0; j < c; ++j)
        for (int64_t b = 0; b < n; ++b) {
            const float *row = x + (b * c + j) * hw;
            float *orow = out ? out + (b * c + j) * hw : NULL;
            const float a = ab ? ab[j] : 1.0f, sh = ab ? ab[c + j] : 0.0f;
            double s = 0.0, q = 0.0;
            for (int64_t i = 0; i < hw; i += BLOCK)
                block_sums(row + i, orow ? orow + i : NULL, hw - i < BLOCK ? hw - i : BLOCK,
                           row[0], a, sh, &s, &q);
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
    if (running_mean)
        move_running(c, mean, acc + c, count, running_mean, running_var, momentum, old);
    free(acc);
    free(ab);
    return 0;
}

#if defined(__AVX2__) && !defined(DAF_PORTABLE)
/* One register of 8 channels of one row: out = v * a + b (when o), d = v - k summed. */
static inline void lane8(const float *p, float *o, __m256 k, __m256 a, __m256 b, __m256 *s,
                         __m256 *q) {
    const __m256 v = _mm256_loadu_ps(p), d = _mm256_sub_ps(v, k);
    if (o) _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(v, a), b));
    *s = _mm256_add_ps(*s, d);
    *q = _mm256_add_ps(*q, _mm256_mul_ps(d, d));
}
#endif

/* Float sums of d = x - k and d^2 per channel over `rows` rows of c values each (rows
   ld apart), added into s and q (c floats each); with out, also writes out = x * a + b per
   channel. Sixteen channels (a cache line) at a time down the rows, sums in registers. */
static void rows_sums(const float *x, float *out, int64_t rows, int64_t c, int64_t ld,
                      const float *k, const float *a, const float *b, float *s, float *q) {
    int64_t j = 0;
#if defined(__AVX2__) && !defined(DAF_PORTABLE)
    for (; j + 8 <= c; j += 16) {
        const int two = j + 16 <= c;  /* a second register of 8 channels */
        const __m256 k0 = _mm256_loadu_ps(k + j), k1 = two ? _mm256_loadu_ps(k + j + 8) : k0;
        const __m256 a0 = out ? _mm256_loadu_ps(a + j) : k0, b0 = out ? _mm256_loadu_ps(b + j) : k0;
        const __m256 a1 = out && two ? _mm256_loadu_ps(a + j + 8) : a0;
        const __m256 b1 = out && two ? _mm256_loadu_ps(b + j + 8) : b0;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, q0 = s0, q1 = s0;
        for (int64_t r = 0; r < rows; ++r) {
            const float *p = x + r * ld + j;
            float *o = out ? out + r * ld + j : NULL;
            lane8(p, o, k0, a0, b0, &s0, &q0);
            if (two) lane8(p + 8, o ? o + 8 : NULL, k1, a1, b1, &s1, &q1);
        }
        _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(s + j), s0));
        _mm256_storeu_ps(q + j, _mm256_add_ps(_mm256_loadu_ps(q + j), q0));
        if (two) {
            _mm256_storeu_ps(s + j + 8, _mm256_add_ps(_mm256_loadu_ps(s + j + 8), s1));
            _mm256_storeu_ps(q + j + 8, _mm256_add_ps(_mm256_loadu_ps(q + j + 8), q1));
        } else {
            j -= 8;  /* only 8 were left: the scalar tail starts after them */
        }
    }
#endif
    for (int64_t r = 0; r < rows && j < c; ++r)
        for (int64_t i = j; i < c; ++i) {
            const float v = x[r * ld + i], d = v - k[i];
            if (out) out[r * ld + i] = v * a[i] + b[i];
            s[i] += d;
            q[i] += d * d;
        }
}

/* x: n_rows rows of c channels, channels-last (NHWC-contiguous: n_rows = N*H*W).
   mean/var: c floats out; running_mean/running_var moved when not NULL; out, weight, bias,
   eps, threads, old as bn_stats (each thread takes an equal run of row blocks).
   Returns 1 when its scratch cannot be allocated. */
int bn_stats_nhwc(const float *x, int64_t n_rows, int64_t c, float *mean, float *var,
                  float *running_mean, float *running_var, float momentum, float *out,
                  const float *weight, const float *bias, float eps, int threads,
                  float *old) {
    double *acc = calloc((size_t)(2 * c), sizeof(double));  /* per channel: sum d, sum d^2 */
    float *ab = malloc((size_t)(2 * c) * sizeof(float));  /* a, then b */
    if (!acc || !ab) {
        free(acc);
        free(ab);
        return 1;
    }
    if (out) affine(c, running_mean, running_var, weight, bias, eps, ab, ab + c);
    /* thread t sums the t-th of `threads` equal runs of row blocks into its own doubles
       (part + 2c t) through its own float block sums (scr + 2c t), then the parts are
       added in thread order; all scratch is allocated here, none in a worker thread */
    const int64_t blocks = (n_rows + ROWS - 1) / ROWS;
    /* wide rows (c >= WIDE: 2 KiB or more) are walked down SUB_ROWS at a time: the walk
       down a channel tile then follows SUB_ROWS address streams, not ROWS of them, which
       the prefetcher keeps up with */
    /* a tensor larger than the caches hold is walked one row at a time instead: one
       sequential address stream, which the prefetcher follows across pages, where a tile
       walk down a block of rows of 1 KiB or more starts a new stream on every page and
       waits on memory (in cache the tile walk, its sums in registers, is the faster) */
    const int64_t sub = n_rows * c >= STREAM_VALUES ? 1 : c >= WIDE ? SUB_ROWS : ROWS;
    double *part = calloc((size_t)(2 * c * threads), sizeof(double));
    float *scr = malloc((size_t)(2 * c * threads) * sizeof(float));
    const int failed = !part || !scr;
#pragma omp parallel num_threads(threads) if (threads > 1 && !failed)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        float *sq = failed ? NULL : scr + 2 * c * t;
        double *mine = failed ? NULL : part + 2 * c * t;
        const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        for (int64_t blk_i = b0; !failed && blk_i < b1; ++blk_i) {
            const int64_t r0 = blk_i * ROWS, rows = n_rows - r0 < ROWS ? n_rows - r0 : ROWS;
            for (int64_t j = 0; j < 2 * c; ++j) sq[j] = 0.0f;
            for (int64_t i = 0; i < rows; i += sub)
                rows_sums(x + (r0 + i) * c, out ? out + (r0 + i) * c : NULL,
                          rows - i < sub ? rows - i : sub, c, c, x, ab, ab + c, sq, sq + c);
            for (int64_t j = 0; j < 2 * c; ++j) mine[j] += sq[j];
        }
    }
    for (int t = 0; !failed && t < threads; ++t)
        for (int64_t j = 0; j < 2 * c; ++j) acc[j] += part[2 * c * t + j];
    free(part);
    free(scr);
    if (failed) {
        free(acc);
        free(ab);
        return 1;
    }
    for (int64_t j = 0; j < c; ++j) {
        const double s = acc[j], m2 = acc[c + j] - s * s / (double)n_rows;
        acc[c + j] = m2 > 0.0 ? m2 : 0.0;
        mean[j] = (float)(x[j] + s / (double)n_rows);
        var[j] = (float)(acc[c + j] / (double)n_rows);
    }
    if (running_mean)
        move_running(c, mean, acc + c, n_rows, running_mean, running_var, momentum, old);
    free(acc);
    free(ab);
    return 0;
}
