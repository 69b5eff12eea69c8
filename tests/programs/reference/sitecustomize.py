"""Count every collective and point-to-point call of an unmodified program with torch's own instruments.

Put this folder first on ``PYTHONPATH`` and set ``MEGATRACE_TEST_REFERENCE=DIR``: every process
that has a ``RANK`` (a torchrun worker, a demo worker) then records, from start-up to exit,

* the PyTorch Flight Recorder's entries (``TORCH_FR_BUFFER_SIZE`` is set here when unset, before
  any process group exists), counted per process group name and op. ``ProcessGroupGloo`` records
  its collectives there, not its sends and receives;
* the profiler's events that ``ProcessGroupGloo`` itself emits (``gloo:send``, ``gloo:recv``,
  ``gloo:all_reduce``, ...), counted per op: the reference for point-to-point calls.

and writes them to ``DIR/rank-<RANK>.json`` at exit: ``{"rank", "fr": {group name: {op: n}},
"fr_desc": {group name: desc}, "profiler": {op: n}}``. Both sit below the c10d dispatcher, where
MegaTrace records, so a call that reaches the process group is counted whoever made it. A process
killed before it exits writes nothing.
"""

import os

_DIR = os.environ.get("MEGATRACE_TEST_REFERENCE")
_RANK = os.environ.get("RANK")
_GLOO = "gloo:"


def _start(directory: str, rank: str) -> None:
    import atexit
    import json
    import pickle
    from collections import Counter

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "100000")
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()

    def finish() -> None:
        prof.stop()
        events = Counter(e.name[len(_GLOO):] for e in prof.events() if e.name.startswith(_GLOO))
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
        fr: dict = {}
        desc: dict = {}
        for entry in dump.get("entries", []):
            name, group_desc = entry["process_group"]
            op = entry["profiling_name"].removeprefix(_GLOO)
            fr.setdefault(name, Counter())[op] += 1
            desc[name] = group_desc
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank-{int(rank)}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump({"rank": int(rank), "fr": fr, "fr_desc": desc, "profiler": events}, fh, indent=1)
        os.replace(path + ".tmp", path)

    atexit.register(finish)


if _DIR and _RANK is not None:
    _start(_DIR, _RANK)
