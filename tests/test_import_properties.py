"""Every importer fed mutated real files (hypothesis): a clear error line or an analysis, never a traceback.

The inputs are real data nobody here wrote (``../shared/realdata``): the Flight Recorder dumps of a 16-rank
Megatron-Core job, a slice of the NCCL-patch logs of a 64-rank Megatron-LM run (in both line formats), and
the NCCL Inspector lines written from that slice (Inspector output of a real job is not in the folder).
Each example changes one thing (a field's value or type, a key removed, a line cut, swapped or garbled,
bytes cut off the end) and runs ``megatrace analyze`` in-process: exit status 0 with a verdict, or 1 with
one ``Error:`` line; nothing escapes. Skipped when ``../shared/realdata`` is absent.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.inspector_logs import write_inspector

from megatrace.cli import main
from megatrace.load.importers.safe_pickle import safe_loads

REALDATA = Path(__file__).resolve().parents[1].parent / "shared" / "realdata"
pytestmark = [pytest.mark.skipif(not REALDATA.is_dir(), reason="../shared/realdata is absent (a clone without it)"),
              pytest.mark.slow]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LOG_RANKS, LOG_LINES = 8, 400  # the slice of the 64-rank logs mutated (a whole job of 8 ranks: TP2 x PP4)

values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.lists(st.integers(min_value=-3, max_value=1 << 40), max_size=4),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), st.just([[1 << 62] * 3]))


def analysed(where: Path) -> None:
    """``megatrace analyze`` in-process: exit 0 with a verdict, or 1 with one Error line; nothing escapes."""
    out = where.parent / "out"
    result = CliRunner().invoke(main, ["analyze", str(where), "-o", str(out), "--no-report"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(result.exception)))
    text = result.output
    assert "Traceback" not in text, text
    assert result.exit_code in (0, 1), text
    if result.exit_code == 1:
        assert text.strip().splitlines()[-1].startswith("Error: "), text
    else:
        assert text.startswith("VERDICT ["), text


@pytest.fixture(scope="module")
def dumps() -> dict[str, dict]:
    case = next(p for p in sorted(REALDATA.iterdir()) if (p / "dumps").is_dir())
    return {p.name: safe_loads(p.read_bytes(), str(p)) for p in sorted((case / "dumps").iterdir())}


def _write_dumps(dumps: dict[str, dict], where: Path) -> Path:
    where.mkdir(parents=True)
    for name, dump in dumps.items():
        (where / name).write_bytes(pickle.dumps(dump))
    return where


@SETTINGS
@given(data=st.data())
def test_flight_recorder_dumps_with_one_thing_changed(dumps: dict[str, dict], data: st.DataObject) -> None:
    mutated = pickle.loads(pickle.dumps(dumps))  # (a deep copy)
    name = data.draw(st.sampled_from(sorted(mutated)))
    dump = mutated[name]
    where = data.draw(st.sampled_from(["entry", "top", "pg_config", "pg_status"]))
    if where == "entry" and dump["entries"]:
        target = dump["entries"][data.draw(st.integers(0, len(dump["entries"]) - 1))]
    elif where in ("pg_config", "pg_status") and dump.get(where):
        target = dump[where][data.draw(st.sampled_from(sorted(dump[where])))]
    else:
        target = dump
    key = data.draw(st.sampled_from(sorted(target)))
    if data.draw(st.booleans()):
        del target[key]
    else:
        target[key] = data.draw(values)
    with tempfile.TemporaryDirectory() as tmp:
        analysed(_write_dumps(mutated, Path(tmp) / "dumps"))


@SETTINGS
@given(cut=st.integers(0, 4000), name=st.integers(0, 15))
def test_flight_recorder_dumps_cut_short(dumps: dict[str, dict], cut: int, name: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = _write_dumps(dumps, Path(tmp) / "dumps")
        victim = sorted(where.iterdir())[name % len(dumps)]
        victim.write_bytes(victim.read_bytes()[:cut])
        analysed(where)


@pytest.fixture(scope="module")
def log_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first lines of the first ranks' logs of the 64-rank case, with its launch script (a TP2 x PP4 job)."""
    archive = next(iter(sorted(REALDATA.glob("*.tar.xz"))))
    full = tmp_path_factory.mktemp("logs")
    with tarfile.open(archive) as tar:
        tar.extractall(full, filter="data")
    (logs,) = {p.parent for p in full.rglob("rank_0.log")}
    out = tmp_path_factory.mktemp("slice") / "logs"
    out.mkdir()
    for rank in range(LOG_RANKS):
        lines = (logs / f"rank_{rank}.log").read_text().splitlines()[:LOG_LINES]
        (out / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    for script in logs.glob("*.sh"):
        shutil.copy(script, out / script.name)
    return out


def _newer(line: str, k: int) -> str:
    return f"[save_count 1] {line} opCount {k}"


@SETTINGS
@given(data=st.data(), newer=st.booleans())
def test_nccl_patch_logs_with_one_line_changed(log_slice: Path, data: st.DataObject, newer: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "logs"
        shutil.copytree(log_slice, where)
        if newer:
            for path in where.glob("rank_*.log"):
                path.write_text("\n".join(_newer(line, k) for k, line in enumerate(path.read_text().splitlines()))
                                + "\n")
        path = where / f"rank_{data.draw(st.integers(0, LOG_RANKS - 1))}.log"
        lines = path.read_text().splitlines()
        k = data.draw(st.integers(0, len(lines) - 1))
        how = data.draw(st.sampled_from(["token", "drop", "swap", "garble", "cut"]))
        if how == "token":
            words = lines[k].split(" ")
            i = data.draw(st.integers(0, len(words) - 1))
            words[i] = data.draw(st.one_of(st.text(max_size=8), st.integers(-(1 << 70), 1 << 70).map(str)))
            lines[k] = " ".join(words)
        elif how == "drop":
            del lines[k]
        elif how == "swap":
            j = data.draw(st.integers(0, len(lines) - 1))
            lines[k], lines[j] = lines[j], lines[k]
        elif how == "garble":
            lines[k] = lines[k][:data.draw(st.integers(0, len(lines[k])))] + "\x00\udcff"
        text = "\n".join(lines) + "\n"
        if how == "cut":
            text = text[:data.draw(st.integers(0, len(text)))]
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        analysed(where)


@pytest.fixture(scope="module")
def inspector_lines(log_slice: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """NCCL Inspector lines of the log slice's completed collectives, one file per rank."""
    from megatrace.load import load_trace

    out = tmp_path_factory.mktemp("inspector") / "lines"
    write_inspector(load_trace(log_slice), out, name=lambda rank, info: f"host-pid{rank}-rank{rank}.log")
    return out


@SETTINGS
@given(data=st.data())
def test_inspector_lines_with_one_field_changed(inspector_lines: Path, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "lines"
        shutil.copytree(inspector_lines, where)
        path = data.draw(st.sampled_from(sorted(where.iterdir())))
        lines = path.read_text().splitlines()
        k = data.draw(st.integers(0, len(lines) - 1))
        obj = json.loads(lines[k])
        part = obj[data.draw(st.sampled_from(sorted(obj)))]
        key = data.draw(st.sampled_from(sorted(part))) if isinstance(part, dict) and part else None
        if key is not None and data.draw(st.booleans()):
            del part[key]
        elif key is not None:
            part[key] = data.draw(values)
        lines[k] = json.dumps(obj) if data.draw(st.booleans()) else re.sub(r"\d", "9", lines[k], count=3)
        text = "\n".join(lines) + "\n"
        path.write_text(text[:data.draw(st.integers(len(text) // 2, len(text)))])
        analysed(where)
