"""The LM head and its cross-entropy without the [tokens x vocabulary] logits: the fused loss that
`--loss-chunk-tokens` runs (common/README.md; its chunked reference: common/loss_reference.py)."""

from __future__ import annotations

import functools

import torch

from common.data import IGNORE_INDEX


def _loss_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss tokens' hidden states [n_loss, d] and labels [n_loss], chosen on the labels' device."""
    labels = labels.flatten()
    positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # on the labels' device: no sync if that is the CPU
    labels = labels.index_select(0, positions)
    if hidden.device.type == "cuda" and labels.device.type == "cpu":
        positions, labels = positions.pin_memory(), labels.pin_memory()  # so that the copies do not block the host
    positions = positions.to(hidden.device, non_blocking=True)
    labels = labels.to(hidden.device, non_blocking=True)
    return hidden.flatten(0, 1).index_select(0, positions), labels


# ---------------------------------------------------------------------------------------------------------------
# The fused loss: gradients computed in the forward pass


def _chunk_loss_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor,
                               scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's loss sum in fp32, (softmax - one_hot) x scale): cross-entropy both ways."""
    logits_f = logits.float()
    log_sum_exp = torch.logsumexp(logits_f, dim=-1, keepdim=True)
    loss = (log_sum_exp - logits_f.gather(1, labels.unsqueeze(1))).sum()
    is_target = torch.arange(logits.shape[1], device=logits.device) == labels.unsqueeze(1)
    grad = (torch.exp(logits_f - log_sum_exp) - is_target.to(torch.float32)) * scale
    return loss, grad.to(logits.dtype)


_compile = functools.cache(torch.compile)  # each function compiled once per process


def _chunk_math(device: torch.device):
    """The per-chunk arithmetic, compiled on a GPU (dynamic: the last chunk is shorter), eager on the CPU."""
    return _compile(_chunk_loss_and_logit_grad, dynamic=True) if device.type == "cuda" else _chunk_loss_and_logit_grad


@functools.cache
def _addmm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether addmm with out_dtype adds a 16-bit product into an fp32 tensor on `device`: tried once, checked."""
    if device.type != "cuda":
        return False
    a = torch.arange(12, device=device, dtype=torch.bfloat16).view(4, 3) / 8
    b = torch.arange(20, device=device, dtype=torch.bfloat16).view(4, 5) / 8
    accumulator = torch.ones(3, 5, device=device)
    try:
        torch.addmm(accumulator, a.t(), b, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return torch.allclose(accumulator, 1 + a.float().t() @ b.float())


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logits.T @ hidden, 16-bit operands into the GEMM's fp32 output where torch can."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
    elif _addmm_accumulates_in_fp32(grad_weight.device):
        torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.add_((grad_logits.t() @ hidden).float())


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_tokens, compute_dtype):
        # hidden [n, d] (loss tokens only), weight [V, d], labels [n], scale 0-d: returns scale x sum of losses.
        want_hidden_grad, want_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            weight_c, hidden_c = weight.to(compute_dtype), hidden.to(compute_dtype)  # one cast per call
            chunk_math = _chunk_math(hidden.device)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden_c) if want_hidden_grad else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if want_weight_grad else None
            scale = scale.to(torch.float32)
            for start in range(0, labels.numel(), chunk_tokens):
                end = start + chunk_tokens
                logits = hidden_c[start:end] @ weight_c.t()  # [chunk, V]: the only logits that exist at a time
                chunk_loss, grad_logits = chunk_math(logits, labels[start:end], scale)
                del logits
                loss += chunk_loss
                if grad_hidden is not None:
                    torch.mm(grad_logits, weight_c, out=grad_hidden[start:end])
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, grad_logits, hidden_c[start:end])
                del grad_logits  # before the next chunk's logits: two [chunk, V] buffers at a time, not three
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_dtype, ctx.weight_dtype, ctx.backward_done = hidden.dtype, weight.dtype, False
        return loss * scale

    @staticmethod
    def backward(ctx, grad_output):
        # grad_output is 1, or world_size under data parallelism: multiplied, never tested (no host wait)
        if ctx.backward_done:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice through one forward (retain_graph); "
                               "its gradients were computed once, in the forward pass")
        ctx.backward_done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_output).to(ctx.hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output).to(ctx.weight_dtype)  # in place: backward runs once
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                               chunk_tokens: int, scale: torch.Tensor) -> torch.Tensor:
    """token_loss_sum(hidden @ lm_head_weight.T, labels) * scale, gradients computed here."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    hidden, labels = _loss_positions(hidden, labels)
    # no loss tokens: still a zero connected to the graph, so backward() works
    return _FusedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, scale, chunk_tokens, compute_dtype)
