"""Checked-in traces of real demo runs (tests/data/scenarios/<name>/), so importer and bad-input tests run
without torch and without a multi-process run each time.

Each folder holds one demo run as the demo wrote it (rings, meta files, layout.yaml, procs.json, fault.json, the
per-rank metrics and, where asked, every rank's Flight Recorder dump), the large files gzipped (``*.gz``). The ranks
ran on a host named :data:`NODE`, so that no analysis takes this machine's process table for theirs.
:func:`unpack` copies a scenario into a test's directory, unzipped. To regenerate one after a change of the ring
format or of the demo (needs torch)::

    python tests/helpers/scenarios.py NAME [NAME ...]
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data" / "scenarios"
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
}


def unpack(name: str, dest: Path) -> Path:
    """Scenario ``name`` as a demo directory at ``dest`` (created), its gzipped files unzipped."""
    src = DATA / name
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such scenario (regenerate: python tests/helpers/scenarios.py {name})")
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
                    shutil.copyfileobj(fin, fout)
            else:
                shutil.copyfile(path, dest)
    return target


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(SCENARIOS):
        print(write(arg))
