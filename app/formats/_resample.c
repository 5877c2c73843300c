/* Pillow's BILINEAR resize of a box of an RGBX image, fused with the write into the output (and its mirror).
 *
 * The same arithmetic as pillow-simd's resize (Resample.c: precompute_coeffs, normalize_coeffs_8bpc; a horizontal
 * pass into 8-bit rows, then a vertical one), so the same pixels, in three steps that all run along rows:
 *   1. the source rows the passes read, 4 at a time as the decoder makes them (while they are in cache), are
 *      transposed in 4 x 4 blocks of pixels: the part's columns become rows;
 *   2. the horizontal pass runs over those as a vertical one (vectorized across the source rows, 4 output columns
 *      at a time) and transposes its result back (rows of the 8-bit intermediate, as Pillow's);
 *   3. the vertical pass writes each output row straight into dst, mirrored where asked.
 * pillow-simd's horizontal pass reduces each output pixel's taps within a register: shuffle-bound, it was 70 % of a
 * resize here. Run along rows, both passes cost about what its vertical one does, each decoded row is moved while
 * it is in cache, and the output needs neither a Pillow image of its own nor a copy into place (the resize, slot
 * write and mirror took 150 us a 224 x 224 crop here, this about 50). The coefficients are Pillow's for the box in
 * the whole image, so the pixels are those of Pillow's resize of the whole image, and they say which part of it
 * the caller must decode (resampler_reads). SSE2 everywhere on x86-64, AVX2
 * where the CPU has it, plain C elsewhere.
 */
#include "_resample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__) && !defined(FEEDLINE_NO_SIMD) /* FEEDLINE_NO_SIMD: the plain C path (a test builds it) */
#define WITH_SSE2 1
#include <emmintrin.h>
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define WITH_AVX2 1
#endif
#endif

#define PRECISION_BITS (32 - 8 - 2) /* Pillow's */
#define MAX_COEFS_PRECISION (16 - 1) /* coefficients are int16 */

/* One axis of the resize: output i reads inputs first[i] .. first[i] + n[i] - 1 with weights k[i * taps ...] in
   fixed point of ``precision`` bits (n[i]: what Pillow reads, rounded up to pairs at weight 0; taps: the most).
   Inputs read: [lo, hi). */
struct axis {
    int *first, *n;
    int16_t *k;
    int taps, precision, lo, hi;
};

static void axis_free(struct axis *a) {
    free(a->first);
    free(a->n);
    free(a->k);
}

static double bilinear(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Pillow's coefficients for [in0, in1) of an axis of in_size pixels onto out pixels. */
static int axis_init(struct axis *a, int in_size, float in0, float in1, int out) {
    const double scale = (double)(in1 - in0) / out, filterscale = scale < 1.0 ? 1.0 : scale;
    const double support = filterscale; /* BILINEAR's support is 1 */
    const int ksize = (int)ceil(support) * 2 + 1;
    a->taps = (ksize + 1) & ~1;
    a->first = malloc(sizeof(int) * (size_t)out);
    a->n = malloc(sizeof(int) * (size_t)out);
    a->k = malloc(sizeof(int16_t) * (size_t)out * (size_t)a->taps);
    double *kk = malloc(sizeof(double) * (size_t)out * (size_t)ksize);
    if (!a->first || !a->n || !a->k || !kk) { /* the caller frees the rest */
        free(kk);
        return -1;
    }
    double maxkk = 0.0;
    a->lo = in_size;
    a->hi = 0;
    const double ss = 1.0 / filterscale;
    for (int xx = 0; xx < out; xx++) {
        const double center = in0 + (xx + 0.5) * scale;
        int xmin = (int)(center - support + 0.5), xmax = (int)(center + support + 0.5);
        if (xmin < 0) xmin = 0;
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        double *k = kk + (size_t)xx * ksize, ww = 0.0;
        int x = 0;
        for (; x < xmax; x++) ww += k[x] = bilinear((x + xmin - center + 0.5) * ss);
        for (x = 0; x < xmax; x++)
            if (ww != 0.0) k[x] /= ww;
        for (; x < ksize; x++) k[x] = 0.0;
        for (x = 0; x < ksize; x++)
            if (k[x] > maxkk) maxkk = k[x];
        a->first[xx] = xmin;
        a->n[xx] = xmax < 1 ? 2 : (xmax + 1) & ~1;
        if (xmin < a->lo) a->lo = xmin;
        if (xmin + xmax > a->hi) a->hi = xmin + xmax;
    }
    int precision = 0;
    for (; precision < PRECISION_BITS; precision++)
        if ((int)(0.5 + maxkk * (1 << (precision + 1))) >= (1 << MAX_COEFS_PRECISION)) break;
    for (int xx = 0; xx < out; xx++)
        for (int x = 0; x < a->taps; x++) {
            const double w = x < ksize ? kk[(size_t)xx * ksize + x] : 0.0;
            a->k[(size_t)xx * a->taps + x] = (int16_t)(w < 0 ? (int)(-0.5 + w * (1 << precision))
                                                             : (int)(0.5 + w * (1 << precision)));
        }
    a->precision = precision;
    free(kk);
    if (a->lo > in_size - 1) a->lo = in_size - 1; /* a box past the image reads its edge (at Pillow's weights, 0) */
    if (a->hi <= a->lo) a->hi = a->lo + 1;
    return 0;
}

/* The rows one output line reads, as pointers (a tap past the input reads its last row, at weight 0). */
static void tap_rows(const struct axis *a, int line, const uint32_t *base, size_t stride, int n, int taps,
                     const uint32_t **rows) {
    for (int t = 0; t < taps; t++) {
        int r = a->first[line] - a->lo + t;
        rows[t] = base + (size_t)(r < n ? r : n - 1) * stride;
    }
}

/* ---- 4 pixels at a time: SSE2, or plain C ---- */
#if defined(WITH_SSE2)
typedef __m128i vec4;

static inline vec4 line4(const uint32_t *const *rows, const int16_t *k, int taps, int p, int precision) {
    const __m128i zero = _mm_setzero_si128(), initial = _mm_set1_epi32(1 << (precision - 1));
    __m128i s0 = initial, s1 = initial, s2 = initial, s3 = initial;
    for (int t = 0; t < taps; t += 2) {
        int32_t pair;
        memcpy(&pair, k + t, 4);
        const __m128i mmk = _mm_set1_epi32(pair);
        const __m128i a = _mm_loadu_si128((const __m128i *)(rows[t] + p));
        const __m128i b = _mm_loadu_si128((const __m128i *)(rows[t + 1] + p));
        const __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
        s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), mmk));
        s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), mmk));
        s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), mmk));
        s3 = _mm_add_epi32(s3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), mmk));
    }
    const __m128i shift = _mm_cvtsi32_si128(precision);
    s0 = _mm_sra_epi32(s0, shift);
    s1 = _mm_sra_epi32(s1, shift);
    s2 = _mm_sra_epi32(s2, shift);
    s3 = _mm_sra_epi32(s3, shift);
    return _mm_packus_epi16(_mm_packs_epi32(s0, s1), _mm_packs_epi32(s2, s3));
}

static inline void transpose4(vec4 r[4]) {
    const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpacklo_epi32(r[2], r[3]);
    const __m128i t2 = _mm_unpackhi_epi32(r[0], r[1]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(t0, t1);
    r[1] = _mm_unpackhi_epi64(t0, t1);
    r[2] = _mm_unpacklo_epi64(t2, t3);
    r[3] = _mm_unpackhi_epi64(t2, t3);
}

static inline vec4 load4(const uint32_t *src) { return _mm_loadu_si128((const __m128i *)src); }
static inline void store4(uint32_t *dst, vec4 v) { _mm_storeu_si128((__m128i *)dst, v); }
static inline vec4 reverse4(vec4 v) { return _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 1, 2, 3)); }
#else
typedef struct {
    uint32_t v[4];
} vec4;

static inline vec4 line4(const uint32_t *const *rows, const int16_t *k, int taps, int p, int precision) {
    vec4 out;
    for (int q = 0; q < 4; q++) {
        uint32_t px = 0;
        for (int c = 0; c < 4; c++) {
            int32_t s = 1 << (precision - 1);
            for (int t = 0; t < taps; t++) s += k[t] * ((const uint8_t *)(rows[t] + p + q))[c];
            s >>= precision;
            ((uint8_t *)&px)[c] = (uint8_t)(s < 0 ? 0 : s > 255 ? 255 : s);
        }
        out.v[q] = px;
    }
    return out;
}

static inline void transpose4(vec4 r[4]) {
    vec4 t[4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) t[j].v[i] = r[i].v[j];
    memcpy(r, t, sizeof t);
}

static inline vec4 load4(const uint32_t *src) {
    vec4 v;
    memcpy(v.v, src, sizeof v.v);
    return v;
}
static inline void store4(uint32_t *dst, vec4 v) { memcpy(dst, v.v, sizeof v.v); }
static inline vec4 reverse4(vec4 v) {
    vec4 r = {{v.v[3], v.v[2], v.v[1], v.v[0]}};
    return r;
}
#endif

/* The first n (< 4) pixels of v. */
static inline void store_some(uint32_t *dst, vec4 v, int n) {
    uint32_t tmp[4];
    store4(tmp, v);
    memcpy(dst, tmp, sizeof(uint32_t) * (size_t)n);
}

/* Step 1, for 4 source rows (strip: rows ``sstride`` pixels apart, from column lo_c): t[c][r + i] = strip[i][c]. */
static void transpose4_rows(const uint32_t *strip, size_t sstride, int lo_c, int nc, uint32_t *t, size_t tstride,
                            int r) {
    for (int c = 0; c < nc; c += 4) {
        vec4 b[4];
        for (int i = 0; i < 4; i++) b[i] = load4(strip + (size_t)i * sstride + lo_c + c);
        transpose4(b);
        for (int i = 0; i < 4; i++) store4(t + (size_t)(c + i) * tstride + r, b[i]);
    }
}

/* Step 2: the horizontal pass over t (nc rows of nr pixels): out column x of row r into mid[r][x]. */
static void horizontal4(const struct axis *h, const uint32_t *t, size_t tstride, int nc, int nr, int out_w,
                        uint32_t *mid, size_t mstride, const uint32_t **rows, const int16_t *zeros) {
    for (int x0 = 0; x0 < out_w; x0 += 4) {
        const int16_t *k[4];
        int n[4];
        for (int i = 0; i < 4; i++) { /* a column past out_w: the last one's rows at weight 0, stored past it */
            const int x = x0 + i < out_w ? x0 + i : out_w - 1;
            n[i] = h->n[x];
            tap_rows(h, x, t, tstride, nc, n[i], rows + i * h->taps);
            k[i] = x0 + i < out_w ? h->k + (size_t)x * h->taps : zeros;
        }
        for (int r = 0; r < nr; r += 4) {
            vec4 v[4];
            for (int i = 0; i < 4; i++) v[i] = line4(rows + i * h->taps, k[i], n[i], r, h->precision);
            transpose4(v);
            for (int i = 0; i < 4; i++) store4(mid + (size_t)(r + i) * mstride + x0, v[i]);
        }
    }
}

/* Step 3: the vertical pass over mid (nr rows), each output row written into dst, mirrored if flip. */
static void vertical4(const struct axis *v, const uint32_t *mid, size_t mstride, int nr, uint32_t *dst, int out_w,
                      int out_h, int flip, const uint32_t **rows) {
    for (int y = 0; y < out_h; y++) {
        const int taps = v->n[y];
        tap_rows(v, y, mid, mstride, nr, taps, rows);
        const int16_t *k = v->k + (size_t)y * v->taps;
        uint32_t *row = dst + (size_t)y * out_w;
        for (int x = 0; x < out_w; x += 4) {
            const vec4 px = line4(rows, k, taps, x, v->precision);
            const int n = out_w - x < 4 ? out_w - x : 4;
            if (!flip)
                n == 4 ? store4(row + x, px) : store_some(row + x, px, n);
            else if (n == 4)
                store4(row + out_w - x - 4, reverse4(px));
            else { /* the last n pixels, x .. x + n - 1, go to out_w - 1 - x down to out_w - x - n */
                uint32_t tmp[4];
                store4(tmp, px);
                for (int q = 0; q < n; q++) row[out_w - 1 - x - q] = tmp[q];
            }
        }
    }
}

#if defined(WITH_AVX2)
/* ---- 8 pixels at a time (AVX2): the same steps 2 and 3, two 4-pixel halves in the register's two lanes ---- */
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i line8(const uint32_t *const *rows, const int16_t *k, int taps, int p, int precision) {
    const __m256i zero = _mm256_setzero_si256(), initial = _mm256_set1_epi32(1 << (precision - 1));
    __m256i s0 = initial, s1 = initial, s2 = initial, s3 = initial;
    for (int t = 0; t < taps; t += 2) {
        int32_t pair;
        memcpy(&pair, k + t, 4);
        const __m256i mmk = _mm256_set1_epi32(pair);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(rows[t] + p));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(rows[t + 1] + p));
        const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), mmk));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), mmk));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), mmk));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), mmk));
    }
    const __m128i shift = _mm_cvtsi32_si128(precision);
    s0 = _mm256_sra_epi32(s0, shift);
    s1 = _mm256_sra_epi32(s1, shift);
    s2 = _mm256_sra_epi32(s2, shift);
    s3 = _mm256_sra_epi32(s3, shift);
    return _mm256_packus_epi16(_mm256_packs_epi32(s0, s1), _mm256_packs_epi32(s2, s3)); /* pixels in order */
}

AVX2 static void horizontal8(const struct axis *h, const uint32_t *t, size_t tstride, int nc, int nr, int out_w,
                             uint32_t *mid, size_t mstride, const uint32_t **rows, const int16_t *zeros) {
    /* rows: every output column's tap rows (out_w rounded up to 4, h->taps each); row blocks outside, so each block's
       rows of mid are written left to right and the source rows' pieces are read while cached */
    const int groups = (out_w + 3) / 4;
    for (int x = 0; x < groups * 4; x++) {
        const int line = x < out_w ? x : out_w - 1;
        tap_rows(h, line, t, tstride, nc, h->n[line], rows + (size_t)x * h->taps);
    }
    for (int r = 0; r < nr; r += 8) {
        uint32_t *out = mid + (size_t)r * mstride;
        for (int x0 = 0; x0 < out_w; x0 += 4, out += 4) {
            __m256i v[4];
            for (int i = 0; i < 4; i++) {
                const int x = x0 + i < out_w ? x0 + i : out_w - 1;
                v[i] = line8(rows + (size_t)(x0 + i) * h->taps, x0 + i < out_w ? h->k + (size_t)x * h->taps : zeros,
                             h->n[x], r, h->precision);
            }
            const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpacklo_epi32(v[2], v[3]);
            const __m256i t2 = _mm256_unpackhi_epi32(v[0], v[1]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
            const __m256i c[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                                  _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
            for (int i = 0; i < 4; i++) { /* lane 0: source row r + i; lane 1: r + 4 + i */
                _mm_storeu_si128((__m128i *)(out + (size_t)i * mstride), _mm256_castsi256_si128(c[i]));
                _mm_storeu_si128((__m128i *)(out + (size_t)(4 + i) * mstride), _mm256_extracti128_si256(c[i], 1));
            }
        }
    }
}

AVX2 static void vertical8(const struct axis *v, const uint32_t *mid, size_t mstride, int nr, uint32_t *dst,
                           int out_w, int out_h, int flip, const uint32_t **rows) {
    const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    for (int y = 0; y < out_h; y++) {
        const int taps = v->n[y];
        tap_rows(v, y, mid, mstride, nr, taps, rows);
        const int16_t *k = v->k + (size_t)y * v->taps;
        uint32_t *row = dst + (size_t)y * out_w;
        int x = 0;
        for (; x + 8 <= out_w; x += 8) {
            const __m256i px = line8(rows, k, taps, x, v->precision);
            if (flip)
                _mm256_storeu_si256((__m256i *)(row + out_w - x - 8), _mm256_permutevar8x32_epi32(px, reverse));
            else
                _mm256_storeu_si256((__m256i *)(row + x), px);
        }
        if (x < out_w) { /* the last out_w - x (< 8) pixels */
            uint32_t tmp[8];
            _mm256_storeu_si256((__m256i *)tmp, line8(rows, k, taps, x, v->precision));
            for (int q = 0; x + q < out_w; q++) row[flip ? out_w - 1 - x - q : x + q] = tmp[q];
        }
    }
}

AVX2 static void transpose8_rows(const uint32_t *strip, size_t sstride, int lo_c, int nc, uint32_t *t,
                                 size_t tstride, int r) {
    for (int c = 0; c < nc; c += 8) {
        __m256i b[4];
        for (int i = 0; i < 4; i++)
            b[i] = _mm256_loadu_si256((const __m256i *)(strip + (size_t)i * sstride + lo_c + c));
        const __m256i t0 = _mm256_unpacklo_epi32(b[0], b[1]), t1 = _mm256_unpacklo_epi32(b[2], b[3]);
        const __m256i t2 = _mm256_unpackhi_epi32(b[0], b[1]), t3 = _mm256_unpackhi_epi32(b[2], b[3]);
        const __m256i q[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                              _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
        for (int i = 0; i < 4; i++) { /* lane 0: column c + i; lane 1: c + 4 + i */
            _mm_storeu_si128((__m128i *)(t + (size_t)(c + i) * tstride + r), _mm256_castsi256_si128(q[i]));
            _mm_storeu_si128((__m128i *)(t + (size_t)(c + 4 + i) * tstride + r), _mm256_extracti128_si256(q[i], 1));
        }
    }
}

static int avx2 = -1; /* unknown yet; a race only computes it twice */

static int has_avx2(void) {
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    return avx2;
}

/* 8 RGBX pixels at a time into 24 bytes of RGB (each lane's 12, then the two lanes' side by side). */
AVX2 static int pack_row8(const uint32_t *row, int width, uint8_t *out, const uint8_t *end) {
    const __m256i rgb = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                         0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);
    int x = 0;
    for (; x + 8 <= width && end - out >= 32; x += 8, out += 24) { /* 32 bytes stored, the last 8 written over next */
        const __m256i px = _mm256_loadu_si256((const __m256i *)(row + x));
        _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(px, rgb), join));
    }
    return x;
}

/* 32 pixels at a time into 96 bytes of RGB, stored as three aligned 32-byte lines that bypass the caches: a batch
 * slot is read by another process or the device, not by this core, and written through the cache each row cost a
 * worker its decoder's cached lines (measured: a worker's samples a CPU-second rose 4 %). */
AVX2 static void pack_row32_streamed(const uint32_t *row, int width, uint8_t *out) {
    const __m256i rgb = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                         0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7); /* 8 pixels' 24 bytes in words 0-5 */
    /* the four packs' 24 words into three lines: p0 p0 p0 p0 p0 p0 p1 p1 | p1 p1 p1 p1 p2 p2 p2 p2 | p2 p2 p3 ... */
    const __m256i a1 = _mm256_setr_epi32(0, 0, 0, 0, 0, 0, 0, 1), b1 = _mm256_setr_epi32(2, 3, 4, 5, 0, 0, 0, 0);
    const __m256i b2 = _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3), c2 = _mm256_setr_epi32(4, 5, 0, 0, 0, 0, 0, 0);
    const __m256i c3 = _mm256_setr_epi32(0, 0, 0, 1, 2, 3, 4, 5);
    for (int x = 0; x + 32 <= width; x += 32, out += 96) {
        __m256i p[4];
        for (int k = 0; k < 4; k++)
            p[k] = _mm256_permutevar8x32_epi32(
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(row + x + 8 * k)), rgb), join);
        _mm256_stream_si256((__m256i *)out, _mm256_blend_epi32(p[0], _mm256_permutevar8x32_epi32(p[1], a1), 0xC0));
        _mm256_stream_si256((__m256i *)(out + 32), _mm256_blend_epi32(_mm256_permutevar8x32_epi32(p[1], b1),
                                                                      _mm256_permutevar8x32_epi32(p[2], b2), 0xF0));
        _mm256_stream_si256((__m256i *)(out + 64), _mm256_blend_epi32(_mm256_permutevar8x32_epi32(p[2], c2),
                                                                      _mm256_permutevar8x32_epi32(p[3], c3), 0xFC));
    }
}
#endif

int pack_can_stream(const uint8_t *out, int width) {
#if defined(WITH_AVX2)
    return has_avx2() && ((uintptr_t)out & 31) == 0 && width > 0 && width % 32 == 0;
#else
    (void)out, (void)width;
    return 0;
#endif
}

void pack_rgb_row_streamed(const uint32_t *row, int width, uint8_t *out) {
#if defined(WITH_AVX2)
    pack_row32_streamed(row, width, out);
#else
    (void)row, (void)width, (void)out;
#endif
}

void pack_fence(void) {
#if defined(WITH_SSE2) || defined(WITH_AVX2)
    _mm_sfence();
#endif
}

int resample_use_avx2(int on) {
#if defined(WITH_AVX2)
    avx2 = on && __builtin_cpu_supports("avx2") ? 1 : 0;
    return avx2;
#else
    (void)on;
    return 0;
#endif
}

const char *resample_simd(void) {
#if defined(WITH_AVX2)
    if (has_avx2()) return "AVX2";
#endif
#if defined(WITH_SSE2)
    return "SSE2";
#else
    return "plain C";
#endif
}

void pack_rgb_row(const uint32_t *row, int width, uint8_t *out, const uint8_t *end) {
    int x = 0;
#if defined(WITH_AVX2)
    if (has_avx2()) {
        x = pack_row8(row, width, out, end);
        out += (size_t)x * 3;
    }
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* four RGBX pixels (two words: R0 G0 B0 X0 R1 G1 B1 X1, R2 ... X3) become 12 bytes of RGB, in registers
     * (stores to a small array then a wider load stalled the store forwarding: five times slower) */
    for (; x + 4 <= width; x += 4, out += 12) {
        uint64_t a, b;
        memcpy(&a, row + x, 8);
        memcpy(&b, row + x + 2, 8);
        const uint64_t lo = (a & 0xFFFFFFull) | ((a >> 8) & 0xFFFFFF000000ull) | (b << 48);
        const uint32_t hi = (uint32_t)(((b >> 16) & 0xFFull) | ((b >> 24) & 0xFFFFFF00ull));
        memcpy(out, &lo, 8);
        memcpy(out + 8, &hi, 4);
    }
#endif
    for (; x < width; x++, out += 3) memcpy(out, row + x, 3); /* R, G, B: the first 3 bytes of a pixel */
    (void)end;
}

struct resampler {
    struct axis h, v;
    int out_w, out_h, nr, nc;
    size_t nrp, owp;
    int x_off, y_off;        /* the part's top left pixel in the image (resampler_place) */
    uint32_t *t, *mid;       /* the source part transposed (nc rows of nrp), the horizontal pass's rows (nr of owp) */
    const uint32_t **rows;   /* tap rows: of every output column (horizontal8), of 4 (horizontal4), of one row */
    int16_t *zeros;          /* the weights of the columns past out_w */
    int avx2;
};

void resampler_free(struct resampler *rs) {
    if (!rs) return;
    axis_free(&rs->h);
    axis_free(&rs->v);
    free(rs->t);
    free(rs->rows);
    free(rs->zeros);
    free(rs);
}

struct resampler *resampler_new(int width, int height, const double box[4], int out_w, int out_h) {
    struct resampler *rs = calloc(1, sizeof *rs);
    if (!rs) return NULL;
    if (axis_init(&rs->h, width, (float)box[0], (float)box[2], out_w) < 0 ||
        axis_init(&rs->v, height, (float)box[1], (float)box[3], out_h) < 0) {
        resampler_free(rs);
        return NULL;
    }
    rs->out_w = out_w;
    rs->out_h = out_h;
    rs->nr = rs->v.hi - rs->v.lo;
    rs->nc = rs->h.hi - rs->h.lo;
    rs->nrp = ((size_t)rs->nr + 7) & ~(size_t)7;
    rs->owp = ((size_t)out_w + 7) & ~(size_t)7;
    const size_t ncp = ((size_t)rs->nc + 7) & ~(size_t)7;
    const int taps = rs->h.taps > rs->v.taps ? rs->h.taps : rs->v.taps;
    rs->t = malloc(sizeof(uint32_t) * (ncp * rs->nrp + rs->nrp * rs->owp));
    rs->rows = malloc(sizeof(*rs->rows) * (size_t)(out_w + 3 > 4 ? out_w + 3 : 4) * (size_t)taps);
    rs->zeros = calloc((size_t)taps, sizeof(int16_t));
    if (!rs->t || !rs->rows || !rs->zeros) {
        resampler_free(rs);
        return NULL;
    }
    rs->mid = rs->t + ncp * rs->nrp;
#if defined(WITH_AVX2)
    rs->avx2 = has_avx2();
#endif
    return rs;
}

void resampler_reads(const struct resampler *rs, int *x0, int *x1, int *y0, int *y1) {
    *x0 = rs->h.lo;
    *x1 = rs->h.hi;
    *y0 = rs->v.lo;
    *y1 = rs->v.hi;
}

void resampler_place(struct resampler *rs, int x_off, int y_off) {
    rs->x_off = x_off;
    rs->y_off = y_off;
}

void resampler_rows(const struct resampler *rs, int *first, int *last) {
    *first = rs->v.lo - rs->y_off;
    *last = rs->v.hi - rs->y_off;
}

void resampler_put(struct resampler *rs, int row, const uint32_t *strip, size_t stride) {
    const int r = row + rs->y_off - rs->v.lo, lo_c = rs->h.lo - rs->x_off;
#if defined(WITH_AVX2)
    if (rs->avx2) {
        transpose8_rows(strip, stride, lo_c, rs->nc, rs->t, rs->nrp, r);
        return;
    }
#endif
    transpose4_rows(strip, stride, lo_c, rs->nc, rs->t, rs->nrp, r);
}

void resampler_finish(const struct resampler *rs, uint32_t *dst, int flip) {
#if defined(WITH_AVX2)
    if (rs->avx2) {
        horizontal8(&rs->h, rs->t, rs->nrp, rs->nc, rs->nr, rs->out_w, rs->mid, rs->owp, rs->rows, rs->zeros);
        vertical8(&rs->v, rs->mid, rs->owp, rs->nr, dst, rs->out_w, rs->out_h, flip, rs->rows);
        return;
    }
#endif
    horizontal4(&rs->h, rs->t, rs->nrp, rs->nc, rs->nr, rs->out_w, rs->mid, rs->owp, rs->rows, rs->zeros);
    vertical4(&rs->v, rs->mid, rs->owp, rs->nr, dst, rs->out_w, rs->out_h, flip, rs->rows);
}
