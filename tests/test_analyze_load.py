"""Loading a trace directory: columns over all ranks, groups, layout, node facts, and bad input as problems."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.analysis_factory import TraceBuilder
from helpers.memory import PEAK_KIB

from megatrace.config import Layout
from megatrace.load import TraceLoadError, load_trace


def four_ranks() -> tuple[TraceBuilder, list]:
    b = TraceBuilder(world=4, hosts={0: "h0", 1: "h0", 2: "h1", 3: "h1"})
    groups = [b.group("tp", [0, 1]), b.group("tp", [2, 3]), b.group("dp", [0, 2]), b.group("dp", [1, 3])]
    b.healthy_steps(groups, steps=3)
    return b, groups


@pytest.fixture(params=["c", "numpy"])
def record_copy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Records into columns by the C extension's one pass, or (as where it is not built) field by field."""
    import megatrace.trace.ring_records as ring_records

    if request.param == "c" and not ring_records.native_split():
        pytest.skip("C extension not built (no compiler at install): the numpy twin runs in the other case")
    if request.param == "numpy":
        monkeypatch.setattr(ring_records, "_split_records", None)
    return request.param


def test_sizes_and_sequence_numbers_are_int32_while_they_fit_and_int64_beyond(tmp_path: Path, record_copy: str) -> None:
    b, groups = four_ranks()
    b.write(tmp_path / "small", closed=True)
    small = load_trace(tmp_path / "small").records
    assert {small.seq.dtype, small.group_seq.dtype, small.nbytes.dtype} == {np.dtype(np.int32)}
    assert small.peer.dtype == small.rank.dtype == np.int16 and small.op.dtype == np.uint8
    b.collective(groups[3], at=100.0, nbytes=3 << 31)  # ranks 1 and 3: one call of 6 GiB
    b.write(tmp_path / "big", closed=True)
    big = load_trace(tmp_path / "big").records
    assert big.nbytes.dtype == np.int64 and big.group_seq.dtype == np.int32
    assert sorted(big.rank[big.nbytes == 3 << 31].tolist()) == [1, 3]
    assert np.array_equal(big.nbytes[big.nbytes != 3 << 31], small.nbytes)  # the rows before it kept their values


def test_a_column_widens_when_a_later_batch_does_not_fit(record_copy: str) -> None:
    from megatrace.load.rings import RecordColumns
    from megatrace.trace.ring_reader import RECORD_DTYPE

    def recs(seq: list[int]) -> np.ndarray:
        out = np.zeros(len(seq), RECORD_DTYPE)
        out["seq"], out["group_seq"], out["nbytes"] = seq, seq, 7
        return out

    cols = RecordColumns(4)
    cols.extend([0], [recs([1, 2])])
    cols.extend([1], [recs([(1 << 31) + 5, 1 << 40])])  # (the ring format's sequence numbers are unsigned)
    got = cols.finish()
    assert got.seq.dtype == got.group_seq.dtype == np.int64 and got.nbytes.dtype == np.int32
    assert got.seq.tolist() == [1, 2, (1 << 31) + 5, 1 << 40] and got.rank.tolist() == [0, 0, 1, 1]
    assert got.rank.dtype == got.peer.dtype == np.int16 and got.op.dtype == np.uint8


def test_ranks_peers_and_op_codes_widen_when_a_later_rank_does_not_fit(record_copy: str) -> None:
    """A rank or peer beyond 2**15 - 1 (a world of more than 32,768) or an op code above 255 (a newer tracer's):
    the column takes its full width, the rows before keep their values."""
    from megatrace.load.rings import RecordColumns
    from megatrace.trace.ring_reader import RECORD_DTYPE

    def recs(peer: list[int], op: list[int]) -> np.ndarray:
        out = np.zeros(len(peer), RECORD_DTYPE)
        out["seq"], out["peer"], out["op"] = np.arange(1, len(peer) + 1), peer, op
        return out

    cols = RecordColumns(6)
    cols.extend([0, 7], [recs([-1, 5], [1, 2]), recs([3], [100])])
    cols.extend([40_000], [recs([40_001, -1], [1, 300])])
    got = cols.finish()
    assert got.rank.dtype == got.peer.dtype == np.int32 and got.op.dtype == np.uint16
    assert got.rank.tolist() == [0, 0, 7, 40_000, 40_000] and got.peer.tolist() == [-1, 5, 3, 40_001, -1]
    assert got.op.tolist() == [1, 2, 100, 1, 300] and got.seq.tolist() == [1, 2, 1, 1, 2]


def codes(trace) -> dict[str, str]:
    return {p.code: p.message for p in trace.problems}


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1),
       lost=st.booleans())
def test_a_counted_seq_column_reads_as_the_column_it_replaces(counts: list[int], seed: int, lost: bool) -> None:
    """Each run's numbers count up from its own first; any slice, row list, mask or row reads the same as the array;
    a run with a gap (a lost record) keeps the array."""
    from megatrace.load.traceset import CountedSeq

    rng = np.random.default_rng(seed)
    seq = np.concatenate([int(rng.integers(1, 2**31 - 100)) + np.arange(k) for k in counts]).astype(np.int32)
    runs = np.r_[0, np.cumsum(counts)].astype(np.int64)
    n = len(seq)
    if lost and n >= 2:
        seq[int(rng.integers(1, n))] += 2  # (a row that steps by more than one, or a run's first row: still fine)
    counted = CountedSeq.of(seq, runs)
    steps = np.diff(seq.astype(np.int64))
    inner = np.ones(max(n - 1, 0), bool)
    inner[runs[1:-1][(runs[1:-1] > 0) & (runs[1:-1] < n)] - 1] = False
    if n and not (steps[inner] == 1).all():
        assert counted is None
        return
    if not n:
        assert counted is None
        return
    assert counted is not None and len(counted) == n and counted.dtype == seq.dtype
    assert np.array_equal(np.asarray(counted), seq) and counted.tolist() == seq.tolist()
    for lo, hi in ((0, n), (n // 3, n - n // 4), (n - 1, n), (n, n), (2, 1)):
        assert np.array_equal(counted[lo:hi], seq[lo:hi])
    rows = rng.integers(-n, n, 17)
    assert np.array_equal(counted[rows], seq[rows]) and counted[-1] == seq[-1] and counted[n // 2] == seq[n // 2]
    mask = rng.random(n) < 0.5
    assert np.array_equal(counted[mask], seq[mask]) and np.array_equal(counted[::3], seq[::3])
    with pytest.raises(IndexError):
        counted[[n]]


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=10), seed=st.integers(0, 2**32 - 1))
def test_per_row_spreads_each_runs_value_over_its_rows(counts: list[int], seed: int) -> None:
    """Any forward range of rows, empty runs included, reads each row's run's value: the gather it replaces."""
    from megatrace.load.traceset import per_row

    rng = np.random.default_rng(seed)
    starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
    values = rng.integers(-1000, 1000, len(counts))
    whole = np.repeat(values, counts)
    n = len(whole)
    for lo, hi in ((0, n), (n // 3, n - n // 4), (n - 1, n), (n, n), (2, 1)):
        lo = max(lo, 0)
        assert np.array_equal(per_row(values, starts, slice(lo, hi)), whole[lo:max(lo, hi)])


def test_a_full_load_keeps_seq_numbers_that_count_up_as_runs(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, closed=True)
    trace = load_trace(tmp_path)
    from megatrace.load.traceset import CountedSeq

    assert isinstance(trace.records.seq, CountedSeq)
    assert all(trace.records.seq[trace.rows(r)].tolist() == list(range(1, 7)) for r in range(4))


def test_a_healthy_trace_loads_as_columns_with_groups_hosts_and_layout(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path, closed=True, layout=Layout(world_size=4, tp=2, pp=1, dp=2))
    trace = load_trace(tmp_path)
    assert trace.world_size == 4 and trace.job_id == "job-1" and not trace.problems
    assert trace.ranks.tolist() == [0, 1, 2, 3] and trace.coverage == 1.0
    assert len(trace.records) == 4 * 3 * 2  # each rank: 3 steps x (its tp + its dp collective)
    assert np.all(np.diff(trace.records.rank) >= 0)  # ranks contiguous, ascending
    rows = trace.rows(2)
    assert set(trace.records.rank[rows].tolist()) == {2}
    assert np.all(np.diff(trace.records.seq[rows]) == 1)
    assert trace.records.t_enqueue.dtype == np.int64 and trace.records.group_id.dtype == np.uint32
    assert trace.hosts == ["h0", "h1"] and trace.host_of(3) == "h1" and trace.local_rank_of(3) == 3
    assert trace.groups[groups[1].gid].ranks == (2, 3) and trace.groups[groups[1].gid].label == "tp group [2, 3]"
    assert trace.layout is not None and trace.layout.dp == 2
    assert all(i.closed_cleanly for i in trace.rank_info)


def test_a_missing_rank_is_named_and_the_rest_is_loaded(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, skip_ranks=(2,))
    trace = load_trace(tmp_path)
    assert trace.missing_ranks == (2,) and trace.ranks.tolist() == [0, 1, 3]
    assert "no readable ring for 1 of 4 ranks: [2]" in codes(trace)["missing-ranks"]
    assert trace.coverage == 0.75


def test_files_of_another_job_are_ignored_and_named(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, job_ids={3: "job-2"})
    trace = load_trace(tmp_path)
    msg = codes(trace)["mixed-jobs"]
    assert trace.job_id == "job-1" and "job-2" in msg and "rank-00003.ring" in msg
    assert trace.missing_ranks == (3,)


def test_a_duplicated_rank_keeps_one_file_and_names_the_other(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path)
    rings = tmp_path / "rings"
    shutil.copy(rings / "rank-00001.ring", rings / "rank-00007.ring")
    trace = load_trace(tmp_path)
    assert "rank 1 appears in 2 ring files" in codes(trace)["duplicate-rank"]
    assert trace.ranks.tolist() == [0, 1, 2, 3]


def test_an_empty_ring_is_reported_and_kept(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, empty_ranks=(1,))
    trace = load_trace(tmp_path)
    assert "ranks [1]" in codes(trace)["empty-ring"]
    assert trace.has(1) and trace.rows(1) == slice(trace.rows(1).start, trace.rows(1).start)


@pytest.mark.parametrize("make", ["missing", "file", "empty", "unreadable"])
def test_a_directory_that_is_not_a_trace_raises_a_clear_error(tmp_path: Path, make: str) -> None:
    target = tmp_path / "x"
    if make == "file":
        target.write_text("hello")
    elif make == "empty":
        target.mkdir()
        (target / "notes.txt").write_text("not a trace")
    elif make == "unreadable":
        (target / "rings").mkdir(parents=True)
        (target / "rings" / "rank-00000.ring").write_bytes(b"garbage" * 1000)
    with pytest.raises(TraceLoadError) as err:
        load_trace(target)
    assert str(target) in str(err.value)


def test_a_layout_that_does_not_fit_the_world_is_dropped_with_a_problem(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, layout=Layout(world_size=8, tp=2, pp=2, dp=2))
    trace = load_trace(tmp_path)
    assert trace.layout is None
    assert "does not fit the trace's 4 ranks" in codes(trace)["layout"]


def test_group_members_that_disagree_across_ranks_are_reported(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path)
    meta = tmp_path / "rings" / "rank-00001.meta.jsonl"
    meta.write_text(meta.read_text().replace('"ranks":[0,1]', '"ranks":[0,1,2]'))
    trace = load_trace(tmp_path)
    assert "the members of 1 group disagree across ranks" in codes(trace)["group-disagreement"]
    assert trace.groups[groups[0].gid].ranks == (0, 1)  # a tie: the lowest reporting rank wins


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_merging_group_lines_does_not_depend_on_ranks_sharing_parsed_lines(data: st.DataObject) -> None:
    """Ranks that wrote the same line share one parsed entry (the load's way) or each hold a copy: the same groups
    (majority members, first line's name, ties to the lowest reporting rank), the same problems, in the same
    order; and the shared entries are left as they were."""
    import copy

    from megatrace.load.side_files import merge_groups

    lines = [{"kind": "group", "gid": g, "name": f"g{g}-{v}", "desc": "tp", "ranks": members}
             for g in range(3) for v, members in enumerate(([0, 1], [0, 1, 2], [1, 2]))]
    lines += [{"kind": "group", "gid": 7, "ranks": "no"}, {"kind": "group", "gid": "x"}, {"kind": "rank", "rank": 0}]
    metas = {r: [lines[i] for i in data.draw(st.lists(st.integers(0, len(lines) - 1), max_size=6))]
             for r in data.draw(st.lists(st.integers(0, 9), unique=True, max_size=8))}
    before = copy.deepcopy(metas)
    used = {5: {0, 3}}
    shared_problems: list = []
    shared = merge_groups(metas, used, shared_problems)
    own_problems: list = []
    own = merge_groups(copy.deepcopy(metas), used, own_problems)
    assert shared == own and list(shared) == list(own)
    assert [str(p) for p in shared_problems] == [str(p) for p in own_problems]
    assert metas == before


def test_groups_without_meta_are_inferred_from_their_users(tmp_path: Path) -> None:
    b, groups = four_ranks()
    b.write(tmp_path, no_meta=(0, 1, 2, 3))
    trace = load_trace(tmp_path)
    assert "unknown-groups" in codes(trace) and "missing-meta" in codes(trace)
    assert trace.groups[groups[2].gid].ranks == (0, 2) and trace.groups[groups[2].gid].inferred


def test_process_facts_are_read_from_procs_json(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, procs={1: {"exit_code": 1}, 2: {"exit_code": None, "signal": "SIGTERM",
                                                      "killed_by_launcher": True}}, outcome="failed")
    facts = load_trace(tmp_path).facts
    assert facts.outcome == "failed"
    assert facts.procs[1].crashed and not facts.procs[2].crashed and not facts.procs[0].crashed
    assert facts.procs[1].describe() == "exited with status 1"


def test_rings_directly_in_the_directory_are_found(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path)
    trace = load_trace(tmp_path / "rings")
    assert trace.ranks.tolist() == [0, 1, 2, 3]


# -- hostile input: another user's links and FIFOs, huge worlds, deep nesting, sparse rings (issue 20) -------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

OTHER_UID = 4242  # the directory's owner, a user (made by chown: the tests run as root in CI)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")


def _give(path: Path) -> Path:
    os.lchown(path, OTHER_UID, OTHER_UID)
    return path


@needs_root
def test_as_root_a_users_layout_link_to_a_root_file_is_not_followed_nor_quoted(tmp_path: Path) -> None:
    """Item 2: the first line of a mode-600 root file was echoed into findings.json through layout.yaml."""
    secret = tmp_path / "root-only"
    secret.write_text("root-secret: [\n")  # bad YAML: the parser's message would quote it
    secret.chmod(0o600)
    user_dir = tmp_path / "job"
    b, _ = four_ranks()
    b.write(user_dir)
    _give(user_dir)
    (user_dir / "layout.yaml").symlink_to(secret)
    _give(user_dir / "layout.yaml")
    trace = load_trace(user_dir)
    text = json.dumps([p.message for p in trace.problems])
    assert "root-secret" not in text and trace.layout is None
    assert "layout.yaml: a symbolic link owned by uid 4242; not followed" in codes(trace)["layout"]
    assert f"belongs to uid {OTHER_UID} and is analysed as root" in codes(trace)["foreign-owner"]


def test_a_bad_layout_is_named_by_line_without_quoting_it(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path)
    (tmp_path / "layout.yaml").write_text("tp: 2\nroot-secret: [\n")
    msg = codes(load_trace(tmp_path))["layout"]
    assert "not valid YAML at line 3" in msg and "root-secret" not in msg, msg


@needs_root
def test_fifos_a_user_planted_for_meta_and_procs_files_never_block_the_analysis(tmp_path: Path) -> None:
    b, _ = four_ranks()
    b.write(tmp_path, procs={})
    for name in ("rings/rank-00001.meta.jsonl", "procs.json"):
        (tmp_path / name).unlink()
        os.mkfifo(tmp_path / name)
        _give(tmp_path / name)
    code = (f"from megatrace.load import load_trace\n"
            f"for tail in (None, 8):\n"
            f"    t = load_trace({str(tmp_path)!r}, tail=tail)\n"
            f"    print(sorted(p.code for p in t.problems))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all("procs" in line for line in done.stdout.splitlines()), done.stdout


def test_rings_claiming_a_world_of_two_billion_ranks_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    """Item 10: 12 KB rings with world_size 2**31-1 made the analysis allocate gigabytes (range(world))."""
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    for rank in range(2):
        w = RingWriter(tmp_path, RingIdentity(rank=rank, world_size=2**31 - 1, job_id="j"), capacity=128)
        w.complete(w.begin(1, 7, 1, 4))
        w.close()
    code = (f"import sys\nfrom megatrace.cli import main\n"
            f"try:\n    main(['analyze', {str(tmp_path)!r}])\n"
            f"except SystemExit as e:\n    print('exit', e.code, {PEAK_KIB})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "world size 2147483647 is outside 1..1048576" in done.stderr
    _, code_, rss_kib = done.stdout.split()
    assert code_ == "1" and int(rss_kib) < 400_000, done.stdout


DEEP = b'{"kind":"group","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"


@pytest.mark.parametrize("tail", [None, QUICK := 16])
def test_a_meta_or_procs_line_nested_100000_deep_is_a_problem_not_a_traceback(tmp_path: Path, tail) -> None:
    """Item 11: json.loads raised RecursionError (no report, also with --quick)."""
    b, _ = four_ranks()
    b.write(tmp_path, procs={})
    with open(tmp_path / "rings" / "rank-00002.meta.jsonl", "ab") as fh:
        fh.write(DEEP)
    (tmp_path / "procs.json").write_bytes(b'{"ranks":' + DEEP[:-1] + b"}")
    trace = load_trace(tmp_path, tail=tail)
    assert trace.ranks.tolist() == [0, 1, 2, 3]
    assert "nested too deeply" in codes(trace)["procs"]
    assert any("nested too deeply" in p.message for p in trace.problems if p.code != "procs"), codes(trace)


def test_a_sparse_gigabyte_ring_costs_only_what_its_capacity_says(tmp_path: Path) -> None:
    """Item 15: a 1 GiB sparse ring (12 KB on disk) cost 1.1 GB of memory: read_ring read the whole file."""
    from megatrace.trace.ring_writer import RingIdentity, RingWriter

    w = RingWriter(tmp_path, RingIdentity(rank=0, world_size=1, job_id="j"), capacity=128)
    w.complete(w.begin(1, 7, 1, 4))
    w.close()
    os.truncate(w.path, 1 << 30)
    code = (f"from megatrace.trace.ring_reader import read_ring\n"
            f"before = {PEAK_KIB}\n"
            f"s = read_ring({str(w.path)!r})\n"
            f"print(len(s.records), {PEAK_KIB} - before)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    n, grown_kib = done.stdout.split()
    # What reading costs, whatever the interpreter had loaded before: the capacity's 8 KiB, not the file's 1 GiB.
    assert n == "1" and int(grown_kib) < 64_000, (done.stdout, done.stderr)


@pytest.fixture(params=["c", "python"])
def meta_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Meta files (and ring heads and tails) read by the C batch passes, or each on its own (no extension)."""
    from megatrace.trace import ring_io

    if request.param == "c" and ring_io._read_files is None:
        pytest.skip("C extension not built (no compiler at install): the Python way runs in the other case")
    if request.param == "python":
        for name in ("_read_files", "_open_heads", "_read_runs"):
            monkeypatch.setattr(ring_io, name, None)
    return request.param


def test_a_quick_load_reads_odd_meta_files_as_a_full_load_does(tmp_path: Path, meta_reads: str) -> None:
    """Rank 1's meta file is a link to a copy (this user's link: followed), rank 2's a FIFO (not read, nothing
    blocks), rank 3's missing: the quick load's groups and problems are the full load's, either way."""
    import os

    b, groups = four_ranks()
    b.write(tmp_path, closed=True)
    metas = {r: next(tmp_path.rglob(f"rank-{r:05d}.meta.jsonl")) for r in range(4)}
    copy = tmp_path / "copy.jsonl"
    shutil.move(metas[1], copy)
    metas[1].symlink_to(copy)
    metas[2].unlink()
    os.mkfifo(metas[2])
    metas[3].unlink()
    quick, full = load_trace(tmp_path, tail=64), load_trace(tmp_path)
    assert quick.groups == full.groups and groups[0].gid in quick.groups
    got = codes(quick)
    assert got == codes(full) and "not a regular file" in got["meta"] and "[3]" in got["missing-meta"]
    assert quick.meta == full.meta and quick.meta[1] and not quick.meta[2] and not quick.meta[3]


def test_read_files_gives_each_small_file_or_leaves_it_to_the_caller(tmp_path: Path) -> None:
    """``ring_io.read_files``: the bytes of regular files within the limit; None (the caller reads it its own way,
    which says why) for a link, a FIFO, a directory, a missing file and one over the limit."""
    import os

    from megatrace.trace import ring_io

    if ring_io._read_files is None:
        pytest.skip("C extension not built (no compiler at install)")
    small, empty, big = tmp_path / "small", tmp_path / "empty", tmp_path / "big"
    small.write_bytes(b'{"kind": "group"}\n' * 3)
    empty.write_bytes(b"")
    big.write_bytes(b"x" * 101)
    (tmp_path / "exact").write_bytes(b"y" * 100)
    link, fifo = tmp_path / "link", tmp_path / "fifo"
    link.symlink_to(small)
    os.mkfifo(fifo)
    paths = [small, empty, tmp_path / "exact", big, link, fifo, tmp_path, tmp_path / "missing"]
    got = ring_io.read_files(paths, 100)
    assert got[:3] == [small.read_bytes(), b"", b"y" * 100] and got[3:] == [None] * 5
    assert ring_io.read_files([], 100) == []
