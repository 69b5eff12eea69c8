"""The torch.distributed tracer: records every collective and point-to-point call.

Two layers, one record per call:

* CPU (gloo) calls are recorded by the c10d dispatcher hook
  (:mod:`megatrace.trace.dispatch_hook`), below every caller of a process group: the
  Python API, DDP's reducer, functional collectives, FSDP, pipelining.
* :func:`install` also replaces the public functions of
  ``torch.distributed.distributed_c10d`` (and their re-exports in ``torch.distributed``)
  with thin wrappers. They record what the hook does not: accelerator (NCCL) calls, and
  every call when the hook is not built for this torch. A wrapper writes an "entered"
  record, calls the original, and records completion: at return for a blocking CPU call,
  from the work's future for an async CPU call, and from a polled device event or work for
  an accelerator call.

Any internal error disables the record for that call with one warning; the training call
itself always runs.

This module imports torch only inside :func:`install`.
"""

from __future__ import annotations

import atexit
import dis
import inspect
import os
import socket
import sys
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatrace.trace import ring_format as fmt
from megatrace.trace.completion import CompletionPoller, Handle, UnwaitedSweeper
from megatrace.trace.environment import filter_env, job_inputs, library_versions
from megatrace.trace.heartbeat import Heartbeat
from megatrace.trace.init_marker import write_marker
from megatrace.trace.ring_writer import RingIdentity, RingOpenError, RingWriter
from megatrace.trace.settings import TracerSettings
from megatrace.trace.warnings import warn_once

Op, Flag = fmt.Op, fmt.Flag
COLLECTIVE, SEND, RECV = 0, 1, 2
_FAILED = int(fmt.State.FAILED)
_COMPLETED = int(fmt.State.COMPLETED)


@dataclass(frozen=True)
class OpSpec:
    """How to read one torch.distributed function's arguments."""

    op: Op
    data: str | None  # the parameter whose bytes and dtype are recorded
    kind: int = COLLECTIVE
    flags: int = 0
    root: str | None = None  # global root / peer parameter
    group_root: str | None = None  # the same as a rank within the group
    always_async: bool = False


_T = int(Flag.TENSOR_API)
OP_SPECS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(Op.ALL_REDUCE, "tensor"),
    "all_gather": OpSpec(Op.ALL_GATHER, "tensor"),
    "all_gather_into_tensor": OpSpec(Op.ALL_GATHER, "input_tensor", flags=_T),
    "_all_gather_base": OpSpec(Op.ALL_GATHER, "input_tensor", flags=_T),
    "reduce_scatter": OpSpec(Op.REDUCE_SCATTER, "output"),
    "reduce_scatter_tensor": OpSpec(Op.REDUCE_SCATTER, "output", flags=_T),
    "_reduce_scatter_base": OpSpec(Op.REDUCE_SCATTER, "output", flags=_T),
    "broadcast": OpSpec(Op.BROADCAST, "tensor", root="src", group_root="group_src"),
    "reduce": OpSpec(Op.REDUCE, "tensor", root="dst", group_root="group_dst"),
    "all_gather_single": OpSpec(Op.ALL_GATHER, "input_tensor", flags=_T),
    "reduce_scatter_single": OpSpec(Op.REDUCE_SCATTER, "output", flags=_T),
    "all_reduce_coalesced": OpSpec(Op.ALL_REDUCE, "tensors"),
    "gather": OpSpec(Op.GATHER, "tensor", root="dst", group_root="group_dst"),
    "scatter": OpSpec(Op.SCATTER, "tensor", root="src", group_root="group_src"),
    "all_to_all": OpSpec(Op.ALL_TO_ALL, "input_tensor_list"),
    "all_to_all_single": OpSpec(Op.ALL_TO_ALL, "input", flags=_T),
    "barrier": OpSpec(Op.BARRIER, None),
    "send": OpSpec(Op.SEND, "tensor", SEND, root="dst", group_root="group_dst"),
    "recv": OpSpec(Op.RECV, "tensor", RECV, root="src", group_root="group_src"),
    "isend": OpSpec(Op.SEND, "tensor", SEND, root="dst", group_root="group_dst", always_async=True),
    "irecv": OpSpec(Op.RECV, "tensor", RECV, root="src", group_root="group_src", always_async=True),
}


class GroupTrace:
    """Per-group counters: the collective sequence and one sequence per p2p peer and direction."""

    __slots__ = ("gid", "ranks", "seq", "send_seq", "recv_seq", "host_only")

    def __init__(self, gid: int, ranks: tuple[int, ...], host_only: bool = False) -> None:
        self.gid = gid
        self.ranks = ranks  # group rank -> global rank
        self.host_only = host_only  # its backend runs on CPU tensors only (gloo): barriers dispatch to CPU
        self.seq = 0
        self.send_seq: dict[int, int] = {}
        self.recv_seq: dict[int, int] = {}


class Tracer:
    """Process-wide tracer state. ``writer`` is None until init_process_group (or when tracing is off)."""

    def __init__(self) -> None:
        self.writer: RingWriter | None = None
        self.groups: dict[Any, GroupTrace] = {}
        self.gids: dict[int, str] = {}
        self.batch: list[Handle] | None = None  # handles of p2p ops inside batch_isend_irecv
        self.c10d: Any = None
        self.torch: Any = None
        self.waits: dict[Any, Handle] = {}  # gloo p2p works without a future -> their record
        self._device_poller: CompletionPoller | None = None
        self._sweeper: UnwaitedSweeper | None = None
        self._heartbeat: Heartbeat | None = None
        self._events: list[Any] = []  # free device events
        self.step = -1
        self.hook: Any = None  # megatrace.trace._c10d_hook, when it loads for this torch
        self.hooked_ops: list[str] = []
        self.hooked_device_ops: list[str] = []
        self.cpu_native = False  # the hook records CPU calls into this process's ring
        self.device_native = False  # ... and device (CUDA) calls

    # -- setup (cold) -----------------------------------------------------
    def start(self, settings: TracerSettings | None = None) -> None:
        """Create this rank's ring once the process group exists. Failure disables tracing with a warning."""
        if self.writer is not None:
            return
        c10d = self.c10d
        settings = settings or TracerSettings.from_env()
        env = os.environ
        local_rank = next((int(env[k]) for k in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
                           if env.get(k, "").isdigit()), -1)
        ident = RingIdentity(rank=c10d.get_rank(), world_size=c10d.get_world_size(), local_rank=local_rank,
                             job_id=settings.job_id, step_id=settings.step_id,
                             host=env.get("SLURMD_NODENAME") or socket.gethostname(), pid=os.getpid())
        try:
            writer = RingWriter(settings.directory, ident, settings.ring_records)
        except (RingOpenError, OSError, ValueError) as exc:
            warn_once("ring-open", f"{exc}; tracing is off for this process, training goes on")
            return
        self.writer = writer
        try:
            writer.start_pulse()
            self._heartbeat = Heartbeat(writer.beat)
            self._heartbeat.start()
        except Exception as exc:  # noqa: BLE001
            warn_once("heartbeat", f"no heartbeat ({exc!r}); a stopped rank is told from the records alone")
        if self.hook is None:  # now, not at install(): torch may still be importing then
            _install_dispatch_hook(self, self.torch)
        self.attach_hook()
        try:
            writer.write_meta("process", rank=ident.rank, world_size=ident.world_size, local_rank=local_rank,
                              host=ident.host, pid=ident.pid, argv=sys.argv,
                              **{"torch": getattr(self.torch, "__version__", ""), **library_versions(self.torch)},
                              backend=str(c10d.get_backend()), capture=self.capture())
            writer.write_meta("env", vars=filter_env(env))
            self.resolve(None)
        except Exception as exc:  # noqa: BLE001
            warn_once("meta", f"cannot record process facts: {exc!r}")
        try:  # the trainer's arguments and config files, parsed at analysis time (megatrace.analyze.jobconfig)
            writer.write_meta("job_inputs", **job_inputs(sys.argv))
        except Exception as exc:  # noqa: BLE001
            warn_once("job-inputs", f"cannot record the job's configuration: {exc!r}")
        atexit.register(self.shutdown)

    def attach_hook(self) -> None:
        """Let the dispatcher hook write CPU calls into this ring (it shares the C writer's counter)."""
        if self.hook is None or self.writer is None:
            return
        fast = getattr(self.writer, "fast", None)
        if fast is None:
            warn_once("hook-python-writer", "the ring writer runs without its C hot path, so the c10d hook "
                                            "cannot share it; only torch.distributed calls are traced")
            return
        try:
            self.hook.set_on_wrap(self.writer._on_wrap)
            self.hook.attach(*fast.shared_state())
        except Exception as exc:  # noqa: BLE001
            warn_once("hook-attach", f"c10d hook not attached ({exc!r}); only torch.distributed calls are traced")
            return
        self.cpu_native = True
        self.device_native = bool(self.hooked_device_ops)

    def capture(self) -> dict[str, Any]:
        """Which call paths this process records, for the trace's readers (see docs/trace-format.md)."""
        return {"dispatcher_cpu": self.hooked_ops if self.cpu_native else [],
                "dispatcher_device": self.hooked_device_ops if self.device_native else [], "python_api": True}

    def resolve_name(self, name: str) -> None:
        """The hook met a group by name before any Python call did: register it (runs with the GIL)."""
        try:
            for pg, pg_name in list(self.c10d._world.pg_names.items()):
                if pg_name == name:
                    self.resolve(pg)
                    return
        except Exception as exc:  # noqa: BLE001
            self.internal_error(exc)

    def shutdown(self) -> None:
        if self.cpu_native:  # before the mapping can go away with the interpreter
            self.hook.detach()
            self.cpu_native = self.device_native = False
        for poller in (self._device_poller, self._sweeper, self._heartbeat):
            if poller is not None:
                poller.stop()
        if self.writer is not None:
            self.writer.close()

    def resolve(self, group: Any) -> GroupTrace | None:
        """Find or register the group of a call; None for a rank outside the group (torch skips the call)."""
        c10d = self.c10d
        pg = c10d._get_default_group() if group is None else group
        if pg is c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        gt = self.groups.get(pg)
        if gt is None:
            ranks = tuple(c10d.get_process_group_ranks(pg))
            name = str(getattr(pg, "group_name", "") or "")
            gid = zlib.crc32(f"torch:{name}".encode())
            if gid in self.gids and self.gids[gid] != name:
                warn_once("gid-collision", f"group ids of {name!r} and {self.gids[gid]!r} collide")
            self.gids[gid] = name
            desc = str(getattr(pg, "group_desc", "") or "")
            try:
                backend = str(c10d.get_backend(pg))
            except Exception:  # noqa: BLE001
                backend = ""
            gt = GroupTrace(gid, ranks, host_only=backend == "gloo")
            self.groups[pg] = gt
            if self.hook is not None:
                self.hook.register_group(name, gid, ranks)
            assert self.writer is not None
            self.writer.write_meta("group", gid=gid, name=name, desc=desc, ranks=list(ranks), backend=backend)
        if group is None:
            self.groups[None] = gt
        return gt

    def forget(self, group: Any) -> None:
        """Drop our references to destroyed groups, so torch tears them down when it means to.

        Holding a destroyed gloo group until interpreter exit lets its threads be torn down
        during finalization, which aborts the process ('terminate called ...')."""
        if group is None:
            self.groups.clear()
            if self.hook is not None:
                self.hook.forget_groups()
        else:
            gt = self.groups.pop(group, None)
            if gt is not None and self.groups.get(None) is gt:
                del self.groups[None]

    # -- completion -------------------------------------------------------
    def _future_done(self, handle: Handle, fut: Any) -> None:
        try:
            fut.value()
            state = _COMPLETED
        except Exception:  # noqa: BLE001 - the collective failed
            state = _FAILED
        writer = self.writer
        if writer is not None:
            writer.complete(handle, state)

    def device_poller(self) -> CompletionPoller:
        if self._device_poller is None:
            self._device_poller = CompletionPoller(name="megatrace-device-completion")
        return self._device_poller

    def sweeper(self) -> UnwaitedSweeper:
        if self._sweeper is None:
            self._sweeper = UnwaitedSweeper(self.waits, _work_done, self.finish_wait)
        return self._sweeper

    def finish_wait(self, work: Any, state: int) -> None:
        """Record a waited work's completion, once, whoever (wait() or the sweeper) sees it first."""
        handle = self.waits.pop(work, None)
        if handle is not None and self.writer is not None:
            self.writer.complete(handle, state)

    def _event_done(self, handle: Handle, event: Any, state: int) -> None:
        self.writer.complete(handle, state)  # type: ignore[union-attr]
        self._events.append(event)

    def track(self, handle: Handle, work: Any, device: bool) -> None:
        """Record completion of an op the caller did not wait for (or whose device work is still running)."""
        writer = self.writer
        assert writer is not None
        if work is None and self.batch is not None:
            self.batch.append(handle)  # coalesced: completes with the batch's works
            return
        if device:
            if work is not None and hasattr(work, "is_completed"):
                self.device_poller().add(_work_probe(work), partial(writer.complete, handle))
            else:  # a blocking device call returned after enqueue: time it with an event on the stream
                event = self._events.pop() if self._events else self.torch.cuda.Event()
                event.record()
                self.device_poller().add(event.query, partial(self._event_done, handle, event))
            return
        if work is None:
            writer.complete(handle)
            return
        try:
            future = work.get_future()
        except Exception:  # noqa: BLE001 - gloo p2p works have no future: wait() records them
            self.waits[work] = handle
            if self._sweeper is None:
                self.sweeper().start()
            return
        future.add_done_callback(partial(self._future_done, handle))

    def internal_error(self, exc: BaseException) -> None:
        warn_once(f"internal:{type(exc).__name__}", f"tracer error ignored, training goes on: {exc!r}")


TRACER = Tracer()


def _work_done(work: Any) -> bool:
    """False while a Work runs, True once it is done; raises if it failed."""
    if not work.is_completed():
        return False
    if work.exception() is not None:  # gloo marks a failed p2p work completed, with an exception
        raise RuntimeError("work failed")
    return True


def _work_probe(work: Any) -> Any:
    """A poller probe for a Work (see :func:`_work_done`)."""
    return partial(_work_done, work)


# -- wrappers -------------------------------------------------------------------
def _describe_many(data: Any, dtypes: dict[Any, int]) -> tuple[int, int, int]:
    """(bytes, dtype code, device flag) of a list of tensors, or of nothing."""
    if not data:
        return 0, 0, 0
    nbytes = 0
    for t in data:
        nbytes += t.nbytes
    first = data[0]
    return nbytes, dtypes.get(first.dtype, 0), (4 if first.is_cuda else 0)


def _positions(orig: Any, *names: str | None) -> list[int]:
    """Positional index of each named parameter of ``orig`` (a large number when absent or None)."""
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        params = []
    return [params.index(n) if n in params else 1 << 30 for n in names]


def _make_wrapper(name: str, orig: Any, spec: OpSpec, tracer: Tracer, dtypes: dict[Any, int]) -> Any:
    di, gi, ai, ri, gri = _positions(orig, spec.data, "group", "async_op", spec.root, spec.group_root)
    dn, rn, grn = spec.data, spec.root, spec.group_root
    op, base_flags, kind, always_async = int(spec.op), spec.flags, spec.kind, spec.always_async
    async_flag, batched_flag = int(Flag.ASYNC), int(Flag.BATCHED)
    tensor_type = tracer.torch.Tensor

    def traced(*args: Any, **kwargs: Any) -> Any:
        writer = tracer.writer
        if writer is None:
            return orig(*args, **kwargs)
        handle = None
        try:
            n = len(args)
            group = args[gi] if gi < n else kwargs.get("group")
            gt = tracer.groups.get(group)
            if gt is None:
                gt = tracer.resolve(group)
            if gt is not None:
                data = args[di] if di < n else kwargs.get(dn)
                if type(data) is tensor_type or isinstance(data, tensor_type):
                    nbytes, dtype, device = data.nbytes, dtypes.get(data.dtype, 0), (4 if data.is_cuda else 0)
                else:
                    nbytes, dtype, device = _describe_many(data, dtypes)
                # A call without data (a barrier) runs on the group's device: CPU for gloo, the GPU otherwise.
                on_device = bool(device) if data is not None else not gt.host_only
                if tracer.device_native if on_device else tracer.cpu_native:
                    gt = None  # the dispatcher hook records this call (the call itself runs below, once)
            if gt is not None:
                is_async = always_async or bool(args[ai] if ai < n else kwargs.get("async_op"))
                flags = base_flags | device
                if is_async:
                    flags |= async_flag
                if tracer.batch is not None:
                    flags |= batched_flag
                peer = -1
                if rn is not None:
                    peer = args[ri] if ri < n else kwargs.get(rn)
                    if peer is None:
                        group_peer = args[gri] if gri < n else kwargs.get(grn)
                        peer = -1 if group_peer is None else gt.ranks[group_peer]
                if kind == COLLECTIVE:
                    gt.seq += 1
                    handle = writer.begin(op, gt.gid, gt.seq, nbytes, peer, dtype, flags)
                else:
                    counters = gt.send_seq if kind == SEND else gt.recv_seq
                    seq = counters.get(peer, 0) + 1
                    counters[peer] = seq
                    handle = writer.begin(op, gt.gid, seq, nbytes, peer, dtype, flags)
        except Exception as exc:  # noqa: BLE001 - never break the training call
            tracer.internal_error(exc)
            handle = None
        if handle is None:
            return orig(*args, **kwargs)
        try:
            work = orig(*args, **kwargs)
        except BaseException:
            writer.complete(handle, _FAILED)
            raise
        if is_async or device:
            try:
                tracer.track(handle, work, bool(device))
            except Exception as exc:  # noqa: BLE001
                tracer.internal_error(exc)
        else:
            writer.complete_now(handle)
        return work

    traced.__name__ = name
    traced.__qualname__ = name
    traced.__doc__ = orig.__doc__
    traced.__wrapped__ = orig  # type: ignore[attr-defined]
    traced._megatrace = True  # type: ignore[attr-defined]
    return traced


def _make_batch_wrapper(orig: Any, tracer: Tracer) -> Any:
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        if tracer.writer is None:
            return orig(p2p_op_list)
        outer, tracer.batch = tracer.batch, []
        hook = tracer.hook if tracer.cpu_native else None
        if hook is not None:
            hook.set_batched(True)
        try:
            works = orig(p2p_op_list)
        finally:
            coalesced, tracer.batch = tracer.batch, outer
            if hook is not None:
                hook.set_batched(outer is not None)
        if coalesced:  # inner ops returned no work of their own: they finish with the batch
            try:
                last = works[-1] if works else None
                for handle in coalesced:
                    tracer.track(handle, last, True) if last is not None else tracer.writer.complete(handle)
            except Exception as exc:  # noqa: BLE001
                tracer.internal_error(exc)
        return works

    batch_isend_irecv.__doc__ = orig.__doc__
    batch_isend_irecv.__wrapped__ = orig  # type: ignore[attr-defined]
    batch_isend_irecv._megatrace = True  # type: ignore[attr-defined]
    return batch_isend_irecv


def _make_wait_wrapper(orig: Any, tracer: Tracer) -> Any:
    """Work.wait: the moment a program learns that a future-less (gloo p2p) work has ended."""
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = orig(self, *args, **kwargs)
        except BaseException:
            if tracer.waits:
                tracer.finish_wait(self, _FAILED)
            raise
        if tracer.waits:
            tracer.finish_wait(self, _COMPLETED)
        return result

    wait.__doc__ = orig.__doc__
    wait._megatrace = True  # type: ignore[attr-defined]
    return wait


def _make_lifecycle_wrapper(orig: Any, tracer: Tracer, after: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if after == "init" and tracer.writer is None:  # a rank stuck in its rendezvous leaves this much
            write_marker(args, kwargs)
        result = orig(*args, **kwargs)
        try:
            if after == "init":
                tracer.start()
            elif after == "destroy":
                tracer.forget(args[0] if args else kwargs.get("group"))
            elif tracer.writer is not None and result is not None:
                tracer.resolve(result)
        except Exception as exc:  # noqa: BLE001
            tracer.internal_error(exc)
        return result

    wrapper.__name__ = orig.__name__
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper._megatrace = True  # type: ignore[attr-defined]
    return wrapper


def _dtype_codes(torch: Any) -> dict[Any, int]:
    D = fmt.Dtype
    names = {"float32": D.FLOAT32, "float16": D.FLOAT16, "bfloat16": D.BFLOAT16, "float64": D.FLOAT64,
             "int8": D.INT8, "uint8": D.UINT8, "int16": D.INT16, "int32": D.INT32, "int64": D.INT64,
             "bool": D.BOOL, "float8_e4m3fn": D.FLOAT8_E4M3, "float8_e5m2": D.FLOAT8_E5M2,
             "complex64": D.COMPLEX64, "complex128": D.COMPLEX128}
    return {getattr(torch, n): int(code) for n, code in names.items() if hasattr(torch, n)}


# Present in every supported torch; the others come and go between versions.
_REQUIRED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
             "all_to_all_single", "barrier", "send", "recv", "isend", "irecv")


def _delegates(func: Any) -> bool:
    """True when ``func`` calls another traced function as a global (e.g. torch 2.13's ``send`` calls
    ``isend``, ``all_gather_into_tensor`` calls ``all_gather_single``): wrapping both would record twice."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    if code is None:
        return False
    called = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    return bool(called & (OP_SPECS.keys() - {func.__name__}))


def _install_dispatch_hook(tracer: Tracer, torch: Any) -> None:
    """Put the native kernel in front of c10d's CPU and CUDA kernels; say once what is lost without it."""
    from megatrace.trace import dispatch_hook

    try:
        hook = dispatch_hook.load(torch)
        rows, skipped = dispatch_hook.spec_rows(torch)
        tracer.hooked_ops, tracer.hooked_device_ops = hook.install(rows, dispatch_hook.poll_cpu())
        hook.set_resolver(tracer.resolve_name)
    except Exception as exc:  # noqa: BLE001 - HookUnavailable, or a registration the dispatcher refused
        warn_once("dispatch-hook", f"{exc}; collectives that PyTorch issues from C++ (DDP's gradient "
                                   "all-reduces, functional collectives, DTensor) are not traced, only "
                                   "calls of the torch.distributed functions")
        return
    tracer.hook = hook
    if skipped:
        warn_once("dispatch-hook-skipped", f"c10d operators with an unknown schema are traced only through "
                                           f"torch.distributed: {', '.join(skipped)}")


def install(c10d: Any = None) -> bool:
    """Wrap torch.distributed's communication functions; idempotent. Returns True when active."""
    try:
        import torch
        if c10d is None:
            from torch.distributed import distributed_c10d as c10d
    except Exception as exc:  # noqa: BLE001
        warn_once("no-torch", f"torch.distributed is not importable ({exc!r}); nothing to trace")
        return False
    if getattr(c10d, "_megatrace_installed", False):
        return True
    tracer = TRACER
    tracer.c10d, tracer.torch = c10d, torch
    dtypes = _dtype_codes(torch)
    dist = sys.modules.get("torch.distributed")
    replaced: dict[str, Any] = {}
    for name, spec in OP_SPECS.items():
        orig = getattr(c10d, name, None)
        if orig is None or _delegates(orig):
            if orig is None and name in _REQUIRED:
                warn_once(f"missing:{name}", f"torch {torch.__version__} has no torch.distributed.{name}; "
                                             "it is not traced")
            continue
        replaced[name] = _make_wrapper(name, orig, spec, tracer, dtypes)
    work_type = getattr(c10d, "Work", None)
    if work_type is not None and not getattr(work_type.wait, "_megatrace", False):
        work_type.wait = _make_wait_wrapper(work_type.wait, tracer)
    if hasattr(c10d, "batch_isend_irecv"):
        replaced["batch_isend_irecv"] = _make_batch_wrapper(c10d.batch_isend_irecv, tracer)
    for name in ("init_process_group",):
        replaced[name] = _make_lifecycle_wrapper(getattr(c10d, name), tracer, "init")
    for name, after in (("new_group", "group"), ("destroy_process_group", "destroy")):
        if hasattr(c10d, name):
            replaced[name] = _make_lifecycle_wrapper(getattr(c10d, name), tracer, after)
    for name, wrapper in replaced.items():
        orig = getattr(c10d, name)
        setattr(c10d, name, wrapper)
        if dist is not None and getattr(dist, name, None) is orig:
            setattr(dist, name, wrapper)
    c10d._megatrace_installed = True
    if c10d.is_initialized():  # installed after init_process_group: start now
        tracer.start()
    return True
