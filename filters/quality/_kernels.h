/* What the quality filter's C files share: the buffer helpers (arrays come in through the
 * buffer protocol, C-contiguous, their format checked) and the functions of _spectra.c that
 * _kernels.c's module table lists. What must hold of every pass: _kernels.c's opening comment. */
#ifndef MMGUARD_QUALITY_KERNELS_H
#define MMGUARD_QUALITY_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The loops are written so the compiler vectorises them; on x86-64 each is built twice, for
 * SSE2 (the baseline) and AVX2, and the loader picks the one the CPU runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VEC __attribute__((target_clones("avx2", "default")))
#else
#define VEC
#endif

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* Whether a buffer's struct format is `code` in this machine's byte order: "f", "@f", "=f",
 * and "<f" or ">f" (with "!f") where that is the machine's order; numpy writes "<f" for a
 * float32 array read from the wire. */
static inline int native_format(const char *format, char code) {
    if (format == NULL)
        return 0;
    char order = format[0];
    if (order == code)
        return format[1] == '\0';
#if PY_BIG_ENDIAN
    int native = order == '@' || order == '=' || order == '>' || order == '!';
#else
    int native = order == '@' || order == '=' || order == '<';
#endif
    return native && format[1] == code && format[2] == '\0';
}

static inline void release(Buf *b) {
    if (b->held)
        PyBuffer_Release(&b->view);
    b->held = 0;
}

/* Holds obj's buffer of at least n values of format `code` (itemsize bytes each, named `kind`
 * in the error) in b, or sets the error, holds nothing and returns -1 (release(b) stays safe
 * either way). */
static inline int get_values(PyObject *obj, Buf *b, Py_ssize_t n, int writable, const char *what,
                             char code, Py_ssize_t itemsize, const char *kind) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0)
        return -1;
    b->held = 1;
    if (b->view.itemsize != itemsize || !native_format(b->view.format, code)) {
        PyErr_Format(PyExc_TypeError, "%s: expected %s, got format %s", what, kind,
                     b->view.format ? b->view.format : "(none)");
        release(b);
        return -1;
    }
    if (n < 0 || b->view.len / itemsize < n) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least %zd values, got %zd", what, n,
                     b->view.len / itemsize);
        release(b);
        return -1;
    }
    return 0;
}

static inline int get_f32(PyObject *obj, Buf *b, Py_ssize_t n, int writable, const char *what) {
    return get_values(obj, b, n, writable, what, 'f', 4, "float32");
}

static inline int get_f64(PyObject *obj, Buf *b, Py_ssize_t n, int writable, const char *what) {
    return get_values(obj, b, n, writable, what, 'd', 8, "float64");
}

/* measure.levels' thresholds and its running totals: the plane's sum, and its counts under
 * lo, over hi, at nw and up, at cl and up, at bl and up. */
typedef struct {
    float lo, hi, nw, cl, bl;
} LevelCuts;

typedef struct {
    double total;
    Py_ssize_t counts[5];
} LevelAcc;

/* channel_clipped's count on one row, every other column: a pixel counts when its largest
 * channel is >= top and its channels' sum, added in channel order, is >= light. Float planes
 * (a, b, c: the row in each channel) or uint8 pixels (p: the row's interleaved RGB). */
static inline Py_ssize_t clipped_row_f32(const float *a, const float *b, const float *c,
                                         Py_ssize_t w, float top, float light) {
    int row = 0;
    for (Py_ssize_t j = 0; j < w; j += 2) {
        float m = a[j] > b[j] ? a[j] : b[j];
        m = c[j] > m ? c[j] : m;
        float level = (a[j] + b[j]) + c[j];
        row += (m >= top) & (level >= light);
    }
    return row;
}

static inline Py_ssize_t clipped_row_u8(const unsigned char *p, Py_ssize_t w, int top,
                                        int light) {
    int row = 0;
    for (Py_ssize_t j = 0; j < w; j += 2) {
        int u = p[3 * j], v = p[3 * j + 1], c = p[3 * j + 2];
        int m = u > v ? u : v;
        m = c > m ? c : m;
        row += (m >= top) & (u + v + c >= light);
    }
    return row;
}

/* _kernels.c: levels' pass, over whole blocks of 64 values and over the last few. */
void levels_blocks(const float *p, Py_ssize_t blocks, const LevelCuts *cut, LevelAcc *acc);
void levels_tail(const float *p, Py_ssize_t n, const LevelCuts *cut, LevelAcc *acc);

/* _pass.c: the image's one pass (luminance, extrema, clipped count, levels). */
PyObject *image_pass(PyObject *self, PyObject *args);

/* _spectra.c: moire's and ghosting's passes around their FFTs. */
PyObject *laplacian(PyObject *self, PyObject *args);
PyObject *windowed(PyObject *self, PyObject *args);
PyObject *moire_peak(PyObject *self, PyObject *args);
PyObject *moire_regional(PyObject *self, PyObject *args);

/* _blocks.c: a large image's block means, before its luminance. */
PyObject *block_mean(PyObject *self, PyObject *args);

#endif
