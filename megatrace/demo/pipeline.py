"""One training step of one pipeline stage: the schedule's forwards and backwards, with their p2p traffic.

After each action the stage sends what it produced and receives what the next
action needs in one batch of point-to-point ops, as Megatron-LM's 1F1B does
(``send_forward_recv_backward`` / ``send_backward_recv_forward``); this pairing
is what keeps rendezvous-style sends from deadlocking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatrace.demo.comm import Comm, Peer
from megatrace.demo.model import HIDDEN, MICRO_BATCH, batch
from megatrace.schedule import Action


@dataclass
class StepStats:
    loss: float | None = None  # mean microbatch loss (last stage only)
    compute_s: float = 0.0  # real compute plus padding, without time in TP all_reduces


@dataclass
class StageRunner:
    """Executes a schedule on one stage. ``prev``/``next`` are global ranks of the neighbours (None at ends)."""

    model: nn.Module
    comm: Comm
    prev: int | None
    next: int | None
    dp_rank: int
    compute_ms: float
    slowdown: Callable[[], float]
    on_action: Callable[[str, int], None]  # (phase, microbatch) before each action
    _saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def run(self, step: int, actions: list[Action]) -> StepStats:
        stats = StepStats()
        losses: list[float] = []
        kind0, mb0 = actions[0]
        self.on_action("forward" if kind0 == "F" else "backward", mb0)
        received = self._exchange([], self._needs(actions[0]))
        for k, (kind, mb) in enumerate(actions):
            if k:
                self.on_action("forward" if kind == "F" else "backward", mb)
            start, tp_busy, padded = time.perf_counter(), self.comm.tp_busy_s, self.comm.padded_s
            # The padding is split like a layer's compute: a slice before each block's TP all_reduce, one at
            # the end; a slow GPU stretches every layer, not only the time before the next pipeline send.
            slices = 1 + (len(self.model) if self.comm.sizes["tp"] > 1 else 0)
            pad_ms = (1.0 if kind == "F" else 2.0) * self.compute_ms / slices
            self.comm.layer_pad_s = pad_ms / 1000.0 * self.slowdown()
            if kind == "F":
                produced = self._forward(step, mb, received, len(actions) // 2, losses)
            else:
                produced = self._backward(mb, received)
            self.comm.layer_pad_s = 0.0
            self._pad(start, tp_busy, padded, pad_ms)
            stats.compute_s += time.perf_counter() - start - (self.comm.tp_busy_s - tp_busy)
            nxt = actions[k + 1] if k + 1 < len(actions) else None
            received = self._exchange(produced, self._needs(nxt) if nxt else [])
        stats.loss = sum(losses) if self.next is None else None
        return stats

    def _needs(self, action: Action) -> list[Peer]:
        kind, _ = action
        peer = self.prev if kind == "F" else self.next
        return [] if peer is None else [(torch.empty(MICRO_BATCH, HIDDEN), peer)]

    def _exchange(self, sends: list[Peer], recvs: list[Peer]) -> torch.Tensor | None:
        self.comm.exchange(sends, recvs)
        return recvs[0][0] if recvs else None

    def _forward(self, step: int, mb: int, received: torch.Tensor | None, microbatches: int,
                 losses: list[float]) -> list[Peer]:
        x, target = batch(step, self.dp_rank, mb)
        inp = (x if received is None else received).requires_grad_()  # stands in for an embedding's grad
        out = self.model(inp)
        if self.next is None:
            loss = F.mse_loss(out, target) / microbatches
            losses.append(loss.item())
            self._saved[mb] = (inp, loss)
            return []
        self._saved[mb] = (inp, out)
        return [(out.detach(), self.next)]

    def _backward(self, mb: int, grad: torch.Tensor | None) -> list[Peer]:
        inp, out = self._saved.pop(mb)
        torch.autograd.backward(out, grad)
        return [] if self.prev is None else [(inp.grad, self.prev)]

    def _pad(self, start: float, tp_busy: float, padded: float, pad_ms: float) -> None:
        """Stretch the action's real compute by this rank's slowdown, and pad ``pad_ms`` more, times it too."""
        factor = self.slowdown()
        real = time.perf_counter() - start - (self.comm.tp_busy_s - tp_busy) - (self.comm.padded_s - padded)
        time.sleep(max(0.0, pad_ms / 1000.0 * factor + real * (factor - 1.0)))
