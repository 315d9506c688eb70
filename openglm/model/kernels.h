/* openglm: what decode_kernels.c and dsa_kernels.c share: the vector types and loads, bf16 conversions, a dot
   product, the k-th largest of a set of scores and the top-k slots of a score row, and the error codes every
   exported function returns. Included by both; compiled into each by openglm/model/native.py. */
#ifndef OPENGLM_KERNELS_H
#define OPENGLM_KERNELS_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Exported functions return a count (>= 0) or 0 on success, else one of these (native.py raises on them). */
#define KERNEL_BAD_ARGS (-1)   /* a shape, limit or type argument outside what the kernel takes: nothing written */
#define KERNEL_NO_MEMORY (-2)  /* a working buffer could not be allocated: the outputs are not valid */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline v16 load_f32(const void *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store_f32(float *p, v16 x) { memcpy(p, &x, sizeof x); }
static inline v16 load_bf16(const void *p) {  /* 16 bf16 -> fp32: the bf16 bits are the fp32's high half */
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 x; memcpy(&x, &w, sizeof x); return x;
}

/* lanes summed as a tree, in registers: a serial sum of 16 lanes is a 16-add dependency chain */
static inline float hsum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Adjacent lanes summed: lanes 0-7 hold a's pair sums, 8-15 b's. Levels of it over 2^L vectors sum runs of 2^L lanes
   and keep their order: four levels over 16 vectors leave one whose lane i is the sum of vector i. */
static inline v16 pairsum(v16 a, v16 b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
static inline __attribute__((always_inline)) v16 pairsum_tree(v16 *v, int n) {  /* n a power of two <= 16 */
    for (; n > 1; n /= 2)
#pragma GCC unroll 8
        for (int j = 0; j < n / 2; j++) v[j] = pairsum(v[2 * j], v[2 * j + 1]);
    return v[0];
}
static inline uint16_t round_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u; memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f; memcpy(&f, &u, sizeof f); return f;
}

/* x [count] split into bf16 parts, x = hi + lo to 2^-17 relative: hi into parts[0, count), lo into
   parts[count, 2 count). Returns whether any lo part is nonzero (values that are bf16 already need hi only). */
static inline int split_bf16(const float *x, int64_t count, uint16_t *parts) {
    int need_lo = 0;
    for (int64_t i = 0; i < count; i++) {
        const uint16_t hi = round_bf16(x[i]), lo = round_bf16(x[i] - widen_bf16(hi));
        parts[i] = hi; parts[count + i] = lo;
        need_lo |= lo & 0x7fff;
    }
    return need_lo;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    if (n == 64) {  /* a common head size: two independent accumulators, no loop */
        v16 s0 = load_f32(a) * load_f32(b), s1 = load_f32(a + 16) * load_f32(b + 16);
        s0 += load_f32(a + 32) * load_f32(b + 32);
        s1 += load_f32(a + 48) * load_f32(b + 48);
        return hsum16(s0 + s1);
    }
    int64_t d = 0;
    float s = 0.0f;
    if (n >= 16) {
        v16 acc = load_f32(a) * load_f32(b);
        for (d = 16; d + 16 <= n; d += 16) acc += load_f32(a + d) * load_f32(b + d);
        s = hsum16(acc);
    }
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* ---- the k-th largest and the top-k slots (the DSA indexer's selection, prefill and decode alike) ---- */

static inline void swapf(float *a, float *b) { float t = *a; *a = *b; *b = t; }

/* The k-th largest (1 <= k <= n) of a[0..n); reorders a. Quickselect with a three-way partition: bf16 scores
   tie often, and equal values must not make it quadratic. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n, r = k - 1;  /* the wanted rank (0 = largest) lies in [lo, hi) */
    while (hi - lo > 1) {
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
        float p = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));  /* median of 3 */
        int64_t gt = lo, i = lo, lt = hi;  /* [lo, gt) > p, [gt, i) == p, [lt, hi) < p */
        while (i < lt) {
            if (a[i] > p) swapf(&a[gt++], &a[i++]);
            else if (a[i] < p) swapf(&a[i], &a[--lt]);
            else i++;
        }
        if (r < gt) hi = gt;
        else if (r < lt) return p;
        else lo = lt;
    }
    return a[lo];
}

/* Copies the elements of a[0..n) within [lo, hi] to out (room for n); returns how many, and in *above how many
   are > hi. */
static int64_t bracket(const float *a, int64_t n, float lo, float hi, float *out, int64_t *above) {
    int64_t c = 0, up = 0, j = 0;
#if defined(__AVX512F__)
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (; j + 16 <= n; j += 16) {
        __m512 x = _mm512_loadu_ps(a + j);
        __mmask16 gt = _mm512_cmp_ps_mask(x, vhi, _CMP_GT_OQ);
        __mmask16 in = _mm512_cmp_ps_mask(x, vlo, _CMP_GE_OQ) & (__mmask16)~gt;
        _mm512_storeu_ps(out + c, _mm512_maskz_compress_ps(in, x));
        c += __builtin_popcount((unsigned)in);
        up += __builtin_popcount((unsigned)gt);
    }
#endif
    for (; j < n; j++) {
        float x = a[j];
        out[c] = x;
        c += (x >= lo) & (x <= hi);
        up += x > hi;
    }
    *above = up;
    return c;
}

/* `kth_largest` for large sets; a and buf (room for n) are overwritten. While the set is large, two values from a
   sample of 32 bracket the wanted rank (with a margin of ~2.5 sigma of the sample's rank) and one vectorised pass
   keeps only what lies between them: ~0.5 cycle per element per pass instead of a quickselect's unpredictable
   branch per element. A bracket that misses (rarely) hands over to the quickselect. */
static float kth_largest_large(float *a, int64_t n, int64_t k, float *buf) {
    while (n > 256) {
        float s[32];
        for (int i = 0; i < 32; i++) {  /* evenly spaced sample, insertion-sorted descending */
            float x = a[(n * (2 * i + 1)) / 64];
            int m = i;
            for (; m > 0 && s[m - 1] < x; m--) s[m] = s[m - 1];
            s[m] = x;
        }
        double p = (double)k / n;
        int r = (int)(32 * p), margin = 2 + (int)(2.5 * __builtin_sqrt(32 * p * (1 - p)));
        float hi = r - margin < 0 ? __builtin_inff() : s[r - margin];
        float lo = r + margin > 31 ? -__builtin_inff() : s[r + margin];
        int64_t above, c = bracket(a, n, lo, hi, buf, &above);
        if (k <= above || k > above + c || c == n) break;  /* missed, or no progress (ties): quickselect */
        float *t = a; a = buf; buf = t;
        n = c;
        k -= above;
    }
    return kth_largest(a, n, k);
}

/* The values of s[0..n) at or above `bound`, in order, into cand and (at not NULL) their indices into at; returns
   how many. cand and at need room for n. */
static int64_t at_least(const float *s, int64_t n, float bound, float *cand, int32_t *at) {
    int64_t c = 0, j = 0;
#if defined(__AVX512F__)
    /* 16 compares at a time; the few kept ones are packed with a compress (stored unmasked: c <= j, room for n) */
    const __m512 b = _mm512_set1_ps(bound);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= n; j += 16) {
        const __m512 x = _mm512_loadu_ps(s + j);
        const __mmask16 m = _mm512_cmp_ps_mask(x, b, _CMP_GE_OQ);
        if (!m) continue;
        _mm512_storeu_ps(cand + c, _mm512_maskz_compress_ps(m, x));
        if (at) {
            const __m512i slot = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)j));
            _mm512_storeu_si512((void *)(at + c), _mm512_maskz_compress_epi32(m, slot));
        }
        c += __builtin_popcount((unsigned)m);
    }
#endif
    for (; j < n; j++) {  /* branch-free: write always, advance when kept (c <= j: in bounds) */
        cand[c] = s[j];
        if (at) at[c] = (int32_t)j;
        c += s[j] >= bound;
    }
    return c;
}

/* The k largest of v[0..n) (0 < k < n) into out as ascending indices (at[i] for element i; at NULL: i). Elements
   tied at the k-th value fill the last places in index order. Returns 1 when more are tied at the k-th value than
   places are left (which of them win is then arbitrary: the caller's tie-break), else 0. tmp, buf: n floats each. */
static int top_k_slots(const float *v, const int32_t *at, int64_t n, int64_t k, int64_t *out, float *tmp, float *buf) {
    memcpy(tmp, v, n * sizeof(float));
    const float kth = kth_largest_large(tmp, n, k, buf);
    int64_t room = k, tied = 0;
    for (int64_t i = 0; i < n; i++) { room -= v[i] > kth; tied += v[i] == kth; }
    const int ambiguous = tied > room;
    for (int64_t i = 0, o = 0; i < n; i++)
        if (v[i] > kth || (v[i] == kth && room-- > 0)) out[o++] = at ? at[i] : i;
    return ambiguous;
}

#endif
