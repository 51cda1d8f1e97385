/* The decoding step's attention on the CPU, for float32 (tinylm/models/cpu_attention.py builds and
   loads this file). One query row per head attends over a few dozen cached slots: as batched
   matrix products that is hundreds of tiny products a step, each paying a library call's setup,
   and every slot of every row is read even where the mask hides it. Here each (row, head) is one
   pass over its slots through 8-wide fused multiply-adds where the CPU has them (AVX2 + FMA), a
   plain loop elsewhere: the scores, their softmax (an 8-wide exponential), the weighted values.
   A hidden slot scores -inf and weighs exactly 0 whatever its key holds, and its value is never
   read; slots are skipped eight hidden ones at a time.

   The cache is read from memory, not from the CPU's caches (a step reads every layer's keys and
   weights in turn), in short runs: a row's slots, a few kilobytes, then the next row's. The
   hardware's prefetchers barely start on runs that short, and the loops wait on memory most of
   the time. So while a row is worked on, each block of eight slots asks for the same block of
   the next row (into the second-level cache: its queue of misses is deeper than the first's).

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

/* Whether the loops ask for the next row (1, always, but for comparisons: set_asking). */
static int asking = 1;

void set_asking(int on) { asking = on != 0; }

/* Asks for the lines from p to end into the second-level cache (the hint: prefetcht1). */
static void ask(const float *p, const float *end) {
    if (!asking) return;
    for (const char *c = (const char *)p; c < (const char *)end; c += 64) __builtin_prefetch(c, 0, 2);
}

/* The first slot of a row that is seen, S when none is. */
static int64_t first_seen(const float *bias, int64_t S) {
    int64_t s = 0;
    while (s < S && hidden(bias[s])) s++;
    return s;
}

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

/* One query row's scores over S slots into w: scale * (q . key) + bias, -inf where hidden. With
   next_k (the next row's keys), each block of slots worked on asks for the same block there. */
static void scores_of(const float *q, const float *k, const float *bias, float *w, int64_t S, int64_t D,
                      float scale, const float *next_k) {
    int64_t s = 0;
#ifdef EIGHT_WIDE
    if (D % 8 == 0) {
        for (; s + 8 <= S; s += 8) {
            if (any_seen(bias, s)) {
                if (next_k != NULL) ask(next_k + s * D, next_k + (s + 8) * D);
                eight_scores(q, k, bias, w, s, D, scale);
            } else
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
   skipped; with next_v, each other block asks for the same block of the next row's values. */
static inline __attribute__((always_inline)) void mix_eights(const float *w, const float *v, float *out, int64_t S,
                                                              float inv, const int n, const float *next_v) {
    __m256 a[16], b[16], zero = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) a[i] = b[i] = zero;
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + s), zero, _CMP_NEQ_OQ)) == 0) continue;
        if (next_v != NULL) ask(next_v + s * 8 * n, next_v + (s + 8) * 8 * n);
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

/* out (D) = the slots' values weighted by w (S), over total; slots of weight 0 are not read.
   next_v: as in mix_eights (the plain loop asks for nothing). */
static void mix_of(const float *w, const float *v, float *out, int64_t S, int64_t D, float total,
                   const float *next_v) {
    float inv = 1.0f / total;
#ifdef EIGHT_WIDE
    if (D == 32) return mix_eights(w, v, out, S, inv, 4, next_v);
    if (D == 64) return mix_eights(w, v, out, S, inv, 8, next_v);
    if (D == 16) return mix_eights(w, v, out, S, inv, 2, next_v);
    if (D % 8 == 0 && D <= 128) return mix_eights(w, v, out, S, inv, (int)(D / 8), next_v);
#endif
    for (int64_t d = 0; d < D; d++) out[d] = 0;
    for (int64_t s = 0; s < S; s++) {
        if (w[s] == 0.0f) continue;
        for (int64_t d = 0; d < D; d++) out[d] += w[s] * v[s * D + d];
    }
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* Asks for a row's slot to be written (its key and its value, D floats each) ahead of the write. */
static void prefetch_slot(const float *k, const float *v, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        __builtin_prefetch(k + d, 1, 3);
        __builtin_prefetch(v + d, 1, 3);
    }
}

/* Asks for what of the next row (keys kn, values vn, bias bn) the blocks of the current row (bias
   bc) will not ask for: its seen slots before the current row's first seen block, the last slots
   after the last whole block (and the row's first row: all its seen slots, bc NULL). */
static void ask_rest(const float *kn, const float *vn, const float *bn, const float *bc, int64_t S, int64_t D) {
    int64_t from = first_seen(bn, S) / 8 * 8, to = bc == NULL ? S : first_seen(bc, S) / 8 * 8, tail = S / 8 * 8;
    if (from < to) {
        ask(kn + from * D, kn + to * D);
        ask(vn + from * D, vn + to * D);
    }
    if (bc != NULL && tail < S) {
        ask(kn + tail * D, kn + S * D);
        ask(vn + tail * D, vn + S * D);
    }
}

/* Which cache row query row i reads and writes (rows and heads merged, as bh). Without rows, the
   cache's row i; with them (the joining prompts' tokens: one entry per token, `heads` query rows
   each, token i / heads and kv head i % heads), the token's row's head. `slot`: every row's write
   slot where there are no per-token slots. */
typedef struct {
    const int64_t *rows, *slots;
    int64_t heads, slot;
} tokens_t;

static int64_t cache_row(const tokens_t *t, int64_t i) {
    return t->rows == NULL ? i : t->rows[i / t->heads] * t->heads + i % t->heads;
}

/* The slot query row i writes its new key and value to: `slot`, or its token's. */
static int64_t slot_of(const tokens_t *t, int64_t i) { return t->slots == NULL ? t->slot : t->slots[i / t->heads]; }

/* out (BH, G, D) = softmax(scale * q . keys + bias) . values for every query row of q (BH, G, D).
   With new_k and new_v (BH, D), row i's new key and value are first written into its slot (the
   step's own token, among the S slots read): the write is the first touch of that line of the
   cache, and it is asked for while the row before is worked on. Prompt tokens (rows, slots: see
   tokens_t) come in order: a token reads the keys its prompt's tokens before it wrote. Returns 0,
   or -1 when scratch memory for the scores could not be had. */
int decode_attention(const float *q, float *k, float *v, const float *bias, float *out, int64_t BH, int64_t G,
                     int64_t S, int64_t D, int64_t kv_stride, int64_t bias_stride, float scale, const float *new_k,
                     const float *new_v, int64_t slot, const int64_t *rows, const int64_t *slots, int64_t heads) {
    float stack[1024], *w = S <= 1024 ? stack : malloc(S * sizeof(float));
    if (w == NULL) return -1;
    const tokens_t t = {rows, slots, heads > 0 ? heads : 1, slot};
    const int64_t per_bias = rows == NULL ? 1 : t.heads; /* query rows per bias row */
    int64_t row = cache_row(&t, 0);
    ask_rest(k + row * kv_stride, v + row * kv_stride, bias, NULL, S, D);
    for (int64_t bh = 0; bh < BH; bh++) {
        float *kb = k + row * kv_stride, *vb = v + row * kv_stride;
        const float *mb = bias + bh / per_bias * bias_stride, *next_k = NULL, *next_v = NULL;
        if (bh + 1 < BH) {
            row = cache_row(&t, bh + 1);
            next_k = k + row * kv_stride;
            next_v = v + row * kv_stride;
            ask_rest(next_k, next_v, bias + (bh + 1) / per_bias * bias_stride, mb, S, D);
            if (new_k != NULL) prefetch_slot(next_k + slot_of(&t, bh + 1) * D, next_v + slot_of(&t, bh + 1) * D, D);
        }
        if (new_k != NULL) {
            memcpy(kb + slot_of(&t, bh) * D, new_k + bh * D, D * sizeof(float));
            memcpy(vb + slot_of(&t, bh) * D, new_v + bh * D, D * sizeof(float));
        }
        for (int64_t g = 0; g < G; g++) {
            const int first = g == 0; /* the next row is asked for once */
            scores_of(q + (bh * G + g) * D, kb, mb, w, S, D, scale, first ? next_k : NULL);
            mix_of(w, vb, out + (bh * G + g) * D, S, D, softmax_weights(w, S), first ? next_v : NULL);
        }
    }
    if (w != stack) free(w);
    return 0;
}
