"""Checked-in traces of real demo runs (tests/data/scenarios/<name>/), so importer and bad-input tests run
without torch and without a multi-process run each time.

Each folder holds one demo run as the demo wrote it (rings, meta files, layout.yaml, procs.json, fault.json, the
per-rank metrics and, where asked, every rank's Flight Recorder dump), the large files gzipped (``*.gz``). The ranks
ran on a host named :data:`NODE`, so that no analysis takes this machine's process table for theirs, and the
paths the tracer records (the run's directory, the repository, the home directory: ``argv``, ``cwd``, ``MEGATRACE_*``
variables in the meta files) are rewritten to neutral ones by :func:`scrub`; :func:`check_clean` refuses to store a
file that still names this machine's paths or hostname. :func:`unpack` copies a scenario into a test's directory,
unzipped. To regenerate one after a change of the ring format or of the demo (needs torch)::

    python tests/helpers/scenarios.py NAME [NAME ...]
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "scenarios"
NODE = "scenario-node"  # the ranks' host in the rings: no machine's, so no analysis probes its own process table
ZIPPED = (".ring", "fr_rank_")  # files stored gzipped: rings (sparse, mostly zeros) and Flight Recorder dumps

# name -> the demo's options, and whether each rank dumps its Flight Recorder
SCENARIOS: dict[str, tuple[dict[str, Any], bool]] = {
    # TP2·PP2, rank 2 hangs at step 2 of 4 (tests/test_import_nccl_log.py)
    "hang-rank2-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 4, "faults": ("hang:rank=2,step=2",)}, False),
    # TP2·PP2, healthy, 2 steps, each rank's Flight Recorder dump in fr/ (tests/test_import_bad_input.py)
    "healthy-fr-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 2}, True),
    # 6 steps each (tests/test_import_inspector.py): rank 1 twice as slow; healthy; TP2·PP2·DP2 with rank 5
    # three times as slow
    "slow-rank1-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 6, "faults": ("slow:rank=1,factor=2",),
                           "stall_s": 10.0}, False),
    "healthy-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 6, "stall_s": 10.0}, False),
    "slow-rank5-tp2pp2dp2": ({"tp": 2, "pp": 2, "dp": 2, "steps": 6, "faults": ("slow:rank=5,factor=3",),
                              "stall_s": 10.0}, False),
    # with every rank's Flight Recorder dump (tests/test_import_flight_recorder.py): rank 1 hangs at step 2 of 4;
    # 6 steps, rank 2 twice as slow (also tests/test_import_semantics.py); 6 steps, healthy
    "hang-rank1-fr-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 4, "faults": ("hang:rank=1,step=2",)}, True),
    "slow-rank2-fr-tp2pp2": ({"tp": 2, "pp": 2, "dp": 1, "steps": 6, "faults": ("slow:rank=2,factor=2",)}, True),
    "healthy-fr-tp2pp2-6steps": ({"tp": 2, "pp": 2, "dp": 1, "steps": 6}, True),
    # a middle-stage rank hangs at step 2 of 4, with Flight Recorder dumps (tests/test_import_semantics.py)
    "hang-rank5-fr-tp2pp4": ({"tp": 2, "pp": 4, "dp": 1, "steps": 4, "faults": ("hang:rank=5,step=2",)}, True),
    "hang-rank2-fr-tp2pp4": ({"tp": 2, "pp": 4, "dp": 1, "steps": 4, "faults": ("hang:rank=2,step=2",)}, True),
    "hang-rank6-fr-tp2pp2dp2": ({"tp": 2, "pp": 2, "dp": 2, "steps": 4, "faults": ("hang:rank=6,step=2",)}, True),
}


def unpack(name: str, dest: Path) -> Path:
    """Scenario ``name`` as a demo directory at ``dest`` (created), its gzipped files unzipped."""
    src = DATA / name
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such scenario (regenerate: python tests/helpers/scenarios.py {name})")
    return unpack_folder(src, dest)


def unpack_folder(src: Path, dest: Path) -> Path:
    """Every file under ``src`` copied to ``dest`` (created), one ``.gz`` of each gzipped one taken off."""
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fin, open(target.with_suffix(""), "wb") as fout:
                shutil.copyfileobj(fin, fout)
        else:
            shutil.copyfile(path, target)
    return dest


def write(name: str) -> Path:
    """Run scenario ``name``'s demo (torch, several processes) and store it in tests/data/scenarios/<name>/."""
    import tempfile

    from megatrace.demo.launcher import DemoOptions, run_local

    options, flight_recorder = SCENARIOS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        os.environ["SLURMD_NODENAME"] = NODE  # (the tracer names its host by it)
        if flight_recorder:
            os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
            os.environ["MEGATRACE_DEMO_FR_DUMP"] = str(out / "fr")
        try:
            run_local(DemoOptions(**{"stall_s": 8.0, **options}, out=out), log=lambda msg: None)
        finally:
            os.environ.pop("MEGATRACE_DEMO_FR_DUMP", None)
            os.environ.pop("SLURMD_NODENAME", None)
        target = DATA / name
        shutil.rmtree(target, ignore_errors=True)
        for path in sorted(out.rglob("*")):
            if not path.is_file() or path.relative_to(out).parts[0] == "logs":  # (logs: the demo's chatter)
                continue
            dest = target / path.relative_to(out)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if path.name.endswith(ZIPPED[0]) or path.name.startswith(ZIPPED[1]):
                with open(path, "rb") as fin, gzip.GzipFile(dest.with_name(dest.name + ".gz"), "wb", mtime=0) as fout:
                    shutil.copyfileobj(fin, fout)  # (binary: rings hold no paths, the demo's dumps no frames)
                check_clean(gzip.decompress(dest.with_name(dest.name + ".gz").read_bytes()), path, binary=True)
            else:
                text = scrub(path.read_text(), {out: f"/jobs/{name}", Path(tmp): "/jobs"})
                check_clean(text.encode(), path)
                dest.write_text(text)
    return target


def scrub(text: str, moved: dict[Path, str]) -> str:
    """``text`` with this machine's paths rewritten: each of ``moved`` (a run's temporary directory -> its neutral
    name), then the repository (``/src/megatrace``), then the home directory (``/home/user``); and this machine's
    hostname, as a word (the demo's layout.yaml names it), by :data:`NODE`."""
    pairs = [(str(k), v) for k, v in moved.items()] + [(str(REPO), "/src/megatrace"), (str(Path.home()), "/home/user")]
    for old, new in sorted(pairs, key=lambda p: -len(p[0])):
        text = text.replace(old, new)
    return re.sub(rf"(?<![\w.-]){re.escape(socket.gethostname())}(?![\w-])", NODE, text)


def check_clean(data: bytes, path: Path, binary: bool = False) -> None:
    """Refuse to store ``data`` (of ``path``) where it names this machine's paths or, as a word, its hostname
    (not checked in binary files, where two random bytes may spell a short name)."""
    found = [w for w in ("/tmp/", "/work/", "/root/", str(REPO), str(Path.home())) if w.encode() in data]
    host = socket.gethostname()
    if not binary and re.search(rb"(?<![\w.-])" + re.escape(host.encode()) + rb"(?![\w-])", data):
        found.append(host)
    if found:
        raise ValueError(f"{path}: names this machine's {found}: add a rewrite for it before checking it in")


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(SCENARIOS):
        print(write(arg))
