/* The image's one pass: what signals.image_signals reads off the input itself, read in a
 * single walk down its rows, so the input comes from memory once and the plane is counted
 * while it is still in cache.
 *
 * Why: it replaces four calls (luminance with its extrema, channel_clipped's count, the plane's
 * levels), each with its own buffer checks, and the input's second and third reads. Measured
 * on a 224 x 224 FP32 photograph: 47 -> 44 us with the caches cold, the same warm (the loops
 * are bound by memory either way); the signals together ~6 us less warm, ~11 us cold.
 *
 * What MUST hold: every result is the separate passes' exactly. The plane is mix_f32's / mix_u8's
 * float32 arithmetic per pixel (same products, same order; -ffp-contract=off); the extrema and
 * counts do not depend on order; the levels' sum runs over the same blocks of 64 plane values
 * in the same order (levels_blocks / levels_tail of _kernels.c, called as rows complete).
 * tests/unit/test_quality_kernels.py compares it with the separate passes and with numpy.
 */
#include "_kernels.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_ssize_t h, w;
    float g0, g1, g2, offset;
    LevelCuts cut;
} PassArgs;

typedef struct {
    int32_t mn, mx;  /* the float extrema as keys: bits, sign folded, in integer order */
    int odd;  /* a NaN or an infinity seen */
    int lo8, hi8;  /* uint8 extrema */
    Py_ssize_t hits;  /* channel_clipped's count */
    LevelAcc levels;
} PassOut;

/* Levels over the plane's blocks of 64 that the rows written so far complete. */
static inline void count_ready(const float *plane, Py_ssize_t written, Py_ssize_t *counted,
                               const LevelCuts *cut, LevelAcc *acc) {
    Py_ssize_t blocks = (written - *counted) / 64;
    if (blocks > 0) {
        levels_blocks(plane + *counted, blocks, cut, acc);
        *counted += 64 * blocks;
    }
}

VEC static void pass_f32(const float *restrict x, float *restrict plane, const PassArgs *a,
                         float top, float light, PassOut *o) {
    const Py_ssize_t h = a->h, w = a->w, n = h * w;
    const float g0 = a->g0, g1 = a->g1, g2 = a->g2, offset = a->offset;
    int32_t mn = INT32_MAX, mx = INT32_MIN, odd = 0;
    Py_ssize_t counted = 0, hits = 0;
    for (Py_ssize_t r = 0; r < h; r++) {
        const float *restrict x0 = x + r * w, *restrict x1 = x0 + n, *restrict x2 = x1 + n;
        float *restrict out = plane + r * w;
        for (Py_ssize_t i = 0; i < w; i++) {
            float v = g0 * x0[i];
            v += g1 * x1[i];
            v += g2 * x2[i];
            out[i] = v - offset;
        }
        for (int c = 0; c < 3; c++) {
            const int32_t *restrict b = (const int32_t *)(x0 + c * n);
            for (Py_ssize_t i = 0; i < w; i++) {
                int32_t v = b[i];
                odd |= (v & 0x7f800000) == 0x7f800000;
                int32_t key = v ^ ((v >> 31) & 0x7fffffff);
                mn = key < mn ? key : mn;
                mx = key > mx ? key : mx;
            }
        }
        if (r % 2 == 0)  /* channel_clipped: every other row and column */
            hits += clipped_row_f32(x0, x1, x2, w, top, light);
        count_ready(plane, (r + 1) * w, &counted, &a->cut, &o->levels);
    }
    levels_tail(plane + counted, n - counted, &a->cut, &o->levels);
    o->mn = mn;
    o->mx = mx;
    o->odd = odd;
    o->hits = hits;
}

VEC static void pass_u8(const unsigned char *restrict x, float *restrict plane,
                        const PassArgs *a, int top, int light, PassOut *o) {
    const Py_ssize_t h = a->h, w = a->w;
    const float g0 = a->g0, g1 = a->g1, g2 = a->g2, offset = a->offset;
    int mn = 255, mx = 0;
    Py_ssize_t counted = 0, hits = 0;
    for (Py_ssize_t r = 0; r < h; r++) {
        const unsigned char *restrict p = x + 3 * r * w;
        float *restrict out = plane + r * w;
        for (Py_ssize_t i = 0; i < w; i++) {
            int u = p[3 * i], v = p[3 * i + 1], c = p[3 * i + 2];
            float y = g0 * (float)u;
            y += g1 * (float)v;
            y += g2 * (float)c;
            out[i] = y - offset;
            mn = u < mn ? u : mn;
            mn = v < mn ? v : mn;
            mn = c < mn ? c : mn;
            mx = u > mx ? u : mx;
            mx = v > mx ? v : mx;
            mx = c > mx ? c : mx;
        }
        if (r % 2 == 0)
            hits += clipped_row_u8(p, w, top, light);
        count_ready(plane, (r + 1) * w, &counted, &a->cut, &o->levels);
    }
    levels_tail(plane + counted, h * w - counted, &a->cut, &o->levels);
    o->lo8 = mn;
    o->hi8 = mx;
    o->hits = hits;
}

/* image_pass(image, h, w, planar, g0, g1, g2, offset, out, top, light, mid_low, mid_high,
 *            near_white, clipped, blown)
 *   -> (min, max, clipped hits, pixels looked at, levels' sum, under mid_low, over mid_high,
 *       >= near_white, >= clipped, >= blown)
 * image: 3 x h x w float32 planes (planar) or h x w x 3 uint8 pixels; out: h x w float32, the
 * luminance before any clipping. The extrema as luminance() returns them (NaN, NaN when a
 * value is not finite); the clipped count as clipped() counts it with top and light; the
 * levels as levels() counts them over out. */
PyObject *image_pass(PyObject *self, PyObject *args) {
    PyObject *o_image, *o_out;
    Py_ssize_t h, w;
    int planar;
    float g0, g1, g2, offset;
    double top, light;
    LevelCuts cut;
    if (!PyArg_ParseTuple(args, "OnnpffffOddfffff", &o_image, &h, &w, &planar, &g0, &g1, &g2,
                          &offset, &o_out, &top, &light, &cut.lo, &cut.hi, &cut.nw, &cut.cl,
                          &cut.bl))
        return NULL;
    if (h < 1 || w < 1 || h > PY_SSIZE_T_MAX / 3 / w) {
        PyErr_SetString(PyExc_ValueError, "image_pass: expected h >= 1 and w >= 1");
        return NULL;
    }
    PassArgs a = {h, w, g0, g1, g2, offset, cut};
    PassOut o;
    memset(&o, 0, sizeof o);
    Buf image, out;
    image.held = out.held = 0;
    PyObject *result = NULL;
    double lo, hi;
    if (get_f32(o_out, &out, h * w, 1, "out") < 0)
        goto done;
    if (planar) {
        if (get_f32(o_image, &image, 3 * h * w, 0, "image") < 0)
            goto done;
        float t = (float)top, l = (float)light;
        Py_BEGIN_ALLOW_THREADS
        pass_f32((const float *)image.view.buf, (float *)out.view.buf, &a, t, l, &o);
        Py_END_ALLOW_THREADS
        int32_t mn = o.mn ^ ((o.mn >> 31) & 0x7fffffff), mx = o.mx ^ ((o.mx >> 31) & 0x7fffffff);
        float fl, fh;
        memcpy(&fl, &mn, sizeof fl);
        memcpy(&fh, &mx, sizeof fh);
        lo = o.odd ? Py_NAN : (double)fl;
        hi = o.odd ? Py_NAN : (double)fh;
    } else {
        if (get_values(o_image, &image, 3 * h * w, 0, "image", 'B', 1, "uint8") < 0)
            goto done;
        int t = (int)top, l = (int)light;
        Py_BEGIN_ALLOW_THREADS
        pass_u8((const unsigned char *)image.view.buf, (float *)out.view.buf, &a, t, l, &o);
        Py_END_ALLOW_THREADS
        lo = (double)o.lo8;
        hi = (double)o.hi8;
    }
    result = Py_BuildValue("ddnnd" "nnnnn", lo, hi, o.hits, ((h + 1) / 2) * ((w + 1) / 2),
                           o.levels.total, o.levels.counts[0], o.levels.counts[1],
                           o.levels.counts[2], o.levels.counts[3], o.levels.counts[4]);
done:
    release(&image);
    release(&out);
    return result;
}
