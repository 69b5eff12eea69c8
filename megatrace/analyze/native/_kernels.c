/*
 * megatrace.analyze._kernels: C passes over every record that numpy would make in many (analyze/index.py).
 *
 * Each function has a numpy twin in the module that calls it, used when this extension is not built; both give
 * the same arrays (tests/test_analyze_kernels.py). Arrays come in as buffers the caller allocated; a function
 * answers -1 (or raises) for an input it does not handle, and the caller then takes the numpy path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
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
 * key_ranges(keys, seqs, op, send, recv, smin, smax) -> rows: for each row with keys[i] >= 0 (and, when op is not
 * None, an op other than the codes send and recv), smin[key] = min(smin[key], seqs[i]) and smax[key] likewise
 * (int64 tables of the keys). Returns how many rows were counted, or -1 (tables partly updated) when a sequence
 * number is negative or a key is not below the tables' length.
 */
static PyObject *key_ranges(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Column c[5];
    memset(c, 0, sizeof c);
    int k = 0, with_op;
    Py_ssize_t rows = 0;
    long send, recv;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "key_ranges(keys, seqs, op, send, recv, smin, smax)");
        return NULL;
    }
    with_op = args[2] != Py_None;
    send = PyLong_AsLong(args[3]);
    recv = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    static const char *names[5] = {"keys", "seqs", "op", "smin", "smax"};
    for (; k < 5; k++) {
        if (k == 2 && !with_op)
            continue;
        if (get_column(args[k < 3 ? k : k + 2], &c[k], k >= 3, names[k]) < 0)
            goto fail;
    }
    if (c[1].n != c[0].n || (with_op && c[2].n != c[0].n) || c[3].width != 8 || c[4].width != 8
        || c[4].n != c[3].n) {
        PyErr_SetString(PyExc_ValueError,
                        "key_ranges: keys, seqs (and op) of one length, int64 tables of one length");
        goto fail;
    }
    {
        int64_t *smin = c[3].view.buf, *smax = c[4].view.buf;
        Py_ssize_t n = c[0].n, n_keys = c[3].n;
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
    int k = 0, with_op;
    long result = 1;
    long send, recv;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "place(keys, seqs, op, send, recv, offset, ids, used)");
        return NULL;
    }
    with_op = args[2] != Py_None;
    send = PyLong_AsLong(args[3]);
    recv = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    static const char *names[6] = {"keys", "seqs", "op", "offset", "ids", "used"};
    for (; k < 6; k++) {
        if (k == 2 && !with_op)
            continue;
        if (get_column(args[k < 3 ? k : k + 2], &c[k], k >= 4, names[k]) < 0)
            goto fail;
    }
    if (c[1].n != c[0].n || (with_op && c[2].n != c[0].n) || c[4].n != c[0].n || c[3].width != 8
        || !(c[4].width == 4 || c[4].width == 8) || !c[4].is_signed || c[5].width != 1) {
        PyErr_SetString(PyExc_ValueError, "place: keys, seqs, (op,) ids of one length; offset int64, ids int32/int64, "
                                          "used one byte a slot");
        goto fail;
    }
    {
        const int64_t *offset = c[3].view.buf;
        unsigned char *used = c[5].view.buf;
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

static PyMethodDef module_methods[] = {
    {"key_ranges", (PyCFunction)(void (*)(void))key_ranges, METH_FASTCALL,
     "key_ranges(keys, seqs, op, send, recv, smin, smax) -> rows counted, or -1 (a negative seq, a key out of "
     "range)."},
    {"place", (PyCFunction)(void (*)(void))place, METH_FASTCALL,
     "place(keys, seqs, op, send, recv, offset, ids, used) -> 1 when every slot was used, 0 when not, -1 when "
     "refused."},
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
