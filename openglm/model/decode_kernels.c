/* openglm: native kernels for a decode step's routed experts, used by openglm/model/moe.py.
   Compiled on first use by openglm/model/native.py (cc -O3 -march=native -shared -fPIC) and called via ctypes.

   A decode step gives each active expert one or two rows. MKL's and oneDNN's small-row matmuls then read the
   expert weights at ~5 GB/s from memory; reading each weight row once, in order, and multiplying it into the
   expert's few input rows held in L1 runs about twice as fast cold. The whole SwiGLU of every active expert is
   one call: gate/up rows, silu(gate) * up, down rows. Accumulation is fp32 throughout (bf16 weights are widened
   on load), so results equal the matmul path up to summation order (and, in bf16, without rounding the
   intermediate activations to bf16). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 8
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline v16 load_f32(const void *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline v16 load_bf16(const void *p) {  /* 16 bf16 -> fp32: the bf16 bits are the fp32's high half */
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 x; memcpy(&x, &w, sizeof x); return x;
}
static inline float hsum16(v16 x) {  /* a tree in registers, not a 16-add chain */
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline uint16_t round_bf16(float f) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u; memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float widen_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, sizeof f); return f; }

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };  /* weight element types; int8 rows carry one fp32 scale each */
static inline int64_t w_size(int wtype) { return wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1; }
static inline v16 load_i8(const void *p) {
    i8x16 h; memcpy(&h, p, sizeof h);
    return __builtin_convertvector(__builtin_convertvector(h, i32x16), v16);
}
static inline __attribute__((always_inline)) v16 load_w(const char *row, int wtype, int64_t d) {
    return wtype == W_BF16 ? load_bf16(row + 2 * d) : wtype == W_I8 ? load_i8(row + d) : load_f32(row + 4 * d);
}

/* y[r, j] = scale[j] * (x[r] . w[j]) for r < n rows (n <= MAX_ROWS), j < m; x [n, k] fp32, w [m, k] of wtype
   (scale only for int8, else ignored), y [n, m] fp32; k a multiple of 16. Each weight row is read once and
   used for all n rows. With one or two rows, four weight rows go together: four independent FMA chains and
   four streams, where one chain per row is bound by the FMA latency, not by memory. */
static inline __attribute__((always_inline)) void rows_times_weight_t(
        const float *x, int64_t n, const void *w, const float *scale, int wtype, int64_t m, int64_t k, float *y) {
    const int64_t row_bytes = k * w_size(wtype);
    int64_t j = 0;
    if (n <= 2)
        for (; j + 4 <= m; j += 4) {
            const char *wr = (const char *)w + j * row_bytes;
            __builtin_prefetch(wr + 16 * row_bytes);
            v16 acc[4][2] = {{{0}}};
            for (int64_t d = 0; d < k; d += 16)
                for (int b = 0; b < 4; b++) {
                    const v16 wv = load_w(wr + b * row_bytes, wtype, d);
                    for (int64_t r = 0; r < n; r++) acc[b][r] += wv * load_f32(x + r * k + d);
                }
            for (int64_t r = 0; r < n; r++)
                for (int b = 0; b < 4; b++) y[r * m + j + b] = hsum16(acc[b][r]) * (wtype == W_I8 ? scale[j + b] : 1.0f);
        }
    for (; j < m; j++) {
        const char *wr = (const char *)w + j * row_bytes;
        __builtin_prefetch(wr + 8 * row_bytes);
        v16 acc[MAX_ROWS] = {{0}};
        for (int64_t d = 0; d < k; d += 16) {
            const v16 wv = load_w(wr, wtype, d);
            for (int64_t r = 0; r < n; r++) acc[r] += wv * load_f32(x + r * k + d);
        }
        for (int64_t r = 0; r < n; r++) y[r * m + j] = hsum16(acc[r]) * (wtype == W_I8 ? scale[j] : 1.0f);
    }
}
static void rows_times_weight(const float *x, int64_t n, const void *w, const float *scale, int wtype, int64_t m,
                              int64_t k, float *y) {  /* one specialised copy per weight type */
    if (wtype == W_BF16) rows_times_weight_t(x, n, w, scale, W_BF16, m, k, y);
    else if (wtype == W_I8) rows_times_weight_t(x, n, w, scale, W_I8, m, k, y);
    else rows_times_weight_t(x, n, w, scale, W_F32, m, k, y);
}

/* SwiGLU of the experts over their rows: xs [rows, h] fp32 sorted by expert, counts [n_experts] rows each
   (each <= MAX_ROWS); gate_up [n_experts, 2 * inter, h] (gate rows first), down [n_experts, h, inter], both of
   wtype; for int8 their row scales gu_scale [n_experts, 2 * inter] and down_scale [n_experts, h] (else NULL);
   out [rows, h] fp32; work >= MAX_ROWS * 3 * inter floats. h and inter multiples of 16. */
void experts_swiglu(const float *xs, const int64_t *counts, int64_t n_experts, const void *gate_up,
                    const void *down, const float *gu_scale, const float *down_scale, int wtype, int64_t h,
                    int64_t inter, float *out, float *work) {
    const int64_t size = w_size(wtype);
    float *gu = work, *act = work + MAX_ROWS * 2 * inter;
    for (int64_t e = 0, row = 0; e < n_experts; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        rows_times_weight(xs + row * h, n, (const char *)gate_up + e * 2 * inter * h * size,
                          gu_scale ? gu_scale + e * 2 * inter : NULL, wtype, 2 * inter, h, gu);
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * u;
            }
        rows_times_weight(act, n, (const char *)down + e * h * inter * size, down_scale ? down_scale + e * h : NULL,
                          wtype, h, inter, out + row * h);
        row += n;
    }
}

/* y [n, m] = x [n, k] times w [m, k] (of wtype, int8 with row scales) transposed: a Linear without bias, for
   n <= MAX_ROWS rows. x and y are bf16 when io_bf16 (x widened once, y rounded as torch rounds), else fp32.
   Returns 0, or -1 when the fp32 buffers of the bf16 case cannot be allocated (y is then untouched). */
int rows_linear(const void *x, int64_t n, const void *w, const float *scale, int wtype, int io_bf16, int64_t m,
                int64_t k, void *y) {
    if (!io_bf16) { rows_times_weight(x, n, w, scale, wtype, m, k, y); return 0; }
    float *xf = malloc(sizeof(float) * n * (k + m));
    if (!xf) return -1;
    for (int64_t i = 0; i < n * k; i++) xf[i] = widen_bf16(((const uint16_t *)x)[i]);
    rows_times_weight(xf, n, w, scale, wtype, m, k, xf + n * k);
    for (int64_t i = 0; i < n * m; i++) ((uint16_t *)y)[i] = round_bf16(xf[n * k + i]);
    free(xf);
    return 0;
}

/* Per-head products of MLA's absorbed decode step: y[r, h] = w[h] x[r, h] for h < heads, where x [n, heads, k]
   fp32, w [heads] of [m, k] (row stride k, head stride w_head elements; of wtype, int8 with row scales at
   scale + h * s_head), y [n, heads, m] fp32. One call per layer instead of a bmm whose small-row set-up
   (oneDNN / MKL) costs more than its ~1 MB read. */
void heads_linear(const float *x, int64_t n, int64_t heads, const void *w, const float *scale, int wtype,
                  int64_t w_head, int64_t s_head, int64_t m, int64_t k, float *y) {
    const int64_t size = w_size(wtype);
    float xs[MAX_ROWS * 1024], ys[MAX_ROWS * 1024];
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t r = 0; r < n; r++) memcpy(xs + r * k, x + (r * heads + h) * k, k * sizeof(float));
        rows_times_weight(xs, n, (const char *)w + h * w_head * size, scale ? scale + h * s_head : NULL, wtype, m, k, ys);
        for (int64_t r = 0; r < n; r++) memcpy(y + (r * heads + h) * m, ys + r * m, m * sizeof(float));
    }
}

/* RMSNorm of bf16 rows as norm.py computes it, in one call instead of ~30 ATen ops: y = w * bf16(x / rms(x)),
   the mean of squares in fp32, the normalised row rounded to bf16, then the weight product rounded again
   (the reference's two roundings). x, y [rows, dim] bf16, w [dim] bf16; dim a multiple of 16. */
void rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, const uint16_t *w, float eps, uint16_t *y) {
    for (int64_t r = 0; r < rows; r++, x += dim, y += dim) {
        v16 acc = {0};
        for (int64_t i = 0; i < dim; i += 16) { v16 v = load_bf16(x + i); acc += v * v; }
        const float inv = 1.0f / sqrtf(hsum16(acc) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            y[i] = round_bf16(widen_bf16(w[i]) * widen_bf16(round_bf16(widen_bf16(x[i]) * inv)));
    }
}
