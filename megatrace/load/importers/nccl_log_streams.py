"""Which communicator each stream of a Megatrace NCCL-patch log belongs to, when the log carries no groupHash.

A stream is a process-local pointer: each communicator a rank uses has its own (torch: one per process
group), so a rank's calls on one stream are one communicator, and the question is which ranks share it.
The layout (``config.yaml`` beside the logs, or a Megatron launch script: :func:`read_layout`) names the
candidate groups; the calls decide between them (:func:`assign_streams`):

* a stream with send/recv is the rank's pipeline group;
* each group of a layout kind (tensor, then data parallel) gets the stream of one *vocabulary* that all
  its members have: the set of (function, element count) a stream's calls use often (at least
  :data:`FREQUENT` of them; an all-to-all's counts differ by rank and are left out). Of the vocabularies
  its members share, one that not every rank of the job has comes first (the group's own calls: a
  stage's tensor- and data-parallel calls differ from other stages'; one every rank has is the world's,
  or every group's alike), then the one with the most calls (Megatron's tensor-parallel groups call far
  more often than its data-parallel ones). Members decide together, so two members never give one
  communicator different streams;
* a further stream is another group of the smallest layout kind whose members all have that vocabulary
  (Megatron makes groups of the same members twice, e.g. data parallel with and without context
  parallelism, each its own communicator and stream; the world's calls too are paired within such a
  group: the smallest kind, because a group taken too small still pairs each call with calls of the same
  instance, while one taken too large would join calls of different communicators), else the world's
  when every rank has one of that vocabulary (without a layout); such a communicator is named by its
  vocabulary (and, for several streams of one vocabulary, their order of first calls), the same on every
  member;
* a stream that none of that explains is kept apart (its calls are judged as a communicator of one rank)
  and reported: never merged into another group, where its calls would collide with that group's.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from pathlib import Path

from megatrace.config import Layout, LayoutError
from megatrace.files import open_input_file, read_input
from megatrace.load.importers.common import ImportFormatError
from megatrace.load.traceset import LoadProblem, plural, rank_list

FREQUENT = 0.01  # a (function, count) pair is in a stream's vocabulary when at least 1 % of its calls (and 2) use it
COLLECTIVE_KINDS = ("tp", "dp")  # the layout kinds a collective stream is first matched to, busiest first
MEGATRON_SIZES = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp"}
SCRIPT_BYTES = 1 << 20  # a launch script larger than this is not read

Members = tuple[int, ...]


def read_layout(directory: Path, world: int, problems: list[LoadProblem]) -> Layout | None:
    """The layout beside the logs (or one level up): ``config.yaml`` (``TP``, ``PP``, ``world_size``), else the
    tensor and pipeline sizes of a Megatron-LM launch script (``*.sh`` with ``--tensor-model-parallel-size``;
    ``$NAME`` values resolved from the script's own ``NAME=value`` lines), the world being the ranks logged."""
    import yaml

    for where in (directory, directory.parent):
        path = where / "config.yaml"
        if not path.is_file():
            continue
        try:
            data = yaml.safe_load(read_input(path, 1 << 20).decode("utf-8", "replace")) or {}
            tp, pp = int(data.get("TP", 1)), int(data.get("PP", 1))
            size = int(data.get("world_size", world))
            if size % (tp * pp):
                raise ImportFormatError(f"{path}: world_size {size} is not a multiple of TP*PP = {tp * pp}")
            return Layout(world_size=size, tp=tp, pp=pp, dp=size // (tp * pp)).validate(str(path))
        except (ValueError, TypeError, AttributeError, yaml.YAMLError, LayoutError) as exc:
            raise ImportFormatError(f"{path}: not a layout (TP, PP, world_size): {exc}") from None
    for where in (directory, directory.parent):
        for path in sorted(where.glob("*.sh")):
            sizes = _megatron_sizes(path)
            if not sizes:
                continue
            tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
            if world % (tp * pp):
                problems.append(LoadProblem("warning", "nccl-log-layout", f"{path}: TP {tp} × PP {pp} does not "
                                            f"divide the {world} ranks logged; analysed without a layout"))
                return None
            problems.append(LoadProblem("info", "nccl-log-layout", f"layout TP{tp}·PP{pp}·DP{world // (tp * pp)} "
                                        f"from the Megatron-LM arguments of {path} (the world: the ranks logged)",
                                        paths=(str(path),)))
            return Layout(world_size=world, tp=tp, pp=pp, dp=world // (tp * pp))
    return None


def _megatron_sizes(path: Path) -> dict[str, int]:
    """Tensor and pipeline sizes of a launch script's Megatron-LM arguments ({} when it has none readable)."""
    try:
        with open_input_file(path) as fh:
            text = fh.read(SCRIPT_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return {}
    names = dict(re.findall(r"^[ \t]*(?:export[ \t]+)?([A-Za-z_]\w*)=[\"']?(\d+)[\"']?[ \t]*(?:#.*)?$", text, re.M))
    out: dict[str, int] = {}
    for flag, value in re.findall(r"(--[a-z-]+-model-parallel-size)[ \t=]+\$?\{?(\w+)\}?", text):
        value = names.get(value, value)
        if flag in MEGATRON_SIZES and value.isdecimal() and 0 < int(value) <= 1 << 20:
            out[MEGATRON_SIZES[flag]] = int(value)
    return out


def vocabulary(calls: list[tuple]) -> frozenset:
    """The (function, element count) pairs a stream's calls use often (see :data:`FREQUENT`)."""
    used = Counter((c[1], -1 if c[1] == "AllToAll" else c[2]) for c in calls)
    floor = max(2, FREQUENT * len(calls))
    often = frozenset(k for k, n in used.items() if n >= floor)
    return often or frozenset(used)


def assign_streams(rank_calls: dict[int, list[tuple]], layout: Layout | None,
                   problems: list[LoadProblem]) -> dict[tuple[int, str], tuple[str, Members]]:
    """(rank, stream) -> (communicator key, members) for logs without groupHash (see the module docstring)."""
    out: dict[tuple[int, str], tuple[str, Members]] = {}
    world = layout.world_size if layout is not None else max(rank_calls) + 1
    streams: dict[int, dict[str, tuple[int, frozenset, int]]] = {}  # rank -> stream -> (calls, vocabulary, first)
    for rank, calls in rank_calls.items():
        by_stream: dict[str, list[tuple]] = {}
        for c in calls:
            by_stream.setdefault(c[3], []).append(c)
        streams[rank] = {}
        for stream, cs in by_stream.items():
            if len(cs) > 1 and all(c[4] == 0 for c in cs):
                out[(rank, stream)] = (f"solo:{rank}:{stream}", (rank,))  # one-rank communicator (opCount stays 0)
            elif any(c[1] in ("Send", "Recv") for c in cs):
                members = tuple(layout.group_of("pp", rank)) if layout is not None else tuple(range(world))
                out[(rank, stream)] = ("pp:" + ",".join(map(str, members)), members)
            else:
                streams[rank][stream] = (len(cs), vocabulary(cs), cs[0][0])
    everywhere = _everywhere(streams)
    kinds = [k for k in COLLECTIVE_KINDS if layout is not None and getattr(layout, k) > 1]
    for k in kinds:  # each group's busiest shared vocabulary, one seen on fewer ranks than all first
        for members in getattr(layout, f"{k}_groups")():
            _assign_group(k, tuple(members), streams, everywhere, out)
    apart, extra = [], []
    others = kinds + (["pp"] if layout is not None and layout.pp > 1 else [])
    for rank, mine in streams.items():  # further streams: the world's, or another group of a layout kind
        seen: Counter = Counter()  # (the n-th further stream of one vocabulary, by its first call, on every member)
        for stream, (_, vocab, _) in sorted(mine.items(), key=lambda x: x[1][2]):
            if (rank, stream) in out:
                continue
            extra.append(rank)
            tag = f"{_tag(vocab)}.{seen[vocab]}"
            seen[vocab] += 1
            k = next((k for k in others if _shared(tuple(layout.group_of(k, rank)), vocab, streams)), None)
            if k is not None:
                members = tuple(layout.group_of(k, rank))
                out[(rank, stream)] = (f"{k}:{','.join(map(str, members))}#{tag}", members)
            elif vocab in everywhere:
                out[(rank, stream)] = (f"world#{tag}", tuple(range(world)))
            else:
                out[(rank, stream)] = (f"stream:{rank}:{stream}", (rank,))
                apart.append(rank)
    if extra:
        problems.append(LoadProblem(
            "info", "nccl-log-streams", f"{plural(len(set(extra)), 'rank')} use more collective streams than the "
            f"layout has kinds of group: each further stream was matched by the calls on it to the world or to "
            f"another group of a layout kind (a communicator of its own): ranks {rank_list(sorted(set(extra)))}"))
    if apart:
        problems.append(LoadProblem(
            "warning", "nccl-log-streams", f"{plural(len(set(apart)), 'rank')} have collective streams that no group "
            f"of the layout explains (their calls match no stream of the group's other members): each was kept as "
            f"a communicator of its own, not judged against other ranks: ranks {rank_list(sorted(set(apart)))}",
            ranks=tuple(sorted(set(apart)))))
    return out


def _assign_group(kind: str, members: Members, streams: dict[int, dict[str, tuple[int, frozenset, int]]],
                  everywhere: set[frozenset], out: dict[tuple[int, str], tuple[str, Members]]) -> None:
    """Give one layout group the stream of the vocabulary every logged member has on a stream not yet taken:
    of those, one not every rank of the job has (a group's own calls) before one every rank has (the world's,
    or every group's alike), then the most calls over the members; of a member's streams of that vocabulary,
    the one whose first call came first (the same on every member)."""
    logged = [m for m in members if m in streams]
    if len(logged) < 2:
        return
    free: dict[int, dict[frozenset, str]] = {}  # member -> vocabulary -> its earliest free stream of it
    for m in logged:
        free[m] = {}
        for s, (_, v, _) in sorted(streams[m].items(), key=lambda x: x[1][2]):
            if (m, s) not in out:
                free[m].setdefault(v, s)
    shared = set.intersection(*(set(f) for f in free.values()))
    if not shared:
        return
    calls = {v: sum(streams[m][free[m][v]][0] for m in logged) for v in shared}
    best = max(shared, key=lambda v: (v not in everywhere, calls[v], _tag(v)))
    key = f"{kind}:{','.join(map(str, members))}"
    for m in logged:
        out[(m, free[m][best])] = (key, members)


def _shared(members: Members, vocab: frozenset, streams: dict[int, dict[str, tuple[int, frozenset, int]]]) -> bool:
    logged = [m for m in members if m in streams]
    return len(logged) >= 2 and all(any(v == vocab for _, v, _ in streams[m].values()) for m in logged)


def _tag(vocab: frozenset) -> int:
    """A short name of a vocabulary, the same on every rank."""
    return zlib.crc32(repr(sorted(vocab)).encode()) & 0xFFFF


def _everywhere(streams: dict[int, dict[str, tuple[int, frozenset, int]]]) -> set[frozenset]:
    """The vocabularies that every logged rank (two or more) has a stream of."""
    if len(streams) < 2:
        return set()
    count = Counter(v for mine in streams.values() for v in {v for _, v, _ in mine.values()})
    return {v for v, n in count.items() if n == len(streams)}
