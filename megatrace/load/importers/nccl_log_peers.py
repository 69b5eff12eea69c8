"""Send/recv partners in Megatrace NCCL-patch logs, where the log names no peer.

A send or recv on a communicator of more than two ranks (a Megatron pipeline group) is logged without
its peer: :func:`p2p_partners` infers the peer and the pairing from the layout's stage order and the
call sequences of adjacent stages. Used by :mod:`megatrace.load.importers.nccl_log`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from megatrace.config import GROUP_KINDS, Layout


def layout_kind(members: tuple[int, ...], layout: Layout | None) -> str:
    """The layout group kind (tp, pp, dp, ...) whose members these are; "default_pg" for the world; "" none."""
    if layout is None or len(members) < 2:
        return ""
    for kind in GROUP_KINDS:
        if tuple(layout.group_of(kind, members[0])) == tuple(sorted(members)):
            return kind
    return "default_pg" if len(members) == layout.world_size else ""


def _group_ends(calls: list[tuple], comms: list[tuple[str, tuple[int, ...]]]) -> list[float]:
    """Per call, when the rank moved on from it: the enqueue time of its next call that belongs to another NCCL
    group (another communicator, or another opCount on the same one; one-rank communicators do not count);
    infinity for the calls of its last group."""
    ends = [math.inf] * len(calls)
    after, run_key, run_first = math.inf, None, math.inf
    for i in range(len(calls) - 1, -1, -1):  # backwards, run by run of calls of one group
        ckey, members = comms[i]
        if len(members) < 2:
            continue
        gkey = (ckey, calls[i][4])
        if gkey != run_key:
            after = run_first if run_key is not None else math.inf
            run_key = gkey
        run_first = calls[i][0]
        ends[i] = after
    return ends


def p2p_partners(rank_calls: dict[int, list[tuple]], comm_of: dict[tuple[int, int], tuple[str, tuple[int, ...]]],
                  layout: Layout | None, ended: dict[int, int] | None = None) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, row) -> (peer or -1, its place in the channel peer -> rank or rank -> peer) for every send and recv
    on a communicator of more than two ranks (a Megatron pipeline group: the log names no peer).

    Rule. The candidates of a call are the adjacent stages of its pipeline group (the layout's stage order:
    a stage sends forward to the next stage's rank of the same DP and TP coordinates and backward to the
    previous one; no wrap-around, so the last-to-first transfer of an interleaved schedule is not recognised);
    on a communicator that is not a layout pipeline group, every other member. A Send of ``N`` elements on
    rank ``a`` pairs with a Recv of ``N`` elements on a candidate ``b`` when both were posted before either
    rank moved on: each side's enqueue time is at most the other side's next call of another NCCL group (a
    batch of send/recv is waited on before the rank goes on: Megatron-LM's ``batch_p2p_sync``, gloo), give
    or take :data:`P2P_SKEW_NS` of clock difference between hosts (a send that completes before its receive
    is posted, as small messages may, and whose rank then moved on, is not paired: see below).

    Candidate pairs are taken greedily: first those that must have a partner in the logs (both calls made
    while every candidate of their rank was observed, and neither in its rank's last group, which a hang may
    leave unpaired), then the others; within each, the one whose receiving rank stayed the shortest in its
    group after the transfer could start first (a receive completes once its send is posted, and its rank
    then moves on; of equally good ones, a pair between two batches that already exchanged one: a 1F1B
    step's batch sends to and receives from the same neighbour), each call at most once, keeping every
    channel first-in first-out (NCCL matches the k-th send a -> b with the k-th receive on b from a). A
    greedy choice can take the partner of another call: augmenting paths then pair as many calls as possible
    (a call left alone takes a candidate whose partner moves to another of its candidates, and so on), and
    the fewest pairs that would break a channel's order are undone. On the demo's TP2 x PP4 runs this gets
    98-100% of the peers right; the rest are two neighbouring calls swapped.

    A call is paired only with a call of a rank whose log covers its time (a log starts later when its ring
    wrapped, and ends early when its later dumps are missing: ``ended``, told from the collectives): the
    partner of a call outside a candidate's log may be that candidate, unobserved. A call of a rank one of
    whose candidates is unobserved at that time still pairs with a candidate that is observed, after the calls
    that must have a partner: excluding it would leave that candidate's real partner out and let a
    neighbour's call of similar timing and size take its place (a pipeline whose first stage lost its last
    dump then had every later transfer of its second stage misassigned, and the hang was blamed on the wrong
    stage), and taking it first let its coincidental match steal the call of a neighbour that has no other
    partner.

    A call left without a partner (its partner fell outside the other rank's log, or was never posted: what a
    hang leaves) gets its peer by elimination among its candidates, each step applied while more than one
    remains (and only if one survives it): drop a candidate whose own last group is left with calls of the
    same kind only (two ranks both waiting in a receive, or both in a send, cannot serve each other); keep
    those that logged nothing on the communicator after the call (they never posted its partner); keep those
    whose log starts after it (the partner was lost to their ring). One candidate left: the peer; else -1
    (unknown: the call is then not judged). Places: within each channel, matched pairs and unmatched calls
    are numbered in order, a pair sharing its number, an unmatched call a number of its own.
    """
    out: dict[tuple[int, int], tuple[int, int]] = {}
    comms, ops, ends = _p2p_calls(rank_calls, comm_of)
    first_t = {r: calls[0][0] for r, calls in rank_calls.items() if calls}
    log_end = {r: calls[-1][0] for r, calls in rank_calls.items() if calls and r in (ended or {})}
    for ckey, members in comms.items():
        by_rank = ops[ckey]
        stages = sorted(members, key=lambda m: layout.coords(m).pp) if layout is not None and \
            layout_kind(members, layout) == "pp" else None

        def candidates(rank: int, members: tuple[int, ...] = members, stages: list[int] | None = stages) -> list[int]:
            if stages is None:
                return [m for m in members if m != rank]
            k = stages.index(rank)
            return [stages[j] for j in (k - 1, k + 1) if 0 <= j < len(stages)]

        def unseen(rank: int, t: float) -> bool:
            """The rank's log does not cover time ``t`` (it starts later or ended early)."""
            return t < first_t.get(rank, math.inf) - P2P_SKEW_NS or t > log_end.get(rank, math.inf) + P2P_SKEW_NS

        matched = _match_p2p(rank_calls, by_rank, ends, candidates, unseen)
        peer_of = _peers(rank_calls, by_rank, matched, candidates, first_t)
        out.update(_channel_places(rank_calls, by_rank, peer_of, matched))
    return out


def _p2p_calls(rank_calls: dict[int, list[tuple]], comm_of: dict[tuple[int, int], tuple[str, tuple[int, ...]]]
               ) -> tuple[dict[str, tuple[int, ...]], dict[str, dict[int, list[int]]], dict[int, list[float]]]:
    """The send/recv calls on communicators of more than two ranks: communicator -> members, communicator ->
    rank -> rows, and each rank with such calls -> :func:`_group_ends` of its calls."""
    comms: dict[str, tuple[int, ...]] = {}
    ops: dict[str, dict[int, list[int]]] = {}  # communicator -> rank -> rows of its send/recv
    ends: dict[int, list[float]] = {}
    for rank, calls in rank_calls.items():
        mine = [comm_of[(rank, i)] for i in range(len(calls))]
        for i, c in enumerate(calls):
            ckey, members = mine[i]
            if c[1] in ("Send", "Recv") and len(members) > 2:
                comms[ckey] = members
                ops.setdefault(ckey, {}).setdefault(rank, []).append(i)
        if any(len(m) > 2 and c[1] in ("Send", "Recv") for c, (_, m) in zip(calls, mine)):
            ends[rank] = _group_ends(calls, mine)
    return comms, ops, ends


def _peers(rank_calls: dict[int, list[tuple]], by_rank: dict[int, list[int]],
           matched: dict[tuple[int, int], tuple[int, int]], candidates, first_t: dict[int, float]
           ) -> dict[tuple[int, int], int]:  # noqa: ANN001 - candidates: rank -> ranks
    """(rank, row) -> peer of every send/recv of one communicator: its partner's rank where ``matched``, else by
    elimination among its candidates, or -1 (see :func:`p2p_partners`)."""
    last_t = {r: rank_calls[r][rows[-1]][0] for r, rows in by_rank.items()}
    stuck_kind = {}  # rank -> the one kind of call left unpaired in its last group ("Send" or "Recv")
    for r, rows in by_rank.items():
        tail = [i for i in rows if rank_calls[r][i][4] == rank_calls[r][rows[-1]][4] and (r, i) not in matched]
        kinds = {rank_calls[r][i][1] for i in tail}
        if len(kinds) == 1:
            stuck_kind[r] = kinds.pop()
    peer_of: dict[tuple[int, int], int] = {}
    for rank, rows in by_rank.items():
        for i in rows:
            if (rank, i) in matched:
                peer_of[(rank, i)] = matched[(rank, i)][0]
                continue
            t, kind = rank_calls[rank][i][0], rank_calls[rank][i][1]
            cands = [m for m in candidates(rank) if m != rank]
            for step in ("not waiting alike", "silent after", "log starts after"):
                if len(cands) < 2:
                    break
                if step == "not waiting alike":
                    left = [m for m in cands if stuck_kind.get(m) != kind or rank not in candidates(m)]
                elif step == "silent after":
                    left = [m for m in cands if last_t.get(m, -math.inf) < t]
                else:
                    left = [m for m in cands if first_t.get(m, math.inf) > t]
                cands = left or cands
            peer_of[(rank, i)] = cands[0] if len(cands) == 1 else -1
    return peer_of


def _slack(ns: float) -> float:
    """Time a rank stayed in a group after a transfer could start; the last group (never left) counts 1 h."""
    return 3.6e12 if ns == math.inf else max(ns, 0.0)


P2P_SKEW_NS = 200_000  # clock difference allowed between two hosts' logs when pairing a send with its receive


def _match_p2p(rank_calls: dict[int, list[tuple]], by_rank: dict[int, list[int]], ends: dict[int, list[float]],
               candidates, unseen) -> dict[tuple[int, int], tuple[int, int]]:  # noqa: ANN001 - (rank -> ranks)
    """(rank, row) -> (peer, peer's row) for the send/recv pairs of one communicator; see :func:`p2p_partners`.
    ``unseen(rank, t)``: the rank's log does not cover time ``t`` (it starts later or ends earlier): a call at
    ``t`` is not paired with that rank."""
    import bisect

    recvs: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}  # rank -> (enqueue, moved-on, rows)
    for rank, rows in by_rank.items():
        mine = [i for i in rows if rank_calls[rank][i][1] == "Recv"]
        recvs[rank] = (np.array([rank_calls[rank][i][0] for i in mine], np.float64),
                       np.array([ends[rank][i] for i in mine], np.float64), mine)
    edges = []
    for rank, rows in by_rank.items():
        calls, end = rank_calls[rank], ends[rank]
        for dst in candidates(rank):
            if dst not in recvs or not len(recvs[dst][2]):
                continue
            t_r, e_r, r_rows = recvs[dst]
            dcalls = rank_calls[dst]
            for i in rows:
                c = calls[i]
                if c[1] != "Send" or unseen(dst, c[0]):
                    continue
                lo = int(np.searchsorted(e_r, c[0] - P2P_SKEW_NS, "left"))
                hi = int(np.searchsorted(t_r, end[i] + P2P_SKEW_NS, "right"))
                for k in range(lo, hi):
                    j = r_rows[k]
                    if dcalls[j][2] == c[2] and t_r[k] <= end[i] + P2P_SKEW_NS and e_r[k] >= c[0] - P2P_SKEW_NS \
                            and not unseen(rank, dcalls[j][0]):
                        at = max(c[0], dcalls[j][0])
                        slack = _slack(e_r[k] - at)
                        doubt = end[i] == math.inf or e_r[k] == math.inf \
                            or any(unseen(x, c[0]) for x in candidates(rank)) \
                            or any(unseen(x, dcalls[j][0]) for x in candidates(dst))
                        edges.append((doubt, slack, at, rank, i, dst, j))
    edges.sort()
    matched: dict[tuple[int, int], tuple[int, int]] = {}
    fifo: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (src, dst) -> (send rows, recv rows), by send
    linked: set[tuple[tuple[int, float], tuple[int, float]]] = set()  # batches that exchanged a pair already
    for src, i, dst, j in _by_batch(edges, ends, linked):
        if (src, i) in matched or (dst, j) in matched:
            continue
        s_rows, r_rows = fifo.setdefault((src, dst), ([], []))
        k = bisect.bisect_left(s_rows, i)
        if (k > 0 and r_rows[k - 1] > j) or (k < len(s_rows) and r_rows[k] < j):
            continue  # would overtake a pair of the same channel
        s_rows.insert(k, i)
        r_rows.insert(k, j)
        matched[(src, i)], matched[(dst, j)] = (dst, j), (src, i)
        linked.add(((src, ends[src][i]), (dst, ends[dst][j])))
        linked.add(((dst, ends[dst][j]), (src, ends[src][i])))
    _augment(edges, matched)
    _keep_order(matched, rank_calls)
    return matched


def _by_batch(edges: list[tuple], ends: dict[int, list[float]], linked: set) -> Iterator[tuple[int, int, int, int]]:
    """The sorted edges as (src, i, dst, j); of edges equally cheap (same slack and start: a receive posted after
    two candidates' sends), those between two batches that already exchanged a pair first. A batch (the calls
    of one NCCL group, one ``ends`` value) of a pipeline schedule exchanges with one neighbour's batch: Megatron's
    send_forward_recv_backward sends to and receives from the same stage. ``linked`` grows as pairs are taken."""
    k = 0
    while k < len(edges):
        block = [edges[k]]
        while k + len(block) < len(edges) and edges[k + len(block)][:3] == edges[k][:3]:
            block.append(edges[k + len(block)])
        k += len(block)
        if len(block) > 1:
            block.sort(key=lambda e: ((e[3], ends[e[3]][e[4]]), (e[5], ends[e[5]][e[6]])) not in linked)
        for *_, src, i, dst, j in block:
            yield src, i, dst, j


def _keep_order(matched: dict[tuple[int, int], tuple[int, int]], rank_calls: dict[int, list[tuple]]) -> None:
    """Unpair the fewest pairs so that every channel stays first-in first-out (augmenting paths ignore the
    order): per channel, the longest run of pairs whose receives come in the order of their sends is kept."""
    import bisect

    by_channel: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (src, dst) -> [(send row, recv row)]
    for (rank, i), (peer, j) in matched.items():
        if rank_calls[rank][i][1] == "Send":
            by_channel.setdefault((rank, peer), []).append((i, j))
    for (src, dst), pairs in by_channel.items():
        pairs.sort()
        tops: list[int] = []  # patience sorting: the smallest last receive of an increasing run of each length
        ends_at: list[int] = []  # ... and the index of the pair that ends it
        prev = [-1] * len(pairs)
        for k, (_, j) in enumerate(pairs):
            pos = bisect.bisect_left(tops, j)
            if pos == len(tops):
                tops.append(j)
                ends_at.append(k)
            else:
                tops[pos], ends_at[pos] = j, k
            prev[k] = ends_at[pos - 1] if pos > 0 else -1
        keep, k = set(), ends_at[-1] if ends_at else -1
        while k >= 0:
            keep.add(k)
            k = prev[k]
        for k, (i, j) in enumerate(pairs):
            if k not in keep:
                del matched[(src, i)], matched[(dst, j)]


AUGMENT_DEPTH = 12  # sends visited at most on one augmenting path


def _augment(edges: list[tuple], matched: dict[tuple[int, int], tuple[int, int]]) -> None:
    """Pair more calls than the greedy pass did: a send left alone takes a candidate receive, whose partner takes
    another of its candidates, and so on until a receive left alone ends the chain (an augmenting path, cheapest
    candidates first). A greedy choice that took the partner of another call is undone this way."""
    adj: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for *_, src, i, dst, j in edges:  # (sorted: surest, then cheapest first)
        adj.setdefault((src, i), []).append((dst, j))

    def extend(send: tuple[int, int], seen: set, depth: int) -> bool:
        if depth > AUGMENT_DEPTH:
            return False
        for recv in adj.get(send, ()):
            if recv in seen:
                continue
            seen.add(recv)
            other = matched.get(recv)
            if other is None or extend(other, seen, depth + 1):
                matched[send], matched[recv] = recv, send
                return True
        return False

    for send in list(adj):
        if send not in matched:
            extend(send, set(), 0)


def _channel_places(rank_calls: dict[int, list[tuple]], by_rank: dict[int, list[int]],
                    peer_of: dict[tuple[int, int], int],
                    matched: dict[tuple[int, int], tuple[int, int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, row) -> (peer, place in its channel): pairs share a place, unmatched calls get their own, in order."""
    lists: dict[tuple[int, int], tuple[list, list]] = {}  # (src, dst) -> (sends on src, recvs on dst), in order
    for rank, rows in by_rank.items():
        for i in rows:
            peer = peer_of[(rank, i)]
            if rank_calls[rank][i][1] == "Send":
                lists.setdefault((rank, peer), ([], []))[0].append((rank, i))
            else:
                lists.setdefault((peer, rank), ([], []))[1].append((rank, i))
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for sends, recvs in lists.values():
        place, a, b = 0, 0, 0
        while a < len(sends) or b < len(recvs):
            s = sends[a] if a < len(sends) else None
            r = recvs[b] if b < len(recvs) else None
            place += 1
            if s is not None and r is not None and matched.get(s) == r:
                out[s], out[r] = (peer_of[s], place), (peer_of[r], place)
                a, b = a + 1, b + 1
            elif s is not None and s not in matched:
                out[s] = (peer_of[s], place)
                a += 1
            elif r is not None and r not in matched:
                out[r] = (peer_of[r], place)
                b += 1
            else:  # cannot happen: pairs keep their channel's order (_keep_order); never loop
                for x in (s, r):
                    if x is not None:
                        out[x] = (peer_of[x], place)
                a, b = a + (s is not None), b + (r is not None)
    return out
