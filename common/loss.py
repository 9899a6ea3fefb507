"""Chunked cross-entropy over the LM head: the loss without ever holding the [tokens x vocabulary] logits.

The plain loss (common/data.py's `token_loss_sum`) multiplies every position's final hidden state by the LM head,
then takes cross-entropy over the whole logits tensor. With Qwen3's 151,936-token vocabulary that is the largest
activation of a small model: for Qwen3-0.6B at micro-batch 1 x 4,096 tokens, fp32 logits alone are
4,096 x 151,936 x 4 B = 2.5 GB; in bf16 training the step holds the bf16 logits (1.2 GB), their fp32 copy and the
fp32 log-softmax kept for backward (2.5 GB each), and backward allocates the same sizes again for their gradients.

`chunked_token_loss_sum` gives the same number and the same gradients while saving two things:
- memory: only the hidden states of the loss tokens are kept for backward ([n_loss, d]: at most
  4,096 x 1,024 x 4 B = 17 MB in the example above); logits and softmax buffers exist for one chunk of
  `chunk_tokens` tokens at a time, in forward and again in backward, where torch.utils.checkpoint recomputes the
  chunk's logits instead of storing them;
- compute: positions whose label is -100 (prompts, system turns, padding: only assistant tokens carry loss) never
  go through the LM head. The head costs 6*d*V FLOPs per token (forward + backward); here it costs 8*d*V per loss
  token (the recomputation is one more forward) and nothing per other position, a win whenever fewer than 3/4 of
  the positions carry loss (summary.json's data.train_loss_tokens over the row slots says how many do).

Why not Liger-Kernel's fused linear cross-entropy, which does the same in Triton and computes the gradient during
the forward (no recomputation)? It is an optional extra that is not installed here, and Triton kernels do not run
on CPU, where the tests run. This is plain PyTorch, works under autocast and with a tied embedding, and
tests/test_loss.py holds it to the plain loss and its gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.data import IGNORE_INDEX


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # F.linear, exactly what the model's nn.Linear LM head runs, so autocast picks the same compute dtype (bf16 or
    # fp32); the cross-entropy itself is always fp32, as in token_loss_sum.
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def chunked_token_loss_sum(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """Sum of cross-entropy over loss tokens, equal to token_loss_sum(hidden @ lm_head_weight.T, labels).

    hidden: final hidden states [batch, seq, d] (after the final norm); lm_head_weight: [V, d]; labels: [batch, seq],
    already shifted, -100 where there is no loss. Divide the result by the step's loss-token count, as with
    token_loss_sum. Call it under the same autocast as the model: checkpoint replays the autocast state in backward.

    `labels` may live on the CPU (the batch before it is copied to the device): the loss tokens are then chosen on
    the host, without the host-device synchronisation that nonzero() on a CUDA mask forces (the number of loss
    tokens, which sets the number of chunks, must be known on the host either way).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    labels = labels.flatten()
    positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # on the labels' device: no sync if that is the CPU
    n_loss = positions.numel()
    positions = positions.to(hidden.device, non_blocking=True)
    hidden = hidden.flatten(0, 1).index_select(0, positions)  # [n_loss, d]: all that is kept for backward
    labels = labels.to(hidden.device, non_blocking=True).index_select(0, positions)
    # A micro-batch without loss tokens still returns a zero that is connected to the graph, so backward() works
    # (and gives zero gradients), as the plain loss does.
    total = None
    for start in range(0, max(n_loss, 1), chunk_tokens):
        end = start + chunk_tokens
        chunk = checkpoint(_chunk_loss_sum, hidden[start:end], lm_head_weight, labels[start:end],
                           use_reentrant=False)
        total = chunk if total is None else total + chunk
    return total
