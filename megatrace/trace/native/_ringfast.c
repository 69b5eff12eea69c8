/*
 * megatrace.trace._ringfast: the ring writer's hot path in C, the reader's slot checks, the tail reader's batch
 * reads and the loader's records-to-columns copy.
 *
 * RingWriter (ring_writer.py) uses it when it was built and falls back to its
 * pure-Python twin otherwise; both write the same bytes (ring_record.h). Calls
 * run under the GIL; the sequence counter is still taken atomically, because the
 * c10d dispatcher hook (c10d_hook.cpp) allocates from it on threads without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ring_record.h"

#define MT_PULSE_OFFSET 280u      /* ring_format.PULSE_OFFSET */
#define MT_SIGNAL_NS_OFFSET 288u  /* ring_format.SIGNAL_NS_OFFSET */
#define MT_SIGNAL_OFFSET 296u     /* ring_format.SIGNAL_OFFSET */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    uint64_t capacity;
    uint64_t next_seq;
    PyObject *on_wrap; /* called once with the first seq this writer sees overwrite an older record */
    int wrap_told;
    /* The pulse: a native thread that rewrites the header's pulse_ns every interval, GIL or not. */
    pthread_t pulse_thread;
    int pulse_running;
    volatile int pulse_stop;
    int64_t pulse_interval_ns;
    int marks_signal; /* this ring is the one a SIGTERM is marked in */
} FastRing;

/* The signal mark: a SIGTERM (a launcher or the scheduler ending the process) is written into the
 * header before the process ends as it would have, so a reader tells "ended from outside" from
 * "died" (SIGKILL, a crash), which leave no mark. Only the process that installed it marks: a
 * forked child inherits the handler and the shared mapping, not the right to speak for the rank. */
static unsigned char *mt_signal_ring;
static pid_t mt_signal_pid;

static void mt_on_signal(int sig)
{
    int saved = errno;
    unsigned char *base = __atomic_load_n(&mt_signal_ring, __ATOMIC_ACQUIRE);
    if (base != NULL && getpid() == mt_signal_pid) {
        __atomic_store_n((int64_t *)(base + MT_SIGNAL_NS_OFFSET), mt_now_ns(), __ATOMIC_RELAXED);
        __atomic_store_n((uint32_t *)(base + MT_SIGNAL_OFFSET), (uint32_t)sig, __ATOMIC_RELEASE);
    }
    raise(sig); /* SA_RESETHAND restored the default action: the process ends by this signal, as before */
    errno = saved;
}

/* Install the mark for SIGTERM unless someone else handles it; 1 when this ring now carries it. */
static int signal_mark_install(FastRing *self)
{
    struct sigaction now, act;
    if (sigaction(SIGTERM, NULL, &now) != 0)
        return 0;
    if (!(now.sa_flags & SA_SIGINFO) && now.sa_handler == mt_on_signal) {
        __atomic_store_n(&mt_signal_ring, (unsigned char *)self->view.buf, __ATOMIC_RELEASE);
        return 1;
    }
    if ((now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL)
        return 0; /* the program's own handler (or SIG_IGN) stays: it decides what SIGTERM means */
    mt_signal_pid = getpid();
    __atomic_store_n(&mt_signal_ring, (unsigned char *)self->view.buf, __ATOMIC_RELEASE);
    memset(&act, 0, sizeof act);
    act.sa_handler = mt_on_signal;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESETHAND | SA_RESTART;
    if (sigaction(SIGTERM, &act, NULL) != 0) {
        __atomic_store_n(&mt_signal_ring, NULL, __ATOMIC_RELEASE);
        return 0;
    }
    return 1;
}

/* Take the mark away (the ring closes): the default action again, if ours is still the handler. */
static void signal_mark_remove(FastRing *self)
{
    struct sigaction now, dfl;
    if (!self->marks_signal)
        return;
    self->marks_signal = 0;
    if (__atomic_load_n(&mt_signal_ring, __ATOMIC_ACQUIRE) != (unsigned char *)self->view.buf)
        return; /* a newer ring carries it */
    if (sigaction(SIGTERM, NULL, &now) == 0 && !(now.sa_flags & SA_SIGINFO) && now.sa_handler == mt_on_signal) {
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGTERM, &dfl, NULL);
    }
    __atomic_store_n(&mt_signal_ring, NULL, __ATOMIC_RELEASE);
}

static void *pulse_main(void *arg)
{
    FastRing *self = (FastRing *)arg;
    struct timespec pause = {self->pulse_interval_ns / 1000000000ll, self->pulse_interval_ns % 1000000000ll};
    unsigned char *base = (unsigned char *)self->view.buf;
    while (!self->pulse_stop) {
        __atomic_store_n((int64_t *)(base + MT_PULSE_OFFSET), mt_now_ns(), __ATOMIC_RELAXED);
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static void pulse_halt(FastRing *self)
{
    signal_mark_remove(self);
    if (!self->pulse_running)
        return;
    self->pulse_stop = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->pulse_thread, NULL);
    Py_END_ALLOW_THREADS
    self->pulse_running = 0;
}

static int FastRing_init(FastRing *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "capacity", "next_seq", "on_wrap", NULL};
    PyObject *buffer, *on_wrap = NULL;
    unsigned long long capacity, next_seq = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OK|KO", kwlist, &buffer, &capacity, &next_seq, &on_wrap))
        return -1;
    Py_XINCREF(on_wrap);
    Py_XSETREF(self->on_wrap, on_wrap);
    if (capacity == 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be positive");
        return -1;
    }
    pulse_halt(self);
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->has_view = 1;
    if ((unsigned long long)self->view.len < MT_HEADER_SIZE + capacity * MT_RECORD_SIZE) {
        PyErr_SetString(PyExc_ValueError, "buffer smaller than header + capacity records");
        return -1;
    }
    self->capacity = capacity;
    self->next_seq = next_seq;
    return 0;
}

static void FastRing_dealloc(FastRing *self)
{
    pulse_halt(self);
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_XDECREF(self->on_wrap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Parse argument i as an integer in [lo, hi] (unsigned when lo == 0 and hi > INT64_MAX). */
static int arg_int(PyObject *const *args, Py_ssize_t i, long long lo, long long hi, long long *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(args[i], &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_OverflowError, "argument %zd out of range [%lld, %lld]", i + 1, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int arg_u64(PyObject *const *args, Py_ssize_t i, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(args[i]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* begin(op, group_id, group_seq, nbytes, peer=-1, dtype=0, flags=0) -> (offset, seq)
 * Ranges as the Python writer's struct: op u16, group_id u32, group_seq and nbytes u64,
 * peer i32, dtype and flags u8. */
static PyObject *FastRing_begin(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long op, group_id, peer = -1, dtype = 0, flags = 0;
    uint64_t group_seq, nbytes;
    if (nargs < 4 || nargs > 7) {
        PyErr_SetString(PyExc_TypeError, "begin() takes 4 to 7 positional arguments");
        return NULL;
    }
    if (arg_int(args, 0, 0, 0xffff, &op) < 0 || arg_int(args, 1, 0, 0xffffffffll, &group_id) < 0
        || arg_u64(args, 2, &group_seq) < 0 || arg_u64(args, 3, &nbytes) < 0
        || (nargs > 4 && arg_int(args, 4, INT32_MIN, INT32_MAX, &peer) < 0)
        || (nargs > 5 && arg_int(args, 5, 0, 0xff, &dtype) < 0)
        || (nargs > 6 && arg_int(args, 6, 0, 0xff, &flags) < 0))
        return NULL;
    uint64_t seq = __atomic_fetch_add(&self->next_seq, 1, __ATOMIC_RELAXED);
    uint64_t off = mt_record_begin((unsigned char *)self->view.buf, self->capacity, seq, group_seq, nbytes,
                                   (uint32_t)group_id, (int32_t)peer, (uint16_t)op, (uint8_t)dtype,
                                   (uint8_t)flags);
    if (seq > self->capacity && !self->wrap_told && self->on_wrap != NULL && self->on_wrap != Py_None) {
        self->wrap_told = 1;
        PyObject *r = PyObject_CallFunction(self->on_wrap, "K", (unsigned long long)seq);
        if (r == NULL)
            PyErr_Clear(); /* a failing warning must not fail the record */
        Py_XDECREF(r);
    }
    return Py_BuildValue("(KK)", (unsigned long long)off, (unsigned long long)seq);
}

static int parse_handle(PyObject *handle, uint64_t *off, uint64_t *seq)
{
    if (!PyTuple_Check(handle) || PyTuple_GET_SIZE(handle) != 2) {
        PyErr_SetString(PyExc_TypeError, "handle must be an (offset, seq) tuple");
        return -1;
    }
    *off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(handle, 0));
    *seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(handle, 1));
    if (PyErr_Occurred())
        return -1;
    return 0;
}

/* complete_now(handle): the calling thread just began this record; no wrap check. */
static PyObject *FastRing_complete_now(FastRing *self, PyObject *handle)
{
    uint64_t off, seq;
    if (parse_handle(handle, &off, &seq) < 0)
        return NULL;
    mt_record_complete((unsigned char *)self->view.buf, off, seq, MT_STATE_COMPLETED);
    Py_RETURN_NONE;
}

/* complete(handle, state=2): from any thread; skipped if the ring wrapped past the record. */
static PyObject *FastRing_complete(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t off, seq, stored;
    long state = MT_STATE_COMPLETED;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "complete() takes 1 or 2 positional arguments");
        return NULL;
    }
    if (parse_handle(args[0], &off, &seq) < 0)
        return NULL;
    if (nargs == 2) {
        state = PyLong_AsLong(args[1]);
        if (state == -1 && PyErr_Occurred())
            return NULL;
    }
    if (off + MT_RECORD_SIZE > (uint64_t)self->view.len) {
        PyErr_SetString(PyExc_ValueError, "handle offset outside the ring");
        return NULL;
    }
    memcpy(&stored, (unsigned char *)self->view.buf + off, 8);
    if (stored == seq)
        mt_record_complete((unsigned char *)self->view.buf, off, seq, (uint32_t)state);
    Py_RETURN_NONE;
}

/* shared_state() -> (mapping address, capacity, address of the sequence counter): for the c10d
 * dispatcher hook, which writes into the same ring from C++ threads and allocates sequence numbers
 * from the same counter (atomically, as begin() does). Valid while this object lives. */
static PyObject *FastRing_shared_state(FastRing *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)self->view.buf, (unsigned long long)self->capacity,
                         (unsigned long long)(uintptr_t)&self->next_seq);
}

/* start_pulse(interval_ns): start the pulse thread (idempotent; signals stay with the other threads)
 * and the SIGTERM mark: together they date the process's end and say whether it was ended from outside. */
static PyObject *FastRing_start_pulse(FastRing *self, PyObject *arg)
{
    long long interval = PyLong_AsLongLong(arg);
    sigset_t all, old;
    int err;
    if (interval == -1 && PyErr_Occurred())
        return NULL;
    if (interval < 1000000 || interval > 10000000000ll) {
        PyErr_SetString(PyExc_ValueError, "pulse interval must be 1 ms to 10 s");
        return NULL;
    }
    if (self->pulse_running || !self->has_view)
        Py_RETURN_NONE;
    self->pulse_interval_ns = interval;
    self->pulse_stop = 0;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    err = pthread_create(&self->pulse_thread, NULL, pulse_main, self);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->pulse_running = 1;
    self->marks_signal = signal_mark_install(self);
    Py_RETURN_NONE;
}

static PyObject *FastRing_stop_pulse(FastRing *self, PyObject *Py_UNUSED(ignored))
{
    pulse_halt(self);
    Py_RETURN_NONE;
}

static PyObject *FastRing_marks_signal(FastRing *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(self->marks_signal);
}

static PyMethodDef FastRing_methods[] = {
    {"start_pulse", (PyCFunction)FastRing_start_pulse, METH_O,
     "Rewrite the header's pulse_ns every interval; mark a SIGTERM in the header."},
    {"marks_signal", (PyCFunction)FastRing_marks_signal, METH_NOARGS, "Whether a SIGTERM is marked in this ring."},
    {"stop_pulse", (PyCFunction)FastRing_stop_pulse, METH_NOARGS, "Stop the pulse thread."},
    {"shared_state", (PyCFunction)FastRing_shared_state, METH_NOARGS, "(address, capacity, counter address)."},
    {"begin", (PyCFunction)(void (*)(void))FastRing_begin, METH_FASTCALL, "Commit an 'entered' record."},
    {"complete_now", (PyCFunction)FastRing_complete_now, METH_O, "Complete a record just begun."},
    {"complete", (PyCFunction)(void (*)(void))FastRing_complete, METH_FASTCALL, "Complete or fail a record."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastRingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "megatrace.trace._ringfast.FastRing",
    .tp_basicsize = sizeof(FastRing),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hot path of the ring writer over a writable buffer (the mmap of a ring file).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastRing_init,
    .tp_dealloc = (destructor)FastRing_dealloc,
    .tp_methods = FastRing_methods,
};

/* The reader's hot path: ring_records.validate() of a whole ring's slots, row i being slot i. */
static int writable_mask(PyObject *obj, Py_buffer *view, Py_ssize_t n)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != n) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a mask must hold one byte per row");
        return -1;
    }
    return 0;
}

static PyObject *scan_slots(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer raw, mask[3];
    unsigned long long capacity;
    Py_ssize_t n, k = 0;
    /* What the reader would otherwise work out from the masks with a dozen numpy passes over a small ring: the
     * whole records (head_ok), the newest, the first and last row holding one, whether their sequence numbers
     * ascend row by row, and whether every slot is empty or whole (head and tail). */
    Py_ssize_t count = 0, first = -1, last = -1;
    uint64_t newest = 0, prev = 0;
    int ascending = 1, clean = 1;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan_slots(raw, capacity, empty, head_ok, tail_ok)");
        return NULL;
    }
    capacity = PyLong_AsUnsignedLongLong(args[1]);
    if (capacity == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (capacity == 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (raw.len % MT_RECORD_SIZE) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, "raw must hold whole 64-byte rows");
        return NULL;
    }
    n = raw.len / MT_RECORD_SIZE;
    for (; k < 3; k++)
        if (writable_mask(args[2 + k], &mask[k], n) < 0)
            goto done;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *row = raw.buf;
    unsigned char *empty = mask[0].buf, *head_ok = mask[1].buf, *tail_ok = mask[2].buf;
    for (Py_ssize_t i = 0; i < n; i++, row += MT_RECORD_SIZE) {
        uint64_t w[8], seq;
        uint32_t head_check, state_word, tail_check;
        int64_t t_complete;
        memcpy(w, row, sizeof w);
        seq = w[0];
        memcpy(&head_check, row + MT_HEAD_LEN, 4);
        memcpy(&t_complete, row + MT_TAIL_OFFSET, 8);
        memcpy(&state_word, row + MT_TAIL_OFFSET + 8, 4); /* the state byte and its padding, as the check covers */
        memcpy(&tail_check, row + MT_TAIL_OFFSET + 12, 4);
        empty[i] = (w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) == 0;
        head_ok[i] = seq > 0 && (seq - 1) % capacity == (uint64_t)i && mt_adler32(row, MT_HEAD_LEN) == head_check;
        tail_ok[i] = mt_tail_check(t_complete, state_word, seq) == tail_check && row[MT_TAIL_OFFSET + 8] >= 1
                     && row[MT_TAIL_OFFSET + 8] <= 3;
        clean &= empty[i] || (head_ok[i] && tail_ok[i]);
        if (head_ok[i]) {
            ascending &= count == 0 || seq > prev;
            prev = seq;
            newest = seq > newest ? seq : newest;
            first = count++ == 0 ? i : first;
            last = i;
        }
    }
    Py_END_ALLOW_THREADS
done:
    while (k-- > 0)
        PyBuffer_Release(&mask[k]);
    PyBuffer_Release(&raw);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(nKnnii)", count, (unsigned long long)newest, first, last, ascending, clean);
}

/* The tail reader's check (ring_records.whole_records): row i holds exactly record seqs[i], both checksums and its
 * state right. Rows of several rings at once; `seqs` is one uint64 per row, `out` one byte per row. */
static PyObject *whole_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer raw, seqs, out;
    Py_ssize_t n;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "whole_rows(raw, seqs, out)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    n = raw.len / MT_RECORD_SIZE;
    if (raw.len % MT_RECORD_SIZE) {
        PyErr_SetString(PyExc_ValueError, "raw must hold whole 64-byte rows");
        goto no_seqs;
    }
    if (PyObject_GetBuffer(args[1], &seqs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto no_seqs;
    if (seqs.itemsize != 8 || seqs.len != n * 8 || seqs.format == NULL || strchr("QLq", seqs.format[0]) == NULL) {
        PyErr_SetString(PyExc_ValueError, "seqs must hold one uint64 per row");
        goto no_out;
    }
    if (writable_mask(args[2], &out, n) < 0)
        goto no_out;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *row = raw.buf;
    const uint64_t *want = seqs.buf;
    unsigned char *whole = out.buf;
    for (Py_ssize_t i = 0; i < n; i++, row += MT_RECORD_SIZE) {
        uint64_t seq;
        uint32_t head_check, state_word, tail_check;
        int64_t t_complete;
        memcpy(&seq, row, 8);
        memcpy(&head_check, row + MT_HEAD_LEN, 4);
        memcpy(&t_complete, row + MT_TAIL_OFFSET, 8);
        memcpy(&state_word, row + MT_TAIL_OFFSET + 8, 4);
        memcpy(&tail_check, row + MT_TAIL_OFFSET + 12, 4);
        whole[i] = seq == want[i] && row[MT_TAIL_OFFSET + 8] >= 1 && row[MT_TAIL_OFFSET + 8] <= 3
                   && mt_adler32(row, MT_HEAD_LEN) == head_check
                   && mt_tail_check(t_complete, state_word, seq) == tail_check;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
no_out:
    PyBuffer_Release(&seqs);
no_seqs:
    PyBuffer_Release(&raw);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* A writable C-contiguous buffer of n items of `itemsize` bytes each. */
static int writable_items(PyObject *obj, Py_buffer *view, Py_ssize_t n, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len != n * itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must hold %zd items of %zd bytes", what, n, itemsize);
        return -1;
    }
    return 0;
}

static ssize_t pread_retry(int fd, void *buf, size_t len, off_t offset)
{
    ssize_t got;
    do
        got = pread(fd, buf, len, offset);
    while (got < 0 && errno == EINTR);
    return got;
}

/*
 * The tail reader's first two passes over many ring files (ring_io.open_heads; its Python twin does the same):
 * open each (with the caller's flags) and ask the kernel for its header; then check it is a regular file, read
 * its size and its first `header_len` bytes, the live words [live_start, live_stop) read again until two reads
 * agree (at most `tries` times). A file that fails any step is closed, its fd -1 and errs[i] its errno (EINVAL:
 * not a regular file; EAGAIN: the live words could not be read again in whole): the caller reads it its own way.
 */
static PyObject *open_heads(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq = NULL, **paths = NULL;
    Py_buffer fds_b, sizes_b, lens_b, heads_b, errs_b;
    long long flags, header_len, live_start, live_stop, tries;
    Py_ssize_t n, k = 0, got_buffers = 0;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "open_heads(paths, flags, header_len, live_start, live_stop, tries, fds, "
                                         "sizes, lens, heads, errs)");
        return NULL;
    }
    if (arg_int(args, 1, INT_MIN, INT_MAX, &flags) < 0 || arg_int(args, 2, 1, 1 << 20, &header_len) < 0
        || arg_int(args, 3, 0, 1 << 20, &live_start) < 0 || arg_int(args, 4, 0, 1 << 20, &live_stop) < 0
        || arg_int(args, 5, 0, 64, &tries) < 0)
        return NULL;
    if (live_start > live_stop || live_stop > header_len) {
        PyErr_SetString(PyExc_ValueError, "the live words must lie inside the header");
        return NULL;
    }
    seq = PySequence_Fast(args[0], "paths must be a sequence");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views[5] = {&fds_b, &sizes_b, &lens_b, &heads_b, &errs_b};
    const Py_ssize_t sizes_of[5] = {4, 8, 8, 1, 4};
    const Py_ssize_t counts[5] = {n, n, n, n * (Py_ssize_t)header_len, n};
    static const char *names[5] = {"fds", "sizes", "lens", "heads", "errs"};
    for (; got_buffers < 5; got_buffers++)
        if (writable_items(args[6 + got_buffers], views[got_buffers], counts[got_buffers], sizes_of[got_buffers],
                           names[got_buffers]) < 0)
            goto done;
    paths = PyMem_Calloc(n ? n : 1, sizeof *paths);
    if (paths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; k < n; k++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, k), &paths[k]))
            goto done;
    int32_t *fds = fds_b.buf, *errs = errs_b.buf;
    int64_t *sizes = sizes_b.buf, *lens = lens_b.buf;
    unsigned char *heads = heads_b.buf;
    size_t live_len = (size_t)(live_stop - live_start);
    Py_BEGIN_ALLOW_THREADS
    unsigned char again[4096];
    for (Py_ssize_t i = 0; i < n; i++) { /* open all, then read: the kernel reads every header ahead at once */
        int fd;
        do
            fd = open(PyBytes_AS_STRING(paths[i]), (int)flags);
        while (fd < 0 && errno == EINTR);
        fds[i] = fd;
        errs[i] = fd < 0 ? errno : 0;
        sizes[i] = lens[i] = 0;
#ifdef POSIX_FADV_WILLNEED
        if (fd >= 0)
            (void)posix_fadvise(fd, 0, (off_t)header_len, POSIX_FADV_WILLNEED);
#endif
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        unsigned char *head = heads + i * header_len;
        ssize_t got;
        int fd = fds[i], err = 0;
        if (fd < 0)
            continue;
        if (fstat(fd, &st) < 0)
            err = errno;
        else if (!S_ISREG(st.st_mode))
            err = EINVAL;
        else if ((got = pread_retry(fd, head, (size_t)header_len, 0)) < 0)
            err = errno;
        else {
            sizes[i] = (int64_t)st.st_size;
            lens[i] = got;
            if (got >= live_stop && live_len) {
                int agreed = 0;
                if (live_len > sizeof again)
                    err = EAGAIN;
                for (long long t = 0; t < tries && !err; t++) {
                    ssize_t again_len = pread_retry(fd, again, live_len, (off_t)live_start);
                    if (again_len != (ssize_t)live_len) {
                        err = EAGAIN; /* (a short re-read: the Python reader keeps what it got) */
                        break;
                    }
                    agreed = memcmp(again, head + live_start, live_len) == 0;
                    memcpy(head + live_start, again, live_len);
                    if (agreed)
                        break;
                }
            }
        }
        if (err) {
            close(fd);
            fds[i] = -1;
            errs[i] = err;
        }
    }
    Py_END_ALLOW_THREADS
done:
    if (paths != NULL) {
        for (Py_ssize_t j = 0; j < k; j++)
            Py_DECREF(paths[j]);
        PyMem_Free(paths);
    }
    while (got_buffers-- > 0)
        PyBuffer_Release(views[got_buffers]);
    Py_DECREF(seq);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/*
 * The tail reader's last pass (ring_io.read_runs): runs of bytes of open files into one buffer, run j being
 * lengths[j] bytes of fds[j] at offsets[j] into dest at at[j]; the kernel asked for every run first. One pread a
 * run (a short one leaves the rest of the run as it was: zeros, an empty slot); errs[j] its errno or 0.
 */
static PyObject *read_runs(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer b[6];
    Py_ssize_t m, got_buffers = 0;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "read_runs(fds, offsets, lengths, dest, at, errs)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &b[0], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    got_buffers = 1;
    m = b[0].len / 4;
    if (b[0].itemsize != 4 || b[0].len != m * 4) {
        PyErr_SetString(PyExc_ValueError, "fds must hold int32 items");
        goto done;
    }
    static const Py_ssize_t widths[6] = {4, 8, 8, 1, 8, 4};
    static const char *names[6] = {"fds", "offsets", "lengths", "dest", "at", "errs"};
    for (; got_buffers < 6; got_buffers++) {
        Py_ssize_t i = got_buffers;
        if (i == 3) { /* dest: any length */
            if (PyObject_GetBuffer(args[3], &b[3], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            continue;
        }
        if (i == 5) {
            if (writable_items(args[5], &b[5], m, 4, names[5]) < 0)
                goto done;
            continue;
        }
        if (PyObject_GetBuffer(args[i], &b[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        if (b[i].itemsize != widths[i] || b[i].len != m * widths[i]) {
            got_buffers++;
            PyErr_Format(PyExc_ValueError, "%s must hold one int64 per run", names[i]);
            goto done;
        }
    }
    const int32_t *fds = b[0].buf;
    const int64_t *offsets = b[1].buf, *lengths = b[2].buf, *at = b[4].buf;
    unsigned char *dest = b[3].buf;
    int32_t *errs = b[5].buf;
    for (Py_ssize_t j = 0; j < m; j++)
        if (lengths[j] < 0 || offsets[j] < 0 || at[j] < 0 || at[j] > b[3].len || lengths[j] > b[3].len - at[j]) {
            PyErr_SetString(PyExc_ValueError, "a run lies outside dest, or has a negative offset or length");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
#ifdef POSIX_FADV_WILLNEED
    for (Py_ssize_t j = 0; j < m; j++)
        (void)posix_fadvise(fds[j], (off_t)offsets[j], (off_t)lengths[j], POSIX_FADV_WILLNEED);
#endif
    for (Py_ssize_t j = 0; j < m; j++)
        errs[j] = pread_retry(fds[j], dest + at[j], (size_t)lengths[j], (off_t)offsets[j]) < 0 ? errno : 0;
    Py_END_ALLOW_THREADS
done:
    while (got_buffers-- > 0)
        PyBuffer_Release(&b[got_buffers]);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/*
 * The loader's reads of many small files (ring_io.read_files): open each (the caller's flags) and ask the kernel
 * for it, then read each whole; a list with the bytes of each file, or for a file to be read the caller's way an
 * int: its errno (open failed), EINVAL (not a regular file) or EFBIG (more than `limit` bytes).
 */
static PyObject *read_files(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *out = NULL, **paths = NULL;
    long long flags, limit;
    Py_ssize_t n, k = 0;
    int *fds = NULL, *errs = NULL;
    char **bufs = NULL;
    Py_ssize_t *lens = NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_files(paths, flags, limit)");
        return NULL;
    }
    if (arg_int(args, 1, INT_MIN, INT_MAX, &flags) < 0 || arg_int(args, 2, 0, (long long)1 << 40, &limit) < 0)
        return NULL;
    seq = PySequence_Fast(args[0], "paths must be a sequence");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    paths = PyMem_Calloc(n ? n : 1, sizeof *paths);
    fds = PyMem_Calloc(n ? n : 1, sizeof *fds);
    errs = PyMem_Calloc(n ? n : 1, sizeof *errs);
    bufs = PyMem_Calloc(n ? n : 1, sizeof *bufs);
    lens = PyMem_Calloc(n ? n : 1, sizeof *lens);
    if (paths == NULL || fds == NULL || errs == NULL || bufs == NULL || lens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; k < n; k++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, k), &paths[k]))
            goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        int fd;
        do
            fd = open(PyBytes_AS_STRING(paths[i]), (int)flags);
        while (fd < 0 && errno == EINTR);
        fds[i] = fd;
        if (fd < 0) {
            errs[i] = errno;
            continue;
        }
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            errs[i] = EINVAL;
            close(fd);
            fds[i] = -1;
            continue;
        }
        lens[i] = (Py_ssize_t)st.st_size; /* (a guess: the file may grow while it is read) */
#ifdef POSIX_FADV_WILLNEED
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
#endif
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t cap, got = 0;
        if (fds[i] < 0)
            continue;
        cap = (size_t)(lens[i] < limit ? lens[i] : limit) + 1; /* one byte past the limit tells a larger file */
        bufs[i] = malloc(cap);
        if (bufs[i] == NULL)
            errs[i] = ENOMEM;
        while (bufs[i] != NULL && !errs[i]) {
            ssize_t r;
            if (got == cap) {
                char *grown;
                if (cap > (size_t)limit) {
                    errs[i] = EFBIG;
                    break;
                }
                cap = cap * 2 > (size_t)limit + 1 ? (size_t)limit + 1 : cap * 2;
                grown = realloc(bufs[i], cap);
                if (grown == NULL) {
                    errs[i] = ENOMEM;
                    break;
                }
                bufs[i] = grown;
            }
            r = read(fds[i], bufs[i] + got, cap - got);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                errs[i] = errno;
            else if (r == 0)
                break;
            else
                got += (size_t)r;
        }
        if (!errs[i] && got > (size_t)limit)
            errs[i] = EFBIG;
        lens[i] = (Py_ssize_t)got;
        close(fds[i]);
        fds[i] = -1;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = errs[i] ? PyLong_FromLong(errs[i]) : PyBytes_FromStringAndSize(bufs[i], lens[i]);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
done:
    for (Py_ssize_t j = 0; j < k; j++)
        Py_DECREF(paths[j]);
    if (bufs != NULL)
        for (Py_ssize_t j = 0; j < n; j++)
            free(bufs[j]);
    PyMem_Free(paths);
    PyMem_Free(fds);
    PyMem_Free(errs);
    PyMem_Free(bufs);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return out;
}

/*
 * The loader's hot path: whole records into columns (load/rings.py, RecordColumns). Rows at..at+n of each
 * column get the fields of the n records of `raw`, in the order of SPLIT_COLUMNS; seq, group_seq and nbytes
 * may be 4-byte columns (int32), peer a 2-byte one (int16) and op a 1-byte one (uint8); the others have their
 * field's size. Returns the narrowed columns that a value does not fit (bit 0 seq, 1 group_seq, 2 nbytes,
 * 3 peer, 4 op; their rows are then not all written): 0 when done.
 */
#define SPLIT_COLUMNS 11
static const struct {
    unsigned offset, size; /* in the record */
    int narrow_bit;        /* -1: never narrowed; else the column may also have half the field's size */
} split_fields[SPLIT_COLUMNS] = {
    {0, 8, 0},  /* seq */
    {8, 8, 1},  /* group_seq */
    {16, 8, -1}, /* t_enqueue */
    {48, 8, -1}, /* t_complete */
    {24, 8, 2},  /* nbytes */
    {32, 4, -1}, /* group_id */
    {36, 4, 3},  /* peer */
    {40, 2, 4},  /* op */
    {42, 1, -1}, /* dtype */
    {43, 1, -1}, /* flags */
    {56, 1, -1}, /* state */
};

static PyObject *split_records(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer raw, col[SPLIT_COLUMNS];
    Py_ssize_t at, n, k = 0;
    unsigned char *out[SPLIT_COLUMNS];
    int width[SPLIT_COLUMNS];
    long over = 0;
    if (nargs != 2 + SPLIT_COLUMNS) {
        PyErr_SetString(PyExc_TypeError, "split_records(raw, at, seq, group_seq, t_enqueue, t_complete, nbytes, "
                                         "group_id, peer, op, dtype, flags, state)");
        return NULL;
    }
    at = PyLong_AsSsize_t(args[1]);
    if (at == -1 && PyErr_Occurred())
        return NULL;
    if (at < 0) {
        PyErr_SetString(PyExc_ValueError, "at must be at least 0");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (raw.len % MT_RECORD_SIZE) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, "raw must hold whole 64-byte records");
        return NULL;
    }
    n = raw.len / MT_RECORD_SIZE;
    for (; k < SPLIT_COLUMNS; k++) {
        if (PyObject_GetBuffer(args[2 + k], &col[k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        width[k] = (int)col[k].itemsize;
        if (!(width[k] == (int)split_fields[k].size
              || (split_fields[k].narrow_bit >= 0 && 2 * width[k] == (int)split_fields[k].size))
            || col[k].len / width[k] < at + n) {
            PyBuffer_Release(&col[k]);
            PyErr_Format(PyExc_ValueError, "column %zd: %d-byte items or fewer than %zd rows", k, width[k], at + n);
            goto done;
        }
        out[k] = (unsigned char *)col[k].buf + (size_t)at * (size_t)width[k];
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *row = raw.buf;
    /* Straight-line per record (the widths of the narrowable columns are the same for every row). */
    for (Py_ssize_t i = 0; i < n; i++, row += MT_RECORD_SIZE) {
        for (int c = 0; c < 5; c++) { /* the 8-byte fields: seq, group_seq, t_enqueue, t_complete, nbytes */
            uint64_t v;
            memcpy(&v, row + split_fields[c].offset, 8);
            if (width[c] == 8) {
                memcpy(out[c] + 8 * i, &v, 8);
            } else {
                uint32_t low = (uint32_t)v;
                over |= (long)(v > (uint64_t)INT32_MAX) << split_fields[c].narrow_bit;
                memcpy(out[c] + 4 * i, &low, 4);
            }
        }
        memcpy(out[5] + 4 * i, row + 32, 4); /* group_id */
        if (width[6] == 4) {
            memcpy(out[6] + 4 * i, row + 36, 4); /* peer */
        } else {
            int32_t v;
            memcpy(&v, row + 36, 4);
            int16_t low = (int16_t)v;
            over |= (long)(v < INT16_MIN || v > INT16_MAX) << 3;
            memcpy(out[6] + 2 * i, &low, 2);
        }
        if (width[7] == 2) {
            memcpy(out[7] + 2 * i, row + 40, 2); /* op */
        } else {
            uint16_t v;
            memcpy(&v, row + 40, 2);
            over |= (long)(v > UINT8_MAX) << 4;
            out[7][i] = (unsigned char)v;
        }
        out[8][i] = row[42];                 /* dtype */
        out[9][i] = row[43];                 /* flags */
        out[10][i] = row[56];                /* state */
    }
    Py_END_ALLOW_THREADS
done:
    while (k-- > 0)
        PyBuffer_Release(&col[k]);
    PyBuffer_Release(&raw);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(over);
}

static PyMethodDef module_methods[] = {
    {"scan_slots", (PyCFunction)(void (*)(void))scan_slots, METH_FASTCALL,
     "scan_slots(raw, capacity, empty, head_ok, tail_ok): ring_records.validate() of a whole ring's copy "
     "(row i is slot i), its three masks written into the given one-byte-per-row buffers; returns (whole "
     "records, newest seq, first and last row of one or -1, their seqs ascend by row, every slot empty or whole)."},
    {"whole_rows", (PyCFunction)(void (*)(void))whole_rows, METH_FASTCALL,
     "whole_rows(raw, seqs, out): ring_records.whole_records() of rows of several rings, row i checked against "
     "record seqs[i] (uint64), written into out, one byte per row."},
    {"open_heads", (PyCFunction)(void (*)(void))open_heads, METH_FASTCALL,
     "open_heads(paths, flags, header_len, live_start, live_stop, tries, fds, sizes, lens, heads, errs): open ring "
     "files and read their headers (ring_io.open_heads)."},
    {"read_runs", (PyCFunction)(void (*)(void))read_runs, METH_FASTCALL,
     "read_runs(fds, offsets, lengths, dest, at, errs): runs of bytes of open files into dest (ring_io.read_runs)."},
    {"read_files", (PyCFunction)(void (*)(void))read_files, METH_FASTCALL,
     "read_files(paths, flags, limit): the bytes of each file, or an int for one to be read the caller's way "
     "(ring_io.read_files)."},
    {"split_records", (PyCFunction)(void (*)(void))split_records, METH_FASTCALL,
     "split_records(raw, at, seq, group_seq, t_enqueue, t_complete, nbytes, group_id, peer, op, dtype, flags, "
     "state): the fields of raw's records into rows at.. of the columns; the bits of the 4-byte columns among "
     "seq, group_seq, nbytes (1, 2, 4) that a value does not fit, 0 when all were written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ringfast",
    .m_doc = "C hot paths of the MegaTrace ring writer and reader.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__ringfast(void)
{
    PyObject *m;
    if (PyType_Ready(&FastRingType) < 0)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastRingType);
    if (PyModule_AddObject(m, "FastRing", (PyObject *)&FastRingType) < 0) {
        Py_DECREF(&FastRingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
