/*
 * A test double of the CUDA runtime (libcudart.so.12) with just the calls the NCCL interposer
 * makes, on host memory: an event recorded on a stream "fires" MT_FAKE_EVENT_DELAY_US
 * microseconds later (default 2000), so the interposer's helper thread must poll it. Lets the
 * interposer's CUDA-event completion path run under the real dynamic linker without a GPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

enum { SUCCESS = 0, INVALID_VALUE = 1, NOT_READY = 600 };

struct fake_event {
    int64_t fires_at; /* atomic; 0: never recorded */
};

static int device;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static int64_t delay_ns(void)
{
    const char *v = getenv("MT_FAKE_EVENT_DELAY_US");
    return (v ? atoll(v) : 2000) * 1000;
}

EXPORT int cudaEventCreateWithFlags(void **event, unsigned flags)
{
    (void)flags;
    *event = calloc(1, sizeof(struct fake_event));
    return *event ? SUCCESS : INVALID_VALUE;
}

EXPORT int cudaEventRecord(void *event, void *stream)
{
    (void)stream;
    __atomic_store_n(&((struct fake_event *)event)->fires_at, now_ns() + delay_ns(), __ATOMIC_RELEASE);
    return SUCCESS;
}

EXPORT int cudaEventQuery(void *event)
{
    int64_t t = __atomic_load_n(&((struct fake_event *)event)->fires_at, __ATOMIC_ACQUIRE);
    return t && now_ns() >= t ? SUCCESS : NOT_READY;
}

EXPORT int cudaGetDevice(int *d)
{
    *d = device;
    return SUCCESS;
}

EXPORT int cudaSetDevice(int d)
{
    device = d;
    return SUCCESS;
}

EXPORT int cudaMalloc(void **p, size_t n)
{
    *p = malloc(n ? n : 1);
    return *p ? SUCCESS : INVALID_VALUE;
}

EXPORT int cudaFree(void *p)
{
    free(p);
    return SUCCESS;
}

EXPORT int cudaMemcpy(void *dst, const void *src, size_t n, int kind)
{
    (void)kind;
    memcpy(dst, src, n);
    return SUCCESS;
}

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned flags)
{
    (void)flags;
    *stream = malloc(1);
    return *stream ? SUCCESS : INVALID_VALUE;
}

EXPORT int cudaStreamSynchronize(void *stream)
{
    (void)stream;
    return SUCCESS;
}

EXPORT int cudaStreamDestroy(void *stream)
{
    free(stream);
    return SUCCESS;
}
