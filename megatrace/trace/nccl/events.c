/*
 * Completion of NCCL calls from CUDA events: the call path records a pre-created event on the
 * call's stream (no allocation, no lock: a slot is taken with one compare-and-swap), and one
 * helper thread polls the outstanding events and rewrites the record's tail when an event has
 * fired. The CUDA runtime is used only if the process already loaded it: the interposer never
 * initialises CUDA itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tracer.h"

#define MAX_DEVICES 16
#define SLOTS_PER_DEVICE 512
#define POLL_BUSY_NS 50000      /* between polls while events are outstanding: the t_complete resolution */
#define POLL_IDLE_NS 2000000    /* between polls while none are */

enum { SLOT_FREE = 0, SLOT_TAKEN = 1, SLOT_PENDING = 2 };
enum { CUDA_SUCCESS = 0, CUDA_NOT_READY = 600, CUDA_EVENT_DISABLE_TIMING = 2, CUDA_STREAM_NON_BLOCKING = 1,
       CUDA_H2D = 1, CUDA_D2H = 2 };

struct slot {
    void *event;
    int state; /* atomic */
    uint64_t off, seq;
};

static struct {
    int (*EventCreateWithFlags)(void **, unsigned);
    int (*EventRecord)(void *, mt_cudaStream_t);
    int (*EventQuery)(void *);
    int (*GetDevice)(int *);
    int (*SetDevice)(int);
    int (*Malloc)(void **, size_t);
    int (*Free)(void *);
    int (*Memcpy)(void *, const void *, size_t, int);
    int (*StreamCreateWithFlags)(mt_cudaStream_t *, unsigned);
    int (*StreamSynchronize)(mt_cudaStream_t);
    int (*StreamDestroy)(mt_cudaStream_t);
} cuda;

static struct slot slots[MAX_DEVICES][SLOTS_PER_DEVICE];
static int prepared[MAX_DEVICES];
static uint32_t cursor[MAX_DEVICES]; /* atomic */
static int pending;                   /* atomic: events outstanding */
static int poller_started;

static void *find(void *lib, const char *name)
{
    void *p = lib ? dlsym(lib, name) : NULL;
    return p ? p : dlsym(RTLD_DEFAULT, name);
}

int mt_events_available(void)
{
    static const char *const libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so",
                                       NULL};
    void *lib = NULL;
    for (int i = 0; libs[i] && !lib; i++)
        lib = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD); /* only a runtime the process already loaded */
#define GET(f, n) cuda.f = (__typeof__(cuda.f))find(lib, n)
    GET(EventCreateWithFlags, "cudaEventCreateWithFlags");
    GET(EventRecord, "cudaEventRecord");
    GET(EventQuery, "cudaEventQuery");
    GET(GetDevice, "cudaGetDevice");
    GET(SetDevice, "cudaSetDevice");
    GET(Malloc, "cudaMalloc");
    GET(Free, "cudaFree");
    GET(Memcpy, "cudaMemcpy");
    GET(StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    GET(StreamSynchronize, "cudaStreamSynchronize");
    GET(StreamDestroy, "cudaStreamDestroy");
#undef GET
    return cuda.EventCreateWithFlags && cuda.EventRecord && cuda.EventQuery && cuda.GetDevice && cuda.SetDevice &&
           cuda.Malloc && cuda.Free && cuda.Memcpy && cuda.StreamCreateWithFlags && cuda.StreamSynchronize &&
           cuda.StreamDestroy;
}

static void sleep_ns(long ns)
{
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

static void *poll_events(void *arg)
{
    (void)arg;
    for (;;) {
        if (__atomic_load_n(&pending, __ATOMIC_ACQUIRE) == 0) {
            sleep_ns(POLL_IDLE_NS);
            continue;
        }
        for (int d = 0; d < MAX_DEVICES; d++) {
            if (!__atomic_load_n(&prepared[d], __ATOMIC_ACQUIRE))
                continue;
            for (int i = 0; i < SLOTS_PER_DEVICE; i++) {
                struct slot *s = &slots[d][i];
                int rc;
                if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != SLOT_PENDING)
                    continue;
                rc = cuda.EventQuery(s->event);
                if (rc == CUDA_NOT_READY)
                    continue;
                /* 6.1 complete(): only if the ring has not wrapped past the record */
                if (__atomic_load_n((uint64_t *)(mt_g.base + s->off), __ATOMIC_ACQUIRE) == s->seq)
                    mt_record_complete(mt_g.base, s->off, s->seq, rc == CUDA_SUCCESS ? MT_STATE_COMPLETED
                                                                                     : MT_STATE_FAILED);
                __atomic_store_n(&s->state, SLOT_FREE, __ATOMIC_RELEASE);
                __atomic_fetch_sub(&pending, 1, __ATOMIC_RELEASE);
            }
        }
        sleep_ns(POLL_BUSY_NS);
    }
    return NULL;
}

/* Cold path (communicator creation): events for `device`, created with that device current. */
int mt_events_prepare(int device)
{
    int current = -1;
    if (device < 0 || device >= MAX_DEVICES)
        return -1;
    if (prepared[device])
        return 0;
    if (cuda.GetDevice(&current) != CUDA_SUCCESS)
        return -1;
    if (current != device && cuda.SetDevice(device) != CUDA_SUCCESS)
        return -1;
    for (int i = 0; i < SLOTS_PER_DEVICE; i++) {
        if (cuda.EventCreateWithFlags(&slots[device][i].event, CUDA_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
            if (current != device)
                cuda.SetDevice(current);
            return -1; /* the events created so far are kept for a later attempt */
        }
    }
    if (current != device)
        cuda.SetDevice(current);
    __atomic_store_n(&prepared[device], 1, __ATOMIC_RELEASE);
    if (!poller_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, poll_events, NULL) == 0)
            poller_started = 1;
        pthread_attr_destroy(&attr);
        if (!poller_started)
            return -1;
    }
    return 0;
}

/* Call path: a free slot of `device` (one CAS, a few probes at most), or -1. */
int mt_event_acquire(int device)
{
    if (device < 0 || device >= MAX_DEVICES || !__atomic_load_n(&prepared[device], __ATOMIC_ACQUIRE))
        return -1;
    for (int probe = 0; probe < 4; probe++) {
        uint32_t i = __atomic_fetch_add(&cursor[device], 1, __ATOMIC_RELAXED) % SLOTS_PER_DEVICE;
        int expect = SLOT_FREE;
        if (__atomic_compare_exchange_n(&slots[device][i].state, &expect, SLOT_TAKEN, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return device * SLOTS_PER_DEVICE + (int)i;
    }
    return -1;
}

void mt_event_release(int slot)
{
    __atomic_store_n(&slots[slot / SLOTS_PER_DEVICE][slot % SLOTS_PER_DEVICE].state, SLOT_FREE, __ATOMIC_RELEASE);
}

int mt_event_record(int slot, mt_cudaStream_t stream, uint64_t off, uint64_t seq)
{
    struct slot *s = &slots[slot / SLOTS_PER_DEVICE][slot % SLOTS_PER_DEVICE];
    if (cuda.EventRecord(s->event, stream) != CUDA_SUCCESS) {
        mt_event_release(slot);
        return -1;
    }
    s->off = off;
    s->seq = seq;
    __atomic_fetch_add(&pending, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&s->state, SLOT_PENDING, __ATOMIC_RELEASE);
    return 0;
}

/* Cold path: all-gather one int per member through device memory on a private stream. */
int mt_exchange_device(ncclComm_t comm, int device, int nranks, int rank, int global, int *out)
{
    int current = -1, rc = -1;
    void *buf = NULL;
    mt_cudaStream_t stream = NULL;
    size_t bytes = (size_t)nranks * sizeof(int);
    if (device < 0 || cuda.GetDevice(&current) != CUDA_SUCCESS)
        return -1;
    if (current != device && cuda.SetDevice(device) != CUDA_SUCCESS)
        return -1;
    if (cuda.Malloc(&buf, bytes) == CUDA_SUCCESS &&
        cuda.StreamCreateWithFlags(&stream, CUDA_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
        cuda.Memcpy((char *)buf + (size_t)rank * sizeof(int), &global, sizeof(int), CUDA_H2D) == CUDA_SUCCESS &&
        mt_real.AllGather((char *)buf + (size_t)rank * sizeof(int), buf, 1, ncclInt32, comm, stream) == ncclSuccess &&
        cuda.StreamSynchronize(stream) == CUDA_SUCCESS &&
        cuda.Memcpy(out, buf, bytes, CUDA_D2H) == CUDA_SUCCESS)
        rc = 0;
    if (stream)
        cuda.StreamDestroy(stream);
    if (buf)
        cuda.Free(buf);
    if (current != device)
        cuda.SetDevice(current);
    return rc;
}
