/* openglm: native kernels for DeepSeek sparse attention (DSA) on the CPU, used by openglm/model/sparse_dsa.py.
   Compiled on first use by openglm/model/native.py (cc -O3 -march=native -shared -fPIC) and called via ctypes.
   - dsa_head_sum / dsa_rows_topk: the lightning indexer's head-weighted relu sum and each row's exact top-k;
   - dsa_pairs_by_key / dsa_pair_scores / dsa_pair_exp / dsa_pair_values: attention over the selected
     (query, key) pairs of a chunk, key-major. */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

/* lanes summed as a tree, in registers: a serial sum of 16 lanes is a 16-add dependency chain */
static inline float hsum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    if (n == 64) {  /* the common head size: two independent accumulators, no loop */
        v16 s0 = load16(a) * load16(b), s1 = load16(a + 16) * load16(b + 16);
        s0 += load16(a + 32) * load16(b + 32);
        s1 += load16(a + 48) * load16(b + 48);
        return hsum16(s0 + s1);
    }
    int64_t d = 0;
    float s = 0.0f;
    if (n >= 16) {
        v16 acc = load16(a) * load16(b);
        for (d = 16; d + 16 <= n; d += 16) acc += load16(a + d) * load16(b + d);
        s = hsum16(acc);
    }
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *y, float w, const float *x, int64_t n) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) store16(y + d, load16(y + d) + w * load16(x + d));
    for (; d < n; d++) y[d] += w * x[d];
}

/* ---- attention over selected pairs, key-major ---- */

/* Rows are streamed in key order, but a key's handful of pairs is too little work for the hardware prefetcher
   to run ahead: asking for the row PREFETCH_ROWS keys ahead cut the time per pair by ~30%. */
#define PREFETCH_ROWS 8
static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(p + d);
}

/* Orders the valid pairs of idx [nq, nk] (-1 = unused) by key: key_start [tk + 1] (CSR offsets), pair_q [pairs]
   (each pair's query). Within a key, pairs keep query order. Returns the number of pairs. */
int64_t dsa_pairs_by_key(const int64_t *idx, int64_t nq, int64_t nk, int64_t tk, int64_t *key_start,
                         int32_t *pair_q) {
    memset(key_start, 0, (tk + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < nq * nk; p++) if (idx[p] >= 0) key_start[idx[p] + 1]++;
    for (int64_t j = 0; j < tk; j++) key_start[j + 1] += key_start[j];
    for (int64_t i = 0, p = 0; i < nq; i++)
        for (int64_t s = 0; s < nk; s++, p++)
            if (idx[p] >= 0) pair_q[key_start[idx[p]]++] = (int32_t)i;
    memmove(key_start + 1, key_start, tk * sizeof(int64_t));  /* each start was advanced to the next key's */
    key_start[0] = 0;
    return key_start[tk];
}

/* One head: sc[e] = scale * q[pair_q[e]] . k[key of e], in key order, so each key row is read once while the
   chunk's query rows stay in cache; rowmax [nq] gets each query's largest score. Row strides q_s, k_s. */
void dsa_pair_scores(const float *q, int64_t q_s, const float *k, int64_t k_s, int64_t tk, int64_t dk,
                     float scale, const int64_t *key_start, const int32_t *pair_q, float *sc, float *rowmax,
                     int64_t nq) {
    for (int64_t i = 0; i < nq; i++) rowmax[i] = -__builtin_inff();
    for (int64_t j = 0; j < tk; j++) {
        const float *kj = k + j * k_s;
        if (j + PREFETCH_ROWS < tk) prefetch_row(kj + PREFETCH_ROWS * k_s, dk);
        for (int64_t e = key_start[j]; e < key_start[j + 1]; e++) {
            float x = scale * dot(q + pair_q[e] * q_s, kj, dk);
            sc[e] = x;
            if (x > rowmax[pair_q[e]]) rowmax[pair_q[e]] = x;
        }
    }
}

/* exp(x) for x <= 0 to ~2 ulp, in plain arithmetic so that loops over it vectorize (libm's expf does not):
   exp(x) = 2^n exp(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, the first exact times n),
   exp(r) by its degree-7 Taylor polynomial (|r| <= 0.35: truncation error < 1e-8). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* exp(-87) ~ 1.6e-38: still a normal float */
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  /* adding 1.5 * 2^23 rounds to an integer */
    float r = (x - n * 0.693145751953125f) - n * 1.428606820309417e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = {((int32_t)n + 127) << 23};  /* 2^n, built in the exponent bits */
    return p * two_n.f;
}

/* Softmax numerators in place: sc[e] = exp(sc[e] - rowmax[pair_q[e]]). */
void dsa_pair_exp(float *sc, const int32_t *pair_q, const float *rowmax, int64_t n) {
    for (int64_t e = 0; e < n; e++) sc[e] -= rowmax[pair_q[e]];
    for (int64_t e = 0; e < n; e++) sc[e] = exp_nonpositive(sc[e]);
}

/* One head: out[i] = sum_e p[e] v[key of e] / sum_e p[e] over query i's pairs, in key order (each value row read
   once per chunk). out rows o_s apart; rowsum [nq] scratch. Queries without pairs get 0 / 0. */
void dsa_pair_values(const float *v, int64_t v_s, int64_t tk, int64_t dv, const int64_t *key_start,
                     const int32_t *pair_q, const float *p, float *out, int64_t o_s, float *rowsum, int64_t nq) {
    for (int64_t i = 0; i < nq; i++) { rowsum[i] = 0.0f; memset(out + i * o_s, 0, dv * sizeof(float)); }
    for (int64_t j = 0; j < tk; j++) {
        const float *vj = v + j * v_s;
        if (j + PREFETCH_ROWS < tk) prefetch_row(vj + PREFETCH_ROWS * v_s, dv);
        for (int64_t e = key_start[j]; e < key_start[j + 1]; e++) {
            axpy(out + pair_q[e] * o_s, p[e], vj, dv);
            rowsum[pair_q[e]] += p[e];
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        float r = 1.0f / rowsum[i];
        for (int64_t d = 0; d < dv; d++) out[i * o_s + d] *= r;
    }
}

/* ---- indexer: head sum and top-k of one row at a time ---- */

static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

static inline void swapf(float *a, float *b) { float t = *a; *a = *b; *b = t; }

/* The k-th largest (1 <= k <= n) of a[0..n); reorders a. Quickselect with a three-way partition: bf16 scores
   tie often, and equal values must not make it quadratic. */
static float quickselect(float *a, int64_t n, int64_t k) {
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
#ifdef __AVX512F__
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

/* The k-th largest (1 <= k <= n) of a[0..n); a and buf (room for n) are overwritten. While the set is large,
   two values from a sample of 32 bracket the wanted rank (with a margin of ~2.5 sigma of the sample's rank)
   and one vectorised pass keeps only what lies between them: ~0.5 cycle per element per pass instead of a
   quickselect's unpredictable branch per element. A bracket that misses (rarely) hands over to quickselect. */
static float kth_largest(float *a, int64_t n, int64_t k, float *buf) {
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
    return quickselect(a, n, k);
}

/* Copies the finite scores >= thr of row[0..n) and their slots to cand_v / cand_j (room for n); returns how many. */
static int64_t compact(const float *row, int64_t n, float thr, float *cand_v, int32_t *cand_j) {
    if (!(thr > -__FLT_MAX__)) thr = -__FLT_MAX__;  /* -inf marks invisible keys */
    int64_t c = 0, j = 0;
#ifdef __AVX512F__
    /* 16 scores per compare; the few kept ones are packed with a compress (stored unmasked: cand has room) */
    __m512 t = _mm512_set1_ps(thr);
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= n; j += 16) {
        __m512 x = _mm512_loadu_ps(row + j);
        __mmask16 m = _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ);
        if (m) {
            _mm512_storeu_ps(cand_v + c, _mm512_maskz_compress_ps(m, x));
            __m512i slot = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)j));
            _mm512_storeu_si512((void *)(cand_j + c), _mm512_maskz_compress_epi32(m, slot));
            c += __builtin_popcount((unsigned)m);
        }
    }
#endif
    for (; j < n; j++) {  /* branch-free: write always, advance when kept */
        float x = row[j];
        cand_v[c] = x; cand_j[c] = (int32_t)j;
        c += x >= thr;
    }
    return c;
}

/* Top n_top slots of one score row[0..n) (-inf = invisible) into out [n_top]: -1 first where fewer are visible,
   then the slots ascending. Slots tied at the k-th score fill the last places in slot order. A threshold from
   every `stride`-th score (the n_sample-th best of them) keeps ~n_sample * stride candidates; if it keeps fewer
   than n_top (it overshot) every visible key is a candidate. cand_v / cand_j / tmp: n floats / ints each.
   Returns 1 when more slots tie at the k-th score than there are places left (the choice among them is
   arbitrary), else 0. */
static int top_row(const float *row, int64_t n, int64_t n_top, int64_t stride, int64_t n_sample, int64_t *out,
                    float *cand_v, int32_t *cand_j, float *tmp, float *buf) {
    float thr = -__builtin_inff();
    if (n_sample > 0 && n >= 3 * stride * n_sample) {
        int64_t m = 0;
        for (int64_t j = 0; j < n; j += stride) tmp[m++] = row[j];
        thr = kth_largest(tmp, m, n_sample, buf);
    }
    int64_t c = compact(row, n, thr, cand_v, cand_j);
    if (c < n_top && thr > -__builtin_inff()) c = compact(row, n, -__builtin_inff(), cand_v, cand_j);  /* overshot */
    int64_t pad = c < n_top ? n_top - c : 0, o = 0;
    for (; o < pad; o++) out[o] = -1;
    if (c <= n_top) {
        for (int64_t e = 0; e < c; e++) out[o++] = cand_j[e];
        return 0;
    }
    memcpy(tmp, cand_v, c * sizeof(float));
    float kth = kth_largest(tmp, c, n_top, buf);
    int64_t room = n_top, tied = 0;
    for (int64_t e = 0; e < c; e++) { room -= cand_v[e] > kth; tied += cand_v[e] == kth; }
    int ambiguous = tied > room;
    for (int64_t e = 0; e < c; e++)
        if (cand_v[e] > kth || (cand_v[e] == kth && room-- > 0)) out[o++] = cand_j[e];
    return ambiguous;
}

/* row[j] = sum_h w[h] * relu(x[h * tx + j]) for j < n, four heads per pass over the row (one pass for the
   usual four index heads), in head order. */
#define HEAD_SUM(NAME, T, LOAD)                                                                          \
static void NAME(const T *x, int64_t nh, int64_t tx, const float *w, int64_t n, float *row) {           \
    int64_t h = 0;                                                                                       \
    for (; h + 4 <= nh; h += 4) {                                                                        \
        const T *x0 = x + h * tx, *x1 = x0 + tx, *x2 = x1 + tx, *x3 = x2 + tx;                           \
        float w0 = w[h], w1 = w[h + 1], w2 = w[h + 2], w3 = w[h + 3];                                    \
        for (int64_t j = 0; j < n; j++) {                                                                \
            float a = LOAD(x0[j]), b = LOAD(x1[j]), c = LOAD(x2[j]), d = LOAD(x3[j]);                    \
            float s = ((w0 * (a > 0.0f ? a : 0.0f) + w1 * (b > 0.0f ? b : 0.0f)) +                       \
                       w2 * (c > 0.0f ? c : 0.0f)) + w3 * (d > 0.0f ? d : 0.0f);                         \
            row[j] = h ? row[j] + s : s;                                                                 \
        }                                                                                                \
    }                                                                                                    \
    for (; h < nh; h++) {                                                                                \
        const T *xh = x + h * tx;                                                                        \
        for (int64_t j = 0; j < n; j++) {                                                                \
            float y = LOAD(xh[j]), s = w[h] * (y > 0.0f ? y : 0.0f);                                     \
            row[j] = h ? row[j] + s : s;                                                                 \
        }                                                                                                \
    }                                                                                                    \
}
#define AS_FLOAT(y) (y)
HEAD_SUM(head_sum_f32, float, AS_FLOAT)
HEAD_SUM(head_sum_bf16, uint16_t, bf16_to_f32)

/* One key tile of an indexer block: heads x [nq, nh, tx] (fp32, or bf16 bits when is_bf16) of keys
   [col0, col0 + tx), w [nq, nh] (scale folded in). Row i's score of key j < n_keys[i] goes to rows[i, j] (rows
   row_s apart): sum_h w[i, h] * relu(x[i, h, j]), in fp32. */
void dsa_head_sum(const void *x, int is_bf16, int64_t nq, int64_t nh, int64_t tx, const float *w,
                  const int64_t *n_keys, int64_t col0, float *rows, int64_t row_s) {
    for (int64_t i = 0; i < nq; i++) {
        int64_t n = n_keys[i] - col0;
        n = n < 0 ? 0 : (n > tx ? tx : n);
        float *row = rows + i * row_s + col0;
        if (is_bf16) head_sum_bf16((const uint16_t *)x + i * nh * tx, nh, tx, w + i * nh, n, row);
        else head_sum_f32((const float *)x + i * nh * tx, nh, tx, w + i * nh, n, row);
    }
}

/* Top n_top slots of each score row [nq, row_s] among its first n_keys[i] (see top_row); visible [nq, vis_s]
   (optional, 1 = visible) hides keys. out [nq, out_s]. work: 4 * row_s floats. tied [nq] (optional): 1 where
   the row's k-th score was tied beyond the places left (see top_row). Returns how many rows were. */
int64_t dsa_rows_topk(float *rows, int64_t row_s, int64_t nq, const int64_t *n_keys, const uint8_t *visible,
                   int64_t vis_s, int64_t n_top, int64_t stride, int64_t n_sample, int64_t *out, int64_t out_s,
                   float *work, uint8_t *tied) {
    float *cand_v = work, *tmp = work + row_s, *buf = work + 2 * row_s;
    int32_t *cand_j = (int32_t *)(work + 3 * row_s);
    int64_t n_tied = 0;
    for (int64_t i = 0; i < nq; i++) {
        float *row = rows + i * row_s;
        if (visible)
            for (int64_t j = 0; j < n_keys[i]; j++) if (!visible[i * vis_s + j]) row[j] = -__builtin_inff();
        int t = top_row(row, n_keys[i], n_top, stride, n_sample, out + i * out_s, cand_v, cand_j, tmp, buf);
        if (tied) tied[i] = (uint8_t)t;
        n_tied += t;
    }
    return n_tied;
}
