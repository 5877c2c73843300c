/* Pillow's BILINEAR resize of a box of an RGBX image, written straight into the output rows (mirrored if asked),
 * fed 4 source rows at a time as they are decoded. See _resample.c. All of it runs without the GIL. */
#ifndef FEEDLINE_RESAMPLE_H
#define FEEDLINE_RESAMPLE_H

#include <stddef.h>
#include <stdint.h>

/* Pixels past a strip row's end that resampler_put() may read (never uses): what a caller allocates beyond it. */
#define RESAMPLE_SLACK_PIXELS 8

struct resampler;

/* The resize of ``box`` (x0, y0, x1, y1 in the pixels of a width x height image, as Pillow's resize(box=) takes
 * it) to out_w x out_h, with Pillow's coefficients; NULL where memory ran out. */
struct resampler *resampler_new(int width, int height, const double box[4], int out_w, int out_h);
/* The image's columns [x0, x1) and rows [y0, y1) the resize reads: what the caller decodes (a part holding them). */
void resampler_reads(const struct resampler *rs, int *x0, int *x1, int *y0, int *y1);
/* The part the caller decodes starts at the image's pixel (x_off, y_off): rows and columns are the part's from here. */
void resampler_place(struct resampler *rs, int x_off, int y_off);
/* The part's rows it reads, [first, last): the caller puts them in groups of 4 from first (the last group may
 * hold rows past last, or stale ones: they are not used). */
void resampler_rows(const struct resampler *rs, int *first, int *last);
/* The part's rows row .. row + 3: strip, rows ``stride`` pixels apart, each readable RESAMPLE_SLACK_PIXELS pixels
 * past the pixels the resize reads. */
void resampler_put(struct resampler *rs, int row, const uint32_t *strip, size_t stride);
/* The output, out_w x out_h RGBX pixels, rows out_w apart, mirrored left to right if flip. */
void resampler_finish(const struct resampler *rs, uint32_t *dst, int flip);
void resampler_free(struct resampler *rs);

/* The instructions the passes use: "AVX2", "SSE2" or "plain C". */
const char *resample_simd(void);
/* AVX2 off (or on again, where the CPU has it), for the tests of the SSE2 path; returns whether it is on. */
int resample_use_avx2(int on);

/* width RGBX pixels written to out as RGB (3 bytes each); nothing at or past end is written. */
void pack_rgb_row(const uint32_t *row, int width, uint8_t *out, const uint8_t *end);
/* Whether rows of width pixels packed from out on can go past the caches (pack_rgb_row_streamed): AVX2, out
 * 32-byte aligned and width a multiple of 32 (every row then starts aligned). */
int pack_can_stream(const uint8_t *out, int width);
/* pack_rgb_row's bytes, written with non-temporal stores (where pack_can_stream said so); pack_fence() after
 * the last row, before anyone is told the pixels are there. */
void pack_rgb_row_streamed(const uint32_t *row, int width, uint8_t *out);
void pack_fence(void);

#endif
