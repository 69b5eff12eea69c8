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
from megatrace.analyze.importers.safe_pickle import safe_loads
from megatrace.cli import main

REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"
needs_realdata = pytest.mark.skipif(not REALDATA.is_dir(), reason="../shared/realdata is absent (a clone without it)")
FR_CASES = sorted(p.name for p in REALDATA.iterdir() if (p / "dumps").is_dir()) if REALDATA.is_dir() else []


def fault_ranks(case: str) -> set[int]:
    """The injected faulty ranks, from the case's fault_injection.log (ground truth)."""
    text = (REALDATA / case / "fault_injection.log").read_text()
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
