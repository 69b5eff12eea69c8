/*
 * MegaTrace NCCL interposer: state shared by its three files.
 *
 *   interpose.c  the exported nccl* wrappers and the per-call hot path
 *   tracer.c     cold path: settings, the ring file and its meta lines, the communicator table
 *   events.c     completion from CUDA events, polled by one helper thread
 *
 * The ring and meta formats are docs/trace-format.md; records are packed by
 * ../native/ring_record.h, the same code the Python tracer's C writer uses.
 */
#ifndef MEGATRACE_NCCL_TRACER_H
#define MEGATRACE_NCCL_TRACER_H

#include <stdint.h>

#include "nccl_api.h"
#include "../native/ring_record.h"

#define MT_HIDDEN __attribute__((visibility("hidden")))

/* docs/trace-format.md, section 7 */
enum { MT_OP_ALL_REDUCE = 1, MT_OP_ALL_GATHER = 2, MT_OP_REDUCE_SCATTER = 3, MT_OP_BROADCAST = 4,
       MT_OP_REDUCE = 5, MT_OP_SEND = 8, MT_OP_RECV = 9 };
enum { MT_FLAG_ASYNC = 1, MT_FLAG_BATCHED = 2, MT_FLAG_DEVICE = 4, MT_FLAG_NO_COMPLETION = 16 };
enum { MT_STATE_FAILED = 3 };

/* How a record's completion is observed (MEGATRACE_NCCL_COMPLETION, default auto). */
enum mt_completion {
    MT_COMPLETE_NONE = 0,   /* enqueue time only: flag NO_COMPLETION */
    MT_COMPLETE_RETURN = 1, /* the library finishes each call before it returns (host-memory NCCL, test double) */
    MT_COMPLETE_EVENT = 2,  /* a CUDA event recorded on the call's stream, polled by a helper thread */
};

/* One communicator. Filled at init under the cold-path lock, then published by storing `key`. */
struct mt_comm {
    ncclComm_t key;         /* NULL: empty slot; MT_COMM_GONE: destroyed; MT_COMM_RESERVED: being filled */
    uint32_t gid;
    int nranks, rank, device;
    int *members;           /* comm rank -> global rank; NULL when unknown */
    uint64_t coll_seq;      /* atomic */
    uint64_t *send_seq;     /* per peer (comm rank), atomic */
    uint64_t *recv_seq;
    unsigned splits;        /* how many ncclCommSplit calls this communicator has seen */
    char name[96];
};
#define MT_COMM_GONE ((ncclComm_t)(uintptr_t)1)
#define MT_COMM_RESERVED ((ncclComm_t)(uintptr_t)2)
#define MT_COMM_SLOTS 4096u /* power of two */

struct mt_global {
    int enabled;            /* MEGATRACE_ENABLE and the interposer is usable */
    int completion;         /* enum mt_completion */
    int exchange;           /* learn group members with an all-gather at communicator creation */
    unsigned char *base;    /* the ring mapping; NULL: not writing */
    uint64_t capacity;
    uint64_t next_seq;      /* atomic: the last seq handed out */
    int rank, world, local_rank;
    int rank_from_env;
    int meta_fd;
    int ring_failed;
};

extern MT_HIDDEN struct mt_global mt_g;
extern MT_HIDDEN struct mt_comm mt_comms[MT_COMM_SLOTS];

/* The real NCCL entry points (dlsym RTLD_NEXT, resolved once). */
struct mt_real {
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommCount)(const ncclComm_t, int *);
    ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
    ncclResult_t (*CommCuDevice)(const ncclComm_t, int *);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*Bcast)(void *, size_t, ncclDataType_t, int, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                           mt_cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                  mt_cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, mt_cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
};
extern MT_HIDDEN struct mt_real mt_real;

/* tracer.c */
MT_HIDDEN void mt_resolve(void);
MT_HIDDEN void mt_log_once(int key, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
enum { MT_LOG_RING, MT_LOG_CAPACITY, MT_LOG_TABLE, MT_LOG_EXCHANGE, MT_LOG_EVENTS, MT_LOG_TORCH, MT_LOG_N };
/* A new communicator: learn its members (`exchange`: a collective, so every member must agree) and,
 * if `trace`, start tracing its calls. */
MT_HIDDEN void mt_comm_created(ncclComm_t comm, int nranks, int rank, uint32_t gid, const char *name, int exchange,
                               int trace);
MT_HIDDEN void mt_comm_destroyed(ncclComm_t comm);
MT_HIDDEN uint32_t mt_crc32(const void *data, size_t n);

static inline uint32_t mt_hash_ptr(const void *p)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Lock-free lookup: the table is filled at communicator creation. */
static inline struct mt_comm *mt_comm_find(ncclComm_t comm)
{
    uint32_t i = mt_hash_ptr(comm) & (MT_COMM_SLOTS - 1);
    for (uint32_t n = 0; n < MT_COMM_SLOTS; n++, i = (i + 1) & (MT_COMM_SLOTS - 1)) {
        ncclComm_t k = __atomic_load_n(&mt_comms[i].key, __ATOMIC_ACQUIRE);
        if (k == comm)
            return &mt_comms[i];
        if (k == NULL)
            return NULL;
    }
    return NULL;
}

/* events.c */
MT_HIDDEN int mt_events_available(void);         /* the CUDA runtime is loaded in this process */
MT_HIDDEN int mt_events_prepare(int device);      /* create the device's event pool (cold path); 0 ok */
MT_HIDDEN int mt_event_acquire(int device);       /* a free event slot, or -1 */
MT_HIDDEN void mt_event_release(int slot);
MT_HIDDEN int mt_event_record(int slot, mt_cudaStream_t stream, uint64_t off, uint64_t seq); /* 0 ok */
MT_HIDDEN int mt_exchange_device(ncclComm_t comm, int device, int nranks, int rank, int global, int *out);

#endif
