"""Memory per device for fine-tuning a Qwen3 decoder under each strategy, and which strategy to try first.

    uv run python -m common.memory --model qwen3-0.6b --gpus 2 --gpu-mem-gb 32 --seq-len 1024
    uv run python -m common.memory --model qwen3-4b --gpus 1 --gpu-mem-gb 24 --activation-checkpointing --lora-rank 16
    uv run python -m common.memory --zero-paper          # reproduce Figure 1 of the ZeRO paper

The peak of one device is taken as the sum of everything below. That is what happens once a step holds the
gradients of an earlier micro-batch (--grad-accum > 1) while the next forward's activations are alive; with one
micro-batch and `zero_grad(set_to_none=True)` the gradients grow while the activations shrink, so the true peak
is somewhat lower. Not counted: the CUDA context and
NCCL's own buffers (outside `max_memory_reserved`, hence USABLE_FRACTION), allocator fragmentation, the
gradients of activations inside one layer's backward, the input ids and labels.

1. Model states: bytes per parameter are a named choice (`BytesPerParam`), never a hidden constant.
   - ZERO_PAPER: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
     section 3.1 and Figure 1: fp16 weights 2 + fp16 gradients 2 + K = 12 bytes of optimizer state (fp32 master
     weights 4, Adam momentum 4, variance 4): 16 bytes per parameter. Sharded over N_d data-parallel devices:
         baseline (DDP)        (2 + 2 + K) Psi
         P_os     (ZeRO-1)     2 Psi + 2 Psi + K Psi / N_d
         P_os+g   (ZeRO-2)     2 Psi + (2 + K) Psi / N_d
         P_os+g+p (ZeRO-3)     (2 + 2 + K) Psi / N_d
     For Psi = 7.5e9 and N_d = 64 that is 120 GB, 31.4 GB, 16.6 GB and 1.9 GB (GB = 1e9 bytes), the paper's numbers.
   - BF16_RULE_OF_THUMB: bf16 weights 2 + bf16 gradients 2 + fp32 AdamW moments 8 = 12 bytes per parameter, no
     master copy (the usual back-of-envelope figure: a 7B model needs 84 GB before activations).
   - PROJECT_BF16: what the experiments do under `--dtype bf16`: the weights stay fp32 and are the master copy
     (4), fp32 gradients (4), fp32 AdamW m and v (8): 16 bytes per parameter. The bf16 copies the matrix multiplies
     read are made by torch.autocast (single, ddp, tp, pp), which caches the cast of every trainable
     weight for the whole forward, or by FSDP2's MixedPrecisionPolicy(param_dtype=bf16) (fsdp), which
     all-gathers each layer in bf16 just before it runs. PROJECT_FP32 (`--dtype fp32`): 4 + 4 + 8, no copies.
   With LoRA only the adapter's parameters have gradients and optimizer state; the frozen base weights cost
   `weights` bytes each.

2. Activations, bytes per token saved for backward by one decoder layer. The method is that of Korthikanti et
   al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4 (list every tensor autograd
   keeps; their GPT layer keeps 34 s b h + 5 a s^2 b bytes in fp16), redone for transformers' Qwen3 layer (RMSNorm
   computed in fp32, QK-norm, GQA, RoPE, SwiGLU) and for fused attention kernels (flash, memory-efficient, cuDNN)
   that keep a per-head log-sum-exp instead of the s x s probabilities. Each term was checked against the tensors
   that torch.autograd.graph.saved_tensors_hooks records (tests/test_memory.py does it for qwen3-tiny).
   Symbols: d hidden, H query heads, G key/value heads, h head_dim, I MLP width, s sequence length, R LoRA rank;
   c bytes of a compute element (2 bf16, 4 fp32); r bytes of the residual stream: 4 under autocast, whose fp32
   weights keep the embedding output and the residual additions fp32, else c; H_kv heads at which k and v reach
   the kernel: G when it takes GQA natively (flash_attention_2, SDPA without a mask), H when transformers repeats
   them (SDPA with a mask, which packed rows always have).
       norms          2 x [4d (fp32 upcast of the input; the input itself when r = 4) + 4 (1 / rms)
                           + r d (the normalised input, kept for the norm weight's gradient; not with LoRA)]
       linear inputs  autocast: 5 c d (q, k, v, gate and up each save their own bf16 cast of the normed input)
                      otherwise: 2 r d (one tensor per norm, shared by the projections that read it)
       QK-norm        (H + G) h (4 + c) + 4 (H + G)   (fp32 upcast, normalised copy without LoRA, 1 / rms per head)
       attention      c h (H + 2 H_kv) [q, k, v as the kernel got them] + c H h [output = o_proj's input,
                      the kernels write it in (batch, seq, head) order so transformers' transpose copies nothing]
                      + 4 H [log-sum-exp]; + c H h with LoRA under autocast (peft re-casts o_proj's input)
       mask           c s: packed rows through SDPA: the block-diagonal mask, turned into an additive bias in the
                      compute dtype, one s x s matrix per row, saved by every layer
       MLP            4 c I  [gate output, SiLU output, up output, their product = down_proj's input]
       LoRA adapters  7 c R  [A x of the seven adapted projections]
   Outside the layers: the final norm (4d + 4, + r d without LoRA), the LM head's input (c d: autocast's cast of the
   norm's output, or that output itself) and RoPE's cos and sin (2 h r, shared by all layers). Activation checkpointing
   (one checkpoint per decoder layer, as transformers does it) keeps only each layer's input, r d, plus one
   layer's full set while it is recomputed.
   Tensor parallelism divides the QK-norm, attention and MLP terms by t; sequence parallelism divides the rest too
   (Korthikanti et al.'s s b h (10 + 24/t) and s b h 34/t), except the mask, which every rank needs whole.

3. Logits: micro_batch x seq x vocab elements, in the compute dtype (c) as the LM head writes them, plus three
   fp32 tensors alive together inside the cross-entropy backward (log-probabilities, their gradient, the logits'
   gradient): c + 12 bytes per element, at the very start of backward, when every activation is still alive.

4. Temporary buffers:
   - ddp: PyTorch's reducer copies every gradient into flat all-reduce buckets (gradient_as_bucket_view=False,
     the default): a second copy of the gradients.
   - zero-1, zero-2: DeepSpeed's reduce bucket, `reduce_bucket_size` = 5e8 elements by default, in the
     gradient dtype (at most the trainable parameter count).
   - zero-3, fsdp: the unsharded units. FSDP2 never reshards the root module (embedding, final norm and, when
     untied, the LM head) between forward and backward, and it all-gathers the next layer while the current one
     runs: root + 2 layers of weights in the compute dtype, and root + 1 layer of unsharded gradients.
   - fsdp-offload: the same units; the sharded weights, gradients and optimizer state sit in CPU memory.
   - tp, tp-sp, pp: none counted (their all-gather and send/receive buffers are a few hidden-state tensors).
   Tensor parallelism shards the decoder layers' linear weights as transformers' Qwen3 tp_plan does; the
   embedding (tied with the LM head) and the norms are replicated, and the logits are gathered on every rank.
   Pipeline parallelism (1F1B, at least as many micro-batches as stages) splits the layers evenly, puts the
   embedding on the first stage and the final norm and LM head on the last (a tied head becomes a second copy
   there); stage k keeps p - k micro-batches of activations in flight, so the first stage holds p.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

from transformers import PretrainedConfig

from common.models import count_parameters, model_config

GIB = 2**30
GB = 1e9  # the ZeRO paper's unit
# Share of a GPU's memory a run can fill: the rest goes to the CUDA/HIP context, cuBLAS and NCCL workspaces and
# allocator fragmentation. GPU makers' "24 GB" is 24 GiB of address space (an RTX 4090 has 24,564 MiB).
USABLE_FRACTION = 0.90
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size
FP32_BYTES = 4
CROSS_ENTROPY_FP32_BUFFERS = 3  # log-probabilities, their gradient, the logits' gradient
LORA_PROJECTIONS = 7  # q, k, v, o, gate, up, down: every linear of a decoder layer, as the experiments adapt
DEFAULT_LORA_RANK = 16  # what the recommendation falls back to when full SFT fits nowhere

STRATEGIES = ("single", "ddp", "zero-1", "zero-2", "zero-3", "fsdp", "fsdp-offload", "tp", "tp-sp", "pp")
# Which model states a strategy divides by the data-parallel world size: (weights, gradients, optimizer + master).
DATA_PARALLEL_SHARDING = {
    "single": (False, False, False), "ddp": (False, False, False),
    "zero-1": (False, False, True), "zero-2": (False, True, True),
    "zero-3": (True, True, True), "fsdp": (True, True, True), "fsdp-offload": (True, True, True),
    "tp": (False, False, False), "tp-sp": (False, False, False), "pp": (False, False, False),
}
UNIT_SHARDED = ("zero-3", "fsdp", "fsdp-offload")  # gather one unit (layer) at a time in the compute dtype
ATTENTION_KINDS = ("sdpa-packed", "sdpa", "flash")
# How to run each strategy in this repository (the README's experiments table).
RUN_WITH = {
    "single": "experiments/single-ft/train.py", "ddp": "experiments/ddp-ft/train.py",
    "zero-1": "experiments/zero-ft/train.py --zero-stage 1", "zero-2": "experiments/zero-ft/train.py --zero-stage 2",
    "zero-3": "experiments/zero-ft/train.py --zero-stage 3", "fsdp": "experiments/fsdp-ft/train.py",
    "fsdp-offload": "experiments/fsdp-ft/train.py --cpu-offload", "tp": "experiments/tp-ft/train.py",
    "tp-sp": "experiments/tp-sp-ft/train.py", "pp": "experiments/pp-ft/train.py",
}


# ---------------------------------------------------------------------------------------------------------------
# Bytes per parameter
@dataclass(frozen=True)
class BytesPerParam:
    name: str
    weights: int  # the weights as kept between steps (every parameter, frozen ones included)
    grads: int  # gradient of a trainable parameter
    optimizer: int  # AdamW's first and second moments
    master: int  # a separate fp32 copy of the weights; 0 when the weights themselves are fp32
    compute: int  # one element of the activations, and of the weights as the matrix multiplies read them
    description: str = ""

    @property
    def trainable(self) -> int:
        """Model-state bytes of one trainable parameter."""
        return self.weights + self.grads + self.optimizer + self.master

    @property
    def zero_k(self) -> int:
        """The ZeRO paper's K: optimizer-state bytes per parameter, master copy included."""
        return self.optimizer + self.master


ZERO_PAPER = BytesPerParam("zero-paper", weights=2, grads=2, optimizer=8, master=4, compute=2,
                           description="ZeRO paper: fp16 weights 2 + fp16 grads 2 + K=12 (fp32 master, m, v)")
BF16_RULE_OF_THUMB = BytesPerParam("bf16-rule-of-thumb", weights=2, grads=2, optimizer=8, master=0, compute=2,
                                   description="bf16 weights 2 + bf16 grads 2 + fp32 AdamW m, v 8")
PROJECT_BF16 = BytesPerParam("project-bf16", weights=4, grads=4, optimizer=8, master=0, compute=2,
                             description="--dtype bf16: fp32 weights 4 + grads 4 + AdamW m, v 8; bf16 compute")
PROJECT_FP32 = BytesPerParam("project-fp32", weights=4, grads=4, optimizer=8, master=0, compute=4,
                             description="--dtype fp32: fp32 weights 4 + grads 4 + AdamW m, v 8")
# DeepSpeed's own bf16 mode, as zero-ft and pp-ds-ft configure it: bf16 weights in the module 2, fp32 gradient
# accumulation 4 (data_types.grad_accum_dtype), fp32 master copy 4 and AdamW moments 8 in the optimizer.
DEEPSPEED_BF16 = BytesPerParam("deepspeed-bf16", weights=2, grads=4, optimizer=8, master=4, compute=2,
                               description="DeepSpeed bf16: bf16 weights 2 + fp32 grads 4 + fp32 master 4 + m, v 8")
PRECISIONS = {p.name: p for p in (PROJECT_BF16, PROJECT_FP32, ZERO_PAPER, BF16_RULE_OF_THUMB, DEEPSPEED_BF16)}


# ---------------------------------------------------------------------------------------------------------------
# Model geometry
@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    # A stated total (e.g. a model card's); default: counted from the geometry. Any difference is put outside the
    # decoder layers, where padded vocabularies and extra heads live.
    parameters: int | None = None

    def _config(self):
        return SimpleNamespace(hidden_size=self.hidden, num_hidden_layers=self.layers, vocab_size=self.vocab,
                               num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                               head_dim=self.head_dim, intermediate_size=self.intermediate,
                               tie_word_embeddings=self.tied_embeddings)

    @property
    def layer_parameters(self) -> int:
        return count_parameters(self._config())["per_layer"]

    @property
    def layer_norm_parameters(self) -> int:
        return 2 * self.hidden + 2 * self.head_dim  # input and post-attention RMSNorm, q_norm, k_norm

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_parameters(self) -> int:
        return self.parameters or count_parameters(self._config())["total"]

    @property
    def root_parameters(self) -> int:
        """What is not in a decoder layer: embedding, final norm, the LM head when untied."""
        return self.total_parameters - self.layers * self.layer_parameters

    def lora_parameters(self, rank: int) -> int:
        """Adapter parameters of rank `rank` on the seven projections: rank x (inputs + outputs) each."""
        d, q, kv, inner = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inner) + (inner + d)
        return rank * per_layer * self.layers


def model_shape(config_like) -> ModelShape:
    """A preset or hub name (through common.models.model_config), a transformers config, a ModelShape, or a dict
    of raw counts: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab (and optionally
    tied_embeddings, parameters, name)."""
    if isinstance(config_like, ModelShape):
        return config_like
    if isinstance(config_like, dict):
        return ModelShape(**{"name": "custom", **config_like})
    name = None
    if isinstance(config_like, str):
        name, config_like = config_like, model_config(config_like)
    if not isinstance(config_like, PretrainedConfig):
        raise TypeError(f"expected a model name, a transformers config, a ModelShape or a dict, got {config_like!r}")
    config = config_like
    if getattr(config, "attention_bias", False):
        raise ValueError("attention biases are not modelled; Qwen3 has none")
    return ModelShape(
        name=name or getattr(config, "name_or_path", "") or config.model_type, layers=config.num_hidden_layers,
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate=config.intermediate_size, vocab=config.vocab_size,
        tied_embeddings=bool(config.tie_word_embeddings))


# ---------------------------------------------------------------------------------------------------------------
# Model states
def model_state_bytes(trainable: float, frozen: float, precision: BytesPerParam, strategy: str,
                      world_size: int) -> dict[str, float]:
    """Weights, gradients, optimizer state and master copy of one device holding `trainable` + `frozen`
    parameters (before data-parallel sharding), with the states `strategy` shards divided by `world_size`."""
    shard_weights, shard_grads, shard_optimizer = DATA_PARALLEL_SHARDING[strategy]
    weights_share = 1 / world_size if shard_weights else 1
    grads_share = 1 / world_size if shard_grads else 1
    optimizer_share = 1 / world_size if shard_optimizer else 1
    return dict(weights=(trainable + frozen) * precision.weights * weights_share,
                grads=trainable * precision.grads * grads_share,
                optimizer=trainable * precision.optimizer * optimizer_share,
                master=trainable * precision.master * optimizer_share)


def zero_paper_figure1(parameters: float = 7.5e9, devices: int = 64) -> list[tuple[str, str, float]]:
    """Rajbhandari et al. 2020, Figure 1: model-state memory per device for each ZeRO stage, in GB (1e9 bytes)."""
    rows = [("baseline", "ddp", "(2 + 2 + K) Psi"), ("P_os", "zero-1", "2 Psi + 2 Psi + K Psi / N_d"),
            ("P_os+g", "zero-2", "2 Psi + (2 + K) Psi / N_d"), ("P_os+g+p", "zero-3", "(2 + 2 + K) Psi / N_d")]
    return [(stage, formula, sum(model_state_bytes(parameters, 0, ZERO_PAPER, strategy, devices).values()) / GB)
            for stage, strategy, formula in rows]


# ---------------------------------------------------------------------------------------------------------------
# Activations
def layer_activation_terms(shape: ModelShape, *, compute_bytes: int, autocast: bool, seq_len: int,
                           attention: str = "sdpa-packed", lora_rank: int = 0) -> dict[str, float]:
    """Bytes per token that one decoder layer keeps for backward, term by term (module docstring, section 2)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS} (eager and the math kernel also keep the "
                         f"s x s probabilities, which this model leaves out), got {attention!r}")
    c, r, f = compute_bytes, FP32_BYTES if autocast else compute_bytes, FP32_BYTES
    d, q_width, kv_width = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved_kv_width = q_width if attention == "sdpa-packed" else kv_width
    # With LoRA the norm weights are frozen, so autograd does not keep the normalised input for their gradient.
    keeps_normalised = lora_rank == 0
    return dict(
        norms=2 * (f * d + f + (r * d if keeps_normalised else 0)),
        linear_inputs=5 * c * d if autocast else 2 * r * d,
        qk_norms=(q_width + kv_width) * (f + (c if keeps_normalised else 0)) + f * (shape.heads + shape.kv_heads),
        attention=c * (q_width + 2 * saved_kv_width) + c * q_width + f * shape.heads
                  + (c * q_width if lora_rank and autocast else 0),
        mask=c * seq_len if attention == "sdpa-packed" else 0,
        mlp=4 * c * shape.intermediate,
        lora_adapters=LORA_PROJECTIONS * c * lora_rank,
    )


TENSOR_PARALLEL_TERMS = ("qk_norms", "attention", "mlp")  # split over heads or MLP columns


def outside_layers_bytes_per_token(shape: ModelShape, *, compute_bytes: int, autocast: bool,
                                   lora_rank: int = 0) -> float:
    """Final norm, the LM head's input and RoPE's cos/sin (module docstring, section 2)."""
    r = FP32_BYTES if autocast else compute_bytes
    final_norm = FP32_BYTES * shape.hidden + FP32_BYTES + (0 if lora_rank else r * shape.hidden)
    lm_head_input = compute_bytes * shape.hidden  # autocast's cast of the norm's output, or that output itself
    return final_norm + lm_head_input + 2 * shape.head_dim * r


# ---------------------------------------------------------------------------------------------------------------
# One device's share of the model under a strategy
@dataclass(frozen=True)
class DeviceSlice:
    layers: int  # decoder layers this device runs
    layer_trainable: float  # per layer on this device: parameters with gradients (all of them, or the adapters)
    layer_frozen: float  # per layer: parameters without (the base weights under LoRA)
    layer_matmul: float  # per layer: weights the matrix multiplies read (what autocast casts to bf16)
    root_trainable: float  # outside the layers (embedding, final norm, LM head), with gradients
    root_frozen: float
    root_matmul: float  # the LM head matrix, where this device computes the logits
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    micro_batches_in_flight: int = 1  # pipeline stages keep several micro-batches of activations
    computes_logits: bool = True
    label: str = ""

    @property
    def trainable(self) -> float:
        return self.layers * self.layer_trainable + self.root_trainable

    @property
    def frozen(self) -> float:
        return self.layers * self.layer_frozen + self.root_frozen


def device_slices(shape: ModelShape, strategy: str, world_size: int, lora_rank: int) -> list[DeviceSlice]:
    """What one device holds and runs (before data-parallel sharding); one slice per stage for pp."""
    layer_norms = shape.layer_norm_parameters
    layer_linears = shape.layer_parameters - layer_norms
    adapters = shape.lora_parameters(lora_rank) / shape.layers
    lm_head = shape.embedding_parameters  # the LM head matrix, tied or not

    def piece(layers: int, root: float, root_matmul: float, linear_share: float = 1.0, **kwargs) -> DeviceSlice:
        linears, layer_adapters = layer_linears * linear_share, adapters * linear_share
        if lora_rank:
            trainable, frozen, root_trainable, root_frozen = layer_adapters, linears + layer_norms, 0.0, root
        else:
            trainable, frozen, root_trainable, root_frozen = linears + layer_norms, 0.0, root, 0.0
        return DeviceSlice(layers, trainable, frozen, linears + layer_adapters, root_trainable, root_frozen,
                           root_matmul, **kwargs)

    if strategy in ("tp", "tp-sp"):
        if shape.heads % world_size or shape.kv_heads % world_size:
            raise ValueError(f"tensor parallelism over {world_size} needs the {shape.heads} heads and "
                             f"{shape.kv_heads} KV heads to divide by {world_size}")
        # transformers' Qwen3 tp_plan: every projection of a layer is split (LoRA adapters counted as split with
        # it, they are tiny); norms and the embedding are replicated; an untied LM head is split by columns.
        untied_head = 0 if shape.tied_embeddings else lm_head
        root = shape.root_parameters - untied_head + untied_head / world_size
        head = lm_head if shape.tied_embeddings else lm_head / world_size
        return [piece(shape.layers, root, head, linear_share=1 / world_size, tensor_parallel=world_size,
                      sequence_parallel=strategy == "tp-sp")]
    if strategy == "pp":
        if world_size > shape.layers:
            raise ValueError(f"{world_size} pipeline stages for {shape.layers} layers")
        stages = []
        for stage in range(world_size):
            first, last = stage == 0, stage == world_size - 1
            layers = shape.layers // world_size + (1 if stage < shape.layers % world_size else 0)
            # A tied LM head on another stage than the embedding is a second copy of that matrix, with its own
            # gradients and optimizer state; the two copies stay equal by summing their gradients (DeepSpeed's
            # TiedLayerSpec does this).
            head_copy = last and not (first and shape.tied_embeddings)
            root = (shape.embedding_parameters if first else 0) + (shape.hidden if last else 0) \
                + (lm_head if head_copy else 0)
            stages.append(piece(layers, root, lm_head if last else 0, micro_batches_in_flight=world_size - stage,
                                computes_logits=last, label=f"stage {stage} of {world_size}"))
        return stages
    return [piece(shape.layers, shape.root_parameters, lm_head)]


# ---------------------------------------------------------------------------------------------------------------
# The estimate
@dataclass(frozen=True)
class MemoryEstimate:
    strategy: str
    world_size: int
    precision: BytesPerParam
    activation_checkpointing: bool
    lora_rank: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    master_bytes: float
    compute_copy_bytes: float  # bf16 copies of fp32 weights made by autocast
    activations_bytes: float
    logits_bytes: float
    buffers_bytes: float  # communication buckets, unsharded FSDP/ZeRO-3 units
    cpu_bytes: float = 0.0  # model states held in host memory by this rank (fsdp-offload)
    note: str = ""  # e.g. which pipeline stage is the largest

    @property
    def model_states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.master_bytes

    @property
    def total_bytes(self) -> float:
        return (self.model_states_bytes + self.compute_copy_bytes + self.activations_bytes + self.logits_bytes
                + self.buffers_bytes)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def fits(self, gpu_mem_gb: float) -> bool:
        return self.total_gib <= gpu_mem_gb * USABLE_FRACTION


def estimate(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024, micro_batch_size: int = 1,
             activation_checkpointing: bool = False, lora_rank: int = 0, precision: BytesPerParam = PROJECT_BF16,
             attention: str = "sdpa-packed") -> MemoryEstimate:
    """Peak memory of one device (for pp: of the fullest stage), broken down as in the module docstring."""
    stages = estimate_stages(config_like, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                             activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
                             precision=precision, attention=attention)
    return max(stages, key=lambda stage: stage.total_bytes)


def estimate_stages(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024,
                    micro_batch_size: int = 1, activation_checkpointing: bool = False, lora_rank: int = 0,
                    precision: BytesPerParam = PROJECT_BF16, attention: str = "sdpa-packed") -> list[MemoryEstimate]:
    """The estimate of every distinct device: one per pipeline stage for pp (stage k on rank k), else one for all."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "single" and world_size != 1:
        raise ValueError("single runs on one device")
    shape = model_shape(config_like)
    return [_estimate_slice(shape, piece, strategy, world_size, micro_batch_size, seq_len, activation_checkpointing,
                            lora_rank, precision, attention)
            for piece in device_slices(shape, strategy, world_size, lora_rank)]


def uses_autocast(strategy: str, precision: BytesPerParam) -> bool:
    """Autocast runs wherever the kept weights are wider than the compute dtype, except under FSDP/ZeRO-3, whose
    mixed-precision policy hands each layer its weights already in the compute dtype."""
    return precision.weights > precision.compute and strategy not in UNIT_SHARDED


def _estimate_slice(shape: ModelShape, piece: DeviceSlice, strategy: str, world_size: int, micro_batch_size: int,
                    seq_len: int, activation_checkpointing: bool, lora_rank: int, precision: BytesPerParam,
                    attention: str) -> MemoryEstimate:
    states = model_state_bytes(piece.trainable, piece.frozen, precision, strategy, world_size)
    c, tokens = precision.compute, micro_batch_size * seq_len
    autocast = uses_autocast(strategy, precision)

    compute_copy = 0.0
    if autocast:
        # Autocast caches the cast of each trainable weight until the forward ends, checkpointing or not. Frozen
        # (LoRA) weights are re-cast at each use and kept only by the autograd graph, which checkpointing drops
        # after each layer: one layer's copies (during its recomputation) and the LM head's remain.
        layers_copied = 1 if lora_rank and activation_checkpointing else piece.layers
        compute_copy = (layers_copied * piece.layer_matmul + piece.root_matmul) * c

    terms = layer_activation_terms(shape, compute_bytes=c, autocast=autocast, seq_len=seq_len, attention=attention,
                                   lora_rank=lora_rank)
    tp = piece.tensor_parallel
    layer_per_token = sum(value / tp if name in TENSOR_PARALLEL_TERMS or (piece.sequence_parallel and name != "mask")
                          else value for name, value in terms.items())
    in_flight_layers = piece.micro_batches_in_flight * piece.layers
    if activation_checkpointing:
        residual_bytes = FP32_BYTES if autocast else c
        checkpoint_per_token = residual_bytes * shape.hidden / (tp if piece.sequence_parallel else 1)
        per_token = in_flight_layers * checkpoint_per_token + layer_per_token  # + the layer being recomputed
    else:
        per_token = in_flight_layers * layer_per_token
    logits = 0.0
    if piece.computes_logits:
        per_token += outside_layers_bytes_per_token(shape, compute_bytes=c, autocast=autocast, lora_rank=lora_rank)
        logits = tokens * shape.vocab * (c + CROSS_ENTROPY_FP32_BUFFERS * FP32_BYTES)

    buffers = 0.0
    if strategy == "ddp":
        buffers = piece.trainable * precision.grads
    elif strategy in ("zero-1", "zero-2"):
        buffers = min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, piece.trainable) * precision.grads
    elif strategy in UNIT_SHARDED:
        layer = piece.layer_trainable + piece.layer_frozen
        gathered_weights = (piece.root_trainable + piece.root_frozen + min(2, piece.layers) * layer) * c
        unsharded_grads = (piece.root_trainable + piece.layer_trainable) * precision.grads
        buffers = gathered_weights + unsharded_grads

    cpu = 0.0
    if strategy == "fsdp-offload":
        cpu, states = sum(states.values()), dict.fromkeys(states, 0.0)
    return MemoryEstimate(
        strategy=strategy, world_size=world_size, precision=precision,
        activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
        weights_bytes=states["weights"], grads_bytes=states["grads"],
        optimizer_bytes=states["optimizer"], master_bytes=states["master"], compute_copy_bytes=compute_copy,
        activations_bytes=tokens * per_token, logits_bytes=logits, buffers_bytes=buffers, cpu_bytes=cpu,
        note=piece.label)


def attention_kind(attn_implementation: str, packing: bool) -> str:
    """The ATTENTION_KINDS entry for an experiment's attention implementation and --packing setting."""
    if attn_implementation.startswith("flash"):
        return "flash"
    return "sdpa-packed" if packing else "sdpa"


def predict_peak_gib(config_like, strategy: str, world_size: int = 1, *, seq_len: int, micro_batch_size: int = 1,
                     activation_checkpointing: bool = False, lora_rank: int = 0, dtype: str = "bf16",
                     attention: str = "sdpa-packed", precision: BytesPerParam | None = None) -> float:
    """Predicted peak GiB of one device, for an experiment's summary.json (`predicted_peak_mem_gib`), next to the
    measured `torch.cuda.max_memory_reserved()`. `strategy` is one of STRATEGIES (zero-ft: f"zero-{stage}",
    fsdp-ft --cpu-offload: "fsdp-offload"); `dtype` is the experiment's --dtype; pass `precision` where the engine
    keeps other dtypes (DeepSpeed's bf16 mode keeps bf16 weights and an fp32 master: DEEPSPEED_BF16); `attention` is
    "sdpa" for --no-packing and "flash" for --attn flash."""
    precision = precision or {"bf16": PROJECT_BF16, "fp32": PROJECT_FP32}[dtype]
    return estimate(config_like, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                    activation_checkpointing=activation_checkpointing, lora_rank=lora_rank, precision=precision,
                    attention=attention).total_gib


# ---------------------------------------------------------------------------------------------------------------
# Which strategy to try first
@dataclass(frozen=True)
class Recommendation:
    strategy: str | None  # None: nothing fits
    activation_checkpointing: bool
    lora_rank: int
    reason: str
    choice: MemoryEstimate | None
    estimates: list[MemoryEstimate]  # every strategy that applies to these GPUs, with the settings as given
    gpus: int
    gpu_mem_gb: float

    @property
    def fitting(self) -> list[str]:
        return [e.strategy for e in self.estimates if e.fits(self.gpu_mem_gb)]

    def command(self) -> str:
        if self.strategy is None:
            return ""
        launcher = "python" if self.strategy == "single" else f"torchrun --nproc_per_node={self.gpus}"
        flags = " --activation-checkpointing" * self.activation_checkpointing
        flags += f" --lora-rank {self.lora_rank}" if self.lora_rank else ""
        return f"uv run {launcher} {RUN_WITH[self.strategy]}{flags}"


WHY = {
    "single": "it fits on one GPU",
    "ddp": "a full replica fits on each GPU: DDP all-reduces only the gradients, the cheapest way to add GPUs "
           "for throughput",
    "zero-2": "ZeRO-2 shards gradients and AdamW state over the GPUs for the same traffic as DDP "
              "(a reduce-scatter plus an all-gather instead of an all-reduce)",
    "fsdp": "FSDP (ZeRO-3) also shards the weights and all-gathers one layer at a time, at 1.5x DDP's traffic",
    "tp-sp": "tensor + sequence parallelism splits every layer's weights and activations; it communicates inside "
             "every layer, so it wants fast links (NVLink, Infinity Fabric)",
    "tp": "tensor parallelism splits every layer's weights and most of its activations; it communicates inside "
          "every layer, so it wants fast links (NVLink, Infinity Fabric)",
    "pp": "pipeline parallelism splits the layers into stages and sends only hidden states between them, which "
          "suits PCIe links; the first stage keeps one micro-batch of activations per stage",
    "fsdp-offload": "CPU offload keeps weights, gradients and AdamW state in host memory (sharded across ranks) "
                    "and runs AdamW on the CPU: much slower, but only the layers being computed sit on the GPU",
}


def recommend(config_like, gpus: int, gpu_mem_gb: float, *, seq_len: int = 1024, micro_batch_size: int = 1,
              activation_checkpointing: bool = False, lora_rank: int = 0, precision: BytesPerParam = PROJECT_BF16,
              attention: str = "sdpa-packed", interconnect: str = "pcie") -> Recommendation:
    """The decision tree, first rung that fits wins:
    1. a replica fits one GPU: single (DDP with more GPUs, for throughput);
    2. its model states fit but its activations do not: the same with activation checkpointing;
    3. model states do not fit one GPU: ZeRO-2, then FSDP/ZeRO-3 (each without, then with checkpointing);
    4. still not: model parallelism, TP(+SP) first on fast links, PP first on PCIe; then CPU offload;
    5. full SFT fits nowhere: LoRA (rank DEFAULT_LORA_RANK unless given), down the same ladder.
    """
    shape = model_shape(config_like)
    usable_gib = gpu_mem_gb * USABLE_FRACTION
    settings = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, precision=precision, attention=attention)

    def attempt(strategy: str, checkpointing: bool, rank: int) -> MemoryEstimate | None:
        try:
            return estimate(shape, strategy, 1 if strategy == "single" else gpus, lora_rank=rank,
                            activation_checkpointing=checkpointing, **settings)
        except ValueError:  # e.g. heads that do not divide over the GPUs
            return None

    candidates = ("single", "fsdp-offload") if gpus == 1 else STRATEGIES[1:]
    as_given = [e for e in (attempt(s, activation_checkpointing, lora_rank) for s in candidates) if e]
    model_parallel = ("tp-sp", "tp", "pp") if interconnect == "nvlink" else ("pp", "tp-sp", "tp")
    ladder = ["single"] if gpus == 1 else ["ddp", "zero-2", "fsdp", *model_parallel]
    ladder.append("fsdp-offload")
    checkpointing_options = (True,) if activation_checkpointing else (False, True)

    failures: list[MemoryEstimate] = []
    for rank in (lora_rank,) if lora_rank else (0, DEFAULT_LORA_RANK):
        for strategy in ladder:
            for checkpointing in checkpointing_options:
                result = attempt(strategy, checkpointing, rank)
                if result is None:
                    continue
                if not result.fits(gpu_mem_gb):
                    failures.append(result)
                    continue
                lora_alternative = None
                if strategy == "fsdp-offload" and not rank:
                    # Offloading full SFT is slow; LoRA on the GPUs alone is the usual way out, so name it too.
                    lora_alternative = next((e for s in ladder[:-1] for ac in checkpointing_options
                                             if (e := attempt(s, ac, DEFAULT_LORA_RANK)) and e.fits(gpu_mem_gb)),
                                            None)
                reason = _explain(result, failures, shape, usable_gib, lora_rank, activation_checkpointing,
                                  lora_alternative)
                return Recommendation(strategy, checkpointing, rank, reason, result, as_given, gpus, gpu_mem_gb)
    smallest = min(failures, key=lambda e: e.total_bytes)
    reason = (f"nothing fits in {usable_gib:.1f} GiB per GPU; the smallest, {_label(smallest)}, needs "
              f"{smallest.total_gib:.1f} GiB: shorten --seq-len or --micro-batch-size, or add GPUs")
    return Recommendation(None, activation_checkpointing, lora_rank, reason, None, as_given, gpus, gpu_mem_gb)


def _label(e: MemoryEstimate) -> str:
    return (e.strategy + (" + activation checkpointing" if e.activation_checkpointing else "")
            + (f" + LoRA r{e.lora_rank}" if e.lora_rank else ""))


def _explain(choice: MemoryEstimate, failures: list[MemoryEstimate], shape: ModelShape, usable_gib: float,
             requested_rank: int, requested_checkpointing: bool, lora_alternative: MemoryEstimate | None) -> str:
    parts = []
    lora_fallback = choice.lora_rank and not requested_rank
    if failures:
        considered = [e for e in failures if not e.lora_rank] if lora_fallback else failures
        leanest = min(considered, key=lambda e: e.total_bytes)
        parts.append(f"{'full SFT fits nowhere: ' if lora_fallback else ''}the leanest option tried before, "
                     f"{_label(leanest)}, needs {leanest.total_gib:.2f} GiB per GPU of {usable_gib:.2f} usable")
    if lora_fallback:
        adapters = shape.lora_parameters(choice.lora_rank)
        parts.append(f"LoRA rank {choice.lora_rank} trains {adapters:,} parameters "
                     f"({adapters / shape.total_parameters:.2%}), so only the frozen weights remain a large state")
    parts.append(WHY[choice.strategy])
    if choice.activation_checkpointing and not requested_checkpointing:
        checkpointing = (f"with activation checkpointing, which keeps only each layer's input and recomputes the "
                         f"layer in backward (about a third more compute): {choice.activations_bytes / GIB:.1f} GiB "
                         f"of activations")
        if choice.model_states_bytes:
            checkpointing += f" beside {choice.model_states_bytes / GIB:.1f} GiB of model states"
        parts.append(checkpointing)
    if choice.cpu_bytes:
        parts.append(f"it needs {choice.cpu_bytes * choice.world_size / GIB:.1f} GiB of host memory in all")
    if lora_alternative:
        parts.append(f"faster, if training adapters instead of all weights is acceptable: {_label(lora_alternative)} "
                     f"({lora_alternative.total_gib:.1f} GiB per GPU)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Command line
ZERO_PAPER_FIGURE1_GB = {"baseline": 120, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.9}  # as printed in the paper
COLUMNS = (("weights", "weights_bytes"), ("grads", "grads_bytes"), ("optim", "optimizer_bytes"),
           ("master", "master_bytes"), ("copies", "compute_copy_bytes"), ("activ", "activations_bytes"),
           ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))


def format_zero_paper() -> str:
    lines = [f"ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B parameters, N_d = 64 devices, "
             f"K = {ZERO_PAPER.zero_k}, model states per device in GB (1e9 bytes)",
             f"{'stage':<10} {'formula':<28} {'computed':>9} {'paper':>6}"]
    for stage, formula, gb in zero_paper_figure1():
        lines.append(f"{stage:<10} {formula:<28} {gb:>9.3f} {ZERO_PAPER_FIGURE1_GB[stage]:>6}")
    return "\n".join(lines)


def format_table(estimates: list[MemoryEstimate], gpu_mem_gb: float) -> str:
    header = f"{'strategy':<14}" + "".join(f"{title:>8}" for title, _ in COLUMNS) + f"{'total':>8}  fits  note"
    lines = [header]
    for e in estimates:
        cells = "".join(f"{getattr(e, field) / GIB:>8.2f}" for _, field in COLUMNS)
        note = ", ".join(filter(None, [e.note, f"+ {e.cpu_bytes / GIB:.1f} GiB in CPU memory per rank"
                                       if e.cpu_bytes else ""]))
        fits = "yes" if e.fits(gpu_mem_gb) else "no"
        lines.append(f"{e.strategy:<14}{cells}{e.total_gib:>8.2f}  {fits:<4}  {note}".rstrip())
    return "\n".join(lines)


def describe_activations(shape: ModelShape, precision: BytesPerParam, tokens: int, seq_len: int, attention: str,
                         lora_rank: int) -> str:
    """The per-layer activation terms for the single/ddp regime, in bytes per token and in MiB per micro-batch."""
    autocast = uses_autocast("single", precision)
    terms = layer_activation_terms(shape, compute_bytes=precision.compute, autocast=autocast, seq_len=seq_len,
                                   attention=attention, lora_rank=lora_rank)
    total = sum(terms.values())
    listed = " + ".join(f"{name.replace('_', ' ')} {value:,.0f}" for name, value in terms.items() if value)
    checkpoint = (FP32_BYTES if autocast else precision.compute) * shape.hidden
    return (f"activations per layer ({'autocast' if autocast else 'no autocast'}, {attention}): {listed} = "
            f"{total:,.0f} bytes/token -> {total * tokens / 2**20:.1f} MiB per layer per micro-batch; "
            f"checkpointed: {checkpoint:,} bytes/token (the layer's input)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="preset, hub id or local folder (or give the raw counts below)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        parser.add_argument(f"--{flag}", type=int, help="raw geometry, instead of --model")
    parser.add_argument("--untied", action="store_true", help="raw geometry: the LM head is not the embedding")
    parser.add_argument("--parameters", type=float, help="raw geometry: a stated total parameter count")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs available")
    parser.add_argument("--gpu-mem-gb", type=float, default=24, help="memory of one GPU, as its maker states it")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--strategy", choices=STRATEGIES, help="show only this strategy")
    parser.add_argument("--precision", choices=PRECISIONS, default=PROJECT_BF16.name)
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="sdpa-packed",
                        help="sdpa-packed: the experiments' default (packed rows through SDPA); sdpa: unpacked "
                             "rows; flash: flash_attention_2")
    parser.add_argument("--interconnect", choices=("pcie", "nvlink"), default="pcie",
                        help="links between the GPUs: decides TP before PP (nvlink) or PP before TP (pcie)")
    parser.add_argument("--zero-paper", action="store_true", help="print the ZeRO paper's Figure 1 and exit")
    args = parser.parse_args(argv)

    if args.zero_paper:
        print(format_zero_paper())
        return
    if args.model:
        shape = model_shape(args.model)
    else:
        geometry = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
        missing = [name for name, value in geometry.items() if value is None]
        if missing:
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            parser.error(f"give --model, or all of the raw counts (missing: {flags})")
        shape = ModelShape(name="custom", tied_embeddings=not args.untied,
                           parameters=int(args.parameters) if args.parameters else None, **geometry)
    precision = PRECISIONS[args.precision]
    advice = recommend(shape, args.gpus, args.gpu_mem_gb, seq_len=args.seq_len,
                       micro_batch_size=args.micro_batch_size, activation_checkpointing=args.activation_checkpointing,
                       lora_rank=args.lora_rank, precision=precision, attention=args.attention,
                       interconnect=args.interconnect)
    shown = [e for e in advice.estimates if args.strategy in (None, e.strategy)]
    if args.strategy and not shown:  # single on several GPUs, or a layout these GPUs cannot take
        world = 1 if args.strategy == "single" else args.gpus
        try:
            shown = [estimate(shape, args.strategy, world, seq_len=args.seq_len,
                              micro_batch_size=args.micro_batch_size, lora_rank=args.lora_rank,
                              activation_checkpointing=args.activation_checkpointing, precision=precision,
                              attention=args.attention)]
        except ValueError as error:
            parser.error(str(error))
    trainable = shape.lora_parameters(args.lora_rank) if args.lora_rank else shape.total_parameters
    print(f"model {shape.name}: {shape.total_parameters:,} parameters, {trainable:,} trainable | {shape.layers} "
          f"layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, MLP "
          f"{shape.intermediate}, vocab {shape.vocab:,}{'' if shape.tied_embeddings else ', untied LM head'}")
    print(f"precision {precision.name}: {precision.description} = {precision.trainable} bytes per trainable parameter")
    print(f"micro-batch {args.micro_batch_size} x {args.seq_len} tokens | activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}")
    print(describe_activations(shape, precision, args.micro_batch_size * args.seq_len, args.seq_len,
                               args.attention, args.lora_rank))
    print(f"\nGiB per device on {args.gpus} x {args.gpu_mem_gb:g} GB ({args.gpu_mem_gb * USABLE_FRACTION:.1f} GiB "
          f"usable); copies = autocast's bf16 weight copies, buffers = buckets and gathered FSDP units")
    print(format_table(shown, args.gpu_mem_gb))
    print()
    if advice.strategy is None:
        print(f"recommendation: none. {advice.reason}")
    else:
        print(f"recommendation: {_label(advice.choice)}. {advice.reason[0].upper()}{advice.reason[1:]}.")
        print(f"run: {advice.command()}")


if __name__ == "__main__":
    main()
