/* The quality signals' passes over the image and its luminance plane, in C: what numpy does in
 * a few dozen passes of 50-150 k values, each read here once and kept in cache.
 *
 * What it does for whom: channel_clipped's count (signals.py; the image's luminance, extrema,
 * that count and the levels together are _pass.c's one pass, luma.py), float16 widened to
 * float32; the plane's differences, their energies, the
 * sharpest region's tiles and noise's blocks in one pass (differences.py); the levels exposure
 * and tone count (measure.py); shake's tile energies (scenes.py); and the small choices made
 * from those (the sharpest region, shake's tile, blockiness's medians, perspective's border
 * statistics, tone's key, constant's variance). moire's and ghosting's steps around their FFTs
 * are in _spectra.c, built into this module (its functions are in the table at the end).
 *
 * What MUST hold: every per-pixel value is the float32 arithmetic of the numpy code it replaces
 * (the same subtractions in the same order: a difference of differences, never a - 2b + c; no
 * product fused into a sum: setup.py builds with -ffp-contract=off); only the order of the sums
 * differs (in float per column, tile or lane, totals in double), so a statistic may move in its
 * last bits and never more; a count, an order statistic or a choice made from the same sums is
 * numpy's exactly. The numpy code stays the reference and the fallback where this module is not
 * built; tests/unit/test_quality_kernels.py holds both to that on real photographs, their
 * degraded copies and values at every edge.
 *
 * No numpy headers: arrays come in through the buffer protocol (C-contiguous, their format
 * checked: float32 or uint8 in this machine's byte order), outputs go into buffers the caller
 * allocated. The GIL is released around the long loops; nothing is global, so calls from
 * several threads at once are safe.
 */
#include "_kernels.h"
#include <stdlib.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Tile sums of one row of tiles: out[b] = the sum of acc[b*tw .. (b+1)*tw - 1], then acc
 * zeroed for the next row of tiles. */
static void fold_tiles(float *acc, float *out, Py_ssize_t tiles, Py_ssize_t tw) {
    for (Py_ssize_t b = 0; b < tiles; b++) {
        float s = 0.0f;
        for (Py_ssize_t c = b * tw; c < (b + 1) * tw; c++)
            s += acc[c];
        out[b] = s;
    }
    memset(acc, 0, sizeof(float) * (size_t)(tiles * tw));
}

/* Per-column sums of one row's squared first differences across x, columns [from, to): into
 * ``all`` and, where given, ``region``. */
VEC static void add_first_x(const float *restrict a, float *restrict all, float *restrict region,
                            Py_ssize_t from, Py_ssize_t to) {
    if (region != NULL) {
        for (Py_ssize_t c = from; c < to; c++) {
            float g = a[c + 1] - a[c];
            all[c] += g * g;
            region[c] += g * g;
        }
    } else {
        for (Py_ssize_t c = from; c < to; c++) {
            float g = a[c + 1] - a[c];
            all[c] += g * g;
        }
    }
}

/* The same for values already computed (a row of second differences across x). */
VEC static void add_squares(const float *restrict q, float *restrict all, float *restrict region,
                            Py_ssize_t from, Py_ssize_t to) {
    if (region != NULL) {
        for (Py_ssize_t c = from; c < to; c++) {
            all[c] += q[c] * q[c];
            region[c] += q[c] * q[c];
        }
    } else {
        for (Py_ssize_t c = from; c < to; c++)
            all[c] += q[c] * q[c];
    }
}

VEC static void add_first_y(const float *restrict a, const float *restrict b,
                            float *restrict region, Py_ssize_t to) {
    for (Py_ssize_t c = 0; c < to; c++) {
        float g = b[c] - a[c];
        region[c] += g * g;
    }
}

/* Second differences across y of rows a, b, d: (d - b) - (b - a), squared, per column. */
VEC static void add_second_y(const float *restrict a, const float *restrict b,
                             const float *restrict d, float *restrict all, float *restrict region,
                             Py_ssize_t from, Py_ssize_t to) {
    if (region != NULL) {
        for (Py_ssize_t c = from; c < to; c++) {
            float s = (d[c] - b[c]) - (b[c] - a[c]);
            all[c] += s * s;
            region[c] += s * s;
        }
    } else {
        for (Py_ssize_t c = from; c < to; c++) {
            float s = (d[c] - b[c]) - (b[c] - a[c]);
            all[c] += s * s;
        }
    }
}

/* |(q2 - q1) - (q1 - q0)|, per column: Immerkaer's mask from three rows of second differences
 * across x. */
VEC static void add_immerkaer(const float *restrict q0, const float *restrict q1,
                              const float *restrict q2, float *restrict out, Py_ssize_t to) {
    for (Py_ssize_t c = 0; c < to; c++) {
        float m = (q2[c] - q1[c]) - (q1[c] - q0[c]);
        out[c] += m < 0 ? -m : m;
    }
}

/* differences(plane, h, w, tiles, block, gx_energy, gy_energy, region, blocks)
 *   -> (sum of squared second differences across x, the same across y)
 *
 * gx_energy (w-1): per column boundary, the squared first difference across x summed over rows.
 * gy_energy (h-1): per row boundary, the squared first difference across y summed over columns.
 * region (4 x tiles x tiles): tile sums of the squared gx, gy, second-across-x, second-across-y
 *   over the first h4 = (h-2)//tiles*tiles rows and w4 columns (as signals.sharpest_region).
 * blocks ((h-2)//block x (w-2)//block): block sums of |Immerkaer's mask| (as signals.noise).
 */
static PyObject *differences(PyObject *self, PyObject *args) {
    PyObject *o_plane, *o_gx, *o_gy, *o_region, *o_blocks;
    Py_ssize_t h, w, tiles, block;
    if (!PyArg_ParseTuple(args, "OnnnnOOOO", &o_plane, &h, &w, &tiles, &block, &o_gx, &o_gy,
                          &o_region, &o_blocks))
        return NULL;
    if (h < 3 || w < 3 || tiles < 1 || block < 1) {
        PyErr_SetString(PyExc_ValueError, "differences: the plane needs 3 x 3 or more");
        return NULL;
    }
    Py_ssize_t h4 = (h - 2) / tiles * tiles, w4 = (w - 2) / tiles * tiles;
    Py_ssize_t th = h4 / tiles, tw = w4 / tiles;
    Py_ssize_t hb = (h - 2) / block, wb = (w - 2) / block;
    Buf plane, gx, gy, region, blocks;
    plane.held = gx.held = gy.held = region.held = blocks.held = 0;
    PyObject *result = NULL;
    float *work = NULL;
    if (get_f32(o_plane, &plane, h * w, 0, "plane") < 0 ||
        get_f32(o_gx, &gx, w - 1, 1, "gx_energy") < 0 ||
        get_f32(o_gy, &gy, h - 1, 1, "gy_energy") < 0 ||
        get_f32(o_region, &region, 4 * tiles * tiles, 1, "region") < 0 ||
        get_f32(o_blocks, &blocks, hb * wb, 1, "blocks") < 0)
        goto done;
    /* Work rows: the second differences across x of three rows (a ring), the per-column
     * accumulators of the four region sums, of the noise blocks, of both second energies. */
    work = (float *)calloc((size_t)(3 * w + 4 * w + w + 2 * w), sizeof(float));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *p = (const float *)plane.view.buf;
    float *gxe = (float *)gx.view.buf, *gye = (float *)gy.view.buf;
    float *reg = (float *)region.view.buf, *blk = (float *)blocks.view.buf;
    double rows_total = 0.0, cols_total = 0.0;
    Py_BEGIN_ALLOW_THREADS
    float *ring = work;                    /* 3 rows of w: second differences across x */
    float *acc = work + 3 * w;             /* 4 rows of w: region sums of gx, gy, rows, cols */
    float *bacc = work + 7 * w;            /* 1 row of w: noise block sums */
    float *racc = work + 8 * w;            /* second-across-x energy, per column */
    float *cacc = work + 9 * w;            /* second-across-y energy, per column */
    const Py_ssize_t t2 = tiles * tiles;
    memset(gxe, 0, sizeof(float) * (size_t)(w - 1));
    memset(reg, 0, sizeof(float) * (size_t)(4 * t2));
    /* rows of the second difference across x for rows 0 and 1 */
    for (Py_ssize_t r = 0; r < 2; r++) {
        const float *a = p + r * w;
        float *q = ring + r * w;
        for (Py_ssize_t c = 0; c + 2 < w; c++)
            q[c] = (a[c + 2] - a[c + 1]) - (a[c + 1] - a[c]);
    }
    for (Py_ssize_t r = 0; r < h; r++) {
        const float *a = p + r * w;
        const float *q0 = ring + (r % 3) * w;
        int region_row = r < h4;
        /* first and second differences across x; the region's columns first (branch-free
         * loops, so the compiler vectorises them) */
        Py_ssize_t split = region_row ? w4 : 0;
        add_first_x(a, gxe, region_row ? acc : NULL, 0, split);
        add_first_x(a, gxe, NULL, split, w - 1);
        add_squares(q0, racc, region_row ? acc + 2 * w : NULL, 0, split);
        add_squares(q0, racc, NULL, split, w - 2);
        if (r + 1 < h) {  /* first differences across y */
            const float *b = a + w;
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            Py_ssize_t c = 0;
            for (; c + 8 <= w; c += 8)
                for (int k = 0; k < 8; k++) {
                    float g = b[c + k] - a[c + k];
                    part[k] += g * g;
                }
            float tail = 0.0f;
            for (; c < w; c++) {
                float g = b[c] - a[c];
                tail += g * g;
            }
            gye[r] = ((part[0] + part[4]) + (part[1] + part[5])) +
                     ((part[2] + part[6]) + (part[3] + part[7])) + tail;
            if (region_row)
                add_first_y(a, b, acc + w, w4);
        }
        if (r + 2 < h) {  /* second differences across y; Immerkaer's mask */
            const float *b = a + w, *d = a + 2 * w;
            add_second_y(a, b, d, cacc, region_row ? acc + 3 * w : NULL, 0, split);
            add_second_y(a, b, d, cacc, NULL, split, w);
            float *q2 = ring + ((r + 2) % 3) * w;
            for (Py_ssize_t c = 0; c + 2 < w; c++)
                q2[c] = (d[c + 2] - d[c + 1]) - (d[c + 1] - d[c]);
            if (r < hb * block) {
                add_immerkaer(q0, ring + ((r + 1) % 3) * w, q2, bacc, wb * block);
                if ((r + 1) % block == 0) {
                    float *row = blk + (r / block) * wb;
                    for (Py_ssize_t j = 0; j < wb; j++) {
                        float s = 0.0f;
                        for (Py_ssize_t c = j * block; c < (j + 1) * block; c++)
                            s += bacc[c];
                        row[j] = s;
                    }
                    memset(bacc, 0, sizeof(float) * (size_t)w);
                }
            }
        }
        if (region_row && (r + 1) % th == 0) {
            Py_ssize_t i = r / th;
            for (int k = 0; k < 4; k++)
                fold_tiles(acc + k * w, reg + k * t2 + i * tiles, tiles, tw);
        }
    }
    for (Py_ssize_t c = 0; c < w; c++) {
        rows_total += racc[c];
        cols_total += cacc[c];
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("dd", rows_total, cols_total);
done:
    free(work);
    release(&plane);
    release(&gx);
    release(&gy);
    release(&region);
    release(&blocks);
    return result;
}

/* Columns 0, 2, ..., 2m of a row into even[0..m], columns 1, 3, ..., 2m+1 into odd[0..m]. */
VEC static void deinterleave(const float *restrict row, float *restrict even,
                             float *restrict odd, Py_ssize_t m) {
    for (Py_ssize_t j = 0; j <= m; j++) {
        even[j] = row[2 * j];
        odd[j] = row[2 * j + 1];
    }
}

/* One direction of shake: (after - c)² into first, ((after + before) - (c + c))² into second. */
VEC static void add_pair(const float *restrict after, const float *restrict before,
                         const float *restrict c, float *restrict first,
                         float *restrict second, Py_ssize_t m) {
    for (Py_ssize_t j = 0; j < m; j++) {
        float f = after[j] - c[j];
        float s = (after[j] + before[j]) - (c[j] + c[j]);
        first[j] += f * f;
        second[j] += s * s;
    }
}

/* shake(plane, h, w, tiles, out): scenes.shake's tile energies. On every other pixel of every
 * other row (centre (2i+1, 2j+1), i < n = th*tiles, j < m = tw*tiles with th = (h-2)//(2 tiles)),
 * per direction (0,1), (1,0), (1,1), (1,-1): the squared first difference (after - centre) and
 * the squared second ((after + before) - (centre + centre)), summed per tile.
 * out: 2 x 4 x tiles x tiles (first, then second; directions in that order). */
static PyObject *shake(PyObject *self, PyObject *args) {
    PyObject *o_plane, *o_out;
    Py_ssize_t h, w, tiles;
    if (!PyArg_ParseTuple(args, "OnnnO", &o_plane, &h, &w, &tiles, &o_out))
        return NULL;
    Py_ssize_t th = (h - 2) / (2 * tiles), tw = (w - 2) / (2 * tiles);
    if (tiles < 1 || th < 1 || tw < 1) {
        PyErr_SetString(PyExc_ValueError, "shake: the plane is too small for its tiles");
        return NULL;
    }
    Py_ssize_t n = th * tiles, m = tw * tiles, t2 = tiles * tiles;
    Buf plane, out;
    plane.held = out.held = 0;
    PyObject *result = NULL;
    float *acc = NULL;
    if (get_f32(o_plane, &plane, h * w, 0, "plane") < 0 ||
        get_f32(o_out, &out, 8 * t2, 1, "out") < 0)
        goto done;
    acc = (float *)calloc((size_t)(8 * m + 6 * (m + 1)), sizeof(float));
    if (acc == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *p = (const float *)plane.view.buf;
    float *o = (float *)out.view.buf;
    float *lat = acc + 8 * m;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *up = p + (2 * i) * w, *mid = up + w, *down = mid + w;
        /* each row's even and odd columns apart, so every neighbour is a contiguous run */
        float *eu = lat, *ou = lat + (m + 1), *em = lat + 2 * (m + 1), *om = lat + 3 * (m + 1);
        float *ed = lat + 4 * (m + 1), *od = lat + 5 * (m + 1);
        deinterleave(up, eu, ou, m);
        deinterleave(mid, em, om, m);
        deinterleave(down, ed, od, m);
        /* centre (2i+1, 2j+1) = om[j]; directions (0,1), (1,0), (1,1), (1,-1) */
        add_pair(em + 1, em, om, acc, acc + 4 * m, m);
        add_pair(od, ou, om, acc + m, acc + 5 * m, m);
        add_pair(ed + 1, eu, om, acc + 2 * m, acc + 6 * m, m);
        add_pair(ed, eu + 1, om, acc + 3 * m, acc + 7 * m, m);
        if ((i + 1) % th == 0) {
            Py_ssize_t row = i / th;
            for (int k = 0; k < 8; k++)
                fold_tiles(acc + k * m, o + k * t2 + row * tiles, tiles, tw);
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(acc);
    release(&plane);
    release(&out);
    return result;
}

/* levels' pass over whole blocks of 64 values, added to acc (see _kernels.h): float partial
 * sums, a double total per 64 values. image_pass (_pass.c) feeds it the plane's blocks as it
 * writes them, so both sum the same blocks in the same order. */
VEC void levels_blocks(const float *p, Py_ssize_t blocks, const LevelCuts *cut, LevelAcc *acc) {
    double total = acc->total;
    Py_ssize_t ink = 0, high = 0, white = 0, clip = 0, blown = 0;
    const float lo = cut->lo, hi = cut->hi, nw = cut->nw, cl = cut->cl, bl = cut->bl;
    for (Py_ssize_t i = 0; i < 64 * blocks; i += 64) {
        const float *restrict q = p + i;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (Py_ssize_t k = 0; k < 64; k += 8)
            for (int j = 0; j < 8; j++)
                part[j] += q[k + j];
        int a = 0, b = 0, c = 0;
        for (Py_ssize_t k = 0; k < 64; k++) {
            a += q[k] < lo;
            b += q[k] > hi;
            c += q[k] >= nw;
        }
        total += (double)(((part[0] + part[4]) + (part[1] + part[5])) +
                          ((part[2] + part[6]) + (part[3] + part[7])));
        ink += a;
        high += b;
        if (c) {
            white += c;
            for (Py_ssize_t k = 0; k < 64; k++) {
                clip += q[k] >= cl;
                blown += q[k] >= bl;
            }
        }
    }
    acc->total = total;
    acc->counts[0] += ink;
    acc->counts[1] += high;
    acc->counts[2] += white;
    acc->counts[3] += clip;
    acc->counts[4] += blown;
}

/* The last n (< 64) values, one at a time. */
void levels_tail(const float *p, Py_ssize_t n, const LevelCuts *cut, LevelAcc *acc) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float v = p[i];
        acc->total += v;
        acc->counts[0] += v < cut->lo;
        acc->counts[1] += v > cut->hi;
        acc->counts[2] += v >= cut->nw;
        acc->counts[3] += v >= cut->cl;
        acc->counts[4] += v >= cut->bl;
    }
}

/* levels(plane, n, mid_low, mid_high, near_white, clipped, blown)
 *   -> (sum, under mid_low, over mid_high, >= near_white, >= clipped, >= blown) */
static PyObject *levels(PyObject *self, PyObject *args) {
    PyObject *o_plane;
    Py_ssize_t n;
    float lo, hi, nw, cl, bl;
    if (!PyArg_ParseTuple(args, "Onfffff", &o_plane, &n, &lo, &hi, &nw, &cl, &bl))
        return NULL;
    Buf plane;
    if (get_f32(o_plane, &plane, n, 0, "plane") < 0)
        return NULL;
    const float *p = (const float *)plane.view.buf;
    LevelCuts cut = {lo, hi, nw, cl, bl};
    LevelAcc acc = {0.0, {0, 0, 0, 0, 0}};
    Py_BEGIN_ALLOW_THREADS
    levels_blocks(p, n / 64, &cut, &acc);
    levels_tail(p + n / 64 * 64, n % 64, &cut, &acc);
    Py_END_ALLOW_THREADS
    release(&plane);
    return Py_BuildValue("dnnnnn", acc.total, acc.counts[0], acc.counts[1], acc.counts[2],
                         acc.counts[3], acc.counts[4]);
}

/* The luminance of n interleaved float32 pixels of `stride` channels, their first three mixed:
 * the sums of _pass.c's planar mix, in its order. */
VEC static void mix_f32_pixels(const float *restrict x, Py_ssize_t stride, float *restrict out,
                               Py_ssize_t n, float g0, float g1, float g2, float offset) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *p = x + i * stride;
        float v = g0 * p[0];
        v += g1 * p[1];
        v += g2 * p[2];
        out[i] = v - offset;
    }
}

/* mix(image, n, stride, g0, g1, g2, offset, out) -> None. image: n x stride float32 (HWC, its
 * first three channels mixed); out: n float32. For the HWC planes luma.luminance mixes
 * itself (down-sampled, or a float image): numpy's `@` would sum them through BLAS, whose
 * rounding differs by CPU, and a product per channel over strided views costs 3x this. */
static PyObject *mix(PyObject *self, PyObject *args) {
    PyObject *o_image, *o_out;
    Py_ssize_t n, stride;
    float g0, g1, g2, offset;
    if (!PyArg_ParseTuple(args, "Onnffff" "O", &o_image, &n, &stride, &g0, &g1, &g2, &offset,
                          &o_out))
        return NULL;
    if (n < 0 || stride < 3 || (n > 0 && stride > PY_SSIZE_T_MAX / n)) {
        PyErr_SetString(PyExc_ValueError, "mix: expected n >= 0 pixels of at least 3 channels");
        return NULL;
    }
    Buf image, out;
    image.held = out.held = 0;
    PyObject *result = NULL;
    if (get_f32(o_out, &out, n, 1, "out") < 0 || get_f32(o_image, &image, stride * n, 0,
                                                         "image") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    mix_f32_pixels((const float *)image.view.buf, stride, (float *)out.view.buf, n, g0, g1, g2,
                   offset);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&image);
    release(&out);
    return result;
}

/* clipped(image, h, w, planar, top, light) -> (light pixels with a channel at its top, pixels
 * looked at), on every other row and column, as signals.channel_clipped counts them: a pixel
 * counts when its largest channel is >= top and the sum of its three channels, added in
 * channel order, is >= light. planar: 3 x h x w float32; else h x w x 3 uint8 (top and light
 * then the integer thresholds the caller derived from the float ones). */
VEC static Py_ssize_t clipped_f32(const float *restrict x, Py_ssize_t h, Py_ssize_t w,
                                  float top, float light) {
    const float *c0 = x, *c1 = x + h * w, *c2 = x + 2 * h * w;
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < h; i += 2)
        hits += clipped_row_f32(c0 + i * w, c1 + i * w, c2 + i * w, w, top, light);
    return hits;
}

VEC static Py_ssize_t clipped_u8(const unsigned char *restrict x, Py_ssize_t h, Py_ssize_t w,
                                 int top, int light) {
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < h; i += 2)
        hits += clipped_row_u8(x + 3 * i * w, w, top, light);
    return hits;
}

static PyObject *clipped(PyObject *self, PyObject *args) {
    PyObject *o_image;
    Py_ssize_t h, w;
    int planar;
    double top, light;
    if (!PyArg_ParseTuple(args, "Onnpdd", &o_image, &h, &w, &planar, &top, &light))
        return NULL;
    Buf image;
    image.held = 0;
    Py_ssize_t hits = 0, looked = ((h + 1) / 2) * ((w + 1) / 2);
    if (planar) {
        if (get_f32(o_image, &image, 3 * h * w, 0, "image") < 0)
            return NULL;
        float t = (float)top, l = (float)light;
        Py_BEGIN_ALLOW_THREADS
        hits = clipped_f32((const float *)image.view.buf, h, w, t, l);
        Py_END_ALLOW_THREADS
    } else {
        if (PyObject_GetBuffer(o_image, &image.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        image.held = 1;
        if (image.view.itemsize != 1 || !native_format(image.view.format, 'B') ||
            image.view.len < 3 * h * w) {
            release(&image);
            PyErr_SetString(PyExc_TypeError, "image: expected h x w x 3 uint8 values");
            return NULL;
        }
        int t = (int)top, l = (int)light;
        Py_BEGIN_ALLOW_THREADS
        hits = clipped_u8((const unsigned char *)image.view.buf, h, w, t, l);
        Py_END_ALLOW_THREADS
    }
    release(&image);
    return Py_BuildValue("nn", hits, looked);
}

/* log_sum(plane, n, step, delta) -> the sum of log(x + delta) over every step-th value, x +
 * delta in float32 (as numpy adds them). The logarithms of products of 64 values at a time
 * (each factor is in [delta, 1 + delta], so a product of 64 stays far inside a double's range):
 * the same sum to a double's precision, 64x fewer logarithms. */
VEC static double log_sum_pass(const float *restrict p, Py_ssize_t n, Py_ssize_t step,
                               float delta) {
    Py_ssize_t count = (n + step - 1) / step, i = 0;
    double total = 0.0;
    for (; i + 64 <= count; i += 64) {
        double lane[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        for (Py_ssize_t k = 0; k < 64; k += 8)
            for (int j = 0; j < 8; j++)
                lane[j] *= (double)(p[(i + k + j) * step] + delta);
        total += log(((lane[0] * lane[1]) * (lane[2] * lane[3])) *
                     ((lane[4] * lane[5]) * (lane[6] * lane[7])));
    }
    double rest = 1.0;
    for (; i < count; i++)
        rest *= (double)(p[i * step] + delta);
    return total + log(rest);
}

static PyObject *log_sum(PyObject *self, PyObject *args) {
    PyObject *o_plane;
    Py_ssize_t n, step;
    float delta;
    if (!PyArg_ParseTuple(args, "Onnf", &o_plane, &n, &step, &delta))
        return NULL;
    if (step < 1 || delta <= 0.0f) {
        PyErr_SetString(PyExc_ValueError, "log_sum: step >= 1 and delta > 0");
        return NULL;
    }
    Buf plane;
    if (get_f32(o_plane, &plane, n, 0, "plane") < 0)
        return NULL;
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = log_sum_pass((const float *)plane.view.buf, n, step, delta);
    Py_END_ALLOW_THREADS
    release(&plane);
    return PyFloat_FromDouble(total);
}

/* float16 bit patterns to float32, bit for bit as numpy's astype: the exponent re-biased,
 * infinities and NaN re-biased once more (their payload kept), subnormals and zeros by an exact
 * float subtraction (2^-14 (1 + m/1024) - 2^-14 = m 2^-24), written so it vectorises. */
typedef union {
    uint32_t u;
    float f;
} Bits;

VEC static void widen_pass(const uint16_t *restrict h, uint32_t *restrict out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x = h[i];
        uint32_t o = (x & 0x7fffu) << 13, e = o & 0x0f800000u;
        o += 0x38000000u;
        o += 0x38000000u & -(uint32_t)(e == 0x0f800000u);
        Bits t;
        t.u = o + 0x00800000u;
        t.f -= 6.103515625e-05f;
        uint32_t low = -(uint32_t)(e == 0);  /* masks, not branches: the loop vectorises */
        o = (t.u & low) | (o & ~low);
        out[i] = o | ((x & 0x8000u) << 16);
    }
}

static PyObject *widen_float16(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO", &o_src, &n, &o_out))
        return NULL;
    Buf src, out;
    src.held = out.held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o_src, &src.view, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    src.held = 1;
    if (src.view.itemsize != 2 || src.view.len < 2 * n) {
        PyErr_Format(PyExc_ValueError, "src: expected %zd float16 values", n);
        goto done;
    }
    if (get_f32(o_out, &out, n, 1, "out") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    widen_pass((const uint16_t *)src.view.buf, (uint32_t *)out.view.buf, n);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&src);
    release(&out);
    return result;
}

/* The k-th largest of n floats (k >= 1, k <= n), by partial selection (n is at most 64). */
static float kth_largest(float *v, Py_ssize_t n, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t best = i;
        for (Py_ssize_t j = i + 1; j < n; j++)
            if (v[j] > v[best])
                best = j;
        float t = v[i];
        v[i] = v[best];
        v[best] = t;
    }
    return v[k - 1];
}

/* numpy's float32 sum of 16 contiguous values (its pairwise sum: eight running sums). */
static float sum16(const float *a) {
    float r[8];
    for (int j = 0; j < 8; j++)
        r[j] = a[j] + a[8 + j];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* region_pick(region, tiles) -> signals.sharpest_region's value from differences' region
 * tiles (4 x tiles x tiles: gx, gy, second across x, second across y), as its numpy code
 * reads them: the tiles holding at least the mean gradient energy (and some along both axes),
 * the lower axis's ratio of each, the second largest (the only one when one; 0 when none). */
static PyObject *region_pick(PyObject *self, PyObject *args) {
    PyObject *o_region;
    Py_ssize_t tiles;
    if (!PyArg_ParseTuple(args, "On", &o_region, &tiles))
        return NULL;
    if (tiles != 4) {
        PyErr_SetString(PyExc_ValueError, "region_pick: 4 x 4 tiles only");
        return NULL;
    }
    Buf region;
    if (get_f32(o_region, &region, 4 * 16, 0, "region") < 0)
        return NULL;
    const float *ex = (const float *)region.view.buf, *ey = ex + 16, *er = ex + 32,
                *ec = ex + 48;
    float both[16], sum[16];
    Py_ssize_t n = 0;
    for (int i = 0; i < 16; i++)
        sum[i] = ex[i] + ey[i];
    float mean = sum16(sum) / 16.0f;
    for (int i = 0; i < 16; i++) {
        if (sum[i] >= mean && ex[i] > 1e-9f && ey[i] > 1e-9f) {
            float a = er[i] / ex[i], b = ec[i] / ey[i];
            both[n++] = (a != a || b != b) ? NAN : (a < b ? a : b);
        }
    }
    release(&region);
    if (n == 0)
        return PyFloat_FromDouble(0.0);
    return PyFloat_FromDouble(n >= 2 ? kth_largest(both, n, 2) : both[0]);
}

/* shake_pick(sums, tiles, area, sigma, edge, rank) -> (value, edge tiles) of scenes.shake from
 * its tile sums (2 x 4 x tiles x tiles), as its numpy code reads them: energies per sample
 * (float32), a tile counted when a direction's first-difference energy passes 2 sigma^2 edge
 * (+1e-9), the noise's share (2 sigma^2, 6 sigma^2) taken off, floors, the lowest direction's
 * ratio, the rank-th largest counted tile (the lowest when fewer). (2.0, 0) with none. */
static PyObject *shake_pick(PyObject *self, PyObject *args) {
    PyObject *o_sums;
    Py_ssize_t tiles, area, rank;
    double sigma, edge;
    if (!PyArg_ParseTuple(args, "Onndnd", &o_sums, &tiles, &area, &sigma, &rank, &edge))
        return NULL;
    Py_ssize_t t2 = tiles * tiles;
    if (tiles < 1 || t2 > 64 || rank < 1 || area < 1) {
        PyErr_SetString(PyExc_ValueError, "shake_pick: 1 to 8 tiles a side, rank and area >= 1");
        return NULL;
    }
    Buf sums;
    if (get_f32(o_sums, &sums, 8 * t2, 0, "sums") < 0)
        return NULL;
    const float *e = (const float *)sums.view.buf;
    float a = (float)area, sf = (float)sigma;
    double n2 = (double)sf * (double)sf;  /* np.float32(sigma) ** 2 is a float64 */
    float threshold = (float)(2.0 * n2 * edge + 1e-9);  /* compared in float32, as numpy does */
    float first_share = (float)(2.0 * n2), second_share = (float)(6.0 * n2);
    float counted[64];
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t2; i++) {
        int is_edge = 0;
        float ratio = 0.0f;
        for (int d = 0; d < 4; d++) {
            float first = e[d * t2 + i] / a, second = e[(4 + d) * t2 + i] / a;
            is_edge |= first > threshold;
            first -= first_share;
            second -= second_share;
            first = first > 1e-12f ? first : 1e-12f;
            second = second > 0.0f ? second : 0.0f;
            float r = second / first;
            ratio = d == 0 || r < ratio ? r : ratio;
        }
        if (is_edge)
            counted[n++] = ratio;
    }
    release(&sums);
    if (n == 0)
        return Py_BuildValue("dn", 2.0, (Py_ssize_t)0);
    float value = kth_largest(counted, n, rank < n ? rank : n);
    return Py_BuildValue("dn", (double)value, n);
}

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The k-th smallest (0-based) of n floats, reordering them (no NaN among them): quickselect,
 * and a sort of what is left once it has taken more rounds than good pivots need (a client
 * sends the border values perspective selects from: a crafted order cannot make it quadratic). */
static float kth_smallest(float *v, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    int rounds = 8;
    for (Py_ssize_t m = n; m > 1; m >>= 1)
        rounds += 2;
    while (lo < hi) {
        if (rounds-- == 0) {
            qsort(v + lo, (size_t)(hi - lo + 1), sizeof(float), compare_floats);
            return v[k];
        }
        float pivot = v[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    return v[k];
}

/* One axis of signals.blockiness: at each boundary of the 8-px grid (7, 15, ... with a middle
 * 4 after it), the energy across it over the mean of the two across the block middles beside
 * it (3 and 11 from the block's start, at least floor), and the median (the upper one of an
 * even count, as numpy's partition at n // 2 picks). In float32, as numpy computes it. */
static int grid_ratio(const float *e, Py_ssize_t size, float floor, double *out) {
    Py_ssize_t n = size > 11 ? (size - 12) / 8 + 1 : 0;  /* len(range(7, size - 4, 8)) */
    if (n <= 0) {
        *out = NAN;
        return 0;
    }
    float small[64];
    float *r = n <= 64 ? small : (float *)malloc(sizeof(float) * (size_t)n);
    if (r == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        float beside = (e[3 + 8 * i] + e[11 + 8 * i]) * 0.5f;
        beside = beside > floor ? beside : floor;
        r[i] = e[7 + 8 * i] / beside;
    }
    *out = kth_smallest(r, n, n / 2);
    if (r != small)
        free(r);
    return 0;
}

/* blockiness(gx_energy, gy_energy, width, height, flat) -> (ratio across x, ratio across y);
 * flat: the per-pixel energy below which a line counts as flat (times the line's length). */
static PyObject *blockiness(PyObject *self, PyObject *args) {
    PyObject *o_gx, *o_gy;
    Py_ssize_t w, h;
    double flat;
    if (!PyArg_ParseTuple(args, "OOnnd", &o_gx, &o_gy, &w, &h, &flat))
        return NULL;
    if (w < 17 || h < 17) {
        PyErr_SetString(PyExc_ValueError, "blockiness: the plane needs 17 x 17 or more");
        return NULL;
    }
    Buf gx, gy;
    gx.held = gy.held = 0;
    PyObject *result = NULL;
    double rx, ry;
    if (get_f32(o_gx, &gx, w - 1, 0, "gx_energy") < 0 ||
        get_f32(o_gy, &gy, h - 1, 0, "gy_energy") < 0)
        goto done;
    /* the floor in float32, as numpy's maximum with a Python float compares it */
    if (grid_ratio((const float *)gx.view.buf, w - 1, (float)(flat * (double)w), &rx) < 0 ||
        grid_ratio((const float *)gy.view.buf, h - 1, (float)(flat * (double)h), &ry) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("dd", rx, ry);
done:
    release(&gx);
    release(&gy);
    return result;
}

/* centred_energy(plane, n, mean) -> the sum of (x - mean)^2, each difference in float32 (as
 * numpy subtracts a float32 mean), the squares summed in float per 64 values, then in double. */
VEC static double centred_pass(const float *restrict p, Py_ssize_t n, float mean) {
    double total = 0.0;
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (Py_ssize_t k = 0; k < 64; k += 8)
            for (int j = 0; j < 8; j++) {
                float d = p[i + k + j] - mean;
                part[j] += d * d;
            }
        total += (double)(((part[0] + part[4]) + (part[1] + part[5])) +
                          ((part[2] + part[6]) + (part[3] + part[7])));
    }
    for (; i < n; i++) {
        float d = p[i] - mean;
        total += (double)(d * d);
    }
    return total;
}

static PyObject *centred_energy(PyObject *self, PyObject *args) {
    PyObject *o_plane;
    Py_ssize_t n;
    float mean;
    if (!PyArg_ParseTuple(args, "Onf", &o_plane, &n, &mean))
        return NULL;
    Buf plane;
    if (get_f32(o_plane, &plane, n, 0, "plane") < 0)
        return NULL;
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = centred_pass((const float *)plane.view.buf, n, mean);
    Py_END_ALLOW_THREADS
    release(&plane);
    return PyFloat_FromDouble(total);
}

/* borders(plane, h, w) -> per side (left, right, top, bottom): its median and half its
 * interquartile range, the order statistics n // 4, n // 2 and 3 n // 4 of its n values (as
 * numpy's partition picks them: exact), the half range in float32 as numpy computes it. */
static PyObject *borders(PyObject *self, PyObject *args) {
    PyObject *o_plane;
    Py_ssize_t h, w;
    if (!PyArg_ParseTuple(args, "Onn", &o_plane, &h, &w))
        return NULL;
    if (h < 1 || w < 1) {
        PyErr_SetString(PyExc_ValueError, "borders: an empty plane");
        return NULL;
    }
    Buf plane;
    if (get_f32(o_plane, &plane, h * w, 0, "plane") < 0)
        return NULL;
    const float *p = (const float *)plane.view.buf;
    Py_ssize_t most = h > w ? h : w;
    float *v = (float *)malloc(sizeof(float) * (size_t)most);
    if (v == NULL) {
        release(&plane);
        return PyErr_NoMemory();
    }
    double out[8];
    for (int side = 0; side < 4; side++) {
        Py_ssize_t n = side < 2 ? h : w;
        for (Py_ssize_t i = 0; i < n; i++)
            v[i] = side == 0 ? p[i * w] : side == 1 ? p[i * w + w - 1]
                 : side == 2 ? p[i] : p[(h - 1) * w + i];
        /* each statistic from the whole side: selection reorders, the values stay */
        float q1 = kth_smallest(v, n, n / 4);
        float med = kth_smallest(v, n, n / 2);
        float q3 = kth_smallest(v, n, 3 * n / 4);
        out[2 * side] = med;
        out[2 * side + 1] = (q3 - q1) * 0.5f;
    }
    free(v);
    release(&plane);
    return Py_BuildValue("dddddddd", out[0], out[1], out[2], out[3], out[4], out[5], out[6],
                         out[7]);
}

static PyMethodDef methods[] = {
    {"differences", differences, METH_VARARGS,
     "The luminance plane's difference energies, region tiles and noise blocks in one pass."},
    {"shake", shake, METH_VARARGS, "scenes.shake's tile energies on the parity lattice."},
    {"levels", levels, METH_VARARGS, "The plane's sum and its counts by level."},
    {"clipped", clipped, METH_VARARGS, "channel_clipped's count of light clipped pixels."},
    {"borders", borders, METH_VARARGS, "perspective's border medians and spreads."},
    {"blockiness", blockiness, METH_VARARGS, "blockiness's grid ratio along each axis."},
    {"centred_energy", centred_energy, METH_VARARGS, "The sum of squares about a mean."},
    {"region_pick", region_pick, METH_VARARGS, "sharpest_region's value from its tiles."},
    {"shake_pick", shake_pick, METH_VARARGS, "shake's value from its tile sums."},
    {"log_sum", log_sum, METH_VARARGS, "tone's sum of logarithms over every step-th value."},
    {"widen_float16", widen_float16, METH_VARARGS, "float16 to float32, bit for bit."},
    {"image_pass", image_pass, METH_VARARGS,
     "The luminance, extrema, clipped count and levels of an image in one pass (_pass.c)."},
    {"mix", mix, METH_VARARGS, "HWC float32 pixels' first three channels mixed into a plane."},
    {"block_mean", block_mean, METH_VARARGS, "A large image's k x k block means, float32."},
    {"laplacian", laplacian, METH_VARARGS, "A window's Laplacian, as moire and ghosting take it."},
    {"windowed", windowed, METH_VARARGS, "moire's centred, Hann-windowed Laplacian and its energy."},
    {"moire_peak", moire_peak, METH_VARARGS, "moire's twin peak from its half power spectrum."},
    {"moire_regional", moire_regional, METH_VARARGS,
     "moire's relaxed twin peak of one region's half power spectrum."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "filters.quality._kernels",
    "The quality signals' passes over the luminance plane, fused (see _kernels.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
