/* The host's summing copy in one pass: rows of 512 64-bit words (4 KiB) copied from `src` to
 * `dst`, each row's words summed (wrap-around) from the registers that were written, so the sums
 * are of exactly the bytes written and the memory is crossed once. Stores bypass the cache where
 * `dst` is 16-byte aligned (SSE2 streaming stores), as a large memcpy's do. The GIL is released
 * while it runs. Called by `integrity.copy_summed_host`, which checks the tensors first. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define ROW_WORDS 512

static uint64_t copy_row(uint64_t *dst, const uint64_t *src, int stream) {
#if defined(__SSE2__)
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
        dst[j] = v;
        acc += v;
    }
    return acc;
#endif
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long dst, src, out;
    Py_ssize_t rows;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnK", &dst, &src, &rows, &out))
        return NULL;
    if (rows < 0 || (dst | src | out) % 8) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: rows < 0 or an address not 8-byte aligned");
        return NULL;
    }
    int stream = dst % 16 == 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        ((uint64_t *)(uintptr_t)out)[r] = copy_row((uint64_t *)(uintptr_t)dst + r * ROW_WORDS,
                                                  (const uint64_t *)(uintptr_t)src + r * ROW_WORDS,
                                                  stream);
#if defined(__SSE2__)
    if (stream)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, src, rows, out): copy `rows` rows of 4 KiB from address src to dst, writing "
     "each row's wrap-around sum of 64-bit words to the int64 at out + 8 * row."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copysum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module); }
