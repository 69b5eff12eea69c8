"""megatrace/names.py is the one home of every naming rule (repo issue 21).

The C plugin, the C tracer and the Slurm scripts cannot import it: their copies are read out of the source text
here and compared with it, so that a drift fails. The Python copies must be gone: every caller imports names.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatrace import names

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatrace"
REMOTE_C = ROOT / "spank_plugin" / "remote.c"
TRACER_C = ROOT / "megatrace" / "trace" / "nccl" / "tracer.c"
SLURM = ROOT / "slurm"


def _c_source(path: Path) -> str:
    """The C source with ``"%" PRIu32`` and ``%u`` read as ``%s``: only the names' shape is compared."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r'%"\s*PRIu32\s*"', "%s", text)  # "job-%" PRIu32 ".%s" -> "job-%s.%s"
    text = re.sub(r'%"\s*PRIu32', '%s"', text)  # "%s/megatrace-%" PRIu32, -> "%s/megatrace-%s",
    return text.replace("%u", "%s")


def _python_sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py") if p != PACKAGE / "names.py"}


# --- names.py itself -------------------------------------------------------------------------------------------
def test_job_dir_and_attempt() -> None:
    assert names.job_dir_name(12) == "megatrace-12"
    assert [names.attempt_suffix(r) for r in ("0", "", None, "x", "2", 3)] == ["", "", "", "", ".r2", ".r3"]


def test_ring_directories() -> None:
    assert names.node_dir_name(7, "n1") == "job-7.n1"
    assert names.step_dir_name("batch") == "step-batch"
    assert names.user_base_name(1000) == "megatrace-1000"
    assert names.ring_dir_name("12", "3") == "12.3"
    assert names.ring_dir_name("local", "") == "local"
    assert names.ring_dir_name("..", "") == "job"  # no dot-dot
    assert names.ring_dir_name("a/b", "é") == "a_b.é"  # the Python tracer keeps non-ASCII letters


def test_safe_name() -> None:
    assert names.safe_name("n1/../x y") == "n1_.._x_y"
    assert names.safe_name("") == "_"
    assert names.safe_name("é") == "_"
    assert names.safe_name("a" * 200) == "a" * 128


def test_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRACE_NODE_NAME", "mine")
    monkeypatch.setenv("SLURMD_NODENAME", "slurms")
    assert names.node_name() == "mine"
    assert names.node_name("given") == "given"
    monkeypatch.delenv("MEGATRACE_NODE_NAME")
    assert names.node_name() == "slurms"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert names.node_name()  # the host name


def test_the_collector_and_the_checks_name_the_node_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrace.check import runner
    from megatrace.collect import node

    monkeypatch.setenv("MEGATRACE_NODE_NAME", "mine")
    assert runner.node_name() == node.node_name() == "mine"


def test_op_names() -> None:
    from megatrace.analyze.index import op_name

    assert names.unknown_op_name(7) == "op7"
    assert op_name(250) == "op250"


def test_the_finding_severities_are_names_py_in_its_order() -> None:
    from megatrace.analyze.findings import Severity

    assert tuple(s.value for s in Severity) == names.SEVERITIES


def test_the_trigger_choices_are_names_py() -> None:
    from megatrace.cli.collect import collect

    option = next(p for p in collect.params if p.name == "trigger")
    assert tuple(option.type.choices) == names.TRIGGERS


# --- the C plugin ----------------------------------------------------------------------------------------------
def test_the_plugin_names_directories_as_names_py() -> None:
    text = _c_source(REMOTE_C)
    assert f'"%s/{names.job_dir_name("%s")}"' in text  # <submit dir>/megatrace-<id>
    assert f'"%s/%s/{names.job_dir_name("%s")}"' in text  # <fallback>/<uid>/megatrace-<id>
    assert f'"{names.ATTEMPT_PREFIX}%s"' in text  # <dir>.r<restarts>
    assert f'"{names.node_dir_name("%s", "%s")}"' in text  # job-<id>.<node>
    assert f'"%s/{names.node_dir_name("%s", "%s")}/{names.step_dir_name("%s")}"' in text  # the step's rings
    assert f"[{names.SAFE_CHARS}]" in text  # the characters a node name in a path may hold


# --- the C tracer ----------------------------------------------------------------------------------------------
def test_the_nccl_tracer_names_its_ring_directory_as_names_py() -> None:
    text = _c_source(TRACER_C)
    assert f'"%s/{names.user_base_name("%s")}/%s"' in text  # <base>/megatrace-<uid>/<job>.<step>
    body = text[text.index("static void safe_component"):text.index("static void trace_dir")]
    assert "(c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')" in body
    extra = set(re.findall(r"c == '(.)'", body))
    assert extra == set(names.SAFE_CHARS.replace("A-Z", "").replace("a-z", "").replace("0-9", ""))
    assert 'snprintf(out, size, "job")' in body  # the fallback of ring_dir_name
    trace_dir = text[text.index("static void trace_dir"):]
    assert 'snprintf(name, sizeof name, "%s.%s", job, step)' in trace_dir
    assert names.ring_dir_name("J", "S") == "J.S"


# --- the Slurm scripts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["prolog", "epilog"])
def test_the_scripts_name_the_node_directory_as_names_py(script: str) -> None:
    text = (SLURM / script).read_text(encoding="utf-8")
    assert f'"$LOCAL_DIR/{names.node_dir_name("$SLURM_JOB_ID", "$SLURMD_NODENAME")}"' in text


def test_the_scripts_name_job_directories_as_names_py() -> None:
    lib = (SLURM / "megatrace-lib.sh").read_text(encoding="utf-8")
    assert f'"$FALLBACK_DIR/$SLURM_JOB_UID/{names.job_dir_name("$SLURM_JOB_ID")}"' in lib
    assert f'"${{submit:-/nonexistent}}/{names.job_dir_name("$SLURM_JOB_ID")}"' in lib
    prolog = (SLURM / "prolog").read_text(encoding="utf-8")
    assert f'job_dir="$job_dir{names.ATTEMPT_PREFIX}$restarts"' in prolog
    assert "'' | 0 | *[!0-9]*) ;;" in prolog  # no suffix for the first attempt, nor for what is not a count


def test_the_scripts_check_node_names_as_names_py() -> None:
    lib = (SLURM / "megatrace-lib.sh").read_text(encoding="utf-8")
    assert lib.count(f"*[!{names.SAFE_CHARS}]*") == 1  # plain_node_name, the one check of the three scripts
    assert 'SLURMD_NODENAME=$(plain_node_name "${SLURMD_NODENAME:-}")' in lib  # prolog, epilog
    assert 'node=$(plain_node_name "${SLURMD_NODENAME:-}")' in (SLURM / "healthcheck").read_text(encoding="utf-8")
    for script in ("prolog", "epilog", "healthcheck"):
        assert "A-Za-z0-9" not in (SLURM / script).read_text(encoding="utf-8"), script


@pytest.mark.skipif(shutil.which("hostname") is None, reason="no hostname(1)")
def test_the_scripts_node_name_check() -> None:
    def plain(name: str) -> str:
        script = f'LOG_TAG=t; . "{SLURM / "megatrace-lib.sh"}"; plain_node_name "$1"'
        return subprocess.run(["bash", "-c", script, "t", name], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, timeout=10).stdout.strip()
    assert plain("n1.a_b-c") == "n1.a_b-c" == names.safe_name("n1.a_b-c")
    assert [plain(bad) for bad in ("", ".", "..", "a b", "a/b")] == [host] * 5


# --- no Python copy is left ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [
    r"def _safe\w*\(",  # the safe-name helpers
    r"def node_name\(",
    r"f\"op ?\{",  # unknown op names
    r"[(\[]\"critical\", \"error\", \"warning\", \"info\"[)\]]",  # severities
    r"\"hang\", \"end\", \"timelimit\", \"failure\", \"manual\"",  # triggers
    r"f\"\.?megatrace-\{",  # job directories and the per-user base
    r"f\"\.r\{",  # the attempt suffix
    r"MEGATRACE_NODE_NAME\"\) or",
])
def test_no_python_copy_is_left(pattern: str) -> None:
    found = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
             for p, text in _python_sources().items() for m in re.finditer(pattern, text)]
    assert not found, f"a copy of a rule of megatrace/names.py: {found}"


def test_names_imports_nothing_of_megatrace() -> None:
    text = (PACKAGE / "names.py").read_text(encoding="utf-8")
    assert not re.search(r"^\s*(from|import) megatrace", text, re.M)
