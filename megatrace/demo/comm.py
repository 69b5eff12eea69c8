"""The demo's communication: TP/PP/DP process groups and every call it makes on them.

Every call goes through the public ``torch.distributed`` API, looked up on the
``dist`` module at call time, so a tracer that patches those functions sees it.
Calls on groups of size 1 are skipped (as Megatron-LM does), but every group is
created on every rank in the same order, so group ids are stable.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from megatrace.config import GROUP_KINDS, Layout

Peer = tuple[torch.Tensor, int]  # (tensor, global peer rank)


def create_groups(layout: Layout, rank: int, timeout: timedelta) -> dict[str, dist.ProcessGroup]:
    """Create every TP, PP and DP group (collectively, on all ranks); return this rank's three."""
    mine: dict[str, dist.ProcessGroup] = {}
    for kind in GROUP_KINDS:
        for ranks in getattr(layout, f"{kind}_groups")():
            group = dist.new_group(ranks, timeout=timeout, group_desc=kind)
            if rank in ranks:
                mine[kind] = group
    return mine


class Comm:
    """This rank's groups, plus a gate called right before every communication call (fault injection)."""

    def __init__(self, layout: Layout, groups: dict[str, dist.ProcessGroup], gate: Callable[[], None]) -> None:
        self.groups = groups
        self.sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
        self.gate = gate
        self.tp_busy_s = 0.0  # time spent inside TP all_reduces, so compute time can exclude it
        self.layer_pad_s = 0.0  # padding before each TP all_reduce: the layer's compute (StageRunner sets it)
        self.padded_s = 0.0  # all such padding so far

    def all_reduce(self, tensor: torch.Tensor, kind: str) -> None:
        """Sum ``tensor`` in place over this rank's ``kind`` group."""
        if self.sizes[kind] > 1:
            if kind == "tp" and self.layer_pad_s > 0:
                time.sleep(self.layer_pad_s)
                self.padded_s += self.layer_pad_s
            self.gate()
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.groups[kind])
            if kind == "tp":
                self.tp_busy_s += time.perf_counter() - start

    def exchange(self, sends: list[Peer], recvs: list[Peer]) -> None:
        """One batch of pipeline point-to-point ops (global peer ranks), waited on, like Megatron-LM's."""
        if not sends and not recvs:
            return
        group = self.groups["pp"]
        # Receives first: each is posted (and traced) before any send of this batch, so a send
        # delayed by a slowlink fault shows as a late arrival in the peer's receive.
        ops = [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        ops += [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        self.gate()
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def average_gradients(self, params: list[torch.nn.Parameter], mode: str) -> None:
        """Average gradients over the DP group as one flat buffer (all_reduce, or reduce-scatter + all-gather)."""
        dp = self.sizes["dp"]
        if dp == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        group = self.groups["dp"]
        if mode == "allreduce":
            self.gate()
            dist.all_reduce(flat, group=group)
        else:
            padded = torch.zeros(-(-flat.numel() // dp) * dp)
            padded[:flat.numel()] = flat
            shard = torch.empty(padded.numel() // dp)
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            self.gate()
            reduce_scatter(shard, padded, group=group)
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            self.gate()
            all_gather(padded, shard, group=group)
            flat = padded[:flat.numel()]
        flat /= dp
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
