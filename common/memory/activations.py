"""Activations and the loss's buffers: what one decoder layer keeps for backward, per token, and what the LM head and
the cross-entropy hold at the start of backward. (common/memory/__init__.py says how the parts fit together.)

1. Activations, bytes per token saved for backward by one decoder layer. The method is that of Korthikanti et
   al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4 (list every tensor autograd
   keeps; their GPT layer keeps 34 s b h + 5 a s^2 b bytes in fp16), redone for transformers' Qwen3 layer (RMSNorm
   computed in fp32, QK-norm, GQA, RoPE, SwiGLU) and for fused attention kernels (flash, memory-efficient, cuDNN,
   variable-length) that keep a per-head log-sum-exp instead of the s x s probabilities. Each term was checked
   against the tensors that torch.autograd.graph.saved_tensors_hooks records (tests/test_memory.py does it for a
   small Qwen3 with head_dim x heads != hidden, so that no two terms can stand in for each other).
   Symbols: d hidden, H query heads, G key/value heads, h head_dim, I MLP width, s sequence length, R LoRA rank;
   c bytes of a compute element (2 bf16, 4 fp32); r bytes of the residual stream, the embedding's dtype under
   autocast (4 with fp32 weights; 2 for a bf16 LoRA base), else c; o bytes of a projection's output: c, except
   under QLoRA, where bitsandbytes returns its input's dtype (fp32); H_kv heads at which k and v reach the kernel:
   G when it takes GQA natively (flash_attention_2, SDPA without a mask, a varlen kernel that takes grouped heads),
   H when they are repeated first (SDPA with a mask, which packed rows always have; torch's varlen_attn before it
   took grouped heads: ATTENTION_KINDS' "flash-expanded-kv").
       norms          2 x [4d (fp32 upcast of the input; the input itself when r = 4) + 4 (1 / rms)
                           + r d (the normalised input, kept for the norm weight's gradient; not with LoRA)]
       linear inputs  autocast: 5 c d (q, k, v, gate and up each save their own bf16 cast of the normed input;
                      under LoRA the adapters' A save them, the frozen base saves none)
                      otherwise: 2 r d (one tensor per norm, shared by the projections that read it)
       QK-norm        (H + G) h (4 + c) + 4 (H + G)   (fp32 upcast, normalised copy without LoRA, 1 / rms per head)
       attention      c h (H + 2 H_kv) [q, k, v as the kernel got them] + c H h [output = o_proj's input,
                      the kernels write it in (batch, seq, head) order so transformers' transpose copies nothing]
                      + 4 H [log-sum-exp]; + c H h with LoRA under autocast (peft re-casts o_proj's input; the
                      fused adapters of --lora-fused do not, and share one cast per input: 2 c d linear inputs)
       mask           c s: packed rows through SDPA: the block-diagonal mask, turned into an additive bias in the
                      compute dtype, one s x s matrix per row, saved by every layer
       MLP            3 o I + c I  [gate output, SiLU output, up output, and their product = down_proj's input]
       LoRA adapters  7 c R  [A x of the seven adapted projections]
   Outside the layers: the final norm (4d + 4, + r d without LoRA), the LM head's input (c d: autocast's cast of the
   norm's output, or that output itself; none for a frozen head; r d for the chunked loss, which keeps the gathered
   hidden states of the loss tokens) and RoPE's cos and sin (2 h r, shared by all layers). Activation checkpointing
   (one checkpoint per decoder layer, as transformers does it) keeps only each layer's input, r d, plus one
   layer's full set while it is recomputed.
   Tensor parallelism divides the QK-norm, attention and MLP terms by t; sequence parallelism divides the rest too
   (Korthikanti et al.'s s b h (10 + 24/t) and s b h 34/t), except the mask, which every rank needs whole.

2. Compiled layers (--compile: torch.compile per decoder layer). AOTAutograd's partitioner saves what is cheapest to
   keep and recomputes the rest in backward (the norms' upcasts and normalised copies, the SiLU), and its casts are
   shared by the projections that read them. What a compiled layer keeps (saved_tensors_hooks on the compiled
   layer: full fine-tuning with and without autocast, and LoRA on a bf16 base):
       norms          r d [the layer's input] + 8 [two 1 / rms]
       linear inputs  3 c d [the two normed inputs as the projections read them, o_proj's output]
       QK-norm        c (H + G) h + 4 (H + G)   [q_proj's and k_proj's outputs, 1 / rms per head]
       attention, mask, LoRA adapters   as in eager
       MLP            3 c I  [gate output, up output, their product]
   Under QLoRA, and for the experts of a mixture of experts, the eager terms stand (not measured compiled: an upper
   bound). The GPU ladder's compile rung measured this: Qwen3-0.6B at 1 x 1,024 tokens held 1.04 GiB less
   (max_memory_reserved) than the same run uncompiled, where these terms predict 0.93 GiB less.

3. The loss. The plain loss (common/data.py's token_loss_sum) holds micro_batch x seq x vocab logits in the compute
   dtype (c) as the LM head writes them, and inside the cross-entropy's backward three fp32 tensors of the same size
   alive together (log-probabilities, their gradient, the logits' gradient): c + 12 bytes per element, at the very
   start of backward, when every activation is still alive. The fused loss (--loss-chunk-tokens N,
   common/loss.py's fused_linear_cross_entropy) holds one chunk of at most N loss tokens at a time (every token of a
   micro-batch counted as a loss token: the prediction cannot know how many carry loss): its logits and their
   gradient, 2c bytes per element, the fp32 arithmetic between them being one compiled kernel on a GPU (on the CPU,
   where it runs eagerly, c + 12 as for the plain loss: this model prices the GPU), and
   beside it, computed in forward and handed on in backward, the gradient of the loss tokens' hidden states (c d
   each, with their gathered copy r d and its cast c d) and the head weight's fp32 gradient, 4 V d.
   Tensor parallelism with loss parallel keeps each rank's V / t columns.
"""

from __future__ import annotations

from common.memory.states import FP32_BYTES, LORA_PROJECTIONS, ModelShape

CROSS_ENTROPY_FP32_BUFFERS = 3  # log-probabilities, their gradient, the logits' gradient
# How k and v reach the attention kernel: sdpa-packed (SDPA with the packed rows' block-diagonal mask: heads repeated,
# a mask per layer), sdpa (unpacked rows, causal, GQA native), flash (no mask, GQA native: flash_attention_2 or a
# varlen kernel that takes grouped heads), flash-expanded-kv (no mask, K/V repeated to every query head first).
ATTENTION_KINDS = ("sdpa-packed", "sdpa", "flash", "flash-expanded-kv")
TENSOR_PARALLEL_TERMS = ("qk_norms", "attention", "mlp")  # split over heads or MLP columns


def attention_kind(attention, packing: bool) -> str:
    """The ATTENTION_KINDS entry of an experiment's attention (common.attention's AttentionChoice, or a dict of its
    fields as summary.json records it) under its --packing setting."""
    fields = attention if isinstance(attention, dict) else vars(attention)
    impl = fields["impl"]
    if impl == "varlen":
        # torch's varlen_attn took no grouped K/V heads before enable_gqa: common.attention repeats them first.
        expanded = fields.get("expands_kv")
        if expanded is None:  # a summary written before the field existed: its reason says so
            expanded = "expanded to all query heads" in fields.get("reason", "")
        return "flash-expanded-kv" if expanded else "flash"
    if impl.startswith("flash") or impl == "flex":  # flex: grouped heads, a block mask of a few KB, log-sum-exp
        return "flash"
    return "sdpa-packed" if packing else "sdpa"


def layer_activation_terms(shape: ModelShape, *, compute_bytes: int, autocast: bool, seq_len: int,
                           attention: str = "sdpa-packed", lora_rank: int = 0, expert_parallel: bool = False,
                           weight_bytes: int = FP32_BYTES, residual_bytes: int | None = None,
                           projection_bytes: int | None = None, compiled: bool = False,
                           lora_fused: bool = False) -> dict[str, float]:
    """Bytes per token that one decoder layer keeps for backward, term by term (module docstring, sections 1-2; a
    mixture of experts: common/memory/estimate.py, section 3, with `expert_parallel` for ep-ft's expert block and
    `weight_bytes`, the dtype transformers' experts compute in, for single-ft's). `residual_bytes` (r) defaults to 4
    under autocast and c otherwise; `projection_bytes` (o) to c. `lora_fused` (--lora-fused, common/lora.py): the
    projections that read one input share one cast of it, and o_proj's input is not cast again."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS} (eager and the math kernel also keep the "
                         f"s x s probabilities, which this model leaves out), got {attention!r}")
    c, f = compute_bytes, FP32_BYTES
    r = residual_bytes or (FP32_BYTES if autocast else compute_bytes)
    o = projection_bytes or c
    d, q_width, kv_width = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved_kv_width = kv_width if attention in ("sdpa", "flash") else q_width
    heads = shape.heads + shape.kv_heads
    attention_bytes = c * (q_width + 2 * saved_kv_width) + c * q_width + f * shape.heads \
        + (c * q_width if lora_rank and autocast and not lora_fused else 0)
    mask = c * seq_len if attention == "sdpa-packed" else 0
    adapters = LORA_PROJECTIONS * c * lora_rank
    if compiled and not shape.is_moe and o == c:
        return dict(norms=r * d + 2 * f, linear_inputs=3 * c * d, qk_norms=c * (q_width + kv_width) + f * heads,
                    attention=attention_bytes, mask=mask, mlp=3 * c * shape.intermediate, lora_adapters=adapters)
    # With LoRA the norm weights are frozen, so autograd does not keep the normalised input for their gradient.
    keeps_normalised = lora_rank == 0
    # Under autocast each projection saves its own cast of the normed input: q, k, v and the dense MLP's gate and
    # up, or a sparse layer's router (its experts gather their rows themselves).
    # Fused LoRA: one cast for q/k/v and one for gate/up (their adapters' shared down products).
    casts = 4 if shape.is_moe else 2 if lora_rank and lora_fused else 5
    terms = dict(
        norms=2 * (f * d + f + (r * d if keeps_normalised else 0)),
        linear_inputs=casts * c * d if autocast else 2 * r * d,
        qk_norms=(q_width + kv_width) * (f + (c if keeps_normalised else 0)) + f * heads,
        attention=attention_bytes,
        mask=mask,
    )
    if not shape.is_moe:
        return {**terms, "mlp": (3 * o + c) * shape.intermediate, "lora_adapters": adapters}
    E, k, inner = shape.experts, shape.experts_per_token, shape.expert_intermediate
    if expert_parallel:  # ep-ft's block: its rows in c, five index vectors, index_add keeping its source in r
        experts = k * (2 * c * d + 4 * c * inner + c + 5 * 8 + r * d)
    else:  # transformers' grouped_mm experts: rows in the weights' dtype, three index vectors
        e = weight_bytes
        experts = k * (2 * e * d + 4 * e * inner + c + 3 * 8)
    return {**terms, "router": f * E + 8 * k + f * k + f, "aux_loss": c * E + 8 * k, "experts": experts}


def outside_layers_bytes_per_token(shape: ModelShape, *, compute_bytes: int, autocast: bool, lora_rank: int = 0,
                                   residual_bytes: int | None = None, chunked_loss: bool = False) -> float:
    """Final norm, the LM head's input and RoPE's cos/sin (module docstring, section 1)."""
    r = residual_bytes or (FP32_BYTES if autocast else compute_bytes)
    final_norm = FP32_BYTES * shape.hidden + FP32_BYTES + (0 if lora_rank else r * shape.hidden)
    if chunked_loss:
        lm_head_input = 0  # the fused loss keeps gradients, not inputs: loss_bytes counts them
    else:  # autocast's cast of the norm's output, or that output itself; a frozen head keeps no input
        lm_head_input = 0 if lora_rank else compute_bytes * shape.hidden
    return final_norm + lm_head_input + 2 * shape.head_dim * r


def loss_bytes(shape: ModelShape, tokens: int, *, compute_bytes: int, vocab_share: float = 1.0,
               loss_chunk_tokens: int = 0, residual_bytes: int | None = None, trainable_head: bool = True) -> float:
    """The loss's buffers at their peak, with every activation alive (module docstring, section 3): the plain loss's
    logits and fp32 tensors at the start of backward; the fused loss's (common/loss.py) at its last chunk, in
    forward: one chunk of logits and its fp32 arithmetic, the loss tokens' hidden states (gathered, and cast to the
    compute dtype), their gradient, and the head weight's fp32 gradient, which the loss computes in forward and
    hands on in backward."""
    if not loss_chunk_tokens:
        return tokens * shape.vocab * vocab_share * (compute_bytes + CROSS_ENTROPY_FP32_BUFFERS * FP32_BYTES)
    per_logit = 2 * compute_bytes  # a chunk's logits and their gradient (the fp32 arithmetic is one GPU kernel)
    r = residual_bytes or FP32_BYTES
    chunk = min(loss_chunk_tokens, tokens) * shape.vocab * vocab_share * per_logit
    hidden = tokens * shape.hidden * (r + 2 * compute_bytes)  # gathered, its compute-dtype cast, its gradient
    head_gradient = shape.vocab * vocab_share * shape.hidden * FP32_BYTES if trainable_head else 0
    return chunk + hidden + head_gradient
