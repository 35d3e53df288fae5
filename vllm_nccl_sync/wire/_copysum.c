/* The host's summing copy in one pass, for many pairs in one call: rows of 512 64-bit words
 * (4 KiB) copied from `src` to `dst`, each row's words summed (wrap-around) from the registers
 * that were written, so the sums are of exactly the bytes written and the memory is crossed once;
 * the tail of words and loose bytes summed as they are copied (a destination of 0: summed only).
 * Stores bypass the cache where `dst` is 16-byte aligned (SSE2 streaming stores), as a large
 * memcpy's do. The GIL is released while it runs. Called by `integrity` (`copies_summed_host`,
 * and the host parts of `checksum_parts`), which checks the tensors first. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define ROW_WORDS 512

static uint64_t copy_row(uint64_t *dst, const uint64_t *src, int stream) {
#if defined(__SSE2__)
    if (!dst) {  /* sum only */
        const __m128i *s = (const __m128i *)src;
        __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < ROW_WORDS / 2; j += 4) {
            a0 = _mm_add_epi64(a0, _mm_loadu_si128(s + j));
            a1 = _mm_add_epi64(a1, _mm_loadu_si128(s + j + 1));
            a2 = _mm_add_epi64(a2, _mm_loadu_si128(s + j + 2));
            a3 = _mm_add_epi64(a3, _mm_loadu_si128(s + j + 3));
        }
        uint64_t lanes[2];
        _mm_storeu_si128((__m128i *)lanes,
                         _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
        return lanes[0] + lanes[1];
    }
    const __m128i *s = (const __m128i *)src;
    __m128i *d = (__m128i *)dst;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (int j = 0; j < ROW_WORDS / 2; j += 4) {
        __m128i v0 = _mm_loadu_si128(s + j), v1 = _mm_loadu_si128(s + j + 1);
        __m128i v2 = _mm_loadu_si128(s + j + 2), v3 = _mm_loadu_si128(s + j + 3);
        if (stream) {
            _mm_stream_si128(d + j, v0); _mm_stream_si128(d + j + 1, v1);
            _mm_stream_si128(d + j + 2, v2); _mm_stream_si128(d + j + 3, v3);
        } else {
            _mm_storeu_si128(d + j, v0); _mm_storeu_si128(d + j + 1, v1);
            _mm_storeu_si128(d + j + 2, v2); _mm_storeu_si128(d + j + 3, v3);
        }
        a0 = _mm_add_epi64(a0, v0); a1 = _mm_add_epi64(a1, v1);
        a2 = _mm_add_epi64(a2, v2); a3 = _mm_add_epi64(a3, v3);
    }
    __m128i a = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, a);
    return lanes[0] + lanes[1];
#else
    (void)stream;
    uint64_t acc = 0;
    for (int j = 0; j < ROW_WORDS; j++) {
        uint64_t v = src[j];
        if (dst)
            dst[j] = v;
        acc += v;
    }
    return acc;
#endif
}

/* One pair: `nbytes` from src to dst (dst NULL: summed only), its three weighted sums
 * (`integrity._terms`' formula) into out[0..2]: the rows' sums weighted 1, 3, 5, ...; the tail's
 * words weighted likewise; the loose bytes likewise. */
static void copy_one(uint64_t *dst, const uint64_t *src, uint64_t nbytes, int64_t *out) {
    uint64_t rows = nbytes / (8 * ROW_WORDS), words = nbytes / 8 - rows * ROW_WORDS;
    int stream = (uintptr_t)dst % 16 == 0;
    uint64_t acc = 0;
    for (uint64_t r = 0; r < rows; r++)
        acc += copy_row(dst ? dst + r * ROW_WORDS : NULL, src + r * ROW_WORDS, stream)
               * (2 * r + 1);
    out[0] = (int64_t)acc;
    acc = 0;
    for (uint64_t j = 0; j < words; j++) {
        uint64_t v = src[rows * ROW_WORDS + j];
        if (dst)
            dst[rows * ROW_WORDS + j] = v;
        acc += v * (2 * j + 1);
    }
    out[1] = (int64_t)acc;
    const uint8_t *sb = (const uint8_t *)(src + rows * ROW_WORDS + words);
    uint8_t *db = dst ? (uint8_t *)(dst + rows * ROW_WORDS + words) : NULL;
    acc = 0;
    for (uint64_t k = 0; k < nbytes % 8; k++) {
        if (db)
            db[k] = sb[k];
        acc += (uint64_t)sb[k] * (2 * k + 1);
    }
    out[2] = (int64_t)acc;
}

static PyObject *copy_many(PyObject *self, PyObject *args) {
    unsigned long long table, out;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnK", &table, &n, &out))
        return NULL;
    const int64_t *t = (const int64_t *)(uintptr_t)table;
    if (n < 0 || (table | out) % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_many: n < 0 or a table not 8-byte aligned");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (t[3 * i + 2] < 0 || (t[3 * i] | t[3 * i + 1]) % 8) {
            PyErr_Format(PyExc_ValueError, "copy_many: pair %zd has a negative size or an "
                         "address not 8-byte aligned", i);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        copy_one((uint64_t *)(uintptr_t)t[3 * i], (const uint64_t *)(uintptr_t)t[3 * i + 1],
                 (uint64_t)t[3 * i + 2], (int64_t *)(uintptr_t)out + 3 * i);
#if defined(__SSE2__)
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(table, n, out): for each of n pairs (int64 dst, src, nbytes at table + 24 * i; "
     "addresses 8-byte aligned; dst 0: sum only) copy nbytes from src to dst, writing the "
     "three weighted sums of `integrity._terms` (rows, tail words, loose bytes) to the int64s "
     "at out + 24 * i."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copysum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module); }
