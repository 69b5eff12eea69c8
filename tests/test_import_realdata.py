"""Real diagnostic data that nobody on this project wrote (``../shared/realdata``): the verdict names the culprit.

Each case's ground truth comes from its source and is read by these tests only (``fault_injection.log``,
``training_performance.log``); the analysis never sees it. Besides the given cases, variants built from
them test the classes of problem the held-back cases share: dumps whose entries never use the default
group, dumps without ``pg_status``, JSON dumps, a missing rank's dump, a layout that does not fit. The
folder is absent in a fresh clone without ``../shared``: the tests skip then.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.analyze.engine import analyze
from megatrace.analyze.findings import Kind, Severity
from megatrace.cli import main
from megatrace.load.importers.safe_pickle import safe_loads

REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"
needs_realdata = pytest.mark.skipif(not REALDATA.is_dir(), reason="../shared/realdata is absent (a clone without it)")
FR_CASES = sorted(p.name for p in REALDATA.iterdir() if (p / "dumps").is_dir()) if REALDATA.is_dir() else []


def fault_ranks(case: str | Path) -> set[int]:
    """The injected faulty ranks, from a case's fault_injection.log (ground truth; ``case``: a name in
    ``REALDATA`` or the case's folder)."""
    text = (REALDATA / case / "fault_injection.log").read_text()  # (an absolute path replaces REALDATA)
    return {int(r) for r in re.search(r"Fault ranks: \[([\d, ]+)\]", text).group(1).split(",")}


def dumps_of(case: str, dest: Path, change=None, as_json: bool = False) -> Path:  # noqa: ANN001
    """A writable copy of a case's dumps; ``change(dump)`` edits each (parsed safely) first."""
    dest.mkdir(parents=True)
    for path in sorted((REALDATA / case / "dumps").iterdir()):
        if change is None and not as_json:
            shutil.copy(path, dest / path.name)
            continue
        dump = safe_loads(path.read_bytes(), str(path))
        if change is not None:
            change(dump)
        if as_json:
            (dest / f"{path.name}.json").write_text(json.dumps(dump))
        else:
            (dest / path.name).write_bytes(pickle.dumps(dump))
    return dest


def verdict_ranks(path: Path, **kwargs) -> tuple[set[int], object]:  # noqa: ANN003
    top = analyze(path, **kwargs).findings[0]
    ranks = set(top.subject.ranks) if top.subject.ranks else {top.subject.rank}
    return ranks, top


@needs_realdata
@pytest.mark.parametrize("case", FR_CASES)
def test_flight_recorder_dumps_name_exactly_the_faulty_ranks_first(case: str, tmp_path: Path) -> None:
    ranks, top = verdict_ranks(dumps_of(case, tmp_path / case))
    assert ranks == fault_ranks(case), top.verdict
    assert top.kind == Kind.COMPUTE_HANG and top.severity == Severity.CRITICAL, top.verdict
    assert not [f for f in analyze(tmp_path / case).findings[1:]
                if f.severity == Severity.CRITICAL], "consequences of the stop flagged as causes of their own"


@needs_realdata
@pytest.mark.parametrize("case", FR_CASES)
def test_what_stopped_is_told_from_pg_status(case: str, tmp_path: Path) -> None:
    """The same verdict says whether the culprits' device work stopped (enqueued, completed by the others, never
    by them) or their host did (everything enqueued completed, nothing in flight)."""
    _, top = verdict_ranks(dumps_of(case, tmp_path / case))
    chain = top.data["chain"][-1]
    enqueued_not_done = "never did (its device work stopped)" in chain
    idle = "stopped issuing calls" in chain
    assert enqueued_not_done != idle, chain
    for path in (REALDATA / case / "dumps").iterdir():  # (what the dumps of the culprits show)
        rank = int(re.search(r"(\d+)$", path.name).group(1))
        if rank in fault_ranks(case):
            status = safe_loads(path.read_bytes(), str(path))["pg_status"].values()
            assert idle == all(s["last_enqueued_collective"] == s["last_completed_collective"] for s in status)


def _without_default_group(dump: dict) -> None:
    world = {name for name, c in dump["pg_config"].items() if c.get("desc") == "default_pg"}
    dump["entries"] = [e for e in dump["entries"] if e["process_group"][0] not in world]
    dump["pg_config"] = {name: c for name, c in dump["pg_config"].items()
                         if name not in world and len(json.loads(c["ranks"])) < 16}


def _without_pg_status(dump: dict) -> None:
    dump.pop("pg_status", None)


@needs_realdata
@pytest.mark.parametrize("case", FR_CASES)
@pytest.mark.parametrize("variant", ["no-default-group", "no-pg-status", "json"])
def test_variants_of_the_dumps_give_the_same_verdict(case: str, variant: str, tmp_path: Path) -> None:
    change = {"no-default-group": _without_default_group, "no-pg-status": _without_pg_status}.get(variant)
    path = dumps_of(case, tmp_path / case, change, as_json=variant == "json")
    ranks, top = verdict_ranks(path)
    assert ranks == fault_ranks(case) and top.severity == Severity.CRITICAL, top.verdict


@needs_realdata
@pytest.mark.parametrize("case", FR_CASES)
def test_no_traceback_with_any_layout_and_without_the_default_group(case: str, tmp_path: Path) -> None:
    """(An IndexError in the hang analysis: the world size was taken from the largest group in the entries.)"""
    path = dumps_of(case, tmp_path / case, _without_default_group)
    small = tmp_path / "small.yaml"
    small.write_text("world_size: 8\ntp: 4\npp: 2\ndp: 1\n")
    for extra in ([], ["--tp", "4", "--pp", "2"], ["--tp", "4"], ["--layout", str(small)]):
        out = CliRunner().invoke(main, ["analyze", str(path), "--no-report", "--json", str(tmp_path / "f.json"),
                                        *extra])
        assert out.exception is None or isinstance(out.exception, SystemExit), out.output
        assert out.exit_code == 0 and "Traceback" not in out.output, out.output
        top = json.loads((tmp_path / "f.json").read_text())["findings"][0]
        assert set(top["subject"]["ranks"]) == fault_ranks(case) and top["severity"] == "critical", top["verdict"]


@needs_realdata
@pytest.mark.parametrize("case", FR_CASES)
def test_a_missing_dump_of_a_waiting_rank_changes_nothing_else(case: str, tmp_path: Path) -> None:
    path = dumps_of(case, tmp_path / case)
    culprits = fault_ranks(case)
    gone = min(verdict_ranks(path)[1].data["waiters"])  # a rank that waits for them
    next(p for p in path.iterdir() if re.search(rf"\D{gone}$", p.name)).unlink()
    ranks, top = verdict_ranks(path)
    assert ranks == culprits, top.verdict


# -- Megatrace NCCL-patch logs (the older line format) of a 64-rank Megatron-LM run -----------------------------

LOG_CASES = sorted(p.name[:-len(".tar.xz")] for p in REALDATA.glob("*.tar.xz")) if REALDATA.is_dir() else []


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each log case unpacked once (its ground truth, training_performance.log, stays in the folder: the analysis
    never reads it)."""
    import tarfile

    out = {}
    for case in LOG_CASES:
        dest = tmp_path_factory.mktemp("realdata")
        with tarfile.open(REALDATA / f"{case}.tar.xz") as tar:
            tar.extractall(dest, filter="data")
        (found,) = {p.parent for p in dest.rglob("rank_0.log")}
        out[case] = found
    return out


def slow_truth(where: Path) -> tuple[int, int, float]:
    """(slowed rank, its iteration counted from 1, that iteration's time in ms) from the training log."""
    text = (where / "training_performance.log").read_text(errors="replace")
    rank = int(re.search(r"begin slowdown in rank (\d+)", text).group(1))
    times = {int(i): float(ms) for i, ms in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration "
                                                      r"\(ms\): ([\d.]+)", text)}
    steady = {i: ms for i, ms in times.items() if i > 1}  # (the first iteration includes the start-up)
    slow = max(steady, key=steady.get)
    return rank, slow, steady[slow]


@needs_realdata
@pytest.mark.slow
@pytest.mark.parametrize("case", LOG_CASES)
def test_the_slowed_rank_is_named_first_with_its_step_and_lag(case: str, logs: dict[str, Path]) -> None:
    rank, iteration, took_ms = slow_truth(logs[case])
    result = analyze(logs[case], out_dir=logs[case].parent / "out")
    top = result.findings[0]
    assert top.kind == Kind.STRAGGLER and top.subject.rank == rank, top.verdict
    (step,) = top.data["steps"]
    it = result.results["iterations"]
    assert step == iteration - 1  # the trace starts with the job: its step 0 is the first iteration
    assert abs(it.step_ns[list(it.steps).index(step)] / 1e6 - took_ms) < 0.05 * took_ms
    assert top.data["lag_ns"] > 10 * top.data["next_lag_ns"]
    assert not [f for f in result.findings if f.severity.at_least(Severity.ERROR)], \
        [f.verdict for f in result.findings if f.severity.at_least(Severity.ERROR)]


def newer_format(src: Path, dest: Path, dump_every: int = 1000, ring: int = 2000) -> Path:
    """The older-format logs re-emitted as the newer patch writes them (save_count dumps of a ring, opCount per
    communicator, no groupHash): the same calls, more collective streams than the layout has kinds of group."""
    from megatrace.load.importers.nccl_log_lines import parse_log

    dest.mkdir()
    for path in sorted(src.glob("rank_*.log")):
        rank, calls = parse_log(path, [])
        lines = [f"[{t // 10**9}.{t % 10**9:09d}] [Rank {rank}] Fun {fun} Data {data} stream {stream} opCount {op}"
                 for t, fun, data, stream, op, _ in calls]
        out = []
        for save, end in enumerate(list(range(dump_every, len(lines), dump_every)) + [len(lines)], start=1):
            out += [f"[save_count {save}] {line}" for line in lines[max(0, end - ring):end]]
        (dest / path.name).write_text("\n".join(out) + "\n")
    for extra in src.glob("*.sh"):
        shutil.copy(extra, dest / extra.name)
    return dest


@needs_realdata
@pytest.mark.slow
@pytest.mark.parametrize("case", LOG_CASES)
def test_the_same_calls_in_the_newer_format_give_the_same_verdict_and_no_mismatch(case: str, logs: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    rank, _, _ = slow_truth(logs[case])
    result = analyze(newer_format(logs[case], tmp_path / "newer"), out_dir=tmp_path / "out")
    assert not [f for f in result.findings if f.kind == Kind.COLLECTIVE_MISMATCH]
    top = result.findings[0]
    assert top.kind == Kind.STRAGGLER and top.subject.rank == rank, top.verdict
