/* y = x W^T (+ b) in float32 for the few rows a decode or verify step feeds, on x86-64 with AVX2
 * and FMA. Built and loaded by runtime/native.py; see there for why it exists.
 *
 * x: [M, K] row-major, W: [N, K] row-major (a torch Linear's weight), b: [N] or NULL, y: [M, N].
 * Weight rows are taken four at a time and streamed once per call: each 8-float slice of the
 * four rows is multiplied into up to three input rows at once (12 accumulators), the rest of the
 * input rows reuse the four rows from L1, and the next four rows are prefetched meanwhile, so a
 * call costs about what reading W costs until the arithmetic itself dominates. Every output is
 * summed in the same order whatever M is (8 lanes over K, then the lanes, then the tail, then
 * the bias): a row's result does not depend on how many rows share the call. */
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float tail(const float *x, const float *w, long k0, long K) {
    float s = 0.0f;
    for (long k = k0; k < K; k++) s += x[k] * w[k];
    return s;
}

/* MB (1..3) input rows x 4 weight rows; prefetches the 4 weight rows after them when pf. */
static inline __attribute__((always_inline)) void tile4(const float *x, const float *w, float *y, int MB,
                                                         long K, long N, int pf) {
    const long K8 = K & ~7L;
    __m256 acc[3][4];
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    for (long k = 0; k < K8; k += 8) {
        if (pf)
            for (int j = 4; j < 8; j++) _mm_prefetch((const char *)(w + j * K + k), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
        __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
        for (int m = 0; m < MB; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(xv, w2, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(xv, w3, acc[m][3]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++) y[m * N + j] = hsum(acc[m][j]) + tail(x + m * K, w + j * K, K8, K);
}

/* MB (1..3) input rows x 1 weight row (the last N % 4 rows). */
static inline __attribute__((always_inline)) void tile1(const float *x, const float *w, float *y, int MB,
                                                         long K, long N) {
    const long K8 = K & ~7L;
    __m256 acc[3];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (long k = 0; k < K8; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w + k);
        for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m]);
    }
    for (int m = 0; m < MB; m++) y[m * N] = hsum(acc[m]) + tail(x + m * K, w, K8, K);
}

void livedraft_linear_f32(const float *x, const float *w, const float *b, float *y, long M, long K, long N) {
    long n = 0;
    for (; n + 4 <= N; n += 4) {
        const int pf = n + 8 <= N;
        long m = 0;
        for (; m + 3 <= M; m += 3) tile4(x + m * K, w + n * K, y + m * N + n, 3, K, N, pf && m == 0);
        if (M - m == 2) tile4(x + m * K, w + n * K, y + m * N + n, 2, K, N, pf && m == 0);
        else if (M - m == 1) tile4(x + m * K, w + n * K, y + m * N + n, 1, K, N, pf && m == 0);
    }
    for (; n < N; n++) {
        long m = 0;
        for (; m + 3 <= M; m += 3) tile1(x + m * K, w + n * K, y + m * N + n, 3, K, N);
        if (M - m == 2) tile1(x + m * K, w + n * K, y + m * N + n, 2, K, N);
        else if (M - m == 1) tile1(x + m * K, w + n * K, y + m * N + n, 1, K, N);
    }
    if (b)
        for (long m = 0; m < M; m++)
            for (long j = 0; j < N; j++) y[m * N + j] += b[j];
}
