"""bf16 weights for compute, fp32 master copies for the update, under --dtype bf16 (common/README.md says where)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from common.metrics import local_tensor


def _assign(param: nn.Parameter, value: torch.Tensor) -> None:
    """`param.data = value`; a DTensor's .data would recast the wrapper, not its local shard: it is swapped whole."""
    if isinstance(param, DTensor):
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value


def _accumulate_into(master: nn.Parameter):
    def hook(param: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)  # in fp32: bf16 + fp32 computes in fp32
        param.grad = None  # the bf16 gradient lives only until it is added
    return hook


def _mirror(model: nn.Module, replacement: dict[int, nn.Parameter]) -> nn.Module:
    """Empty modules in the model's tree holding its parameters under their names (a tied one under each), each
    replaced by `replacement[id(parameter)]` where there is one."""
    root = nn.Module()
    for name, param in model.named_parameters(remove_duplicate=False):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, replacement.get(id(param), param))
    return root


class MasterWeights:
    """fp32 masters of `model`'s trainable parameters, which become `compute_dtype` (common/README.md). With
    `compute_dtype` None nothing changes: `parameters` are the model's own trainable ones and every method does
    nothing (--dtype fp32, and --qlora, which keeps autocast over fp32 adapters for bitsandbytes)."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = torch.bfloat16):
        self.compute_dtype = compute_dtype
        trainable = [p for p in model.parameters() if p.requires_grad]  # a tied parameter once
        self.module, self.parameters, self.weights, self.copies, self.buckets = model, trainable, [], [], []
        if compute_dtype is None:
            return
        self.weights = trainable
        with torch.no_grad():
            # The master takes the loaded fp32 storage; the parameter gets a new bf16 one.
            self.copies = [nn.Parameter(p.detach().to(torch.float32)) for p in trainable]
            for param, master in zip(trainable, self.copies):
                _assign(param, param.detach().to(compute_dtype))
                param.register_post_accumulate_grad_hook(_accumulate_into(master))
        self.parameters = self.copies  # what AdamW updates and clipping norms
        self.module = _mirror(model, {id(p): m for p, m in zip(trainable, self.copies)})

    def of(self, params) -> list:
        """The masters of `params`, where they hold the gradients (the parameters themselves when off)."""
        masters = {id(param): master for param, master in zip(self.weights, self.copies)}
        return [masters.get(id(param), param) for param in params]

    def take_grads(self) -> None:
        """Add into the masters the gradients written past their hooks (ZBV's weight pass sets .grad itself)."""
        for param, master in zip(self.weights, self.copies):
            if param.grad is not None:
                _accumulate_into(master)(param)

    def free_weights(self) -> None:
        """Release the compute-dtype parameters' storage (after backward, before the optimizer step); the next
        copy_to_model() allocates it again."""
        for param in self.weights:
            param.grad = None  # under DDP, views of its bucket
        for tensor in [*map(local_tensor, self.weights), *self.buckets]:
            tensor.untyped_storage().resize_(0)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the compute-dtype parameters: after each optimizer step, and after a resume."""
        weights = [local_tensor(param) for param in self.weights]  # a DTensor's shard (masters: the same placements)
        for tensor in [*weights, *self.buckets]:
            if tensor.untyped_storage().size() == 0:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self.buckets = []  # DDP rebuilds its buckets at the second step: the next backward names them again
        if self.copies:
            torch._foreach_copy_(weights, [local_tensor(master) for master in self.copies])

    @torch.no_grad()
    def restore_masters(self) -> None:
        """Make the model's trainable parameters the fp32 masters again (before an export); training ends here."""
        for param, master in zip(self.weights, self.copies):
            _assign(param, master.detach())

    def summary(self) -> dict | None:
        """For summary.json (`master_weights`), which the memory model reads the layout from; None when off."""
        if not self.copies:
            return None
        return dict(compute_dtype=str(self.compute_dtype).removeprefix("torch."), master_dtype="float32",
                    tensors=len(self.copies), elements=sum(m.numel() for m in self.copies))
