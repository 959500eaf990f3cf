/* moire's and ghosting's passes around their FFTs (scenes.py, echo.py): the Laplacian of a
 * window of the plane, moire's centred and Hann-windowed copy of it with its energy, and
 * moire's twin-peak search over the half power spectrum (two box sums per frequency from
 * running sums, their ratio, the band, the turned frequency, the highest). The FFTs stay
 * numpy's.
 *
 * The same rules as _kernels.c: every value is the arithmetic of the numpy code it replaces,
 * in the same order where numpy's order is defined (the Laplacian's subtractions, the running
 * sums of np.cumsum, the ratio, np.minimum, np.argmax's first highest); only the energy's sum
 * runs in another order than BLAS's, so it may differ in its last bits.
 */
#include "_kernels.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* laplacian(plane, h, w, top, left, rows, cols, out, out_w, out_offset): the 4-neighbour
 * Laplacian of the window plane[top:top+rows, left:left+cols] at its inner points, written
 * out[out_offset + (i-1)*out_w + (j-1)] for i in 1..rows-2, j in 1..cols-2. Each value is
 * numpy's (((4p - up) - down) - left) - right in float32. */
VEC static void laplacian_rows(const float *restrict p, Py_ssize_t w, Py_ssize_t rows,
                               Py_ssize_t cols, float *restrict out, Py_ssize_t out_w) {
    for (Py_ssize_t i = 1; i < rows - 1; i++) {
        const float *up = p + (i - 1) * w, *mid = p + i * w, *down = p + (i + 1) * w;
        float *o = out + (i - 1) * out_w;
        for (Py_ssize_t j = 1; j < cols - 1; j++)
            o[j - 1] = (((mid[j] * 4.0f - up[j]) - down[j]) - mid[j - 1]) - mid[j + 1];
    }
}

PyObject *laplacian(PyObject *self, PyObject *args) {
    PyObject *o_plane, *o_out;
    Py_ssize_t h, w, top, left, rows, cols, out_w, out_offset;
    if (!PyArg_ParseTuple(args, "OnnnnnnOnn", &o_plane, &h, &w, &top, &left, &rows, &cols,
                          &o_out, &out_w, &out_offset))
        return NULL;
    if (h < 1 || w < 1 || rows < 3 || cols < 3 || top < 0 || left < 0 || top > h - rows ||
        left > w - cols || out_w < cols - 2 || out_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "laplacian: the window is not inside the plane");
        return NULL;
    }
    Buf plane, out;
    if (get_f32(o_plane, &plane, h * w, 0, "plane") < 0)
        return NULL;
    if (get_f32(o_out, &out, out_offset + (rows - 3) * out_w + cols - 2, 1, "out") < 0) {
        release(&plane);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    laplacian_rows((const float *)plane.view.buf + top * w + left, w, rows, cols,
                   (float *)out.view.buf + out_offset, out_w);
    Py_END_ALLOW_THREADS
    release(&plane);
    release(&out);
    Py_RETURN_NONE;
}

/* windowed(lap, side, mean, hann) -> the energy: lap's inner (side-2)^2 values (rows and
 * columns 1..side-2 of side x side) made (v - mean) * hann in float32, in place, and the sum
 * of their squares (in float per row and lane, then in double: it only scales a floor). */
VEC static double window_rows(float *restrict lap, const float *restrict hann, Py_ssize_t side,
                              float mean) {
    double total = 0.0;
    for (Py_ssize_t i = 1; i < side - 1; i++) {
        float *row = lap + i * side;
        const float *win = hann + i * side;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        Py_ssize_t j = 1;
        for (; j + 8 <= side - 1; j += 8)
            for (int k = 0; k < 8; k++) {
                float v = (row[j + k] - mean) * win[j + k];
                row[j + k] = v;
                part[k] += v * v;
            }
        for (; j < side - 1; j++) {
            float v = (row[j] - mean) * win[j];
            row[j] = v;
            part[0] += v * v;
        }
        total += (double)(((part[0] + part[4]) + (part[1] + part[5])) +
                          ((part[2] + part[6]) + (part[3] + part[7])));
    }
    return total;
}

PyObject *windowed(PyObject *self, PyObject *args) {
    PyObject *o_lap, *o_hann;
    Py_ssize_t side;
    float mean;
    if (!PyArg_ParseTuple(args, "OnfO", &o_lap, &side, &mean, &o_hann))
        return NULL;
    if (side < 3) {
        PyErr_SetString(PyExc_ValueError, "windowed: a side under 3");
        return NULL;
    }
    Buf lap, hann;
    if (get_f32(o_lap, &lap, side * side, 1, "lap") < 0)
        return NULL;
    if (get_f32(o_hann, &hann, side * side, 0, "hann") < 0) {
        release(&lap);
        return NULL;
    }
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = window_rows((float *)lap.view.buf, (const float *)hann.view.buf, side, mean);
    Py_END_ALLOW_THREADS
    release(&lap);
    release(&hann);
    return PyFloat_FromDouble(total);
}

/* The sums of the (2r+1)^2 powers around every frequency (fy: every row, periodic; fx: the
 * first `out_cols` columns), from ext (rows x cw, its running sums down the rows taken), as
 * scenes._half_box_sums: the difference of two rows of running sums, its running sum along the
 * row, the difference of two of those. `scratch` holds 4 x cw values: four rows run side by
 * side, interleaved (each row's sum is still taken in order; the four fill a vector). */
VEC static void box_sums(const double *ext, Py_ssize_t cw, Py_ssize_t side,
                         Py_ssize_t out_cols, Py_ssize_t big, Py_ssize_t r,
                         double *restrict scratch, double *restrict out) {
    Py_ssize_t lo = big - r, hi = big + r + 1;
    for (Py_ssize_t fy0 = 0; fy0 < side; fy0 += 4) {
        Py_ssize_t n = side - fy0 < 4 ? side - fy0 : 4;
        for (Py_ssize_t g = 0; g < 4; g++) {
            const double *a = ext + (hi + fy0 + g) * cw, *b = ext + (lo + fy0 + g) * cw;
            for (Py_ssize_t k = 0; k < cw; k++)
                scratch[k * 4 + g] = g < n ? a[k] - b[k] : 0.0;
        }
        for (Py_ssize_t k = 1; k < cw; k++)
            for (Py_ssize_t g = 0; g < 4; g++)
                scratch[k * 4 + g] = scratch[(k - 1) * 4 + g] + scratch[k * 4 + g];
        for (Py_ssize_t g = 0; g < n; g++) {
            double *o = out + (fy0 + g) * out_cols;
            for (Py_ssize_t c = 0; c < out_cols; c++)
                o[c] = scratch[(hi + c) * 4 + g] - scratch[(lo + c) * 4 + g];
        }
    }
}

/* ext: rows 1+big .. big+side hold the half spectrum's power with `big` columns mirrored in
 * front of it (fx < 0: P(fy, fx) = P(-fy, -fx)) and, for a whole half, `big` behind it; `big`
 * rows wrapped above and below (fy is periodic); row 0 and column 0 zero; then the running
 * sums down every column (np.cumsum(axis=0)). The spectrum comes column by column (`width`
 * columns of `side` complex values, real and imaginary parts interleaved); a power is
 * re * re + im * im, as numpy squares and adds them. */
static double power_at(const double *spectrum, Py_ssize_t side, Py_ssize_t fy, Py_ssize_t fx) {
    const double *z = spectrum + 2 * (fx * side + fy);
    return z[0] * z[0] + z[1] * z[1];
}

static void extend(const double *spectrum, Py_ssize_t side, Py_ssize_t width, int truncated,
                   Py_ssize_t big, double *ext, Py_ssize_t cw) {
    Py_ssize_t body_w = cw - 1;
    for (Py_ssize_t fy = 0; fy < side; fy++) {
        double *e = ext + (1 + big + fy) * cw + 1;
        Py_ssize_t flipped = (side - fy) % side;
        for (Py_ssize_t c = 0; c < big; c++)
            e[c] = power_at(spectrum, side, flipped, big - c);
        for (Py_ssize_t k = 0; k < width; k++)
            e[big + k] = power_at(spectrum, side, fy, k);
        if (!truncated) {
            Py_ssize_t last = side % 2 ? width - 1 : width - 2;
            for (Py_ssize_t k = 0; k < big; k++)
                e[big + width + k] = power_at(spectrum, side, flipped, last - k);
        }
    }
    for (Py_ssize_t j = 0; j < big; j++) {
        memcpy(ext + (1 + j) * cw + 1, ext + (1 + side + j) * cw + 1, sizeof(double) * body_w);
        memcpy(ext + (1 + big + side + j) * cw + 1, ext + (1 + big + j) * cw + 1,
               sizeof(double) * body_w);
    }
    Py_ssize_t rows = side + 2 * big + 1;
    memset(ext, 0, sizeof(double) * (size_t)cw);
    for (Py_ssize_t i = 1; i < rows; i++)
        ext[i * cw] = 0.0;
    for (Py_ssize_t i = 1; i < rows; i++)
        for (Py_ssize_t k = 0; k < cw; k++)
            ext[i * cw + k] = ext[(i - 1) * cw + k] + ext[i * cw + k];
}

/* Per frequency of the first `cols` columns of the half spectrum, the box sum of radius `small`
 * (peak) and the mean of the rest of the box of radius `big` scaled to 3 x 3, plus `lift`
 * (around): moire_peak's and moire_regional's shared first steps. */
static void peak_and_around(const double *spectrum, Py_ssize_t side, Py_ssize_t width,
                            int truncated, Py_ssize_t big, Py_ssize_t small, double lift,
                            double *ext, Py_ssize_t cw, Py_ssize_t cols, double *row,
                            double *peak, double *around) {
    extend(spectrum, side, width, truncated, big, ext, cw);
    box_sums(ext, cw, side, cols, big, small, row, peak);
    box_sums(ext, cw, side, cols, big, big, row, around);
    for (Py_ssize_t i = 0; i < side * cols; i++)
        around[i] = (around[i] - peak[i]) * 0.125 + lift;
}

VEC static void ratios(double *restrict peak, const double *restrict around,
                       const unsigned char *restrict band, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double q = peak[i] / around[i];
        peak[i] = band[i] ? q : 0.0;
    }
}

/* The ratio of every frequency in the band (zero outside it), then the lower of it and the
 * ratio at the frequency turned by 90 degrees (scenes._turned), and the first highest (a NaN
 * is the highest, as np.argmax has it). */
static Py_ssize_t twin_peak(double *peak, double *around, const unsigned char *band,
                            Py_ssize_t side, Py_ssize_t cols, double *value) {
    ratios(peak, around, band, side * cols);
    double *twin = (double *)around; /* around is read no more */
    for (Py_ssize_t i = 0; i < side; i++) {
        Py_ssize_t fy = (i + side / 2) % side - side / 2, reach = fy < 0 ? -fy : fy;
        Py_ssize_t column = reach < cols - 1 ? reach : cols - 1;
        for (Py_ssize_t c = 0; c < cols; c++) {
            Py_ssize_t row = fy <= 0 || c == 0 ? c : side - c; /* (fy <= 0 ? c : -c) mod side */
            double a = peak[i * cols + c], b = peak[row * cols + column];
            twin[i * cols + c] = (isnan(a) || a <= b) ? a : b; /* np.minimum */
        }
    }
    Py_ssize_t best = 0;
    double top = twin[0];
    if (isnan(top)) {
        *value = top;
        return 0;
    }
    for (Py_ssize_t i = 1; i < side * cols; i++) {
        double t = twin[i];
        if (t > top) {
            top = t;
            best = i;
        } else if (isnan(t)) {
            *value = t;
            return i;
        }
    }
    *value = top;
    return best;
}

/* moire_peak(spectrum, side, width, big, small, lift, band) -> (value, at, cols): spectrum is
 * the half spectrum's first `width` columns (numpy's side x width complex128 result, read
 * column by column: its transpose's float64 view); the box sums of radius `small` (the peak)
 * and `big` (its surround) of the power per frequency, around = (surround - peak) * 0.125 +
 * lift, the ratio where `band` (side x cols bools) holds, the twin test, and the highest: its
 * value, its flat index in the side x cols result. */
PyObject *moire_peak(PyObject *self, PyObject *args) {
    PyObject *o_spectrum, *o_band;
    Py_ssize_t side, width, big, small;
    double lift;
    if (!PyArg_ParseTuple(args, "OnnnndO", &o_spectrum, &side, &width, &big, &small, &lift,
                          &o_band))
        return NULL;
    int truncated = width < side / 2 + 1;
    Py_ssize_t cols = truncated ? width - big : width;
    if (side < 2 * big + 1 || small < 0 || small > big || width > side / 2 + 1 || cols < 1 ||
        width <= big) {
        PyErr_SetString(PyExc_ValueError, "moire_peak: the spectrum does not fit the boxes");
        return NULL;
    }
    Buf spectrum, band;
    if (get_f64(o_spectrum, &spectrum, 2 * side * width, 0, "spectrum") < 0)
        return NULL;
    if (get_values(o_band, &band, side * cols, 0, "band", '?', 1, "bool") < 0) {
        release(&spectrum);
        return NULL;
    }
    Py_ssize_t cw = cols + 2 * big + 1, rows = side + 2 * big + 1;
    double *ext = (double *)malloc(sizeof(double) * (size_t)(rows * cw + 4 * cw + 2 * side * cols));
    if (ext == NULL) {
        release(&spectrum);
        release(&band);
        return PyErr_NoMemory();
    }
    double *row = ext + rows * cw, *peak = row + 4 * cw, *around = peak + side * cols;
    double value;
    Py_ssize_t at;
    Py_BEGIN_ALLOW_THREADS
    peak_and_around((const double *)spectrum.view.buf, side, width, truncated, big, small, lift,
                    ext, cw, cols, row, peak, around);
    at = twin_peak(peak, around, (const unsigned char *)band.view.buf, side, cols, &value);
    Py_END_ALLOW_THREADS
    free(ext);
    release(&spectrum);
    release(&band);
    return Py_BuildValue("dnn", value, at, cols);
}

/* The ratio map (side x cols, the half spectrum's) with a border of `r` bins around it, as
 * the isolation test reads it: rows wrapped (fy is periodic), the columns before fx = 0 read
 * at their mirror (P(fy, -c) = P(-fy, c)), those past the last column 0 (outside the band). */
static void bordered(const double *ratio, Py_ssize_t side, Py_ssize_t cols, Py_ssize_t r,
                     double *out) {
    Py_ssize_t w = cols + 2 * r;
    for (Py_ssize_t i = 0; i < side + 2 * r; i++) {
        Py_ssize_t fy = ((i - r) % side + side) % side, mirror = (side - fy) % side;
        double *o = out + i * w;
        for (Py_ssize_t c = -r; c < cols + r; c++)
            o[c + r] = c < 0 ? ratio[mirror * cols - c] : c < cols ? ratio[fy * cols + c] : 0.0;
    }
}

/* moire_regional(spectrum, side, width, big, small, lift, band, half, radius, count, turn,
 * pitch) -> (value, period): one region's half spectrum as moire_peak reads it, the same
 * ratio per frequency (zero outside `band`), its isolated peaks (at least every ratio within
 * `radius` bins, the spectrum periodic in fy and mirrored at fx = 0) where `half` holds, the
 * `count` highest, and of their pairs whose directions are at least 90 - turn degrees apart
 * (|cos| <= cos(90 - turn), given as `turn`) and whose distances from zero are within `pitch`
 * of each other, the highest lower ratio, with the pair's mean period (side / mean distance).
 * As moire.py's numpy code (_region_ratios, _relaxed_twin): the same value, but where two
 * peaks tie for the last of the `count`. */
PyObject *moire_regional(PyObject *self, PyObject *args) {
    PyObject *o_spectrum, *o_band, *o_half;
    Py_ssize_t side, width, big, small, radius, count;
    double lift, turn, pitch;
    if (!PyArg_ParseTuple(args, "OnnnndOOnndd", &o_spectrum, &side, &width, &big, &small, &lift,
                          &o_band, &o_half, &radius, &count, &turn, &pitch))
        return NULL;
    int truncated = width < side / 2 + 1;
    Py_ssize_t cols = truncated ? width - big : width;
    if (side < 2 * big + 1 || small < 0 || small > big || width > side / 2 + 1 || cols < 1 ||
        width <= big || radius < 0 || radius >= side || count < 2 || count > 64) {
        PyErr_SetString(PyExc_ValueError, "moire_regional: the spectrum does not fit the boxes");
        return NULL;
    }
    Buf spectrum, band, half;
    if (get_f64(o_spectrum, &spectrum, 2 * side * width, 0, "spectrum") < 0)
        return NULL;
    if (get_values(o_band, &band, side * cols, 0, "band", '?', 1, "bool") < 0) {
        release(&spectrum);
        return NULL;
    }
    if (get_values(o_half, &half, side * cols, 0, "half", '?', 1, "bool") < 0) {
        release(&spectrum);
        release(&band);
        return NULL;
    }
    Py_ssize_t cw = cols + 2 * big + 1, rows = side + 2 * big + 1;
    Py_ssize_t bw = cols + 2 * radius;
    double *ext = (double *)malloc(sizeof(double) * (size_t)(rows * cw + 4 * cw + 2 * side * cols +
                                                            (side + 2 * radius) * bw));
    if (ext == NULL) {
        release(&spectrum);
        release(&band);
        release(&half);
        return PyErr_NoMemory();
    }
    double *border = ext + rows * cw + 4 * cw + 2 * side * cols;
    double *row = ext + rows * cw, *peak = row + 4 * cw, *around = peak + side * cols;
    double value = 0.0, period = 0.0, top[64];
    Py_ssize_t ty[64], tx[64], found = 0;
    const unsigned char *in_half = (const unsigned char *)half.view.buf;
    Py_BEGIN_ALLOW_THREADS
    peak_and_around((const double *)spectrum.view.buf, side, width, truncated, big, small, lift,
                    ext, cw, cols, row, peak, around);
    ratios(peak, around, (const unsigned char *)band.view.buf, side * cols);
    bordered(peak, side, cols, radius, border);
    for (Py_ssize_t fy = 0; fy < side; fy++)
        for (Py_ssize_t c = 0; c < cols; c++) {
            double v = peak[fy * cols + c];
            if (!(v > 0.0) || !in_half[fy * cols + c] || (found == count && !(v > top[count - 1])))
                continue; /* not a candidate, or below the ten kept so far */
            const double *near = border + fy * bw + c; /* its (2r+1)^2 box, top left */
            int isolated = 1;
            for (Py_ssize_t dy = 0; dy <= 2 * radius && isolated; dy++)
                for (Py_ssize_t dx = 0; dx <= 2 * radius; dx++)
                    if (near[dy * bw + dx] > v) {
                        isolated = 0;
                        break;
                    }
            if (!isolated)
                continue;
            Py_ssize_t k = found < count ? found++ : count;
            if (k == count && !(v > top[count - 1]))
                continue;
            if (k == count)
                k = count - 1;
            while (k > 0 && top[k - 1] < v) {
                top[k] = top[k - 1];
                ty[k] = ty[k - 1];
                tx[k] = tx[k - 1];
                k--;
            }
            top[k] = v;
            ty[k] = (fy + side / 2) % side - side / 2;
            tx[k] = c;
        }
    for (Py_ssize_t i = 0; i < found; i++)
        for (Py_ssize_t j = i + 1; j < found; j++) {
            double ri = hypot((double)ty[i], (double)tx[i]), rj = hypot((double)ty[j], (double)tx[j]);
            double lo = ri < rj ? ri : rj, hi = ri < rj ? rj : ri;
            double cosine = fabs((double)(ty[i] * ty[j] + tx[i] * tx[j])) / (ri * rj);
            double both = top[j]; /* the lower of the two: the list is sorted */
            if (cosine <= turn && hi <= pitch * lo && both > value) {
                value = both;
                period = 2.0 * (double)side / (ri + rj);
            }
        }
    Py_END_ALLOW_THREADS
    free(ext);
    release(&spectrum);
    release(&band);
    release(&half);
    return Py_BuildValue("dd", value, period);
}
