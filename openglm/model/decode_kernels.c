/* openglm: native kernels for a decode step's routed experts, used by openglm/model/moe.py.
   Compiled on first use by openglm/model/native.py (cc -O3 -march=native -shared -fPIC) and called via ctypes.

   A decode step gives each active expert one or two rows. MKL's and oneDNN's small-row matmuls then read the
   expert weights at ~5 GB/s from memory; reading each weight row once, in order, and multiplying it into the
   expert's few input rows held in L1 runs about twice as fast cold. The whole SwiGLU of every active expert is
   one call: gate/up rows, silu(gate) * up, down rows. Accumulation is fp32 throughout (bf16 weights are widened
   on load), so results equal the matmul path up to summation order (and, in bf16, without rounding the
   intermediate activations to bf16). */
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include "kernels.h"

/* The limits of what these kernels take (native.py reads them through `decode_limits`): rows per weight (the
   register sums of each row), the per-head widths of heads_linear (its stack buffers) and the widths of a decode
   step's layer (hidden, kv rank, experts, indexer heads x width: its stack buffers). */
#define MAX_ROWS 8
#define HEADS_MAX_WIDTH 1024
#define STEP_MAX_WIDTH 65536

/* weight element types; int8 rows carry one fp32 scale each, int4 rows (int4_kernels.h) one bf16 scale per group */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3 };
static inline int64_t w_size(int wtype) { return wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1; }
static inline int64_t w_bytes(int wtype, int64_t n) { return wtype == W_I4 ? n / 2 : n * w_size(wtype); }
/* the scales of a weight `rows` rows in (k columns, int4 groups of `group`): fp32 per row, bf16 per group */
static inline const void *scale_at(const void *scale, int wtype, int64_t rows, int64_t k, int64_t group) {
    if (!scale) return NULL;
    return wtype == W_I4 ? (const void *)((const uint16_t *)scale + rows * (k / group))
                         : (const void *)((const float *)scale + rows);
}
/* Threads the weight kernels split a product over (native.py sets it to torch's thread count) and the weight size
   from which they do: below it a fork/join costs more than the split saves. */
static int kernel_threads = 1;
#define PARALLEL_BYTES (128 << 10)
#include "int4_kernels.h"
static inline v16 load_i8(const void *p) {  /* 16 int8 -> fp32 */
#if defined(__AVX512F__)  /* GCC lowers the generic conversion below to 16 scalar moves */
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    i8x16 h; memcpy(&h, p, sizeof h);
    return __builtin_convertvector(__builtin_convertvector(h, i32x16), v16);
#endif
}
static inline __attribute__((always_inline)) v16 load_w(const char *row, int wtype, int64_t d) {
    return wtype == W_BF16 ? load_bf16(row + 2 * d) : wtype == W_I8 ? load_i8(row + d) : load_f32(row + 4 * d);
}

/* With one x row, weight rows of up to this many bytes are read one at a time, front to back with four sum chains
   (one memory stream: 16 -> 19-24 GB/s cold on AVX-512 EPYC); longer rows go four at a time (four streams were
   faster there). */
#define SEQ_ROW_BYTES 4096

/* Several x rows (2 <= N <= MAX_ROWS, a compile-time constant in each copy): each weight row read once, front to back,
   into two sum chains per x row held in registers (a runtime row count kept them in memory: 2 rows ran 3x slower
   than one). k a multiple of 32. */
static inline __attribute__((always_inline)) void rows_seq(const float *x, const int N, const char *w, const float *scale,
                                                           int wtype, int64_t m, int64_t k, float *y) {
    const int64_t row_bytes = k * w_size(wtype);
    for (int64_t j = 0; j < m; j++) {
        const char *wr = w + j * row_bytes;
        v16 a[MAX_ROWS][2];
        for (int r = 0; r < N; r++) { a[r][0] = (v16){0}; a[r][1] = (v16){0}; }
        for (int64_t d = 0; d < k; d += 32) {
            const v16 w0 = load_w(wr, wtype, d), w1 = load_w(wr, wtype, d + 16);
            for (int r = 0; r < N; r++) {
                a[r][0] += w0 * load_f32(x + r * k + d);
                a[r][1] += w1 * load_f32(x + r * k + d + 16);
            }
        }
        for (int r = 0; r < N; r++) y[r * m + j] = hsum16(a[r][0] + a[r][1]) * (wtype == W_I8 ? scale[j] : 1.0f);
    }
}
#define ROWS_SEQ_CASE(N) case N: rows_seq(x, N, w, scale, wtype, m, k, y); return 1;
static inline __attribute__((always_inline)) int rows_seq_any(const float *x, int64_t n, const char *w,
                                                              const float *scale, int wtype, int64_t m, int64_t k, float *y) {
    switch (n) { ROWS_SEQ_CASE(2) ROWS_SEQ_CASE(3) ROWS_SEQ_CASE(4) ROWS_SEQ_CASE(5) ROWS_SEQ_CASE(6)
                 ROWS_SEQ_CASE(7) ROWS_SEQ_CASE(8) }
    return 0;
}

/* y[r, j] = scale[j] * (x[r] . w[j]) for r < n rows (n <= MAX_ROWS), j < m; x [n, k] fp32, w [m, k] of wtype
   (scale only for int8, else ignored), y [n, m] fp32; k a multiple of 16. Each weight row is read once and
   used for all n rows: short rows one at a time (above), otherwise, with one or two x rows, four weight rows
   together (four independent FMA chains and four streams, where one chain per row is bound by the FMA latency). */
static inline __attribute__((always_inline)) void rows_times_weight_t(
        const float *x, int64_t n, const void *w, const float *scale, int wtype, int64_t m, int64_t k, float *y) {
    const int64_t row_bytes = k * w_size(wtype);
    int64_t j = 0;
    if (n == 1 && k % 64 == 0 && row_bytes <= SEQ_ROW_BYTES)  /* one row: one weight row at a time, front to back */
        for (; j < m; j++) {
            const char *wr = (const char *)w + j * row_bytes;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t d = 0; d < k; d += 64) {
                a0 += load_w(wr, wtype, d) * load_f32(x + d);
                a1 += load_w(wr, wtype, d + 16) * load_f32(x + d + 16);
                a2 += load_w(wr, wtype, d + 32) * load_f32(x + d + 32);
                a3 += load_w(wr, wtype, d + 48) * load_f32(x + d + 48);
            }
            y[j] = hsum16((a0 + a1) + (a2 + a3)) * (wtype == W_I8 ? scale[j] : 1.0f);
        }
    if (n > 1 && k % 32 == 0 && row_bytes <= SEQ_ROW_BYTES && rows_seq_any(x, n, w, scale, wtype, m, k, y)) return;
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
#if defined(__AVX512BF16__)
#include <immintrin.h>

/* N bf16 x rows (xp: N rows of k / 32 vectors) times w [m, k] -> y [N, m]: each weight row read once, front to back;
   N a compile-time constant in each copy, so the N sum chains stay in registers. */
static inline __attribute__((always_inline)) void rows_bf16_seq(const __m512i *xp, const int N, const uint16_t *w,
                                                                int64_t m, int64_t k, float *y) {
    const int64_t steps = k / 32;
    for (int64_t j = 0; j < m; j++) {
        const uint16_t *wr = w + j * k;
        __m512 a[2 * MAX_ROWS];
        for (int r = 0; r < N; r++) a[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < steps; d++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + 32 * d);
            for (int r = 0; r < N; r++) a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_loadu_si512(xp + r * steps + d));
        }
        for (int r = 0; r < N; r++) y[r * m + j] = _mm512_reduce_add_ps(a[r]);
    }
}
#define BF16_SEQ_CASE(N) case N: rows_bf16_seq(xp, N, w, m, k, y); return 1;
static int rows_bf16_seq_any(const __m512i *xp, int64_t rows, const uint16_t *w, int64_t m, int64_t k, float *y) {
    switch (rows) { BF16_SEQ_CASE(2) BF16_SEQ_CASE(3) BF16_SEQ_CASE(4) BF16_SEQ_CASE(5) BF16_SEQ_CASE(6)
                    BF16_SEQ_CASE(7) BF16_SEQ_CASE(8) BF16_SEQ_CASE(10) BF16_SEQ_CASE(12) BF16_SEQ_CASE(14)
                    BF16_SEQ_CASE(16) }
    return 0;
}

/* rows_times_weight for bf16 weights on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums
   per instruction, where widening and FMAs take four; widening bound the bf16 kernel at ~9 GB/s on one core. Each
   x row is split into bf16 hi + lo parts (x = hi + lo to 2^-17 relative); rows whose values are bf16 already (a bf16
   model's activations) need the hi part only. Returns 0 when it does not apply (k not a multiple of 32). */
static int rows_times_bf16(const float *x, int64_t n, const uint16_t *w, int64_t m, int64_t k, float *y) {
    if (k % 32) return 0;
    uint16_t *parts = malloc(sizeof(uint16_t) * 2 * n * k);
    if (!parts) return 0;
    const int need_lo = split_bf16(x, n * k, parts);
    const __m512i *xh = (const __m512i *)parts, *xl = (const __m512i *)(parts + n * k);
    const int64_t steps = k / 32, virtual_rows = need_lo ? 2 * n : n;  /* the lo parts as rows of their own */
    if (virtual_rows > 1 && 2 * k <= SEQ_ROW_BYTES) {
        float *ys = need_lo ? malloc(sizeof(float) * 2 * n * m) : y;
        if (ys && rows_bf16_seq_any(xh, virtual_rows, w, m, k, ys)) {
            for (int64_t i = 0; need_lo && i < n * m; i++) y[i] = ys[i] + ys[n * m + i];
            if (need_lo) free(ys);
            free(parts);
            return 1;
        }
        if (need_lo) free(ys);
    }
    int64_t j = 0;
    for (; n == 1 && !need_lo && 2 * k <= SEQ_ROW_BYTES && j < m; j++) {  /* as in rows_times_weight_t */
        const uint16_t *wr = w + j * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 4 <= steps; d += 4) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr + 32 * d), (__m512bh)_mm512_loadu_si512(xh + d));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr + 32 * d + 32), (__m512bh)_mm512_loadu_si512(xh + d + 1));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wr + 32 * d + 64), (__m512bh)_mm512_loadu_si512(xh + d + 2));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wr + 32 * d + 96), (__m512bh)_mm512_loadu_si512(xh + d + 3));
        }
        for (; d < steps; d++)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr + 32 * d), (__m512bh)_mm512_loadu_si512(xh + d));
        y[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    for (; j + 4 <= m && n <= 2; j += 4) {
        const uint16_t *wr = w + j * k;
        __builtin_prefetch(wr + 16 * k);
        __m512 acc[4][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()},
                            {_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
        for (int64_t d = 0; d < steps; d++)
            for (int b = 0; b < 4; b++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + b * k + 32 * d);
                for (int64_t r = 0; r < n; r++) {
                    acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)_mm512_loadu_si512(xh + r * steps + d));
                    if (need_lo) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)_mm512_loadu_si512(xl + r * steps + d));
                }
            }
        for (int64_t r = 0; r < n; r++)
            for (int b = 0; b < 4; b++) y[r * m + j + b] = _mm512_reduce_add_ps(acc[b][r]);
    }
    for (; j < m; j++) {
        const uint16_t *wr = w + j * k;
        __builtin_prefetch(wr + 8 * k);
        __m512 acc[MAX_ROWS];
        for (int64_t r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < steps; d++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + 32 * d);
            for (int64_t r = 0; r < n; r++) {
                acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(xh + r * steps + d));
                if (need_lo) acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(xl + r * steps + d));
            }
        }
        for (int64_t r = 0; r < n; r++) y[r * m + j] = _mm512_reduce_add_ps(acc[r]);
    }
    free(parts);
    return 1;
}
#else
static int rows_times_bf16(const float *x, int64_t n, const uint16_t *w, int64_t m, int64_t k, float *y) {
    (void)x; (void)n; (void)w; (void)m; (void)k; (void)y;
    return 0;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define I8_CHUNK 2048  /* int32 sums are moved to fp32 this often: 2048 / 16 products of <= 127 * 32767 per lane */
/* rows_times_weight for int8 weights with AVX512-VNNI: each x row becomes int16 (x = sx * q, sx = |x|max / 32767)
   and vpdpwssd multiplies 32 int8-widened weights into int32 sums per instruction, where converting to fp32 and
   FMAs took eight. A row whose values are not all bf16 (an fp32 model's) also gets the remainder as a second int16
   part (x = sx * (q + r / 32768)), so the result matches the fp32 product to ~2^-30 of |x|max; a bf16 model's rows
   keep one part (2^-16 of |x|max, far below bf16's rounding). Returns 0 when it does not apply (k % 32). */
static int rows_times_i8(const float *x, int64_t n, const int8_t *w, const float *scale, int64_t m, int64_t k, float *y) {
    if (k % 32) return 0;
    int16_t *q = malloc(sizeof(int16_t) * 2 * n * k);
    if (!q) return 0;
    float sx[MAX_ROWS];
    int two = 0;
    for (int64_t r = 0; r < n; r++) {
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float a = fabsf(x[r * k + i]);
            amax = a > amax ? a : amax;
            uint32_t u; memcpy(&u, x + r * k + i, 4);
            two |= (u & 0xffff) != 0;
        }
        sx[r] = amax > 0.0f ? amax / 32767.0f : 0.0f;
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float v = x[r * k + i] * inv, hi = nearbyintf(v);
            q[r * k + i] = (int16_t)hi;
            q[n * k + r * k + i] = (int16_t)nearbyintf((v - hi) * 32768.0f);
        }
    }
    int64_t j = 0;
    for (; j + 4 <= m && n == 1; j += 4) {  /* one row: four weight rows at once, four independent sum chains */
        const int8_t *wr = w + j * k;
        __builtin_prefetch(wr + 16 * k);
        __m512 accf[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t c = 0; c < k; c += I8_CHUNK) {
            const int64_t end = c + I8_CHUNK < k ? c + I8_CHUNK : k;
            __m512i hi[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            __m512i lo[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int64_t d = c; d < end; d += 32) {
                const __m512i xh = _mm512_loadu_si512(q + d), xl = _mm512_loadu_si512(q + k + d);
                for (int b = 0; b < 4; b++) {
                    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + b * k + d)));
                    hi[b] = _mm512_dpwssd_epi32(hi[b], wv, xh);
                    if (two) lo[b] = _mm512_dpwssd_epi32(lo[b], wv, xl);
                }
            }
            for (int b = 0; b < 4; b++) {
                accf[b] = _mm512_add_ps(accf[b], _mm512_cvtepi32_ps(hi[b]));
                if (two) accf[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[b]), _mm512_set1_ps(1.0f / 32768.0f), accf[b]);
            }
        }
        for (int b = 0; b < 4; b++) y[j + b] = _mm512_reduce_add_ps(accf[b]) * sx[0] * scale[j + b];
    }
    for (; j < m; j++) {
        const int8_t *wr = w + j * k;
        __builtin_prefetch(wr + 8 * k);
        __m512 accf[MAX_ROWS];
        for (int64_t r = 0; r < n; r++) accf[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += I8_CHUNK) {
            const int64_t end = c + I8_CHUNK < k ? c + I8_CHUNK : k;
            __m512i hi[MAX_ROWS], lo[MAX_ROWS];
            for (int64_t r = 0; r < n; r++) { hi[r] = _mm512_setzero_si512(); lo[r] = _mm512_setzero_si512(); }
            for (int64_t d = c; d < end; d += 32) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + d)));
                for (int64_t r = 0; r < n; r++) {
                    hi[r] = _mm512_dpwssd_epi32(hi[r], wv, _mm512_loadu_si512(q + r * k + d));
                    if (two) lo[r] = _mm512_dpwssd_epi32(lo[r], wv, _mm512_loadu_si512(q + n * k + r * k + d));
                }
            }
            for (int64_t r = 0; r < n; r++) {
                accf[r] = _mm512_add_ps(accf[r], _mm512_cvtepi32_ps(hi[r]));
                if (two) accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_set1_ps(1.0f / 32768.0f), accf[r]);
            }
        }
        for (int64_t r = 0; r < n; r++) y[r * m + j] = _mm512_reduce_add_ps(accf[r]) * sx[r] * scale[j];
    }
    free(q);
    return 1;
}
#else
static int rows_times_i8(const float *x, int64_t n, const int8_t *w, const float *scale, int64_t m, int64_t k, float *y) {
    (void)x; (void)n; (void)w; (void)scale; (void)m; (void)k; (void)y;
    return 0;
}
#endif

static void rows_times_weight_one(const float *x, int64_t n, const void *w, const void *scale, int wtype,
                                  int64_t group, int64_t m, int64_t k, float *y) {  /* one copy per weight type */
    if (wtype == W_I4) { rows_times_i4(x, n, w, scale, group, m, k, y, m); return; }
    if (wtype == W_BF16 && rows_times_bf16(x, n, w, m, k, y)) return;
    if (wtype == W_I8 && rows_times_i8(x, n, w, scale, m, k, y)) return;
    if (wtype == W_BF16) rows_times_weight_t(x, n, w, scale, W_BF16, m, k, y);
    else if (wtype == W_I8) rows_times_weight_t(x, n, w, scale, W_I8, m, k, y);
    else rows_times_weight_t(x, n, w, scale, W_F32, m, k, y);
}

/* y [n, m] = x [n, k] times w [m, k] transposed, the weight rows split over `kernel_threads` (in multiples of 16 rows)
   when it is large enough; each thread's part goes through a buffer of its own when n > 1 (y's rows are m apart). */
static void rows_times_weight(const float *x, int64_t n, const void *w, const void *scale, int wtype, int64_t group,
                              int64_t m, int64_t k, float *y) {
    const int threads = kernel_threads;
    if (threads < 2 || w_bytes(wtype, m * k) < PARALLEL_BYTES || m < 32 || omp_in_parallel()) {
        rows_times_weight_one(x, n, w, scale, wtype, group, m, k, y);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t per = (m / 16 + t - 1) / t * 16, j0 = i * per < m ? i * per : m, j1 = j0 + per < m ? j0 + per : m;
        if (j1 > j0) {
            const void *wp = (const char *)w + w_bytes(wtype, j0 * k), *sp = scale_at(scale, wtype, j0, k, group);
            float *part = n == 1 ? y + j0 : malloc(sizeof(float) * n * (j1 - j0));
            if (part) {
                rows_times_weight_one(x, n, wp, sp, wtype, group, j1 - j0, k, part);
                for (int64_t r = 0; n > 1 && r < n; r++)
                    memcpy(y + r * m + j0, part + r * (j1 - j0), sizeof(float) * (j1 - j0));
                if (n > 1) free(part);
            } else {  /* no buffer: the part one row at a time, straight into y */
                for (int64_t r = 0; r < n; r++)
                    rows_times_weight_one(x + r * k, 1, wp, sp, wtype, group, j1 - j0, k, y + r * m + j0);
            }
        }
    }
}

/* Whether a product of n x rows by a weight [m, k] of wtype (with row scales when int8, group scales when int4) is
   one these kernels take: 1 <= n <= MAX_ROWS, k a positive multiple of 16 (the vector loops have no tail); int4: k a
   multiple of 32 and of the group, which is 32, 64 or 128. */
static int rows_ok(int64_t n, int64_t m, int64_t k, int wtype, const void *scale, int64_t group) {
    return n >= 1 && n <= MAX_ROWS && m >= 1 && k >= 16 && k % 16 == 0 && wtype >= W_F32 && wtype <= W_I4
        && (wtype < W_I8 || scale != NULL) && (wtype != W_I4 || i4_group_ok(k, group));
}

/* The limits above, for native.py: out[0] = MAX_ROWS, out[1] = HEADS_MAX_WIDTH, out[2] = STEP_MAX_WIDTH. */
int64_t decode_limits(int64_t *out) {
    out[0] = MAX_ROWS;
    out[1] = HEADS_MAX_WIDTH;
    out[2] = STEP_MAX_WIDTH;
    return 3;
}

/* Which instruction paths this build compiled (-march=native): 1 = bf16 weights through AVX512-BF16 dot products,
   2 = int8 weights through AVX512-VNNI, 4 = int4 weights widened by table lookup into AVX512-BF16 dot products;
   otherwise the portable code widens each weight to fp32. */
int decode_features(void) {
    int f = 0;
#if defined(__AVX512BF16__)
    f |= 1;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    f |= 4;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    f |= 2;
#endif
    return f;
}

/* SwiGLU of the experts over their rows: xs [rows, h] fp32 sorted by expert, counts [n_experts] rows each
   (each <= MAX_ROWS); gate_up [n_experts, 2 * inter, h] (gate rows first), down [n_experts, h, inter], both of
   wtype; for int8 their row scales gu_scale [n_experts, 2 * inter] and down_scale [n_experts, h], for int4 their
   group scales (groups of `group` columns), else NULL; out [rows, h] fp32; work >= MAX_ROWS * 3 * inter floats. h and
   inter multiples of 16. Returns 0, or KERNEL_BAD_ARGS (nothing written) when a count is outside [0, MAX_ROWS] or a
   size, group or type is not one it takes. */
int experts_swiglu(const float *xs, const int64_t *counts, int64_t n_experts, const void *gate_up,
                   const void *down, const void *gu_scale, const void *down_scale, int wtype, int64_t group, int64_t h,
                   int64_t inter, float *out, float *work) {
    if (n_experts < 0 || !rows_ok(1, h, inter, wtype, down_scale, group)
        || !rows_ok(1, 2 * inter, h, wtype, gu_scale, group))
        return KERNEL_BAD_ARGS;
    for (int64_t e = 0; e < n_experts; e++) if (counts[e] < 0 || counts[e] > MAX_ROWS) return KERNEL_BAD_ARGS;
    float *gu = work, *act = work + MAX_ROWS * 2 * inter;
    for (int64_t e = 0, row = 0; e < n_experts; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        rows_times_weight(xs + row * h, n, (const char *)gate_up + w_bytes(wtype, e * 2 * inter * h),
                          scale_at(gu_scale, wtype, e * 2 * inter, h, group), wtype, group, 2 * inter, h, gu);
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * u;
            }
        rows_times_weight(act, n, (const char *)down + w_bytes(wtype, e * h * inter),
                          scale_at(down_scale, wtype, e * h, inter, group), wtype, group, h, inter, out + row * h);
        row += n;
    }
    return 0;
}

/* y [n, m] = x [n, k] times w [m, k] (of wtype, int8 with row scales, int4 with group scales) transposed: a Linear
   without bias, for n <= MAX_ROWS rows. x and y are bf16 when io_bf16 (x widened once, y rounded as torch rounds),
   else fp32. k a multiple of 16. Returns 0, KERNEL_BAD_ARGS (nothing written), or KERNEL_NO_MEMORY when the fp32
   buffers of the bf16 case cannot be allocated (y is then untouched). */
int rows_linear(const void *x, int64_t n, const void *w, const void *scale, int wtype, int64_t group, int io_bf16,
                int64_t m, int64_t k, void *y) {
    if (!rows_ok(n, m, k, wtype, scale, group)) return KERNEL_BAD_ARGS;
    if (!io_bf16) { rows_times_weight(x, n, w, scale, wtype, group, m, k, y); return 0; }
    float *xf = malloc(sizeof(float) * n * (k + m));
    if (!xf) return KERNEL_NO_MEMORY;
    for (int64_t i = 0; i < n * k; i++) xf[i] = widen_bf16(((const uint16_t *)x)[i]);
    rows_times_weight(xf, n, w, scale, wtype, group, m, k, xf + n * k);
    for (int64_t i = 0; i < n * m; i++) ((uint16_t *)y)[i] = round_bf16(xf[n * k + i]);
    free(xf);
    return 0;
}

/* Per-head products of MLA's absorbed decode step: y[r, h] = w[h] x[r, h] for h < heads, where x [n, heads, k]
   fp32, w [heads] of [m, k] (row stride k, head stride w_head elements; of wtype, int8 with row scales at
   scale + h * s_head), y [n, heads, m] fp32. One call per layer instead of a bmm whose small-row set-up
   (oneDNN / MKL) costs more than its ~1 MB read. m and k at most HEADS_MAX_WIDTH, k a multiple of 16; heads at
   least m * k elements (and, int8, m scales) apart. Returns 0 or KERNEL_BAD_ARGS (nothing written). */
int heads_linear(const float *x, int64_t n, int64_t heads, const void *w, const void *scale, int wtype, int64_t group,
                 int64_t w_head, int64_t s_head, int64_t m, int64_t k, float *y) {
    if (!rows_ok(n, m, k, wtype, scale, group) || heads < 1 || m > HEADS_MAX_WIDTH || k > HEADS_MAX_WIDTH
        || (heads > 1 && (w_head < m * k || (wtype == W_I8 && s_head < m) || (wtype == W_I4 && s_head < m * (k / group)))))
        return KERNEL_BAD_ARGS;
    float xs[MAX_ROWS * HEADS_MAX_WIDTH], ys[MAX_ROWS * HEADS_MAX_WIDTH];
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t r = 0; r < n; r++) memcpy(xs + r * k, x + (r * heads + h) * k, k * sizeof(float));
        const void *sh = !scale ? NULL : wtype == W_I4 ? (const void *)((const uint16_t *)scale + h * s_head)
                                                       : (const void *)((const float *)scale + h * s_head);
        rows_times_weight(xs, n, (const char *)w + w_bytes(wtype, h * w_head), sh, wtype, group, m, k, ys);
        for (int64_t r = 0; r < n; r++) memcpy(y + (r * heads + h) * m, ys + r * m, m * sizeof(float));
    }
    return 0;
}

/* RMSNorm of bf16 rows as norm.py computes it, in one call instead of ~30 ATen ops: y = w * bf16(x / rms(x)),
   the mean of squares in fp32, the normalised row rounded to bf16, then the weight product rounded again
   (the reference's two roundings). x, y [rows, dim] bf16, w [dim] bf16; dim a positive multiple of 16. Returns 0
   or KERNEL_BAD_ARGS (nothing written). */
int rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, const uint16_t *w, float eps, uint16_t *y) {
    if (rows < 0 || dim < 16 || dim % 16) return KERNEL_BAD_ARGS;
    for (int64_t r = 0; r < rows; r++, x += dim, y += dim) {
        v16 acc = {0};
        for (int64_t i = 0; i < dim; i += 16) { v16 v = load_bf16(x + i); acc += v * v; }
        const float inv = 1.0f / sqrtf(hsum16(acc) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            y[i] = round_bf16(widen_bf16(w[i]) * widen_bf16(round_bf16(widen_bf16(x[i]) * inv)));
    }
    return 0;
}

/* ---- A whole MLA/DSA decoder layer's decode step in three calls (openglm/model/decode_step.py drives them) ----
   A small model's decode step is bound by op dispatch (~95 ATen ops per layer). These run one layer's attention as
   two calls (mla_decode_select: norms, projections, RoPE, the new cache entries, the absorbed queries and the DSA
   top-k; mla_decode_attend: attention over the selected latent rows, W_uv, o_proj, the residual and the
   post-attention norm) and its MLP or MoE as one (ffn_decode). Each weight is streamed once for all rows.
   Activations are fp32; in a bf16 model every value the torch path holds in bf16 is rounded to bf16 at the same
   point (`in_act_dtype`), so the two paths agree up to summation order. Keys are read where the cache holds them. */

typedef struct {  /* a weight [rows, cols] of type `type` (per head: head_stride elements apart); int8 row scales, int4
                     group scales (groups of `group` columns) */
    const void *w; const void *scale; int64_t type, rows, cols, head_stride, scale_head_stride, group;
} Mat;

typedef struct {
    int64_t hidden, q_lora, rank, rope, nope, v_dim, heads, idx_heads, idx_dim, topk, own_indexer, act_bf16, vec_bf16;
    float eps, eps_q, eps_kv, eps_idx, scale, idx_weight_scale;
    Mat w_in, w_iw, w_q, w_uk, w_uv, w_o;  /* w_iw.w NULL: the indexer head weights are w_in's last rows */
    const void *n_in, *n_q, *n_kv, *n_post, *ln_w, *ln_b;  /* norm weights (bf16 if vec_bf16), LayerNorm bias */
} MlaLayer;

typedef struct {  /* a layer's cache: key i of row r is slot table[row_base[r] + i] (no table: row_base[r] + i) */
    void *kv, *pe, *ik;
    int64_t kv_stride, pe_stride, ik_stride, kv_bf16, ik_bf16;
    const int64_t *table, *row_base, *row_keys, *write;
    int8_t *ik8; float *ik8_scale;  /* the indexer keys' int8 shadow (NULL: none), below */
} CacheRows;

static inline int64_t slot_of(const CacheRows *c, int64_t r, int64_t i) {
    return c->table ? c->table[c->row_base[r] + i] : c->row_base[r] + i;
}
static inline float vec_at(const void *v, int bf16, int64_t i) {
    return bf16 ? widen_bf16(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}
/* A value as the torch path holds it: rounded to bf16 in a bf16 model (kept in fp32 here), else as is. */
static inline float in_act_dtype(float f, int bf16) { return bf16 ? widen_bf16(round_bf16(f)) : f; }
static void round_to_act_dtype(float *x, int64_t n, int bf16) {
    if (bf16) for (int64_t i = 0; i < n; i++) x[i] = in_act_dtype(x[i], 1);
}
static void load_row(const void *src, int bf16, int64_t n, float *dst) {
    if (!bf16) { memcpy(dst, src, n * sizeof(float)); return; }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  /* 16 at a time: a decode step widens every attended latent row */
        const v16 v = load_bf16((const uint16_t *)src + i);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < n; i++) dst[i] = widen_bf16(((const uint16_t *)src)[i]);
}
static void store_row(const float *src, int bf16, int64_t n, void *dst) {
    if (!bf16) { memcpy(dst, src, n * sizeof(float)); return; }
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = round_bf16(src[i]);
}
static inline void *row_at(void *base, int64_t row, int64_t stride, int bf16) {
    return (char *)base + row * stride * (bf16 ? 2 : 4);
}
/* RMSNorm as norm.py: fp32 statistics; in bf16 the normalised row and the weight product are each rounded. */
static void rmsnorm(const float *x, int64_t dim, const void *w, int bf16, float eps, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) y[i] = in_act_dtype(vec_at(w, bf16, i) * in_act_dtype(x[i] * inv, bf16), bf16);
}
static void layernorm(const float *x, int64_t dim, const void *w, const void *b, int bf16, float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t i = 0; i < dim; i++) mean += x[i];
    mean /= (float)dim;
    for (int64_t i = 0; i < dim; i++) var += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf(var / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++)
        y[i] = in_act_dtype((x[i] - mean) * inv * vec_at(w, bf16, i) + vec_at(b, bf16, i), bf16);
}
/* Interleaved pairs (x[2i], x[2i+1]) times the complex rot[i] (its scale included), i < pairs. */
static void rope_pairs(float *x, const float *rot, int64_t pairs, int bf16) {
    for (int64_t i = 0; i < pairs; i++) {
        const float a = x[2 * i], b = x[2 * i + 1], c = rot[2 * i], s = rot[2 * i + 1];
        x[2 * i] = in_act_dtype(a * c - b * s, bf16);
        x[2 * i + 1] = in_act_dtype(a * s + b * c, bf16);
    }
}
/* Whether a weight is one rows_times_weight reads for n rows and has the shape [rows, cols]. */
static int mat_ok(const Mat *m, int64_t n, int64_t rows, int64_t cols) {
    return m->w && m->rows == rows && m->cols == cols && rows_ok(n, rows, cols, (int)m->type, m->scale, m->group);
}

/* y [n, m->rows] = x [n, m->cols] times head `head` of m, transposed; x rows x_stride apart, y rows y_stride apart.
   Returns 0, or KERNEL_NO_MEMORY (y not written) when a buffer for strided rows cannot be allocated. */
static int mat_rows(const Mat *m, int64_t head, const float *x, int64_t x_stride, int64_t n, float *y, int64_t y_stride) {
    const int copy_x = x_stride != m->cols, copy_y = y_stride != m->rows;
    float *tmp = copy_x || copy_y ? malloc(sizeof(float) * n * (m->cols + m->rows)) : NULL;
    if ((copy_x || copy_y) && !tmp) return KERNEL_NO_MEMORY;
    const float *xi = x;
    if (copy_x) {
        for (int64_t r = 0; r < n; r++) memcpy(tmp + r * m->cols, x + r * x_stride, m->cols * sizeof(float));
        xi = tmp;
    }
    float *yo = copy_y ? tmp + n * m->cols : y;
    const int t = (int)m->type;
    const void *sh = !m->scale ? NULL : t == W_I4 ? (const void *)((const uint16_t *)m->scale + head * m->scale_head_stride)
                                                  : (const void *)((const float *)m->scale + head * m->scale_head_stride);
    rows_times_weight(xi, n, (const char *)m->w + w_bytes(t, head * m->head_stride), sh, t, m->group, m->rows, m->cols, yo);
    if (copy_y)
        for (int64_t r = 0; r < n; r++) memcpy(y + r * y_stride, yo + r * m->rows, m->rows * sizeof(float));
    free(tmp);
    return 0;
}
static inline v16 relu(v16 x) {  /* x where x > 0, else +0 (a NaN too) */
    const v16 z = {0};
    i32x16 bits;
    memcpy(&bits, &x, sizeof x);
    bits &= (x > z);
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline __attribute__((always_inline)) v16 key_dot(const char *k, int b16, const float *q, const int ID) {
    v16 a = load_f32(q) * (b16 ? load_bf16(k) : load_f32(k));  /* lanes of q . k, summed later */
#pragma GCC unroll 16
    for (int d = 16; d < ID; d += 16) a += load_f32(q + d) * (b16 ? load_bf16(k + 2 * d) : load_f32(k + 4 * d));
    return a;
}

/* The index scores of 16 keys (rows k[t]): lane t = sum_h w[h] relu(q_h . k_t) over IH heads of ID dims (ID a multiple
   of 16; IH a power of two below 16, or a multiple of 16). 16 (key, head) dot vectors at a time are summed by a
   pairsum tree. IH < 16: group g is keys g*16/IH.. x every head (lane weights wpat[p] = w[p % IH]), and the IH groups'
   weighted relus reduce to the 16 scores; IH >= 16: a group is one key x 16 heads. Inlined with constant IH and ID it
   stays in registers (a loop over runtime shapes took 28 ns a key on `small`). */
static inline __attribute__((always_inline)) v16 scores16(const char *const *k, int b16, const float *q, const float *w,
                                                           v16 wpat, const int IH, const int ID) {
    v16 out[16], a[16];
    if (IH < 16) {
        for (int g = 0; g < IH; g++) {
#pragma GCC unroll 16
            for (int p = 0; p < 16; p++) a[p] = key_dot(k[g * (16 / IH) + p / IH], b16, q + (p % IH) * ID, ID);
            out[g] = relu(pairsum_tree(a, 16)) * wpat;
        }
        return pairsum_tree(out, IH);
    }
    for (int t = 0; t < 16; t++) {
        v16 score = {0};
        for (int h0 = 0; h0 < IH; h0 += 16) {
#pragma GCC unroll 16
            for (int p = 0; p < 16; p++) a[p] = key_dot(k[t], b16, q + (h0 + p) * ID, ID);
            score += relu(pairsum_tree(a, 16)) * load_f32(w + h0);
        }
        out[t] = score;
    }
    return pairsum_tree(out, 16);
}

/* `scores16` over n of row r's keys, read where the cache holds them: s[i] = the score of key idx[i] (idx NULL: key
   from + i). */
static inline __attribute__((always_inline)) void scan_keys(const CacheRows *c, int64_t r, const int32_t *idx,
                                                            int64_t from, int64_t n, const float *q, const float *w,
                                                            const int IH, const int ID, float *s) {
    const int b16 = (int)c->ik_bf16;
    v16 wpat = {0};
    for (int p = 0; p < 16 && IH < 16; p++) wpat[p] = w[p % IH];
    for (int64_t i = 0; i < n; i += 16) {
        const char *k[16];
        for (int t = 0; t < 16; t++) {  /* past the last key: the last key again, its scores dropped */
            const int64_t j = i + t < n ? i + t : n - 1;
            k[t] = row_at(c->ik, slot_of(c, r, idx ? idx[j] : from + j), c->ik_stride, b16);
        }
        if ((c->table || idx) && i + 48 <= n)  /* paged, or chosen keys: the rows 32 keys ahead need not follow
                                                   these (adjacent rows gained nothing from software prefetch) */
            for (int t = 32; t < 48; t++)
                for (int byte = 0; byte < ID * (b16 ? 2 : 4); byte += 64)
                    __builtin_prefetch((const char *)row_at(c->ik, slot_of(c, r, idx ? idx[i + t] : from + i + t),
                                                            c->ik_stride, b16) + byte);
        const v16 sc = scores16(k, b16, q, w, wpat, IH, ID);
        if (i + 16 <= n) memcpy(s + i, &sc, sizeof sc);
        else for (int64_t t = 0; t < n - i; t++) s[i + t] = sc[t];
    }
}

/* The indexer shapes (heads, width) that get compiled copies of the scans: the presets', GLM-5's, DeepSeek-V3.2's. */
#define INDEX_SHAPES(X) X(4, 16) X(4, 32) X(4, 64) X(4, 128) X(8, 64) X(8, 128) X(16, 128) X(32, 128) X(64, 128)

/* The indexer's score of n of row r's keys (idx, from as `scan_keys`): sum_h iw[h] relu(q_h . k), q [ih, id]. */
static void index_scores(const CacheRows *c, int64_t r, const int32_t *idx, int64_t from, int64_t n, const float *q,
                         const float *iw, int64_t ih, int64_t id, float *s) {
#define SCAN(IH, ID) if (ih == IH && id == ID) { scan_keys(c, r, idx, from, n, q, iw, IH, ID, s); return; }
    INDEX_SHAPES(SCAN)
#undef SCAN
    if (id % 16 == 0 && ih <= 64 && ((ih < 16 && 16 % ih == 0) || ih % 16 == 0)) {
        scan_keys(c, r, idx, from, n, q, iw, (int)ih, (int)id, s);
        return;
    }
    const int b16 = (int)c->ik_bf16;
    float kf[id];
    for (int64_t i = 0; i < n; i++) {  /* other shapes one key at a time */
        load_row(row_at(c->ik, slot_of(c, r, idx ? idx[i] : from + i), c->ik_stride, b16), b16, id, kf);
        float sc = 0.0f;
        for (int64_t hd = 0; hd < ih; hd++) {
            const float d = dot(q + hd * id, kf, id);
            sc += iw[hd] * (d > 0.0f ? d : 0.0f);
        }
        s[i] = sc;
    }
}

/* The int8 shadow of the indexer keys (cache.KeyShadow writes it on the torch path). Key slot t: codes c_t =
   round(k_t * 127 / max|k_t|) and scale s_t = max|k_t| / 127, so |k_t - s_t c_t| <= s_t / 2 in every element; blocks of
   16 slots laid out for AVX512-VNNI's 4-byte dot products: byte d of slot t is ik8[(t / 16) * id * 16 + (d / 4) * 64 +
   (t % 16) * 4 + d % 4]. The query is rounded alike, q_h ~ g_h u_h (u_h int8, g_h = max|q_h| / 127), so
   |q_h . k_t - g_h s_t (u_h . c_t)| <= s_t (|q_h|_1 + g_h |c_t|_1) / 2, and relu being 1-Lipschitz, score_t lies within
   s_t (A + B |c_t|_1) of s_t sum_h w_h relu(g_h u_h . c_t), A = sum_h |w_h| |q_h|_1 / 2, B = sum_h |w_h| g_h / 2.
   A long row's scan reads the shadow (id + 4 bytes a key, against 4 id in fp32), keeps every key whose upper bound
   reaches the k-th largest lower bound and scores those exactly: the same keys as scoring every key exactly. */
static void store_key_shadow(const CacheRows *c, int64_t slot, const float *key, int64_t id) {
    float amax = 0.0f;
    for (int64_t d = 0; d < id; d++) amax = fmaxf(amax, fabsf(key[d]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *lane = c->ik8 + (slot / 16) * id * 16 + (slot % 16) * 4;
    for (int64_t d = 0; d < id; d++) lane[(d / 4) * 64 + d % 4] = (int8_t)lrintf(key[d] * inv);
    c->ik8_scale[slot] = amax / 127.0f;
}

typedef struct {  /* a query rounded for the shadow scan: u [IH, ID] int8, off[h] = 128 sum_d u_h[d], g, w, A, B as above */
    const int8_t *u;
    const int32_t *off;
    const float *g, *w;
    float A, B;
} ShadowQuery;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* lo[i], up[i] = the bounds of key i's score (0 <= i < n) from the shadow, 16 keys a step (lanes = keys: no sums across
   lanes), and bmax[i / 16] the largest lo of each 16. vpdpbusd multiplies unsigned by signed bytes: the codes go in as
   c_t + 128 (one xor), the query as u_h, and the 128 sum(u_h) that adds is taken off. -1 when 16 positions are not 16
   adjacent slots from a multiple of 16 (a paged cache of another block size): the caller scores every key. */
static inline __attribute__((always_inline)) int shadow_bounds(const CacheRows *c, int64_t r, int64_t n,
                                                               const ShadowQuery *sq, const int IH, const int ID,
                                                               float *lo, float *up, float *bmax) {
    const int HB = IH < 8 ? IH : 8;  /* heads per pass over a block: their sums stay in registers */
    const __m512i ones = _mm512_set1_epi8(1), bias = _mm512_set1_epi8(-128);
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = n - i < 16 ? n - i : 16, slot = slot_of(c, r, i);
        if (slot % 16 || slot_of(c, r, i + m - 1) != slot + m - 1) return -1;
        const int8_t *blk = c->ik8 + slot * ID;
        __m512i l1 = _mm512_setzero_si512();
        v16 score = {0};
        for (int h0 = 0; h0 < IH; h0 += HB) {
            __m512i acc[HB];
            for (int h = 0; h < HB; h++) acc[h] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int q4 = 0; q4 < ID / 4; q4++) {
                const __m512i codes = _mm512_loadu_si512(blk + q4 * 64), biased = _mm512_xor_si512(codes, bias);
                if (h0 == 0) l1 = _mm512_dpbusd_epi32(l1, ones, _mm512_abs_epi8(codes));
#pragma GCC unroll 8
                for (int h = 0; h < HB; h++) {
                    int32_t u4;
                    memcpy(&u4, sq->u + (h0 + h) * ID + 4 * q4, 4);
                    acc[h] = _mm512_dpbusd_epi32(acc[h], biased, _mm512_set1_epi32(u4));
                }
            }
            for (int h = 0; h < HB; h++) {
                const v16 dot = (v16)_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[h], _mm512_set1_epi32(sq->off[h0 + h])));
                score += sq->w[h0 + h] * relu(dot * sq->g[h0 + h]);
            }
        }
        const v16 sc = load_f32(c->ik8_scale + slot), a = score * sc;
        const v16 b = sc * (sq->A + sq->B * (v16)_mm512_cvtepi32_ps(l1));
        v16 l = a - b, u = a + b;
        memcpy(lo + i, &l, m * sizeof(float));
        memcpy(up + i, &u, m * sizeof(float));
        for (int64_t t = m; t < 16; t++) l[t] = -INFINITY;
        bmax[i / 16] = _mm512_reduce_max_ps((__m512)l);
    }
    return 0;
}
static int shadow_bounds_any(const CacheRows *c, int64_t r, int64_t n, const ShadowQuery *sq, int64_t ih, int64_t id,
                             float *lo, float *up, float *bmax) {
#define BOUNDS(IH, ID) if (ih == IH && id == ID) return shadow_bounds(c, r, n, sq, IH, ID, lo, up, bmax);
    INDEX_SHAPES(BOUNDS)
#undef BOUNDS
    return id % 4 ? -1 : shadow_bounds(c, r, n, sq, (int)ih, (int)id, lo, up, bmax);
}
#else
static int shadow_bounds_any(const CacheRows *c, int64_t r, int64_t n, const ShadowQuery *sq, int64_t ih, int64_t id,
                             float *lo, float *up, float *bmax) {
    (void)c; (void)r; (void)n; (void)sq; (void)ih; (void)id; (void)lo; (void)up; (void)bmax;
    return -1;  /* without VNNI the exact scan is the faster one */
}
#endif

/* The k-th largest of lo[0..n) given bmax[0..nb), the maximum of each block of 16 (nb >= 2k): the k-th largest maximum
   of ~4k groups of blocks, a k-th largest among a subset of lo, bounds it from below; then a selection among the few at
   or above that (2-4x faster than sampling every 8th of 64K bounds). NaN when no k bounds reach it (NaN bounds). bmax
   is reused; work: n floats. */
static float kth_from_block_max(const float *lo, int64_t n, float *bmax, int64_t nb, int64_t k, float *work) {
    const int64_t per = nb / (4 * k) > 1 ? nb / (4 * k) : 1, groups = (nb + per - 1) / per;
    for (int64_t g = 0; g < groups; g++) {
        float mx = bmax[g * per];
        for (int64_t b = g * per + 1; b < (g + 1) * per && b < nb; b++) mx = fmaxf(mx, bmax[b]);
        bmax[g] = mx;
    }
    const int64_t m = at_least(lo, n, kth_largest(bmax, groups, k), work, NULL);
    return m >= k ? kth_largest(work, m, k) : NAN;
}

/* `top_k_slots` for row r's nk keys through the shadow: 0 (out written), 1 (the k-th exact score is tied beyond the
   places left), -1 (no bounds for this row, or a NaN: the caller scores every key). For rows with a head weight > 0
   (with none, every key with no positive dot ties at 0: the caller's business). work: 4 nk floats. */
static int64_t path_count[2];  /* selections made by `shadow_top_slots` and `first_zero_slots` (tests check they ran) */
static int shadow_top_slots(const CacheRows *c, int64_t r, int64_t nk, int64_t k, const float *q, const float *w,
                            int64_t ih, int64_t id, float *work, int64_t *out) {
    int8_t u[ih * id];
    int32_t off[ih];
    float g[ih], A = 0.0f, B = 0.0f;
    for (int64_t h = 0; h < ih; h++) {
        float amax = 0.0f, l1 = 0.0f;
        for (int64_t d = 0; d < id; d++) { amax = fmaxf(amax, fabsf(q[h * id + d])); l1 += fabsf(q[h * id + d]); }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        off[h] = 0;
        for (int64_t d = 0; d < id; d++) {
            u[h * id + d] = (int8_t)lrintf(q[h * id + d] * inv);
            off[h] += 128 * u[h * id + d];
        }
        g[h] = amax / 127.0f;
        A += fabsf(w[h]) * l1;
        B += fabsf(w[h]) * g[h];
    }
    /* the margin covers fp32 rounding in the bounds and in the exact scores */
    const ShadowQuery sq = {u, off, g, w, A * 0.5f * 1.0625f, B * 0.5f * 1.0625f};
    const int64_t nb = (nk + 15) / 16;
    float *lo = work, *up = work + nk, *tmp = work + 2 * nk, *bmax = work + 3 * nk;
    if (shadow_bounds_any(c, r, nk, &sq, ih, id, lo, up, bmax) < 0) return -1;
    const float floor_k = kth_from_block_max(lo, nk, bmax, nb, k, tmp);  /* at least k keys score >= this */
    if (floor_k != floor_k) return -1;
    int32_t *at = (int32_t *)lo;
    const int64_t m = at_least(up, nk, floor_k, tmp, at);
    /* a NaN, or bounds too wide to pay: rescoring a chosen key costs ~2.5x one of the full scan's */
    if (m < k || m > nk / 3) return -1;
    float *exact = up;
    index_scores(c, r, at, 0, m, q, w, ih, id, exact);
    /* every key tied at the k-th score is a candidate; tmp has room for 2m (m <= nk / 3) */
    if (top_k_slots(exact, at, m, k, out, tmp, tmp + m)) return 1;
    __atomic_fetch_add(&path_count[0], 1, __ATOMIC_RELAXED);
    return 0;
}
int64_t path_selections(int64_t path) {  /* KERNEL_BAD_ARGS for a path other than 0 or 1 */
    return path == 0 || path == 1 ? __atomic_load_n(&path_count[path], __ATOMIC_RELAXED) : KERNEL_BAD_ARGS;
}

/* A row whose index head weights are all <= 0 scores every key <= 0 (a random-weight indexer: 1 row in 16 with 4
   heads), and when at least k keys score exactly 0, their maximum, torch.topk over n >= 64 k scores (a partial sort:
   a heap of the first k that admits only a strictly greater score) keeps the first k of them in key order. So does
   this, scoring keys in order until it has k (~16 k keys, not nk; the caller's torch.topk tie-break was ~0.3 ms at
   64K keys). Returns 0 (out written), or -1 with every key's score in s (fewer than k zeros). */
static int first_zero_slots(const CacheRows *c, int64_t r, int64_t nk, int64_t k, const float *q, const float *w,
                            int64_t ih, int64_t id, float *s, int64_t *out) {
    const int64_t chunk = 1024;
    int64_t found = 0;
    for (int64_t i = 0; i < nk && found < k; i += chunk) {
        const int64_t m = nk - i < chunk ? nk - i : chunk;
        index_scores(c, r, NULL, i, m, q, w, ih, id, s + i);
        for (int64_t j = 0; j < m && found < k; j++) if (s[i + j] == 0.0f) out[found++] = i + j;
    }
    if (found < k) return -1;
    __atomic_fetch_add(&path_count[1], 1, __ATOMIC_RELAXED);
    return 0;
}
static int nonpositive(const float *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) if (!(w[i] <= 0.0f)) return 0;
    return 1;
}
/* The layer parameters mla_decode_select / mla_decode_attend take for n rows: sizes within MAX_ROWS / STEP_MAX_WIDTH
   (their stack buffers), an even rope width within the indexer's, and every weight of the shape the sizes imply. */
static int mla_ok(const MlaLayer *L, const CacheRows *c, int64_t n) {
    const int64_t H = L->heads, ih = L->idx_heads, id = L->idx_dim, own = L->own_indexer;
    if (n < 1 || n > MAX_ROWS || L->hidden > STEP_MAX_WIDTH || L->rank > STEP_MAX_WIDTH || L->q_lora > STEP_MAX_WIDTH
        || H < 1 || L->nope < 0 || L->v_dim < 1 || L->rope < 0 || L->rope % 2 || (own && !c->ik))
        return 0;
    if (own && (ih < 1 || id < L->rope || ih * id > STEP_MAX_WIDTH || !L->ln_w || !L->ln_b)) return 0;
    const int64_t in_rows = L->q_lora + L->rank + L->rope + (own ? id + (L->w_iw.w ? 0 : ih) : 0);
    const int64_t q_rows = H * (L->nope + L->rope) + (own ? ih * id : 0);
    for (int64_t r = 0; r < n; r++) if (c->row_keys[r] < 1) return 0;
    return mat_ok(&L->w_in, n, in_rows, L->hidden) && mat_ok(&L->w_q, n, q_rows, L->q_lora)
        && mat_ok(&L->w_uk, n, L->rank, L->nope) && mat_ok(&L->w_uv, n, L->v_dim, L->rank)
        && mat_ok(&L->w_o, n, L->hidden, H * L->v_dim) && (!L->w_iw.w || mat_ok(&L->w_iw, n, ih, L->hidden))
        && L->n_in && L->n_q && L->n_kv && L->n_post && c->kv && c->pe && c->row_base && c->row_keys && c->write;
}

/* Phase one (n <= MAX_ROWS rows). h [n, hidden] in the model dtype; rot [n, rope/2] complex; state [n, heads,
   rank + rope] receives the absorbed, roped queries. The new kv / k_pe / indexer key of each row go to its write
   slot. With an own indexer: slots [n, topk] its selection (ascending, -1 pads) and, for a row whose k-th score is
   tied, tied[r] = 1 and its index scores in scores [n, score_stride]. Returns the number of tied rows,
   KERNEL_BAD_ARGS (nothing written: see mla_ok, and score_stride below a row's key count), or KERNEL_NO_MEMORY. */
int64_t mla_decode_select(const MlaLayer *L, const CacheRows *c, int64_t n, const void *h, const float *rot,
                          float *state, int64_t *slots, float *scores, int64_t score_stride, uint8_t *tied) {
    if (!mla_ok(L, c, n) || (L->own_indexer && (!slots || !scores || !tied))) return KERNEL_BAD_ARGS;
    for (int64_t r = 0; r < n && L->own_indexer; r++) if (c->row_keys[r] > score_stride) return KERNEL_BAD_ARGS;
    const int b16 = (int)L->act_bf16, vb = (int)L->vec_bf16;
    const int64_t H = L->heads, qk = L->nope + L->rope, dq = L->rank + L->rope, ih = L->idx_heads, id = L->idx_dim;
    const int64_t D = L->hidden, n_in = L->w_in.rows, n_q = L->w_q.rows, P = L->rope / 2;
    const int64_t kv_at = L->q_lora, pe_at = kv_at + L->rank, ik_at = pe_at + L->rope;
    float *buf = malloc(sizeof(float) * n * (2 * D + n_in + L->q_lora + n_q + ih * id + ih + H * L->rank + id));
    if (!buf) return KERNEL_NO_MEMORY;
    float *hf = buf, *x = hf + n * D, *y = x + n * D, *qr = y + n * n_in, *z = qr + n * L->q_lora;
    float *iq = z + n * n_q, *iw = iq + n * ih * id, *lat = iw + n * ih, *key = lat + n * H * L->rank;
    for (int64_t r = 0; r < n; r++) {
        load_row(row_at((void *)h, r, D, b16), b16, D, hf + r * D);
        rmsnorm(hf + r * D, D, L->n_in, vb, L->eps, x + r * D);
    }
    if (mat_rows(&L->w_in, 0, x, D, n, y, n_in)) goto no_memory;
    round_to_act_dtype(y, n * n_in, b16);
    for (int64_t r = 0; r < n; r++) {
        float *yr = y + r * n_in;
        rmsnorm(yr, L->q_lora, L->n_q, vb, L->eps_q, qr + r * L->q_lora);
        float kvn[L->rank];
        rmsnorm(yr + kv_at, L->rank, L->n_kv, vb, L->eps_kv, kvn);
        store_row(kvn, (int)c->kv_bf16, L->rank, row_at(c->kv, c->write[r], c->kv_stride, (int)c->kv_bf16));
        rope_pairs(yr + pe_at, rot + r * L->rope, P, b16);
        store_row(yr + pe_at, (int)c->kv_bf16, L->rope, row_at(c->pe, c->write[r], c->pe_stride, (int)c->kv_bf16));
    }
    if (mat_rows(&L->w_q, 0, qr, L->q_lora, n, z, n_q)) goto no_memory;
    round_to_act_dtype(z, n * n_q, b16);
    for (int64_t hd = 0; hd < H; hd++)  /* absorb W_uk: one pass over each head's weight for all rows */
        if (mat_rows(&L->w_uk, hd, z + hd * qk, n_q, n, lat + hd * L->rank, H * L->rank)) goto no_memory;
    round_to_act_dtype(lat, n * H * L->rank, b16);
    for (int64_t r = 0; r < n; r++)
        for (int64_t hd = 0; hd < H; hd++) {
            float *st = state + (r * H + hd) * dq;
            memcpy(st, lat + (r * H + hd) * L->rank, L->rank * sizeof(float));
            memcpy(st + L->rank, z + r * n_q + hd * qk + L->nope, L->rope * sizeof(float));
            rope_pairs(st + L->rank, rot + r * L->rope, P, b16);
        }
    if (!L->own_indexer) { free(buf); return 0; }
    if (L->w_iw.w && mat_rows(&L->w_iw, 0, x, D, n, iw, ih)) goto no_memory;
    for (int64_t r = 0; r < n; r++) {
        float *k = y + r * n_in + ik_at;
        layernorm(k, id, L->ln_w, L->ln_b, vb, L->eps_idx, key);
        rope_pairs(key, rot + r * L->rope, P, b16);
        store_row(key, (int)c->ik_bf16, id, row_at(c->ik, c->write[r], c->ik_stride, (int)c->ik_bf16));
        if (c->ik8) store_key_shadow(c, c->write[r], key, id);
        for (int64_t hd = 0; hd < ih; hd++) {
            float *q = iq + (r * ih + hd) * id;
            memcpy(q, z + r * n_q + H * qk + hd * id, id * sizeof(float));
            rope_pairs(q, rot + r * L->rope, P, b16);
            const float w = L->w_iw.w ? iw[r * ih + hd] : k[id + hd];  /* fused: after the key's rows */
            iw[r * ih + hd] = w * L->idx_weight_scale;
        }
    }
    int64_t n_tied = 0;
    for (int64_t r = 0; r < n; r++) {  /* scored after every new key is in the cache */
        const int64_t nk = c->row_keys[r];
        int64_t *out = slots + r * L->topk;
        tied[r] = 0;
        for (int64_t j = 0; j < L->topk; j++) out[j] = j < nk ? j : -1;
        if (nk <= L->topk) continue;
        float *s = scores + r * score_stride, *work = malloc(sizeof(float) * 4 * nk);
        const float *q = iq + r * ih * id, *w = iw + r * ih;
        if (!work) goto no_memory;
        int res;  /* 0: out written; 1: tied (every score in s, for the caller's tie-break); -1: every score in s */
        const int no_positive_weight = nonpositive(w, ih);
        if (no_positive_weight && nk >= 64 * L->topk) {
            res = first_zero_slots(c, r, nk, L->topk, q, w, ih, id, s, out);
        } else {
            res = c->ik8 && nk >= 32 * L->topk && !no_positive_weight
                ? shadow_top_slots(c, r, nk, L->topk, q, w, ih, id, work, out) : -1;
            if (res != 0) index_scores(c, r, NULL, 0, nk, q, w, ih, id, s);
        }
        if (res < 0) res = top_k_slots(s, NULL, nk, L->topk, out, work, work + nk);
        if (res) { tied[r] = 1; n_tied++; }
        free(work);
    }
    free(buf);
    return n_tied;
no_memory:
    free(buf);
    return KERNEL_NO_MEMORY;
}

/* Phase two: each row attends over its selected keys (slots [n, n_slots], -1 unused; NULL: every key it sees), then
   W_uv and o_proj; h (in place, model dtype) += o_proj(o); x [n, hidden] fp32 = the post-attention norm of h.
   Returns 0, KERNEL_BAD_ARGS (nothing written: see mla_ok, and a slot past its row's keys) or KERNEL_NO_MEMORY. */
int mla_decode_attend(const MlaLayer *L, const CacheRows *c, int64_t n, void *h, const float *state,
                      const int64_t *slots, int64_t n_slots, float *x) {
    if (!mla_ok(L, c, n) || n_slots < 0) return KERNEL_BAD_ARGS;
    for (int64_t r = 0; r < n && slots; r++)
        for (int64_t j = 0; j < n_slots; j++) if (slots[r * n_slots + j] >= c->row_keys[r]) return KERNEL_BAD_ARGS;
    const int b16 = (int)L->act_bf16;
    const int64_t H = L->heads, dq = L->rank + L->rope, D = L->hidden, R = L->rank;
    int64_t most = n_slots;
    for (int64_t r = 0; r < n && !slots; r++) most = c->row_keys[r] > most ? c->row_keys[r] : most;
    float *buf = malloc(sizeof(float) * (H * most + n * H * R + n * H * L->v_dim + n * D + dq + 16));
    if (!buf) return KERNEL_NO_MEMORY;
    float *sc = buf, *ol = sc + H * most, *ov = ol + n * H * R, *a = ov + n * H * L->v_dim, *key = a + n * D;
    memset(ol, 0, sizeof(float) * n * H * R);
    for (int64_t r = 0; r < n; r++) {
        const float *q = state + r * H * dq;
        const int64_t nk = slots ? n_slots : c->row_keys[r];
        int64_t used = 0;
        for (int64_t j = 0; j < nk; j++) {  /* scores, key-major: each key row is read once for all heads */
            const int64_t i = slots ? slots[r * n_slots + j] : j;
            if (i < 0) continue;
            const int64_t s = slot_of(c, r, i);
            load_row(row_at(c->kv, s, c->kv_stride, (int)c->kv_bf16), (int)c->kv_bf16, R, key);
            load_row(row_at(c->pe, s, c->pe_stride, (int)c->kv_bf16), (int)c->kv_bf16, L->rope, key + R);
            for (int64_t hd = 0; hd < H; hd++) sc[hd * most + used] = dot(q + hd * dq, key, dq) * L->scale;
            used++;
        }
        for (int64_t hd = 0; hd < H; hd++) {  /* softmax in fp32, probabilities rounded as the torch path's */
            float *p = sc + hd * most, m = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < used; j++) m = p[j] > m ? p[j] : m;
            for (int64_t j = 0; j < used; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
            for (int64_t j = 0; j < used; j++) p[j] = in_act_dtype(p[j] / sum, b16);
        }
        for (int64_t j = 0, u = 0; j < nk; j++) {  /* o_lat[h] = sum_j p[h, j] kv_j */
            const int64_t i = slots ? slots[r * n_slots + j] : j;
            if (i < 0) continue;
            load_row(row_at(c->kv, slot_of(c, r, i), c->kv_stride, (int)c->kv_bf16), (int)c->kv_bf16, R, key);
            for (int64_t hd = 0; hd < H; hd++) {
                const float p = sc[hd * most + u];
                float *o = ol + (r * H + hd) * R;
                for (int64_t t = 0; t < R; t++) o[t] += p * key[t];
            }
            u++;
        }
    }
    round_to_act_dtype(ol, n * H * R, b16);
    for (int64_t hd = 0; hd < H; hd++)  /* un-absorb W_uv, one pass over each head's weight for all rows */
        if (mat_rows(&L->w_uv, hd, ol + hd * R, H * R, n, ov + hd * L->v_dim, H * L->v_dim)) goto no_memory;
    round_to_act_dtype(ov, n * H * L->v_dim, b16);
    if (mat_rows(&L->w_o, 0, ov, H * L->v_dim, n, a, D)) goto no_memory;
    for (int64_t r = 0; r < n; r++) {
        void *hr = row_at(h, r, D, b16);
        float *hf = x + r * D;  /* the new residual, then normed in place through a copy */
        float res[D];
        load_row(hr, b16, D, res);
        for (int64_t t = 0; t < D; t++) res[t] = in_act_dtype(res[t] + in_act_dtype(a[r * D + t], b16), b16);
        store_row(res, b16, D, hr);
        rmsnorm(res, D, L->n_post, (int)L->vec_bf16, L->eps, hf);
    }
    free(buf);
    return 0;
no_memory:
    free(buf);
    return KERNEL_NO_MEMORY;
}

typedef struct {
    int64_t hidden, n_experts, top_k, n_group, topk_group, inter, norm_topk, softmax_router, act_bf16, wtype, group;
    float scaling;
    Mat router;  /* [n_experts, hidden]; router.w NULL: a dense MLP layer (only `shared` below) */
    const float *bias;  /* e_score_correction_bias [n_experts], fp32 */
    const void *gate_up, *down;  /* routed experts [E, 2 * inter, hidden], [E, hidden, inter] of wtype */
    const void *gu_scale, *down_scale;  /* their int8 row scales or int4 group scales (`group` columns), else NULL */
    Mat s_gu, s_down;  /* shared experts or the dense MLP: [2 * I, hidden], [hidden, I]; s_gu.w NULL: none */
} FfnLayer;

/* The experts a router picks for one row: chosen[top_k] experts, gates[top_k] weights (router.py's Router). */
static void route(const FfnLayer *F, const float *logits, int64_t *chosen, float *gates) {
    const int64_t E = F->n_experts, k = F->top_k;
    float s[E], pick[E];
    if (F->softmax_router) {
        float m = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
        for (int64_t e = 0; e < E; e++) { s[e] = expf(logits[e] - m); sum += s[e]; }
        for (int64_t e = 0; e < E; e++) pick[e] = s[e] /= sum;
    } else {
        for (int64_t e = 0; e < E; e++) { s[e] = 1.0f / (1.0f + expf(-logits[e])); pick[e] = s[e] + F->bias[e]; }
        if (F->n_group > 1) {  /* keep the topk_group groups whose two best scores sum highest */
            const int64_t G = F->n_group, per = E / G;
            float best[G];
            for (int64_t g = 0; g < G; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int64_t e = g * per; e < (g + 1) * per; e++) {
                    if (pick[e] > a) { b = a; a = pick[e]; } else if (pick[e] > b) b = pick[e];
                }
                best[g] = a + b;
            }
            for (int64_t t = 0; t < G - F->topk_group; t++) {  /* drop the worst groups */
                int64_t worst = -1;
                for (int64_t g = 0; g < G; g++) if (best[g] != INFINITY && (worst < 0 || best[g] < best[worst])) worst = g;
                best[worst] = INFINITY;
                for (int64_t e = worst * per; e < (worst + 1) * per; e++) pick[e] = -INFINITY;
            }
        }
    }
    float total = 0.0f;
    for (int64_t t = 0; t < k; t++) {  /* k argmaxes: k <= 8 of at most a few hundred experts */
        int64_t b = -1;
        for (int64_t e = 0; e < E; e++) if (pick[e] != -INFINITY - 0.0f * e && (b < 0 || pick[e] > pick[b])) b = e;
        chosen[t] = b;
        gates[t] = s[b];
        pick[b] = -INFINITY;
        total += s[b];
    }
    for (int64_t t = 0; t < k; t++) gates[t] = (F->norm_topk ? gates[t] / (total + 1e-20f) : gates[t]) * F->scaling;
}

/* The FFN parameters ffn_decode takes for n rows: sizes within MAX_ROWS / STEP_MAX_WIDTH (its stack buffers), the
   router's groups as router.py's (E a multiple of n_group, >= 2 experts a group, top_k within the kept groups), and
   every weight of the shape the sizes imply. */
static int ffn_ok(const FfnLayer *F, int64_t n) {
    const int64_t D = F->hidden, E = F->n_experts, G = F->n_group;
    if (n < 1 || n > MAX_ROWS || D < 16 || D > STEP_MAX_WIDTH || (!F->router.w && !F->s_gu.w)) return 0;
    if (F->router.w) {
        if (E < 1 || E > STEP_MAX_WIDTH || F->top_k < 1 || F->top_k > E || G < 1 || E % G || F->topk_group < 1
            || F->topk_group > G || (G > 1 && (E / G < 2 || F->top_k > E / G * F->topk_group)))
            return 0;
        if (!mat_ok(&F->router, n, E, D) || !F->gate_up || !F->down || (!F->softmax_router && !F->bias)
            || !rows_ok(n, 2 * F->inter, D, (int)F->wtype, F->gu_scale, F->group)
            || !rows_ok(n, D, F->inter, (int)F->wtype, F->down_scale, F->group))
            return 0;
    }
    return !F->s_gu.w || (mat_ok(&F->s_down, n, D, F->s_down.cols) && mat_ok(&F->s_gu, n, 2 * F->s_down.cols, D));
}

/* The SwiGLU of one weight set over rows xs [n, hidden] (n <= MAX_ROWS) into ys [n, hidden], rounded as the torch
   path's output (its activation stays fp32, as experts_swiglu's). Returns 0 or KERNEL_NO_MEMORY (as mat_rows). */
static int swiglu_rows(const Mat *gu, const Mat *dn, const float *xs, int64_t n, float *work, float *ys, int bf16) {
    const int64_t I = dn->cols;
    if (mat_rows(gu, 0, xs, gu->cols, n, work, gu->rows)) return KERNEL_NO_MEMORY;
    float *a = work + n * 2 * I;
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < I; i++) {
            const float g = work[r * 2 * I + i], u = work[r * 2 * I + I + i];
            a[r * I + i] = g / (1.0f + expf(-g)) * u;
        }
    if (mat_rows(dn, 0, a, I, n, ys, dn->rows)) return KERNEL_NO_MEMORY;
    round_to_act_dtype(ys, n * dn->rows, bf16);
    return 0;
}

/* The MLP half of a decoder layer for n <= MAX_ROWS rows: x [n, hidden] fp32 (the post-attention norm), h [n,
   hidden] in the model dtype, updated in place: h += routed experts (router, top-k, gates) + shared experts, or
   h += the dense MLP. Returns 0, KERNEL_BAD_ARGS (nothing written: see ffn_ok) or KERNEL_NO_MEMORY. */
int ffn_decode(const FfnLayer *F, int64_t n, void *h, const float *x) {
    if (!ffn_ok(F, n)) return KERNEL_BAD_ARGS;
    const int b16 = (int)F->act_bf16;
    const int64_t D = F->hidden, E = F->n_experts, k = F->top_k;
    const int64_t I = F->inter > F->s_down.cols ? F->inter : F->s_down.cols;
    float *buf = malloc(sizeof(float) * (2 * n * D + MAX_ROWS * (D + 3 * I + D) + n * (E + 2 * k) + 1));
    if (!buf) return KERNEL_NO_MEMORY;
    float *out = buf, *shared = out + n * D, *xs = shared + n * D, *work = xs + MAX_ROWS * D;
    float *ys = work + MAX_ROWS * 3 * I, *logits = ys + MAX_ROWS * D, *gates = logits + n * E;
    int64_t chosen[n * k + 1];
    memset(out, 0, sizeof(float) * n * D);
    if (F->router.w) {
        if (mat_rows(&F->router, 0, x, D, n, logits, E)) goto no_memory;
        for (int64_t r = 0; r < n; r++) route(F, logits + r * E, chosen + r * k, gates + r * k);
        for (int64_t e = 0; e < E; e++) {  /* each hit expert once, over all its rows */
            int64_t rows[MAX_ROWS * 8], slot[MAX_ROWS * 8], m = 0;
            for (int64_t r = 0; r < n; r++)
                for (int64_t t = 0; t < k; t++)
                    if (chosen[r * k + t] == e) {
                        rows[m] = r; slot[m] = r * k + t;
                        memcpy(xs + m * D, x + r * D, D * sizeof(float));
                        m++;
                    }
            if (!m) continue;
            const int wt = (int)F->wtype;
            const Mat gu = {(const char *)F->gate_up + w_bytes(wt, e * 2 * F->inter * D),
                            scale_at(F->gu_scale, wt, e * 2 * F->inter, D, F->group), F->wtype, 2 * F->inter, D, 0, 0,
                            F->group};
            const Mat dn = {(const char *)F->down + w_bytes(wt, e * D * F->inter),
                            scale_at(F->down_scale, wt, e * D, F->inter, F->group), F->wtype, D, F->inter, 0, 0, F->group};
            if (swiglu_rows(&gu, &dn, xs, m, work, ys, b16)) goto no_memory;
            for (int64_t j = 0; j < m; j++)
                for (int64_t t = 0; t < D; t++) out[rows[j] * D + t] += gates[slot[j]] * ys[j * D + t];
        }
        round_to_act_dtype(out, n * D, b16);
    }
    if (F->s_gu.w) {
        if (swiglu_rows(&F->s_gu, &F->s_down, x, n, work, shared, b16)) goto no_memory;
        for (int64_t i = 0; i < n * D; i++) out[i] = in_act_dtype(out[i] + shared[i], b16);
    }
    for (int64_t r = 0; r < n; r++) {
        void *hr = row_at(h, r, D, b16);
        float res[D];
        load_row(hr, b16, D, res);
        for (int64_t t = 0; t < D; t++) res[t] = in_act_dtype(res[t] + out[r * D + t], b16);
        store_row(res, b16, D, hr);
    }
    free(buf);
    return 0;
no_memory:
    free(buf);
    return KERNEL_NO_MEMORY;
}

/* y [rows, m] = x [rows, k] (bf16, rows xs apart) times the int4 weight w [m, k] (group scales, groups of `group`)
   transposed, for any number of rows (a prefill's products; a decode step's go through rows_linear): y bf16 (rounded
   as torch rounds) when y_bf16, else fp32, rows ys apart. Returns 0, KERNEL_BAD_ARGS (nothing written: sizes, strides
   or group not ones it takes) or KERNEL_NO_MEMORY. */
int i4_matmul(const uint16_t *x, int64_t rows, int64_t xs, const uint8_t *w, const uint16_t *scale, int64_t group,
              int64_t m, int64_t k, void *y, int y_bf16, int64_t ys) {
    if (rows < 1 || m < 1 || !i4_group_ok(k, group) || xs < k || ys < m || !x || !w || !scale || !y)
        return KERNEL_BAD_ARGS;
    const int threads = w_bytes(W_I4, m * k) * rows >= PARALLEL_BYTES && !omp_in_parallel() ? kernel_threads : 1;
    return i4_matmul_blocks(x, rows, xs, w, scale, group, m, k, y, y_bf16, ys, threads);
}

/* The thread count the weight kernels split their larger products over (native.py passes torch's); returns it, or
   KERNEL_BAD_ARGS for a count below 1. */
int64_t set_kernel_threads(int64_t threads) {
    if (threads < 1) return KERNEL_BAD_ARGS;
    kernel_threads = threads > 256 ? 256 : (int)threads;
    return kernel_threads;
}
