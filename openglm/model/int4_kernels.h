/* openglm: int4 weight kernels, included by decode_kernels.c. The weight layout is quantized.py's: per row, blocks of 64
   codes in 32 bytes (byte j: code j in the low nibble, code 32 + j in the high one), a last block of 32 codes in 16
   bytes when the width is an odd multiple of 32 (byte j: codes j and 16 + j); code c stands for c - 8; one bf16 scale
   per `group` (32, 64 or 128) consecutive columns, [rows, k / group]. Every kernel reads the packed codes in place.

   - i4_rows (decode, a few x rows): widening a block to bf16 is one zero-extension, a mask and a shift, then a
     16-entry table lookup (vpermw) per 32 codes gives bf16(c - 8) exactly; vdpbf16ps multiplies it into the x rows
     (split into bf16 hi + lo parts unless they are bf16 already, as rows_times_bf16) and each group's fp32 sum is
     scaled once: sum_g s_g sum_i (c_i - 8) x_i, exact products, fp32 sums.
   - i4_matmul (prefill, any rows): four weight rows at a time are dequantised once to bf16 (the same bf16((c - 8) * s)
     as the torch path's dequantised weight) into a buffer that stays in L1, then multiplied into the x rows four at a
     time: 16 sums in registers, each loaded vector used four times. */

enum { I4_BLOCK = 64 };

static inline int i4_group_ok(int64_t k, int64_t group) {
    return (group == 32 || group == 64 || group == 128) && k >= 32 && k % 32 == 0 && k % group == 0;
}

/* code c of a packed row (portable path and tests of the layout) */
static inline int i4_code(const uint8_t *row, int64_t k, int64_t i) {
    const int64_t full = k / I4_BLOCK * I4_BLOCK;
    const int64_t b = i < full ? I4_BLOCK : 32, start = i < full ? i / I4_BLOCK * I4_BLOCK : full;
    const int64_t j = i - start, byte = start / 2 + (j < b / 2 ? j : j - b / 2);
    return j < b / 2 ? row[byte] & 15 : row[byte] >> 4;
}

/* portable: y[r * ldy + j] = sum_i x[r, i] (c_ji - 8) s_j,g(i), r < n */
static void i4_rows_portable(const float *x, int64_t n, const uint8_t *w, const uint16_t *scale, int64_t group,
                             int64_t m, int64_t k, float *y, int64_t ldy) {
    const int64_t ng = k / group;
    for (int64_t j = 0; j < m; j++) {
        const uint8_t *wr = w + j * (k / 2);
        for (int64_t r = 0; r < n; r++) {
            float total = 0.0f;
            for (int64_t g = 0; g < ng; g++) {
                float part = 0.0f;
                for (int64_t i = g * group; i < (g + 1) * group; i++) part += x[r * k + i] * (float)(i4_code(wr, k, i) - 8);
                total += part * widen_bf16(scale[j * ng + g]);
            }
            y[r * ldy + j] = total;
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static const uint16_t I4_BF16[32] = {0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
                                     0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};  /* bf16(c - 8) */

/* the 32 codes of block half h (0: low nibbles, 1: high) of the 64-block at p, as bf16(c - 8) */
static inline __attribute__((always_inline)) void i4_widen64(const uint8_t *p, __m512i lut, __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    *lo = _mm512_permutexvar_epi16(_mm512_and_si512(v, _mm512_set1_epi16(15)), lut);
    *hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
}
/* the 32 codes of a last 32-block (16 bytes) in order, as bf16(c - 8) */
static inline __attribute__((always_inline)) __m512i i4_widen32(const uint8_t *p, __m512i lut) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, _mm256_set1_epi16(15))),
                                         _mm256_srli_epi16(v, 4), 1);
    return _mm512_permutexvar_epi16(c, lut);
}

/* N bf16 x rows (xp: N rows of k / 32 vectors) times the int4 rows w [m, k] -> y[r * ldy + j]; G the group size, both
   compile-time constants in each copy (sums in registers). sf: room for k / 32 floats. */
static inline __attribute__((always_inline)) void i4_rows(const __m512i *xp, const int N, const uint8_t *w,
                                                          const uint16_t *scale, const int G, int64_t m, int64_t k,
                                                          float *y, int64_t ldy, float *sf) {
    const __m512i lut = _mm512_loadu_si512(I4_BF16);
    const int64_t steps = k / 32, blocks = k / I4_BLOCK, ng = k / G;
    const int T = N <= 8 ? 2 : 1;  /* two sum chains per row while registers allow */
    for (int64_t j = 0; j < m; j++) {
        const uint8_t *wr = w + j * (k / 2);
        const uint16_t *sr = scale + j * ng;
        for (int64_t g = 0; g < ng; g++) sf[g] = widen_bf16(sr[g]);
        __m512 t[16][2];
        for (int r = 0; r < N; r++) { t[r][0] = _mm512_setzero_ps(); t[r][1] = _mm512_setzero_ps(); }
        for (int64_t b = 0; b < blocks; b += G == 128 ? 2 : 1) {
            __m512i lo, hi, lo2 = _mm512_setzero_si512(), hi2 = _mm512_setzero_si512();
            i4_widen64(wr + 32 * b, lut, &lo, &hi);
            if (G == 128) i4_widen64(wr + 32 * b + 32, lut, &lo2, &hi2);
            for (int r = 0; r < N; r++) {
                const __m512i *xr = xp + r * steps + 2 * b;
                if (G == 32) {
                    const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xr));
                    const __m512 c = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xr + 1));
                    t[r][0] = _mm512_fmadd_ps(a, _mm512_set1_ps(sf[2 * b]), t[r][0]);
                    t[r][T - 1] = _mm512_fmadd_ps(c, _mm512_set1_ps(sf[2 * b + 1]), t[r][T - 1]);
                } else {
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xr));
                    a = _mm512_dpbf16_ps(a, (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xr + 1));
                    if (G == 128) {
                        a = _mm512_dpbf16_ps(a, (__m512bh)lo2, (__m512bh)_mm512_loadu_si512(xr + 2));
                        a = _mm512_dpbf16_ps(a, (__m512bh)hi2, (__m512bh)_mm512_loadu_si512(xr + 3));
                    }
                    const int c = T == 2 ? (int)((b / (G / I4_BLOCK)) & 1) : 0;
                    t[r][c] = _mm512_fmadd_ps(a, _mm512_set1_ps(sf[b * I4_BLOCK / G]), t[r][c]);
                }
            }
        }
        if (k % I4_BLOCK) {  /* the last 32 codes (G is 32 here: it divides k) */
            const __m512i wv = i4_widen32(wr + 32 * blocks, lut);
            for (int r = 0; r < N; r++) {
                const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wv,
                                                  (__m512bh)_mm512_loadu_si512(xp + r * steps + 2 * blocks));
                t[r][0] = _mm512_fmadd_ps(a, _mm512_set1_ps(sf[ng - 1]), t[r][0]);
            }
        }
        for (int r = 0; r < N; r++) y[r * ldy + j] = _mm512_reduce_add_ps(T == 2 ? _mm512_add_ps(t[r][0], t[r][1]) : t[r][0]);
    }
}
#define I4_CASE(N, G) case N * 1000 + G: i4_rows(xp, N, w, scale, G, m, k, y, ldy, sf); return 1;
#define I4_CASES(N) I4_CASE(N, 32) I4_CASE(N, 64) I4_CASE(N, 128)
static int i4_rows_any(const __m512i *xp, int64_t rows, const uint8_t *w, const uint16_t *scale, int64_t group,
                       int64_t m, int64_t k, float *y, int64_t ldy, float *sf) {
    switch (rows * 1000 + group) {
        I4_CASES(1) I4_CASES(2) I4_CASES(3) I4_CASES(4) I4_CASES(5) I4_CASES(6) I4_CASES(7) I4_CASES(8)
        I4_CASES(10) I4_CASES(12) I4_CASES(14) I4_CASES(16)
    }
    return 0;
}

/* x [n, k] fp32 (n <= MAX_ROWS) times the int4 weight [m, k] -> y[r * ldy + j]. Returns 0 when it cannot run (no
   memory for the bf16 parts): the caller takes the portable path. */
static int rows_times_i4_simd(const float *x, int64_t n, const uint8_t *w, const uint16_t *scale, int64_t group,
                              int64_t m, int64_t k, float *y, int64_t ldy) {
    uint16_t *parts = malloc(sizeof(uint16_t) * 2 * n * k + sizeof(float) * (k / 32 + 2 * n * m));
    if (!parts) return 0;
    const int need_lo = split_bf16(x, n * k, parts);
    float *sf = (float *)(parts + 2 * n * k), *ys = sf + k / 32;
    int done;
    if (!need_lo) done = i4_rows_any((const __m512i *)parts, n, w, scale, group, m, k, y, ldy, sf);
    else {  /* the lo parts as rows of their own, summed after */
        done = i4_rows_any((const __m512i *)parts, 2 * n, w, scale, group, m, k, ys, m, sf);
        for (int64_t r = 0; done && r < n; r++)
            for (int64_t j = 0; j < m; j++) y[r * ldy + j] = ys[r * m + j] + ys[(n + r) * m + j];
    }
    free(parts);
    return done;
}
#else
static int rows_times_i4_simd(const float *x, int64_t n, const uint8_t *w, const uint16_t *scale, int64_t group,
                              int64_t m, int64_t k, float *y, int64_t ldy) {
    (void)x; (void)n; (void)w; (void)scale; (void)group; (void)m; (void)k; (void)y; (void)ldy;
    return 0;
}
#endif

static void rows_times_i4(const float *x, int64_t n, const uint8_t *w, const uint16_t *scale, int64_t group,
                          int64_t m, int64_t k, float *y, int64_t ldy) {
    if (!rows_times_i4_simd(x, n, w, scale, group, m, k, y, ldy)) i4_rows_portable(x, n, w, scale, group, m, k, y, ldy);
}

/* ---- many rows: dequantise four weight rows to bf16 once, multiply them into every x row ---- */

/* row j of the int4 weight as bf16((c - 8) * s), rounded to nearest even as torch's .to(torch.bfloat16) */
static void i4_dequant_row(const uint8_t *wr, const uint16_t *sr, int64_t group, int64_t k, uint16_t *out) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i low = _mm512_set1_epi32(15);
    int64_t i = 0;
    for (; i + I4_BLOCK <= k; i += I4_BLOCK) {  /* bytes 0-15: codes 0-15 and 32-47; bytes 16-31: 16-31 and 48-63 */
        const uint8_t *p = wr + i / 2;
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        const __m512 s0 = _mm512_set1_ps(widen_bf16(sr[i / group])), s1 = _mm512_set1_ps(widen_bf16(sr[(i + 32) / group]));
        const __m512 f0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(a, low), lut), s0);
        const __m512 f1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low), lut), s0);
        const __m512 f2 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), lut), s1);
        const __m512 f3 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), s1);
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
        _mm512_storeu_si512(out + i + 32, (__m512i)_mm512_cvtne2ps_pbh(f3, f2));
    }
    if (i < k) {  /* the last 32 codes: byte j holds codes j and 16 + j */
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wr + i / 2)));
        const __m512 s = _mm512_set1_ps(widen_bf16(sr[i / group]));
        const __m512 f0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(a, low), lut), s);
        const __m512 f1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), lut), s);
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
#else
    for (int64_t i = 0; i < k; i++) out[i] = round_bf16((float)(i4_code(wr, k, i) - 8) * widen_bf16(sr[i / group]));
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* y rows [R, 4] (R <= 4 x rows, 4 bf16 weight rows wb [4, k]): 16 sums, summed across lanes by one pairsum tree */
static inline __attribute__((always_inline)) void i4_tile(const uint16_t *x, int64_t xs, const int R, const uint16_t *wb,
                                                          int64_t k, float *out /* [R][4] */) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + d), w1 = (__m512bh)_mm512_loadu_si512(wb + k + d);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wb + 2 * k + d), w3 = (__m512bh)_mm512_loadu_si512(wb + 3 * k + d);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * xs + d);
            acc[4 * r] = _mm512_dpbf16_ps(acc[4 * r], w0, xv);
            acc[4 * r + 1] = _mm512_dpbf16_ps(acc[4 * r + 1], w1, xv);
            acc[4 * r + 2] = _mm512_dpbf16_ps(acc[4 * r + 2], w2, xv);
            acc[4 * r + 3] = _mm512_dpbf16_ps(acc[4 * r + 3], w3, xv);
        }
    }
    v16 v[16];
    for (int i = 0; i < 16; i++) memcpy(&v[i], &acc[i], sizeof v[i]);
    const v16 s = pairsum_tree(v, 16);
    for (int i = 0; i < 4 * R; i++) out[i] = s[i];
}
#endif

/* y [rows, m] (row stride ys; bf16 when y_bf16, rounded as torch rounds, else fp32) = x [rows, k] bf16 (row stride
   xs) times the int4 weight [m, k] transposed. Work is split over the OpenMP threads by blocks of weight rows. */
static int i4_matmul_blocks(const uint16_t *x, int64_t rows, int64_t xs, const uint8_t *w, const uint16_t *scale,
                            int64_t group, int64_t m, int64_t k, void *y, int y_bf16, int64_t ys, int threads) {
    const int64_t nblocks = (m + 3) / 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *wb = malloc(sizeof(uint16_t) * 4 * k);
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; blk++) {
            if (!wb) continue;
            const int64_t j0 = blk * 4, nb = m - j0 < 4 ? m - j0 : 4;
            for (int64_t b = 0; b < 4; b++) {
                if (b < nb) i4_dequant_row(w + (j0 + b) * (k / 2), scale + (j0 + b) * (k / group), group, k, wb + b * k);
                else memset(wb + b * k, 0, sizeof(uint16_t) * k);
            }
            float out[16];
            for (int64_t i = 0; i < rows; i += 4) {
                const int R = rows - i < 4 ? (int)(rows - i) : 4;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
                switch (R) {
                    case 1: i4_tile(x + i * xs, xs, 1, wb, k, out); break;
                    case 2: i4_tile(x + i * xs, xs, 2, wb, k, out); break;
                    case 3: i4_tile(x + i * xs, xs, 3, wb, k, out); break;
                    default: i4_tile(x + i * xs, xs, 4, wb, k, out); break;
                }
#else
                for (int r = 0; r < R; r++)
                    for (int b = 0; b < 4; b++) {
                        float s = 0.0f;
                        for (int64_t d = 0; d < k; d++) s += widen_bf16(x[(i + r) * xs + d]) * widen_bf16(wb[b * k + d]);
                        out[4 * r + b] = s;
                    }
#endif
                for (int r = 0; r < R; r++)
                    for (int64_t b = 0; b < nb; b++) {
                        if (y_bf16) ((uint16_t *)y)[(i + r) * ys + j0 + b] = round_bf16(out[4 * r + b]);
                        else ((float *)y)[(i + r) * ys + j0 + b] = out[4 * r + b];
                    }
            }
        }
        free(wb);
    }
    return failed ? KERNEL_NO_MEMORY : 0;
}
