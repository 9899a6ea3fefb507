"""The chunked, recomputing reference that tests/test_loss.py holds common/loss.py's fused loss to (and the GPU
probe times beside it); no train.py runs it (common/README.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.loss import _loss_positions


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # F.linear, as the model's LM head runs it, so autocast picks the same dtype; the cross-entropy in fp32
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def chunked_token_loss_sum(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """token_loss_sum(hidden @ lm_head_weight.T, labels), each chunk's logits recomputed in backward. hidden
    [batch, seq, d] after the final norm, labels [batch, seq] shifted (on the host preferably); call it under the
    model's autocast."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    hidden, labels = _loss_positions(hidden, labels)  # [n_loss, d]: all that is kept for backward
    # no loss tokens: still a zero connected to the graph, so backward() works
    total = None
    for start in range(0, max(labels.numel(), 1), chunk_tokens):
        end = start + chunk_tokens
        chunk = checkpoint(_chunk_loss_sum, hidden[start:end], lm_head_weight, labels[start:end],
                           use_reentrant=False)
        total = chunk if total is None else total + chunk
    return total
