"""The demo model and data: Megatron-style tensor-parallel MLP blocks and a synthetic regression task.

Every rank builds the *full* weights of a block from a seed that depends only on
the layer index and keeps its TP shard, so DP replicas start identical and TP
shards agree without any broadcast. Data come from a seed of (step, dp rank,
microbatch): the first stage makes the inputs, the last stage the targets.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrace.demo.comm import Comm

HIDDEN = 32
FFN = 4 * HIDDEN
MICRO_BATCH = 16
TEACHER_SEED = 7
LAYER_SEED = 1000
LR = 0.1  # the momentum SGD's learning rate, every engine


class _CopyToTP(torch.autograd.Function):
    """Enter the TP region: identity forward, all_reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad, "tp")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Leave the TP region: all_reduce of the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, "tp")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ParallelBlock(nn.Module):
    """``x + RowParallel(GELU(ColumnParallel(x)))``: one TP all_reduce forward and one backward."""

    def __init__(self, layer: int, tp_rank: int, tp_size: int, comm: Comm) -> None:
        super().__init__()
        if FFN % tp_size:
            raise ValueError(f"tp {tp_size} does not divide the FFN width {FFN}")
        gen = torch.Generator().manual_seed(LAYER_SEED + layer)
        w1 = torch.randn(FFN, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
        w2 = torch.randn(HIDDEN, FFN, generator=gen) * (0.5 / math.sqrt(FFN))
        shard = slice(tp_rank * FFN // tp_size, (tp_rank + 1) * FFN // tp_size)
        self.w1 = nn.Parameter(w1[shard].clone())
        self.b1 = nn.Parameter(torch.zeros(FFN // tp_size))
        self.w2 = nn.Parameter(w2[:, shard].clone())
        self.b2 = nn.Parameter(torch.zeros(HIDDEN))  # added after the reduction, like Megatron's
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToTP.apply(x, self.comm), self.w1, self.b1))
        return x + _ReduceFromTP.apply(F.linear(h, self.w2), self.comm) + self.b2


def build_stage(stage: int, layers_per_stage: int, tp_rank: int, tp_size: int, comm: Comm) -> nn.Sequential:
    """The blocks of pipeline ``stage``: global layers ``stage * layers_per_stage ...``."""
    first = stage * layers_per_stage
    return nn.Sequential(*(ParallelBlock(first + i, tp_rank, tp_size, comm) for i in range(layers_per_stage)))


def _teacher() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(TEACHER_SEED)
    return (torch.randn(HIDDEN, HIDDEN, generator=gen) * (2.0 / math.sqrt(HIDDEN)),
            torch.randn(HIDDEN, HIDDEN, generator=gen) / math.sqrt(HIDDEN))


_A, _B = _teacher()


def batch(step: int, dp_rank: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``tanh(x A) B`` of one microbatch (identical on every stage and TP rank)."""
    gen = torch.Generator().manual_seed((step * 7919 + dp_rank) * 104729 + microbatch)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=gen)
    return x, torch.tanh(x @ _A) @ _B


class MomentumSGD:
    """SGD with momentum, ``torch.optim.SGD``'s update rule.

    Written out because constructing any ``torch.optim`` optimizer imports
    ``torch._dynamo`` (over a second of CPU per rank: most of a demo's startup).
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float = 0.9) -> None:
        self.params, self.lr, self.momentum = params, lr, momentum
        self.buffers = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.buffers):
            buf.mul_(self.momentum).add_(p.grad)
            p.sub_(buf, alpha=self.lr)
            p.grad.zero_()
