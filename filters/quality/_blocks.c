/* The down-sampling of a large image before its luminance is mixed: luma.block_mean's
 * k x k block means, in C, bit for bit as numpy computes them. numpy's two axis sums cast a
 * uint8 image to float32 value by value and walk it twice (12.6 ms for a 1920 x 1080 x 3
 * image on the 2-core machine); this reads it once, a band of k rows at a time.
 *
 * The sums, in numpy's order (tests/unit/test_quality_kernels.py holds them to it):
 *   - down the k rows of a band: the first row's value, then each next row added;
 *   - across the k columns of a block: the first column's value, then each next added. Where
 *     the columns are innermost (CHW, or HWC of one channel) numpy sums them pairwise, which
 *     is this order for fewer than 8 values only: such images come here for k < 8;
 *   - the block's sum times inv, numpy's float32(1 / k^2). */

#include "_kernels.h"

#include <stdlib.h>

/* One band's row sums into row (w x c floats, HWC order: column, then channel), from the k
 * image rows that start at src, each `pitch` values apart. */
#define BAND_SUMS(T)                                                                           \
    VEC static void band_##T(const T *restrict src, Py_ssize_t pitch, Py_ssize_t n,            \
                             Py_ssize_t k, float *restrict row) {                              \
        for (Py_ssize_t j = 0; j < n; j++)                                                     \
            row[j] = (float)src[j];                                                            \
        for (Py_ssize_t r = 1; r < k; r++) {                                                   \
            const T *s = src + r * pitch;                                                      \
            for (Py_ssize_t j = 0; j < n; j++)                                                 \
                row[j] += (float)s[j];                                                         \
        }                                                                                      \
    }

typedef unsigned char u8;
BAND_SUMS(u8)
BAND_SUMS(float)

/* HWC: out[J, ch] = (row[J k, ch] + row[J k + 1, ch] + ...) * inv, left to right. */
VEC static void across_hwc(const float *restrict row, Py_ssize_t blocks, Py_ssize_t k,
                           Py_ssize_t c, float inv, float *restrict out) {
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *p = row + b * k * c;
        for (Py_ssize_t ch = 0; ch < c; ch++) {
            float acc = p[ch];
            for (Py_ssize_t s = 1; s < k; s++)
                acc += p[s * c + ch];
            out[b * c + ch] = acc * inv;
        }
    }
}

/* CHW: out[J] = (row[J k] + row[J k + 1] + ...) * inv, left to right (numpy's pairwise sum
 * of a contiguous run is this for fewer than 8 values). */
VEC static void across_chw(const float *restrict row, Py_ssize_t blocks, Py_ssize_t k,
                           float inv, float *restrict out) {
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *p = row + b * k;
        float acc = p[0];
        for (Py_ssize_t s = 1; s < k; s++)
            acc += p[s];
        out[b] = acc * inv;
    }
}

/* block_mean(image, hwc, H, W, C, k, inv, out) -> None. image: H x W x C (hwc) or C x H x W,
 * uint8 or float32, C-contiguous; out: float32, (H / k) x (W / k) x C or C x (H / k) x (W / k)
 * (the remainder rows and columns left out, as numpy's slices leave them). */
PyObject *block_mean(PyObject *self, PyObject *args) {
    PyObject *o_image, *o_out;
    Py_ssize_t H, W, C, k;
    int hwc;
    float inv;
    if (!PyArg_ParseTuple(args, "Opnnnnf" "O", &o_image, &hwc, &H, &W, &C, &k, &inv, &o_out))
        return NULL;
    if (H < 0 || W < 0 || C < 1 || k < 2 || ((!hwc || C == 1) && k >= 8)) {
        PyErr_SetString(PyExc_ValueError, "block_mean: expected H, W >= 0, C >= 1 and "
                                          "2 <= k (k < 8 for CHW or one channel)");
        return NULL;
    }
    if (H > 0 && W > 0 && (W > PY_SSIZE_T_MAX / 8 / H || C > PY_SSIZE_T_MAX / 8 / (H * W))) {
        PyErr_SetString(PyExc_ValueError, "block_mean: image too large");
        return NULL;
    }
    Py_ssize_t hb = H / k, wb = W / k, w = wb * k;
    Buf image, out;
    image.held = out.held = 0;
    PyObject *result = NULL;
    float *row = NULL;
    if (PyObject_GetBuffer(o_image, &image.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    image.held = 1;
    int is_u8 = image.view.itemsize == 1 && native_format(image.view.format, 'B');
    int is_f32 = image.view.itemsize == 4 && native_format(image.view.format, 'f');
    if (!is_u8 && !is_f32) {
        PyErr_Format(PyExc_TypeError, "image: expected uint8 or float32, got format %s",
                     image.view.format ? image.view.format : "(none)");
        goto done;
    }
    if (image.view.len / image.view.itemsize < H * W * C) {
        PyErr_Format(PyExc_ValueError, "image: expected at least %zd values, got %zd",
                     H * W * C, image.view.len / image.view.itemsize);
        goto done;
    }
    if (get_f32(o_out, &out, hb * wb * C, 1, "out") < 0)
        goto done;
    row = malloc(sizeof(float) * (size_t)(w * C + 1));
    if (row == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    float *o = (float *)out.view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (hwc) {
        for (Py_ssize_t i = 0; i < hb; i++) {
            Py_ssize_t at = i * k * W * C;
            if (is_u8)
                band_u8((const u8 *)image.view.buf + at, W * C, w * C, k, row);
            else
                band_float((const float *)image.view.buf + at, W * C, w * C, k, row);
            across_hwc(row, wb, k, C, inv, o + i * wb * C);
        }
    } else {
        for (Py_ssize_t ch = 0; ch < C; ch++) {
            for (Py_ssize_t i = 0; i < hb; i++) {
                Py_ssize_t at = ch * H * W + i * k * W;
                if (is_u8)
                    band_u8((const u8 *)image.view.buf + at, W, w, k, row);
                else
                    band_float((const float *)image.view.buf + at, W, w, k, row);
                across_chw(row, wb, k, inv, o + (ch * hb + i) * wb);
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    free(row);
    release(&image);
    release(&out);
    return result;
}
