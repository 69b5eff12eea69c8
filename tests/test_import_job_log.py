"""Job output logs: the hang verdict from PyTorch's NCCL watchdog lines, as `megatrace analyze slurm-<id>.out` gives it.

Real watchdog lines need NCCL and a GPU, which CI lacks, so the lines here are written from the format strings of
``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` (pytorch/pytorch) as each version builds them:

* ``WorkNCCL::checkTimeout``: ``c10::str(logPrefix(), "Watchdog caught collective operation timeout: ", *this,
  " ran for ", ms, " milliseconds before timing out.")`` with ``operator<<``'s ``WorkNCCL(SeqNum=S, OpType=OP,
  NumelIn=N, NumelOut=M, Timeout(ms)=T)`` and ``WorkNCCL::logPrefix()`` = ``"[Rank " rank "] "`` (every version);
* the watchdog's ``"Timeout at NCCL work: ", seq, ", last enqueued NCCL work: ", E, ", last completed NCCL work: ",
  C, "."`` (2.3-2.6), and 2.7's ``" failure detected by watchdog at work sequence id: ", seq, " PG status: last
  enqueued work: ", E, ", last completed work: ", C`` (two spaces after the prefix, no period);
* ``getNCCLWatchdogTimeoutErrorMsg``: ``"Received a dump signal due to a collective timeout from ", extra, " and we
  will try our best to dump the debug info. Last enqueued NCCL work: ", E, ", last completed NCCL work: ", C, ".This
  is most likely ..."`` with ``extra`` = ``" rank " R`` (so "from  rank R", two spaces) (2.5+);
* ``ProcessGroupNCCL::logPrefix()``: ``[PG 0 Rank R]`` (2.3), ``[PG ID 0 PG GUID 0(default_pg) Rank R]`` (2.5+);
  the c10 logger's ``[rankR]:[E1204 06:01:02.123456789 ProcessGroupNCCL.cpp:LINE] `` (2.4+),
  ``[E ProcessGroupNCCL.cpp:LINE] `` before; the excepthook's ``[rankR]: `` on every traceback line;
* Slurm's ``srun: error: NODE: tasks LIST: Exited with exit code N`` (src/srun/launch.c ``_task_finish``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.load.importers.job_log_lines import read_job_log
from megatrace.load.traceset import TraceLoadError

PREFIX_25 = "[PG ID 0 PG GUID 0(default_pg) Rank {r}]"
PREFIX_23 = "[PG 0 Rank {r}]"


def c10(rank: int, line: int, text: str, stamp: bool = True) -> str:
    """A line of torch's C++ logger with its global-rank prefix."""
    head = f"[E1204 06:01:02.{123456789 + rank:09d} ProcessGroupNCCL.cpp:{line}]" if stamp else \
        f"[E ProcessGroupNCCL.cpp:{line}]"
    return f"[rank{rank}]:{head} {text}"


def watchdog(rank: int, seq: int, op: str = "ALLREDUCE", numel: int = 1048576, stamp: bool = True) -> str:
    work = f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000)"
    return c10(rank, 632, f"[Rank {rank}] Watchdog caught collective operation timeout: {work} ran for "
                          f"{600000 + rank} milliseconds before timing out.", stamp)


def timeout_at(rank: int, seq: int, enq: int, done: int, prefix: str = PREFIX_25, stamp: bool = True) -> str:
    return c10(rank, 1709, f"{prefix.format(r=rank)} Timeout at NCCL work: {seq}, last enqueued NCCL work: {enq}, "
                           f"last completed NCCL work: {done}.", stamp)


def failure_27(rank: int, seq: int, enq: int, done: int) -> str:
    return c10(rank, 2299, f"{PREFIX_25.format(r=rank)}  failure detected by watchdog at work sequence id: {seq} PG "
                           f"status: last enqueued work: {enq}, last completed work: {done}")


def dump_signal(rank: int, src: int, enq: int, done: int) -> str:
    return c10(rank, 1987, f"{PREFIX_25.format(r=rank)} Received a dump signal due to a collective timeout from  rank "
                           f"{src} and we will try our best to dump the debug info. Last enqueued NCCL work: {enq}, "
                           f"last completed NCCL work: {done}.This is most likely caused by incorrect usages of "
                           f"collectives, e.g., wrong sizes used across ranks, the order of collectives is not same for "
                           f"all ranks or the scheduled collective, for some reason, didn't run. ")


def write(tmp_path: Path, lines: list[str], name: str = "slurm-4242.out") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(["step 30 | loss 2.31 | 512 ms", *lines, ""]))
    return path


def hung_job(world: int, culprit: int, seq: int = 812) -> list[str]:
    """torch 2.5+: every rank but the culprit times out in collective ``seq``; the culprit answers the dump signal."""
    lines = []
    for r in range(world):
        if r != culprit:
            lines += [watchdog(r, seq), timeout_at(r, seq, seq, seq - 1)]
    lines.append(dump_signal(culprit, 0, seq - 1, seq - 1))
    lines.append(f"srun: error: n1: tasks 0-{world - 1}: Exited with exit code 1")
    return lines


def test_the_rank_behind_in_the_default_group_is_the_culprit(tmp_path: Path) -> None:
    result = analyze(write(tmp_path, hung_job(8, culprit=5)))
    top = result.findings[0]
    assert top.kind == Kind.COMPUTE_HANG and top.subject.rank == 5, top.verdict
    assert top.severity == Severity.CRITICAL
    assert "all_reduce #812" in top.verdict and "7 ranks wait for it" in top.verdict
    assert "last enqueued 811, last completed 811" in " ".join(map(str, top.evidence))
    assert " before the end" not in top.verdict + " ".join(map(str, top.evidence))  # a log has no times
    # the task exits after the timeout are the watchdog's abort, not crashes
    assert not [f for f in result.findings if f.kind == Kind.CRASHED_PROCESS]


def test_older_and_newer_watchdog_wordings_give_the_same_verdict(tmp_path: Path) -> None:
    old = []  # torch 2.3: "[PG 0 Rank R]", no time in the logger's prefix, no dump signal: the culprit is silent
    for r in range(4):
        if r != 2:
            old += [watchdog(r, 40, stamp=False), timeout_at(r, 40, 40, 39, PREFIX_23, stamp=False)]
    new = [failure_27(r, 40, 40, 39) if r != 2 else dump_signal(r, 0, 39, 39) for r in range(4)]  # torch 2.7+
    for name, lines, kind in (("old", old, Kind.NO_TRACE), ("new", new, Kind.COMPUTE_HANG)):
        (tmp_path / name).mkdir()
        top = analyze(write(tmp_path / name, lines)).findings[0]
        assert top.subject.rank == 2 and top.kind == kind, (name, top.verdict)
        if name == "old":
            assert "printed nothing" in " ".join(map(str, top.evidence))


def test_a_rank_that_crashed_before_the_timeouts_is_the_crash(tmp_path: Path) -> None:
    lines = ["[rank3]: Traceback (most recent call last):",
             '[rank3]:   File "/work/train.py", line 88, in <module>',
             "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
             "srun: error: n2: task 3: Exited with exit code 1"]
    for r in (0, 1, 2):
        lines += [watchdog(r, 9), timeout_at(r, 9, 9, 8)]
    lines += ["[rank0]: Traceback (most recent call last):",  # the victims' own errors come after: consequences
              "[rank0]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0."]
    top = analyze(write(tmp_path, lines)).findings[0]
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 3, top.verdict
    assert "OutOfMemoryError" in " ".join(map(str, top.evidence))


def test_a_group_other_than_the_default_one_names_the_rank_behind_in_it(tmp_path: Path) -> None:
    # TP group "5" of ranks 4-7: local ranks in the tag, global ranks from the logger's prefix
    tp = "[PG ID 2 PG GUID 5(tp) Rank {r}]"
    lines = [timeout_at(g, 77, 77, 76, tp.replace("{r}", str(g - 4))) for g in (4, 5, 7)]
    lines.append(c10(6, 1987, f"{tp.format(r=2)} Received a dump signal due to a collective timeout from  rank 4 and "
                              f"we will try our best to dump the debug info. Last enqueued NCCL work: 76, last "
                              f"completed NCCL work: 76."))
    lines += [timeout_at(r, 300, 300, 299) for r in range(8) if r < 4]  # the default group: ranks 0-3 wait on 4-7
    lines += [c10(r, 1987, f"{PREFIX_25.format(r=r)} Received a dump signal due to a collective timeout from  rank 0 "
                           f"and we will try our best to dump the debug info. Last enqueued NCCL work: 299, last "
                           f"completed NCCL work: 299.") for r in range(4, 8)]
    top = analyze(write(tmp_path, lines)).findings[0]
    assert top.subject.rank == 6, top.verdict


def test_every_rank_at_minus_one_is_a_stop_outside_communication(tmp_path: Path) -> None:
    lines = [dump_signal(r, 0, -1, -1) for r in range(4)]
    top = analyze(write(tmp_path, lines)).findings[0]
    assert top.kind == Kind.POSSIBLE_HANG and top.severity == Severity.WARNING, top.verdict
    assert "no collective was in flight" in " ".join(map(str, top.evidence))


def test_a_log_without_watchdog_lines_is_refused_by_name_unless_a_rank_crashed(tmp_path: Path) -> None:
    path = write(tmp_path, ["epoch 1 loss 2.31", "[rank0]: saving checkpoint"])
    with pytest.raises(TraceLoadError, match=r"slurm-4242\.out: no NCCL watchdog position in it"):
        analyze(path)
    crashed = write(tmp_path, ["[rank0]: Traceback (most recent call last):", "[rank0]: ValueError: bad config"])
    top = analyze(crashed).findings[0]  # (how the job ended is all it says, and that is the verdict)
    assert top.kind == Kind.CRASHED_PROCESS and top.subject.rank == 0, top.verdict
    assert "ValueError: bad config" in " ".join(map(str, top.evidence)), top.evidence
    garbage = tmp_path / "garbage.out"
    garbage.write_bytes(bytes(range(256)) * 4096 + b"\xff" * 200_000)  # binary, one enormous line
    proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(garbage)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "garbage.out: no NCCL watchdog position" in proc.stderr


def test_the_command_reads_a_file_or_the_directory_sbatch_wrote_it_into(tmp_path: Path) -> None:
    log = write(tmp_path, hung_job(4, culprit=1))
    for target in (log, tmp_path):
        proc = subprocess.run([sys.executable, "-m", "megatrace.cli", "analyze", str(target)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("VERDICT [critical] rank 1 "), proc.stdout
    assert (tmp_path.parent / f"{tmp_path.name}-megatrace" / "report.html").is_file()
    assert (tmp_path / "slurm-4242.out-megatrace" / "findings.json").is_file()  # beside the log, never into it


def test_reading_is_one_pass_and_keeps_what_it_needs(tmp_path: Path) -> None:
    lines = [f"[rank0]:iteration {i} loss 1.0" for i in range(200_000)] + hung_job(4, culprit=2)
    log = read_job_log(write(tmp_path, lines))
    assert log.lines == 1 + 200_000 + len(hung_job(4, culprit=2))
    assert sorted(log.ranks) == [0, 1, 2, 3] and log.ranks[2].groups["0"].enqueued == 811
