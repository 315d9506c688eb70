/* openglm: native kernels for DeepSeek sparse attention (DSA) on the CPU, used by openglm/model/sparse_dsa.py.
   Compiled on first use by openglm/model/native.py (cc -O3 -march=native -shared -fPIC) and called via ctypes.
   - dsa_head_sum / dsa_rows_topk: the lightning indexer's head-weighted relu sum and each row's exact top-k;
   - dsa_pairs_by_key / dsa_pair_scores / dsa_pair_exp / dsa_pair_values: attention over the selected
     (query, key) pairs of a chunk, key-major. */
#include "kernels.h"

static inline void axpy(float *y, float w, const float *x, int64_t n) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) store_f32(y + d, load_f32(y + d) + w * load_f32(x + d));
    for (; d < n; d++) y[d] += w * x[d];
}

/* ---- attention over selected pairs, key-major ---- */

/* Rows are streamed in key order, but a key's handful of pairs is too little work for the hardware prefetcher
   to run ahead: asking for the row PREFETCH_ROWS keys ahead cut the time per pair by ~30%. */
#define PREFETCH_ROWS 8
static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(p + d);
}

/* Orders the valid pairs of idx [nq, nk] (-1 = unused, else a key slot < tk) by key: key_start [tk + 1] (CSR
   offsets), pair_q [nq * nk] (each pair's query). Within a key, pairs keep query order. Returns the number of pairs,
   or KERNEL_BAD_ARGS (a slot >= tk, a negative size, more than 2^31 queries). */
int64_t dsa_pairs_by_key(const int64_t *idx, int64_t nq, int64_t nk, int64_t tk, int64_t *key_start,
                         int32_t *pair_q) {
    if (nq < 0 || nk < 0 || tk < 0 || nq > INT32_MAX) return KERNEL_BAD_ARGS;
    for (int64_t p = 0; p < nq * nk; p++) if (idx[p] >= tk) return KERNEL_BAD_ARGS;
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
   chunk's query rows stay in cache; rowmax [nq] gets each query's largest score. Row strides q_s, k_s (>= dk);
   key_start and pair_q as dsa_pairs_by_key wrote them. Returns 0 or KERNEL_BAD_ARGS. */
int64_t dsa_pair_scores(const float *q, int64_t q_s, const float *k, int64_t k_s, int64_t tk, int64_t dk,
                        float scale, const int64_t *key_start, const int32_t *pair_q, float *sc, float *rowmax,
                        int64_t nq) {
    if (tk < 0 || dk < 0 || nq < 0 || q_s < dk || k_s < dk) return KERNEL_BAD_ARGS;
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
    return 0;
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

/* Softmax numerators in place: sc[e] = exp(sc[e] - rowmax[pair_q[e]]). Returns 0 or KERNEL_BAD_ARGS. */
int64_t dsa_pair_exp(float *sc, const int32_t *pair_q, const float *rowmax, int64_t n) {
    if (n < 0) return KERNEL_BAD_ARGS;
    for (int64_t e = 0; e < n; e++) sc[e] -= rowmax[pair_q[e]];
    for (int64_t e = 0; e < n; e++) sc[e] = exp_nonpositive(sc[e]);
    return 0;
}

/* One head: out[i] = sum_e p[e] v[key of e] / sum_e p[e] over query i's pairs, in key order (each value row read
   once per chunk). out rows o_s apart (v rows v_s, both >= dv); rowsum [nq] scratch. Queries without pairs get
   0 / 0. Returns 0 or KERNEL_BAD_ARGS. */
int64_t dsa_pair_values(const float *v, int64_t v_s, int64_t tk, int64_t dv, const int64_t *key_start,
                        const int32_t *pair_q, const float *p, float *out, int64_t o_s, float *rowsum, int64_t nq) {
    if (tk < 0 || dv < 0 || nq < 0 || v_s < dv || o_s < dv) return KERNEL_BAD_ARGS;
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
    return 0;
}

/* ---- indexer: head sum and top-k of one row at a time ---- */

/* Top n_top slots of one score row[0..n) (-inf = invisible) into out [n_top]: -1 first where fewer are visible,
   then the slots ascending (`top_k_slots`). A threshold from every `stride`-th score (the n_sample-th best of them)
   keeps ~n_sample * stride candidates; if it keeps fewer than n_top (it overshot) every visible key is a
   candidate. cand_v / cand_j / tmp / buf: n floats / ints each. Returns 1 when more slots tie at the k-th score
   than there are places left (the choice among them is arbitrary), else 0. */
static int top_row(const float *row, int64_t n, int64_t n_top, int64_t stride, int64_t n_sample, int64_t *out,
                   float *cand_v, int32_t *cand_j, float *tmp, float *buf) {
    float thr = -__FLT_MAX__;  /* -inf marks invisible keys: never a candidate */
    if (n_sample > 0 && n >= 3 * stride * n_sample) {
        int64_t m = 0;
        for (int64_t j = 0; j < n; j += stride) tmp[m++] = row[j];
        const float t = kth_largest_large(tmp, m, n_sample, buf);
        thr = t > -__FLT_MAX__ ? t : -__FLT_MAX__;
    }
    int64_t c = at_least(row, n, thr, cand_v, cand_j);
    if (c < n_top && thr > -__FLT_MAX__) c = at_least(row, n, -__FLT_MAX__, cand_v, cand_j);  /* overshot */
    int64_t pad = c < n_top ? n_top - c : 0, o = 0;
    for (; o < pad; o++) out[o] = -1;
    if (c <= n_top) {
        for (int64_t e = 0; e < c; e++) out[o++] = cand_j[e];
        return 0;
    }
    return top_k_slots(cand_v, cand_j, c, n_top, out, tmp, buf);
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
HEAD_SUM(head_sum_bf16, uint16_t, widen_bf16)

/* One key tile of an indexer block: heads x [nq, nh, tx] (fp32, or bf16 bits when is_bf16) of keys
   [col0, col0 + tx), w [nq, nh] (scale folded in). Row i's score of key j < n_keys[i] goes to rows[i, j] (rows
   row_s apart): sum_h w[i, h] * relu(x[i, h, j]), in fp32. Returns 0, or KERNEL_BAD_ARGS (a negative size, or a
   row's n_keys past row_s). */
int64_t dsa_head_sum(const void *x, int is_bf16, int64_t nq, int64_t nh, int64_t tx, const float *w,
                     const int64_t *n_keys, int64_t col0, float *rows, int64_t row_s) {
    if (nq < 0 || nh < 0 || tx < 0 || col0 < 0) return KERNEL_BAD_ARGS;
    for (int64_t i = 0; i < nq; i++) if (n_keys[i] > row_s) return KERNEL_BAD_ARGS;
    for (int64_t i = 0; i < nq; i++) {
        int64_t n = n_keys[i] - col0;
        n = n < 0 ? 0 : (n > tx ? tx : n);
        float *row = rows + i * row_s + col0;
        if (is_bf16) head_sum_bf16((const uint16_t *)x + i * nh * tx, nh, tx, w + i * nh, n, row);
        else head_sum_f32((const float *)x + i * nh * tx, nh, tx, w + i * nh, n, row);
    }
    return 0;
}

/* Top n_top slots of each score row [nq, row_s] among its first n_keys[i] (see top_row); visible [nq, vis_s]
   (optional, 1 = visible) hides keys. out [nq, out_s]. work: 4 * row_s floats. tied [nq] (optional): 1 where
   the row's k-th score was tied beyond the places left (see top_row). Returns how many rows were, or
   KERNEL_BAD_ARGS (n_top outside [1, out_s], a stride below 1, a row's n_keys past row_s or vis_s). */
int64_t dsa_rows_topk(float *rows, int64_t row_s, int64_t nq, const int64_t *n_keys, const uint8_t *visible,
                      int64_t vis_s, int64_t n_top, int64_t stride, int64_t n_sample, int64_t *out, int64_t out_s,
                      float *work, uint8_t *tied) {
    if (nq < 0 || n_top < 1 || n_top > out_s || stride < 1 || n_sample < 0) return KERNEL_BAD_ARGS;
    for (int64_t i = 0; i < nq; i++)
        if (n_keys[i] < 0 || n_keys[i] > row_s || (visible && n_keys[i] > vis_s)) return KERNEL_BAD_ARGS;
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
