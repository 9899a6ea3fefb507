"""Fused LoRA adapters (--lora-fused): peft's modules, parameters and state dict, with fewer and fuller kernels.
How and why: see common/README.md."""

from __future__ import annotations

from types import MethodType

import torch

# Projections called on the same tensor inside one forward of their parent module (Qwen3Attention, Qwen3MLP).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LoraFusionError(ValueError):
    """A LoRA configuration the fused path does not compute (refused before training starts)."""


def _adapter(layer) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r x d_in], B [d_out x r], scaling) of a LoRA layer's one active adapter."""
    name = layer.active_adapters[0]
    return layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]


def down_products(layers, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x @ (scaling x A)^T of every layer in `layers`, as one product over their stacked A matrices, split per layer:
    [tokens x r] each (column views of one [tokens x sum r] tensor; their gradients meet again in one cat)."""
    adapters = [_adapter(layer) for layer in layers]
    stacked = torch.cat([scaling * a for a, _, scaling in adapters]) if len(adapters) > 1 else \
        adapters[0][2] * adapters[0][0]
    down = torch.mm(x.reshape(-1, x.shape[-1]).to(dtype), stacked.to(dtype).t())
    return down.split([a.shape[0] for a, _, _ in adapters], dim=1)


class SharedDown:
    """The LoRA layers of one parent module that read the same input. While the parent's forward runs (`active`), the
    first of them to be called computes the down product of all of them and the others take their columns; outside
    it, or on another input, each computes its own. Nothing outlives the parent's call."""

    def __init__(self, layers) -> None:
        self.layers = tuple(layers)
        self.active = False
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] | None = None

    def __call__(self, index: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.active or len(self.layers) == 1:
            return down_products(self.layers[index:index + 1], x, dtype)[0]
        if self.input is not x:
            self.input, self.parts = x, down_products(self.layers, x, dtype)
        return self.parts[index]

    def reset(self) -> None:
        self.active, self.input, self.parts = False, None, None


def fused_forward(self, x, *args, **kwargs):
    """A LoRA layer's forward (bound to the layer; its group and place in it are attributes of the layer, so every
    decoder layer's compiled graph is the same one): the base output with the adapter's product added by addmm."""
    if args or kwargs or self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)  # peft's own path
    result = self.base_layer(x)
    down = self.lora_shared_down(self.lora_shared_index, x, result.dtype)
    up = _adapter(self)[1].to(result.dtype)
    # One product that also adds: base + down @ B^T, out of place (a 4-bit base's output must not be modified).
    return torch.addmm(result.reshape(-1, result.shape[-1]), down, up.t()).view(result.shape)


def bracketed_forward(self, *args, **kwargs):
    """The parent's own forward, with its groups active while it runs and emptied after (also on an exception)."""
    for shared in self.lora_shared_groups:
        shared.active = True
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        for shared in self.lora_shared_groups:
            shared.reset()


def _check(layer, name: str) -> None:
    """Refuse what the fused forward would compute differently from peft."""
    if len(layer.active_adapters) != 1 or len(layer.lora_A) != 1:
        raise LoraFusionError(f"--lora-fused: {name} has {len(layer.lora_A)} adapters; the fused path trains one")
    adapter = layer.active_adapters[0]
    if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):
        raise LoraFusionError(
            f"--lora-fused: {name} has LoRA dropout (p > 0); peft draws a mask per projection, so q, k and v no longer "
            f"read the same input and cannot share one product: use lora_dropout=0 or drop --lora-fused")
    if adapter in getattr(layer, "lora_variant", {}) or layer.lora_B[adapter].bias is not None:
        raise LoraFusionError(f"--lora-fused: {name} is a LoRA variant (DoRA, a B bias, ...); the fused path computes "
                              f"plain LoRA only: drop --lora-fused")


def fuse_lora(model) -> dict[str, int]:
    """Give every plain LoRA linear layer of the peft `model` the fused forward (in place; parameters untouched).
    Returns what was fused: layers, and the groups that share one down product."""
    from peft.tuners.lora import Linear
    try:  # peft's 4-bit LoRA layer imports bitsandbytes, which only QLoRA needs (the `qlora` group)
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # no bitsandbytes: no 4-bit layer can exist to fuse
        Linear4bit = None

    # the groups' side effects add up to nothing: no replay when a checkpointed layer recomputes (common/README.md)
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

    fusable = (Linear, *((Linear4bit,) if Linear4bit is not None else ()))
    counts = {"layers": 0, "shared_groups": 0}
    for parent_name, parent in model.named_modules():
        children = {name: child for name, child in parent.named_children() if type(child) in fusable}
        if not children:
            continue
        for name, child in children.items():
            _check(child, f"{parent_name}.{name}")
        groups = [names for names in SHARED_INPUT if all(name in children for name in names)]
        grouped = {name for names in groups for name in names}
        groups += [(name,) for name in children if name not in grouped]
        shared_groups = []
        for names in groups:
            shared = SharedDown(children[name] for name in names)
            for index, name in enumerate(names):
                children[name].lora_shared_down, children[name].lora_shared_index = shared, index
                children[name].forward = MethodType(fused_forward, children[name])
            if len(names) > 1:
                shared_groups.append(shared)
            counts["layers"] += len(names)
        if shared_groups:
            parent.lora_shared_groups = tuple(shared_groups)
            parent.forward = MethodType(bracketed_forward, parent)
            counts["shared_groups"] += len(shared_groups)
    return counts
