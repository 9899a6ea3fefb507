"""bf16 weights for compute, fp32 master copies for the update: single-ft's --dtype bf16.

Under torch.autocast the weights stay fp32 and every matrix multiply casts its weight to bf16 again in every
micro-batch's forward (and its gradient back to fp32 in backward); the embedding and the norms are not cast, so the
residual stream, the norms' outputs and the normed queries and keys stay fp32: twice the bytes of those element-wise
passes and of the activations they save. `MasterWeights` keeps the layout that FSDP2's
MixedPrecisionPolicy(param_dtype=bf16) gives fsdp-ft (and DeepSpeed's bf16 mode zero-ft) instead:
- the model's trainable parameters become bf16: the forward computes in bf16 throughout, no autocast;
- an fp32 copy of each (the "master") is what AdamW updates, so small updates are not lost to bf16's 8-bit mantissa;
- each parameter's bf16 gradient is added into its master's fp32 .grad as soon as backward has accumulated it
  (register_post_accumulate_grad_hook) and then freed: micro-batches accumulate in fp32, and clipping and the fused
  AdamW step (with the clip folded in, common/step.py) read fp32 gradients;
- `copy_to_model()` rounds the updated masters into the bf16 parameters, once per optimizer step.
Kept whole, the bf16 weights would cost 2 bytes a parameter beside the 16 of the fp32 masters, gradients and AdamW
moments at the optimizer step, the step's peak; nothing reads them between backward and the next forward, so
`free_weights()` releases their storage before the step (as FSDP releases its gathered bf16 weights) and
`copy_to_model()`, after the gradients are freed, allocates it again: the step's peak stays 16 bytes a parameter, and
the forward's is 14 (2 + 4 + 8), what fp32 weights with autocast's cached bf16 copies held.
A tied embedding and LM head is one parameter: one master, one hook (autograd sums both uses before it runs).
Frozen parameters (a LoRA base, already bf16) are left as they are. `module` is the model with the masters in place
of the trainable parameters, under the same names, for torch.distributed.checkpoint: a checkpoint holds the fp32
masters and AdamW's state, keyed as the model's own state would be. `restore_masters()` puts the fp32 masters back
into the model for export, so --save-hf writes what it wrote under autocast. Under DDP (ddp-ft) `buckets` are
DDP's bf16 buckets, named by its comm hook each step, freed and allocated again with the weights (common/README.md).
"""

from __future__ import annotations

import torch
from torch import nn


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
    """fp32 masters of `model`'s trainable parameters, which become `compute_dtype` (module docstring). With
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
                param.data = param.detach().to(compute_dtype)
                param.register_post_accumulate_grad_hook(_accumulate_into(master))
        self.parameters = self.copies  # what AdamW updates and clipping norms
        self.module = _mirror(model, {id(p): m for p, m in zip(trainable, self.copies)})

    def free_weights(self) -> None:
        """Release the compute-dtype parameters' storage (after backward, before the optimizer step); the next
        copy_to_model() allocates it again."""
        for param in self.weights:
            param.grad = None  # under DDP, views of its bucket
        for tensor in [*self.weights, *self.buckets]:
            tensor.untyped_storage().resize_(0)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the compute-dtype parameters: after each optimizer step, and after a resume."""
        for tensor in [*self.weights, *self.buckets]:
            if tensor.untyped_storage().size() == 0:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self.buckets = []  # DDP rebuilds its buckets at the second step: the next backward names them again
        if self.copies:
            torch._foreach_copy_(self.weights, self.copies)

    @torch.no_grad()
    def restore_masters(self) -> None:
        """Make the model's trainable parameters the fp32 masters again (before an export); training ends here."""
        for param, master in zip(self.weights, self.copies):
            param.data = master.detach()

    def summary(self) -> dict | None:
        """For summary.json (`master_weights`), which the memory model reads the layout from; None when off."""
        if not self.copies:
            return None
        return dict(compute_dtype=str(self.compute_dtype).removeprefix("torch."), master_dtype="float32",
                    tensors=len(self.copies), elements=sum(m.numel() for m in self.copies))
