"""What ``megatrace-check`` prints and writes: the cluster table, JSON, and node-exporter metrics.

The table starts with one line per result that is not OK, worst first; the
prolog takes the first of them as the node's drain reason. Then a grid of the
nodes by check group, worst node first, and the verdict line.
"""

from __future__ import annotations

import json
import os

from megatrace.check.results import ProbeResult, Status, worst
from megatrace.check.runner import CheckReport
from megatrace.files import write_atomic

# The grid's columns: a group of probes each, so that ~30 probes fit a terminal.
GROUPS: dict[str, tuple[str, ...]] = {
    "GPU errors": ("gpu.xid", "gpu.ecc", "gpu.remap", "gpu.retired", "gpu.dcgm"),
    "GPU heat": ("gpu.temperature", "gpu.clocks", "gpu.power"),
    "GPU links": ("gpu.pcie", "gpu.pcie_gen", "gpu.nvlink"),
    "GPU setup": (),  # every other gpu.* probe: nvml, count, driver, memory held, MIG, persistence
    "NIC": ("node.ib", "node.ib_errors", "node.ib_rate"),  # InfiniBand/RoCE ports: results per port
    "node": (),  # every other node.* probe: space, CPUs, memory, versions, clock
    "network": (),  # net.*: all-reduce bandwidth, the node x node bandwidth and latency matrix
}
_FALLBACK = {"gpu": "GPU setup", "node": "node", "net": "network"}
ALLOCATION_WIDE = ("net.allreduce", "net.matrix")  # one result for every node it measured
OK_ROWS_SHOWN = 16  # healthy nodes beyond these are counted, not listed (the JSON has them all)


def group_of(probe: str) -> str:
    """The grid column a probe's results are shown in."""
    for name, members in GROUPS.items():
        if probe in members:
            return name
    return _FALLBACK.get(probe.split(".", 1)[0], "node")


def _cell(results: list[ProbeResult]) -> str:
    """``-`` nothing checked, ``ok``, or the worst status with how many results have it."""
    if not results:
        return "-"
    status = worst(results)
    if status in (Status.OK, Status.SKIP):
        return "ok" if status == Status.OK else "-"
    n = sum(r.status == status for r in results)
    return status.value.upper() + (f" {n}" if n > 1 else "")


def grid(report: CheckReport, ok_rows: int = OK_ROWS_SHOWN) -> list[str]:
    """Nodes x check groups, the worst node first (then the one with most problems, then by name).

    An all-reduce or matrix result counts for every node of the allocation, a link's for both its ends.
    """
    by_node: dict[str, dict[str, list[ProbeResult]]] = {node: {} for node in report.nodes}
    for r in report.results:
        if r.probe in ALLOCATION_WIDE:
            concerned = report.nodes or [r.subject.node]
        else:  # a link's result is both ends'
            concerned = [r.subject.node] + ([r.subject.peer] if r.subject.peer else [])
        for node in concerned:
            by_node.setdefault(node, {}).setdefault(group_of(r.probe), []).append(r)
    columns = [g for g in GROUPS if any(g in groups for groups in by_node.values())]

    def key(node: str) -> tuple[int, int, str]:
        mine = [r for rs in by_node[node].values() for r in rs]
        return -worst(mine).rank, -sum(r.status in (Status.WARN, Status.FAIL) for r in mine), node

    order = sorted(by_node, key=key)
    rows = [[node, worst([r for rs in by_node[node].values() for r in rs]).value.upper()]
            + [_cell(by_node[node].get(g, [])) for g in columns] for node in order]
    healthy = [row for row in rows if row[1] in ("OK", "SKIP")]
    hidden = len(healthy) - ok_rows if len(healthy) > ok_rows else 0
    if hidden:
        rows = rows[:len(rows) - hidden]
    header = ["node", "verdict", *columns]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    if hidden:
        lines.append(f"... and {hidden} more node(s), all ok (--json lists every result)")
    return lines


def problems(report: CheckReport) -> list[ProbeResult]:
    """The results that are not OK, worst first (then by node and GPU): the table's first lines."""
    return sorted((r for r in report.results if r.status not in (Status.OK, Status.SKIP)),
                  key=lambda r: (-r.status.rank, r.subject.node, r.subject.gpu if r.subject.gpu is not None else -1))


def drain_reason(report: CheckReport) -> str | None:
    """The reason a prolog drains the node with: the worst problem, as ``megatrace: GPU1 XID 79 ...``."""
    bad = problems(report)
    return bad[0].drain_reason() if bad else None


def table(report: CheckReport) -> str:
    """The problems (worst first), the node x check grid, and the verdict line."""
    bad = problems(report)
    lines = [f"{r.status.value.upper():4} {r.subject.label():20} {r.probe:16} {r.message}" for r in bad]
    if bad:
        lines.append("")
    lines += grid(report)
    lines.append(f"verdict: {report.status.value} ({len(report.nodes)} node(s), {len(report.results)} checks, "
                 f"{report.elapsed_s:.1f} s)")
    return "\n".join(lines)


def prom_textfile(report: CheckReport, path: str | os.PathLike[str]) -> None:
    """Node-exporter textfile metrics: one status gauge per check and subject (0 ok/skip, 1 warn, 2 fail).

    Labels: node and probe, and where the subject has them gpu, port (a NIC port, "mlx5_0/1") and peer (the
    other end of a link). Node-exporter rejects a file with two series of the same labels: results that
    still share them (a probe that reports several findings of one GPU) are one series, the worst.
    """
    level = {Status.OK: 0, Status.SKIP: 0, Status.WARN: 1, Status.FAIL: 2}
    series: dict[str, int] = {}
    for r in report.results:
        labels = ",".join(f'{name}="{_esc(str(value))}"' for name, value in
                          (("node", r.subject.node), ("probe", r.probe), ("gpu", r.subject.gpu),
                           ("port", r.subject.port), ("peer", r.subject.peer)) if value is not None)
        series[labels] = max(series.get(labels, 0), level[r.status])
    lines = ["# HELP megatrace_check_status MegaTrace preflight: 0 ok, 1 warning, 2 failure",
             "# TYPE megatrace_check_status gauge"]
    lines += [f"megatrace_check_status{{{labels}}} {value}" for labels, value in series.items()]
    write_atomic(path, "\n".join(lines) + "\n")  # node-exporter must never read half a file


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_json(report: CheckReport, path: str | os.PathLike[str]) -> None:
    write_atomic(path, json.dumps(report.to_dict(), indent=1, default=str) + "\n")
