"""Slurm glue: host lists, the collector's and the agent's srun lines, on-hang actions."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrace.collect.slurm import agent_command, collect_command, expand_hostlist, hang_action


def test_slurm_host_lists_expand_like_scontrol() -> None:
    assert expand_hostlist("n[1-3],gpu[08-10,12],login") == ["n1", "n2", "n3", "gpu08", "gpu09", "gpu10", "gpu12",
                                                              "login"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(ValueError):
        expand_hostlist("n[1-")


def test_the_srun_line_overlaps_the_hung_step_with_one_pmi2_task_per_node() -> None:
    cmd = collect_command("1234", "/home/a/run", trigger="hang", nodes=4, python="/venv/bin/python")
    assert cmd[:6] == ["srun", "--jobid=1234", "--overlap", "--mpi=pmi2", "--ntasks-per-node=1",
                       "--kill-on-bad-exit=0"]
    assert "--nodes=4" in cmd and cmd[cmd.index("--trigger") + 1] == "hang"
    assert cmd[cmd.index("/venv/bin/python"):][:4] == ["/venv/bin/python", "-m", "megatrace.cli", "collect"]


def test_the_agent_srun_line_runs_one_agent_per_node() -> None:
    cmd = agent_command("7", "/job", hang_timeout_s=120, on_hang="requeue", nodes=2, python="py")
    assert cmd[:4] == ["srun", "--jobid=7", "--overlap", "--ntasks-per-node=1"]
    assert cmd[cmd.index("py"):][:4] == ["py", "-m", "megatrace.cli", "agent"]
    assert cmd[cmd.index("--on-hang") + 1] == "requeue"


def test_on_hang_actions_outside_slurm_do_nothing() -> None:
    assert "keeps running" in hang_action("report", "1", env={})
    assert "skipped" in hang_action("cancel", None, env={})
    assert "skipped" in hang_action("requeue", "local", env={"SLURM_JOB_ID": "5"})
    with pytest.raises(ValueError):
        hang_action("reboot", "1", env={})


def test_without_mpi4py_the_collector_says_to_use_local(monkeypatch, tmp_path) -> None:
    import sys

    from megatrace.collect.run import CollectError, CollectOptions, collect_mpi

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(CollectError, match="--local"):
        collect_mpi(CollectOptions(job_dir=str(tmp_path)))


def test_the_job_end_time_comes_from_scontrol_fields_and_unlimited_jobs_have_none() -> None:
    import time

    from megatrace.collect.slurm import end_time

    fields = {"TimeLimit": "00:02:00", "EndTime": "2026-12-02T15:55:43"}
    assert end_time(fields) == time.mktime((2026, 12, 2, 15, 55, 43, 0, 0, -1))
    assert end_time({"TimeLimit": "UNLIMITED", "EndTime": "2027-12-02T15:55:43"}) is None
    assert end_time({"TimeLimit": "00:02:00", "EndTime": "Unknown"}) is None
    assert end_time({}) is None


def test_the_reason_goes_into_the_jobs_output_file_but_never_through_a_link(tmp_path) -> None:
    from megatrace.collect.slurm import _clip, say_in_job_output

    out = tmp_path / "out.txt"
    out.write_text("training...\n")
    assert say_in_job_output({"StdOut": str(out)}, "megatrace: hang confirmed")
    assert out.read_text() == "training...\nmegatrace: hang confirmed\n"
    link = tmp_path / "link.txt"
    link.symlink_to(out)
    assert not say_in_job_output({"StdOut": str(link)}, "again")
    assert not say_in_job_output({"StdOut": "/dev/null"}, "x") and not say_in_job_output({}, "x")
    assert out.read_text().count("megatrace") == 1
    assert _clip("megatrace: hang confirmed; rank 5 stopped", 30) == "megatrace: hang confirmed…"  # a whole word
    assert _clip("short", 30) == "short"


def test_a_job_record_is_never_split_at_a_blank_inside_a_value() -> None:
    """Issue 20, item 9: `scontrol show job` output was split on blanks (a StdOut path with spaces was cut, and a
    job name could stand in for later fields)."""
    from megatrace.collect.slurm import parse_job_record

    text = ("JobId=42 JobName=train EndTime=2000-01-01T00:00:00 StdOut=/tmp/evil\n"
            "   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A\n"
            "   RunTime=00:01:02 TimeLimit=01:00:00 TimeMin=N/A\n"
            "   StartTime=2026-12-03T10:00:00 EndTime=2026-12-03T11:00:00 Deadline=N/A\n"
            "   ReqNodeList=(null) ExcNodeList=n3\n"
            "   Command=/home/alice/run 1/job.sh\n"
            "   WorkDir=/home/alice/run 1\n"
            "   Comment=megatrace: hang confirmed; on-hang=cancel StdOut=/tmp/evil\n"
            "   StdErr=/home/alice/run 1/out-42.txt\n"
            "   StdOut=/home/alice/run 1/out-42.txt\n")
    fields = parse_job_record(text)
    assert fields["JobName"] == "train EndTime=2000-01-01T00:00:00 StdOut=/tmp/evil"
    assert fields["EndTime"] == "2026-12-03T11:00:00" and fields["TimeLimit"] == "01:00:00"
    assert fields["WorkDir"] == "/home/alice/run 1" and fields["StdOut"] == "/home/alice/run 1/out-42.txt"
    assert fields["Comment"] == "megatrace: hang confirmed; on-hang=cancel StdOut=/tmp/evil"
    assert fields["ExcNodeList"] == "n3" and fields["JobId"] == "42"


def test_job_fields_reads_the_multi_line_record_of_scontrol(tmp_path: Path) -> None:
    from megatrace.collect.slurm import job_fields

    fake = tmp_path / "scontrol"  # stands in for Slurm's command: prints the record it was asked for
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show job 7" ] || exit 1\n'
                    'printf "JobId=7 JobName=a b\\n   StdOut=/x y/out.txt\\n"\n')
    fake.chmod(0o755)
    assert job_fields("7", str(fake)) == {"JobId": "7", "JobName": "a b", "StdOut": "/x y/out.txt"}


def test_sbatch_output_patterns_are_expanded_from_the_jobs_record() -> None:
    from megatrace.collect.slurm import expand_file_pattern

    fields = {"JobId": "1234", "JobName": "pretrain", "UserId": "alice(1000)", "NodeList": "gpu[07-08]",
              "ArrayJobId": "1230", "ArrayTaskId": "4"}
    assert expand_file_pattern("logs/%x-%j.out", fields) == "logs/pretrain-1234.out"
    assert expand_file_pattern("%A_%a.%u.%N.%%.txt", fields) == "1230_4.alice.gpu07.%.txt"
    assert expand_file_pattern("run-%8j.log", fields) == "run-00001234.log"
    assert expand_file_pattern("/abs/slurm-1234.out", fields) == "/abs/slurm-1234.out"  # scontrol's, expanded


def test_a_job_id_that_is_not_one_is_refused_before_slurm_is_asked() -> None:
    from megatrace.collect.slurm import JobLookupError, job_output

    for bad in ("12;rm", "../1", "", "1_2_3"):
        with pytest.raises(JobLookupError, match="not a Slurm job id"):
            job_output(bad, scontrol="/nonexistent/scontrol", sacct="/nonexistent/sacct")
