/* kvtier._rows: the copy loop of chunk encode and decode, compiled.
 *
 * copy_rows gathers or scatters fixed-size rows (a chunk's blocks) and computes the
 * payload's xxh3_64 checksum on the way, hashing each row right after copying it,
 * while it is in the CPU cache: the source (host-slab rows, a mapped LMDB page, a
 * Redis reply) is read once, not once to copy and once to hash.
 *
 * Every index is checked before anything is copied; bad input raises a Python
 * exception naming the problem.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The checksum's inner loop in AVX2 where the CPU has it (xxhash.h builds the AVX2
 * kernels under a target attribute; the module itself stays baseline x86-64): on
 * cache-hot rows it hashes about three times as fast as the SSE2 kernels. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROWS_AVX2 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"

/* Bytes copied, then hashed while they are still in the L1 cache. */
#define PIECE_NBYTES ((size_t)16 << 10)

typedef void (*update_fn)(XXH3_state_t *, const char *, size_t);

static void
update_default(XXH3_state_t *state, const char *p, size_t len)
{
    XXH3_64bits_update(state, p, len);
}

#ifdef ROWS_AVX2
static XXH_TARGET_AVX2 void
update_avx2(XXH3_state_t *state, const char *p, size_t len)
{
    XXH3_update(state, (const xxh_u8 *)p, len, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

static update_fn update = update_default;

/* Row indices: None (rows 0, 1, 2, ...: *rows NULL) or a C-contiguous int64 buffer,
 * each index in [0, limit). Returns 0, or -1 with an exception set; on 0 with a
 * buffer, the caller releases ``view``. */
static int
get_rows(PyObject *obj, Py_buffer *view, const int64_t **rows, Py_ssize_t *count,
         Py_ssize_t limit, const char *name)
{
    *rows = NULL;
    if (obj == Py_None)
        return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    char code = fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@' ? fmt[1] : fmt[0];
    if (view->itemsize != 8 || (code != 'q' && code != 'l') || fmt[strlen(fmt) - 1] != code) {
        PyErr_Format(PyExc_TypeError, "%s must be None or an int64 buffer, got format '%s'",
                     name, fmt);
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *v = (const int64_t *)view->buf;
    Py_ssize_t n = view->len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] >= limit) {
            PyErr_Format(PyExc_IndexError, "%s[%zd] = %lld is outside [0, %zd)", name, i,
                         (long long)v[i], limit);
            PyBuffer_Release(view);
            return -1;
        }
    }
    *rows = v;
    *count = n;
    return 0;
}

PyDoc_STRVAR(copy_rows_doc,
"copy_rows(dst, dst_rows, src, src_rows, row_nbytes, seed) -> int\n\n"
"Copy rows of ``row_nbytes`` bytes, ``dst[dst_rows[i]] = src[src_rows[i]]`` for each\n"
"i in order, and return the xxh3_64 digest, seeded with ``seed``, of the bytes copied\n"
"in that order (``xxhash.xxh3_64_intdigest`` of their concatenation). A rows argument\n"
"of None means rows 0, 1, 2, ...; at least one must be given, or both buffers hold the\n"
"same number of rows. ``dst`` is a writable and ``src`` a readable C-contiguous buffer\n"
"whose length is a multiple of ``row_nbytes``; rows are int64 buffers (numpy arrays).\n"
"Every index is checked before anything is copied (IndexError); the GIL is released\n"
"while copying.");

static PyObject *
copy_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "copy_rows takes 6 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t row = PyLong_AsSsize_t(args[4]);
    if (row == -1 && PyErr_Occurred())
        return NULL;
    if (row <= 0) {
        PyErr_Format(PyExc_ValueError, "row_nbytes must be positive, got %zd", row);
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[5]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;

    PyObject *result = NULL;
    Py_buffer dst, src, dview, sview;
    const int64_t *drows = NULL, *srows = NULL;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &src, PyBUF_C_CONTIGUOUS) < 0)
        goto release_dst;
    if (dst.len % row || src.len % row) {
        PyErr_Format(PyExc_ValueError,
                     "buffers of %zd and %zd bytes are not whole rows of %zd bytes", dst.len,
                     src.len, row);
        goto release_src;
    }
    Py_ssize_t dn = dst.len / row, sn = src.len / row;
    Py_ssize_t n_d = dn, n_s = sn;
    if (get_rows(args[1], &dview, &drows, &n_d, dn, "dst_rows") < 0)
        goto release_src;
    if (get_rows(args[3], &sview, &srows, &n_s, sn, "src_rows") < 0)
        goto release_drows;
    /* Rows given are the count; an implicit range must hold as many. */
    if (n_d != n_s && !((drows && !srows && n_d <= sn) || (srows && !drows && n_s <= dn))) {
        PyErr_Format(PyExc_ValueError, "%zd destination rows for %zd source rows", n_d, n_s);
        goto release_srows;
    }
    Py_ssize_t n = drows ? n_d : n_s;
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto release_srows;
    }
    XXH3_64bits_reset_withSeed(state, (XXH64_hash_t)seed);
    char *d = (char *)dst.buf;
    const char *s = (const char *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *to = d + (drows ? drows[i] : i) * row;
        const char *from = s + (srows ? srows[i] : i) * row;
        for (size_t at = 0; at < (size_t)row; at += PIECE_NBYTES) {
            size_t len = (size_t)row - at < PIECE_NBYTES ? (size_t)row - at : PIECE_NBYTES;
            memcpy(to + at, from + at, len);
            update(state, to + at, len);
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(XXH3_64bits_digest(state));
    XXH3_freeState(state);
release_srows:
    if (srows)
        PyBuffer_Release(&sview);
release_drows:
    if (drows)
        PyBuffer_Release(&dview);
release_src:
    PyBuffer_Release(&src);
release_dst:
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef rows_methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL, copy_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._rows",
    .m_doc = "The copy loop of chunk encode and decode: rows copied and checksummed in one pass.",
    .m_size = 0,
    .m_methods = rows_methods,
};

PyMODINIT_FUNC
PyInit__rows(void)
{
#ifdef ROWS_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        update = update_avx2;
#endif
    return PyModule_Create(&rows_module);
}
