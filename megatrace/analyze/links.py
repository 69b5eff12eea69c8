"""Slow links: transfers that take longer than the same kind of transfer elsewhere, and the delay matrix.

A transfer is timed from when both sides had arrived: a p2p pair from
max(send, recv enqueue) to the receive's completion, a collective from its
last arrival to its last completion. Per pair of ranks (a p2p channel, or two
members of a small collective group) the median is compared with the median of
the other pairs of the same kind; the excess fills a rank × rank delay matrix.
A rank whose every pair is slow shows as a row and a column (its NIC, PCIe link
or host); a slow link is one cell. Compute stragglers do not show here: a late
arrival does not make the transfer after it slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrace.analyze.findings import Finding, Severity, Subject
from megatrace.analyze.index import CHUNK, RecordIndex, chunks
from megatrace.analyze.iterations import Iterations, perf_kind
from megatrace.analyze.match import Collectives
from megatrace.analyze.words import duration, rank_label, rank_subject
from megatrace.load.traceset import TraceSet
from megatrace.names import unknown_op_name
from megatrace.trace.ring_format import Op, State

# A slow link's median transfer time exceeds that of the same kind of transfer elsewhere by at least ...
MIN_LINK_EXCESS_NS = 5_000_000  # ... 5 ms (healthy demo p2p medians: 0.2–0.7 ms; collectives 1–4 ms)
MIN_LINK_RATIO = 3.0  # ... and is at least 3 times the reference (load on 2 cores doubles medians, not triples)
MIN_LINK_TRANSFERS = 3  # transfers needed on a pair to judge it
MAX_PAIR_GROUP = 8  # collective groups up to this size (TP) fill the pair view; a DP group of 512 would not
DENSE_MAX_RANKS = 2048  # the dense delay matrix up to this world size (32 MiB); beyond, the pair list only
SLOW_RANK_FRACTION = 0.75  # a rank with this share of its pairs slow (and at least 2) is itself slow (row+column)
EXACT_REFERENCE = 16  # up to this many pairs of a kind, a pair's reference leaves the pair itself out
MAX_LISTED = 8  # pairs named one by one in a finding


@dataclass
class PairStats:
    """Transfers between two ranks against the same kind of transfer elsewhere (ns)."""

    a: int
    b: int
    kind: str  # "p2p", "tp", "dp", ... (the group kind)
    transfers: int
    median_ns: int
    reference_ns: int
    slow: bool = False

    @property
    def excess_ns(self) -> int:
        return self.median_ns - self.reference_ns


def _medians(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys, lower median of ``values`` per key, count per key), by one sort."""
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, np.diff(k) != 0]) if len(k) else np.zeros(0, np.int64)
    sizes = np.diff(np.r_[starts, len(k)])
    return k[starts], v[starts + (sizes - 1) // 2], sizes


def _references(kinds: list[str], meds: np.ndarray, same: list[list[int]]) -> np.ndarray:
    """Per item, the median of the other items of its kind (leaving out ``same[i]``); -1 where there are none."""
    ref = np.full(len(meds), -1, np.int64)
    for kind in set(kinds):
        idx = np.array([i for i, k in enumerate(kinds) if k == kind])
        if len(idx) > EXACT_REFERENCE:  # many: leaving a few out does not move the median
            ref[idx] = int(np.median(meds[idx]))
            continue
        for i in idx.tolist():
            others = [j for j in idx.tolist() if j not in same[i]]
            if others:
                ref[i] = int(np.median(meds[others]))
    return ref


def p2p_pairs(trace: TraceSet, ix: RecordIndex, it: Iterations, te: np.ndarray, tc: np.ndarray,
              steps: list[int]) -> list[PairStats]:
    """Per p2p channel (src -> dst): receive completion − when both sides had arrived, against other channels."""
    rec = trace.records
    in_steps = it.in_steps(steps)
    found = []
    for lo, hi in _channel_chunks(ix.pair_chan):  # (whole channels at a time: temporaries bounded by CHUNK pairs)
        s, r = ix.send_row[lo:hi], ix.recv_row[lo:hi]
        both = np.flatnonzero((s >= 0) & (r >= 0))
        s, r = s[both], r[both]
        keep = (rec.state[r] == State.COMPLETED) & (tc[r] > 0) & in_steps(it.record_step[r])
        s, r, chan = s[keep], r[keep], ix.pair_chan[lo + both[keep]]
        found.append(_medians(chan.astype(np.int64), tc[r] - np.maximum(te[s], te[r])))
    chans, meds, counts = (np.concatenate(cols) for cols in zip(*found)) if found else (np.zeros(0, np.int64),) * 3
    good = counts >= MIN_LINK_TRANSFERS
    chans, meds, counts = chans[good], meds[good], counts[good]
    src, dst = ix.chan_src[chans].astype(np.int64), ix.chan_dst[chans].astype(np.int64)
    kinds = []
    for ch in chans.tolist():
        g = trace.groups.get(int(ix.group_ids[ix.chan_gidx[ch]]))
        kinds.append(f"{g.kind} p2p" if g is not None and g.named else "p2p")
    # Leave out both directions of the same pair when taking the reference.
    pair_key = np.minimum(src, dst) * trace.world_size + np.maximum(src, dst)
    same = [np.flatnonzero(pair_key == k).tolist() for k in pair_key.tolist()] if len(chans) <= EXACT_REFERENCE \
        else [[i] for i in range(len(chans))]
    ref = _references(kinds, meds, same)
    return [PairStats(int(a), int(b), k, int(n), int(m), int(rf)) for a, b, k, n, m, rf
            in zip(src, dst, kinds, counts, meds, ref) if rf >= 0]


def _channel_chunks(pair_chan: np.ndarray) -> list[tuple[int, int]]:
    """Ranges of pair ids of about :data:`CHUNK` pairs, cut between channels (pair ids ascend by channel)."""
    cuts = np.unique(np.r_[0, np.searchsorted(pair_chan, pair_chan[CHUNK::CHUNK]), len(pair_chan)])
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def collective_pairs(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations,
                     steps: list[int]) -> list[PairStats]:
    """Per small collective group and op: last completion − last arrival, against the other groups' of its kind.

    Every pair of members gets the group's figures (a collective's time cannot be pinned to one of its links);
    groups larger than :data:`MAX_PAIR_GROUP` are left out of the pair view.
    """
    seen = np.zeros(ix.n_instances, bool)  # the instances entered in ``steps`` (marked, not sorted out)
    in_steps = it.in_steps(steps)
    for sl in chunks(len(ix.inst)):
        inst = ix.inst[sl]
        seen[inst[(inst >= 0) & in_steps(it.record_step[sl])]] = True
    insts = np.flatnonzero(seen)
    insts = insts[(c.complete & (c.n_members >= 2) & (c.last_complete > 0))[insts]]
    key = ix.inst_gidx[insts].astype(np.int64) * 65536 + c.op[insts]
    keys, meds, counts = _medians(key, (c.last_complete - c.last_enter)[insts])
    items = []
    for k, m, n in zip(keys.tolist(), meds.tolist(), counts.tolist()):
        g = trace.groups.get(int(ix.group_ids[k // 65536]))
        if g is None or n < MIN_LINK_TRANSFERS:
            continue
        op = k % 65536
        label = Op(op).label if op in Op._value2member_map_ else unknown_op_name(op)
        items.append((g, f"{g.kind} {label}", m, n))
    ref = _references([kd for _, kd, _, _ in items], np.array([m for *_, m, _ in items], np.int64),
                      [[i] for i in range(len(items))])
    out = []
    for (g, kind, m, n), rf in zip(items, ref.tolist()):
        if rf < 0 or len(g.ranks) > MAX_PAIR_GROUP:
            continue
        out += [PairStats(a, b, kind, n, m, rf) for i, a in enumerate(g.ranks) for b in g.ranks[i + 1:]]
    return out


def delay_matrix(pairs: list[PairStats], world: int) -> np.ndarray | None:
    """The rank × rank matrix of excess transfer time (ns, >= 0, symmetric, NaN where unmeasured), small worlds."""
    if world > DENSE_MAX_RANKS:
        return None
    delay = np.full((world, world), np.nan)
    for p in pairs:
        if 0 <= p.a < world and 0 <= p.b < world:
            for a, b in ((p.a, p.b), (p.b, p.a)):
                delay[a, b] = np.fmax(delay[a, b], float(max(p.excess_ns, 0)))
    return delay


def classify_delays(pairs: list[PairStats]) -> tuple[list[int], list[PairStats]]:
    """Slow ranks (a row and a column of slow cells) and the slow links they do not explain."""
    slow = [p for p in pairs if p.slow]
    partners: dict[int, set[int]] = {}
    slow_partners: dict[int, set[int]] = {}
    excess: dict[int, list[int]] = {}
    for p in pairs:
        for a, b in ((p.a, p.b), (p.b, p.a)):
            partners.setdefault(a, set()).add(b)
    for p in slow:
        for a, b in ((p.a, p.b), (p.b, p.a)):
            slow_partners.setdefault(a, set()).add(b)
            excess.setdefault(a, []).append(p.excess_ns)
    ranks = sorted((r for r, s in slow_partners.items()
                    if len(s) >= 2 and len(s) >= SLOW_RANK_FRACTION * len(partners[r])),
                   key=lambda r: -float(np.median(excess[r])))
    links: dict[tuple[int, int], PairStats] = {}
    for p in slow:
        if p.a in ranks or p.b in ranks:
            continue
        key = (min(p.a, p.b), max(p.a, p.b))
        if key not in links or p.excess_ns > links[key].excess_ns:
            links[key] = p
    return ranks, sorted(links.values(), key=lambda p: -p.excess_ns)


def analyze_links(trace: TraceSet, ix: RecordIndex, c: Collectives, it: Iterations, te: np.ndarray, tc: np.ndarray,
                  steps: list[int]) -> tuple[list[PairStats], np.ndarray | None, list[int], list[PairStats]]:
    """(pairs, delay matrix or None when large, slow ranks, slow links) over ``steps``."""
    pairs = p2p_pairs(trace, ix, it, te, tc, steps) + collective_pairs(trace, ix, c, it, steps)
    for p in pairs:
        p.slow = p.excess_ns >= MIN_LINK_EXCESS_NS and p.median_ns >= MIN_LINK_RATIO * max(p.reference_ns, 1)
    slow_ranks, slow_links = classify_delays(pairs)
    return pairs, delay_matrix(pairs, trace.world_size), slow_ranks, slow_links


def _hosts(trace: TraceSet, ranks: list[int]) -> tuple[str, ...]:
    return tuple(sorted({h for h in (trace.host_of(r) for r in ranks) if h}))


def link_finding(trace: TraceSet, pairs: list[PairStats], steps: list[int], p: PairStats) -> Finding:
    """The finding for one slow link (a cell of the delay matrix no slow rank explains)."""
    a, b = min(p.a, p.b), max(p.a, p.b)
    ha, hb = trace.host_of(a) or "?", trace.host_of(b) or "?"
    where = f"hosts {ha} and {hb}" if ha != hb else f"host {ha}"
    verdict = (f"slow link between ranks {a} and {b} ({where}): {p.kind} transfers take {duration(p.median_ns)} "
               f"after both sides arrived, against {duration(p.reference_ns)} elsewhere")
    others = [q for q in pairs if q.kind == p.kind and not q.slow and {q.a, q.b} != {a, b}]
    own = [q for q in pairs if {q.a, q.b} != {a, b} and ({q.a, q.b} & {a, b})]
    own_ok = [q for q in own if not q.slow]
    evidence: list[str | dict[str, Any]] = [
        f"median over {p.transfers} transfers in steps {steps[0]}–{steps[-1]}: both ranks had entered, the time "
        "was lost inside the transfer",
        f"{len(others)} other {p.kind} channels are normal (median {duration(p.reference_ns)})"]
    if own:
        evidence.append(f"{len(own_ok)} of the {len(own)} other pairs of ranks {a} and {b} are normal: "
                        + ("one link, not one rank" if len(own_ok) == len(own) else "mostly this link"))
    return Finding(
        id=f"slow-link:{a}-{b}", severity=Severity.WARNING, kind=perf_kind("SLOW_LINK"),
        subject=Subject(ranks=(a, b), hosts=_hosts(trace, [a, b]), link=(a, b)), verdict=verdict,
        evidence=evidence,
        remediation=("Test the network path between these ranks' GPUs/hosts (nccl-tests or ib_write_bw between the "
                     "two, link error counters, cabling and switch port, NVLink status within a node); drain the "
                     "node or fix the link."),
        confidence=min(0.95, 0.6 + 0.35 * min(1.0, p.excess_ns / (4 * MIN_LINK_EXCESS_NS))) * trace.coverage,
        impact=len(trace.ranks), data={"median_ns": p.median_ns, "reference_ns": p.reference_ns, "kind": p.kind,
                                       "transfers": p.transfers})


def slow_rank_finding(trace: TraceSet, pairs: list[PairStats], steps: list[int], r: int) -> Finding:
    """The finding for a rank whose every pair is slow (a row and a column of the delay matrix)."""
    mine = [p for p in pairs if p.slow and r in (p.a, p.b)]
    verdict = (f"{rank_label(trace, r)} communicates slowly with every peer: {len(mine)} of its pairs take "
               f"{duration(int(np.median([p.median_ns for p in mine])))} per transfer against "
               f"{duration(int(np.median([p.reference_ns for p in mine])))} elsewhere")
    evidence: list[str | dict[str, Any]] = [
        f"{p.kind} with rank {p.b if p.a == r else p.a}: {duration(p.median_ns)} (elsewhere "
        f"{duration(p.reference_ns)}), steps {steps[0]}–{steps[-1]}" for p in mine[:MAX_LISTED]]
    return Finding(
        id=f"slow-rank-network:rank-{r}", severity=Severity.WARNING, kind=perf_kind("SLOW_RANK_NETWORK"),
        subject=rank_subject(trace, r), verdict=verdict, evidence=evidence,
        remediation=("This rank's network path is slow to every peer: check its NIC and PCIe link (ibstat, link "
                     "speed, error counters), its GPU's PCIe/NVLink status and the host's load; drain the node."),
        confidence=0.8 * trace.coverage, impact=len(trace.ranks))


