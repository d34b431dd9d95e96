/* kvtier._core: the per-block hot loops of the block bookkeeping, compiled.
 *
 * - chain_hashes: the chained block hashes of hashing.py, one C loop per prompt
 *   (xxh3_128 inline from the vendored xxhash.h, or any 16-byte digest callable).
 * - HashIndex: a fixed-capacity map from 16-byte block hashes to block ids
 *   (open addressing, linear probing, backward-shift deletion). Batch methods
 *   prefetch the table slots of the keys ahead of the one being probed, so that a
 *   pool of a million blocks, whose table does not fit in the CPU cache, costs
 *   about what a small one does.
 *
 * Every function validates its input before it changes anything, and reports bad
 * input as a Python exception naming the problem.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <sys/mman.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define KEY_NBYTES 16
#define HUGE_PAGE_NBYTES ((size_t)2 << 20)
#define PREFETCH_AHEAD 16 /* keys ahead whose slots are prefetched (measured: 16 < 32, 64) */

/* ------------------------------------------------------------------ chain_hashes */

/* One block's digest of buf[0:len] into out[16]; 0 on success, -1 with an exception. */
static int
digest_block(PyObject *digest, const char *buf, Py_ssize_t len, char *out)
{
    if (digest == Py_None) {
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, XXH3_128bits(buf, (size_t)len));
        memcpy(out, canon.digest, KEY_NBYTES);
        return 0;
    }
    PyObject *arg = PyBytes_FromStringAndSize(buf, len);
    if (arg == NULL)
        return -1;
    PyObject *res = PyObject_CallOneArg(digest, arg);
    Py_DECREF(arg);
    if (res == NULL)
        return -1;
    if (!PyBytes_Check(res) || PyBytes_GET_SIZE(res) != KEY_NBYTES) {
        PyErr_Format(PyExc_ValueError, "digest must return %d bytes, got %.100s",
                     KEY_NBYTES, Py_TYPE(res)->tp_name);
        Py_DECREF(res);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(res), KEY_NBYTES);
    Py_DECREF(res);
    return 0;
}

PyDoc_STRVAR(chain_hashes_doc,
"chain_hashes(data, parent, step, suffixes, digest) -> list[bytes]\n\n"
"The chained hashes of the full ``step``-byte blocks of ``data`` (a trailing partial\n"
"block is ignored): h[i] = digest(h[i-1] || block i || suffix i), h[-1] = ``parent``\n"
"(16 bytes). ``suffixes`` is one bytes object appended to every block, or a list\n"
"with one per block. ``digest`` is None for xxh3_128 (canonical, big-endian: the\n"
"bytes of ``xxhash.xxh3_128_digest``), or a callable returning 16 bytes.");

static PyObject *
chain_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "chain_hashes takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *parent = args[1], *suffixes = args[3], *digest = args[4];
    Py_ssize_t step = PyLong_AsSsize_t(args[2]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    if (step <= 0) {
        PyErr_Format(PyExc_ValueError, "step must be positive, got %zd", step);
        return NULL;
    }
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) != KEY_NBYTES) {
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes", KEY_NBYTES);
        return NULL;
    }
    if (digest != Py_None && !PyCallable_Check(digest)) {
        PyErr_SetString(PyExc_TypeError, "digest must be None (xxh3_128) or a callable");
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = data.len / step;
    PyObject *result = NULL, *out = NULL;
    char *buf = NULL;

    /* Every suffix is checked, and the buffer sized for the longest, before hashing. */
    Py_ssize_t max_suffix;
    int per_block = PyList_Check(suffixes);
    if (per_block) {
        if (PyList_GET_SIZE(suffixes) != n) {
            PyErr_Format(PyExc_ValueError, "%zd suffixes for %zd blocks",
                         PyList_GET_SIZE(suffixes), n);
            goto done;
        }
        max_suffix = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *s = PyList_GET_ITEM(suffixes, i);
            if (!PyBytes_Check(s)) {
                PyErr_SetString(PyExc_TypeError, "suffixes must be bytes");
                goto done;
            }
            if (PyBytes_GET_SIZE(s) > max_suffix)
                max_suffix = PyBytes_GET_SIZE(s);
        }
    }
    else if (PyBytes_Check(suffixes)) {
        max_suffix = PyBytes_GET_SIZE(suffixes);
    }
    else {
        PyErr_SetString(PyExc_TypeError, "suffixes must be bytes or a list of bytes");
        goto done;
    }

    buf = PyMem_Malloc(KEY_NBYTES + step + max_suffix);
    out = PyList_New(n);
    if (buf == NULL || out == NULL) {
        if (buf == NULL)
            PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, PyBytes_AS_STRING(parent), KEY_NBYTES);
    const char *blocks = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = per_block ? PyList_GET_ITEM(suffixes, i) : suffixes;
        Py_ssize_t slen = PyBytes_GET_SIZE(s);
        memcpy(buf + KEY_NBYTES, blocks + i * step, step);
        memcpy(buf + KEY_NBYTES + step, PyBytes_AS_STRING(s), slen);
        char h[KEY_NBYTES];
        if (digest_block(digest, buf, KEY_NBYTES + step + slen, h) < 0)
            goto done;
        PyObject *item = PyBytes_FromStringAndSize(h, KEY_NBYTES);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(out, i, item);
        memcpy(buf, h, KEY_NBYTES); /* the next block's parent */
    }
    result = out;
    out = NULL;
done:
    Py_XDECREF(out);
    PyMem_Free(buf);
    PyBuffer_Release(&data);
    return result;
}

/* ------------------------------------------------------------------ HashIndex */

typedef struct {
    uint64_t k0, k1;
    int64_t value; /* < 0: the slot is empty */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *table;
    uint64_t mask;
    int shift; /* 64 - log2(table size): the slot is the top bits of the mixed key */
    Py_ssize_t size, capacity;
} HashIndex;

/* A parsed key: its two words and its home slot. */
typedef struct {
    uint64_t k0, k1, home;
} Key;

static inline uint64_t
home_slot(const HashIndex *ix, uint64_t k0, uint64_t k1)
{
    /* Block hashes are digests, but tests and callers may use structured keys: mix. */
    uint64_t h = (k0 ^ (k1 * 0x9E3779B97F4A7C15ULL)) * 0xBF58476D1CE4E5B9ULL;
    return h >> ix->shift;
}

static int
parse_key(const HashIndex *ix, PyObject *obj, Key *key)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be %d bytes, got %.100s",
                     KEY_NBYTES, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(obj) != KEY_NBYTES) {
        PyErr_Format(PyExc_ValueError, "a block hash must be %d bytes, got %zd bytes",
                     KEY_NBYTES, PyBytes_GET_SIZE(obj));
        return -1;
    }
    const char *p = PyBytes_AS_STRING(obj);
    memcpy(&key->k0, p, 8);
    memcpy(&key->k1, p + 8, 8);
    key->home = home_slot(ix, key->k0, key->k1);
    return 0;
}

/* Parse every key of a sequence up front (so bad input changes nothing). The caller
 * frees *keys with PyMem_Free and releases *seq. */
static Py_ssize_t
parse_keys(const HashIndex *ix, PyObject *obj, PyObject **seq, Key **keys)
{
    *seq = PySequence_Fast(obj, "block hashes must be a sequence of bytes");
    if (*seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(*seq);
    *keys = PyMem_Malloc(sizeof(Key) * (n ? n : 1));
    if (*keys == NULL) {
        Py_CLEAR(*seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(*seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_key(ix, items[i], &(*keys)[i]) < 0) {
            PyMem_Free(*keys);
            *keys = NULL;
            Py_CLEAR(*seq);
            return -1;
        }
    }
    return n;
}

/* A macro, not a function: GCC's IPA deems a function whose only effect is a
 * prefetch pure, and drops its calls. */
#define PREFETCH_AHEAD_OF(ix, keys, i, n)                                       \
    do {                                                                        \
        if ((i) + PREFETCH_AHEAD < (n))                                         \
            __builtin_prefetch(&(ix)->table[(keys)[(i) + PREFETCH_AHEAD].home]); \
    } while (0)

/* The slot holding the key, or the empty slot where it would go (*found says which). */
static inline uint64_t
probe(const HashIndex *ix, const Key *key, int *found)
{
    uint64_t i = key->home;
    for (;;) {
        const Entry *e = &ix->table[i];
        if (e->value < 0) {
            *found = 0;
            return i;
        }
        if (e->k0 == key->k0 && e->k1 == key->k1) {
            *found = 1;
            return i;
        }
        i = (i + 1) & ix->mask;
    }
}

/* Empty slot i, moving later entries of its probe run back (no tombstones). */
static void
erase_slot(HashIndex *ix, uint64_t i)
{
    Entry *t = ix->table;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & ix->mask;
        if (t[j].value < 0)
            break;
        uint64_t home = home_slot(ix, t[j].k0, t[j].k1);
        /* t[j] may fill the hole at i when i lies on its probe path [home, j). */
        if (((j - home) & ix->mask) >= ((j - i) & ix->mask)) {
            t[i] = t[j];
            i = j;
        }
    }
    t[i].value = -1;
    ix->size--;
}

/* Fill empty slot i with the key. */
static inline void
put(HashIndex *ix, uint64_t i, const Key *key, int64_t value)
{
    Entry *e = &ix->table[i];
    e->k0 = key->k0;
    e->k1 = key->k1;
    e->value = value;
    ix->size++;
}

/* The table, on transparent huge pages where the kernel allows it: a probe lands on
 * a random slot, and with 4 KiB pages a table of a million blocks (48 MiB) misses the
 * TLB on almost every one (measured: a 1M-block prefix lookup 1.6x slower than a
 * 10k-block one on 4 KiB pages, 1.1x on huge pages). */
static Entry *
alloc_table(size_t nbytes)
{
    int huge = nbytes >= HUGE_PAGE_NBYTES;
    void *p = NULL;
    if (posix_memalign(&p, huge ? HUGE_PAGE_NBYTES : 64, nbytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    if (huge)
        madvise(p, nbytes, MADV_HUGEPAGE); /* advice only: failure changes nothing */
#endif
    return p;
}

static int
HashIndex_init(HashIndex *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:HashIndex", kwlist, &capacity))
        return -1;
    if (capacity <= 0 || capacity > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in [1, 2**40], got %zd", capacity);
        return -1;
    }
    /* At least twice the capacity, a power of two: probe runs stay short. */
    uint64_t slots = 2;
    int bits = 1;
    while (slots < 2 * (uint64_t)capacity) {
        slots <<= 1;
        bits++;
    }
    Entry *table = alloc_table(sizeof(Entry) * slots);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < slots; i++)
        table[i].value = -1;
    free(self->table);
    self->table = table;
    self->mask = slots - 1;
    self->shift = 64 - bits;
    self->size = 0;
    self->capacity = capacity;
    return 0;
}

static void
HashIndex_dealloc(HashIndex *self)
{
    free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
HashIndex_len(HashIndex *self)
{
    return self->size;
}

static int
check_ready(const HashIndex *self)
{
    if (self->table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "HashIndex was not initialised");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(get_doc, "get(key) -> int | None: the id stored under ``key``, or None.");

static PyObject *
HashIndex_get(HashIndex *self, PyObject *obj)
{
    Key key;
    int found;
    if (check_ready(self) < 0 || parse_key(self, obj, &key) < 0)
        return NULL;
    uint64_t i = probe(self, &key, &found);
    if (!found)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(self->table[i].value);
}

PyDoc_STRVAR(prefix_doc,
"prefix(keys) -> list[int]: the ids of the longest leading run of ``keys`` held here.");

static PyObject *
HashIndex_prefix(HashIndex *self, PyObject *obj)
{
    PyObject *seq;
    Key *keys;
    if (check_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_keys(self, obj, &seq, &keys);
    if (n < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int found;
        PREFETCH_AHEAD_OF(self, keys, i, n);
        uint64_t s = probe(self, &keys[i], &found);
        if (!found)
            break;
        PyObject *v = PyLong_FromLongLong(self->table[s].value);
        if (v == NULL || PyList_Append(out, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(find_doc,
"find(keys) -> list[int | None]: the id stored under each key, or None.");

static PyObject *
HashIndex_find(HashIndex *self, PyObject *obj)
{
    PyObject *seq;
    Key *keys;
    if (check_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_keys(self, obj, &seq, &keys);
    if (n < 0)
        return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int found;
        PREFETCH_AHEAD_OF(self, keys, i, n);
        uint64_t s = probe(self, &keys[i], &found);
        PyObject *v = found ? PyLong_FromLongLong(self->table[s].value) : Py_NewRef(Py_None);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(insert_doc,
"insert(keys, ids) -> list[int]\n\n"
"Store ``ids[i]`` (an int64 buffer, e.g. a numpy array, each >= 0) under ``keys[i]``\n"
"where the key is absent. Returns the positions i whose key was already held (its\n"
"id is kept: first writer wins). OverflowError, changing nothing, if the new keys\n"
"could exceed the capacity.");

static PyObject *
HashIndex_insert(HashIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "insert takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (check_ready(self) < 0)
        return NULL;
    Py_buffer ids;
    if (PyObject_GetBuffer(args[1], &ids, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *seq = NULL, *out = NULL;
    Key *keys = NULL;
    const char *fmt = ids.format ? ids.format : "B";
    char code = fmt[strlen(fmt) - 1];
    if (ids.itemsize != 8 || (code != 'q' && code != 'l')) {
        PyErr_Format(PyExc_TypeError, "ids must be an int64 buffer, got format %s", fmt);
        goto done;
    }
    Py_ssize_t n = parse_keys(self, args[0], &seq, &keys);
    if (n < 0)
        goto done;
    const int64_t *v = ids.buf;
    if (ids.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd ids", n, ids.len / 8);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (v[i] < 0) {
            PyErr_Format(PyExc_ValueError, "ids must be >= 0, got %lld", (long long)v[i]);
            goto done;
        }
    }
    if (self->size + n > self->capacity) {
        PyErr_Format(PyExc_OverflowError, "HashIndex holds %zd of %zd keys, cannot add %zd",
                     self->size, self->capacity, n);
        goto done;
    }
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int found;
        PREFETCH_AHEAD_OF(self, keys, i, n);
        uint64_t s = probe(self, &keys[i], &found);
        if (found) {
            PyObject *pos = PyLong_FromSsize_t(i);
            if (pos == NULL || PyList_Append(out, pos) < 0)
                Py_CLEAR(out);
            Py_XDECREF(pos);
            continue;
        }
        put(self, s, &keys[i], v[i]);
    }
done:
    PyMem_Free(keys);
    Py_XDECREF(seq);
    PyBuffer_Release(&ids);
    return out;
}

PyDoc_STRVAR(remove_doc,
"remove(keys) -> None: drop every key. KeyError, changing nothing, if one is absent\n"
"(a key given twice is absent the second time).");

static PyObject *
HashIndex_remove(HashIndex *self, PyObject *obj)
{
    PyObject *seq;
    Key *keys;
    if (check_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_keys(self, obj, &seq, &keys);
    if (n < 0)
        return NULL;
    PyObject *result = Py_None;
    int64_t *removed = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (removed == NULL) {
        PyErr_NoMemory();
        result = NULL;
    }
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        int found;
        PREFETCH_AHEAD_OF(self, keys, i, n);
        uint64_t s = probe(self, &keys[i], &found);
        if (!found) {
            /* The caller's bookkeeping is broken: put back what this call removed, so
             * the error leaves the index as it was. */
            for (Py_ssize_t j = i - 1; j >= 0; j--)
                put(self, probe(self, &keys[j], &found), &keys[j], removed[j]);
            PyErr_SetObject(PyExc_KeyError, PySequence_Fast_GET_ITEM(seq, i));
            result = NULL;
            break;
        }
        removed[i] = self->table[s].value;
        erase_slot(self, s);
    }
    PyMem_Free(removed);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return Py_XNewRef(result);
}

PyDoc_STRVAR(items_doc, "items() -> list[tuple[bytes, int]]: every (key, id), in no order.");

static PyObject *
HashIndex_items(HashIndex *self, PyObject *Py_UNUSED(ignored))
{
    if (check_ready(self) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (uint64_t i = 0; out != NULL && i <= self->mask; i++) {
        const Entry *e = &self->table[i];
        if (e->value < 0)
            continue;
        char k[KEY_NBYTES];
        memcpy(k, &e->k0, 8);
        memcpy(k + 8, &e->k1, 8);
        PyObject *item = Py_BuildValue("(y#L)", k, (Py_ssize_t)KEY_NBYTES, (long long)e->value);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

PyDoc_STRVAR(clear_doc, "clear() -> None: drop every key.");

static PyObject *
HashIndex_clear(HashIndex *self, PyObject *Py_UNUSED(ignored))
{
    if (check_ready(self) < 0)
        return NULL;
    for (uint64_t i = 0; i <= self->mask; i++)
        self->table[i].value = -1;
    self->size = 0;
    Py_RETURN_NONE;
}

static PyMethodDef HashIndex_methods[] = {
    {"get", (PyCFunction)HashIndex_get, METH_O, get_doc},
    {"prefix", (PyCFunction)HashIndex_prefix, METH_O, prefix_doc},
    {"find", (PyCFunction)HashIndex_find, METH_O, find_doc},
    {"insert", (PyCFunction)(void (*)(void))HashIndex_insert, METH_FASTCALL, insert_doc},
    {"remove", (PyCFunction)HashIndex_remove, METH_O, remove_doc},
    {"items", (PyCFunction)HashIndex_items, METH_NOARGS, items_doc},
    {"clear", (PyCFunction)HashIndex_clear, METH_NOARGS, clear_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods HashIndex_as_sequence = {
    .sq_length = (lenfunc)HashIndex_len,
};

PyDoc_STRVAR(HashIndex_doc,
"HashIndex(capacity)\n\n"
"A map from 16-byte block hashes to non-negative ids, holding at most ``capacity``\n"
"keys in a table of at least twice as many slots (fixed: it never rehashes).\n"
"Not thread-safe; every method runs with the GIL held.");

static PyTypeObject HashIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.HashIndex",
    .tp_basicsize = sizeof(HashIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = HashIndex_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)HashIndex_init,
    .tp_dealloc = (destructor)HashIndex_dealloc,
    .tp_methods = HashIndex_methods,
    .tp_as_sequence = &HashIndex_as_sequence,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL, chain_hashes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._core",
    .m_doc = "Compiled block bookkeeping: chained block hashes and the hash -> block index.",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&HashIndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "HashIndex", (PyObject *)&HashIndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
