"""NCCL Inspector output written from a trace: :func:`write_inspector` writes each rank's completed collectives in
the plugin's JSON format (header, metadata, coll_perf; ``event_trace_ts`` when verbose), one file per process
named ``<host>-pid<pid>.log`` as the plugin names them.

Used by tests/test_import_inspector.py, tests/test_import_bad_input.py and tests/test_import_properties.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrace.load.traceset import TraceSet
from megatrace.trace.ring_format import Op, State

COLL = {Op.ALL_REDUCE: "AllReduce", Op.ALL_GATHER: "AllGather", Op.REDUCE_SCATTER: "ReduceScatter",
        Op.BROADCAST: "Broadcast", Op.REDUCE: "Reduce", Op.ALL_TO_ALL: "AllToAll",
        Op.BARRIER: "AllReduce"}  # (torch runs an NCCL barrier as a one-element all-reduce)


def write_inspector(trace: TraceSet, out: Path, verbose: bool = True, name=None) -> dict[int, int]:
    """The demo's completed collectives as Inspector JSON lines; returns rank -> records written."""
    out.mkdir(parents=True, exist_ok=True)
    rec, written = trace.records, {}
    for rank in trace.ranks.tolist():
        info = trace.info(rank)
        lines = []
        for i in range(trace.rows(rank).start, trace.rows(rank).stop):
            op = int(rec.op[i])
            if op not in COLL or rec.state[i] != State.COMPLETED:
                continue
            members = trace.groups[int(rec.group_id[i])].ranks
            t0 = (info.anchor_wall_ns + int(rec.t_enqueue[i]) - info.anchor_mono_ns) // 1000
            t1 = (info.anchor_wall_ns + int(rec.t_complete[i]) - info.anchor_mono_ns) // 1000
            perf = {"coll": COLL[op], "coll_sn": int(rec.group_seq[i]), "coll_msg_size_bytes": int(rec.nbytes[i]),
                    "coll_exec_time_us": t1 - t0, "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0,
                    "coll_busbw_gbs": 1.0, "coll_algo": "RING", "coll_proto": "LL"}
            if verbose:
                perf["event_trace_ts"] = {"coll_start_ts": t0, "coll_stop_ts": t0 + 3, "kernel_events": [
                    {"channel_id": 0, "kernel_start_ts": t0 + 3, "kernel_stop_ts": t1, "kernel_record_ts": t1}]}
            lines.append(json.dumps({
                "header": {"id": f"0x{int(rec.group_id[i]):x}", "rank": members.index(rank), "n_ranks": len(members),
                           "nnodes": 1},
                "metadata": {"inspector_output_format_version": "v4.2", "git_rev": "", "dump_timestamp_us": t1 + 400,
                             "rec_mechanism": "nccl_profiler_interface", "hostname": info.host, "pid": info.pid},
                "coll_perf": perf}))
        written[rank] = len(lines)
        file = name(rank, info) if name else f"{info.host}-pid{info.pid}.log"
        (out / file).write_text("\n".join(lines) + "\n")
    return written
