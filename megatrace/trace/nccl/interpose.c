/*
 * libmegatrace_nccl.so: an LD_PRELOAD interposer of the public NCCL API that writes every
 * collective and point-to-point call into this rank's MegaTrace ring (docs/trace-format.md,
 * docs/nccl-interposer.md). Only the nccl* entry points below are exported.
 *
 * Per call: one table lookup (lock-free), two atomic increments (the rank's and the
 * communicator's sequence), one 64-byte record written into the mapping, and a tail rewrite
 * once completion is known. No lock, no allocation. With MEGATRACE_ENABLE unset every call
 * goes straight to NCCL after one branch.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tracer.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_PENDING 256 /* calls of one ncclGroupStart/End per thread whose completion is tracked */

struct pend {
    uint64_t off, seq;
    int slot;
    mt_cudaStream_t stream;
};

/* Per thread: NCCL's group depth is per thread too. */
static __thread struct {
    int depth;   /* ncclGroupStart nesting */
    int inside;  /* inside a real NCCL call: NCCL calling its own public API is not traced twice */
    int npend;
    struct pend p[MAX_PENDING];
} T;

struct call {
    uint64_t off, seq;
    int slot;
    uint8_t flags;
};

/* NCCL data type -> (element size, ring dtype code) */
static const uint8_t dt_size[12] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
static const uint8_t dt_code[12] = {5, 6, 8, 0, 9, 0, 2, 1, 4, 3, 11, 12};

static inline uint64_t nbytes_of(size_t count, ncclDataType_t dt)
{
    return (unsigned)dt < 12 ? (uint64_t)count * dt_size[dt] : 0;
}

static inline int32_t global_of(const struct mt_comm *c, int peer)
{
    if (peer < 0 || peer >= c->nranks)
        return -1;
    return c->members ? c->members[peer] : -1;
}

static inline void complete(uint64_t off, uint64_t seq, uint32_t state)
{
    if (__atomic_load_n((uint64_t *)(mt_g.base + off), __ATOMIC_RELAXED) == seq) /* not wrapped past */
        mt_record_complete(mt_g.base, off, seq, state);
}

static inline void enter(struct call *k, const struct mt_comm *c, uint16_t op, uint64_t group_seq, uint64_t nbytes,
                         int32_t peer, ncclDataType_t dt)
{
    uint8_t flags = T.depth > 0 ? MT_FLAG_BATCHED : 0;
    int tracked = T.depth == 0 || T.npend < MAX_PENDING;
    k->slot = -1;
    if (mt_g.completion == MT_COMPLETE_RETURN && tracked) {
        /* completed when the call (or its group) returns */
    } else if (mt_g.completion == MT_COMPLETE_EVENT && tracked && (k->slot = mt_event_acquire(c->device)) >= 0) {
        flags |= MT_FLAG_DEVICE;
    } else {
        flags |= MT_FLAG_NO_COMPLETION;
    }
    k->flags = flags;
    k->seq = __atomic_add_fetch(&mt_g.next_seq, 1, __ATOMIC_RELAXED);
    k->off = mt_record_begin(mt_g.base, mt_g.capacity, k->seq, group_seq, nbytes, c->gid, peer, op,
                             (unsigned)dt < 12 ? dt_code[dt] : 0, flags);
    if (__builtin_expect(k->seq == mt_g.capacity + 1, 0))
        mt_log_once(MT_LOG_RING, "the ring is full after %llu records; it now wraps and overwrites the oldest "
                    "(raise MEGATRACE_RING_RECORDS to keep more)", (unsigned long long)mt_g.capacity);
}

static inline void leave(const struct call *k, ncclResult_t rc, mt_cudaStream_t stream)
{
    if (rc != ncclSuccess && rc != ncclInProgress) {
        if (k->slot >= 0)
            mt_event_release(k->slot);
        complete(k->off, k->seq, MT_STATE_FAILED);
        return;
    }
    if (k->flags & MT_FLAG_NO_COMPLETION)
        return;
    if (T.depth > 0) { /* NCCL launches the group's work at the outermost ncclGroupEnd */
        struct pend *p = &T.p[T.npend++];
        p->off = k->off;
        p->seq = k->seq;
        p->slot = k->slot;
        p->stream = stream;
        return;
    }
    if (mt_g.completion == MT_COMPLETE_RETURN)
        complete(k->off, k->seq, MT_STATE_COMPLETED);
    else if (mt_event_record(k->slot, stream, k->off, k->seq) != 0)
        complete(k->off, k->seq, MT_STATE_COMPLETED); /* enqueued fine; its end cannot be observed */
}

static inline struct mt_comm *traced(ncclComm_t comm)
{
    if (!mt_g.enabled || T.inside)
        return NULL;
    return mt_comm_find(comm);
}

static ncclResult_t missing(const char *name)
{
    static char seen;
    if (!seen) {
        seen = 1;
        fprintf(stderr, "megatrace-nccl: %s not found in the NCCL library loaded after the interposer\n", name);
    }
    return ncclInternalError;
}

#define REAL(f) (__builtin_expect(mt_real.f != NULL, 1) || (mt_resolve(), mt_real.f != NULL))

/* One traced call: `c` found, record entered, real call made with T.inside set, completion arranged. */
#define TRACE(f, c, op, group_seq, nbytes, peer, dt, stream, ...)                                              \
    do {                                                                                                     \
        struct call k_;                                                                                      \
        ncclResult_t rc_;                                                                                    \
        enter(&k_, c, op, group_seq, nbytes, peer, dt);                                                      \
        T.inside = 1;                                                                                        \
        rc_ = mt_real.f(__VA_ARGS__);                                                                        \
        T.inside = 0;                                                                                        \
        leave(&k_, rc_, stream);                                                                             \
        return rc_;                                                                                          \
    } while (0)

#define COLL_SEQ(c) __atomic_add_fetch(&(c)->coll_seq, 1, __ATOMIC_RELAXED)

/* -- collectives ---------------------------------------------------------------------------- */

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(AllReduce))
        return missing("ncclAllReduce");
    if (!(c = traced(comm)))
        return mt_real.AllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
    TRACE(AllReduce, c, MT_OP_ALL_REDUCE, COLL_SEQ(c), nbytes_of(count, datatype), -1, datatype, stream,
          sendbuff, recvbuff, count, datatype, op, comm, stream);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(Broadcast))
        return missing("ncclBroadcast");
    if (!(c = traced(comm)))
        return mt_real.Broadcast(sendbuff, recvbuff, count, datatype, root, comm, stream);
    TRACE(Broadcast, c, MT_OP_BROADCAST, COLL_SEQ(c), nbytes_of(count, datatype), global_of(c, root), datatype,
          stream, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                              mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(Bcast))
        return missing("ncclBcast");
    if (!(c = traced(comm)))
        return mt_real.Bcast(buff, count, datatype, root, comm, stream);
    TRACE(Bcast, c, MT_OP_BROADCAST, COLL_SEQ(c), nbytes_of(count, datatype), global_of(c, root), datatype,
          stream, buff, count, datatype, root, comm, stream);
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(Reduce))
        return missing("ncclReduce");
    if (!(c = traced(comm)))
        return mt_real.Reduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream);
    TRACE(Reduce, c, MT_OP_REDUCE, COLL_SEQ(c), nbytes_of(count, datatype), global_of(c, root), datatype, stream,
          sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(AllGather))
        return missing("ncclAllGather");
    if (!(c = traced(comm)))
        return mt_real.AllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream);
    TRACE(AllGather, c, MT_OP_ALL_GATHER, COLL_SEQ(c), nbytes_of(sendcount, datatype), -1, datatype, stream,
          sendbuff, recvbuff, sendcount, datatype, comm, stream);
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(ReduceScatter))
        return missing("ncclReduceScatter");
    if (!(c = traced(comm)))
        return mt_real.ReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
    TRACE(ReduceScatter, c, MT_OP_REDUCE_SCATTER, COLL_SEQ(c), nbytes_of(recvcount, datatype), -1, datatype,
          stream, sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
}

/* -- point to point: group_seq counts per (communicator, peer, direction) ---------------------- */

static inline uint64_t p2p_seq(uint64_t *counters, const struct mt_comm *c, int peer)
{
    return peer >= 0 && peer < c->nranks ? __atomic_add_fetch(&counters[peer], 1, __ATOMIC_RELAXED) : 0;
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(Send))
        return missing("ncclSend");
    if (!(c = traced(comm)))
        return mt_real.Send(sendbuff, count, datatype, peer, comm, stream);
    TRACE(Send, c, MT_OP_SEND, p2p_seq(c->send_seq, c, peer), nbytes_of(count, datatype), global_of(c, peer),
          datatype, stream, sendbuff, count, datatype, peer, comm, stream);
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             mt_cudaStream_t stream)
{
    struct mt_comm *c;
    if (!REAL(Recv))
        return missing("ncclRecv");
    if (!(c = traced(comm)))
        return mt_real.Recv(recvbuff, count, datatype, peer, comm, stream);
    TRACE(Recv, c, MT_OP_RECV, p2p_seq(c->recv_seq, c, peer), nbytes_of(count, datatype), global_of(c, peer),
          datatype, stream, recvbuff, count, datatype, peer, comm, stream);
}

/* -- groups: calls inside are flagged BATCHED and completed at the outermost ncclGroupEnd ------ */

EXPORT ncclResult_t ncclGroupStart(void)
{
    ncclResult_t rc;
    if (!REAL(GroupStart))
        return missing("ncclGroupStart");
    if (!mt_g.enabled || T.inside)
        return mt_real.GroupStart();
    rc = mt_real.GroupStart();
    if (rc == ncclSuccess)
        T.depth++;
    return rc;
}

EXPORT ncclResult_t ncclGroupEnd(void)
{
    ncclResult_t rc;
    int ok;
    if (!REAL(GroupEnd))
        return missing("ncclGroupEnd");
    if (!mt_g.enabled || T.inside)
        return mt_real.GroupEnd();
    T.inside = 1;
    rc = mt_real.GroupEnd();
    T.inside = 0;
    if (T.depth > 0)
        T.depth--;
    if (T.depth > 0 || T.npend == 0)
        return rc;
    ok = rc == ncclSuccess || rc == ncclInProgress;
    for (int i = 0; i < T.npend; i++) {
        struct pend *p = &T.p[i];
        if (!ok) {
            if (p->slot >= 0)
                mt_event_release(p->slot);
            complete(p->off, p->seq, MT_STATE_FAILED);
        } else if (mt_g.completion == MT_COMPLETE_RETURN) {
            complete(p->off, p->seq, MT_STATE_COMPLETED);
        } else if (mt_event_record(p->slot, p->stream, p->off, p->seq) != 0) {
            complete(p->off, p->seq, MT_STATE_COMPLETED);
        }
    }
    T.npend = 0;
    return rc;
}

/* -- communicators (cold path) ------------------------------------------------------------- */

/* The id every member derives alike: crc32("nccl:" + hex of the 128-byte ncclUniqueId). */
static uint32_t id_gid(const ncclUniqueId *id, char *name, size_t size)
{
    static const char hex[] = "0123456789abcdef";
    char key[5 + 2 * NCCL_UNIQUE_ID_BYTES + 1] = "nccl:";
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
        key[5 + 2 * i] = hex[(unsigned char)id->internal[i] >> 4];
        key[6 + 2 * i] = hex[(unsigned char)id->internal[i] & 15];
    }
    key[sizeof key - 1] = 0;
    snprintf(name, size, "%.21s", key); /* "nccl:" + the id's first 8 bytes */
    return mt_crc32(key, sizeof key - 1);
}

static void created(ncclComm_t *comm, ncclResult_t rc, int nranks, int rank, const ncclUniqueId *id, int exchange)
{
    char name[96];
    uint32_t gid;
    if (!mt_g.enabled || T.inside || (rc != ncclSuccess && rc != ncclInProgress) || !comm || !*comm)
        return;
    gid = id_gid(id, name, sizeof name);
    /* Learning members takes one collective: not inside a group, not on a communicator still in progress. */
    mt_comm_created(*comm, nranks, rank, gid, name, exchange && rc == ncclSuccess && T.depth == 0, 1);
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
    ncclResult_t rc;
    if (!REAL(CommInitRank))
        return missing("ncclCommInitRank");
    int outer = !T.inside;
    T.inside = 1;
    rc = mt_real.CommInitRank(comm, nranks, commId, rank);
    T.inside = !outer;
    created(comm, rc, nranks, rank, &commId, 1);
    return rc;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                           ncclConfig_t *config)
{
    ncclResult_t rc;
    if (!REAL(CommInitRankConfig))
        return missing("ncclCommInitRankConfig");
    int outer = !T.inside;
    T.inside = 1;
    rc = mt_real.CommInitRankConfig(comm, nranks, commId, rank, config);
    T.inside = !outer;
    created(comm, rc, nranks, rank, &commId, !config || config->blocking != 0);
    return rc;
}

EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
    static unsigned calls;
    ncclResult_t rc;
    if (!REAL(CommInitAll))
        return missing("ncclCommInitAll");
    int outer = !T.inside;
    T.inside = 1;
    rc = mt_real.CommInitAll(comms, ndev, devlist);
    T.inside = !outer;
    if (rc == ncclSuccess && mt_g.enabled && !T.inside && comms) {
        /* One process holds every member: the id is this process's own. */
        char host[64] = "", key[160];
        uint32_t gid;
        gethostname(host, sizeof host - 1);
        snprintf(key, sizeof key, "nccl:all:%s:%d:%u", host, (int)getpid(), calls++);
        gid = mt_crc32(key, strlen(key));
        for (int i = 0; i < ndev; i++)
            mt_comm_created(comms[i], ndev, i, gid, key, 0, 1);
    }
    return rc;
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config)
{
    struct mt_comm *parent;
    unsigned nth = 0;
    ncclResult_t rc;
    int outer;
    if (!REAL(CommSplit))
        return missing("ncclCommSplit");
    outer = !T.inside;
    parent = mt_g.enabled && outer ? mt_comm_find(comm) : NULL;
    if (parent) /* every member of the parent calls split, also those that get no communicator */
        nth = __atomic_fetch_add(&parent->splits, 1, __ATOMIC_RELAXED);
    T.inside = 1;
    rc = mt_real.CommSplit(comm, color, key, newcomm, config);
    T.inside = !outer;
    if (mt_g.enabled && outer && (rc == ncclSuccess || rc == ncclInProgress) && newcomm && *newcomm &&
        color != NCCL_SPLIT_NOCOLOR) {
        char name[96];
        int nranks = 0, rank = -1;
        snprintf(name, sizeof name, "nccl:%08x/split%u:%d", parent ? parent->gid : 0, nth, color);
        /* Without a traced parent there is no id every member agrees on: not traced, but the members
         * are still exchanged, since the other members (whose parent is traced) take part in it. */
        if (mt_real.CommCount && mt_real.CommUserRank && mt_real.CommCount(*newcomm, &nranks) == ncclSuccess &&
            mt_real.CommUserRank(*newcomm, &rank) == ncclSuccess)
            mt_comm_created(*newcomm, nranks, rank, mt_crc32(name, strlen(name)), name,
                            rc == ncclSuccess && T.depth == 0 && (!config || config->blocking != 0), parent != NULL);
    }
    return rc;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!REAL(CommDestroy))
        return missing("ncclCommDestroy");
    if (mt_g.enabled)
        mt_comm_destroyed(comm);
    return mt_real.CommDestroy(comm);
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!REAL(CommAbort))
        return missing("ncclCommAbort");
    if (mt_g.enabled)
        mt_comm_destroyed(comm);
    return mt_real.CommAbort(comm);
}
