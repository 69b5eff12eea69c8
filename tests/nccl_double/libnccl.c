/*
 * A test double of libnccl.so.2: the NCCL entry points the MegaTrace interposer wraps,
 * implemented over MPI on host buffers, so that the interposer runs under the real dynamic
 * linker with no GPU and no NCCL.
 *
 * Semantics kept: communicators (from a unique id, a split), per-call blocking outside a group,
 * ncclGroupStart/End batching (calls inside a group start as non-blocking MPI operations and
 * are waited for at the outermost ncclGroupEnd, so paired send/recv in a group do not deadlock).
 * Not kept: reduction arithmetic on 16-bit and 8-bit floating types (summed as integers),
 * ncclAvg (summed), streams (ignored), multi-device ncclCommInitAll (ndev 1 only); a reduce-scatter
 * inside a group completes at once.
 *
 * Restriction: ncclCommInitRank splits MPI_COMM_WORLD, so every process must call it the same
 * number of times in the same order (as a 3D-parallel job creating its TP, PP and DP
 * communicators does).
 *
 * `megatrace_nccl_host_memory` tells the interposer that this library takes host memory and has
 * finished every call (every group) when it returns.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl_api.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT const int megatrace_nccl_host_memory = 1;

struct ncclComm {
    MPI_Comm mpi;
    int nranks, rank;
};

#define MAX_REQ 4096
static int group_depth;
static MPI_Request reqs[MAX_REQ];
static int nreq;

static MPI_Datatype mpi_type(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat16: case ncclBfloat16: return MPI_UINT16_T;
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    case ncclFloat8e4m3: case ncclFloat8e5m2: return MPI_UINT8_T;
    }
    return MPI_DATATYPE_NULL;
}

static size_t type_size(ncclDataType_t t)
{
    static const size_t s[12] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return (unsigned)t < 12 ? s[t] : 0;
}

static MPI_Op mpi_op(ncclRedOp_t op)
{
    switch (op) {
    case ncclProd: return MPI_PROD;
    case ncclMax: return MPI_MAX;
    case ncclMin: return MPI_MIN;
    default: return MPI_SUM;
    }
}

/* MPI started by the double (a host program without MPI of its own) ends with the process: a real NCCL leaves
 * nothing behind, and MPICH removes its start-up segment in /dev/shm only in MPI_Finalize. */
static void finalize_mpi(void)
{
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down)
        MPI_Finalize();
}

static void ensure_mpi(void)
{
    int up = 0;
    MPI_Initialized(&up);
    if (!up) {
        MPI_Init(NULL, NULL);
        atexit(finalize_mpi);
    }
}

/* Outside a group the call completes now; inside it, at the outermost ncclGroupEnd. */
static ncclResult_t issue(int rc, MPI_Request *req)
{
    if (rc != MPI_SUCCESS)
        return ncclSystemError;
    if (group_depth == 0)
        return MPI_Wait(req, MPI_STATUS_IGNORE) == MPI_SUCCESS ? ncclSuccess : ncclSystemError;
    if (nreq == MAX_REQ)
        return ncclInvalidUsage;
    reqs[nreq++] = *req;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    static unsigned counter;
    int world = 0;
    uint64_t r[2];
    FILE *f = fopen("/dev/urandom", "rb");
    ensure_mpi();
    MPI_Comm_rank(MPI_COMM_WORLD, &world);
    memset(id, 0, sizeof *id);
    if (!f || fread(r, sizeof r, 1, f) != 1) {
        r[0] = (uint64_t)getpid() * 2654435761u;
        r[1] = (uint64_t)counter;
    }
    if (f)
        fclose(f);
    memcpy(id->internal, r, sizeof r);
    memcpy(id->internal + 16, &world, sizeof world);
    counter++;
    memcpy(id->internal + 20, &counter, sizeof counter);
    return ncclSuccess;
}

static ncclResult_t make_comm(ncclComm_t *comm, MPI_Comm parent, int color, int key, int want_ranks, int want_rank)
{
    MPI_Comm sub;
    struct ncclComm *c;
    if (MPI_Comm_split(parent, color, key, &sub) != MPI_SUCCESS)
        return ncclSystemError;
    if (sub == MPI_COMM_NULL) {
        *comm = NULL;
        return ncclSuccess;
    }
    c = calloc(1, sizeof *c);
    if (!c)
        return ncclSystemError;
    c->mpi = sub;
    MPI_Comm_size(sub, &c->nranks);
    MPI_Comm_rank(sub, &c->rank);
    if ((want_ranks >= 0 && c->nranks != want_ranks) || (want_rank >= 0 && c->rank != want_rank)) {
        fprintf(stderr, "libnccl double: communicator has %d ranks (rank %d), expected %d (rank %d)\n",
                c->nranks, c->rank, want_ranks, want_rank);
        MPI_Comm_free(&sub);
        free(c);
        return ncclInvalidUsage;
    }
    *comm = c;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    uint32_t color = 2166136261u;
    ensure_mpi();
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++)
        color = (color ^ (unsigned char)id.internal[i]) * 16777619u; /* FNV-1a of the id */
    return make_comm(comm, MPI_COMM_WORLD, (int)(color & 0x3fffffff), rank, nranks, rank);
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t *config)
{
    (void)config;
    return ncclCommInitRank(comm, nranks, id, rank);
}

EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
    (void)devlist;
    ensure_mpi();
    if (ndev != 1)
        return ncclInvalidUsage;
    return make_comm(&comms[0], MPI_COMM_SELF, 0, 0, 1, 0);
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config)
{
    (void)config;
    return make_comm(newcomm, comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, -1, -1);
}

static ncclResult_t free_comm(ncclComm_t comm)
{
    if (!comm)
        return ncclInvalidArgument;
    MPI_Comm_free(&comm->mpi);
    free(comm);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) { return free_comm(comm); }
EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) { return free_comm(comm); }

EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    *count = comm->nranks;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    *rank = comm->rank;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device)
{
    (void)comm;
    *device = 0;
    return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t result)
{
    return result == ncclSuccess ? "no error" : "libnccl double: error";
}

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    const void *s = sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff;
    return issue(MPI_Iallreduce(s, recvbuff, (int)count, mpi_type(datatype), mpi_op(op), comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    if (comm->rank == root && sendbuff != recvbuff)
        memcpy(recvbuff, sendbuff, count * type_size(datatype));
    return issue(MPI_Ibcast(recvbuff, (int)count, mpi_type(datatype), root, comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                              mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    return issue(MPI_Ibcast(buff, (int)count, mpi_type(datatype), root, comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    const void *s = (comm->rank == root && sendbuff == recvbuff) ? MPI_IN_PLACE : sendbuff;
    return issue(MPI_Ireduce(s, recvbuff, (int)count, mpi_type(datatype), mpi_op(op), root, comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    const void *s = sendbuff == (const char *)recvbuff + (size_t)comm->rank * sendcount * type_size(datatype)
                        ? MPI_IN_PLACE : sendbuff;
    return issue(MPI_Iallgather(s, (int)sendcount, mpi_type(datatype), recvbuff, (int)sendcount,
                                mpi_type(datatype), comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      mt_cudaStream_t stream)
{
    /* Into a scratch buffer, completed at once (also inside a group): NCCL's in-place form
     * (recvbuff inside sendbuff) has no MPI_IN_PLACE equivalent. */
    size_t bytes = recvcount * type_size(datatype);
    void *tmp = malloc(bytes ? bytes : 1);
    int rc;
    (void)stream;
    if (!tmp)
        return ncclSystemError;
    rc = MPI_Reduce_scatter_block(sendbuff, tmp, (int)recvcount, mpi_type(datatype), mpi_op(op), comm->mpi);
    memcpy(recvbuff, tmp, bytes);
    free(tmp);
    return rc == MPI_SUCCESS ? ncclSuccess : ncclSystemError;
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    return issue(MPI_Isend(sendbuff, (int)count, mpi_type(datatype), peer, 77, comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             mt_cudaStream_t stream)
{
    MPI_Request r;
    (void)stream;
    return issue(MPI_Irecv(recvbuff, (int)count, mpi_type(datatype), peer, 77, comm->mpi, &r), &r);
}

EXPORT ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupEnd(void)
{
    int rc;
    if (group_depth == 0)
        return ncclInvalidUsage;
    if (--group_depth > 0)
        return ncclSuccess;
    rc = MPI_Waitall(nreq, reqs, MPI_STATUSES_IGNORE);
    nreq = 0;
    return rc == MPI_SUCCESS ? ncclSuccess : ncclSystemError;
}
