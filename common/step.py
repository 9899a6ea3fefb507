"""The step's helpers: garbage collection between steps, never inside one, gradient clipping folded into the fused
AdamW step, a bucketed all-reduce of gradients, and the learning-rate schedule every experiment shares
(common/README.md)."""

from __future__ import annotations

import gc
import math

import torch
import torch.distributed
from torch.distributed.tensor import DTensor

GC_EVERY_STEPS = 20  # young-generation collections every this many optimizer steps (torchtitan's default is 50)


class GarbageCollection:
    """The collector on a schedule: made after set-up, step() before each clock, close() at the end."""

    def __init__(self, every_steps: int = GC_EVERY_STEPS):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = every_steps
        self.collections = 0
        gc.collect()  # the set-up's own garbage, once
        gc.freeze()
        gc.disable()

    def step(self, step: int) -> None:
        """Before optimizer step `step` (0-based): a young-generation collection every `every_steps` steps."""
        if step > 0 and step % self.every_steps == 0:
            gc.collect(1)
            self.collections += 1

    def close(self) -> None:
        gc.unfreeze()
        gc.enable()

    def summary(self) -> dict:
        return dict(policy="frozen after set-up, automatic collection off", every_steps=self.every_steps,
                    collections=self.collections)


def folds_clipping(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` can apply the clipping factor itself, as GradScaler's grad_scale (fused AdamW)."""
    return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)


def clip_grad_norm(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor],
                   max_norm: float, group=None, norm_parameters: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients before clipping (what clip_grad_norm_ returns), with the gradients
    clipped to `max_norm` (inf: not at all) by the next `optimizer.step()` when the optimizer can fold it in
    (`folds_clipping`), else here, in place, as clip_grad_norm_ does.

    A model split over ranks (pipeline stages): `group` sums the squared norms of all its ranks, and
    `norm_parameters` (default: `parameters`) are the ones the norm counts, e.g. without a tied weight's copy.
    DTensor gradients (tensor parallel) are normed per mesh (_clip_sharded_grad_norm)."""
    grads = [p.grad for p in (parameters if norm_parameters is None else norm_parameters) if p.grad is not None]
    if any(isinstance(grad, DTensor) for grad in grads):
        if group is not None or norm_parameters is not None:
            raise ValueError("clip_grad_norm: DTensor gradients are normed per mesh, without group or norm_parameters")
        return _clip_sharded_grad_norm(parameters, max_norm)
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if group is not None:
        squared = norm.square()
        torch.distributed.all_reduce(squared, group=group)
        norm = squared.sqrt()
    if folds_clipping(optimizer):
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); the fused step divides by grad_scale.
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).to(torch.float32)
    else:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm


def _clip_sharded_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for DTensor gradients beside plain ones (meta-pytorch/torchtune#2420)."""
    groups: dict = {}
    for p in parameters:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    norms = []
    for group in groups.values():
        grads = [p.grad for p in group if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def all_reduce_in_buckets(tensors: list[torch.Tensor], bucket_bytes: int, group=None) -> None:
    """Sum `tensors` over the ranks in place, a few large calls instead of one per tensor: in order, a bucket is sent
    once it holds `bucket_bytes` or more (common.comm.dense_buckets counts them the same way;
    ep-ft's dense gradients, pp-ft's replicas under --dtype bf16)."""
    bucket, size = [], 0
    for tensor in [*tensors, None]:
        if tensor is not None:
            bucket.append(tensor)
            size += tensor.numel() * tensor.element_size()
        if bucket and (tensor is None or size >= bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            torch.distributed.all_reduce(flat, group=group)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
            bucket, size = [], 0


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to the peak over `warmup_steps`, then cosine decay to 0 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
