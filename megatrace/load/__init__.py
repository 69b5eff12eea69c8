"""Load: the pipeline's stage between collect and analyze (``trace → collect → load → analyze → report``).

One builder, :func:`load_trace`, turns a trace directory (rings) or another tool's files (importers) into a
:class:`TraceSet`; analyzers receive that and never open files.

* :mod:`.discovery` finds the ring files and start markers and picks one ring per rank;
* :mod:`.rings` reads them into record columns (all records, or each ring's tail);
* :mod:`.side_files` reads the group lines, ``procs.json`` and ``layout.yaml``;
* :mod:`.markers` and :mod:`.probe`: start markers, rendezvous lookups, this host's process table;
* :mod:`.importers`: job logs, Flight Recorder dumps, NCCL logs and RAS reports, Kineto, Inspector;
* :mod:`.directory` puts them together; :mod:`.traceset` is the data model.
"""

from megatrace.load.directory import QUICK_TAIL, load_trace
from megatrace.load.traceset import LoadProblem, TraceLoadError, TraceSet

__all__ = ["QUICK_TAIL", "LoadProblem", "TraceLoadError", "TraceSet", "load_trace"]
