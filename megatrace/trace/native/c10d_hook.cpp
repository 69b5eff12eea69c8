/*
 * megatrace.trace._c10d_hook: records every c10d collective and point-to-point call where all
 * of PyTorch's call paths meet, the dispatcher.
 *
 * Every ProcessGroup method (the Python API, DDP's reducer, functional collectives, DTensor,
 * FSDP, torch.compile, pipelining) calls a c10d operator (c10d::allreduce_, c10d::send, ...)
 * through the dispatcher, whose per-device kernel hands the call to the backend (gloo on CPU).
 * This module puts a boxed kernel in front of the CPU kernel of each operator that the Python
 * side names (megatrace/trace/dispatch_hook.py reads argument positions from the operator's
 * schema), keeps the original kernel and calls it. Per call: one uncontended mutex for the
 * group's sequence counters, two clock reads, one 64-byte record (ring_record.h, the bytes
 * every MegaTrace writer produces), and completion from the work's future (collectives) or
 * from the work's wait() (gloo send/recv works have no future: they are wrapped).
 *
 * The same kernel also sits in front of each operator's CUDA kernel (NCCL: DDP's gradient
 * buckets, FSDP, DTensor on GPUs). A device work's future completes when the work is enqueued,
 * not when the GPU has run it, so device records are completed by one poller thread that asks
 * each outstanding work isCompleted() (its end event), from 0.5 ms apart backing off to 4 ms
 * while nothing finishes; it takes no GIL. A synchronous call may return no work at all (recent
 * ProcessGroupNCCL runs it on the caller's stream): an event recorded on that stream right after
 * the call is polled instead.
 *
 * Never throws into the training call: any failure of our own skips the record.
 * Built against the installed torch by dispatch_hook.build(); tied to that torch version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

extern "C" {
#include "ring_record.h"
}

#ifndef MEGATRACE_TORCH_VERSION
#define MEGATRACE_TORCH_VERSION "unknown"
#endif

#if PY_VERSION_HEX >= 0x030D0000
#define MT_PY_FINALIZING() Py_IsFinalizing()
#else
#define MT_PY_FINALIZING() _Py_IsFinalizing()
#endif

namespace {

constexpr uint32_t kStateFailed = 3;
constexpr uint8_t kFlagAsync = 1, kFlagBatched = 2, kFlagDevice = 4;
constexpr int kCollective = 0, kSend = 1, kRecv = 2;
// How an argument carries the data whose size is recorded.
enum DataKind { kNone = 0, kTensor = 1, kTensorList = 2, kTensorListList = 3 };

/* The ring this process writes: the writer's mapping and its sequence counter (shared with the
 * Python writer's C hot path, which allocates from the same counter atomically). */
struct Ring {
    unsigned char *base;
    uint64_t capacity;
    uint64_t *next_seq;
};
std::atomic<Ring *> g_ring{nullptr};

struct Group {
    std::string name;
    uint32_t gid = 0;
    std::vector<int> ranks;  // group rank -> global rank; empty when unknown
    uint64_t seq = 0;
    std::unordered_map<int, uint64_t> send_seq, recv_seq;
};

std::mutex g_groups_mu;
std::unordered_map<std::string, std::unique_ptr<Group>> g_by_name;
std::unordered_map<const c10d::ProcessGroup *, Group *> g_by_pg;
PyObject *g_resolver = nullptr;  // Python callable(name) that registers an unknown group
PyObject *g_on_wrap = nullptr;   // Python callable(seq), told once when the ring starts to overwrite
std::atomic<uint64_t> g_calls{0}, g_skipped{0};
thread_local bool t_batched = false;  // inside batch_isend_irecv on this thread (set from Python)

uint32_t crc32(const std::string &s)
{
    uint32_t c = 0xffffffffu;
    for (unsigned char ch : s) {
        c ^= ch;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

uint8_t dtype_code(c10::ScalarType t)
{
    switch (t) {  // megatrace/trace/ring_format.py: Dtype
    case c10::ScalarType::Float: return 1;
    case c10::ScalarType::Half: return 2;
    case c10::ScalarType::BFloat16: return 3;
    case c10::ScalarType::Double: return 4;
    case c10::ScalarType::Char: return 5;
    case c10::ScalarType::Byte: return 6;
    case c10::ScalarType::Short: return 7;
    case c10::ScalarType::Int: return 8;
    case c10::ScalarType::Long: return 9;
    case c10::ScalarType::Bool: return 10;
    case c10::ScalarType::Float8_e4m3fn: return 11;
    case c10::ScalarType::Float8_e5m2: return 12;
    case c10::ScalarType::ComplexFloat: return 13;
    case c10::ScalarType::ComplexDouble: return 14;
    default: return 0;
    }
}

/* Call back into Python (rare: once per unknown group, once when the ring wraps), taking the
 * GIL; never while g_groups_mu is held, never during interpreter shutdown. */
template <typename... Args>
void call_python(PyObject *fn, const char *format, Args... args)
{
    if (fn == nullptr || !Py_IsInitialized() || MT_PY_FINALIZING())
        return;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(fn, format, args...);
    if (r == nullptr)
        PyErr_Clear();
    Py_XDECREF(r);
    PyGILState_Release(gil);
}

/* Ask Python to register a group we have not seen (created by a path the tracer did not
 * watch); the resolver calls register_group(). */
void resolve_in_python(const std::string &name)
{
    call_python(g_resolver, "s#", name.data(), (Py_ssize_t)name.size());
}

Group *find_locked(const c10d::ProcessGroup *pg, const std::string &name)
{
    auto it = g_by_pg.find(pg);
    if (it != g_by_pg.end() && it->second->name == name)
        return it->second;
    auto byname = g_by_name.find(name);
    if (byname == g_by_name.end())
        return nullptr;
    g_by_pg[pg] = byname->second.get();
    return byname->second.get();
}

Group *group_of(const c10d::ProcessGroup *pg)
{
    const std::string &name = pg->getGroupName();
    {
        std::lock_guard<std::mutex> lock(g_groups_mu);
        if (Group *g = find_locked(pg, name))
            return g;
    }
    resolve_in_python(name);
    std::lock_guard<std::mutex> lock(g_groups_mu);
    if (Group *g = find_locked(pg, name))
        return g;
    auto g = std::make_unique<Group>();  // unresolved: its id as Python would compute it, no members
    g->name = name;
    g->gid = crc32("torch:" + name);
    Group *raw = g.get();
    g_by_name[name] = std::move(g);
    g_by_pg[pg] = raw;
    return raw;
}

void add_tensor(const at::Tensor &t, uint64_t &nbytes, int &dtype)
{
    if (!t.defined())
        return;
    nbytes += t.nbytes();
    if (dtype < 0)
        dtype = dtype_code(t.scalar_type());
}

void add_tensor(const at::Tensor &t, uint64_t &nbytes, int &dtype, std::optional<c10::Device> &device)
{
    if (t.defined() && !device)
        device = t.device();
    add_tensor(t, nbytes, dtype);
}

/* The data's size, type and (first tensor's) device. */
void measure(const c10::IValue &v, int kind, uint64_t &nbytes, int &dtype, std::optional<c10::Device> &device)
{
    if (kind == kTensor && v.isTensor()) {
        add_tensor(v.toTensor(), nbytes, dtype, device);
    } else if (kind == kTensorList && v.isTensorList()) {
        for (const at::Tensor &t : v.toTensorList().vec())
            add_tensor(t, nbytes, dtype, device);
    } else if (kind == kTensorListList && v.isList()) {
        for (const c10::IValue &inner : v.toListRef())
            if (inner.isTensorList())
                for (const at::Tensor &t : inner.toTensorList().vec())
                    add_tensor(t, nbytes, dtype, device);
    }
}

struct Pending {
    uint64_t off, seq;
    std::optional<c10::Device> device;  // of the call's data
};

void complete(const Pending &p, uint32_t state)
{
    Ring *ring = g_ring.load(std::memory_order_acquire);
    if (ring == nullptr || p.off + MT_RECORD_SIZE > MT_HEADER_SIZE + ring->capacity * MT_RECORD_SIZE)
        return;
    uint64_t stored;
    memcpy(&stored, ring->base + p.off, 8);
    if (stored == p.seq)  // else the ring wrapped past this record while it was outstanding
        mt_record_complete(ring->base, p.off, p.seq, state);
}

/* Works whose future says nothing of their end (device works), polled by one thread. Heap objects
 * never freed: the thread is detached and may still run while static destructors do at exit. */
struct Polled {
    c10::intrusive_ptr<c10d::Work> work;  // the call's work, or null: then
    std::unique_ptr<c10::Event> event;    // an event recorded after the call on the caller's stream
    Pending p;
};
std::mutex *g_poll_mu = new std::mutex;
std::condition_variable *g_poll_cv = new std::condition_variable;
std::vector<Polled> *g_incoming = new std::vector<Polled>;
bool g_poller_started = false;  // under g_poll_mu
std::atomic<uint64_t> g_outstanding{0};  // works handed to the poller and not yet finished
std::atomic<uint64_t> g_passes{0};       // polling passes done

/* The poller queries CUDA events while a training thread may be capturing a CUDA graph. In the default
 * (global) capture mode such a query from any thread invalidates that capture: PyTorch's NCCL watchdog
 * thread relaxes its own mode for this, and so does the poller (cudaThreadExchangeStreamCaptureMode of
 * the CUDA runtime the process already loaded; nothing when it has none). */
void *cudart_symbol(const char *name)
{
    static const char *const libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so",
                                       nullptr};
    void *fn = nullptr;
    for (int i = 0; libs[i] && !fn; i++)
        if (void *lib = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD))  // only a runtime already loaded
            fn = dlsym(lib, name);
    return fn ? fn : dlsym(RTLD_DEFAULT, name);
}

/* True while `device`'s current stream is capturing a CUDA graph: the call is being recorded into the
 * graph, not run (it runs at each replay, which c10d never sees), and its work or events cannot be
 * queried. Such calls are not traced. */
bool capturing(const c10::Device &device)
{
    using IsCapturing = int (*)(void *, int *);
    static IsCapturing fn = reinterpret_cast<IsCapturing>(cudart_symbol("cudaStreamIsCapturing"));
    if (fn == nullptr || device.type() != c10::DeviceType::CUDA)
        return false;
    try {
        void *stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
        int status = 0;  // cudaStreamCaptureStatusNone
        return fn(stream, &status) == 0 && status != 0;
    } catch (...) {
        return false;
    }
}

void relax_capture_mode()
{
    void *fn = cudart_symbol("cudaThreadExchangeStreamCaptureMode");
    if (fn) {
        int mode = 2;  // cudaStreamCaptureModeRelaxed
        reinterpret_cast<int (*)(int *)>(fn)(&mode);
    }
}

void poll_works()
{
    relax_capture_mode();
    using std::chrono::microseconds;
    std::vector<Polled> active;
    microseconds interval(500);
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(*g_poll_mu);
            if (active.empty())
                g_poll_cv->wait(lock, [] { return !g_incoming->empty(); });
            for (Polled &x : *g_incoming)
                active.push_back(std::move(x));
            g_incoming->clear();
        }
        if (g_ring.load(std::memory_order_acquire) == nullptr) {
            for (Polled &x : active) {  // detached at exit: drop them without running their destructors
                x.work.release();
                x.event.release();
            }
            g_outstanding.fetch_sub(active.size(), std::memory_order_relaxed);
            active.clear();
            continue;
        }
        bool finished = false;
        for (size_t i = 0; i < active.size();) {
            bool done, failed = false;
            try {
                Polled &x = active[i];
                done = x.work ? x.work->isCompleted() : x.event->query();
                failed = done && x.work && x.work->exception() != nullptr;
            } catch (...) {
                done = failed = true;
            }
            if (!done) {
                i++;
                continue;
            }
            complete(active[i].p, failed ? kStateFailed : MT_STATE_COMPLETED);
            active[i] = std::move(active.back());
            active.pop_back();
            g_outstanding.fetch_sub(1, std::memory_order_release);
            finished = true;
        }
        g_passes.fetch_add(1, std::memory_order_release);
        if (active.empty())
            continue;
        interval = finished ? microseconds(500) : std::min(interval * 2, microseconds(4000));
        std::this_thread::sleep_for(interval);
    }
}

/* Hand a work or event to the poller (started on first use). False if the thread cannot be started. */
bool poll_until_done(c10::intrusive_ptr<c10d::Work> work, std::unique_ptr<c10::Event> event, const Pending &p)
{
    std::lock_guard<std::mutex> lock(*g_poll_mu);
    if (!g_poller_started) {
        try {
            std::thread(poll_works).detach();
        } catch (...) {
            return false;
        }
        g_poller_started = true;
    }
    g_incoming->push_back(Polled{std::move(work), std::move(event), p});
    g_outstanding.fetch_add(1, std::memory_order_relaxed);
    g_poll_cv->notify_one();
    return true;
}

/* Before the ring is detached at exit: let the poller finish what the GPU has finished (a clean
 * exit right after the last synchronize), waiting two passes at most, 50 ms at most. */
void drain_polled()
{
    if (g_outstanding.load(std::memory_order_acquire) == 0)
        return;
    uint64_t target = g_passes.load(std::memory_order_acquire) + 2;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    while (g_outstanding.load(std::memory_order_acquire) != 0 && g_passes.load(std::memory_order_acquire) < target
           && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
}

/* A gloo send/recv work (no future): completion is recorded when the program learns of it. */
class TracedWork : public c10d::Work {
  public:
    TracedWork(c10::intrusive_ptr<c10d::Work> inner, Pending p)
        : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), pending_(p) {}
    ~TracedWork() override
    {
        try {
            if (inner_->isCompleted())
                finish_record();
        } catch (...) {
        }
    }
    bool isCompleted() override
    {
        bool done = inner_->isCompleted();
        if (done)
            finish_record();
        return done;
    }
    bool isSuccess() const override { return inner_->isSuccess(); }
    std::exception_ptr exception() const override { return inner_->exception(); }
    int sourceRank() const override { return inner_->sourceRank(); }
    std::vector<at::Tensor> result() override { return inner_->result(); }
    void synchronize() override { inner_->synchronize(); }
    bool wait(std::chrono::milliseconds timeout) override
    {
        bool ok;
        try {
            ok = inner_->wait(timeout);
        } catch (...) {
            finish_record(kStateFailed);
            throw;
        }
        if (ok)
            finish_record();
        return ok;
    }
    void blockCurrentStream() override { inner_->blockCurrentStream(); }
    void abort() override { inner_->abort(); }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
    c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
    float getDuration() const override { return inner_->getDuration(); }
    uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

  private:
    void finish_record(uint32_t state = MT_STATE_COMPLETED)
    {
        if (!recorded_.exchange(true))
            complete(pending_, state);
    }
    c10::intrusive_ptr<c10d::Work> inner_;
    Pending pending_;
    std::atomic<bool> recorded_{false};
};

/* How to read one operator's arguments (positions from its schema, found by name in Python). */
struct OpSpec {
    std::string name;
    uint16_t op;
    int data_arg, data_kind, pg_arg, root_arg, async_arg, kind;
    uint8_t flags;
};

class TracingKernel final : public c10::OperatorKernel {
  public:
    /* device: in front of a device (CUDA) kernel; poll: completion from the poller, not the future. */
    TracingKernel(OpSpec spec, c10::SafeKernelFunction original, bool device, bool poll)
        : spec_(std::move(spec)), original_(std::move(original)), device_(device), poll_(poll || device) {}

    void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet ks, torch::jit::Stack *stack)
    {
        Ring *ring = g_ring.load(std::memory_order_acquire);
        Pending p{0, 0};
        bool traced = false;
        if (ring != nullptr) {
            try {
                traced = begin(*ring, op, *stack, p);
            } catch (...) {
                g_skipped.fetch_add(1, std::memory_order_relaxed);
            }
        }
        if (!traced) {
            original_.callBoxed(op, ks, stack);
            return;
        }
        try {
            original_.callBoxed(op, ks, stack);
        } catch (...) {
            complete(p, kStateFailed);
            throw;
        }
        try {
            attach_completion(*stack, p);
        } catch (...) {
            g_skipped.fetch_add(1, std::memory_order_relaxed);
        }
    }

  private:
    bool begin(Ring &ring, const c10::OperatorHandle &op, const torch::jit::Stack &stack, Pending &p)
    {
        const size_t nargs = op.schema().arguments().size();
        if (stack.size() < nargs)
            return false;
        const c10::IValue *args = stack.data() + (stack.size() - nargs);
        const c10::IValue &pgv = args[spec_.pg_arg];
        if (!pgv.isCustomClass())
            return false;
        auto pg = pgv.toCustomClass<c10d::ProcessGroup>();
        uint64_t nbytes = 0;
        int dtype = -1;
        if (spec_.data_arg >= 0)
            measure(args[spec_.data_arg], spec_.data_kind, nbytes, dtype, p.device);
        if (device_ && p.device && capturing(*p.device))
            return false;
        uint8_t flags = spec_.flags | (t_batched ? kFlagBatched : 0) | (device_ ? kFlagDevice : 0);
        if (spec_.async_arg >= 0 && args[spec_.async_arg].isBool() && args[spec_.async_arg].toBool())
            flags |= kFlagAsync;
        int group_peer = spec_.root_arg >= 0 && args[spec_.root_arg].isInt()
                             ? (int)args[spec_.root_arg].toInt() : -1;
        Group *g = group_of(pg.get());
        int32_t peer = -1;
        uint64_t group_seq;
        uint32_t gid;
        {
            std::lock_guard<std::mutex> lock(g_groups_mu);
            gid = g->gid;
            if (group_peer >= 0 && (size_t)group_peer < g->ranks.size())
                peer = g->ranks[group_peer];
            if (spec_.kind == kCollective)
                group_seq = ++g->seq;
            else
                group_seq = ++(spec_.kind == kSend ? g->send_seq : g->recv_seq)[peer];
        }
        uint64_t seq = __atomic_fetch_add(ring.next_seq, 1, __ATOMIC_RELAXED);
        p.off = mt_record_begin(ring.base, ring.capacity, seq, group_seq, nbytes, gid, peer, spec_.op,
                                (uint8_t)(dtype < 0 ? 0 : dtype), flags);
        p.seq = seq;
        g_calls.fetch_add(1, std::memory_order_relaxed);
        if (seq == ring.capacity + 1)  // exactly one writer thread gets this number
            call_python(g_on_wrap, "K", (unsigned long long)seq);
        return true;
    }

    void attach_completion(torch::jit::Stack &stack, const Pending &p)
    {
        c10::intrusive_ptr<c10d::Work> work;
        if (!stack.empty() && stack.back().isCustomClass())
            work = stack.back().toCustomClass<c10d::Work>();
        if (poll_) {
            attach_polled(std::move(work), p);
            return;
        }
        if (!work) {  // no work (monitored_barrier): done
            complete(p, MT_STATE_COMPLETED);
            return;
        }
        c10::intrusive_ptr<c10::ivalue::Future> fut;
        try {
            fut = work->getFuture();
        } catch (...) {
        }
        if (fut) {
            fut->addCallback([p](c10::ivalue::Future &f) {
                complete(p, f.hasError() ? kStateFailed : MT_STATE_COMPLETED);
            });
            return;
        }
        stack.back() = c10::IValue(c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<TracedWork>(work, p)));
    }

    /* Completion from the poller: the work, else (a synchronous device call that returned none) an event
     * recorded now on the caller's current stream, where the call was enqueued. */
    void attach_polled(c10::intrusive_ptr<c10d::Work> work, const Pending &p)
    {
        std::unique_ptr<c10::Event> event;
        if (!work && device_ && p.device) {
            try {
                const c10::Device dev = *p.device;
                event = std::make_unique<c10::Event>(dev.type());
                event->record(c10::impl::getDeviceGuardImpl(dev.type())->getStream(dev));
            } catch (...) {
                event.reset();
            }
        }
        if (!work && !event) {  // nothing to observe: it ended when the call returned
            complete(p, MT_STATE_COMPLETED);
            return;
        }
        if (!poll_until_done(std::move(work), std::move(event), p))
            g_skipped.fetch_add(1, std::memory_order_relaxed);  // stays entered: never a false end
    }

    OpSpec spec_;
    c10::SafeKernelFunction original_;
    bool device_, poll_;
};

// Deleted only by uninstall(): never by static destruction at exit, when the dispatcher may be gone.
torch::Library *g_library = nullptr, *g_device_library = nullptr;
std::vector<std::string> g_hooked;

/* A warning handler that drops the dispatcher's "Overriding a previously registered kernel". */
class QuietHandler : public c10::WarningHandler {
  public:
    void process(const c10::Warning &) override {}
};

// ---- Python interface --------------------------------------------------------------------
/* install(rows, poll_cpu=False) -> (CPU operators hooked, device operators hooked). poll_cpu: CPU
 * works too are completed by the poller (the device path's completion, exercised without a GPU). */
PyObject *py_install(PyObject *, PyObject *args)
{
    PyObject *specs;
    int poll_cpu = 0;
    if (!PyArg_ParseTuple(args, "O!|p", &PyList_Type, &specs, &poll_cpu))
        return nullptr;
    if (g_library) {
        PyErr_SetString(PyExc_RuntimeError, "already installed");
        return nullptr;
    }
    std::vector<OpSpec> parsed;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(specs); i++) {
        const char *name;
        int op, data_arg, data_kind, pg_arg, root_arg, async_arg, kind, flags;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(specs, i), "siiiiiiii", &name, &op, &data_arg, &data_kind,
                              &pg_arg, &root_arg, &async_arg, &kind, &flags))
            return nullptr;
        parsed.push_back(OpSpec{name, (uint16_t)op, data_arg, data_kind, pg_arg, root_arg, async_arg, kind,
                                (uint8_t)flags});
    }
    PyObject *hooked[2] = {PyList_New(0), PyList_New(0)};
    auto drop = [&hooked]() {
        Py_XDECREF(hooked[0]);
        Py_XDECREF(hooked[1]);
    };
    if (hooked[0] == nullptr || hooked[1] == nullptr) {
        drop();
        return nullptr;
    }
    const c10::DispatchKey keys[2] = {c10::DispatchKey::CPU, c10::DispatchKey::CUDA};
    std::vector<std::unique_ptr<torch::Library>> libs;
    try {
        QuietHandler quiet;
        c10::WarningUtils::WarningHandlerGuard guard(&quiet);
        for (int k = 0; k < 2; k++) {
            auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d",
                                                        std::optional<c10::DispatchKey>(keys[k]), __FILE__, __LINE__);
            for (const OpSpec &spec : parsed) {
                auto handle = c10::Dispatcher::singleton().findSchema({"c10d::" + spec.name, ""});
                if (!handle || !handle->hasKernelForDispatchKey(keys[k]))
                    continue;
                auto original = handle->getComputedKernelForDispatchKey(keys[k]);
                lib->impl(spec.name.c_str(),
                          torch::CppFunction::makeFromBoxedFunctor(std::make_unique<TracingKernel>(
                              spec, std::move(original), k == 1, poll_cpu != 0)));
                PyObject *s = PyUnicode_FromString(spec.name.c_str());
                if (s == nullptr || PyList_Append(hooked[k], s) < 0) {
                    Py_XDECREF(s);
                    drop();
                    return nullptr;  // the libraries made so far go with `libs`: their kernels are removed
                }
                Py_DECREF(s);
            }
            libs.push_back(std::move(lib));
        }
        g_library = libs[0].release();
        g_device_library = libs[1].release();
    } catch (const std::exception &e) {
        drop();
        PyErr_Format(PyExc_RuntimeError, "cannot register the c10d kernels: %s", e.what());
        return nullptr;
    }
    return Py_BuildValue("(NN)", hooked[0], hooked[1]);
}

PyObject *py_uninstall(PyObject *, PyObject *)
{
    try {
        QuietHandler quiet;
        c10::WarningUtils::WarningHandlerGuard guard(&quiet);
        delete g_library;  // the dispatcher restores the original kernels
        delete g_device_library;
        g_library = g_device_library = nullptr;
    } catch (const std::exception &e) {
        PyErr_Format(PyExc_RuntimeError, "cannot remove the c10d kernels: %s", e.what());
        return nullptr;
    }
    Py_RETURN_NONE;
}

/* attach(base_address, capacity, counter_address): records go to this ring from now on. */
PyObject *py_attach(PyObject *, PyObject *args)
{
    unsigned long long base, capacity, counter;
    if (!PyArg_ParseTuple(args, "KKK", &base, &capacity, &counter))
        return nullptr;
    if (base == 0 || counter == 0 || capacity == 0) {
        PyErr_SetString(PyExc_ValueError, "attach() needs a mapping, a capacity and a counter");
        return nullptr;
    }
    // Never freed: completions may still arrive from backend threads after detach().
    Ring *ring = new Ring{reinterpret_cast<unsigned char *>(base), capacity, reinterpret_cast<uint64_t *>(counter)};
    static bool fork_handler = false;
    if (!fork_handler) {  // a forked child (a data-loader worker) must not write into its parent's ring
        fork_handler = pthread_atfork(nullptr, nullptr, [] { g_ring.store(nullptr, std::memory_order_relaxed); }) == 0;
    }
    g_ring.store(ring, std::memory_order_release);
    Py_RETURN_NONE;
}

PyObject *py_detach(PyObject *, PyObject *)
{
    Py_BEGIN_ALLOW_THREADS
    drain_polled();
    Py_END_ALLOW_THREADS
    g_ring.store(nullptr, std::memory_order_release);
    Py_RETURN_NONE;
}

/* register_group(name, gid, ranks): the group's id and members, as the Python tracer records them. */
PyObject *py_register_group(PyObject *, PyObject *args)
{
    const char *name;
    Py_ssize_t name_len;
    unsigned int gid;
    PyObject *ranks;
    if (!PyArg_ParseTuple(args, "s#IO", &name, &name_len, &gid, &ranks))
        return nullptr;
    PyObject *seq = PySequence_Fast(ranks, "ranks must be a sequence of ints");
    if (seq == nullptr)
        return nullptr;
    std::vector<int> members;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long r = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (r == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return nullptr;
        }
        members.push_back((int)r);
    }
    Py_DECREF(seq);
    std::string key(name, name_len);
    std::lock_guard<std::mutex> lock(g_groups_mu);
    auto &slot = g_by_name[key];
    if (!slot) {
        slot = std::make_unique<Group>();
        slot->name = key;
    }
    slot->gid = gid;  // keeps its counters if the C++ side met the group first
    slot->ranks = std::move(members);
    Py_RETURN_NONE;
}

/* forget_groups(): a new process group world (destroy_process_group(None)); counters restart. */
PyObject *py_forget_groups(PyObject *, PyObject *)
{
    std::lock_guard<std::mutex> lock(g_groups_mu);
    g_by_pg.clear();
    g_by_name.clear();
    Py_RETURN_NONE;
}

void set_callback(PyObject *&slot, PyObject *fn)
{
    PyObject *old = slot;
    if (fn == Py_None) {
        slot = nullptr;
    } else {
        Py_INCREF(fn);
        slot = fn;
    }
    Py_XDECREF(old);
}

PyObject *py_set_resolver(PyObject *, PyObject *fn)
{
    set_callback(g_resolver, fn);
    Py_RETURN_NONE;
}

PyObject *py_set_on_wrap(PyObject *, PyObject *fn)
{
    set_callback(g_on_wrap, fn);
    Py_RETURN_NONE;
}

/* set_batched(flag): the calling thread is inside batch_isend_irecv (its records get BATCHED). */
PyObject *py_set_batched(PyObject *, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return nullptr;
    t_batched = on != 0;
    Py_RETURN_NONE;
}

PyObject *py_stats(PyObject *, PyObject *)
{
    return Py_BuildValue("{s:K,s:K,s:n}", "calls", (unsigned long long)g_calls.load(), "skipped",
                         (unsigned long long)g_skipped.load(), "hooked", (Py_ssize_t)(g_library ? 1 : 0));
}

PyMethodDef methods[] = {
    {"install", py_install, METH_VARARGS,
     "install(rows, poll_cpu=False) -> (cpu, device): the tracing kernel in front of c10d's CPU and CUDA kernels."},
    {"uninstall", py_uninstall, METH_NOARGS, "Restore the original kernels."},
    {"attach", py_attach, METH_VARARGS, "Write records into this ring (base, capacity, counter address)."},
    {"detach", py_detach, METH_NOARGS, "Stop writing records."},
    {"register_group", py_register_group, METH_VARARGS, "Record a group's id and global ranks."},
    {"forget_groups", py_forget_groups, METH_NOARGS, "Drop every group and its counters."},
    {"set_resolver", py_set_resolver, METH_O, "Python callable(name) that registers an unknown group."},
    {"set_on_wrap", py_set_on_wrap, METH_O, "Python callable(seq) told once when the ring wraps."},
    {"set_batched", py_set_batched, METH_O, "Mark this thread's next calls as one batch (or not)."},
    {"stats", py_stats, METH_NOARGS, "Calls recorded and skipped."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_c10d_hook", "MegaTrace's c10d dispatcher hook.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__c10d_hook(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m == nullptr)
        return nullptr;
    if (PyModule_AddStringConstant(m, "TORCH_VERSION", MEGATRACE_TORCH_VERSION) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
