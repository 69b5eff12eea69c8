/*
 * megatrace.analyze._kernels: C passes over every record that numpy would make in many (analyze/index.py,
 * analyze/iterations.py, analyze/match.py, analyze/jobconfig/build.py).
 *
 * Each function has a numpy twin in the module that calls it, used when this extension is not built; both give
 * the same arrays (tests/test_analyze_kernels.py). Arrays come in as buffers the caller allocated; a function
 * answers -1 (or raises) for an input it does not handle, and the caller then takes the numpy path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int width; /* bytes per item: 1, 2, 4 or 8 */
    int is_signed;
    Py_ssize_t n;
} Column;

static int get_column(PyObject *obj, Column *col, int writable, const char *name)
{
    const char *fmt;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &col->view, flags) < 0)
        return -1;
    col->width = (int)col->view.itemsize;
    fmt = col->view.format ? col->view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    col->is_signed = *fmt == 'b' || *fmt == 'h' || *fmt == 'i' || *fmt == 'l' || *fmt == 'q';
    if (col->view.ndim > 1 || !(col->width == 1 || col->width == 2 || col->width == 4 || col->width == 8)
        || strchr("bBhHiIlLqQ", *fmt) == NULL || fmt[1] != '\0') {
        PyErr_Format(PyExc_ValueError, "%s: a 1-D array of integers is needed", name);
        PyBuffer_Release(&col->view);
        return -1;
    }
    col->n = col->view.len / col->width;
    return 0;
}

static inline int64_t load_int(const Column *c, Py_ssize_t i)
{
    const unsigned char *p = (const unsigned char *)c->view.buf + (size_t)i * (size_t)c->width;
    switch (c->width) {
    case 8: { int64_t v; memcpy(&v, p, 8); return v; }
    case 4:
        if (c->is_signed) { int32_t v; memcpy(&v, p, 4); return v; }
        else { uint32_t v; memcpy(&v, p, 4); return v; }
    case 2:
        if (c->is_signed) { int16_t v; memcpy(&v, p, 2); return v; }
        else { uint16_t v; memcpy(&v, p, 2); return v; }
    default: return c->is_signed ? (int64_t)(int8_t)*p : (int64_t)*p;
    }
}

static inline void store_int(Column *c, Py_ssize_t i, int64_t v)
{
    unsigned char *p = (unsigned char *)c->view.buf + (size_t)i * (size_t)c->width;
    if (c->width == 8) {
        memcpy(p, &v, 8);
    } else {
        int32_t w = (int32_t)v;
        memcpy(p, &w, 4);
    }
}

/* (a view never taken, or already released, has no obj: releasing it does nothing) */
static void release(Column *cols, int k)
{
    while (k-- > 0)
        PyBuffer_Release(&cols[k].view);
}

/*
 * The arguments key_ranges and place share: keys, seqs, op (or None: every row keyed), send, recv, then `n_tables`
 * more columns (args[5..]) into c[3..], writable from c[writable_from] on. 0, or -1 with an exception set (the
 * caller releases what was taken: c zeroed first).
 */
typedef struct {
    int with_op;
    long send, recv;
} KeyedRows;

static int keyed_columns(const char *fname, PyObject *const *args, Column *c, int n_tables, int writable_from,
                         const char *const *names, KeyedRows *kr)
{
    kr->with_op = args[2] != Py_None;
    kr->send = PyLong_AsLong(args[3]);
    kr->recv = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return -1;
    for (int k = 0; k < 3 + n_tables; k++) {
        if (k == 2 && !kr->with_op)
            continue;
        if (get_column(args[k < 3 ? k : k + 2], &c[k], k >= writable_from, names[k]) < 0)
            return -1;
    }
    if (c[1].n != c[0].n || (kr->with_op && c[2].n != c[0].n)) {
        PyErr_Format(PyExc_ValueError, "%s: keys, seqs (and op) of one length", fname);
        return -1;
    }
    return 0;
}

/*
 * key_ranges(keys, seqs, op, send, recv, smin, smax) -> rows: for each row with keys[i] >= 0 (and, when op is not
 * None, an op other than the codes send and recv), smin[key] = min(smin[key], seqs[i]) and smax[key] likewise
 * (int64 tables of the keys). Returns how many rows were counted, or -1 (tables partly updated) when a sequence
 * number is negative or a key is not below the tables' length.
 */
static PyObject *key_ranges(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[5];
    memset(c, 0, sizeof c);
    KeyedRows kr;
    Py_ssize_t rows = 0;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "key_ranges(keys, seqs, op, send, recv, smin, smax)");
        return NULL;
    }
    static const char *const names[5] = {"keys", "seqs", "op", "smin", "smax"};
    if (keyed_columns("key_ranges", args, c, 2, 3, names, &kr) < 0)
        goto fail;
    if (c[3].width != 8 || c[4].width != 8 || c[4].n != c[3].n) {
        PyErr_SetString(PyExc_ValueError, "key_ranges: int64 tables of one length");
        goto fail;
    }
    {
        int64_t *smin = c[3].view.buf, *smax = c[4].view.buf;
        Py_ssize_t n = c[0].n, n_keys = c[3].n;
        const int with_op = kr.with_op;
        const long send = kr.send, recv = kr.recv;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t key = load_int(&c[0], i), v;
            if (key < 0)
                continue;
            if (with_op) {
                int64_t op = load_int(&c[2], i);
                if (op == send || op == recv)
                    continue;
            }
            v = load_int(&c[1], i);
            if (v < 0 || key >= n_keys) {
                rows = -1;
                break;
            }
            smin[key] = v < smin[key] ? v : smin[key];
            smax[key] = v > smax[key] ? v : smax[key];
            rows++;
        }
        Py_END_ALLOW_THREADS
    }
    release(c, 5);
    return PyLong_FromSsize_t(rows);
fail:
    release(c, 5);
    return NULL;
}

/*
 * place(keys, seqs, op, send, recv, offset, ids, used) -> all used: ids[i] = offset[key] + seqs[i] for the rows
 * key_ranges counts (-1 for the others), used[slot] = 1; whether every slot was used. The slots must lie below
 * len(used): key_ranges' tables make them so (a slot outside is refused: -1, ids partly written).
 */
static PyObject *place(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[6];
    memset(c, 0, sizeof c);
    KeyedRows kr;
    long result = 1;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "place(keys, seqs, op, send, recv, offset, ids, used)");
        return NULL;
    }
    static const char *const names[6] = {"keys", "seqs", "op", "offset", "ids", "used"};
    if (keyed_columns("place", args, c, 3, 4, names, &kr) < 0)
        goto fail;
    if (c[4].n != c[0].n || c[3].width != 8 || !(c[4].width == 4 || c[4].width == 8) || !c[4].is_signed
        || c[5].width != 1) {
        PyErr_SetString(PyExc_ValueError, "place: ids as long as keys; offset int64, ids int32/int64, used one byte "
                                          "a slot");
        goto fail;
    }
    {
        const int64_t *offset = c[3].view.buf;
        unsigned char *used = c[5].view.buf;
        const int with_op = kr.with_op;
        const long send = kr.send, recv = kr.recv;
        Py_ssize_t n = c[0].n, n_keys = c[3].n, n_slots = c[5].n, placed = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t key = load_int(&c[0], i), slot;
            int64_t op = with_op ? load_int(&c[2], i) : -1;
            if (key < 0 || (with_op && (op == send || op == recv))) {
                store_int(&c[4], i, -1);
                continue;
            }
            if (key >= n_keys) {
                result = -1;
                break;
            }
            slot = offset[key] + load_int(&c[1], i);
            if (slot < 0 || slot >= n_slots) {
                result = -1;
                break;
            }
            store_int(&c[4], i, slot);
            placed += !used[slot];
            used[slot] = 1;
        }
        if (result == 1)
            result = placed == n_slots;
        Py_END_ALLOW_THREADS
    }
    release(c, 6);
    return PyLong_FromLong(result);
fail:
    release(c, 6);
    return NULL;
}

/* Group id -> its position in the sorted gids: an open-addressing table twice as large as the gids (a binary search
 * per record mispredicts its branches: 10 ns a record at 4,600 groups). */
typedef struct {
    uint32_t *keys;
    int32_t *pos;
    size_t mask;
} GroupTable;

static int group_table(GroupTable *t, const uint32_t *gids, Py_ssize_t m)
{
    size_t size = 16;
    while (size < 2 * (size_t)m)
        size *= 2;
    t->keys = malloc(size * sizeof *t->keys);
    t->pos = malloc(size * sizeof *t->pos);
    if (t->keys == NULL || t->pos == NULL || m > INT32_MAX) {
        free(t->keys);
        free(t->pos);
        return -1;
    }
    t->mask = size - 1;
    for (size_t j = 0; j < size; j++)
        t->pos[j] = -1;
    for (Py_ssize_t k = 0; k < m; k++) { /* (gids are distinct: a dict's keys) */
        size_t h = (size_t)((gids[k] * 0x9E3779B1u) >> 7) & t->mask;
        while (t->pos[h] >= 0 && t->keys[h] != gids[k])
            h = (h + 1) & t->mask;
        t->keys[h] = gids[k];
        t->pos[h] = (int32_t)k;
    }
    return 0;
}

static inline int32_t group_of(const GroupTable *t, uint32_t g)
{
    size_t h = (size_t)((g * 0x9E3779B1u) >> 7) & t->mask;
    while (t->pos[h] >= 0) {
        if (t->keys[h] == g)
            return t->pos[h];
        h = (h + 1) & t->mask;
    }
    return -1;
}

static void group_table_free(GroupTable *t)
{
    free(t->keys);
    free(t->pos);
}

/*
 * group_index(group_id, op, gids, marker, out): out[i] = the position of group_id[i] in gids (sorted, uint32) for
 * rows whose op is below marker and whose group is in gids; out[i] left as it is for the others (the caller fills
 * out with -1). out int32.
 */
static PyObject *group_index(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[4];
    memset(c, 0, sizeof c);
    static const char *names[4] = {"group_id", "op", "gids", "out"};
    long marker;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "group_index(group_id, op, gids, marker, out)");
        return NULL;
    }
    marker = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    for (int k = 0; k < 4; k++)
        if (get_column(args[k < 3 ? k : 4], &c[k], k == 3, names[k]) < 0)
            goto fail;
    if (c[1].n != c[0].n || c[3].n != c[0].n || c[0].width != 4 || c[2].width != 4 || c[3].width != 4
        || c[0].is_signed || c[2].is_signed || !c[3].is_signed) {
        PyErr_SetString(PyExc_ValueError, "group_index: uint32 group ids and gids, int32 out, one length a row");
        goto fail;
    }
    {
        const uint32_t *gid = c[0].view.buf, *gids = c[2].view.buf;
        int32_t *out = c[3].view.buf;
        Py_ssize_t n = c[0].n;
        GroupTable table;
        if (group_table(&table, gids, c[2].n) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            if (load_int(&c[1], i) >= marker)
                continue;
            int32_t pos = group_of(&table, gid[i]);
            if (pos >= 0)
                out[i] = pos;
        }
        Py_END_ALLOW_THREADS
        group_table_free(&table);
    }
    release(c, 4);
    Py_RETURN_NONE;
fail:
    release(c, 4);
    return NULL;
}

/*
 * group_counts(group_id, op, gids, marker, send, recv, collectives, p2p): per group of the sorted gids (uint32), how
 * many records below marker it carried, collectives and point-to-point (send, recv) apart (int64 counts, added to).
 */
static PyObject *group_counts(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[5];
    memset(c, 0, sizeof c);
    static const char *names[5] = {"group_id", "op", "gids", "collectives", "p2p"};
    static const int arg_of[5] = {0, 1, 2, 6, 7};
    long long marker, send, recv;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "group_counts(group_id, op, gids, marker, send, recv, collectives, p2p)");
        return NULL;
    }
    marker = PyLong_AsLongLong(args[3]);
    send = PyLong_AsLongLong(args[4]);
    recv = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    for (int k = 0; k < 5; k++)
        if (get_column(args[arg_of[k]], &c[k], k >= 3, names[k]) < 0)
            goto fail;
    if (c[1].n != c[0].n || c[0].width != 4 || c[0].is_signed || c[2].width != 4 || c[2].is_signed
        || c[3].width != 8 || c[4].width != 8 || c[3].n != c[2].n || c[4].n != c[2].n) {
        PyErr_SetString(PyExc_ValueError, "group_counts: uint32 group ids and gids, int64 counts a group");
        goto fail;
    }
    {
        const uint32_t *gid = c[0].view.buf, *gids = c[2].view.buf;
        int64_t *coll = c[3].view.buf, *p2p = c[4].view.buf;
        Py_ssize_t n = c[0].n;
        GroupTable table;
        if (group_table(&table, gids, c[2].n) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t op = load_int(&c[1], i);
            if (op >= marker)
                continue;
            int32_t pos = group_of(&table, gid[i]);
            if (pos >= 0)
                (op == send || op == recv ? p2p : coll)[pos] += 1;
        }
        Py_END_ALLOW_THREADS
        group_table_free(&table);
    }
    release(c, 5);
    Py_RETURN_NONE;
fail:
    release(c, 5);
    return NULL;
}

/*
 * p2p_channels(op, gidx, rank, peer, world, send, recv, rows, chans) -> (count, keys): the point-to-point rows
 * (op send or recv, gidx >= 0, 0 <= peer < world) in order into rows[:count], and for each its channel: the key
 * (gidx * world + src) * world + dst (for a send src is the rank and dst its peer, for a recv the other way round)
 * numbered by first appearance into chans[:count]; keys holds the distinct keys in that order (int64 bytes).
 * rows and chans: int32 or int64, as long as the records.
 */
typedef struct {
    int64_t *keys;
    int32_t *ids;
    size_t mask, used;
} KeyTable;

static int table_grow(KeyTable *t)
{
    size_t size = t->mask ? 2 * (t->mask + 1) : 1024;
    int64_t *keys = malloc(size * sizeof *keys);
    int32_t *ids = malloc(size * sizeof *ids);
    if (keys == NULL || ids == NULL) {
        free(keys);
        free(ids);
        return -1;
    }
    for (size_t j = 0; j < size; j++)
        ids[j] = -1;
    for (size_t j = 0; t->mask && j <= t->mask; j++) {
        if (t->ids[j] < 0)
            continue;
        size_t h = ((uint64_t)t->keys[j] * 0x9E3779B97F4A7C15ull) >> 17 & (size - 1);
        while (ids[h] >= 0)
            h = (h + 1) & (size - 1);
        keys[h] = t->keys[j];
        ids[h] = t->ids[j];
    }
    free(t->keys);
    free(t->ids);
    t->keys = keys;
    t->ids = ids;
    t->mask = size - 1;
    return 0;
}

static PyObject *p2p_channels(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[6];
    memset(c, 0, sizeof c);
    static const char *names[6] = {"op", "gidx", "rank", "peer", "rows", "chans"};
    static const int arg_of[6] = {0, 1, 2, 3, 7, 8};
    long long world;
    long send, recv;
    KeyTable table = {NULL, NULL, 0, 0};
    int64_t *order = NULL;
    size_t order_cap = 0;
    Py_ssize_t count = 0;
    int failed = 0;
    PyObject *result = NULL;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "p2p_channels(op, gidx, rank, peer, world, send, recv, rows, chans)");
        return NULL;
    }
    world = PyLong_AsLongLong(args[4]);
    send = PyLong_AsLong(args[5]);
    recv = PyLong_AsLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (world < 1 || world > (1ll << 21)) {
        PyErr_SetString(PyExc_ValueError, "p2p_channels: world between 1 and 2**21");
        return NULL;
    }
    for (int k = 0; k < 6; k++)
        if (get_column(args[arg_of[k]], &c[k], k >= 4, names[k]) < 0)
            goto done;
    for (int k = 1; k < 6; k++)
        if (c[k].n != c[0].n || (k >= 4 && (c[k].width < 4 || !c[k].is_signed))) {
            PyErr_SetString(PyExc_ValueError, "p2p_channels: one length a row; rows and chans int32 or int64");
            goto done;
        }
    if (table_grow(&table) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0, n = c[0].n; i < n; i++) {
        int64_t op = load_int(&c[0], i), g, me, peer, key;
        if (op != send && op != recv)
            continue;
        g = load_int(&c[1], i);
        peer = load_int(&c[3], i);
        if (g < 0 || peer < 0 || peer >= world)
            continue;
        me = load_int(&c[2], i);
        /* (in uint64: wraps as numpy's int64 arithmetic does, where C's signed overflow would be undefined) */
        key = (int64_t)(((uint64_t)g * (uint64_t)world + (uint64_t)(op == send ? me : peer)) * (uint64_t)world
                        + (uint64_t)(op == send ? peer : me));
        size_t h = ((uint64_t)key * 0x9E3779B97F4A7C15ull) >> 17 & table.mask;
        while (table.ids[h] >= 0 && table.keys[h] != key)
            h = (h + 1) & table.mask;
        if (table.ids[h] < 0) {
            if (table.used >= order_cap) {
                size_t cap = order_cap ? 2 * order_cap : 1024;
                int64_t *grown = realloc(order, cap * sizeof *order);
                if (grown == NULL || table.used >= (size_t)INT32_MAX) {
                    failed = 1;
                    break;
                }
                order = grown;
                order_cap = cap;
            }
            order[table.used] = key;
            table.keys[h] = key;
            table.ids[h] = (int32_t)table.used++;
            if (2 * table.used > table.mask && table_grow(&table) < 0) {
                failed = 1;
                break;
            }
            h = ((uint64_t)key * 0x9E3779B97F4A7C15ull) >> 17 & table.mask;
            while (table.keys[h] != key || table.ids[h] < 0)
                h = (h + 1) & table.mask;
        }
        store_int(&c[4], count, i);
        store_int(&c[5], count, table.ids[h]);
        count++;
    }
    Py_END_ALLOW_THREADS
    if (failed)
        PyErr_NoMemory();
    else
        result = Py_BuildValue("(ny#)", count, order ? (const char *)order : "",
                               (Py_ssize_t)(table.used * sizeof *order));
done:
    free(table.keys);
    free(table.ids);
    free(order);
    release(c, 6);
    return result;
}

/*
 * step_cells(starts, role, te, tc, record_step, gseq, k0, n, dp_per_step, marker, dp,
 *            gap, count, end, first, compute, arrival, dp_end) -> 0, or -1 (outputs partly written)
 *
 * iterations.compute_gaps and the per-rank, per-step sums of iterations._per_step in two passes a rank:
 * gap[row] = the row's enqueue minus the latest end (completion, or enqueue when later) of its rank's earlier rows,
 * at least 0, float32 (markers and a rank's first row 0); then for each row with record_step >= 0, its cell
 * (rank position * n + step - k0) counts it, sums its gap (float64, in row order: numpy's sums equal these whenever
 * every sum is exact, whole ns below 2**53), takes the max end and min enqueue, the min enqueue of its DP rows,
 * and marks a completed DP row whose group_seq is a multiple of dp_per_step (0: none). Refused (-1) when a rank's
 * times span more than 2**63 ns, where numpy's shifted times would wrap.
 */
static PyObject *step_cells(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    enum { STARTS, ROLE, TE, TC, STEP, GSEQ, GAP, COUNT, END, FIRST, COMPUTE, ARRIVAL, DP_END, N_COLS };
    static const char *names[N_COLS] = {"starts", "role", "te", "tc", "record_step", "gseq", "gap", "count", "end",
                                        "first", "compute", "arrival", "dp_end"};
    static const int arg_of[N_COLS] = {0, 1, 2, 3, 4, 5, 11, 12, 13, 14, 15, 16, 17};
    Column c[N_COLS];
    memset(c, 0, sizeof c);
    long long k0, n_steps, dp_per_step, marker, dp;
    long result = 0;
    if (nargs != 18) {
        PyErr_SetString(PyExc_TypeError, "step_cells(starts, role, te, tc, record_step, gseq, k0, n, dp_per_step, "
                                         "marker, dp, gap, count, end, first, compute, arrival, dp_end)");
        return NULL;
    }
    k0 = PyLong_AsLongLong(args[6]);
    n_steps = PyLong_AsLongLong(args[7]);
    dp_per_step = PyLong_AsLongLong(args[8]);
    marker = PyLong_AsLongLong(args[9]);
    dp = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    for (int k = 0; k < N_COLS; k++) {
        int writable = k >= GAP;
        if (k == GAP || k == COMPUTE) { /* floating point: taken as raw buffers of 4 and 8 bytes */
            if (PyObject_GetBuffer(args[arg_of[k]], &c[k].view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
                goto fail;
            c[k].width = k == GAP ? 4 : 8;
            c[k].n = c[k].view.len / c[k].width;
            continue;
        }
        if (get_column(args[arg_of[k]], &c[k], writable, names[k]) < 0)
            goto fail;
    }
    {
        Py_ssize_t rows = c[ROLE].n, n_ranks = c[STARTS].n - 1, cells = n_ranks * n_steps;
        if (n_ranks < 0 || n_steps < 1 || c[STARTS].width != 8 || c[ROLE].width != 1 || c[TE].width != 8
            || c[TC].width != 8 || c[STEP].width != 4 || c[TE].n != rows || c[TC].n != rows || c[STEP].n != rows
            || c[GSEQ].n != rows || c[GAP].n != rows || c[COUNT].width != 8 || c[END].width != 8
            || c[FIRST].width != 8 || c[ARRIVAL].width != 8 || c[DP_END].width != 1 || c[COUNT].n != cells
            || c[END].n != cells || c[FIRST].n != cells || c[COMPUTE].n != cells || c[ARRIVAL].n != cells
            || c[DP_END].n != cells) {
            PyErr_SetString(PyExc_ValueError, "step_cells: arrays of the wrong length or item size");
            goto fail;
        }
        const int64_t *starts = c[STARTS].view.buf, *te = c[TE].view.buf, *tc = c[TC].view.buf;
        const int8_t *role = c[ROLE].view.buf;
        const int32_t *step = c[STEP].view.buf;
        float *gap = c[GAP].view.buf;
        double *compute = c[COMPUTE].view.buf;
        int64_t *count = c[COUNT].view.buf, *end = c[END].view.buf, *first = c[FIRST].view.buf;
        int64_t *arrival = c[ARRIVAL].view.buf;
        unsigned char *dp_end = c[DP_END].view.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < n_ranks && result == 0; p++) {
            Py_ssize_t lo = starts[p], hi = starts[p + 1];
            if (lo < 0 || hi < lo || hi > rows) {
                result = -2;
                break;
            }
            /* the rank's earliest enqueue: every later time within 2**63 of it, or numpy's shifted times wrap */
            int64_t base = INT64_MAX, busy = 0;
            int seen = 0;
            for (Py_ssize_t i = lo; i < hi; i++)
                if (role[i] != marker && te[i] < base)
                    base = te[i];
            for (Py_ssize_t i = lo; i < hi; i++) {
                if (role[i] == marker)
                    continue;
                int64_t m = tc[i] > te[i] ? tc[i] : te[i];
                if ((uint64_t)m - (uint64_t)base > (uint64_t)INT64_MAX) {
                    result = -1;
                    break;
                }
                if (seen) {
                    int64_t after = te[i] - busy;
                    gap[i] = after > 0 ? (float)after : 0.0f;
                }
                busy = seen && busy > m ? busy : m;
                seen = 1;
            }
            for (Py_ssize_t i = lo; i < hi && result == 0; i++) {
                if (step[i] < 0)
                    continue;
                int64_t cell = (int64_t)p * n_steps + step[i] - k0;
                if (cell < (int64_t)p * n_steps || cell >= (int64_t)(p + 1) * n_steps) {
                    result = -2;
                    break;
                }
                int64_t m = tc[i] > te[i] ? tc[i] : te[i];
                count[cell] += 1;
                compute[cell] += (double)gap[i];
                end[cell] = m > end[cell] ? m : end[cell];
                first[cell] = te[i] < first[cell] ? te[i] : first[cell];
                if (role[i] == dp) {
                    arrival[cell] = te[i] < arrival[cell] ? te[i] : arrival[cell];
                    if (dp_per_step > 0 && load_int(&c[GSEQ], i) % dp_per_step == 0 && tc[i] > 0)
                        dp_end[cell] = 1;
                }
            }
        }
        Py_END_ALLOW_THREADS
        if (result == -2) {
            PyErr_SetString(PyExc_ValueError, "step_cells: row bounds or steps outside the arrays");
            goto fail;
        }
    }
    release(c, N_COLS);
    return PyLong_FromLong(result);
fail:
    release(c, N_COLS);
    return NULL;
}

/*
 * place_by_key(keys, rows, cursor, out) -> 0, or -1: the counting sort's placing pass (index.rows_by_key): for each
 * i in order, out[cursor[keys[i]]++] = rows[i]. Refused (-1) for a key outside cursor (before any write) or a place
 * outside out (counts that were not the keys': out partly written).
 */
static PyObject *place_by_key(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    static const char *names[4] = {"keys", "rows", "cursor", "out"};
    Column c[4];
    memset(c, 0, sizeof c);
    long result = 0;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "place_by_key(keys, rows, cursor, out)");
        return NULL;
    }
    for (int k = 0; k < 4; k++)
        if (get_column(args[k], &c[k], k >= 2, names[k]) < 0)
            goto fail;
    if (c[1].n != c[0].n || c[2].width != 8 || !c[2].is_signed || c[3].width < 4 || !c[3].is_signed) {
        PyErr_SetString(PyExc_ValueError, "place_by_key: keys and rows of one length, int64 cursor, int32/int64 out");
        goto fail;
    }
    {
        int64_t *cursor = c[2].view.buf;
        Py_ssize_t n = c[0].n, n_keys = c[2].n, n_out = c[3].n;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n && result == 0; i++) { /* every key first: refused before any write */
            int64_t key = load_int(&c[0], i);
            result = key < 0 || key >= n_keys ? -1 : 0;
        }
        for (Py_ssize_t i = 0; i < n && result == 0; i++) {
            int64_t key = load_int(&c[0], i);
            if (cursor[key] < 0 || cursor[key] >= n_out) { /* (counts that do not fit the keys: out partly written) */
                result = -1;
                break;
            }
            store_int(&c[3], cursor[key]++, load_int(&c[1], i));
        }
        Py_END_ALLOW_THREADS
    }
    release(c, 4);
    return PyLong_FromLong(result);
fail:
    release(c, 4);
    return NULL;
}

/*
 * instance_facts(inst, state, te, tc, op, dtype, nbytes, peer, rank, codes, kept, checks) -> 0, or -1 (an instance
 * id not below the tables' width: nothing is trusted then)
 *
 * match.match's per-instance facts in two passes over the records, for rows with inst >= 0. codes: (COMPLETED,
 * FAILED, ALL_TO_ALL, rooted op 1, rooted op 2). kept: int64 [KEPT, n_instances], the facts match keeps: entered,
 * completed, failed (counts), first and last enqueue, last completion (of a completed row), the rank of the last
 * row (in row order) whose enqueue is its instance's last, the min op and the max nbytes (0 for an all_to_all);
 * checks: int64 [FACTS - KEPT, n_instances], the rest of the min and max of op, dtype, nbytes and root (peer of a
 * rooted op, else -1), which only tell whether members agree. Both filled by the caller with each row's start.
 */
enum { F_ENTERED, F_COMPLETED, F_FAILED, F_FIRST, F_LAST, F_LAST_COMPLETE, F_LAST_RANK, F_OP_LO, F_NBYTES_HI, KEPT,
       F_OP_HI = KEPT, F_DTYPE_LO, F_DTYPE_HI, F_NBYTES_LO, F_ROOT_LO, F_ROOT_HI, FACTS };

static PyObject *instance_facts(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    enum { INST, STATE, TE, TC, OP, DTYPE, NBYTES, PEER, RANK, OUT, CHECKS, N_COLS };
    static const char *names[N_COLS] = {"inst", "state", "te", "tc", "op", "dtype", "nbytes", "peer", "rank", "kept",
                                        "checks"};
    static const int arg_of[N_COLS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11};
    Column c[N_COLS];
    memset(c, 0, sizeof c);
    long long code[5];
    long result = 0;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "instance_facts(inst, state, te, tc, op, dtype, nbytes, peer, rank, codes, "
                                         "kept, checks)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args[9], "LLLLL", &code[0], &code[1], &code[2], &code[3], &code[4]))
        return NULL;
    for (int k = 0; k < N_COLS; k++)
        if (get_column(args[arg_of[k]], &c[k], k >= OUT, names[k]) < 0)
            goto fail;
    {
        Py_ssize_t n = c[INST].n, width = c[OUT].n / KEPT;
        for (int k = STATE; k < OUT; k++)
            if (c[k].n != n) {
                PyErr_SetString(PyExc_ValueError, "instance_facts: the record columns must have one length");
                goto fail;
            }
        if (c[OUT].width != 8 || !c[OUT].is_signed || c[OUT].n != KEPT * width || c[CHECKS].width != 8
            || !c[CHECKS].is_signed || c[CHECKS].n != (FACTS - KEPT) * width || c[TE].width != 8 || c[TC].width != 8) {
            PyErr_SetString(PyExc_ValueError, "instance_facts: int64 times, int64 tables [KEPT and FACTS - KEPT, "
                                              "n_instances]");
            goto fail;
        }
        int64_t *out = c[OUT].view.buf, *checks = c[CHECKS].view.buf;
        const int64_t *te = c[TE].view.buf, *tc = c[TC].view.buf;
#define FACT(row, i) \
    (*((row) < KEPT ? &out[(Py_ssize_t)(row) * width + (i)] : &checks[(Py_ssize_t)((row) - KEPT) * width + (i)]))
#define LOWER(row, i, v) FACT(row, i) = (v) < FACT(row, i) ? (v) : FACT(row, i)
#define RAISE(row, i, v) FACT(row, i) = (v) > FACT(row, i) ? (v) : FACT(row, i)
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < n; r++) {
            int64_t i = load_int(&c[INST], r);
            if (i < 0)
                continue;
            if (i >= width) {
                result = -1;
                break;
            }
            int64_t state = load_int(&c[STATE], r), op = load_int(&c[OP], r), t = te[r];
            int64_t size = op == code[2] ? 0 : load_int(&c[NBYTES], r);
            int64_t root = op == code[3] || op == code[4] ? load_int(&c[PEER], r) : -1;
            int64_t dt = load_int(&c[DTYPE], r);
            FACT(F_ENTERED, i) += 1;
            if (state == code[0]) {
                FACT(F_COMPLETED, i) += 1;
                RAISE(F_LAST_COMPLETE, i, tc[r]);
            }
            FACT(F_FAILED, i) += state == code[1];
            LOWER(F_FIRST, i, t);
            RAISE(F_LAST, i, t);
            LOWER(F_OP_LO, i, op);
            RAISE(F_OP_HI, i, op);
            LOWER(F_DTYPE_LO, i, dt);
            RAISE(F_DTYPE_HI, i, dt);
            LOWER(F_NBYTES_LO, i, size);
            RAISE(F_NBYTES_HI, i, size);
            LOWER(F_ROOT_LO, i, root);
            RAISE(F_ROOT_HI, i, root);
        }
        for (Py_ssize_t r = 0; r < n && result == 0; r++) {
            int64_t i = load_int(&c[INST], r);
            if (i >= 0 && te[r] == FACT(F_LAST, i))
                FACT(F_LAST_RANK, i) = load_int(&c[RANK], r);
        }
        Py_END_ALLOW_THREADS
#undef FACT
#undef LOWER
#undef RAISE
    }
    release(c, N_COLS);
    return PyLong_FromLong(result);
fail:
    release(c, N_COLS);
    return NULL;
}

/*
 * fill_runs(runs, values, out) -> 0, or -1 (nothing written): out[runs[j]:runs[j + 1]] = values[j] for each run j
 * (iterations._steps_from_ends: a step over the rows of each run). runs ascending within 0..len(out).
 */
static PyObject *fill_runs(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    static const char *names[3] = {"runs", "values", "out"};
    Column c[3];
    memset(c, 0, sizeof c);
    long result = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fill_runs(runs, values, out)");
        return NULL;
    }
    for (int k = 0; k < 3; k++)
        if (get_column(args[k], &c[k], k == 2, names[k]) < 0)
            goto fail;
    if (c[0].width != 8 || c[1].width != 4 || c[2].width != 4 || c[1].n + 1 != c[0].n) {
        PyErr_SetString(PyExc_ValueError, "fill_runs: int64 runs, one int32 value a run, int32 out");
        goto fail;
    }
    {
        const int64_t *runs = c[0].view.buf;
        const int32_t *values = c[1].view.buf;
        int32_t *out = c[2].view.buf;
        Py_ssize_t n_runs = c[1].n, n = c[2].n;
        for (Py_ssize_t j = 0; j < n_runs && result == 0; j++)
            result = runs[j] < 0 || runs[j] > runs[j + 1] || runs[j + 1] > n ? -1 : 0;
        if (result == 0) {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t j = 0; j < n_runs; j++)
                for (int64_t i = runs[j]; i < runs[j + 1]; i++)
                    out[i] = values[j];
            Py_END_ALLOW_THREADS
        }
    }
    release(c, 3);
    return PyLong_FromLong(result);
fail:
    release(c, 3);
    return NULL;
}

/*
 * record_roles(gidx, op, peer, rank, group_roles, stage, ops, roles, out) -> 0, or -1 (out partly written)
 *
 * iterations.record_roles in one pass: each record's role from its group's (group_roles[gidx]; OTHER without a
 * group), MARKER for an op at or above the first marker op, OTHER for a p2p call in a TP or DP group and for a
 * collective in a pipeline group; a p2p call in a pipeline group, when stage (each rank's pipeline stage, int64;
 * None: no layout) knows both ends, becomes ACT_IN, ACT_OUT, GRAD_IN or GRAD_OUT by direction. ops: (first marker
 * op, SEND, RECV); roles: (OTHER, MARKER, TP, DP, PP_OTHER, ACT_IN, ACT_OUT, GRAD_IN, GRAD_OUT). Refused for a
 * group index beyond group_roles or a negative rank where the stage is looked up (numpy's answers then).
 */
static PyObject *record_roles(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    enum { GIDX, OP, PEER, RANK, GROLES, STAGE, OUT, N_COLS };
    static const char *names[N_COLS] = {"gidx", "op", "peer", "rank", "group_roles", "stage", "out"};
    static const int arg_of[N_COLS] = {0, 1, 2, 3, 4, 5, 8};
    Column c[N_COLS];
    memset(c, 0, sizeof c);
    long long mark, send, recv;
    int other, marker, tp, dp, pp_other, act_in, act_out, grad_in, grad_out;
    int with_stage = args[5] != Py_None;
    long result = 0;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "record_roles(gidx, op, peer, rank, group_roles, stage, ops, roles, out)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args[6], "LLL", &mark, &send, &recv)
        || !PyArg_ParseTuple(args[7], "iiiiiiiii", &other, &marker, &tp, &dp, &pp_other, &act_in, &act_out, &grad_in,
                             &grad_out))
        return NULL;
    for (int k = 0; k < N_COLS; k++) {
        if (k == STAGE && !with_stage)
            continue;
        if (get_column(args[arg_of[k]], &c[k], k == OUT, names[k]) < 0)
            goto fail;
    }
    {
        Py_ssize_t n = c[GIDX].n, n_groups = c[GROLES].n, world = with_stage ? c[STAGE].n : 0;
        if (c[OP].n != n || c[PEER].n != n || c[RANK].n != n || c[OUT].n != n || c[OUT].width != 1
            || (with_stage && c[STAGE].width != 8)) {
            PyErr_SetString(PyExc_ValueError, "record_roles: the record columns and out of one length, int8 out, "
                                              "int64 stages");
            goto fail;
        }
        int8_t *out = c[OUT].view.buf;
        const int64_t *stage = with_stage ? c[STAGE].view.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t g = load_int(&c[GIDX], i), op = load_int(&c[OP], i);
            int role;
            if (g >= n_groups) {
                result = -1;
                break;
            }
            role = g >= 0 ? (int)load_int(&c[GROLES], g) : other;
            int p2p = op == send || op == recv;
            if (op >= mark)
                role = marker;
            else if ((role == tp || role == dp) && p2p)
                role = other;
            else if (role == pp_other && !p2p)
                role = other;
            else if (role == pp_other && with_stage) {
                int64_t peer = load_int(&c[PEER], i), me = load_int(&c[RANK], i);
                if (peer >= 0 && peer < world && me < world) {
                    if (me < 0) {
                        result = -1;
                        break;
                    }
                    int64_t mine = stage[me], theirs = stage[peer];
                    int sending = op == send;
                    role = pp_other;
                    if (!sending && theirs == mine - 1)
                        role = act_in;
                    if (sending && theirs == mine + 1)
                        role = act_out;
                    if (!sending && theirs == mine + 1)
                        role = grad_in;
                    if (sending && theirs == mine - 1)
                        role = grad_out;
                }
            }
            out[i] = (int8_t)role;
        }
        Py_END_ALLOW_THREADS
    }
    release(c, N_COLS);
    return PyLong_FromLong(result);
fail:
    release(c, N_COLS);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"key_ranges", (PyCFunction)(void (*)(void))key_ranges, METH_FASTCALL,
     "key_ranges(keys, seqs, op, send, recv, smin, smax) -> rows counted, or -1 (a negative seq, a key out of "
     "range)."},
    {"place", (PyCFunction)(void (*)(void))place, METH_FASTCALL,
     "place(keys, seqs, op, send, recv, offset, ids, used) -> 1 when every slot was used, 0 when not, -1 when "
     "refused."},
    {"group_index", (PyCFunction)(void (*)(void))group_index, METH_FASTCALL,
     "group_index(group_id, op, gids, marker, out): each row's position in the sorted gids (rows below marker)."},
    {"p2p_channels", (PyCFunction)(void (*)(void))p2p_channels, METH_FASTCALL,
     "p2p_channels(op, gidx, rank, peer, world, send, recv, rows, chans) -> (count, distinct keys as int64 "
     "bytes, by first appearance)."},
    {"step_cells", (PyCFunction)(void (*)(void))step_cells, METH_FASTCALL,
     "step_cells(starts, role, te, tc, record_step, gseq, k0, n, dp_per_step, marker, dp, gap, count, end, first, "
     "compute, arrival, dp_end) -> 0, or -1 where a rank's times span more than 2**63 ns."},
    {"place_by_key", (PyCFunction)(void (*)(void))place_by_key, METH_FASTCALL,
     "place_by_key(keys, rows, cursor, out) -> 0, or -1 (a key or a place out of range)."},
    {"instance_facts", (PyCFunction)(void (*)(void))instance_facts, METH_FASTCALL,
     "instance_facts(inst, state, te, tc, op, dtype, nbytes, peer, rank, codes, kept, checks) -> 0, or -1 (an "
     "instance id out of range)."},
    {"fill_runs", (PyCFunction)(void (*)(void))fill_runs, METH_FASTCALL,
     "fill_runs(runs, values, out) -> 0, or -1 (runs not ascending within out: nothing written)."},
    {"record_roles", (PyCFunction)(void (*)(void))record_roles, METH_FASTCALL,
     "record_roles(gidx, op, peer, rank, group_roles, stage, ops, roles, out) -> 0, or -1 (refused)."},
    {"group_counts", (PyCFunction)(void (*)(void))group_counts, METH_FASTCALL,
     "group_counts(group_id, op, gids, marker, send, recv, collectives, p2p): records per group, added to."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernels",
    .m_doc = "C passes over every record for the analysis (each with a numpy twin).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
