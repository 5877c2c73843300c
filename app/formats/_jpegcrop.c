/* Decode only the part of a JPEG that a crop needs.
 *
 * RandomResizedCrop knows its box before any pixel is decoded. libjpeg-turbo can then skip the rows
 * above the box (jpeg_skip_scanlines), decode only the iMCU columns the box covers
 * (jpeg_crop_scanline), stop at the box's last row, and scale the IDCT by m/8. That part is then
 * resized with Pillow's BILINEAR arithmetic (_resample.c) with the box moved into its pixels: the
 * pixels of the PIL path, which decodes the whole image first and resizes with pillow-simd.
 *
 * crop_resize(data, out_w, out_h, x0, y0, x1, y1, m, flip) -> bytes
 *   data:   the JPEG (any buffer)
 *   x0..y1: the box in the full-size image's pixels; out_w x out_h the size it is resized to
 *   m:      decode at m/8 of the full size (1..8); the box is scaled with the image
 *   flip:   mirror the output left to right
 * returns out_w x out_h RGBX pixels (as Pillow holds RGB: an image made on them reads them in place).
 * Raises _jpegcrop.Error for a JPEG libjpeg cannot read (corrupt, or truncated anywhere, also below
 * the box) and _jpegcrop.Unsupported for one this path does not decode (CMYK, YCCK, 4x sampling):
 * the caller falls back to Pillow.
 *
 * pack_rgb(capsule, width, height, out) writes a Pillow RGB image (its Image.getim() capsule) into
 * ``out`` as packed RGB rows: the batch slot gets the resize's pixels in one pass,
 * where tobytes() then a copy into the slot took two. Pillow holds RGB as 4 bytes a pixel in rows it
 * points to (its ImagingMemoryInstance: the first fields below are Pillow 12's; earlier versions began
 * with a char mode[7] and fail the checks); the fields are checked against the image's known size
 * before any is used, and anything else raises _jpegcrop.Unsupported: the caller then copies through
 * Pillow. With stream true, rows go past the caches (non-temporal stores) where out is 32-byte aligned
 * and the width a multiple of 32: what a batch slot wants, which this core does not read again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>

#include <jpeglib.h>
#include <jerror.h>

#include "_resample.h"

static PyObject *JpegError;
static PyObject *Unsupported;

enum { OK = 0, ERR_JPEG = 1, ERR_UNSUPPORTED = 2, ERR_MEMORY = 3, ERR_BOX = 4 };

struct err_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
    int eof; /* the data ended before the image did (libjpeg inserted an EOI): Pillow fails, so do we */
};

static void on_error(j_common_ptr cinfo) {
    struct err_mgr *err = (struct err_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    /* Other warnings (extraneous bytes before a marker, ...) are ignored, as Pillow ignores them. */
    if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) ((struct err_mgr *)cinfo->err)->eof = 1;
}

/* Whether an EOI marker follows the scan data read so far: a file cut below the box is corrupt, as Pillow,
   which decodes every row, finds (in scan data a 0xFF byte is always followed by 0x00 or a restart marker).
   Looked for from the end, where it nearly always is: a scan forward over the rows below the box cost 5 % of
   a sample. */
static int eoi_after(const unsigned char *from, const unsigned char *end) {
    for (ptrdiff_t i = end - from - 2; i >= 0; i--)
        if (from[i] == 0xFF && from[i + 1] == JPEG_EOI) return 1;
    return 0;
}

struct job {
    const unsigned char *data;
    size_t len;
    int out_w, out_h, m, flip;
    double x0, y0, x1, y1;
    uint32_t *out;            /* out_w x out_h RGBX pixels */
    struct resampler *rs;     /* the resize, fed the decoded rows */
    uint32_t *strip;          /* 4 decoded rows, RGBX */
    char message[JMSG_LENGTH_MAX];
};

/* Runs without the GIL. The region is the box's rows and the iMCU columns around it, with what the resize's
   filter reads beyond the box and one pixel more each side, so the upsampler's edge handling at the crop's
   border never reaches a pixel that is used. */
static int decode_region(struct job *job) {
    struct jpeg_decompress_struct cinfo;
    struct err_mgr err;
    volatile int status = OK; /* volatile: set after the setjmp */

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.eof = 0;
    err.message[0] = 0;
    job->rs = NULL; /* the caller frees these */
    job->strip = NULL;
    if (setjmp(err.jump)) {
        snprintf(job->message, sizeof job->message, "%s", err.message);
        jpeg_destroy_decompress(&cinfo);
        return ERR_JPEG;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->len);
    jpeg_read_header(&cinfo, TRUE);

    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        snprintf(job->message, sizeof job->message, "colour space %d (CMYK or YCCK)", (int)cinfo.jpeg_color_space);
        jpeg_destroy_decompress(&cinfo);
        return ERR_UNSUPPORTED;
    }
    for (int i = 0; i < cinfo.num_components; i++) {
        if (cinfo.comp_info[i].h_samp_factor > 2 || cinfo.comp_info[i].v_samp_factor > 2) {
            snprintf(job->message, sizeof job->message, "sampling factors over 2");
            jpeg_destroy_decompress(&cinfo);
            return ERR_UNSUPPORTED;
        }
    }
    const int width = (int)cinfo.image_width, height = (int)cinfo.image_height;
    if (!(job->x1 <= width + 1e-6 && job->y1 <= height + 1e-6)) { /* as Pillow's resize refuses it */
        snprintf(job->message, sizeof job->message, "the box (%g, %g, %g, %g) passes the %dx%d image", job->x0,
                 job->y0, job->x1, job->y1, width, height);
        jpeg_destroy_decompress(&cinfo);
        return ERR_BOX;
    }
    cinfo.out_color_space = JCS_EXT_RGBX; /* Pillow keeps RGB in 4 bytes: its image can use these */
    cinfo.scale_num = (unsigned)job->m;
    cinfo.scale_denom = 8;
    cinfo.dct_method = JDCT_ISLOW; /* what Pillow decodes with (JDCT_IFAST moved pixels by up to 2.2 of 255) */
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_calc_output_dimensions(&cinfo);
    const int sw = (int)cinfo.output_width, sh = (int)cinfo.output_height;

    /* The box in the scaled image's pixels, as the PIL path scales it after its draft; the resize of it, with
       Pillow's coefficients for the whole scaled image, says which pixels it reads: those, and one more each side
       (so the upsampler's edge handling at the part's border never reaches a pixel that is used), are decoded. */
    const double sx = (double)sw / width, sy = (double)sh / height;
    const double box[4] = {job->x0 * sx, job->y0 * sy, job->x1 * sx, job->y1 * sy};
    job->rs = resampler_new(sw, sh, box, job->out_w, job->out_h);
    if (!job->rs) {
        jpeg_destroy_decompress(&cinfo);
        snprintf(job->message, sizeof job->message, "out of memory");
        return ERR_MEMORY;
    }
    int cx0, cx1, ry0, ry1;
    resampler_reads(job->rs, &cx0, &cx1, &ry0, &ry1);
    const int dx0 = cx0 > 0 ? cx0 - 1 : 0, dx1 = cx1 < sw ? cx1 + 1 : sw;
    const int dy0 = ry0 > 0 ? ry0 - 1 : 0, dy1 = ry1 < sh ? ry1 + 1 : sh;

    jpeg_start_decompress(&cinfo);
    JDIMENSION xoff = (JDIMENSION)dx0, cw = (JDIMENSION)(dx1 - dx0);
    if (cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw); /* xoff moves left to an iMCU edge */
    resampler_place(job->rs, (int)xoff, dy0); /* the part's rows are resized as they are decoded, 4 at a time */
    const size_t stride = (size_t)cinfo.output_width + RESAMPLE_SLACK_PIXELS;
    job->strip = malloc(sizeof(uint32_t) * stride * 5); /* 4 rows and one for those the resize does not read */
    if (!job->strip) {
        status = ERR_MEMORY;
        goto done;
    }
    int first, last;
    resampler_rows(job->rs, &first, &last);
    if (dy0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)dy0);
    for (int group = first; (int)cinfo.output_scanline < dy1;) {
        const int r = (int)cinfo.output_scanline - dy0, used = r >= first && r < last;
        JSAMPROW row = (JSAMPROW)(job->strip + stride * (size_t)(used ? r - group : 4));
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) break;
        if (used && (r - group == 3 || r == last - 1)) {
            resampler_put(job->rs, group, job->strip, stride);
            group += 4;
        }
    }
    /* Where libjpeg's input stopped before the EOI marker (the box ended above the last iMCU row), the rest is
       looked at for it; where the input reached it (read, or met by the entropy decoder and held as the
       unread marker), a missing one was a JWRN_JPEG_EOF. */
    const int at_eoi = jpeg_input_complete(&cinfo) || cinfo.unread_marker == JPEG_EOI;
    if ((int)cinfo.output_scanline < dy1 || err.eof ||
        (!at_eoi && !eoi_after(cinfo.src->next_input_byte, job->data + job->len))) {
        snprintf(job->message, sizeof job->message, "image file is truncated");
        status = ERR_JPEG;
        goto done;
    }
    resampler_finish(job->rs, job->out, job->flip);

done:
    jpeg_abort_decompress(&cinfo); /* not finish: the rows below the box were never read */
    jpeg_destroy_decompress(&cinfo);
    if (status == ERR_MEMORY) snprintf(job->message, sizeof job->message, "out of memory");
    return status;
}

static PyObject *crop_resize(PyObject *self, PyObject *args) {
    Py_buffer data;
    int out_w, out_h, m, flip;
    double x0, y0, x1, y1;
    if (!PyArg_ParseTuple(args, "y*iiddddip", &data, &out_w, &out_h, &x0, &y0, &x1, &y1, &m, &flip)) return NULL;
    if (out_w < 1 || out_h < 1 || out_w > 65536 || out_h > 65536 || !(x1 > x0 && y1 > y0 && x0 >= 0 && y0 >= 0) ||
        m < 1 || m > 8) {
        PyErr_SetString(PyExc_ValueError, "the output must be 1x1 to 65536x65536, the box have x1 > x0 >= 0 and "
                                          "y1 > y0 >= 0, and m be 1 to 8");
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)out_w * out_h * 4);
    if (!out) {
        PyBuffer_Release(&data);
        return NULL;
    }
    struct job job = {.data = data.buf, .len = (size_t)data.len, .out_w = out_w, .out_h = out_h, .m = m,
                      .flip = flip, .x0 = x0, .y0 = y0, .x1 = x1, .y1 = y1,
                      .out = (uint32_t *)(void *)PyBytes_AS_STRING(out)};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_region(&job);
    resampler_free(job.rs);
    free(job.strip);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status == OK) return out;
    Py_DECREF(out);
    if (status == ERR_UNSUPPORTED)
        PyErr_SetString(Unsupported, job.message);
    else if (status == ERR_BOX)
        PyErr_SetString(PyExc_ValueError, job.message);
    else if (status == ERR_MEMORY)
        PyErr_NoMemory();
    else if (status == ERR_JPEG)
        PyErr_SetString(JpegError, job.message[0] ? job.message : "not a readable JPEG");
    return NULL;
}

/* The leading fields of Pillow 12's ImagingMemoryInstance (libImaging/Imaging.h; pillow-simd 12.1.1). */
struct pillow_imaging {
    int mode, type, depth, bands, xsize, ysize;
    void *palette;
    unsigned char **image8;
    int **image32;
    char **image;
    char *block;
    void *blocks;
    int pixelsize, linesize;
};

/* The Pillow image of pack_rgb's layout, or NULL with Unsupported set. */
static const struct pillow_imaging *rgb_image(PyObject *capsule, int width, int height) {
    const struct pillow_imaging *im = NULL;
    if (PyCapsule_IsValid(capsule, "Pillow Imaging")) im = PyCapsule_GetPointer(capsule, "Pillow Imaging");
    if (im == NULL || im->xsize != width || im->ysize != height || im->bands != 3 || im->pixelsize != 4 ||
        im->linesize != width * 4 || im->image == NULL || width < 1 || height < 1) {
        PyErr_Clear();
        PyErr_SetString(Unsupported, "not a Pillow RGB image of this layout");
        return NULL;
    }
    return im;
}

static PyObject *pack_rgb(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int width, height, stream = 0;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Oiiw*|p", &capsule, &width, &height, &out, &stream)) return NULL;
    const struct pillow_imaging *im = rgb_image(capsule, width, height);
    if (im == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (out.len != (Py_ssize_t)width * height * 3 || !PyBuffer_IsContiguous(&out, 'C')) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "out must be a contiguous buffer of width * height * 3 bytes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = out.buf, *const end = o + out.len;
    if (stream && pack_can_stream(o, width)) {
        for (int y = 0; y < height; y++, o += (size_t)width * 3)
            pack_rgb_row_streamed((const uint32_t *)(const void *)im->image[y], width, o);
        pack_fence();
    } else {
        for (int y = 0; y < height; y++, o += (size_t)width * 3)
            pack_rgb_row((const uint32_t *)(const void *)im->image[y], width, o, end);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *can_stream(PyObject *self, PyObject *args) {
    Py_buffer out;
    int width;
    if (!PyArg_ParseTuple(args, "w*i", &out, &width)) return NULL;
    const int yes = pack_can_stream(out.buf, width);
    PyBuffer_Release(&out);
    return PyBool_FromLong(yes);
}

static PyObject *simd(PyObject *self, PyObject *args) { return PyUnicode_FromString(resample_simd()); }

static PyObject *use_avx2(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    return PyBool_FromLong(resample_use_avx2(on));
}

static PyMethodDef methods[] = {
    {"simd", simd, METH_NOARGS, "simd() -> the instructions the resize uses: 'AVX2', 'SSE2' or 'plain C'"},
    {"can_stream", can_stream, METH_VARARGS,
     "can_stream(out, width) -> whether pack_rgb(..., stream=True) writes rows of width pixels into out past the caches"},
    {"use_avx2", use_avx2, METH_VARARGS, "use_avx2(on) -> whether AVX2 is now used (tests turn it off)"},
    {"pack_rgb", pack_rgb, METH_VARARGS,
     "pack_rgb(capsule, width, height, out, stream=False): a Pillow RGB image (Image.getim()) written into out as "
     "packed RGB rows; stream: past the caches where it can (out 32-byte aligned, width a multiple of 32)"},
    {"crop_resize", crop_resize, METH_VARARGS,
     "crop_resize(data, out_w, out_h, x0, y0, x1, y1, m, flip) -> bytes: the box (full-size pixels) of the JPEG "
     "resized to out_w x out_h by Pillow's BILINEAR arithmetic from only the part of it that needs decoding, at "
     "m/8, mirrored if flip; RGBX pixels"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT, .m_name = "_jpegcrop", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    /* Made once a process: the module imported again under another name (feedline.formats._jpegcrop and the
     * source tree's app.formats._jpegcrop) gets the same classes, so either copy's `except Error` catches what
     * crop_resize raises (the statics hold the last made). */
    if (!JpegError) JpegError = PyErr_NewException("feedline.formats._jpegcrop.Error", NULL, NULL);
    if (!Unsupported) Unsupported = PyErr_NewException("feedline.formats._jpegcrop.Unsupported", NULL, NULL);
    if (!JpegError || !Unsupported || PyModule_AddObjectRef(m, "Error", JpegError) < 0 ||
        PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0 ||
        PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef LIBJPEG_TURBO_VERSION
#define FL_STR2(x) #x
#define FL_STR(x) FL_STR2(x)
    if (PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", FL_STR(LIBJPEG_TURBO_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
