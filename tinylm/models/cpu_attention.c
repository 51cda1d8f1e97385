/* The decoding step's attention on the CPU, for float32 (tinylm/models/cpu_attention.py builds and
   loads this file). One query row per head attends over a few dozen cached slots: as batched
   matrix products that is hundreds of tiny products a step, each paying a library call's setup,
   and every slot of every row is read even where the mask hides it. Here each (row, head) is one
   loop over its slots through 8-wide fused multiply-adds where the CPU has them (AVX2 + FMA), a
   plain loop elsewhere. A hidden slot scores -inf whatever its key holds and its value is never
   read; keys are skipped eight hidden slots at a time.

   Layouts (all float32): q (BH, G, D) contiguous, G query heads per key/value head; keys and
   values: row bh's slot s at k + bh * kv_stride + s * D; bias (BH, S) additive at
   bias + bh * bias_stride, -inf where a slot is hidden. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EIGHT_WIDE 1
#endif

static int hidden(float bias) { return isinf(bias) && bias < 0; }

#ifdef EIGHT_WIDE
/* The sums of each of eight vectors' lanes, in order. */
static __m256 lane_sums(__m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* Eight slots' scores from s on; returns 0 when all eight are hidden (their keys are not read). */
static int eight_scores(const float *q, const float *k, const float *bias, float *out, int64_t s, int64_t D,
                        float scale) {
    int seen = 0;
    for (int j = 0; j < 8; j++) seen |= !hidden(bias[s + j]);
    if (!seen) return 0;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (s + j) * D + d), a[j]);
    }
    __m256 b = _mm256_loadu_ps(bias + s), minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 x = _mm256_fmadd_ps(lane_sums(a), _mm256_set1_ps(scale), b);
    /* hidden slots of a block that is read score -inf whatever their keys hold */
    _mm256_storeu_ps(out + s, _mm256_blendv_ps(x, minus_inf, _mm256_cmp_ps(b, minus_inf, _CMP_EQ_OQ)));
    return 1;
}
#endif

/* One query row's scores over S slots into out: scale * (q . key) + bias, -inf where hidden. */
static void scores_of(const float *q, const float *k, const float *bias, float *out, int64_t S, int64_t D,
                      float scale) {
    int64_t s = 0;
#ifdef EIGHT_WIDE
    if (D % 8 == 0)
        for (; s + 8 <= S; s += 8)
            if (!eight_scores(q, k, bias, out, s, D, scale))
                for (int j = 0; j < 8; j++) out[s + j] = -INFINITY;
#endif
    for (; s < S; s++) {
        if (hidden(bias[s])) {
            out[s] = -INFINITY;
            continue;
        }
        float x = 0;
        for (int64_t d = 0; d < D; d++) x += q[d] * k[s * D + d];
        out[s] = x * scale + bias[s];
    }
}

/* out (D) = the slots' values weighted by w (S), over total; slots of weight 0 are not read. */
static void mix_of(const float *w, const float *v, float *out, int64_t S, int64_t D, float total) {
    float inv = 1.0f / total;
#ifdef EIGHT_WIDE
    if (D % 8 == 0 && D <= 128) {
        __m256 a[16];
        int64_t n = D / 8;
        for (int64_t i = 0; i < n; i++) a[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            if (w[s] == 0.0f) continue;
            __m256 ws = _mm256_set1_ps(w[s]);
            for (int64_t i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(v + s * D + 8 * i), a[i]);
        }
        for (int64_t i = 0; i < n; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) out[d] = 0;
    for (int64_t s = 0; s < S; s++) {
        if (w[s] == 0.0f) continue;
        for (int64_t d = 0; d < D; d++) out[d] += w[s] * v[s * D + d];
    }
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* out (BH, G, D) = softmax(scale * q . keys + bias) . values for every query row of q (BH, G, D).
   Returns 0, or -1 when scratch memory for the scores could not be had. */
int decode_attention(const float *q, const float *k, const float *v, const float *bias, float *out, int64_t BH,
                     int64_t G, int64_t S, int64_t D, int64_t kv_stride, int64_t bias_stride, float scale) {
    float stack[1024], *w = S <= 1024 ? stack : malloc(S * sizeof(float));
    if (w == NULL) return -1;
    for (int64_t bh = 0; bh < BH; bh++) {
        const float *kb = k + bh * kv_stride, *vb = v + bh * kv_stride, *mb = bias + bh * bias_stride;
        for (int64_t g = 0; g < G; g++) {
            scores_of(q + (bh * G + g) * D, kb, mb, w, S, D, scale);
            float top = -INFINITY, total = 0;
            for (int64_t s = 0; s < S; s++) top = w[s] > top ? w[s] : top;
            for (int64_t s = 0; s < S; s++) {
                w[s] = w[s] == -INFINITY ? 0.0f : expf(w[s] - top);
                total += w[s];
            }
            mix_of(w, vb, out + (bh * G + g) * D, S, D, total);
        }
    }
    if (w != stack) free(w);
    return 0;
}
