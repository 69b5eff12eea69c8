/*
 * MegaTrace ring format v1: writing one record (see docs/trace-format.md).
 *
 * Header-only and dependency-free so that every C writer (the CPython fast
 * path, the NCCL interposer) produces the very bytes megatrace/trace/
 * ring_format.py defines. Little-endian hosts only (x86-64, aarch64).
 */
#ifndef MEGATRACE_RING_RECORD_H
#define MEGATRACE_RING_RECORD_H

#include <stdint.h>
#include <string.h>
#include <time.h>

#define MT_HEADER_SIZE 4096u
#define MT_RECORD_SIZE 64u
#define MT_WRITE_COUNTER_OFFSET 256u
#define MT_HEAD_LEN 44u
#define MT_TAIL_OFFSET 48u
#define MT_TAIL_PRIME 268435399ull
#define MT_STATE_ENQUEUED 1u
#define MT_STATE_COMPLETED 2u

static inline int64_t mt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static inline uint32_t mt_adler32(const unsigned char *p, size_t n)
{
    /* n <= 44: no intermediate reduction needed. B as a weighted sum (byte i counts n - i times) rather than a
     * running one: no chain of dependent additions, and a record head's first 32 bytes are a loop of fixed
     * length, which the compiler vectorises (at -O3 the scan of a ring's slots takes two thirds of the time). */
    uint32_t a = 1, b = (uint32_t)n;
    size_t i = 0;
    if (n == MT_HEAD_LEN)
        for (; i < 32; i++) {
            a += p[i];
            b += (uint32_t)(MT_HEAD_LEN - i) * p[i];
        }
    for (; i < n; i++) {
        a += p[i];
        b += (uint32_t)(n - i) * p[i];
    }
    return ((b % 65521u) << 16) | (a % 65521u);
}

static inline uint32_t mt_tail_check(int64_t t_complete, uint32_t state, uint64_t seq)
{
    /* (t_complete | state << 64 | (seq mod 2**32) << 96) mod P, word by word: each 32-bit word times 2**(32 k)
     * mod P (P below 2**28) is below 2**60, four such add up below 2**62, and one 64-bit remainder by a constant
     * is a multiplication (a 128-bit one is a library call). */
    const uint64_t r1 = (1ull << 32) % MT_TAIL_PRIME, r2 = r1 * r1 % MT_TAIL_PRIME, r3 = r2 * r1 % MT_TAIL_PRIME;
    uint64_t t = (uint64_t)t_complete;
    uint64_t x = (t & 0xffffffffu) + (t >> 32) * r1 + (uint64_t)state * r2 + (seq & 0xffffffffu) * r3;
    return (uint32_t)(x % MT_TAIL_PRIME);
}

/* Raise the header's write counter to `seq`. Several threads may commit records at once (the
 * dispatcher hook runs on backend and autograd threads): the counter only ever moves forward. */
static inline void mt_counter_raise(uint64_t *counter, uint64_t seq)
{
    uint64_t cur = __atomic_load_n(counter, __ATOMIC_RELAXED);
    while (cur < seq && !__atomic_compare_exchange_n(counter, &cur, seq, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        ;
}

/* Write the record for `seq` into its slot; returns the slot's byte offset. */
static inline uint64_t mt_record_begin(unsigned char *base, uint64_t capacity, uint64_t seq,
                                       uint64_t group_seq, uint64_t nbytes, uint32_t group_id,
                                       int32_t peer, uint16_t op, uint8_t dtype, uint8_t flags)
{
    uint64_t off = MT_HEADER_SIZE + ((seq - 1) % capacity) * MT_RECORD_SIZE;
    unsigned char rec[MT_RECORD_SIZE];
    int64_t t = mt_now_ns(), zero = 0;
    uint32_t check, tail;
    memcpy(rec + 0, &seq, 8);
    memcpy(rec + 8, &group_seq, 8);
    memcpy(rec + 16, &t, 8);
    memcpy(rec + 24, &nbytes, 8);
    memcpy(rec + 32, &group_id, 4);
    memcpy(rec + 36, &peer, 4);
    memcpy(rec + 40, &op, 2);
    rec[42] = dtype;
    rec[43] = flags;
    check = mt_adler32(rec, MT_HEAD_LEN);
    memcpy(rec + 44, &check, 4);
    memcpy(rec + 48, &zero, 8);
    rec[56] = MT_STATE_ENQUEUED;
    rec[57] = rec[58] = rec[59] = 0;
    tail = mt_tail_check(0, MT_STATE_ENQUEUED, seq);
    memcpy(rec + 60, &tail, 4);
    memcpy(base + off, rec, MT_RECORD_SIZE);
    mt_counter_raise((uint64_t *)(base + MT_WRITE_COUNTER_OFFSET), seq);
    return off;
}

/* Rewrite the 16-byte tail of the record at `off` (which must still hold `seq`). */
static inline void mt_record_complete(unsigned char *base, uint64_t off, uint64_t seq, uint32_t state)
{
    unsigned char tail[16];
    int64_t t = mt_now_ns();
    uint32_t check = mt_tail_check(t, state, seq);
    memcpy(tail, &t, 8);
    tail[8] = (unsigned char)state;
    tail[9] = tail[10] = tail[11] = 0;
    memcpy(tail + 12, &check, 4);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(base + off + MT_TAIL_OFFSET, tail, 16);
}

#endif
