/* The decoding step's attention on the CPU, for float32 (tinylm/models/cpu_attention.py builds and
   loads this file). One query row per head attends over a few dozen cached slots: as batched
   matrix products that is hundreds of tiny products a step, each paying a library call's setup,
   and every slot of every row is read even where the mask hides it. Here each (row, head) is one
   pass over its slots through 8-wide fused multiply-adds where the CPU has them (AVX2 + FMA), a
   plain loop elsewhere: the scores, their softmax (an 8-wide exponential), the weighted values.
   A hidden slot scores -inf and weighs exactly 0 whatever its key holds, and its value is never
   read; slots are skipped eight hidden ones at a time.

   Layouts (all float32): q (BH, G, D) contiguous, G query heads per key/value head; keys and
   values: row bh's slot s at k + bh * kv_stride + s * D; bias (BH, S) additive at
   bias + bh * bias_stride, -inf where a slot is hidden. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

static float sum8(__m256 x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static float max8(__m256 x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* e^x for eight x <= 0 (scores less their maximum); -inf gives exactly 0. x = n ln2 + r with
   |r| <= ln2 / 2, e^r by Cephes' expf polynomial, 2^n through the exponent bits: about 1e-7
   relative error. Below -87 (e^x under 1.6e-38, no normal float) it gives e^-87. */
static __m256 exp8(__m256 x) {
    __m256 gone = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(gone, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* Whether any of the eight slots from s on is seen. */
static inline int any_seen(const float *bias, int64_t s) {
    __m256 b = _mm256_loadu_ps(bias + s);
    return _mm256_movemask_ps(_mm256_cmp_ps(b, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ)) != 0;
}

/* Eight slots' scores from s on (at least one of them seen). */
static void eight_scores(const float *q, const float *k, const float *bias, float *out, int64_t s, int64_t D,
                         float scale) {
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
}
#endif

/* One query row's scores over S slots into w: scale * (q . key) + bias, -inf where hidden. */
static void scores_of(const float *q, const float *k, const float *bias, float *w, int64_t S, int64_t D,
                      float scale) {
    int64_t s = 0;
#ifdef EIGHT_WIDE
    if (D % 8 == 0) {
        for (; s + 8 <= S; s += 8) {
            if (any_seen(bias, s))
                eight_scores(q, k, bias, w, s, D, scale);
            else
                _mm256_storeu_ps(w + s, _mm256_set1_ps(-INFINITY));
        }
        for (; s < S; s++) { /* the last few slots, one at a time */
            if (hidden(bias[s])) {
                w[s] = -INFINITY;
                continue;
            }
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + s * D + d), a);
            w[s] = sum8(a) * scale + bias[s];
        }
    }
#endif
    for (; s < S; s++) {
        if (hidden(bias[s])) {
            w[s] = -INFINITY;
            continue;
        }
        float x = 0;
        for (int64_t d = 0; d < D; d++) x += q[d] * k[s * D + d];
        w[s] = x * scale + bias[s];
    }
}

/* The scores w (S) in place into e^(w - max w), hidden slots exactly 0; returns their sum. */
static float softmax_weights(float *w, int64_t S) {
    float top = -INFINITY, total = 0;
    int64_t s = 0;
#ifdef EIGHT_WIDE
    __m256 top8 = _mm256_set1_ps(-INFINITY), total8 = _mm256_setzero_ps();
    for (; s + 8 <= S; s += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(w + s));
    top = max8(top8);
#endif
    for (int64_t t = s; t < S; t++) top = w[t] > top ? w[t] : top;
    s = 0;
#ifdef EIGHT_WIDE
    for (; s + 8 <= S; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + s), _mm256_set1_ps(top)));
        _mm256_storeu_ps(w + s, e);
        total8 = _mm256_add_ps(total8, e);
    }
    total = sum8(total8);
#endif
    for (; s < S; s++) {
        w[s] = w[s] == -INFINITY ? 0.0f : expf(w[s] - top);
        total += w[s];
    }
    return total;
}

#ifdef EIGHT_WIDE
/* The weighted values for head sizes 8 n, n at most 16: n accumulators for each parity of the
   slot, so that one slot's fused multiply-adds do not wait for the slot's before it. Where n is a
   constant at the call (inlined), the accumulators stay in registers. Blocks of eight weights 0 are
   skipped. */
static inline __attribute__((always_inline)) void mix_eights(const float *w, const float *v, float *out, int64_t S,
                                                              float inv, const int n) {
    __m256 a[16], b[16], zero = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) a[i] = b[i] = zero;
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + s), zero, _CMP_NEQ_OQ)) == 0) continue;
        for (int64_t t = s; t < s + 8; t += 2) {
            const float *v0 = v + t * 8 * n, *v1 = v0 + 8 * n;
            __m256 w0 = _mm256_set1_ps(w[t]), w1 = _mm256_set1_ps(w[t + 1]);
            if (w[t] != 0.0f)
                for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8 * i), a[i]);
            if (w[t + 1] != 0.0f)
                for (int i = 0; i < n; i++) b[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 8 * i), b[i]);
        }
    }
    for (; s < S; s++) {
        __m256 ws = _mm256_set1_ps(w[s]);
        if (w[s] != 0.0f)
            for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(v + s * 8 * n + 8 * i), a[i]);
    }
    __m256 scale = _mm256_set1_ps(inv);
    for (int i = 0; i < n; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_add_ps(a[i], b[i]), scale));
}
#endif

/* out (D) = the slots' values weighted by w (S), over total; slots of weight 0 are not read. */
static void mix_of(const float *w, const float *v, float *out, int64_t S, int64_t D, float total) {
    float inv = 1.0f / total;
#ifdef EIGHT_WIDE
    if (D == 32) return mix_eights(w, v, out, S, inv, 4);
    if (D == 64) return mix_eights(w, v, out, S, inv, 8);
    if (D == 16) return mix_eights(w, v, out, S, inv, 2);
    if (D % 8 == 0 && D <= 128) return mix_eights(w, v, out, S, inv, (int)(D / 8));
#endif
    for (int64_t d = 0; d < D; d++) out[d] = 0;
    for (int64_t s = 0; s < S; s++) {
        if (w[s] == 0.0f) continue;
        for (int64_t d = 0; d < D; d++) out[d] += w[s] * v[s * D + d];
    }
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* Asks the caches for the slots a row sees (keys and values), while the row before it is worked
   on: each row's slots are a stream of their own, too short for the hardware to guess. */
static void prefetch_seen(const float *k, const float *v, const float *bias, int64_t S, int64_t D) {
    int64_t s = 0;
    while (s < S && hidden(bias[s])) s++;
    for (const char *p = (const char *)(k + s * D), *end = (const char *)(k + S * D); p < end; p += 64)
        __builtin_prefetch(p, 0, 3);
    for (const char *p = (const char *)(v + s * D), *end = (const char *)(v + S * D); p < end; p += 64)
        __builtin_prefetch(p, 0, 3);
}

/* Asks for a row's slot to be written (its key and its value, D floats each) ahead of the write. */
static void prefetch_slot(const float *k, const float *v, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        __builtin_prefetch(k + d, 1, 3);
        __builtin_prefetch(v + d, 1, 3);
    }
}

/* out (BH, G, D) = softmax(scale * q . keys + bias) . values for every query row of q (BH, G, D).
   With new_k and new_v (BH, D), row bh's new key and value are first written into its slot
   `slot` (the step's own token, among the S slots read): the write is the first touch of that
   line of the cache, and it is asked for with the row's other slots, while the row before is
   worked on. Returns 0, or -1 when scratch memory for the scores could not be had. */
int decode_attention(const float *q, float *k, float *v, const float *bias, float *out, int64_t BH, int64_t G,
                     int64_t S, int64_t D, int64_t kv_stride, int64_t bias_stride, float scale, const float *new_k,
                     const float *new_v, int64_t slot) {
    float stack[1024], *w = S <= 1024 ? stack : malloc(S * sizeof(float));
    if (w == NULL) return -1;
    for (int64_t bh = 0; bh < BH; bh++) {
        if (bh + 1 < BH) {
            int64_t next = (bh + 1) * kv_stride;
            prefetch_seen(k + next, v + next, bias + (bh + 1) * bias_stride, S, D);
            if (new_k != NULL) prefetch_slot(k + next + slot * D, v + next + slot * D, D);
        }
        float *kb = k + bh * kv_stride, *vb = v + bh * kv_stride;
        const float *mb = bias + bh * bias_stride;
        if (new_k != NULL) {
            memcpy(kb + slot * D, new_k + bh * D, D * sizeof(float));
            memcpy(vb + slot * D, new_v + bh * D, D * sizeof(float));
        }
        for (int64_t g = 0; g < G; g++) {
            scores_of(q + (bh * G + g) * D, kb, mb, w, S, D, scale);
            mix_of(w, vb, out + (bh * G + g) * D, S, D, softmax_weights(w, S));
        }
    }
    if (w != stack) free(w);
    return 0;
}
