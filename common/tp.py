"""What the tensor-parallel experiments (tp-ft, tp-sp-ft, fsdp-tp-ft) measure and evaluate the same way
(common/README.md)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from common.dist import print0
from common.metrics import local_tensor


class SavedActivations:
    """Bytes of the tensors autograd keeps for the backward during a forward, parameters excluded: the activation
    memory of one micro-batch on this rank. `with activations.once():` around a forward measures the first one
    (and prints it); later forwards run unmeasured."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {storage.data_ptr() for p in model.parameters() for storage in storages(p)}
        # Keyed by address, each storage held until the forward ends: a tensor freed mid-forward would otherwise
        # hand its address to a later one, and the two would count once.
        self.kept: dict[int, torch.UntypedStorage] = {}
        self.nbytes: int | None = None  # set when the measured forward ends
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for storage in storages(tensor):
            if storage.data_ptr() not in self.parameters:
                self.kept[storage.data_ptr()] = storage
        return tensor

    @property
    def mib(self) -> float | None:
        """MiB saved by the measured forward; None before it (or when it saved nothing)."""
        return self.nbytes / 2**20 if self.nbytes else None

    def once(self):
        """This object for the first forward, a no-op context after it."""
        return self if self.nbytes is None else nullcontext()

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.nbytes = sum(storage.nbytes() for storage in self.kept.values())
        self.kept.clear()
        print0(f"activations: {self.nbytes / 2**20:.1f} MiB saved for the backward of one micro-batch on rank 0")


def storages(tensor: torch.Tensor):
    """The memory behind a tensor: a DTensor (or a collective's not yet awaited result) wraps plain tensors."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        for inner in (getattr(tensor, name) for name in inner_names):
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    else:
        yield tensor.untyped_storage()


def on_tp_mesh(parameter: torch.Tensor) -> bool:
    """Whether a parameter is split over the mesh dimension named "tp" (a TP slice), not replicated across it."""
    if not isinstance(parameter, DTensor):
        return False
    names = parameter.device_mesh.mesh_dim_names or ()
    return "tp" in names and not parameter.placements[names.index("tp")].is_replicate()


def replica_drift(parameters, tp_mesh) -> float:
    """Largest |difference| between any tp rank's and its group's first rank's copy (or FSDP shard) of the
    parameters replicated over "tp": 0.0 when the replicas are in sync. A collective: every rank calls it."""
    copies = [local_tensor(p).detach() for p in parameters if not on_tp_mesh(p)]
    if not copies:
        return 0.0
    mine = torch.cat([copy.flatten() for copy in copies])
    first = mine.clone()
    dist.broadcast(first, group=tp_mesh.get_group(), group_src=0)
    drift = (mine - first).abs().max()
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)  # over every tp group of the world
    largest = drift.item()
    print0(f"parameters replicated over tp: largest difference between ranks {largest:.3g}")
    return largest


class FullLogits(torch.nn.Module):
    """common.data.evaluate() adds up plain-tensor losses: give it gathered logits (no grad, one micro-batch)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        output = self.model(**kwargs)
        if isinstance(output.logits, DTensor):
            output.logits = output.logits.full_tensor()
        return output
