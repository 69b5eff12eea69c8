"""The model every torch-API engine trains: residual MLP blocks of plain ``nn.Linear`` layers.

Plain modules, so that DDP, ``fully_shard``, ``parallelize_module`` and ``PipelineStage`` take
them as they are. Each block's weights come from a seed of its global layer index, so every rank
builds the same model (and a pipeline stage its own slice of it). Data are the demo's teacher
task (:func:`megatrace.demo.model.batch`). Compute is padded like the 3D job's: a forward of the
rank's blocks sleeps ``--compute-ms`` in total, a backward twice that, times a ``slow`` fault's
factor, so that a slow rank shows between its own communication calls.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from megatrace.demo.model import FFN, HIDDEN, LAYER_SEED, LR, MomentumSGD, batch
from megatrace.demo.runtime import Session

__all__ = ["Block", "ComputeClock", "LR", "MomentumSGD", "batch", "build_blocks", "mse", "train_step"]


@dataclass
class ComputeClock:
    """The padding of one block's forward (its backward pads twice that), scaled by a slowdown factor."""

    pad_s: float
    slowdown: Callable[[], float]
    spent_s: float = 0.0  # padding so far; an engine resets it at each step

    def pad(self, scale: float) -> None:
        seconds = self.pad_s * scale * self.slowdown()
        if seconds > 0:
            time.sleep(seconds)
            self.spent_s += seconds


class _Pad(torch.autograd.Function):
    """Identity that sleeps the clock's padding in forward, twice it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: ComputeClock) -> torch.Tensor:
        ctx.clock = clock
        clock.pad(1.0)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.pad(2.0)
        return grad, None


class Block(nn.Module):
    """``x + fc2(GELU(pad(fc1(x))))``; the padding sits after ``fc1`` so that its backward always runs."""

    def __init__(self, layer: int, clock: ComputeClock) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.clock = clock
        gen = torch.Generator().manual_seed(LAYER_SEED + layer)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.randn(FFN, HIDDEN, generator=gen) / math.sqrt(HIDDEN))
            self.fc2.weight.copy_(torch.randn(HIDDEN, FFN, generator=gen) * (0.5 / math.sqrt(FFN)))
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(_Pad.apply(self.fc1(x), self.clock)))


def build_blocks(first_layer: int, count: int, compute_ms: float, slowdown: Callable[[], float]
                 ) -> tuple[nn.Sequential, ComputeClock]:
    """Blocks ``first_layer .. first_layer + count - 1`` and the clock that pads them (``compute_ms`` per forward)."""
    clock = ComputeClock(compute_ms / 1000.0 / count, slowdown)
    return nn.Sequential(*(Block(first_layer + i, clock) for i in range(count))), clock


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss (a named function: pipelining's schedule wants a callable it can name)."""
    return F.mse_loss(output, target)


def train_step(session: Session, model: nn.Module, clock: ComputeClock, optimizer: MomentumSGD,
               x: torch.Tensor, target: torch.Tensor, before_update: Callable[[], None] | None = None
               ) -> torch.Tensor:
    """One forward, backward and update of a data-parallel style engine, each phase reported first.

    ``before_update`` runs at the start of the optimizer phase (e.g. a DP gradient average). Returns
    the (detached) loss; the clock counts this step's padding only.
    """
    clock.spent_s = 0.0
    session.phase("forward")
    loss = mse(model(x), target)
    session.phase("backward")
    loss.backward()
    session.phase("optimizer")
    if before_update is not None:
        before_update()
    optimizer.step()
    return loss.detach().clone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (DTensor) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average the local gradient shards over ``group`` with one flat all_reduce (as a DP wrapper would)."""
    grads = [_local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
