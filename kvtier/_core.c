/* kvtier._core: the per-block hot loops of the block bookkeeping, compiled.
 *
 * - pack_tokens, chain_hashes: the chained block hashes of hashing.py, one C loop per
 *   prompt
 *   (xxh3_128 inline from the vendored xxhash.h, or any 16-byte digest callable).
 * - HashIndex: a fixed-capacity map from 16-byte block hashes to block ids
 *   (open addressing, linear probing, backward-shift deletion). Batch methods
 *   prefetch the table slots of the keys ahead of the one being probed, so that a
 *   pool of a million blocks, whose table does not fit in the CPU cache, costs
 *   about what a small one does.
 * - populate, Slab: host memory faulted in ahead of its first use (host_pool.py).
 *
 * Every function validates its input before it changes anything, and reports bad
 * input as a Python exception naming the problem.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define KEY_NBYTES 16
#define HUGE_PAGE_NBYTES ((size_t)2 << 20)
#define PREFETCH_AHEAD 16 /* keys ahead whose slots are prefetched (measured: 16 < 32, 64) */

/* ------------------------------------------------------------------ pack_tokens */

PyDoc_STRVAR(pack_tokens_doc,
"pack_tokens(ids) -> bytes\n\n"
"A sequence of token ids as little-endian uint32 bytes, what ``chain_hashes`` hashes.\n"
"ValueError for an id outside [0, 2**32), TypeError for one that is not an int.");

#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* PyLongObject's digits; Python.h includes it from 3.11 */
#endif

/* An exact int of one digit (under 2**30, every token id of a real vocabulary), read
 * from the object itself: measured 4.6x faster per id than PyLong_AsLongLongAndOverflow,
 * which a 4k-token prompt pays 4k times. Into *v; false for any other object (the
 * caller takes the general path). */
static inline int
small_int(PyObject *o, uint32_t *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
        return 0;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)o);
    if (x < 0)
        return 0;
    *v = (uint32_t)x;
#else
    if (Py_SIZE(o) != 1)
        return 0;
    *v = (uint32_t)((PyLongObject *)o)->ob_digit[0];
#endif
    return 1;
}

/* The hash input of a prompt given as a list: one C loop over the ints, where
 * array.array("I", ids) costs several times more per id (a generic item setter). */
static PyObject *
pack_tokens(PyObject *module, PyObject *obj)
{
    PyObject *seq = PySequence_Fast(obj, "token ids must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++, p += 4) {
        PyObject *item = items[i];
        uint32_t u;
        if (!small_int(item, &u)) {
            if (!PyLong_Check(item)) {
                PyErr_Format(PyExc_TypeError, "token id %zd is %.100s, not an int", i,
                             Py_TYPE(item)->tp_name);
                goto fail;
            }
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (v == -1 && PyErr_Occurred())
                goto fail;
            if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
                PyErr_SetString(PyExc_ValueError, "token ids must be in [0, 2**32)");
                goto fail;
            }
            u = (uint32_t)v;
        }
        p[0] = (unsigned char)u;
        p[1] = (unsigned char)(u >> 8);
        p[2] = (unsigned char)(u >> 16);
        p[3] = (unsigned char)(u >> 24);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

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

/* Memory on transparent huge pages where the kernel allows it (the HashIndex table and
 * the BlockTable arrays): a probe lands on a random slot, and with 4 KiB pages a table
 * of a million blocks (48 MiB) misses the TLB on almost every one (measured: a
 * 1M-block prefix lookup 1.6x slower than a 10k-block one on 4 KiB pages, 1.1x on huge
 * pages). Freed with free(). */
static void *
alloc_huge(size_t nbytes)
{
    int huge = nbytes >= HUGE_PAGE_NBYTES;
    void *p = NULL;
    if (posix_memalign(&p, huge ? HUGE_PAGE_NBYTES : 64, nbytes ? nbytes : 1) != 0)
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
    Entry *table = alloc_huge(sizeof(Entry) * slots);
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

/* A list of ints from n int64s. */
static PyObject *
id_list(const int64_t *ids, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(ids[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* ------------------------------------------------------------------ Ring */

/* A queue of ids 0..n-1 in order of arrival, with lazy deletion: the entry at
 * position p for id b is live only while qpos[b] == base + p (qpos is the owner's,
 * one word per id; the base, 0 or 2 * n, tells apart two rings that share it, and is
 * given to each call: a constant 0 costs the common case nothing). Taking an id out
 * only changes qpos[b]; a push appends at the tail; the oldest live entry is found
 * from the head. The ring has 2 * n entries and is compacted when its end is
 * reached, so a compaction frees at least n entries (amortised O(1) per push). A
 * ring, not a linked list: walking it is sequential, where a list chases one pointer
 * (one cache miss in a large pool) per id. */
typedef struct {
    int64_t *ids; /* 2 * n */
    Py_ssize_t head, tail;
} Ring;

/* Move the live entries to the front, in order. */
static void
ring_compact(Ring *r, int64_t *qpos, int64_t base)
{
    Py_ssize_t w = 0;
    for (Py_ssize_t p = r->head; p < r->tail; p++) {
        int64_t b = r->ids[p];
        if (qpos[b] == base + p) {
            r->ids[w] = b;
            qpos[b] = base + w++;
        }
    }
    r->head = 0;
    r->tail = w;
}

/* Append b (not queued in this ring's table) as the newest entry. */
static inline void
ring_push(Ring *r, int64_t *qpos, Py_ssize_t n, int64_t b, int64_t base)
{
    if (r->tail == 2 * n)
        ring_compact(r, qpos, base); /* at most n live entries: room for n more */
    r->ids[r->tail] = b;
    qpos[b] = base + r->tail++;
}

/* The first live position at or after p (the tail when there is none). */
static inline Py_ssize_t
ring_live_from(const Ring *r, const int64_t *qpos, Py_ssize_t p, int64_t base)
{
    while (p < r->tail && qpos[r->ids[p]] != base + p)
        p++;
    return p;
}

/* ------------------------------------------------------------------ UseCounts */

/* How many requests used each block, by block hash: what the reuse policy ranks by.
 * It outlives the blocks (a block evicted and computed again is known), but holds
 * only the ``capacity`` hashes used most recently: a full table forgets its least
 * recently used entry. Entries are 0..size-1 (none is freed but to be reused at
 * once); the ring orders them by last use. */
typedef struct {
    PyObject_HEAD
    HashIndex *index;      /* hash -> entry */
    Py_ssize_t capacity;
    unsigned char *keys;   /* capacity x 16 bytes: each entry's hash */
    int64_t *count;        /* requests that used it */
    int64_t *qpos;         /* its ring position */
    Ring ring;             /* entries, least recently used first */
} UseCounts;

static PyTypeObject UseCountsType;

static inline Key
stored_key(const HashIndex *ix, const unsigned char *h)
{
    Key k;
    memcpy(&k.k0, h, 8);
    memcpy(&k.k1, h + 8, 8);
    k.home = home_slot(ix, k.k0, k.k1);
    return k;
}

/* The count of a 16-byte hash: 0 when it is not held. */
static inline int64_t
uses_of(const UseCounts *u, const unsigned char *h)
{
    int found;
    Key k = stored_key(u->index, h);
    uint64_t s = probe(u->index, &k, &found);
    return found ? u->count[u->index->table[s].value] : 0;
}

static int
UseCounts_init(UseCounts *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:UseCounts", kwlist, &n))
        return -1;
    if (n <= 0 || n > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in [1, 2**40], got %zd", n);
        return -1;
    }
    if (self->index != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "UseCounts is already initialised");
        return -1;
    }
    self->index = (HashIndex *)PyObject_CallFunction((PyObject *)&HashIndexType, "n", n);
    if (self->index == NULL)
        return -1;
    self->capacity = n;
    self->keys = alloc_huge(n * KEY_NBYTES);
    self->count = alloc_huge(n * sizeof(int64_t));
    self->qpos = alloc_huge(n * sizeof(int64_t));
    self->ring.ids = alloc_huge(2 * n * sizeof(int64_t));
    if (!self->keys || !self->count || !self->qpos || !self->ring.ids) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
UseCounts_dealloc(UseCounts *self)
{
    Py_XDECREF(self->index);
    free(self->keys);
    free(self->count);
    free(self->qpos);
    free(self->ring.ids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
uses_ready(const UseCounts *self)
{
    if (self->index == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "UseCounts was not initialised");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(record_doc,
"record(hashes) -> None: one more use of each of a request's blocks, given in chain\n"
"order, each once. They become the most recently used entries, the chain's head\n"
"last, so that a chain's tail is forgotten before its head.");

static PyObject *
UseCounts_record(UseCounts *self, PyObject *obj)
{
    PyObject *seq;
    Key *keys;
    if (uses_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_keys(self->index, obj, &seq, &keys);
    if (n < 0)
        return NULL;
    HashIndex *ix = self->index;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int found;
        if (i >= PREFETCH_AHEAD)
            __builtin_prefetch(&ix->table[keys[i - PREFETCH_AHEAD].home]);
        uint64_t s = probe(ix, &keys[i], &found);
        int64_t e;
        if (found) {
            e = ix->table[s].value;
            self->count[e]++;
        }
        else {
            if (ix->size == self->capacity) { /* forget the least recently used */
                Py_ssize_t p = ring_live_from(&self->ring, self->qpos, self->ring.head, 0);
                e = self->ring.ids[p];
                self->ring.head = p + 1;
                Key old = stored_key(ix, self->keys + e * KEY_NBYTES);
                erase_slot(ix, probe(ix, &old, &found));
                s = probe(ix, &keys[i], &found); /* the erase may have moved its slot */
            }
            else
                e = ix->size;
            memcpy(self->keys + e * KEY_NBYTES, &keys[i].k0, 8);
            memcpy(self->keys + e * KEY_NBYTES + 8, &keys[i].k1, 8);
            self->count[e] = 1;
            put(ix, s, &keys[i], e);
        }
        ring_push(&self->ring, self->qpos, self->capacity, e, 0);
    }
    PyMem_Free(keys);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(counts_doc,
"counts(hashes) -> list[int]: the uses recorded of each hash (0: none remembered).");

static PyObject *
UseCounts_counts(UseCounts *self, PyObject *obj)
{
    PyObject *seq;
    Key *keys;
    if (uses_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_keys(self->index, obj, &seq, &keys);
    if (n < 0)
        return NULL;
    int64_t *counts = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    PyObject *out = NULL;
    if (counts == NULL)
        PyErr_NoMemory();
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            int found;
            PREFETCH_AHEAD_OF(self->index, keys, i, n);
            uint64_t s = probe(self->index, &keys[i], &found);
            counts[i] = found ? self->count[self->index->table[s].value] : 0;
        }
        out = id_list(counts, n);
    }
    PyMem_Free(counts);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

static Py_ssize_t
UseCounts_len(UseCounts *self)
{
    return self->index ? self->index->size : 0;
}

static PyObject *
UseCounts_get_capacity(UseCounts *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->capacity);
}

static PyMethodDef UseCounts_methods[] = {
    {"record", (PyCFunction)UseCounts_record, METH_O, record_doc},
    {"counts", (PyCFunction)UseCounts_counts, METH_O, counts_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef UseCounts_getset[] = {
    {"capacity", (getter)UseCounts_get_capacity, NULL, "hashes it remembers at most", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods UseCounts_as_sequence = {
    .sq_length = (lenfunc)UseCounts_len,
};

PyDoc_STRVAR(UseCounts_doc,
"UseCounts(capacity)\n\n"
"How many requests used each block, by block hash, for the ``capacity`` hashes used\n"
"most recently. Not thread-safe beyond the GIL: each method is one step under it.");

static PyTypeObject UseCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.UseCounts",
    .tp_basicsize = sizeof(UseCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = UseCounts_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)UseCounts_init,
    .tp_dealloc = (destructor)UseCounts_dealloc,
    .tp_methods = UseCounts_methods,
    .tp_getset = UseCounts_getset,
    .tp_as_sequence = &UseCounts_as_sequence,
};

/* ------------------------------------------------------------------ reuse policy */

/* The state of the reuse eviction policy in one table of n blocks. Cached free blocks
 * used by one request so far wait in the table's first ring (probation), those used
 * by two or more (``uses``) in ``protected``; each is stamped with the tick at which
 * it was queued. The victim is the older of the two heads, probation's aged by
 * ``delta`` ticks: a block seen once is worth as much as a protected one ``delta``
 * older. Two ghost lists remember the hashes last evicted from each ring (at most n
 * each); a hash published again while in one moves ``delta``: back from probation,
 * probation was too short (delta falls); back from protected, the reverse. */
#define REUSE_DELTA0 4.0   /* delta starts at this many times n ticks ... */
#define REUSE_DELTA_MAX 16.0 /* ... and stays in [0, this many times n] */
#define REUSE_STEP 4.0     /* ticks a ghost hit moves it, times the other list's share */
#define PROTECTED(n) (2 * (int64_t)(n)) /* the protected ring's base (the first's is 0) */

typedef struct {
    UseCounts *uses;
    Ring protected;          /* base PROTECTED(n) */
    int64_t *stamp;          /* tick at which a queued block was queued */
    int64_t tick;
    double delta;
    HashIndex *ghost;        /* hash -> list * n + slot */
    unsigned char *ghost_keys; /* two lists of n slots of 16 bytes, each circular */
    Py_ssize_t ghost_head[2], ghost_len[2], ghost_live[2];
} Reuse;

static void
reuse_free(Reuse *r)
{
    if (r == NULL)
        return;
    Py_XDECREF(r->uses);
    Py_XDECREF(r->ghost);
    free(r->protected.ids);
    free(r->stamp);
    free(r->ghost_keys);
    PyMem_Free(r);
}

static void
reuse_clear(Reuse *r, Py_ssize_t n)
{
    r->protected.head = r->protected.tail = 0;
    r->tick = 0;
    r->delta = REUSE_DELTA0 * n;
    for (int l = 0; l < 2; l++)
        r->ghost_head[l] = r->ghost_len[l] = r->ghost_live[l] = 0;
}

static Reuse *
reuse_new(UseCounts *uses, Py_ssize_t n)
{
    Reuse *r = PyMem_Calloc(1, sizeof(Reuse));
    if (r == NULL)
        return (Reuse *)PyErr_NoMemory();
    r->uses = (UseCounts *)Py_NewRef(uses);
    r->ghost = (HashIndex *)PyObject_CallFunction((PyObject *)&HashIndexType, "n", 2 * n);
    r->protected.ids = alloc_huge(2 * n * sizeof(int64_t));
    r->stamp = alloc_huge(n * sizeof(int64_t));
    r->ghost_keys = alloc_huge(2 * n * KEY_NBYTES);
    if (r->ghost == NULL || !r->protected.ids || !r->stamp || !r->ghost_keys) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        reuse_free(r);
        return NULL;
    }
    reuse_clear(r, n);
    return r;
}

/* Take hash h out of the ghost lists; the list it was in (0: probation, 1: protected),
 * or -1 when it was in neither. */
static int
ghost_take(Reuse *r, Py_ssize_t n, const unsigned char *h)
{
    int found;
    Key k = stored_key(r->ghost, h);
    uint64_t s = probe(r->ghost, &k, &found);
    if (!found)
        return -1;
    int list = (int)(r->ghost->table[s].value / n);
    erase_slot(r->ghost, s);
    r->ghost_live[list]--;
    return list;
}

/* Remember hash h as evicted from ``list``; the list's oldest slot goes when all n
 * are taken (a slot whose hash came back since is already dead). */
static void
ghost_push(Reuse *r, Py_ssize_t n, int list, const unsigned char *h)
{
    int found;
    if (r->ghost_len[list] == n) {
        Py_ssize_t slot = r->ghost_head[list];
        Key old = stored_key(r->ghost, r->ghost_keys + (list * n + slot) * KEY_NBYTES);
        uint64_t s = probe(r->ghost, &old, &found);
        if (found && r->ghost->table[s].value == list * n + slot) {
            erase_slot(r->ghost, s);
            r->ghost_live[list]--;
        }
        r->ghost_head[list] = (slot + 1) % n;
        r->ghost_len[list]--;
    }
    Key k = stored_key(r->ghost, h);
    uint64_t s = probe(r->ghost, &k, &found);
    if (found) { /* never in practice: a hash is published before it is evicted */
        r->ghost_live[r->ghost->table[s].value / n]--;
        erase_slot(r->ghost, s);
        s = probe(r->ghost, &k, &found);
    }
    Py_ssize_t slot = (r->ghost_head[list] + r->ghost_len[list]++) % n;
    memcpy(r->ghost_keys + (list * n + slot) * KEY_NBYTES, h, KEY_NBYTES);
    put(r->ghost, s, &k, list * n + slot);
    r->ghost_live[list]++;
}

/* Fetch ahead the ghost-index slot of the 16-byte hash at h (a macro: see
 * PREFETCH_AHEAD_OF). */
#define PREFETCH_GHOST(r, h)                                                      \
    do {                                                                          \
        uint64_t k0_, k1_;                                                        \
        memcpy(&k0_, (h), 8);                                                     \
        memcpy(&k1_, (h) + 8, 8);                                                 \
        __builtin_prefetch(&(r)->ghost->table[home_slot((r)->ghost, k0_, k1_)]); \
    } while (0)

/* A hash published again: if a ghost list holds it, move delta as described above. */
static void
reuse_returned(Reuse *r, Py_ssize_t n, const unsigned char *h)
{
    int list = ghost_take(r, n, h);
    if (list < 0)
        return;
    Py_ssize_t mine = r->ghost_live[list], other = r->ghost_live[1 - list];
    double step = REUSE_STEP * fmax(1.0, (double)other / (double)(mine > 1 ? mine : 1));
    double delta = r->delta + (list == 0 ? -step : step);
    r->delta = fmin(fmax(delta, 0.0), REUSE_DELTA_MAX * n);
}

/* ------------------------------------------------------------------ BlockTable */

/* The per-block state of a pool (block_pool.py): ref counts, each block's hash, parent
 * hash and chain position, the queue of cached free blocks and the stack of empty
 * ones, with the hash -> block map (a HashIndex) kept in step. It is in C because
 * every pool operation touches a few words per block: in numpy each such step is a
 * call of about a microsecond, which a request of a few blocks pays many times over.
 *
 * The queue is a Ring in eviction order: a touch only clears qpos[b]; a free appends
 * at the tail; an allocation takes live entries from the head. Under the reuse policy
 * (``Reuse``) the ring holds the probation blocks and a second ring the protected
 * ones, and an allocation merges their heads. */

typedef struct {
    PyObject_HEAD
    HashIndex *index;
    Py_ssize_t n;
    int64_t *ref;            /* references; 0: free */
    int64_t *pos;            /* chain position of the hash the block holds; -1: none */
    unsigned char *hash;     /* n x 16 bytes, valid where pos >= 0 */
    unsigned char *parent;   /* n x 16 bytes, valid where pos >= 0 */
    int64_t *qpos;           /* ring base + position of a queued block; -1: not queued */
    Ring lru;                /* cached free blocks (reuse: those in probation), oldest first */
    Py_ssize_t num_lru;      /* cached free blocks, in either ring */
    int64_t *empty;          /* stack of empty free blocks */
    Py_ssize_t num_empty;
    Py_ssize_t untouched;    /* the stack's bottom entries never popped: blocks
                                n - untouched .. n - 1, never handed out */
    int in_hook;             /* allocate is calling on_evict: no change allowed */
    Reuse *reuse;            /* the reuse policy's state; NULL: LRU */
} BlockTable;

/* The words of block b that the batch loops touch, fetched ahead: in a large pool each
 * is a cache miss, and a loop that waits for them one block at a time costs several
 * times what it does in a pool that fits in the cache. A macro for the reason given at
 * PREFETCH_AHEAD_OF. */
#define PREFETCH_BLOCK(t, b)                                 \
    do {                                                     \
        __builtin_prefetch(&(t)->ref[(b)], 1);               \
        __builtin_prefetch(&(t)->pos[(b)], 1);               \
        __builtin_prefetch(&(t)->qpos[(b)], 1);              \
        __builtin_prefetch(&(t)->hash[(b) * KEY_NBYTES], 1);   \
        __builtin_prefetch(&(t)->parent[(b) * KEY_NBYTES], 1); \
    } while (0)

/* items[0:n] (ints) into out, each checked to be in [0, limit); the IndexError names
 * the bad one as ``what`` ("block id", "source row", ...). */
static int
ids_in_range(PyObject **items, Py_ssize_t n, Py_ssize_t limit, int64_t *out, const char *what)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(items[i]);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_IndexError, "%s %zd out of range [0, %zd)", what, v, limit);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

/* A sequence of block ids as a malloc'd int64 array (caller frees with PyMem_Free),
 * each checked to be in [0, n). */
static Py_ssize_t
parse_ids(const BlockTable *t, PyObject *obj, int64_t **out)
{
    PyObject *seq = PySequence_Fast(obj, "block ids must be a sequence of ints");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *ids = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (ids == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    if (ids_in_range(PySequence_Fast_ITEMS(seq), n, t->n, ids, "block id") < 0) {
        PyMem_Free(ids);
        Py_DECREF(seq);
        return -1;
    }
    Py_DECREF(seq);
    *out = ids;
    return n;
}

static int
BlockTable_init(BlockTable *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", "policy", "uses", NULL};
    Py_ssize_t n;
    const char *policy = "lru";
    PyObject *uses = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|sO:BlockTable", kwlist, &n, &policy, &uses))
        return -1;
    if (n <= 0 || n > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "num_blocks must be in [1, 2**40], got %zd", n);
        return -1;
    }
    int reuse = strcmp(policy, "reuse") == 0;
    if (!reuse && strcmp(policy, "lru") != 0) {
        PyErr_Format(PyExc_ValueError, "policy must be 'lru' or 'reuse', got '%s'", policy);
        return -1;
    }
    if (uses == Py_None ? reuse : !PyObject_TypeCheck(uses, &UseCountsType)) {
        PyErr_SetString(PyExc_TypeError, "uses must be a UseCounts (policy 'reuse' needs "
                                         "one, 'lru' ignores it) or None");
        return -1;
    }
    if (self->index != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BlockTable is already initialised");
        return -1;
    }
    self->index = (HashIndex *)PyObject_CallFunction((PyObject *)&HashIndexType, "n", n);
    if (self->index == NULL)
        return -1;
    self->n = n;
    self->ref = alloc_huge(n * sizeof(int64_t));
    self->pos = alloc_huge(n * sizeof(int64_t));
    self->hash = alloc_huge(n * KEY_NBYTES);
    self->parent = alloc_huge(n * KEY_NBYTES);
    self->qpos = alloc_huge(n * sizeof(int64_t));
    self->lru.ids = alloc_huge(2 * n * sizeof(int64_t));
    self->empty = alloc_huge(n * sizeof(int64_t));
    if (!self->ref || !self->pos || !self->hash || !self->parent || !self->qpos ||
        !self->lru.ids || !self->empty) {
        PyErr_NoMemory();
        return -1;
    }
    if (reuse && (uses_ready((UseCounts *)uses) < 0 ||
                  (self->reuse = reuse_new((UseCounts *)uses, n)) == NULL))
        return -1;
    for (Py_ssize_t b = 0; b < n; b++) {
        self->ref[b] = 0;
        self->pos[b] = -1;
        self->qpos[b] = -1;
        self->empty[b] = n - 1 - b; /* popped from the top: block 0 first */
    }
    self->num_empty = n;
    self->untouched = n;
    self->lru.head = self->lru.tail = self->num_lru = 0;
    return 0;
}

static void
BlockTable_dealloc(BlockTable *self)
{
    Py_XDECREF(self->index);
    free(self->ref);
    free(self->pos);
    free(self->hash);
    free(self->parent);
    free(self->qpos);
    free(self->lru.ids);
    free(self->empty);
    reuse_free(self->reuse);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
table_ready(const BlockTable *self)
{
    if (self->index == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BlockTable was not initialised");
        return -1;
    }
    return 0;
}

/* Changes wait until allocate's eviction hook has returned: allocate has chosen its
 * victims and commits them afterwards, so a change made by the hook would be lost. */
static int
table_mutable(const BlockTable *self)
{
    if (table_ready(self) < 0)
        return -1;
    if (self->in_hook) {
        PyErr_SetString(PyExc_RuntimeError, "a pool cannot change inside its eviction hook");
        return -1;
    }
    return 0;
}

/* Reuse: fetch ahead the use-count slot of block b's hash, which queueing it probes (a
 * cache miss per block in a large table). A macro for the reason given at
 * PREFETCH_AHEAD_OF. */
#define PREFETCH_USES(t, b)                                                       \
    do {                                                                          \
        const HashIndex *ix_ = (t)->reuse->uses->index;                           \
        uint64_t k0_, k1_;                                                        \
        memcpy(&k0_, (t)->hash + (b) * KEY_NBYTES, 8);                            \
        memcpy(&k1_, (t)->hash + (b) * KEY_NBYTES + 8, 8);                        \
        __builtin_prefetch(&ix_->table[home_slot(ix_, k0_, k1_)]);               \
    } while (0)

/* Queue the blocks of ids[0:n] that reached ref 0, last first (free's second half):
 * cached ones at the tail of their ring (LRU: the one ring; reuse: stamped, in the ring
 * their use count picks), empty ones on the empty stack. Inlined once per policy, with
 * ``reuse`` a constant, so that the LRU loop tests nothing more per block. */
static inline __attribute__((always_inline)) void
queue_freed(BlockTable *t, const int64_t *ids, Py_ssize_t n, const int reuse)
{
    Reuse *r = t->reuse;
    Py_ssize_t first_empty = t->num_empty;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int64_t b = ids[i];
        if (reuse && i >= PREFETCH_AHEAD)
            PREFETCH_USES(t, ids[i - PREFETCH_AHEAD]);
        if (t->ref[b] != 0 || t->qpos[b] != -1)
            continue; /* still held, or queued by a repeat of it later in ids */
        if (t->pos[b] >= 0) {
            if (reuse && uses_of(r->uses, t->hash + b * KEY_NBYTES) >= 2)
                ring_push(&r->protected, t->qpos, t->n, b, PROTECTED(t->n));
            else
                ring_push(&t->lru, t->qpos, t->n, b, 0);
            if (reuse)
                r->stamp[b] = r->tick++;
            t->num_lru++;
        }
        else {
            t->empty[t->num_empty++] = b;
            t->qpos[b] = -2; /* marks it stacked until this loop ends */
        }
    }
    for (Py_ssize_t i = first_empty; i < t->num_empty; i++)
        t->qpos[t->empty[i]] = -1;
}

/* Reuse: the next victim from probation position *p or protected position *q (each
 * live or its ring's tail; at least one is live); advances that one past it. */
static inline int64_t
reuse_victim(const BlockTable *t, Py_ssize_t *p, Py_ssize_t *q)
{
    const Reuse *r = t->reuse;
    const Ring *prob = &t->lru, *prot = &r->protected;
    int from_probation = *q >= prot->tail ||
                         (*p < prob->tail && (double)r->stamp[prob->ids[*p]] - r->delta <=
                                                 (double)r->stamp[prot->ids[*q]]);
    int64_t b = from_probation ? prob->ids[(*p)++] : prot->ids[(*q)++];
    *p = ring_live_from(prob, t->qpos, *p, 0);
    *q = ring_live_from(prot, t->qpos, *q, PROTECTED(t->n));
    return b;
}

PyDoc_STRVAR(touch_doc,
"touch(ids) -> None: take a reference on each block; a cached free block leaves the\n"
"queue. ValueError, changing nothing, for a free block that holds no hash.");

static PyObject *
BlockTable_touch(BlockTable *self, PyObject *obj)
{
    int64_t *ids;
    if (table_mutable(self) < 0)
        return NULL;
    Py_ssize_t n = parse_ids(self, obj, &ids);
    if (n < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH_BLOCK(self, ids[i + PREFETCH_AHEAD]);
        if (self->ref[ids[i]] == 0 && self->qpos[ids[i]] < 0) {
            PyErr_Format(PyExc_ValueError, "block %lld is empty: only cached blocks are hit",
                         (long long)ids[i]);
            PyMem_Free(ids);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (self->ref[b]++ == 0) {
            self->qpos[b] = -1; /* its ring entry becomes stale */
            self->num_lru--;
        }
    }
    PyMem_Free(ids);
    Py_RETURN_NONE;
}

/* The victims' (ids, hashes, positions, parents) as four lists. */
static PyObject *
chain_info(const BlockTable *t, const int64_t *ids, Py_ssize_t n)
{
    PyObject *hashes = PyList_New(n), *positions = PyList_New(n), *parents = PyList_New(n);
    PyObject *blocks = id_list(ids, n), *result = NULL;
    if (hashes == NULL || positions == NULL || parents == NULL || blocks == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        PyObject *h = PyBytes_FromStringAndSize((const char *)t->hash + b * KEY_NBYTES, KEY_NBYTES);
        PyObject *p = PyBytes_FromStringAndSize((const char *)t->parent + b * KEY_NBYTES, KEY_NBYTES);
        PyObject *q = PyLong_FromLongLong(t->pos[b]);
        if (h == NULL || p == NULL || q == NULL) {
            Py_XDECREF(h);
            Py_XDECREF(p);
            Py_XDECREF(q);
            goto done;
        }
        PyList_SET_ITEM(hashes, i, h);
        PyList_SET_ITEM(parents, i, p);
        PyList_SET_ITEM(positions, i, q);
    }
    result = PyTuple_Pack(4, blocks, hashes, positions, parents);
done:
    Py_XDECREF(blocks);
    Py_XDECREF(hashes);
    Py_XDECREF(positions);
    Py_XDECREF(parents);
    return result;
}

PyDoc_STRVAR(allocate_doc,
"allocate(n, on_evict) -> list[int]\n\n"
"``n`` blocks with ref 1: empty blocks first, then cached ones in the policy's\n"
"eviction order, which are evicted (reuse: their hashes join the ghost lists). Before anything changes, ``on_evict(ids, hashes,\n"
"positions, parents)`` (if not None) sees the victims, in eviction order; if it\n"
"raises, nothing changes. ValueError, changing nothing, when fewer than n are free.");

static PyObject *
BlockTable_allocate(BlockTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "allocate takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (table_mutable(self) < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    PyObject *hook = args[1];
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > self->num_empty + self->num_lru) {
        PyErr_Format(PyExc_ValueError, "cannot allocate %zd blocks, %zd free", n,
                     self->num_empty + self->num_lru);
        return NULL;
    }
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "on_evict must be None or a callable");
        return NULL;
    }
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (out == NULL)
        return PyErr_NoMemory();
    Py_ssize_t k = n < self->num_empty ? n : self->num_empty;
    for (Py_ssize_t i = 0; i < k; i++)
        out[i] = self->empty[self->num_empty - 1 - i];
    /* Find the victims without dequeuing them: the hook may still fail. */
    Py_ssize_t v = k, p = self->lru.head, q = 0;
    Reuse *r = self->reuse;
    if (r == NULL) {
        for (; v < n; p++) {
            if (p + PREFETCH_AHEAD < self->lru.tail)
                __builtin_prefetch(&self->qpos[self->lru.ids[p + PREFETCH_AHEAD]]);
            int64_t b = self->lru.ids[p];
            if (self->qpos[b] == p)
                out[v++] = b;
        }
    }
    else if (v < n) {
        p = ring_live_from(&self->lru, self->qpos, p, 0);
        q = ring_live_from(&r->protected, self->qpos, r->protected.head, PROTECTED(self->n));
        while (v < n)
            out[v++] = reuse_victim(self, &p, &q);
    }
    int64_t *victims = out + k;
    Py_ssize_t nv = v - k;
    Key *keys = PyMem_Malloc(sizeof(Key) * (nv ? nv : 1));
    if (keys == NULL) {
        PyMem_Free(out);
        return PyErr_NoMemory();
    }
    HashIndex *ix = self->index;
    for (Py_ssize_t i = 0; i < nv; i++) {
        if (i + PREFETCH_AHEAD < nv)
            PREFETCH_BLOCK(self, victims[i + PREFETCH_AHEAD]);
        keys[i] = stored_key(ix, self->hash + victims[i] * KEY_NBYTES);
    }
    if (nv && hook != Py_None) {
        PyObject *info = chain_info(self, victims, nv);
        self->in_hook = 1;
        PyObject *res = info ? PyObject_Call(hook, info, NULL) : NULL;
        self->in_hook = 0;
        Py_XDECREF(info);
        if (res == NULL) {
            PyMem_Free(keys);
            PyMem_Free(out);
            return NULL;
        }
        Py_DECREF(res);
    }
    /* Commit: the victims leave the rings (reuse: into the ghost lists) and drop their
     * hashes. */
    self->num_empty -= k;
    if (self->num_empty < self->untouched)
        self->untouched = self->num_empty;
    if (nv) {
        self->lru.head = p;
        if (r != NULL) {
            r->protected.head = q;
            for (Py_ssize_t i = 0; i < nv; i++) {
                if (i + PREFETCH_AHEAD < nv) { /* its slot, and the slots of the hashes
                                                   the pushes ahead may drop */
                    PREFETCH_GHOST(r, self->hash + victims[i + PREFETCH_AHEAD] * KEY_NBYTES);
                    for (int l = 0; l < 2; l++)
                        if (r->ghost_len[l] == self->n) {
                            Py_ssize_t ahead = (r->ghost_head[l] + PREFETCH_AHEAD) % self->n;
                            PREFETCH_GHOST(r, r->ghost_keys + (l * self->n + ahead) * KEY_NBYTES);
                        }
                }
                ghost_push(r, self->n, self->qpos[victims[i]] >= PROTECTED(self->n),
                           self->hash + victims[i] * KEY_NBYTES);
            }
        }
    }
    self->num_lru -= nv;
    for (Py_ssize_t i = 0; i < nv; i++) {
        int found;
        PREFETCH_AHEAD_OF(ix, keys, i, nv);
        uint64_t s = probe(ix, &keys[i], &found);
        if (found) /* always: the table and its index change together */
            erase_slot(ix, s);
        self->qpos[victims[i]] = -1;
        self->pos[victims[i]] = -1;
    }
    PyMem_Free(keys);
    for (Py_ssize_t i = 0; i < n; i++)
        self->ref[out[i]] = 1;
    PyObject *result = id_list(out, n);
    PyMem_Free(out);
    return result;
}

PyDoc_STRVAR(publish_doc,
"publish(ids, hashes, positions, parents) -> int\n\n"
"Make in-use blocks that hold no hash hittable: ``ids[i]`` holds ``hashes[i]`` at\n"
"chain position ``positions[i]`` after ``parents[i]``. A hash another block holds\n"
"stays there (first writer wins) and that block stays unhashed. Returns how many\n"
"were published. ValueError (TypeError for a wrong type), changing nothing, for\n"
"lists of different lengths, a free or already hashed or repeated block, a negative\n"
"position, or a hash that is not 16 bytes.");

static PyObject *
BlockTable_publish(BlockTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "publish takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    if (table_mutable(self) < 0)
        return NULL;
    int64_t *ids = NULL;
    Key *keys = NULL, *pkeys = NULL;
    PyObject *hseq = NULL, *pseq = NULL, *posseq = NULL, *result = NULL;
    int64_t *pos = NULL;
    Py_ssize_t n = parse_ids(self, args[0], &ids);
    if (n < 0)
        return NULL;
    if (parse_keys(self->index, args[1], &hseq, &keys) < 0 ||
        parse_keys(self->index, args[3], &pseq, &pkeys) < 0)
        goto done;
    posseq = PySequence_Fast(args[2], "positions must be a sequence of ints");
    if (posseq == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(hseq) != n || PySequence_Fast_GET_SIZE(pseq) != n ||
        PySequence_Fast_GET_SIZE(posseq) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "publish needs as many hashes, positions and parents as blocks");
        goto done;
    }
    pos = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (pos == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        pos[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(posseq, i));
        if (pos[i] == -1 && PyErr_Occurred())
            goto done;
        if (pos[i] < 0) {
            PyErr_Format(PyExc_ValueError, "chain positions must be >= 0, got %lld",
                         (long long)pos[i]);
            goto done;
        }
    }
    /* Every block in use, unhashed, and given once: marked -2 while checking. */
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n && bad < 0; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH_BLOCK(self, ids[i + PREFETCH_AHEAD]);
        if (self->ref[ids[i]] <= 0 || self->pos[ids[i]] != -1)
            bad = i;
        else
            self->pos[ids[i]] = -2;
    }
    for (Py_ssize_t i = 0; i < (bad < 0 ? n : bad); i++)
        self->pos[ids[i]] = -1;
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError,
                     "publish needs in-use blocks that hold no hash, each once; block %lld",
                     (long long)ids[bad]);
        goto done;
    }
    Py_ssize_t published = 0;
    HashIndex *ix = self->index;
    for (Py_ssize_t i = 0; i < n; i++) {
        int found;
        PREFETCH_AHEAD_OF(ix, keys, i, n);
        uint64_t s = probe(ix, &keys[i], &found);
        if (found)
            continue; /* another block holds it: this one stays unhashed */
        put(ix, s, &keys[i], ids[i]);
        int64_t b = ids[i];
        memcpy(self->hash + b * KEY_NBYTES, &keys[i].k0, 8);
        memcpy(self->hash + b * KEY_NBYTES + 8, &keys[i].k1, 8);
        memcpy(self->parent + b * KEY_NBYTES, &pkeys[i].k0, 8);
        memcpy(self->parent + b * KEY_NBYTES + 8, &pkeys[i].k1, 8);
        self->pos[b] = pos[i];
        if (self->reuse != NULL)
            reuse_returned(self->reuse, self->n, self->hash + b * KEY_NBYTES);
        published++;
    }
    result = PyLong_FromSsize_t(published);
done:
    PyMem_Free(ids);
    PyMem_Free(keys);
    PyMem_Free(pkeys);
    PyMem_Free(pos);
    Py_XDECREF(hseq);
    Py_XDECREF(pseq);
    Py_XDECREF(posseq);
    return result;
}

PyDoc_STRVAR(free_doc,
"free(ids) -> None: drop one reference from each of a request's blocks (in request\n"
"order). Those reaching 0 are queued last block first: cached ones as the newest of\n"
"their policy's queue (a chain's suffix is evicted before its prefix; reuse: in\n"
"protected when ``uses`` counts 2 or more uses of the hash), empty ones on the empty\n"
"stack. ValueError, changing nothing, if a block would drop below 0.");

static PyObject *
BlockTable_free(BlockTable *self, PyObject *obj)
{
    int64_t *ids;
    if (table_mutable(self) < 0)
        return NULL;
    Py_ssize_t n = parse_ids(self, obj, &ids);
    if (n < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH_BLOCK(self, ids[i + PREFETCH_AHEAD]);
        if (--self->ref[ids[i]] < 0) { /* undo: a block given more times than held */
            for (Py_ssize_t j = i; j >= 0; j--)
                self->ref[ids[j]]++;
            PyErr_Format(PyExc_ValueError, "block %lld is freed more often than it is held",
                         (long long)ids[i]);
            PyMem_Free(ids);
            return NULL;
        }
    }
    if (__builtin_expect(self->reuse == NULL, 1))
        queue_freed(self, ids, n, 0);
    else
        queue_freed(self, ids, n, 1);
    PyMem_Free(ids);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(holds_doc,
"holds(ids, hashes) -> bool: whether each ``ids[i]`` holds ``hashes[i]`` (a hit is not\n"
"stale). ValueError if the lengths differ.");

static PyObject *
BlockTable_holds(BlockTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "holds takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (table_ready(self) < 0)
        return NULL;
    int64_t *ids;
    PyObject *seq;
    Key *keys;
    Py_ssize_t n = parse_ids(self, args[0], &ids);
    if (n < 0)
        return NULL;
    if (parse_keys(self->index, args[1], &seq, &keys) < 0) {
        PyMem_Free(ids);
        return NULL;
    }
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd blocks but %zd hashes", n,
                     PySequence_Fast_GET_SIZE(seq));
    }
    else {
        int all = 1;
        for (Py_ssize_t i = 0; i < n && all; i++) {
            const unsigned char *h = self->hash + ids[i] * KEY_NBYTES;
            all = self->pos[ids[i]] >= 0 && memcmp(h, &keys[i].k0, 8) == 0 &&
                  memcmp(h + 8, &keys[i].k1, 8) == 0;
        }
        result = PyBool_FromLong(all);
    }
    PyMem_Free(ids);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(num_queued_doc,
"num_queued(ids) -> int: how many of ``ids`` are free (ref 0): touching them uses\n"
"free space.");

static PyObject *
BlockTable_num_queued(BlockTable *self, PyObject *obj)
{
    int64_t *ids;
    if (table_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_ids(self, obj, &ids), count = 0;
    if (n < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        count += self->ref[ids[i]] == 0;
    PyMem_Free(ids);
    return PyLong_FromSsize_t(count);
}

PyDoc_STRVAR(cached_doc,
"cached(ids) -> (ids, hashes, positions, parents): the blocks among ``ids`` that hold\n"
"a hash, in the given order, with their hashes, chain positions and parent hashes.");

static PyObject *
BlockTable_cached(BlockTable *self, PyObject *obj)
{
    int64_t *ids;
    if (table_ready(self) < 0)
        return NULL;
    Py_ssize_t n = parse_ids(self, obj, &ids), k = 0;
    if (n < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (self->pos[ids[i]] >= 0)
            ids[k++] = ids[i];
    PyObject *result = chain_info(self, ids, k);
    PyMem_Free(ids);
    return result;
}

PyDoc_STRVAR(walk_back_doc,
"walk_back(last, count) -> (list[int], bytes | None)\n\n"
"The blocks of the ``count`` chain positions ending at hash ``last``, oldest first,\n"
"following parent hashes: ``(blocks, None)`` when all are held here, else\n"
"``([], missing)`` with the first hash (walking back) that is not (always so when\n"
"``count`` exceeds the table's blocks: a chain visits each block once).");

static PyObject *
BlockTable_walk_back(BlockTable *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "walk_back takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (table_ready(self) < 0)
        return NULL;
    Key key;
    if (parse_key(self->index, args[0], &key) < 0)
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "count must be >= 0, got %zd", count);
        return NULL;
    }
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (count ? count : 1));
    if (out == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = count - 1; i >= 0; i--) {
        int found;
        uint64_t s = probe(self->index, &key, &found);
        if (!found) {
            char h[KEY_NBYTES];
            memcpy(h, &key.k0, 8);
            memcpy(h + 8, &key.k1, 8);
            PyMem_Free(out);
            return Py_BuildValue("([]y#)", h, (Py_ssize_t)KEY_NBYTES);
        }
        out[i] = self->index->table[s].value;
        key = stored_key(self->index, self->parent + out[i] * KEY_NBYTES);
    }
    PyObject *blocks = id_list(out, count);
    PyMem_Free(out);
    if (blocks == NULL)
        return NULL;
    PyObject *result = PyTuple_Pack(2, blocks, Py_None);
    Py_DECREF(blocks);
    return result;
}

PyDoc_STRVAR(eviction_order_doc,
"eviction_order() -> list[int]: the cached free blocks in the order allocations would\n"
"evict them (O(ring)).");

static PyObject *
BlockTable_eviction_order(BlockTable *self, PyObject *Py_UNUSED(ignored))
{
    if (table_ready(self) < 0)
        return NULL;
    int64_t *order = PyMem_Malloc(sizeof(int64_t) * (self->num_lru ? self->num_lru : 1));
    if (order == NULL)
        return PyErr_NoMemory();
    Py_ssize_t p = ring_live_from(&self->lru, self->qpos, self->lru.head, 0);
    if (self->reuse == NULL) {
        for (Py_ssize_t v = 0; v < self->num_lru; v++)
            order[v] = self->lru.ids[p], p = ring_live_from(&self->lru, self->qpos, p + 1, 0);
    }
    else {
        Ring *prot = &self->reuse->protected;
        Py_ssize_t q = ring_live_from(prot, self->qpos, prot->head, PROTECTED(self->n));
        for (Py_ssize_t v = 0; v < self->num_lru; v++)
            order[v] = reuse_victim(self, &p, &q);
    }
    PyObject *out = id_list(order, self->num_lru);
    PyMem_Free(order);
    return out;
}

PyDoc_STRVAR(ghosts_doc,
"ghosts() -> tuple[int, int]: reuse policy: how many hashes evicted from probation\n"
"and from protected it remembers (each at most num_blocks); (0, 0) under LRU.");

static PyObject *
BlockTable_ghosts(BlockTable *self, PyObject *Py_UNUSED(ignored))
{
    if (table_ready(self) < 0)
        return NULL;
    Reuse *r = self->reuse;
    return Py_BuildValue("(nn)", r ? r->ghost_live[0] : 0, r ? r->ghost_live[1] : 0);
}

PyDoc_STRVAR(empty_blocks_doc,
"empty_blocks() -> list[int]: the empty free blocks, the next to be allocated last.");

static PyObject *
BlockTable_empty_blocks(BlockTable *self, PyObject *Py_UNUSED(ignored))
{
    if (table_ready(self) < 0)
        return NULL;
    return id_list(self->empty, self->num_empty);
}

PyDoc_STRVAR(refs_doc, "refs() -> list[int]: the reference count of every block.");

static PyObject *
BlockTable_refs(BlockTable *self, PyObject *Py_UNUSED(ignored))
{
    if (table_ready(self) < 0)
        return NULL;
    return id_list(self->ref, self->n);
}

PyDoc_STRVAR(reset_doc,
"reset() -> bool: forget every hash and queue every block as empty; False, changing\n"
"nothing, while any block is in use.");

static PyObject *
BlockTable_reset(BlockTable *self, PyObject *Py_UNUSED(ignored))
{
    if (table_mutable(self) < 0)
        return NULL;
    if (self->num_empty + self->num_lru != self->n)
        Py_RETURN_FALSE;
    PyObject *r = HashIndex_clear(self->index, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    for (Py_ssize_t b = 0; b < self->n; b++) {
        self->pos[b] = -1;
        self->qpos[b] = -1;
        self->empty[b] = self->n - 1 - b; /* the untouched bottom holds the same blocks */
    }
    self->num_empty = self->n;
    self->lru.head = self->lru.tail = self->num_lru = 0;
    if (self->reuse != NULL) {
        r = HashIndex_clear(self->reuse->ghost, NULL);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        reuse_clear(self->reuse, self->n);
    }
    Py_RETURN_TRUE;
}

static PyObject *
BlockTable_get_index(BlockTable *self, void *Py_UNUSED(closure))
{
    if (table_ready(self) < 0)
        return NULL;
    return Py_NewRef(self->index);
}

static PyObject *
BlockTable_get_num_free(BlockTable *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->num_empty + self->num_lru);
}

static PyObject *
BlockTable_get_num_empty(BlockTable *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->num_empty);
}

static PyObject *
BlockTable_get_frontier(BlockTable *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->n - self->untouched);
}

static PyObject *
BlockTable_get_policy(BlockTable *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->reuse ? "reuse" : "lru");
}

static PyObject *
BlockTable_get_delta(BlockTable *self, void *Py_UNUSED(closure))
{
    if (self->reuse == NULL)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->reuse->delta);
}

static PyMethodDef BlockTable_methods[] = {
    {"touch", (PyCFunction)BlockTable_touch, METH_O, touch_doc},
    {"allocate", (PyCFunction)(void (*)(void))BlockTable_allocate, METH_FASTCALL, allocate_doc},
    {"publish", (PyCFunction)(void (*)(void))BlockTable_publish, METH_FASTCALL, publish_doc},
    {"free", (PyCFunction)BlockTable_free, METH_O, free_doc},
    {"holds", (PyCFunction)(void (*)(void))BlockTable_holds, METH_FASTCALL, holds_doc},
    {"num_queued", (PyCFunction)BlockTable_num_queued, METH_O, num_queued_doc},
    {"cached", (PyCFunction)BlockTable_cached, METH_O, cached_doc},
    {"walk_back", (PyCFunction)(void (*)(void))BlockTable_walk_back, METH_FASTCALL,
     walk_back_doc},
    {"eviction_order", (PyCFunction)BlockTable_eviction_order, METH_NOARGS,
     eviction_order_doc},
    {"ghosts", (PyCFunction)BlockTable_ghosts, METH_NOARGS, ghosts_doc},
    {"empty_blocks", (PyCFunction)BlockTable_empty_blocks, METH_NOARGS, empty_blocks_doc},
    {"refs", (PyCFunction)BlockTable_refs, METH_NOARGS, refs_doc},
    {"reset", (PyCFunction)BlockTable_reset, METH_NOARGS, reset_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockTable_getset[] = {
    {"index", (getter)BlockTable_get_index, NULL, "the HashIndex of the held hashes", NULL},
    {"num_free", (getter)BlockTable_get_num_free, NULL, "empty plus cached free blocks", NULL},
    {"num_empty", (getter)BlockTable_get_num_empty, NULL, "free blocks holding no hash", NULL},
    {"frontier", (getter)BlockTable_get_frontier, NULL,
     "blocks frontier .. num_blocks - 1 have never been handed out by allocate (empty\n"
     "blocks go out in ascending order, after the ones freed back empty)", NULL},
    {"policy", (getter)BlockTable_get_policy, NULL, "the eviction policy: 'lru' or 'reuse'", NULL},
    {"delta", (getter)BlockTable_get_delta, NULL,
     "reuse: the ticks probation is aged by when heads are compared; None under LRU", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(BlockTable_doc,
"BlockTable(num_blocks, policy='lru', uses=None)\n\n"
"The per-block state of a pool: ref counts; each block's hash, parent hash and chain\n"
"position; the queue of cached free blocks, in the eviction order of ``policy``, and\n"
"a stack of empty ones; and ``index``, the HashIndex of held hashes, kept in step.\n"
"Empty blocks freed back are handed out again first, then the never used ones in\n"
"ascending order: ``frontier`` is how far allocate has ever reached.\n"
"``policy`` 'lru' evicts the least recently freed block; 'reuse' ranks blocks by\n"
"``uses`` (a UseCounts, which it needs) as kvtier.eviction describes. Every\n"
"method checks its input before it changes anything. Not thread-safe; every method\n"
"runs with the GIL held.");

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.BlockTable",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = BlockTable_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockTable_init,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_methods = BlockTable_methods,
    .tp_getset = BlockTable_getset,
};

/* ------------------------------------------------------------------ Copier */

/* Block copies between two host buffers on a C worker thread. On CPU a prefetch of
 * host hits is one such copy, and so is each value a spill load checks (copied here
 * while the loading thread hashes it); run by a Python worker it cost the engine thread a GIL
 * hand-off each way (measured: ~100-300 us per request on a 2-core VM, more than the
 * copy of a block), because the woken worker holds the GIL while it runs Python. This
 * thread never takes the GIL: a job is raw pointers and row numbers, checked when it
 * is submitted. A caller that waits for a job joins in: pieces of rows are claimed one
 * at a time from a shared counter, so a job nobody has started runs on the waiting thread with
 * no hand-off at all, and one already running gets a second core (torch copies with
 * two threads here; one thread alone reached about half the bandwidth). */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

enum { JOB_QUEUED, JOB_RUNNING, JOB_DONE, JOB_CANCELLED };
#define PIECE_NBYTES ((size_t)256 << 10) /* the unit two threads share a copy in */
#define SPIN_SECONDS 100e-6 /* how long a waiter polls for the last piece, and the worker
                               for its next job, before sleeping */

typedef struct Job {
    struct Job *next;
    atomic_int state;    /* changed from QUEUED and to DONE under the copier's lock */
    atomic_int refs;     /* the CopyJob object and the queue: freed by the last */
    atomic_long claimed; /* pieces handed out */
    atomic_long copied;  /* pieces copied */
    const char *src;
    char *dst;
    size_t row;          /* bytes per row */
    int cached;          /* plain stores: the bytes stay in the CPU cache for their reader */
    Py_ssize_t n;
    int64_t *rows;       /* n source rows, then n destination rows */
    double start, seconds;
} Job;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work;  /* the worker waits for jobs */
    pthread_cond_t done;  /* waiters wait for a job to finish */
    Job *head, *tail;
    atomic_int queued;    /* jobs in the queue, read without the lock by the polling worker */
    int started, stop;
    char name[16];        /* the thread's OS name (Linux allows 15 bytes) */
} Copier;

typedef struct {
    PyObject_HEAD
    Copier *copier;       /* kept alive: wait() uses its lock */
    Job *job;
    Py_buffer src, dst;   /* held until the job can no longer run */
} CopyJob;

static void
job_release(Job *job)
{
    if (atomic_fetch_sub(&job->refs, 1) == 1) {
        free(job->rows);
        free(job);
    }
}

static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* memcpy that bypasses the CPU caches where the CPU allows (x86-64: streaming stores,
 * source lines prefetched as non-temporal). A block copy is large and read later by
 * someone else (the engine's attention), not by this thread: normal stores first read
 * every destination line (write-allocate) and evict the engine's code and data from
 * the shared cache, as a DMA copy to a GPU never does. Measured here (EPYC, 32 MiB
 * cold): 13.2 GB/s vs memcpy's 7-7.9, and Python code run right after it 1.5x less
 * slowed. A job whose bytes are read again at once (a chunk value, sent to its tier
 * next) takes plain memcpy instead (``cached``): streamed out, they would be read back
 * from memory. */
static void
copy_streaming(char *dst, const char *src, size_t len)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (len < 4096) { /* short rows: memcpy; a longer one always outlasts head (< 16) */
        memcpy(dst, src, len);
        return;
    }
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= len; i += 64) {
        _mm_prefetch(src + i + 512, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the job is done */
    memcpy(dst + i, src + i, len - i);
#else
    memcpy(dst, src, len);
#endif
}

/* Start a queued job; true while it has rows left to claim (it is running). */
static int
job_claim(Copier *c, Job *job)
{
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&job->state) == JOB_QUEUED) {
        job->start = now();
        atomic_store(&job->state, JOB_RUNNING);
    }
    int running = atomic_load(&job->state) == JOB_RUNNING;
    pthread_mutex_unlock(&c->mu);
    return running;
}

/* Copy pieces of a running job until none is left; whoever copies the last marks it
 * done. Rows are split into pieces of at most PIECE_NBYTES so that two threads share
 * even a one-block copy. */
static void
job_copy_rows(Copier *c, Job *job)
{
    const long pieces = (long)((job->row + PIECE_NBYTES - 1) / PIECE_NBYTES);
    const long total = job->n * pieces;
    long mine = 0, u;
    while ((u = atomic_fetch_add(&job->claimed, 1)) < total) {
        long i = u / pieces;
        size_t offset = (size_t)(u % pieces) * PIECE_NBYTES;
        size_t len = job->row - offset < PIECE_NBYTES ? job->row - offset : PIECE_NBYTES;
        char *dst = job->dst + job->rows[job->n + i] * job->row + offset;
        const char *src = job->src + job->rows[i] * job->row + offset;
        if (job->cached)
            memcpy(dst, src, len);
        else
            copy_streaming(dst, src, len);
        mine++;
    }
    if (mine && atomic_fetch_add(&job->copied, mine) + mine == total) {
        pthread_mutex_lock(&c->mu);
        job->seconds = now() - job->start;
        atomic_store(&job->state, JOB_DONE);
        pthread_cond_broadcast(&c->done);
        pthread_mutex_unlock(&c->mu);
    }
}

static void *
worker_main(void *arg)
{
    Copier *c = arg;
#ifdef __linux__
    /* Its OS name, and any CPU the process's cpuset allows, not only the creating
     * thread's (threads.py). */
    pthread_setname_np(pthread_self(), c->name);
    cpu_set_t any;
    CPU_ZERO(&any);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        CPU_SET(cpu, &any);
    sched_setaffinity(0, sizeof any, &any);
#endif
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->head == NULL && !c->stop) {
            /* Poll a while before sleeping: a caller often submits the next job right
             * after the last (a batch of values), and a wake-up costs tens of us. */
            pthread_mutex_unlock(&c->mu);
            const double until = now() + SPIN_SECONDS;
            while (atomic_load(&c->queued) == 0 && now() < until)
                sched_yield();
            pthread_mutex_lock(&c->mu);
        }
        while (c->head == NULL && !c->stop)
            pthread_cond_wait(&c->work, &c->mu);
        if (c->head == NULL)
            break; /* stopped and drained */
        Job *job = c->head;
        c->head = job->next;
        atomic_fetch_sub(&c->queued, 1);
        if (c->head == NULL)
            c->tail = NULL;
        pthread_mutex_unlock(&c->mu);
        if (job_claim(c, job))
            job_copy_rows(c, job);
        job_release(job);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static int
Copier_init(Copier *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", NULL};
    const char *name = "kvtier-copy";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$s:Copier", kwlist, &name))
        return -1;
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "Copier is already initialised");
        return -1;
    }
    if (strlen(name) >= sizeof self->name) {
        PyErr_Format(PyExc_ValueError, "name must be at most %d bytes, got '%s'",
                     (int)sizeof self->name - 1, name);
        return -1;
    }
    strcpy(self->name, name);
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->done, NULL);
    if (pthread_create(&self->thread, NULL, worker_main, self) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot start the copier thread");
        return -1;
    }
    self->started = 1;
    return 0;
}

/* Stop the worker once its queue is drained, and join it (GIL released). */
static void
copier_stop(Copier *self)
{
    if (!self->started || self->stop)
        return;
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
}

static void
Copier_dealloc(Copier *self)
{
    copier_stop(self); /* jobs hold a reference: none is left when this runs */
    if (self->started) {
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->work);
        pthread_cond_destroy(&self->done);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(close_doc, "close() -> None: run the queued jobs, then stop the thread.");

static PyObject *
Copier_close(Copier *self, PyObject *Py_UNUSED(ignored))
{
    copier_stop(self);
    Py_RETURN_NONE;
}

static PyTypeObject CopyJobType;

/* A C-contiguous buffer of whole rows; its row count in *rows. */
static int
get_rows(PyObject *obj, Py_buffer *view, int flags, size_t row, Py_ssize_t *rows, const char *what)
{
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % (Py_ssize_t)row != 0) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not whole rows of %zu", what,
                     view->len, row);
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->len / (Py_ssize_t)row;
    return 0;
}

/* Rows from a sequence of ints, each checked to be in [0, limit). */
static int
get_row_ids(PyObject *obj, int64_t *out, Py_ssize_t n, Py_ssize_t limit, const char *what)
{
    PyObject *seq = PySequence_Fast(obj, "rows must be a sequence of ints");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd source rows but %zd destination rows", n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return -1;
    }
    int rc = ids_in_range(PySequence_Fast_ITEMS(seq), n, limit, out, what);
    Py_DECREF(seq);
    return rc;
}

PyDoc_STRVAR(submit_doc,
"submit(src, src_rows, dst, dst_rows, row_nbytes, cached=False) -> CopyJob\n\n"
"Queue ``dst[dst_rows[i]] = src[src_rows[i]]`` for every i, rows of ``row_nbytes``\n"
"bytes, on the worker thread. ``src`` and ``dst`` are C-contiguous buffers (``dst``\n"
"writable) of whole rows, held by the job until it is over. Rows are checked here:\n"
"IndexError or ValueError, queueing nothing, for a bad one. The copy bypasses the\n"
"CPU caches unless ``cached`` is true: for bytes the caller reads again right away.");

static PyObject *
Copier_submit(Copier *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw != 5 && nargs + nkw != 6) {
        PyErr_Format(PyExc_TypeError, "submit takes 5 or 6 arguments, got %zd", nargs + nkw);
        return NULL;
    }
    /* Keyword names are always str; with 5 positional arguments there is at most one. */
    if (nargs < 5 ||
        (nkw && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "cached") != 0)) {
        PyErr_SetString(PyExc_TypeError, "submit takes 5 positional arguments and cached=");
        return NULL;
    }
    int cached = nargs + nkw == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (cached < 0)
        return NULL;
    if (!self->started || self->stop) {
        PyErr_SetString(PyExc_RuntimeError, "the copier is closed");
        return NULL;
    }
    Py_ssize_t row = PyLong_AsSsize_t(args[4]);
    if (row == -1 && PyErr_Occurred())
        return NULL;
    if (row <= 0) {
        PyErr_Format(PyExc_ValueError, "row_nbytes must be positive, got %zd", row);
        return NULL;
    }
    Py_ssize_t n = PyObject_Length(args[1]);
    if (n < 0)
        return NULL;
    CopyJob *cj = PyObject_New(CopyJob, &CopyJobType);
    if (cj == NULL)
        return NULL;
    cj->copier = (Copier *)Py_NewRef(self);
    cj->job = NULL;
    cj->src.obj = cj->dst.obj = NULL;
    Job *job = calloc(1, sizeof(Job));
    int64_t *rows = malloc(sizeof(int64_t) * (2 * n + 1));
    Py_ssize_t src_rows, dst_rows;
    if (job == NULL || rows == NULL) {
        free(job);
        free(rows);
        Py_DECREF(cj);
        return PyErr_NoMemory();
    }
    job->rows = rows;
    atomic_init(&job->refs, 1);
    atomic_init(&job->state, JOB_CANCELLED); /* until it is queued */
    cj->job = job;
    if (get_rows(args[0], &cj->src, PyBUF_SIMPLE, row, &src_rows, "src") < 0 ||
        get_rows(args[2], &cj->dst, PyBUF_WRITABLE, row, &dst_rows, "dst") < 0 ||
        get_row_ids(args[1], rows, n, src_rows, "source row") < 0 ||
        get_row_ids(args[3], rows + n, n, dst_rows, "destination row") < 0) {
        Py_DECREF(cj);
        return NULL;
    }
    job->src = cj->src.buf;
    job->dst = cj->dst.buf;
    job->row = row;
    job->cached = cached;
    job->n = n;
    atomic_init(&job->claimed, 0);
    atomic_init(&job->copied, 0);
    if (n == 0) { /* nothing to copy: done, never queued (no row would mark it done) */
        atomic_store(&job->state, JOB_DONE);
        return (PyObject *)cj;
    }
    atomic_store(&job->state, JOB_QUEUED);
    atomic_fetch_add(&job->refs, 1); /* the queue's */
    pthread_mutex_lock(&self->mu);
    if (self->tail)
        self->tail->next = job;
    else
        self->head = job;
    self->tail = job;
    atomic_fetch_add(&self->queued, 1);
    pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->mu);
    return (PyObject *)cj;
}

/* Block until the job is over (GIL released), copying its unclaimed rows here. */
static void
job_join(CopyJob *self)
{
    Job *job = self->job;
    Copier *c = self->copier;
    Py_BEGIN_ALLOW_THREADS
    if (job_claim(c, job))
        job_copy_rows(c, job);
    /* Nothing is left to claim: the worker holds at most one piece. Poll for it a
     * while before sleeping: a wake-up from the condition variable costs tens of us
     * on a VM, more than the copy of a piece. */
    const double until = now() + SPIN_SECONDS;
    while (atomic_load(&job->state) == JOB_RUNNING && now() < until)
        sched_yield();
    pthread_mutex_lock(&c->mu);
    while (atomic_load(&job->state) == JOB_RUNNING)
        pthread_cond_wait(&c->done, &c->mu);
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
}

/* QUEUED -> CANCELLED; true if the job can no longer run. */
static int
job_cancel(Copier *c, Job *job)
{
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&job->state) == JOB_QUEUED)
        atomic_store(&job->state, JOB_CANCELLED);
    int cancelled = atomic_load(&job->state) == JOB_CANCELLED;
    pthread_mutex_unlock(&c->mu);
    return cancelled;
}

static void
CopyJob_dealloc(CopyJob *self)
{
    if (self->job != NULL) {
        /* Cancel it if queued; finish it if running: the buffers must outlive the copy. */
        if (!job_cancel(self->copier, self->job))
            job_join(self);
        job_release(self->job);
    }
    if (self->src.obj)
        PyBuffer_Release(&self->src);
    if (self->dst.obj)
        PyBuffer_Release(&self->dst);
    Py_XDECREF(self->copier);
    PyObject_Free(self);
}

PyDoc_STRVAR(job_wait_doc,
"wait() -> None: block until the copy is over, copying the rows nobody has taken yet\n"
"on this thread (GIL released): all of them if the worker has not started.");

static PyObject *
CopyJob_wait(CopyJob *self, PyObject *Py_UNUSED(ignored))
{
    job_join(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(job_done_doc, "done() -> bool: whether the copy is over (or cancelled). Never blocks.");

static PyObject *
CopyJob_done(CopyJob *self, PyObject *Py_UNUSED(ignored))
{
    int s = atomic_load(&self->job->state);
    return PyBool_FromLong(s == JOB_DONE || s == JOB_CANCELLED);
}

PyDoc_STRVAR(job_cancel_doc,
"cancel() -> bool: make sure the copy never runs; False once it has started.");

static PyObject *
CopyJob_cancel(CopyJob *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(job_cancel(self->copier, self->job));
}

static PyObject *
CopyJob_get_seconds(CopyJob *self, void *Py_UNUSED(closure))
{
    int done = atomic_load(&self->job->state) == JOB_DONE;
    return PyFloat_FromDouble(done ? self->job->seconds : 0.0);
}

static PyMethodDef CopyJob_methods[] = {
    {"wait", (PyCFunction)CopyJob_wait, METH_NOARGS, job_wait_doc},
    {"done", (PyCFunction)CopyJob_done, METH_NOARGS, job_done_doc},
    {"cancel", (PyCFunction)CopyJob_cancel, METH_NOARGS, job_cancel_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CopyJob_getset[] = {
    {"seconds", (getter)CopyJob_get_seconds, NULL, "time the copy took (0.0 until done)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.CopyJob",
    .tp_basicsize = sizeof(CopyJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One queued copy of a Copier (made by Copier.submit).",
    .tp_dealloc = (destructor)CopyJob_dealloc,
    .tp_methods = CopyJob_methods,
    .tp_getset = CopyJob_getset,
};

static PyMethodDef Copier_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Copier_submit, METH_FASTCALL | METH_KEYWORDS,
     submit_doc},
    {"close", (PyCFunction)Copier_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Copier_doc,
"Copier(*, name='kvtier-copy')\n\n"
"One C worker thread, ``name`` at the OS level (at most 15 bytes), that copies rows\n"
"between host buffers without the GIL, in submission order. ``close`` (or garbage\n"
"collection) runs what is queued and stops it.");

static PyTypeObject CopierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.Copier",
    .tp_basicsize = sizeof(Copier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Copier_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Copier_init,
    .tp_dealloc = (destructor)Copier_dealloc,
    .tp_methods = Copier_methods,
};

/* ------------------------------------------------------------------ populate, Slab */

#include <errno.h>
#include <semaphore.h>
#include <sys/resource.h>

/* Fault in, for writing, every page holding a byte of [p, p + n), changing no byte:
 * one atomic compare-and-swap of 0 with 0 per page, on the range's first byte in its
 * first page and on the first byte of each page after. A write racing it lands before
 * or after it, never under it, and a byte that is not 0 fails the compare and stays.
 * Touches no byte outside the range. Stops early when *stop (if not NULL) becomes
 * non-zero; returns how many bytes from p it covered. */
static size_t
touch_pages(char *p, size_t n, atomic_int *stop)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t end = (uintptr_t)p + n;
    uintptr_t a = (uintptr_t)p;
    while (a < end) {
        if (stop != NULL && atomic_load_explicit(stop, memory_order_relaxed))
            return a - (uintptr_t)p;
        char zero = 0; /* compared with, and on a match stored: 0 stays 0 */
        __atomic_compare_exchange_n((char *)a, &zero, 0, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        a = (a & ~(page - 1)) + page;
    }
    return n;
}

PyDoc_STRVAR(populate_doc,
"populate(address, nbytes) -> None\n\n"
"Fault in, for writing, every page holding a byte of [address, address + nbytes),\n"
"leaving every byte as it is, even while other threads write into the range: one\n"
"atomic compare-and-swap of 0 with 0 on one byte of the range in each page. Touches\n"
"no byte outside the range. The range must stay mapped writable for the whole call\n"
"(the caller holds the memory). Runs without the GIL.");

static PyObject *
populate(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "populate takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    uintptr_t address = (uintptr_t)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (nbytes < 0 || (nbytes > 0 && address == 0) || address + (size_t)nbytes < address) {
        PyErr_Format(PyExc_ValueError, "populate: bad range of %zd bytes at %p", nbytes,
                     (void *)address);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    touch_pages((char *)address, (size_t)nbytes, NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A pageable host slab (host_pool.py): anonymous memory of its own, exported as a
 * writable buffer, and a C thread at idle priority that populates it a bounded
 * distance ahead of the bytes its owner has handed out (``follow``).
 *
 * The thread never takes the GIL: a Python thread at idle priority that wants the GIL
 * makes the thread holding it drop it and wait until it has taken it, so on busy CPUs
 * the engine's thread waits for an idle-priority thread to be scheduled (host_pool.py
 * has the measurement). Nor does it ever unmap: munmap holds the process's mmap lock,
 * and a thread at idle priority preempted holding it would stall the engine's own
 * mmap and munmap calls.
 *
 * Lifetimes, with the owner waiting for the thread at most SLAB_RELEASE_WAIT:
 * ``mem_users`` counts the owner (until its release) and the thread while it touches
 * pages; the thread takes a use only from a count above 0, so once the owner's release
 * brought it to 0 the memory is the owner's to unmap. When the thread's use is the
 * last (it was preempted in the middle of a piece), it leaves the memory on the
 * graveyard, which owners empty (slab creation and release). ``refs`` counts the owner
 * and the thread (or the graveyard) for the struct itself. */

typedef struct FillState {
    struct FillState *next_dead; /* the graveyard's link */
    char *base;
    size_t nbytes, mapped;       /* the buffer's bytes; the mapping's (whole pages) */
    size_t ahead, step, piece;
    atomic_size_t frontier;      /* bytes handed out so far (follow) */
    atomic_size_t target;        /* populate up to here */
    atomic_size_t reached;       /* populated, or handed out, up to here */
    atomic_int stop;
    atomic_int mem_users;
    atomic_int refs;
    sem_t wake;
    char name[16];
} FillState;

typedef struct {
    PyObject_HEAD
    FillState *st;
    int filling; /* a fill thread was started */
} Slab;

static _Atomic(FillState *) graveyard;
#define SLAB_RELEASE_WAIT 200e-6 /* seconds a release waits for the thread to leave */

static void
fill_state_release(FillState *st)
{
    if (atomic_fetch_sub(&st->refs, 1) == 1) {
        sem_destroy(&st->wake);
        free(st);
    }
}

/* Unmap the slabs whose fill thread let go of them last. */
static void
graveyard_drain(void)
{
    FillState *st = atomic_exchange(&graveyard, NULL);
    while (st != NULL) {
        FillState *next = st->next_dead;
        munmap(st->base, st->mapped);
        fill_state_release(st);
        st = next;
    }
}

static int
mem_acquire(FillState *st)
{
    int n = atomic_load(&st->mem_users);
    while (n > 0)
        if (atomic_compare_exchange_weak(&st->mem_users, &n, n + 1))
            return 1;
    return 0;
}

static void *
fill_main(void *arg)
{
    FillState *st = arg;
#ifdef __linux__
    /* Its OS name, any CPU the process's cpuset allows (threads.py), and idle priority:
     * SCHED_IDLE, or nice 19 where that is refused; both apply to this thread alone. */
    pthread_setname_np(pthread_self(), st->name);
    cpu_set_t any;
    CPU_ZERO(&any);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        CPU_SET(cpu, &any);
    sched_setaffinity(0, sizeof any, &any);
    struct sched_param none = {0};
    if (sched_setscheduler(0, SCHED_IDLE, &none) != 0)
        setpriority(PRIO_PROCESS, 0, 19);
#endif
    size_t reached = 0;
    while (!atomic_load(&st->stop)) {
        size_t target = atomic_load(&st->target), frontier = atomic_load(&st->frontier);
        size_t lo = reached > frontier ? reached : frontier; /* handed out: its users write it */
        if (lo >= target) {
            reached = lo;
            atomic_store(&st->reached, reached);
            while (sem_wait(&st->wake) != 0 && errno == EINTR)
                ;
            continue;
        }
        size_t hi = target - lo < st->piece ? target : lo + st->piece;
        if (!mem_acquire(st))
            break; /* released by its owner */
        size_t done = touch_pages(st->base + lo, hi - lo, &st->stop);
        if (atomic_fetch_sub(&st->mem_users, 1) == 1) { /* the owner let go meanwhile */
            FillState *head = atomic_load(&graveyard);
            do
                st->next_dead = head;
            while (!atomic_compare_exchange_weak(&graveyard, &head, st));
            return NULL; /* this thread's ref went to the graveyard with it */
        }
        reached = lo + done;
        atomic_store(&st->reached, reached);
    }
    fill_state_release(st);
    return NULL;
}

static int
Slab_init(Slab *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "ahead", "piece", "name", NULL};
    Py_ssize_t nbytes, ahead = 0, piece = (Py_ssize_t)8 << 20;
    const char *name = "kvtier-fill";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|nn$s:Slab", kwlist, &nbytes, &ahead, &piece,
                                     &name))
        return -1;
    if (self->st != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Slab is already initialised");
        return -1;
    }
    if (nbytes <= 0 || ahead < 0 || piece <= 0) {
        PyErr_Format(PyExc_ValueError, "need nbytes > 0, ahead >= 0, piece > 0; got %zd, %zd, %zd",
                     nbytes, ahead, piece);
        return -1;
    }
    if (strlen(name) >= sizeof self->st->name) {
        PyErr_Format(PyExc_ValueError, "name must be at most %d bytes, got '%s'",
                     (int)sizeof self->st->name - 1, name);
        return -1;
    }
    graveyard_drain();
    FillState *st = calloc(1, sizeof *st);
    if (st == NULL || sem_init(&st->wake, 0, 0) != 0) {
        free(st);
        PyErr_NoMemory();
        return -1;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    st->nbytes = (size_t)nbytes;
    st->mapped = (st->nbytes + page - 1) / page * page;
    st->base = mmap(NULL, st->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (st->base == MAP_FAILED) {
        sem_destroy(&st->wake);
        free(st);
        PyErr_SetFromErrno(PyExc_MemoryError);
        return -1;
    }
    st->ahead = (size_t)ahead < st->nbytes ? (size_t)ahead : st->nbytes;
    st->step = st->ahead / 2 ? st->ahead / 2 : 1;
    st->piece = (size_t)piece;
    strcpy(st->name, name);
    atomic_init(&st->target, st->ahead);
    atomic_init(&st->mem_users, 1);
    atomic_init(&st->refs, 1);
    self->st = st;
    if (st->ahead == 0)
        return 0;
    pthread_attr_t attr;
    pthread_t thread;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, (size_t)256 << 10);
    atomic_store(&st->refs, 2);
    int err = pthread_create(&thread, &attr, fill_main, st);
    pthread_attr_destroy(&attr);
    if (err != 0) {
        atomic_store(&st->refs, 1);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1; /* dealloc unmaps */
    }
    self->filling = 1;
    return 0;
}

static void
slab_stop(Slab *self)
{
    if (self->filling && !atomic_exchange(&self->st->stop, 1))
        sem_post(&self->st->wake);
}

static void
Slab_dealloc(Slab *self)
{
    FillState *st = self->st;
    if (st != NULL) {
        slab_stop(self);
        /* A thread in the middle of a piece stops within a page once it runs: wait that
         * long, so that the memory is unmapped here rather than left on the graveyard. */
        const double until = now() + SLAB_RELEASE_WAIT;
        while (atomic_load(&st->mem_users) > 1 && now() < until)
            sched_yield();
        if (atomic_fetch_sub(&st->mem_users, 1) == 1)
            munmap(st->base, st->mapped);
        fill_state_release(st);
        graveyard_drain();
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Slab_getbuffer(Slab *self, Py_buffer *view, int flags)
{
    if (self->st == NULL) {
        PyErr_SetString(PyExc_BufferError, "Slab was not initialised");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->st->base,
                             (Py_ssize_t)self->st->nbytes, 0, flags);
}

static PyBufferProcs Slab_as_buffer = {(getbufferproc)Slab_getbuffer, NULL};

PyDoc_STRVAR(follow_doc,
"follow(frontier) -> None: the owner has handed out the bytes up to ``frontier``; the\n"
"fill populates ``ahead`` bytes past it (it moves on once the frontier has moved half\n"
"of that, or reached the end). Called on the owner's thread; takes no lock.");

static PyObject *
Slab_follow(Slab *self, PyObject *arg)
{
    Py_ssize_t f = PyLong_AsSsize_t(arg);
    if (f == -1 && PyErr_Occurred())
        return NULL;
    FillState *st = self->st;
    if (f < 0) {
        PyErr_Format(PyExc_ValueError, "frontier must be >= 0, got %zd", f);
        return NULL;
    }
    if (st == NULL || !self->filling)
        Py_RETURN_NONE;
    size_t frontier = (size_t)f < st->nbytes ? (size_t)f : st->nbytes;
    atomic_store(&st->frontier, frontier);
    size_t want = st->nbytes - frontier > st->ahead ? frontier + st->ahead : st->nbytes;
    size_t target = atomic_load(&st->target);
    if (want > target && (want - target >= st->step || want == st->nbytes)) {
        atomic_store(&st->target, want);
        sem_post(&st->wake);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(wait_filled_doc,
"wait_filled(timeout=None) -> bool: wait until the fill has populated (or seen handed\n"
"out) every byte it was asked for; False on timeout (tests and benchmarks).");

static PyObject *
Slab_wait_filled(Slab *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:wait_filled", kwlist, &timeout))
        return NULL;
    double limit = -1;
    if (timeout != Py_None && (limit = PyFloat_AsDouble(timeout)) == -1 && PyErr_Occurred())
        return NULL;
    FillState *st = self->st;
    if (st == NULL || !self->filling)
        Py_RETURN_TRUE;
    int done;
    Py_BEGIN_ALLOW_THREADS
    const double until = now() + limit;
    while (!(done = atomic_load(&st->reached) >= atomic_load(&st->target)) &&
           !atomic_load(&st->stop) && (limit < 0 || now() < until)) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

PyDoc_STRVAR(slab_close_doc,
"close() -> None: stop the fill (without waiting for it); the memory stays until the\n"
"Slab is released.");

static PyObject *
Slab_close(Slab *self, PyObject *Py_UNUSED(ignored))
{
    if (self->st != NULL)
        slab_stop(self);
    Py_RETURN_NONE;
}

static PyMethodDef Slab_methods[] = {
    {"follow", (PyCFunction)Slab_follow, METH_O, follow_doc},
    {"wait_filled", (PyCFunction)(void (*)(void))Slab_wait_filled, METH_VARARGS | METH_KEYWORDS,
     wait_filled_doc},
    {"close", (PyCFunction)Slab_close, METH_NOARGS, slab_close_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Slab_doc,
"Slab(nbytes, ahead=0, piece=8 MiB, *, name='kvtier-fill')\n\n"
"``nbytes`` of zeroed anonymous memory, a writable buffer (``torch.frombuffer``), and,\n"
"when ``ahead`` > 0, a C thread ``name`` at idle priority that faults its pages in,\n"
"``piece`` bytes at a time, up to ``ahead`` bytes past the bytes handed out (``follow``;\n"
"at first the first ``ahead``), changing no byte (``populate``). The thread never takes\n"
"the GIL, and the memory is unmapped once neither the Slab nor the thread uses it.");

static PyTypeObject SlabType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.Slab",
    .tp_basicsize = sizeof(Slab),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Slab_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slab_init,
    .tp_dealloc = (destructor)Slab_dealloc,
    .tp_methods = Slab_methods,
    .tp_as_buffer = &Slab_as_buffer,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"pack_tokens", (PyCFunction)pack_tokens, METH_O, pack_tokens_doc},
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL, chain_hashes_doc},
    {"populate", (PyCFunction)(void (*)(void))populate, METH_FASTCALL, populate_doc},
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
    if (PyType_Ready(&HashIndexType) < 0 || PyType_Ready(&UseCountsType) < 0 ||
        PyType_Ready(&BlockTableType) < 0 ||
        PyType_Ready(&CopierType) < 0 || PyType_Ready(&CopyJobType) < 0 ||
        PyType_Ready(&SlabType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObject(m, "REUSE_DELTA0", PyFloat_FromDouble(REUSE_DELTA0)) < 0 ||
        PyModule_AddObject(m, "REUSE_DELTA_MAX", PyFloat_FromDouble(REUSE_DELTA_MAX)) < 0 ||
        PyModule_AddObject(m, "REUSE_STEP", PyFloat_FromDouble(REUSE_STEP)) < 0 ||
        PyModule_AddObjectRef(m, "HashIndex", (PyObject *)&HashIndexType) < 0 ||
        PyModule_AddObjectRef(m, "UseCounts", (PyObject *)&UseCountsType) < 0 ||
        PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&BlockTableType) < 0 ||
        PyModule_AddObjectRef(m, "Copier", (PyObject *)&CopierType) < 0 ||
        PyModule_AddObjectRef(m, "CopyJob", (PyObject *)&CopyJobType) < 0 ||
        PyModule_AddObjectRef(m, "Slab", (PyObject *)&SlabType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
