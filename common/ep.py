"""Expert parallelism's bookkeeping (experiments/ep-ft) besides the exchange itself, which stays in the script
(common/README.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from common.dist import all_ranks


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [n, in] grouped by expert (counts[e] rows for expert e), weight [experts, out, in] -> [n, out]: one
    grouped_mm where torch has it (CPU; CUDA in bf16), else a loop over the experts."""
    if hasattr(F, "grouped_mm") and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16):
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    return torch.cat([chunk @ w.T for chunk, w in zip(rows.split(counts), weight)])


def clip_expert_parallel_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """common.step.clip_grad_norm for expert parallelism: the plain gradients (replicated, the same on every rank)
    count once; the DTensor ones are sharded on the experts of a 1-D mesh, each shard complete on its owner, so their
    squares are summed over the mesh in one all-reduce of one fp32 (clip_grad_norm's DTensor path sends one norm
    per tensor). Every gradient is then scaled as clip_grad_norm_ would; returns the norm before clipping."""
    meshes = {p.device_mesh for p in parameters if isinstance(p, DTensor)}
    if len(meshes) != 1 or next(iter(meshes)).ndim != 1:
        raise ValueError("clip_expert_parallel_grad_norm: the DTensor parameters must share one 1-D mesh")
    shards = [p.grad.to_local() for p in parameters if isinstance(p, DTensor) and p.grad is not None]
    replicated = [p.grad for p in parameters if not isinstance(p, DTensor) and p.grad is not None]
    squared = torch.nn.utils.get_total_norm(shards).square() if shards else \
        torch.zeros((), device=replicated[0].device)
    dist.all_reduce(squared, group=next(iter(meshes)).get_group())
    norm = (torch.nn.utils.get_total_norm(replicated).square() + squared).sqrt()
    clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in [*replicated, *shards]:
        grad.mul_(clip)
    return norm


class Dispatches:
    """What the expert blocks dispatched, for summary.json: the rows this rank sent to each rank over the training
    forwards (`dispatched_rows`) and each profiled step's (`routed_rows_profiled`); begin()/end() as RouterStats."""

    def __init__(self, blocks: list[nn.Module], world_size: int):
        self.blocks, self.rows_sent = blocks, [0] * world_size
        self.step_forwards: list[tuple[list[int], int]] = []
        self.profiled: list[list[tuple[list[int], int]]] = []

    def begin(self) -> None:
        for block in self.blocks:
            block.forwards.clear()

    def end(self) -> None:
        self.step_forwards += [rows for block in self.blocks for rows in block.forwards]

    def end_step(self, profiled: bool) -> None:
        """After an optimizer step; `profiled`: the step ran under the profiler that measured its collectives."""
        self.rows_sent = [n + sum(send[r] for send, _ in self.step_forwards) for r, n in enumerate(self.rows_sent)]
        if profiled:
            self.profiled.append(self.step_forwards)
        self.step_forwards = []

    def summary(self) -> dict:
        """summary.json's fields (all_ranks: every rank calls it)."""
        return dict(routed_rows_profiled=self.profiled, dispatched_rows=all_ranks(self.rows_sent))
