/* JSON numbers as Triton writes them: a double's shortest-enough digits by Grisu2 (Loitsch,
 * "Printing Floating-Point Numbers Quickly and Accurately with Integers", PLDI 2010), then laid
 * out as RapidJSON lays them out (Triton's JSON writer): "1.5", "2.0", "0.000015", "1e-7",
 * "1.2345e+20" is "123450000000000000000.0" up to 21 digits, and so on. Python's repr gives the
 * shortest digits and another layout ("1e-07", "1.5e-05"); Grisu2's digits are not always the
 * shortest (9.313225746154786e-10 where repr has ...785), so the bytes of a JSON answer mmguard
 * writes (a gRPC backend's answer to an HTTP client) differed from Triton's own in about one
 * value in five near 1e-3.
 *
 * join(buffer of float64) -> bytes: the values separated by commas, NaN and infinities as
 * "NaN", "Infinity", "-Infinity" (Triton's writer allows them). Bit for bit against Triton is
 * held by tests/conformance/test_triton_json_floats.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { uint64_t f; int e; } fp;

static const uint64_t POW_F[] = {
    0xfa8fd5a0081c0288ULL, 0xbaaee17fa23ebf76ULL, 0x8b16fb203055ac76ULL,
    0xcf42894a5dce35eaULL, 0x9a6bb0aa55653b2dULL, 0xe61acf033d1a45dfULL,
    0xab70fe17c79ac6caULL, 0xff77b1fcbebcdc4fULL, 0xbe5691ef416bd60cULL,
    0x8dd01fad907ffc3cULL, 0xd3515c2831559a83ULL, 0x9d71ac8fada6c9b5ULL,
    0xea9c227723ee8bcbULL, 0xaecc49914078536dULL, 0x823c12795db6ce57ULL,
    0xc21094364dfb5637ULL, 0x9096ea6f3848984fULL, 0xd77485cb25823ac7ULL,
    0xa086cfcd97bf97f4ULL, 0xef340a98172aace5ULL, 0xb23867fb2a35b28eULL,
    0x84c8d4dfd2c63f3bULL, 0xc5dd44271ad3cdbaULL, 0x936b9fcebb25c996ULL,
    0xdbac6c247d62a584ULL, 0xa3ab66580d5fdaf6ULL, 0xf3e2f893dec3f126ULL,
    0xb5b5ada8aaff80b8ULL, 0x87625f056c7c4a8bULL, 0xc9bcff6034c13053ULL,
    0x964e858c91ba2655ULL, 0xdff9772470297ebdULL, 0xa6dfbd9fb8e5b88fULL,
    0xf8a95fcf88747d94ULL, 0xb94470938fa89bcfULL, 0x8a08f0f8bf0f156bULL,
    0xcdb02555653131b6ULL, 0x993fe2c6d07b7facULL, 0xe45c10c42a2b3b06ULL,
    0xaa242499697392d3ULL, 0xfd87b5f28300ca0eULL, 0xbce5086492111aebULL,
    0x8cbccc096f5088ccULL, 0xd1b71758e219652cULL, 0x9c40000000000000ULL,
    0xe8d4a51000000000ULL, 0xad78ebc5ac620000ULL, 0x813f3978f8940984ULL,
    0xc097ce7bc90715b3ULL, 0x8f7e32ce7bea5c70ULL, 0xd5d238a4abe98068ULL,
    0x9f4f2726179a2245ULL, 0xed63a231d4c4fb27ULL, 0xb0de65388cc8ada8ULL,
    0x83c7088e1aab65dbULL, 0xc45d1df942711d9aULL, 0x924d692ca61be758ULL,
    0xda01ee641a708deaULL, 0xa26da3999aef774aULL, 0xf209787bb47d6b85ULL,
    0xb454e4a179dd1877ULL, 0x865b86925b9bc5c2ULL, 0xc83553c5c8965d3dULL,
    0x952ab45cfa97a0b3ULL, 0xde469fbd99a05fe3ULL, 0xa59bc234db398c25ULL,
    0xf6c69a72a3989f5cULL, 0xb7dcbf5354e9beceULL, 0x88fcf317f22241e2ULL,
    0xcc20ce9bd35c78a5ULL, 0x98165af37b2153dfULL, 0xe2a0b5dc971f303aULL,
    0xa8d9d1535ce3b396ULL, 0xfb9b7cd9a4a7443cULL, 0xbb764c4ca7a44410ULL,
    0x8bab8eefb6409c1aULL, 0xd01fef10a657842cULL, 0x9b10a4e5e9913129ULL,
    0xe7109bfba19c0c9dULL, 0xac2820d9623bf429ULL, 0x80444b5e7aa7cf85ULL,
    0xbf21e44003acdd2dULL, 0x8e679c2f5e44ff8fULL, 0xd433179d9c8cb841ULL,
    0x9e19db92b4e31ba9ULL, 0xeb96bf6ebadf77d9ULL, 0xaf87023b9bf0ee6bULL
};
static const int16_t POW_E[] = {
    -1220, -1193, -1166, -1140, -1113, -1087, -1060, -1034, -1007, -980,
    -954, -927, -901, -874, -847, -821, -794, -768, -741, -715,
    -688, -661, -635, -608, -582, -555, -529, -502, -475, -449,
    -422, -396, -369, -343, -316, -289, -263, -236, -210, -183,
    -157, -130, -103, -77, -50, -24, 3, 30, 56, 83,
    109, 136, 162, 189, 216, 242, 269, 295, 322, 348,
    375, 402, 428, 455, 481, 508, 534, 561, 588, 614,
    641, 667, 694, 720, 747, 774, 800, 827, 853, 880,
    907, 933, 960, 986, 1013, 1039, 1066
};
static const uint64_t POW10[] = {
    1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL, 10000000ULL, 100000000ULL,
    1000000000ULL, 10000000000ULL, 100000000000ULL, 1000000000000ULL, 10000000000000ULL,
    100000000000000ULL, 1000000000000000ULL, 10000000000000000ULL, 100000000000000000ULL,
    1000000000000000000ULL, 10000000000000000000ULL
};

#define HIDDEN (1ULL << 52)

static fp product(fp x, fp y) {
    unsigned __int128 p = (unsigned __int128)x.f * y.f;
    uint64_t high = (uint64_t)(p >> 64), low = (uint64_t)p;
    fp r = { high + (low >> 63), x.e + y.e + 64 };  /* rounded half up */
    return r;
}

static fp normalized(fp x) {
    int s = __builtin_clzll(x.f);
    fp r = { x.f << s, x.e - s };
    return r;
}

/* The value's neighbours' midpoints, both on the upper one's exponent. */
static void boundaries(fp v, fp *minus, fp *plus) {
    fp up = { (v.f << 1) + 1, v.e - 1 };
    up = normalized(up);
    fp low = v.f == HIDDEN ? (fp){ (v.f << 2) - 1, v.e - 2 } : (fp){ (v.f << 1) - 1, v.e - 1 };
    low.f <<= low.e - up.e;
    low.e = up.e;
    *plus = up;
    *minus = low;
}

/* The cached power of ten that brings an exponent e into [-60, -32], and its decimal exponent. */
static fp cached_power(int e, int *k) {
    double dk = (-61 - e) * 0.30102999566398114 + 347;
    int ki = (int)dk;
    if (dk - ki > 0.0)
        ki++;
    unsigned index = (unsigned)((ki >> 3) + 1);
    *k = -(-348 + (int)(index << 3));
    fp c = { POW_F[index], POW_E[index] };
    return c;
}

static int digits32(uint32_t n) {
    int d = 1;
    while (n >= 10) { n /= 10; d++; }
    return d;
}

static void nudge(char *buf, int len, uint64_t delta, uint64_t rest, uint64_t ten_kappa,
                  uint64_t wp_w) {
    while (rest < wp_w && delta - rest >= ten_kappa
           && (rest + ten_kappa < wp_w || wp_w - rest > rest + ten_kappa - wp_w)) {
        buf[len - 1]--;
        rest += ten_kappa;
    }
}

static void generate(fp w, fp mp, uint64_t delta, char *buf, int *len, int *k) {
    fp one = { 1ULL << -mp.e, mp.e };
    uint64_t wp_w = mp.f - w.f;
    uint32_t p1 = (uint32_t)(mp.f >> -one.e);
    uint64_t p2 = mp.f & (one.f - 1);
    int kappa = digits32(p1);
    *len = 0;
    while (kappa > 0) {
        uint32_t div = (uint32_t)POW10[kappa - 1];
        uint32_t d = p1 / div;
        p1 %= div;
        if (d || *len)
            buf[(*len)++] = (char)('0' + d);
        kappa--;
        uint64_t tmp = ((uint64_t)p1 << -one.e) + p2;
        if (tmp <= delta) {
            *k += kappa;
            nudge(buf, *len, delta, tmp, POW10[kappa] << -one.e, wp_w);
            return;
        }
    }
    for (;;) {
        p2 *= 10;
        delta *= 10;
        char d = (char)(p2 >> -one.e);
        if (d || *len)
            buf[(*len)++] = (char)('0' + d);
        p2 &= one.f - 1;
        kappa--;
        if (p2 < delta) {
            *k += kappa;
            int index = -kappa;
            /* RapidJSON scales the distance to the value by 10^index only for index < 9 and by
             * 0 past it (no rounding towards the value then): Triton's digits are those. With
             * the paper's scaling (< 20) a quarter of random float32 values differed in their
             * last digit; with this, none of 5,986 (the conformance test holds it). */
            nudge(buf, *len, delta, p2, one.f, wp_w * (index < 9 ? POW10[index] : 0));
            return;
        }
    }
}

/* The digits of a finite positive double and its decimal exponent: value = digits * 10^k. */
static void grisu2(double value, char *buf, int *len, int *k) {
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    int biased = (int)((bits >> 52) & 0x7FF);
    uint64_t mantissa = bits & (HIDDEN - 1);
    fp v = biased ? (fp){ mantissa + HIDDEN, biased - 1075 } : (fp){ mantissa, -1074 };
    fp minus, plus;
    boundaries(v, &minus, &plus);
    fp c = cached_power(plus.e, k);
    fp w = product(normalized(v), c);
    fp wp = product(plus, c);
    fp wm = product(minus, c);
    wm.f++;
    wp.f--;
    generate(w, wp, wp.f - wm.f, buf, len, k);
}

static char *exponent(int e, char *out) {
    *out++ = 'e';
    if (e < 0) { *out++ = '-'; e = -e; }
    if (e >= 100) { *out++ = (char)('0' + e / 100); e %= 100; *out++ = (char)('0' + e / 10);
                    *out++ = (char)('0' + e % 10); }
    else if (e >= 10) { *out++ = (char)('0' + e / 10); *out++ = (char)('0' + e % 10); }
    else *out++ = (char)('0' + e);
    return out;
}

/* RapidJSON's layout of digits * 10^k (at most 17 digits): into out, returns its end. */
static char *lay_out(const char *digits, int len, int k, char *out) {
    int kk = len + k;  /* 10^(kk-1) <= v < 10^kk */
    if (k >= 0 && kk <= 21) {  /* 1234e7 -> 12340000000.0 */
        memcpy(out, digits, (size_t)len); out += len;
        for (int i = 0; i < k; i++) *out++ = '0';
        *out++ = '.'; *out++ = '0';
    } else if (0 < kk && kk <= 21) {  /* 1234e-2 -> 12.34 */
        memcpy(out, digits, (size_t)kk); out += kk;
        *out++ = '.';
        memcpy(out, digits + kk, (size_t)(len - kk)); out += len - kk;
    } else if (-6 < kk && kk <= 0) {  /* 1234e-6 -> 0.001234 */
        *out++ = '0'; *out++ = '.';
        for (int i = 0; i < -kk; i++) *out++ = '0';
        memcpy(out, digits, (size_t)len); out += len;
    } else if (len == 1) {  /* 1e30 */
        *out++ = digits[0];
        out = exponent(kk - 1, out);
    } else {  /* 1234e30 -> 1.234e33 */
        *out++ = digits[0]; *out++ = '.';
        memcpy(out, digits + 1, (size_t)(len - 1)); out += len - 1;
        out = exponent(kk - 1, out);
    }
    return out;
}

/* One double as Triton's JSON writer writes it; out needs 32 bytes. */
static char *write_double(double d, char *out) {
    if (d != d) { memcpy(out, "NaN", 3); return out + 3; }
    if (d == __builtin_inf()) { memcpy(out, "Infinity", 8); return out + 8; }
    if (d == -__builtin_inf()) { memcpy(out, "-Infinity", 9); return out + 9; }
    if (d == 0) {
        if (signbit(d)) *out++ = '-';
        memcpy(out, "0.0", 3);
        return out + 3;
    }
    if (d < 0) { *out++ = '-'; d = -d; }
    char digits[32];
    int len, k;
    grisu2(d, digits, &len, &k);
    return lay_out(digits, len, k, out);
}

static PyObject *join(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    /* numpy exports a native float64 as "d", or as "=d" / "<d" for an array whose dtype names
     * its byte order (an FP64 tensor decoded from the wire): all the same on a little-endian
     * host, the only kind mmguard is built for. */
    const char *format = view.format == NULL ? "" : view.format;
    if (*format == '=' || *format == '<' || *format == '@')
        format++;
    if (view.itemsize != 8 || strcmp(format, "d") != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "join: a contiguous buffer of float64 is needed");
        return NULL;
    }
    Py_ssize_t n = view.len / 8;
    if (n > PY_SSIZE_T_MAX / 33) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    char *text = PyMem_Malloc((size_t)(n * 33 + 1));
    if (text == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const double *values = (const double *)view.buf;
    char *out = text;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i) *out++ = ',';
        out = write_double(values[i], out);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *result = PyBytes_FromStringAndSize(text, out - text);
    PyMem_Free(text);
    return result;
}

static PyMethodDef METHODS[] = {
    {"join", join, METH_O, "join(float64 buffer) -> bytes: the values as Triton's JSON writes "
                           "them, separated by commas."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_floats", NULL, -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__floats(void) { return PyModule_Create(&MODULE); }
