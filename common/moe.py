"""Mixture of experts: the router's load-balancing loss and the tokens each expert receives, per layer
(common/README.md)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of every sparse layer, in layer order (Qwen3-MoE: `layers.i.mlp.gate`, a Qwen3MoeTopKRouter)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RouterStats:
    """Per training forward (begin() ... end()): the routers' aux loss and the tokens sent to each expert."""

    def __init__(self, model: nn.Module, num_experts: int, top_k: int, aux_coef: float = 0.0):
        self.num_experts, self.top_k, self.aux_coef = num_experts, top_k, aux_coef
        self.step_aux: torch.Tensor | None = None  # the step's aux loss so far (aux_loss), taken by step_values
        self.layers = routers(model)
        if not self.layers:
            raise ValueError("no router found: RouterStats is for mixture-of-experts models")
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.load: torch.Tensor | None = None  # [layers, experts] routed (token, slot) pairs since take_load()
        self.handles = [router.register_forward_hook(self._record) for router in self.layers]

    @classmethod
    def attach(cls, model: nn.Module) -> RouterStats | None:
        """Hooks on the routers of a mixture of experts, with the model's own aux-loss coefficient; None if dense."""
        config = model.config
        if not getattr(config, "num_experts", 0) or not routers(model):
            return None
        return cls(model, config.num_experts, config.num_experts_per_tok, config.router_aux_loss_coef)

    def _record(self, module, inputs, output) -> None:
        logits, _, indices = output  # (router_logits, top-k weights, top-k expert ids), each [tokens, ...]
        self.logits.append(logits)
        self.indices.append(indices)

    def begin(self) -> None:
        self.logits, self.indices = [], []

    def end(self) -> torch.Tensor:
        """The aux loss of the forward that just ran (a scalar with its graph), and adds its load to the count."""
        if len(self.logits) != len(self.layers):
            raise RuntimeError(f"expected one routing per sparse layer ({len(self.layers)}), got {len(self.logits)}")
        aux = load_balancing_loss_func(tuple(self.logits), self.num_experts, self.top_k)
        # scatter_add into a fixed-size tensor: no host read (bincount would need one)
        load = torch.stack([torch.zeros(self.num_experts, device=ids.device).scatter_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device)) for ids in self.indices])
        self.load = load if self.load is None else self.load + load
        self.begin()
        return aux

    def aux_loss(self, micro_batches_per_step: int) -> torch.Tensor:
        """end() as this micro-batch's loss term: its share of the step's mean aux loss x the coefficient."""
        aux = self.end() / micro_batches_per_step
        self.step_aux = aux.detach() if self.step_aux is None else self.step_aux + aux.detach()
        return self.aux_coef * aux

    def step_values(self) -> torch.Tensor:
        """The step's aux loss and [layers, experts] load as one flat device tensor, read with the step's values."""
        aux, self.step_aux = self.step_aux, None
        return torch.cat([aux.reshape(1), self.take_load().flatten()])

    def read(self, values: list[float]) -> dict:
        """step_values() read back to the host: the step record's aux_loss and expert_tokens."""
        return dict(aux_loss=values[0], expert_tokens=split_load(values[1:], self.num_experts))

    def take_load(self) -> torch.Tensor:
        """The [layers, experts] count since the last call (a device tensor)."""
        load, self.load = self.load, None
        return load

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def split_load(flat: list[float], experts: int) -> list[list[float]]:
    """A flattened [layers, experts] count back into rows."""
    return [flat[i:i + experts] for i in range(0, len(flat), experts)]
