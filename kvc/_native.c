/*
 * kvc._native: loops of the request path, compiled. Each has a pure-Python twin that
 * is the specification, the fallback where this module was not built, and what the tests
 * hold this module to:
 *
 *   chain_keys     the chained block keys of kvc/block_keys.py;
 *   probe_set_ids  the key lookup of the shadow prefix index's open-addressing table
 *                  (conductor/core/prefix_index.py, _KeyTable._probe);
 *   probe_runs     the same lookup, answering only where the set id changes
 *                  (_KeyTable.run_changes);
 *   kaplan_meier   the output-length model's survival rebuild
 *                  (conductor/core/output_length.py, _kaplan_meier_numpy);
 *   survival_areas, survival_pmf
 *                  the rest of that rebuild: the areas and the tail's knot of a
 *                  snapshot, and its per-bin mass (_snapshot_numpy, _pmf_numpy).
 *
 * chain_keys: the same layouts, bit for bit (kvc/block_keys.py is the specification and the
 * fallback where this module was not built):
 *
 *   layout 2: key_i = BLAKE2b-64(salt = NS(tenant, model), person = "kvc-blockkey-v2",
 *                                node_offset = key_{i-1},
 *                                data = le_u32(tok) for tok in block i)
 *   layout 1: key_i = BLAKE2b-64(salt = NS(tenant, model), person = "kvc-blockkey-v1",
 *                                data = le_u64(key_{i-1}) || le_u32(tok) for tok in block i)
 *
 * BLAKE2b is written here from RFC 7693 (sections 2 and 3); nothing else is linked. What
 * the Python version spends per block (a hash object made or copied, updates, a digest and
 * an int built from bytes, ~0.4 us) becomes compressions on the token bytes: one per
 * 32-token block in layout 2 (the parent sits in the parameter block, XORed into the
 * starting state), two in layout 1 (8 bytes of parent + 128 of tokens). The token list is
 * read straight from its int objects instead of through array('I', ...).
 *
 * chain_keys(tokens, salt, person, block_size, parent, layout) -> list[int]
 *     tokens: a sequence of ints in [0, 2**32) (anything with __index__, as array('I')
 *             takes); every id is checked, the trailing partial block included.
 *     salt, person: the BLAKE2b parameter-block fields (at most 16 bytes each, zero padded
 *             as hashlib pads them).
 *     block_size: tokens per block, > 0; parent: the key before tokens[0], a uint64;
 *     layout: 1 or 2.
 * Raises ValueError for a bad token id, block size, salt, person, parent or layout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLAKE2B_BLOCK 128
#define PREFETCH 16 /* items or rows read ahead in the loops that chase pointers */
#define KEY_BYTES 8
#define TOKEN_BYTES 4

static const uint64_t blake2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
    0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
    0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

/* Explicit little-endian loads and stores: the keys are the same on any host. */
static inline uint64_t load64_le(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64_le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void store32_le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

/* RFC 7693 section 3.2, F: one 128-byte block; t = bytes so far (< 2**64 here). */
static void blake2b_compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    /* Rounds written out: with a constant round number every message index is a
     * constant, so the compiler keeps m and v in registers (a loop over r costs ~2x). */
#define ROUND(r)                                                        \
    do {                                                                \
        G(0, 4, 8, 12, m[blake2b_sigma[r][0]], m[blake2b_sigma[r][1]]);   \
        G(1, 5, 9, 13, m[blake2b_sigma[r][2]], m[blake2b_sigma[r][3]]);   \
        G(2, 6, 10, 14, m[blake2b_sigma[r][4]], m[blake2b_sigma[r][5]]);  \
        G(3, 7, 11, 15, m[blake2b_sigma[r][6]], m[blake2b_sigma[r][7]]);  \
        G(0, 5, 10, 15, m[blake2b_sigma[r][8]], m[blake2b_sigma[r][9]]);  \
        G(1, 6, 11, 12, m[blake2b_sigma[r][10]], m[blake2b_sigma[r][11]]); \
        G(2, 7, 8, 13, m[blake2b_sigma[r][12]], m[blake2b_sigma[r][13]]);  \
        G(3, 4, 9, 14, m[blake2b_sigma[r][14]], m[blake2b_sigma[r][15]]);  \
    } while (0)
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* A small exact int's value without a call: 1 and v set, or 0 (take the general path).
 * Python 3.12 gave compact ints a documented (unstable-tier) reader; 3.11 keeps one
 * 30-bit digit and the sign in ob_size. Reading the list costs ~1 ns a token this way
 * against ~3 ns through PyLong_AsUnsignedLongLong. */
static inline int small_int_value(PyObject *item, unsigned long long *v) {
    if (!PyLong_CheckExact(item)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) return 0;
    Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)item);
    if (c < 0) return 0;
    *v = (unsigned long long)c;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0) {
        *v = 0;
        return 1;
    }
    if (size != 1) return 0;
    *v = ((PyLongObject *)item)->ob_digit[0];
    return 1;
#endif
}

/* Token ids as little-endian uint32 bytes; 0 on success, -1 with ValueError set.
 * Runs of small exact ints are read from the item array without running Python code, so
 * without checking the size on every step. Anything else goes through __index__, which
 * may run Python code that changes a list under us: the item is held while it runs, and
 * the size and the items are read again after it. */
static int tokens_to_le_u32(PyObject *seq, uint8_t *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
        if (i >= size) {
            PyErr_SetString(PyExc_ValueError, "the token ids changed while being read");
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(seq);
        Py_ssize_t stop = n < size ? n : size;
        for (; i < stop; i++) {
#if defined(__GNUC__) || defined(__clang__)
            /* The int objects lie all over the heap: fetch ahead what the loop reads next. */
            if (i + PREFETCH < stop) __builtin_prefetch(items[i + PREFETCH]);
#endif
            unsigned long long v;
            if (!small_int_value(items[i], &v) || v > 0xFFFFFFFFULL) break;
            store32_le(out + (size_t)i * TOKEN_BYTES, (uint32_t)v);
        }
        if (i == stop) continue; /* the loop's head checks the size again */
        PyObject *item = items[i];
        unsigned long long v;
        Py_INCREF(item);
        if (PyLong_Check(item)) {
            v = PyLong_AsUnsignedLongLong(item);
        } else {
            PyObject *index = PyNumber_Index(item);
            if (index == NULL) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError,
                             "token ids must be integers: %.100s object at position %zd",
                             Py_TYPE(item)->tp_name, i);
                Py_DECREF(item);
                return -1;
            }
            v = PyLong_AsUnsignedLongLong(index);
            Py_DECREF(index);
        }
        if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "token ids must lie in [0, 2**32): %R at position %zd", item, i);
            Py_DECREF(item);
            return -1;
        }
        Py_DECREF(item);
        store32_le(out + (size_t)i * TOKEN_BYTES, (uint32_t)v);
        i++;
    }
    return 0;
}

/* Layout 2 over n_blocks blocks of `tokens` (little-endian uint32 bytes): the parent is
 * the parameter block's node offset (bytes 8..15, the starting state's word 1), the data
 * is the block's tokens alone. Whole 128-byte pieces are compressed where they lie; a
 * shorter last piece goes through `buf` (128 bytes, zero past the piece: the padding). */
static void chain_v2(const uint64_t h0[8], const uint8_t *tokens, Py_ssize_t n_blocks,
                     Py_ssize_t block_size, uint64_t parent, uint8_t *buf, uint64_t *keys) {
    const size_t msg_len = (size_t)block_size * TOKEN_BYTES;
    const size_t last_off = (msg_len - 1) / BLAKE2B_BLOCK * BLAKE2B_BLOCK;
    const size_t tail = msg_len - last_off; /* 1..128 */
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        const uint8_t *msg = tokens + (size_t)b * msg_len;
        uint64_t h[8];
        memcpy(h, h0, sizeof h);
        h[1] ^= parent;
        for (size_t off = 0; off < last_off; off += BLAKE2B_BLOCK)
            blake2b_compress(h, msg + off, (uint64_t)(off + BLAKE2B_BLOCK), 0);
        const uint8_t *last = msg + last_off;
        if (tail < BLAKE2B_BLOCK) {
            memcpy(buf, last, tail);
            last = buf;
        }
        blake2b_compress(h, last, (uint64_t)msg_len, 1);
        parent = h[0]; /* the 8-byte digest read little-endian */
        keys[b] = parent;
    }
}

/* Layout 1 over n_blocks blocks of `tokens` (little-endian uint32 bytes). */
static void chain(const uint64_t h0[8], const uint8_t *tokens, Py_ssize_t n_blocks,
                  Py_ssize_t block_size, uint64_t parent, uint8_t *buf, uint64_t *keys) {
    const size_t block_bytes = (size_t)block_size * TOKEN_BYTES;
    const size_t msg_len = KEY_BYTES + block_bytes;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint64_t h[8];
        memcpy(h, h0, sizeof h);
        store64_le(buf, parent);
        memcpy(buf + KEY_BYTES, tokens + (size_t)b * block_bytes, block_bytes);
        /* buf's tail past msg_len stays zero: the padding of the last block. */
        size_t off = 0;
        while (msg_len - off > BLAKE2B_BLOCK) {
            off += BLAKE2B_BLOCK;
            blake2b_compress(h, buf + off - BLAKE2B_BLOCK, (uint64_t)off, 0);
        }
        blake2b_compress(h, buf + off, (uint64_t)msg_len, 1);
        parent = h[0]; /* the 8-byte digest read little-endian */
        keys[b] = parent;
    }
}

static int param_field(PyObject *obj, const char *name, uint8_t out[16]) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return -1;
    if (view.len > 16) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%s must be at most 16 bytes", name);
        return -1;
    }
    memset(out, 0, 16);
    memcpy(out, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    PyObject *tokens_obj, *salt_obj, *person_obj, *parent_obj;
    Py_ssize_t block_size;
    int layout;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOnOi:chain_keys", &tokens_obj, &salt_obj, &person_obj,
                          &block_size, &parent_obj, &layout))
        return NULL;
    if (layout != 1 && layout != 2) {
        PyErr_Format(PyExc_ValueError, "unknown block-key layout %d (1 and 2 exist)", layout);
        return NULL;
    }
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be a positive int, got %zd", block_size);
        return NULL;
    }
    /* The size limit of one message's byte counter; far above any KV page. */
    if (block_size > (Py_ssize_t)(1 << 24)) {
        PyErr_Format(PyExc_ValueError, "block_size %zd is too large", block_size);
        return NULL;
    }
    unsigned long long parent = PyLong_AsUnsignedLongLong(parent_obj);
    if (parent == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "parent must be a uint64, got %R", parent_obj);
        return NULL;
    }
    uint8_t param[64];
    memset(param, 0, sizeof param);
    param[0] = KEY_BYTES; /* digest length */
    param[2] = 1;         /* fanout */
    param[3] = 1;         /* depth */
    if (param_field(salt_obj, "salt", param + 32) < 0) return NULL;
    if (param_field(person_obj, "person", param + 48) < 0) return NULL;
    uint64_t h0[8];
    for (int i = 0; i < 8; i++) h0[i] = blake2b_iv[i] ^ load64_le(param + 8 * i);

    PyObject *seq = PySequence_Fast(tokens_obj, "token ids must be a sequence of integers");
    if (seq == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t n_blocks = n / block_size;
    uint8_t *tokens = PyMem_Malloc(n > 0 ? (size_t)n * TOKEN_BYTES : 1);
    size_t msg_len = (layout == 1 ? KEY_BYTES : 0) + (size_t)block_size * TOKEN_BYTES;
    size_t buf_len = layout == 2 ? BLAKE2B_BLOCK  /* the last piece of a block */
                                 : (msg_len + BLAKE2B_BLOCK - 1) / BLAKE2B_BLOCK * BLAKE2B_BLOCK;
    uint8_t *buf = PyMem_Calloc(buf_len, 1);
    uint64_t *keys = PyMem_Malloc(n_blocks > 0 ? (size_t)n_blocks * sizeof(uint64_t) : 1);
    PyObject *result = NULL;
    if (tokens == NULL || buf == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (tokens_to_le_u32(seq, tokens, n) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    if (layout == 2)
        chain_v2(h0, tokens, n_blocks, block_size, (uint64_t)parent, buf, keys);
    else
        chain(h0, tokens, n_blocks, block_size, (uint64_t)parent, buf, keys);
    Py_END_ALLOW_THREADS
    result = PyList_New(n_blocks);
    if (result == NULL) goto done;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject *key = PyLong_FromUnsignedLongLong(keys[b]);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, key);
    }
done:
    PyMem_Free(tokens);
    PyMem_Free(buf);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return result;
}

/*
 * probe_set_ids(keys, start, end, table_keys, table_ids, overflowed, rows, mult, row, out)
 *
 * For keys[start:end] (a list or tuple of ints), the set id each has in the table (0 where
 * absent), written into out (a writable uint32 buffer of end - start items). The table is
 * `rows` rows of `row` slots: table_keys (uint64) and table_ids (uint32) of rows * row
 * items, overflowed (one byte per row). A key's home row is (key * mult mod 2**64) mod
 * rows; a slot matches when it holds the key with a set id above 1 (0: never used, 1: a
 * deleted slot); a miss goes on to the next row (wrapping) while the row is flagged
 * overflowed. Exactly _KeyTable._probe(positions=False).
 * Raises ValueError for a key that is not a uint64 or buffers of the wrong size.
 */
#define TOMB_ID 1u

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t items,
                      int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (view->len != itemsize * items) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, view->len,
                     itemsize * items);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The arguments both probes share, checked; the buffers held until probe_release. */
typedef struct {
    PyObject *keys_obj;
    Py_ssize_t start, end, rows, row_slots;
    unsigned long long mult;
    Py_buffer tkeys, tids, over;
} Probe;

/* The number of keys in keys_obj, or -1 with ValueError set when it is not a list or a
 * tuple. */
static Py_ssize_t keys_length(PyObject *keys_obj) {
    if (!PyList_Check(keys_obj) && !PyTuple_Check(keys_obj)) {
        PyErr_SetString(PyExc_ValueError, "keys must be a list or a tuple of ints");
        return -1;
    }
    return PySequence_Fast_GET_SIZE(keys_obj);
}

/* keys_obj[at] as a uint64 into *key; -1 with ValueError set when it is not one. */
static int read_key(PyObject *keys_obj, Py_ssize_t at, uint64_t *key) {
    /* Keys are ints: reading one runs no Python code, so the list cannot change. */
    PyObject *item = PySequence_Fast_GET_ITEM(keys_obj, at);
    int ok = PyLong_Check(item);
    if (ok) {
        *key = PyLong_AsUnsignedLongLong(item);
        ok = !(*key == (uint64_t)-1 && PyErr_Occurred());
    }
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "block keys must be unsigned 64-bit ints: %.100s at position %zd",
                     Py_TYPE(item)->tp_name, at);
        return -1;
    }
    return 0;
}

/* writable: the table's buffers are asked for writing (place_keys). */
static int probe_open(Probe *p, PyObject *keys_obj, Py_ssize_t start, Py_ssize_t end,
                      PyObject *tkeys_obj, PyObject *tids_obj, PyObject *over_obj,
                      Py_ssize_t rows, PyObject *mult_obj, Py_ssize_t row_slots, int writable) {
    Py_ssize_t n_keys = keys_length(keys_obj);
    if (n_keys < 0) return -1;
    if (start < 0 || end < start || end > n_keys) {
        PyErr_Format(PyExc_ValueError, "keys[%zd:%zd] is out of range for %zd keys", start, end,
                     n_keys);
        return -1;
    }
    if (rows <= 0 || row_slots <= 0) {
        PyErr_SetString(PyExc_ValueError, "rows and row must be positive");
        return -1;
    }
    p->mult = PyLong_AsUnsignedLongLong(mult_obj);
    if (p->mult == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (get_buffer(tkeys_obj, &p->tkeys, 8, rows * row_slots, writable, "table_keys") < 0)
        return -1;
    if (get_buffer(tids_obj, &p->tids, 4, rows * row_slots, writable, "table_ids") < 0) {
        PyBuffer_Release(&p->tkeys);
        return -1;
    }
    if (get_buffer(over_obj, &p->over, 1, rows, writable, "overflowed") < 0) {
        PyBuffer_Release(&p->tkeys);
        PyBuffer_Release(&p->tids);
        return -1;
    }
    p->keys_obj = keys_obj;
    p->start = start;
    p->end = end;
    p->rows = rows;
    p->row_slots = row_slots;
    return 0;
}

static void probe_release(Probe *p) {
    PyBuffer_Release(&p->tkeys);
    PyBuffer_Release(&p->tids);
    PyBuffer_Release(&p->over);
}

/* The set id of each of keys[start:end] into ids (and its slot into positions, -1 where
 * absent, unless positions is NULL); 0 on success, -1 with ValueError set (a key that is
 * not a uint64) or MemoryError. */
static int probe_run(const Probe *p, uint32_t *ids, int64_t *positions) {
    const uint64_t *table_keys = (const uint64_t *)p->tkeys.buf;
    const uint32_t *table_ids = (const uint32_t *)p->tids.buf;
    const uint8_t *overflowed = (const uint8_t *)p->over.buf;
    const Py_ssize_t rows = p->rows, row_slots = p->row_slots;
    const uint64_t mult = (uint64_t)p->mult;
    Py_ssize_t n = p->end - p->start;
    /* First every key and its home row; then the probes, each row prefetched PREFETCH
     * keys ahead: a shadow table outgrows the caches, and a lookup that waits for each
     * row in turn costs a memory latency per key (~4x more at 4,096 keys measured). */
    uint64_t *keys = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    uint64_t *homes = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (keys == NULL || homes == NULL) {
        PyMem_Free(keys);
        PyMem_Free(homes);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = 0;
        if (read_key(p->keys_obj, p->start + i, &key) < 0) {
            PyMem_Free(keys);
            PyMem_Free(homes);
            return -1;
        }
        keys[i] = key;
        homes[i] = (key * mult) % (uint64_t)rows;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
#if defined(__GNUC__) || defined(__clang__)
        if (i + PREFETCH < n) {
            uint64_t ahead = homes[i + PREFETCH] * (uint64_t)row_slots;
            __builtin_prefetch(table_keys + ahead);
            __builtin_prefetch(table_keys + ahead + 8);
            __builtin_prefetch(table_ids + ahead);
        }
#endif
        uint64_t key = keys[i];
        uint64_t r = homes[i];
        uint32_t found = 0;
        int64_t at = -1;
        for (Py_ssize_t hops = 0; hops < rows; hops++) {
            const uint64_t *rk = table_keys + r * (uint64_t)row_slots;
            const uint32_t *ri = table_ids + r * (uint64_t)row_slots;
            for (Py_ssize_t c = 0; c < row_slots; c++) {
                if (rk[c] == key && ri[c] > TOMB_ID) {
                    found = ri[c];
                    at = (int64_t)(r * (uint64_t)row_slots) + c;
                    break;
                }
            }
            if (found || !overflowed[r]) break;
            r = r + 1 == (uint64_t)rows ? 0 : r + 1;
        }
        ids[i] = found;
        if (positions != NULL) positions[i] = at;
    }
    PyMem_Free(keys);
    PyMem_Free(homes);
    return 0;
}

static PyObject *probe_set_ids(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *tkeys_obj, *tids_obj, *over_obj, *out_obj, *mult_obj;
    Py_ssize_t start, end, rows, row_slots;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnnOOOnOnO:probe_set_ids", &keys_obj, &start, &end, &tkeys_obj,
                          &tids_obj, &over_obj, &rows, &mult_obj, &row_slots, &out_obj))
        return NULL;
    Probe p;
    if (probe_open(&p, keys_obj, start, end, tkeys_obj, tids_obj, over_obj, rows, mult_obj,
                   row_slots, 0) < 0)
        return NULL;
    Py_buffer out;
    if (get_buffer(out_obj, &out, 4, end - start, 1, "out") < 0) {
        probe_release(&p);
        return NULL;
    }
    int rc = probe_run(&p, (uint32_t *)out.buf, NULL);
    PyBuffer_Release(&out);
    probe_release(&p);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/*
 * probe_runs(keys, start, end, table_keys, table_ids, overflowed, rows, mult, row, last)
 *     -> list[int]
 *
 * Where the set id changes along keys[start:end]: a flat list [i0, id0, i1, id1, ...] of
 * the absolute positions whose set id differs from the key's before (the first key is
 * compared with `last`, the id before keys[start]) and their ids. What
 * _KeyTable.run_changes computes from set_ids_of, without an array per chunk: a prompt
 * held by a few nodes changes set a few times over thousands of keys.
 */
static PyObject *probe_runs(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *tkeys_obj, *tids_obj, *over_obj, *mult_obj;
    Py_ssize_t start, end, rows, row_slots;
    long long last;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnnOOOnOnL:probe_runs", &keys_obj, &start, &end, &tkeys_obj,
                          &tids_obj, &over_obj, &rows, &mult_obj, &row_slots, &last))
        return NULL;
    Probe p;
    if (probe_open(&p, keys_obj, start, end, tkeys_obj, tids_obj, over_obj, rows, mult_obj,
                   row_slots, 0) < 0)
        return NULL;
    Py_ssize_t n = end - start;
    uint32_t *ids = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint32_t) : 1);
    if (ids == NULL) {
        probe_release(&p);
        return PyErr_NoMemory();
    }
    int rc = probe_run(&p, ids, NULL);
    probe_release(&p);
    PyObject *result = rc < 0 ? NULL : PyList_New(0);
    long long prev = last;
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        if ((long long)ids[i] == prev) continue;
        prev = ids[i];
        PyObject *at = PyLong_FromSsize_t(start + i);
        PyObject *id = PyLong_FromUnsignedLong(ids[i]);
        if (at == NULL || id == NULL || PyList_Append(result, at) < 0 ||
            PyList_Append(result, id) < 0)
            Py_CLEAR(result);
        Py_XDECREF(at);
        Py_XDECREF(id);
    }
    PyMem_Free(ids);
    return result;
}

/*
 * probe_slots(keys, table_keys, table_ids, overflowed, rows, mult, row) -> list[int]
 *
 * The slot and set id of each key: a flat list [slot0, id0, slot1, id1, ...], slot -1
 * and id 0 where the key is absent. _KeyTable.slots_of; the events that store or remove
 * a block or two (nearly all of them) take it instead of NumPy's small-array calls.
 */
static PyObject *probe_slots(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *tkeys_obj, *tids_obj, *over_obj, *mult_obj;
    Py_ssize_t rows, row_slots;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOnOn:probe_slots", &keys_obj, &tkeys_obj, &tids_obj,
                          &over_obj, &rows, &mult_obj, &row_slots))
        return NULL;
    Py_ssize_t n = keys_length(keys_obj);
    Probe p;
    if (n < 0 || probe_open(&p, keys_obj, 0, n, tkeys_obj, tids_obj, over_obj, rows, mult_obj,
                            row_slots, 0) < 0)
        return NULL;
    uint32_t *ids = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint32_t) : 1);
    int64_t *positions = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(int64_t) : 1);
    int rc = ids == NULL || positions == NULL ? (PyErr_NoMemory(), -1)
                                              : probe_run(&p, ids, positions);
    probe_release(&p);
    PyObject *result = rc < 0 ? NULL : PyList_New(2 * n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *at = PyLong_FromLongLong(positions[i]);
        PyObject *id = PyLong_FromUnsignedLong(ids[i]);
        if (at == NULL || id == NULL) {
            Py_XDECREF(at);
            Py_XDECREF(id);
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, 2 * i, at);
        PyList_SET_ITEM(result, 2 * i + 1, id);
    }
    PyMem_Free(ids);
    PyMem_Free(positions);
    return result;
}

/*
 * place_keys(keys, set_id, table_keys, table_ids, overflowed, rows, mult, row) -> int
 *
 * _KeyTable._place_one for each of keys (distinct, none in the table; the caller keeps
 * the fill under 3/4, so a free slot exists): the first slot whose id is EMPTY or TOMB
 * from the key's home row on gets the key and set_id, and every full row passed is
 * flagged overflowed. Returns how many deleted (TOMB) slots were reused.
 */
static PyObject *place_keys(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *tkeys_obj, *tids_obj, *over_obj, *mult_obj;
    Py_ssize_t rows, row_slots;
    unsigned long set_id;
    (void)self;
    if (!PyArg_ParseTuple(args, "OkOOOnOn:place_keys", &keys_obj, &set_id, &tkeys_obj,
                          &tids_obj, &over_obj, &rows, &mult_obj, &row_slots))
        return NULL;
    if (set_id <= TOMB_ID || set_id > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "set_id must be a live set id (2 to 2**32 - 1)");
        return NULL;
    }
    Py_ssize_t n = keys_length(keys_obj);
    Probe p;
    if (n < 0 || probe_open(&p, keys_obj, 0, n, tkeys_obj, tids_obj, over_obj, rows, mult_obj,
                            row_slots, 1) < 0)
        return NULL;
    uint64_t *table_keys = p.tkeys.buf;
    uint32_t *table_ids = p.tids.buf;
    uint8_t *overflowed = p.over.buf;
    Py_ssize_t reused = 0;
    int failed = 0;
    /* Every key is read before any is placed: a bad one leaves the table as it was. */
    uint64_t *keys = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (keys == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    for (Py_ssize_t i = 0; i < n && !failed; i++)
        failed = read_key(keys_obj, i, &keys[i]) < 0;
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        uint64_t key = keys[i];
        uint64_t r = (key * (uint64_t)p.mult) % (uint64_t)rows;
        Py_ssize_t hops = 0;
        for (; hops < rows; hops++) {
            uint64_t at = r * (uint64_t)row_slots;
            Py_ssize_t c = 0;
            while (c < row_slots && table_ids[at + c] > TOMB_ID) c++;
            if (c < row_slots) {
                if (table_ids[at + c] == TOMB_ID) reused++;
                table_keys[at + c] = key;
                table_ids[at + c] = (uint32_t)set_id;
                break;
            }
            overflowed[r] = 1;
            r = r + 1 == (uint64_t)rows ? 0 : r + 1;
        }
        if (hops == rows) {
            PyErr_SetString(PyExc_ValueError, "the table has no free slot");
            failed = 1;
        }
    }
    PyMem_Free(keys);
    probe_release(&p);
    if (failed) return NULL;
    return PyLong_FromSsize_t(reused);
}

/*
 * kaplan_meier(exact, censored, unwatched, scale, pseudo) -> list[float]
 *
 * conductor/core/output_length.py's _kaplan_meier (the specification and the fallback):
 * the binned actuarial Kaplan-Meier survival at the knots, from four float64 buffers of
 * the same length (stored counts and pseudo-counts per bin) and the counts' scale. The
 * same IEEE operations in the same order as the NumPy version: the at-risk counts summed
 * from the top bin down, one bin at a time, as np.add.accumulate does over the reversed
 * array; the factors multiplied up from the bottom, as np.multiply.accumulate does. NaN
 * propagates through min and max as np.minimum and np.maximum propagate it. Built with
 * -ffp-contract=off (setup.py), so no multiply and add is fused where NumPy rounds twice.
 */
static PyObject *kaplan_meier(PyObject *self, PyObject *args) {
    PyObject *exact_obj, *censored_obj, *unwatched_obj, *pseudo_obj;
    double scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOdO:kaplan_meier", &exact_obj, &censored_obj,
                          &unwatched_obj, &scale, &pseudo_obj))
        return NULL;
    Py_buffer d, c, u, p;
    if (PyObject_GetBuffer(exact_obj, &d, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = d.len / (Py_ssize_t)sizeof(double);
    if (d.len % (Py_ssize_t)sizeof(double) != 0 || n == 0) {
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "exact must hold one or more float64 values");
        return NULL;
    }
    if (get_buffer(censored_obj, &c, sizeof(double), n, 0, "censored") < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (get_buffer(unwatched_obj, &u, sizeof(double), n, 0, "unwatched") < 0) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&c);
        return NULL;
    }
    if (get_buffer(pseudo_obj, &p, sizeof(double), n, 0, "pseudo") < 0) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&c);
        PyBuffer_Release(&u);
        return NULL;
    }
    const double *dv = d.buf, *cv = c.buf, *uv = u.buf, *pv = p.buf;
    double *at_risk = PyMem_Malloc((size_t)n * sizeof(double));
    PyObject *result = at_risk == NULL ? PyErr_NoMemory() : PyList_New(n + 1);
    if (result != NULL) {
        double sum = 0.0;
        for (Py_ssize_t k = n - 1; k >= 0; k--) {
            double arrivals = (dv[k] + cv[k]) / scale + pv[k];
            sum = k == n - 1 ? arrivals : sum + arrivals;
            at_risk[k] = sum;
        }
        double survival = 1.0;
        for (Py_ssize_t k = 0; k <= n && result != NULL; k++) {
            if (k > 0) {
                Py_ssize_t b = k - 1;
                double deaths = dv[b] / scale + pv[b];
                double exposed = at_risk[b] - uv[b] / scale;
                double hazard = deaths > 0.0 && exposed > 0.0 ? deaths / exposed : 0.0;
                double capped = isnan(hazard) ? hazard : (hazard < 1.0 ? hazard : 1.0);
                double left = 1.0 - capped;
                double factor = isnan(left) ? left : (left > 0.0 ? left : 0.0);
                survival = k == 1 ? factor : survival * factor;
            }
            PyObject *value = PyFloat_FromDouble(survival);
            if (value == NULL)
                Py_CLEAR(result);
            else
                PyList_SET_ITEM(result, k, value);
        }
    }
    PyMem_Free(at_risk);
    PyBuffer_Release(&d);
    PyBuffer_Release(&c);
    PyBuffer_Release(&u);
    PyBuffer_Release(&p);
    return result;
}

/* Read a list of n + 1 floats (a knot survival curve) into out; -1 with an error set. */
static int read_survival(PyObject *obj, double *out, Py_ssize_t n_knots) {
    if ((!PyList_Check(obj) && !PyTuple_Check(obj)) || PySequence_Fast_GET_SIZE(obj) != n_knots) {
        PyErr_Format(PyExc_ValueError, "survival must be a list or tuple of %zd floats",
                     n_knots);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t k = 0; k < n_knots; k++) {
        PyObject *item = items[k];
        if (!PyFloat_CheckExact(item)) {
            PyErr_SetString(PyExc_ValueError, "survival must hold floats only");
            return -1;
        }
        out[k] = PyFloat_AS_DOUBLE(item);
    }
    return 0;
}

/*
 * survival_areas(survival, widths, tail) -> (list[float], int)
 *
 * conductor/core/output_length.py's _snapshot_numpy (the specification and the fallback):
 * area_0 = 0, area_{k+1} = area_k + (S_k + S_{k+1}) * w_k / 2 with the same operations in
 * the same order as NumPy's element-wise product and add.accumulate (n = len(widths)).
 * Returns the areas and the first knot k >= 1 with S_k <= tail (n + 1 when there is none).
 */
static PyObject *survival_areas(PyObject *self, PyObject *args) {
    PyObject *survival_obj, *widths_obj;
    double tail;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOd:survival_areas", &survival_obj, &widths_obj, &tail))
        return NULL;
    Py_buffer w;
    if (PyObject_GetBuffer(widths_obj, &w, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = w.len / (Py_ssize_t)sizeof(double);
    if (w.len % (Py_ssize_t)sizeof(double) != 0 || n == 0) {
        PyBuffer_Release(&w);
        PyErr_SetString(PyExc_ValueError, "widths must hold one or more float64 values");
        return NULL;
    }
    const double *wv = w.buf;
    double *s = PyMem_Malloc((size_t)(n + 1) * sizeof(double));
    PyObject *areas = NULL, *result = NULL;
    if (s == NULL) {
        PyErr_NoMemory();
    } else if (read_survival(survival_obj, s, n + 1) == 0 && (areas = PyList_New(n + 1))) {
        Py_ssize_t tail_index = n + 1;
        double area = 0.0;
        for (Py_ssize_t k = 0; k <= n; k++) {
            if (k > 0) {
                double piece = (s[k - 1] + s[k]) * wv[k - 1] / 2;
                area = k == 1 ? piece : area + piece;
                if (tail_index > n && s[k] <= tail) tail_index = k;
            }
            PyObject *value = PyFloat_FromDouble(area);
            if (value == NULL) {
                Py_CLEAR(areas);
                break;
            }
            PyList_SET_ITEM(areas, k, value);
        }
        if (areas != NULL) {
            result = Py_BuildValue("(Nn)", areas, tail_index);
            areas = NULL;
        }
    }
    Py_XDECREF(areas);
    PyMem_Free(s);
    PyBuffer_Release(&w);
    return result;
}

/*
 * survival_pmf(survival, scale, out) -> None
 *
 * conductor/core/output_length.py's _pmf_numpy times scale, into out (n float64):
 * scale * max(0, S_k - S_{k+1}) (NumPy's maximum: NaN stays NaN), the last bin
 * scale * (max(0, S_{n-1} - S_n) + max(0.0, S_n)) (Python's max: NaN gives 0).
 */
static PyObject *survival_pmf(PyObject *self, PyObject *args) {
    PyObject *survival_obj, *out_obj;
    double scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "OdO:survival_pmf", &survival_obj, &scale, &out_obj))
        return NULL;
    Py_buffer o;
    if (PyObject_GetBuffer(out_obj, &o, PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t n = o.len / (Py_ssize_t)sizeof(double);
    if (o.len % (Py_ssize_t)sizeof(double) != 0 || n == 0) {
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "out must hold one or more float64 values");
        return NULL;
    }
    double *s = PyMem_Malloc((size_t)(n + 1) * sizeof(double));
    int ok = 0;
    if (s == NULL) {
        PyErr_NoMemory();
    } else if (read_survival(survival_obj, s, n + 1) == 0) {
        double *ov = o.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            double drop = s[k] - s[k + 1];
            double mass = isnan(drop) ? drop : (drop > 0.0 ? drop : 0.0);
            if (k == n - 1) mass += s[n] > 0.0 ? s[n] : 0.0;
            ov[k] = scale * mass;
        }
        ok = 1;
    }
    PyMem_Free(s);
    PyBuffer_Release(&o);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(tokens, salt, person, block_size, parent, layout) -> list[int]\n\n"
     "Chained BLAKE2b-64 keys of the full blocks of tokens (see kvc/block_keys.py)."},
    {"probe_set_ids", probe_set_ids, METH_VARARGS,
     "probe_set_ids(keys, start, end, table_keys, table_ids, overflowed, rows, mult, row, "
     "out) -> None\n\n"
     "The set id of each of keys[start:end] in the prefix index's key table, into out."},
    {"probe_runs", probe_runs, METH_VARARGS,
     "probe_runs(keys, start, end, table_keys, table_ids, overflowed, rows, mult, row, "
     "last) -> list[int]\n\n"
     "Where the set id changes along keys[start:end]: [i0, id0, i1, id1, ...]."},
    {"probe_slots", probe_slots, METH_VARARGS,
     "probe_slots(keys, table_keys, table_ids, overflowed, rows, mult, row) -> list[int]\n\n"
     "The slot and set id of each key in the prefix index's key table (-1 and 0: absent)."},
    {"place_keys", place_keys, METH_VARARGS,
     "place_keys(keys, set_id, table_keys, table_ids, overflowed, rows, mult, row) -> int\n\n"
     "Insert absent keys with set_id into the prefix index's key table; the reused "
     "deleted slots."},
    {"survival_areas", survival_areas, METH_VARARGS,
     "survival_areas(survival, widths, tail) -> tuple[list[float], int]\n\n"
     "The areas under a knot survival curve and its first knot at or below tail."},
    {"survival_pmf", survival_pmf, METH_VARARGS,
     "survival_pmf(survival, scale, out) -> None\n\n"
     "scale times the per-bin mass of a knot survival curve, into out."},
    {"kaplan_meier", kaplan_meier, METH_VARARGS,
     "kaplan_meier(exact, censored, unwatched, scale, pseudo) -> list[float]\n\n"
     "Binned actuarial Kaplan-Meier survival at the knots (conductor/core/output_length.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvc._native",
    "Block keys and the prefix index's key lookup, compiled (see kvc/_native.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
