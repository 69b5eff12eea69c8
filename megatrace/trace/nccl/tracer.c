/*
 * Cold path of the NCCL interposer: settings, the ring file and its meta lines, the
 * communicator table. Everything here runs at library load, at communicator creation and
 * destruction, or at exit, never per collective. Nothing here may stop the traced program:
 * every failure logs one line on stderr and leaves the calls passing through untraced.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tracer.h"

MT_HIDDEN struct mt_global mt_g = {.meta_fd = -1, .rank = -1, .world = -1, .local_rank = -1};
MT_HIDDEN struct mt_comm mt_comms[MT_COMM_SLOTS];
MT_HIDDEN struct mt_real mt_real;

static pthread_mutex_t cold_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static int logged[MT_LOG_N];

#define MIN_CAPACITY 16ull
#define MAX_CAPACITY (1ull << 26)
#define DEFAULT_CAPACITY 65536ull

void mt_log_once(int key, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    int n;
    if (__atomic_exchange_n(&logged[key], 1, __ATOMIC_RELAXED))
        return;
    n = snprintf(line, sizeof line, "megatrace-nccl: ");
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(2, line, (size_t)n) < 0) { /* nothing else to do */ }
}

uint32_t mt_crc32(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return c ^ 0xffffffffu;
}

/* -- settings (the same variables and defaults as megatrace/trace/settings.py) -------------- */

static int env_true(const char *name)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    while (*v == ' ')
        v++;
    return !(*v == 0 || !strcasecmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") ||
             !strcasecmp(v, "off"));
}

static int env_int(const char *const *names, int fallback)
{
    for (; *names; names++) {
        const char *v = getenv(*names);
        char *end;
        long x;
        if (!v || !*v)
            continue;
        x = strtol(v, &end, 10);
        if (*end == 0 && x >= 0 && x < (1l << 30))
            return (int)x;
    }
    return fallback;
}

static const char *env_or(const char *a, const char *b, const char *fallback)
{
    const char *v = getenv(a);
    if (v && *v)
        return v;
    v = b ? getenv(b) : NULL;
    return v && *v ? v : fallback;
}

static uint64_t ring_capacity(void)
{
    const char *raw = getenv("MEGATRACE_RING_RECORDS");
    char *end;
    unsigned long long n, p = 1;
    if (!raw || !*raw)
        return DEFAULT_CAPACITY;
    n = strtoull(raw, &end, 10);
    if (*end || n < MIN_CAPACITY || n > MAX_CAPACITY) {
        mt_log_once(MT_LOG_RING, "MEGATRACE_RING_RECORDS=%s is not an integer in [16, 67108864]; using 65536", raw);
        return DEFAULT_CAPACITY;
    }
    while (p < n)
        p <<= 1; /* a power of two, as the Python tracer rounds it (docs/trace-format.md, "Capacity") */
    if (p != n)
        mt_log_once(MT_LOG_CAPACITY, "MEGATRACE_RING_RECORDS=%llu rounded up to %llu, a power of two", n, p);
    return p;
}

static void safe_component(const char *in, char *out, size_t size)
{
    size_t n = 0;
    for (; *in && n + 1 < size; in++) {
        char c = *in;
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                 c == '_' || c == '-';
        out[n++] = ok ? c : '_';
    }
    out[n] = 0;
    /* strip leading and trailing dots, as megatrace/names.py ring_dir_name does */
    while (n && out[n - 1] == '.')
        out[--n] = 0;
    size_t lead = strspn(out, ".");
    memmove(out, out + lead, n - lead + 1);
    if (!out[0])
        snprintf(out, size, "job");
}

static void trace_dir(char *out, size_t size, const char *job, const char *step)
{
    const char *dir = getenv("MEGATRACE_DIR");
    char name[420], safe[420];
    struct stat st;
    const char *base;
    if (dir && *dir) {
        snprintf(out, size, "%s", dir);
        return;
    }
    if (*step)
        snprintf(name, sizeof name, "%s.%s", job, step);
    else
        snprintf(name, sizeof name, "%s", job);
    safe_component(name, safe, sizeof safe);
    base = (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)) ? "/dev/shm" : env_or("TMPDIR", NULL, "/tmp");
    snprintf(out, size, "%s/megatrace-%u/%s", base, (unsigned)geteuid(), safe); /* per user, as settings.py */
}

/* mkdir -p, mode 0700 for every directory it creates. */
static int mkdirs(char *path)
{
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(path, 0700) != 0 && errno != EEXIST) {
            *p = '/';
            return -1;
        }
        *p = '/';
    }
    return mkdir(path, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* The trace directory, as megatrace.files.private_dir accepts it: a real directory owned by this user and
 * writable by nobody else, under directories (walked up through "..") that only root or this user own and
 * that others cannot write unless they are sticky. Returns its descriptor, or -1 with *why set. */
static int open_private_dir(const char *dir, const char **why)
{
    struct stat st, up;
    uid_t me = geteuid();
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), cur, next;
    *why = "not a directory, or a symbolic link";
    if (fd < 0 || fstat(fd, &st) != 0)
        goto bad;
    *why = "owned by another user";
    if (st.st_uid != me)
        goto bad;
    *why = "writable by other users";
    if (st.st_mode & 022)
        goto bad;
    cur = dup(fd);
    for (int depth = 0; cur >= 0 && depth < 4096; depth++) {
        next = openat(cur, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        close(cur);
        cur = next;
        if (cur < 0 || fstat(cur, &up) != 0)
            break;
        if (up.st_dev == st.st_dev && up.st_ino == st.st_ino) { /* reached "/" */
            close(cur);
            return fd;
        }
        *why = "a directory above it is owned by another user";
        if (up.st_uid != 0 && up.st_uid != me)
            break;
        *why = "a directory above it is writable by everyone and not sticky";
        if ((up.st_mode & S_IWOTH) && !(up.st_mode & S_ISVTX))
            break;
        st = up;
    }
    if (cur >= 0)
        close(cur);
bad:
    if (fd >= 0)
        close(fd);
    return -1;
}

static int exists_at(int dfd, const char *name)
{
    struct stat st;
    return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

/* -- meta lines (JSON, one write() each, O_APPEND) ------------------------------------------ */

struct jbuf {
    char *p;
    size_t n, cap;
    int overflow;
};

static void jraw(struct jbuf *b, const char *s, size_t n)
{
    if (b->n + n + 2 > b->cap) {
        b->overflow = 1;
        return;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void jfmt(struct jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void jfmt(struct jbuf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        jraw(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static void jstr(struct jbuf *b, const char *s)
{
    jraw(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            jraw(b, e, 2);
        } else if (c < 0x20 || c >= 0x80) {
            jfmt(b, "\\u%04x", c); /* bytes, not characters: argv need not be UTF-8 */
        } else {
            jraw(b, (const char *)&c, 1);
        }
    }
    jraw(b, "\"", 1);
}

static void meta_write(struct jbuf *b)
{
    if (b->overflow || mt_g.meta_fd < 0)
        return;
    b->p[b->n++] = '}';
    b->p[b->n++] = '\n';
    if (write(mt_g.meta_fd, b->p, b->n) != (ssize_t)b->n)
        mt_log_once(MT_LOG_RING, "cannot append to the meta file: %s", strerror(errno));
}

static void meta_begin(struct jbuf *b, const char *kind)
{
    jfmt(b, "{\"kind\":");
    jstr(b, kind);
    jfmt(b, ",\"t_mono_ns\":%lld", (long long)mt_now_ns());
}

static void meta_process(const char *host)
{
    static char buf[8192];
    struct jbuf b = {buf, 0, sizeof buf, 0};
    char args[4096];
    ssize_t n = -1;
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        n = read(fd, args, sizeof args - 1);
        close(fd);
    }
    meta_begin(&b, "process");
    jfmt(&b, ",\"rank\":%d,\"world_size\":%d,\"local_rank\":%d,\"host\":", mt_g.rank, mt_g.world, mt_g.local_rank);
    jstr(&b, host);
    jfmt(&b, ",\"pid\":%d,\"argv\":[", (int)getpid());
    if (n > 0) {
        args[n] = 0;
        for (ssize_t i = 0; i < n; i += (ssize_t)strlen(args + i) + 1) {
            if (i)
                jraw(&b, ",", 1);
            jstr(&b, args + i);
        }
    }
    jfmt(&b, "],\"torch\":\"\",\"backend\":\"nccl\",\"tracer\":\"nccl-interposer\"");
    meta_write(&b);
}

static void meta_group(const struct mt_comm *c)
{
    static char buf[1 << 20]; /* under cold_lock; up to ~100k members */
    struct jbuf b = {buf, 0, sizeof buf, 0};
    meta_begin(&b, "group");
    jfmt(&b, ",\"gid\":%u,\"name\":", c->gid);
    jstr(&b, c->name);
    jfmt(&b, ",\"desc\":\"\",\"ranks\":[");
    for (int i = 0; i < c->nranks; i++)
        jfmt(&b, i ? ",%d" : "%d", c->members[i]);
    jfmt(&b, "],\"backend\":\"nccl\"");
    meta_write(&b);
}

/* -- the ring file ---------------------------------------------------------------------------- */

/* The writer of an existing ring of this rank, if it is this very process (the Python tracer). */
static int ring_is_ours(int dfd, const char *name)
{
    unsigned char h[40];
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), pid;
    ssize_t n = fd >= 0 ? pread(fd, h, sizeof h, 0) : -1;
    if (fd >= 0)
        close(fd);
    if (n != (ssize_t)sizeof h || memcmp(h, "MGTRACE", 8) != 0)
        return 0;
    memcpy(&pid, h + 36, 4);
    return pid == (int)getpid();
}

static void put_str(unsigned char *dst, const char *s, size_t size)
{
    size_t n = strlen(s);
    memcpy(dst, s, n < size ? n : size); /* NUL padding: the mapping starts zeroed */
}

static int ring_create(void)
{
    char job[200], step[200], dir[1024], path[1200], meta[1200], old[300], host[256] = "", ring[64], metaname[64];
    const char *why = "";
    const char *node = getenv("SLURMD_NODENAME");
    uint64_t cap = ring_capacity(), size = MT_HEADER_SIZE + cap * MT_RECORD_SIZE;
    unsigned char *base;
    uint32_t u32, check;
    int64_t wall, mono;
    struct timespec ts;
    int fd, dfd, err, pid = (int)getpid();

    snprintf(job, sizeof job, "%s", env_or("MEGATRACE_JOB_ID", "SLURM_JOB_ID", "local"));
    snprintf(step, sizeof step, "%s", env_or("MEGATRACE_STEP_ID", "SLURM_STEP_ID", ""));
    trace_dir(dir, sizeof dir, job, step);
    snprintf(path, sizeof path, "%s/rank-%05d.ring", dir, mt_g.rank);
    snprintf(meta, sizeof meta, "%s/rank-%05d.meta.jsonl", dir, mt_g.rank);
    snprintf(ring, sizeof ring, "rank-%05d.ring", mt_g.rank);
    snprintf(metaname, sizeof metaname, "rank-%05d.meta.jsonl", mt_g.rank);
    if (node && *node)
        snprintf(host, sizeof host, "%s", node);
    else
        gethostname(host, sizeof host - 1);

    if (mkdirs(dir) != 0) {
        mt_log_once(MT_LOG_RING, "cannot create trace directory %s: %s; NCCL calls are not traced", dir,
                    strerror(errno));
        return -1;
    }
    dfd = open_private_dir(dir, &why);
    if (dfd < 0) {
        mt_log_once(MT_LOG_RING, "cannot use trace directory %s: %s; NCCL calls are not traced", dir, why);
        return -1;
    }
    if (exists_at(dfd, ring)) {
        if (ring_is_ours(dfd, ring)) {
            mt_log_once(MT_LOG_TORCH, "%s is written by this process's Python tracer; the NCCL interposer "
                        "stays out of its way", path);
            close(dfd);
            return -1;
        }
        int k = 1;
        for (;; k++) { /* keep a previous attempt: rank-NNNNN.ring.K */
            snprintf(old, sizeof old, "%s.%d", ring, k);
            if (!exists_at(dfd, old))
                break;
        }
        if (renameat(dfd, ring, dfd, old) == 0) {
            char oldmeta[300];
            snprintf(oldmeta, sizeof oldmeta, "%s.%d", metaname, k);
            if (exists_at(dfd, metaname))
                renameat(dfd, metaname, dfd, oldmeta);
        }
    }
    fd = openat(dfd, ring, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        mt_log_once(MT_LOG_RING, "cannot create ring file %s: %s; NCCL calls are not traced", path, strerror(errno));
        close(dfd);
        return -1;
    }
    /* Reserve the blocks now: a sparse file on a full tmpfs would SIGBUS the trainer later. */
    err = posix_fallocate(fd, 0, (off_t)size);
    base = err ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        mt_log_once(MT_LOG_RING, "cannot reserve %llu bytes for ring file %s: %s; NCCL calls are not traced",
                    (unsigned long long)size, path, strerror(err ? err : errno));
        close(fd);
        unlinkat(dfd, ring, 0);
        close(dfd);
        return -1;
    }
    close(fd);

    clock_gettime(CLOCK_REALTIME, &ts);
    wall = (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
    mono = mt_now_ns();
    memcpy(base, "MGTRACE\0", 8);
    u32 = 1;
    memcpy(base + 8, &u32, 4);
    u32 = MT_HEADER_SIZE;
    memcpy(base + 12, &u32, 4);
    u32 = MT_RECORD_SIZE;
    memcpy(base + 16, &u32, 4);
    u32 = (uint32_t)cap;
    memcpy(base + 20, &u32, 4);
    memcpy(base + 24, &mt_g.rank, 4);
    memcpy(base + 28, &mt_g.local_rank, 4);
    memcpy(base + 32, &mt_g.world, 4);
    memcpy(base + 36, &pid, 4);
    memcpy(base + 40, &wall, 8);
    memcpy(base + 48, &mono, 8);
    put_str(base + 64, job, 64);
    put_str(base + 128, step, 32);
    put_str(base + 160, host, 64);
    check = mt_adler32(base, 252);
    memcpy(base + 252, &check, 4);
    u32 = 1; /* writer_state OPEN; write_counter stays 0 */
    memcpy(base + 264, &u32, 4);

    mt_g.meta_fd = openat(dfd, metaname, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
    close(dfd);
    if (mt_g.meta_fd < 0)
        mt_log_once(MT_LOG_RING, "cannot open meta file %s: %s; group members will be inferred", meta,
                    strerror(errno));
    mt_g.capacity = cap;
    meta_process(host);
    __atomic_store_n(&mt_g.base, base, __ATOMIC_RELEASE);
    return 0;
}

/* -- communicators ---------------------------------------------------------------------------- */

static struct mt_comm *slot_for(ncclComm_t comm)
{
    uint32_t i = mt_hash_ptr(comm) & (MT_COMM_SLOTS - 1);
    struct mt_comm *reuse = NULL;
    for (uint32_t n = 0; n < MT_COMM_SLOTS; n++, i = (i + 1) & (MT_COMM_SLOTS - 1)) {
        ncclComm_t k = mt_comms[i].key;
        if (k == comm)
            return &mt_comms[i];
        if (k == MT_COMM_GONE && !reuse)
            reuse = &mt_comms[i];
        if (k == NULL)
            return reuse ? reuse : &mt_comms[i];
    }
    return reuse;
}

/* Global ranks of a new communicator's members, learned with one all-gather on it; NULL if not. */
static int *exchange_members(ncclComm_t comm, int nranks, int rank, int device, const char *name)
{
    int *out = calloc((size_t)nranks, sizeof(int));
    int global = mt_g.rank, rc = -1;
    if (!out)
        return NULL;
    if (mt_g.completion == MT_COMPLETE_RETURN) /* host memory, finished on return */
        rc = mt_real.AllGather(&global, out, 1, ncclInt32, comm, NULL) == ncclSuccess ? 0 : -1;
    else if (mt_g.completion == MT_COMPLETE_EVENT)
        rc = mt_exchange_device(comm, device, nranks, rank, global, out);
    if (rc != 0) {
        free(out);
        mt_log_once(MT_LOG_EXCHANGE, "cannot learn the members of communicator %s; the analyzer infers them", name);
        return NULL;
    }
    return out;
}

void mt_comm_created(ncclComm_t comm, int nranks, int rank, uint32_t gid, const char *name, int exchange, int trace)
{
    struct mt_comm *c;
    uint64_t *seqs;
    int device = -1, *members = NULL;
    if (!mt_g.enabled || !comm || nranks <= 0)
        return;
    pthread_mutex_lock(&cold_lock);
    if (!mt_g.base && !mt_g.ring_failed) {
        if (mt_g.rank < 0) { /* no rank in the environment: the first communicator is the world */
            mt_g.rank = rank;
            mt_g.world = nranks;
        }
        if (mt_g.world < 0)
            mt_g.world = nranks;
        if (ring_create() != 0)
            mt_g.ring_failed = 1;
    }
    if (mt_real.CommCuDevice && mt_g.completion == MT_COMPLETE_EVENT)
        mt_real.CommCuDevice(comm, &device);
    if (device >= 0 && mt_g.base && mt_events_prepare(device) != 0)
        mt_log_once(MT_LOG_EVENTS, "no CUDA events for device %d; its calls record enqueue time only", device);
    c = mt_g.base && trace ? slot_for(comm) : NULL;
    seqs = c ? calloc(2 * (size_t)nranks, sizeof(uint64_t)) : NULL;
    if (c && seqs) {
        memset(c, 0, sizeof *c);
        c->key = MT_COMM_RESERVED; /* taken, not yet visible to mt_comm_find */
        c->nranks = nranks;
        c->rank = rank;
        c->device = device;
        c->send_seq = seqs;
        c->recv_seq = seqs + nranks;
        snprintf(c->name, sizeof c->name, "%s", name);
        c->gid = gid ? gid : 1; /* 0 is for markers */
    } else {
        if (mt_g.base && trace)
            mt_log_once(MT_LOG_TABLE, "no room to trace communicator %s; its calls are not traced", name);
        free(seqs);
        c = NULL;
    }
    pthread_mutex_unlock(&cold_lock);

    /* Outside the lock: the all-gather blocks until every member has created the communicator. It
     * runs even when this rank does not trace (its ring failed): the other members are waiting in it. */
    if (exchange && mt_g.exchange)
        members = exchange_members(comm, nranks, rank, device, name);
    if (!c) {
        free(members);
        return;
    }
    if (!members && nranks == mt_g.world && rank == mt_g.rank) {
        /* a world-sized communicator where we hold our global rank: taken as member i = rank i */
        members = calloc((size_t)nranks, sizeof(int));
        for (int i = 0; members && i < nranks; i++)
            members[i] = i;
    }
    pthread_mutex_lock(&cold_lock);
    c->members = members;
    if (members)
        meta_group(c);
    __atomic_store_n(&c->key, comm, __ATOMIC_RELEASE); /* publish: calls on `comm` are traced from now on */
    pthread_mutex_unlock(&cold_lock);
}

void mt_comm_destroyed(ncclComm_t comm)
{
    struct mt_comm *c = mt_comm_find(comm);
    if (!c)
        return;
    pthread_mutex_lock(&cold_lock);
    __atomic_store_n(&c->key, MT_COMM_GONE, __ATOMIC_RELEASE);
    /* The counters and members stay allocated: a thread may still be inside a call on `comm`. */
    pthread_mutex_unlock(&cold_lock);
}

/* -- load, resolve, exit ---------------------------------------------------------------------- */

/* The real NCCL when it is not in the global scope: a framework that dlopen()s its libraries with
 * RTLD_LOCAL (PyTorch's extension modules, and libnccl.so.2 with them as a dependency) still binds
 * its NCCL calls to this preloaded library, but RTLD_NEXT cannot see past it into that local scope.
 * Found among the loaded objects by file name (libnccl.so*), and opened without loading anything. */
static int nccl_path(struct dl_phdr_info *info, size_t size, void *data)
{
    const char *path = info->dlpi_name, *base;
    (void)size;
    if (!path || !*path)
        return 0;
    base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (strncmp(base, "libnccl.so", 10) != 0 || strlen(path) >= PATH_MAX)
        return 0;
    strcpy((char *)data, path);
    return 1;
}

static void *local_nccl(void)
{
    char path[PATH_MAX] = "";
    if (!dl_iterate_phdr(nccl_path, path)) /* dlopen only after the iteration: it holds the loader's lock */
        return NULL;
    return dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
}

static void *real_symbol(void **local, const char *sym)
{
    void *p = dlsym(RTLD_NEXT, sym);
    if (p)
        return p;
    if (!*local)
        *local = local_nccl();
    return *local ? dlsym(*local, sym) : NULL;
}

#define RESOLVE(field, sym) mt_real.field = (__typeof__(mt_real.field))real_symbol(&local, sym)

static void resolve_all(void)
{
    void *local = NULL;
    RESOLVE(CommInitRank, "ncclCommInitRank");
    RESOLVE(CommInitRankConfig, "ncclCommInitRankConfig");
    RESOLVE(CommInitAll, "ncclCommInitAll");
    RESOLVE(CommSplit, "ncclCommSplit");
    RESOLVE(CommDestroy, "ncclCommDestroy");
    RESOLVE(CommAbort, "ncclCommAbort");
    RESOLVE(CommCount, "ncclCommCount");
    RESOLVE(CommUserRank, "ncclCommUserRank");
    RESOLVE(CommCuDevice, "ncclCommCuDevice");
    RESOLVE(AllReduce, "ncclAllReduce");
    RESOLVE(Broadcast, "ncclBroadcast");
    RESOLVE(Bcast, "ncclBcast");
    RESOLVE(Reduce, "ncclReduce");
    RESOLVE(AllGather, "ncclAllGather");
    RESOLVE(ReduceScatter, "ncclReduceScatter");
    RESOLVE(Send, "ncclSend");
    RESOLVE(Recv, "ncclRecv");
    RESOLVE(GroupStart, "ncclGroupStart");
    RESOLVE(GroupEnd, "ncclGroupEnd");

    if (!mt_g.enabled)
        return;
    const char *mode = getenv("MEGATRACE_NCCL_COMPLETION");
    if (mode && !strcmp(mode, "none"))
        mt_g.completion = MT_COMPLETE_NONE;
    else if (mode && !strcmp(mode, "return"))
        mt_g.completion = MT_COMPLETE_RETURN;
    else if (mode && !strcmp(mode, "event"))
        mt_g.completion = mt_events_available() ? MT_COMPLETE_EVENT : MT_COMPLETE_NONE;
    else if (real_symbol(&local, "megatrace_nccl_host_memory")) /* a host-memory NCCL (the test double) */
        mt_g.completion = MT_COMPLETE_RETURN;
    else
        mt_g.completion = mt_events_available() ? MT_COMPLETE_EVENT : MT_COMPLETE_NONE;
    if (mt_g.completion == MT_COMPLETE_NONE && !(mode && !strcmp(mode, "none")))
        mt_log_once(MT_LOG_EVENTS, "no CUDA runtime in this process: records carry enqueue times only");
    /* Learning members needs a buffer the library accepts: host memory, or device memory via CUDA. */
    mt_g.exchange = mt_g.completion != MT_COMPLETE_NONE && !(getenv("MEGATRACE_NCCL_MEMBERS") &&
                                                             !env_true("MEGATRACE_NCCL_MEMBERS"));
}

void mt_resolve(void)
{
    pthread_once(&resolve_once, resolve_all);
}

/* A forked child (a data-loader worker, say) shares the parent's ring mapping but not its counters:
 * it must neither write records nor mark the ring closed when it exits. */
static void mt_forked_child(void)
{
    mt_g.enabled = 0;
    mt_g.base = NULL;
}

__attribute__((constructor)) static void mt_load(void)
{
    static const char *const rank_vars[] = {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                            "PMIX_RANK", NULL};
    static const char *const world_vars[] = {"WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS",
                                             "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", NULL};
    static const char *const local_vars[] = {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                             "MPI_LOCALRANKID", NULL};
    mt_g.enabled = env_true("MEGATRACE_ENABLE");
    if (!mt_g.enabled)
        return;
    mt_g.rank = env_int(rank_vars, -1);
    mt_g.world = env_int(world_vars, -1);
    mt_g.local_rank = env_int(local_vars, -1);
    mt_g.rank_from_env = mt_g.rank >= 0;
    pthread_atfork(NULL, NULL, mt_forked_child);
}

__attribute__((destructor)) static void mt_unload(void)
{
    unsigned char *base = __atomic_load_n(&mt_g.base, __ATOMIC_ACQUIRE);
    uint32_t closed = 2;
    if (base)
        __atomic_store_n((uint32_t *)(base + 264), closed, __ATOMIC_RELEASE); /* writer_state CLOSED */
}
