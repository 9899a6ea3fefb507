"""One device's memory under a strategy: what it holds, when the peak comes, and how the experiments ask for it.
(common/memory/__init__.py says how the parts fit together.)

The peak. A step passes through two high points, and the estimate is the larger:
- the start of backward (`forward_bytes`): the weights, the optimizer state and master copy, the gradients that
  already exist then, autocast's weight copies, every layer's activations, the loss's buffers (logits and the
  cross-entropy's fp32 tensors) and the temporary buffers of section 1. Which gradients exist then: with more
  than one micro-batch per step (--grad-accum > 1) those of the earlier ones; under ddp and DeepSpeed's engines
  always, since their gradients live in buffers allocated once (DDP's buckets, with gradient_as_bucket_view=True:
  under --dtype bf16 only those, bf16, the fp32 masters' gradients as under single; DeepSpeed's flat fp32
  buffers); in a pipeline always (1F1B runs backward while later micro-batches are in flight); under FSDP none
  (its unsharded accumulation is a buffer of section 1, and each rank's shard of a gradient is written only by the
  last reduce-scatter). With one micro-batch and `zero_grad(set_to_none=True)`,
  single, tp and ep start backward without gradients: they grow while the activations shrink, layer by layer, so
  the backward's memory lies between its two ends.
- the optimizer step (`step_bytes`): every model state, and the buffers that outlive backward (DeepSpeed's);
  single-ft's and ddp-ft's bf16 weights (and ddp-ft's bf16 buckets) are freed for it (common/precision.py: rebuilt
  from the fp32 masters after it).
The estimate's columns (weights, grads, ...) list everything a step ever holds; `total_bytes` is that peak.
Not counted: the CUDA context and NCCL's own buffers (outside `max_memory_reserved`, hence USABLE_FRACTION), the
caching allocator's fragmentation (reserved beyond allocated: the committed GPU runs put it at a few percent, the
gap between this prediction and max_memory_reserved), the gradients of activations inside one layer's backward,
the input ids and labels. tests/test_memory.py holds every GPU run committed under devlog/data to this estimate.

1. Temporary buffers, in the `buffers` column (symbols: c compute bytes, w the weights' bytes, T trainable
   parameters, E elements of the largest trainable parameter, B = reduce_bucket_size = 5e8 elements):
   - ddp: none. ddp-ft passes gradient_as_bucket_view=True, so the gradients are views into the all-reduce buckets
     (the default, False, would copy every gradient into a second, bucketed copy). Under --dtype bf16 the buckets
     are the bf16 weights' (c T, counted with the gradients) and only the masters' fp32 gradients are reduced.
   - zero-1 under bf16: BF16_Optimizer all-reduces its fp32 gradient buffer in place, one param group at a time;
     only when the group of matrices has at most 5e8 elements (the engine's all-reduce bucket) are both groups
     flattened into one copy first, 4 T (small models only).
   - zero-1 under fp32, zero-2, zero-3: the reduce bucket, allocated at its full B elements whatever the trainable
     count (a LoRA run pays it too), in the module's dtype for stages 1-2 (w B: 0.93 GiB in bf16) and in the fp32
     communication dtype for stage 3 (4 B), plus the fp32 tensor that the collective reduces, flattened from one
     full bucket (4 min(B, T): 1.86 GiB). Stages 2-3 also hold each gradient as autograd writes it (c bytes) until
     it is copied into the bucket; the largest, a tied embedding whose LM-head half arrives at the start of
     backward and embedding half at its end, is alive for all of it: c E.
   - zero-3: the gathered parameters, in the weights' dtype. zero3_gathered_elements() replays one step of
     DeepSpeed's parameter coordinator with zero-ft's defaults (prefetch 5e7, max live 1e9, reuse distance 1e9
     elements): 1.39e9 elements for Qwen3-4B (2.6 GiB in bf16), 1.31e9 for 1.7B, the whole 0.6B model (5.96e8).
     On one rank nothing is gathered: a parameter becomes a view of its (whole) partition.
   - fsdp: the unsharded units. FSDP2 never reshards the root module (embedding, final norm and, when untied, the
     LM head) between forward and backward, and it all-gathers the next layer while the current one runs: root +
     2 layers of weights in the compute dtype (root + every layer with --no-reshard-after-forward, which keeps each
     layer gathered from its forward to its backward, and with the gather-once setting). A unit's gradients
     arrive in c bytes and are copied into an fp32 reduce-scatter input (the reduce dtype); the root's reduce-scatter
     waits for the embedding's gradient at the end of backward: max(c root + (c + 4) layer, (c + 4) root) of trainable
     parameters. With --grad-accum > 1 fsdp-ft reduce-scatters only in the last micro-batch: until then every unit keeps
     its unsharded gradients, upcast to fp32 to accumulate: 4 T + (c + 4) layer (estimate(grad_accum=...)).
   - tp, tp-sp, pp: none counted (their all-gather and send/receive buffers are a few hidden-state tensors).
   - QLoRA: bitsandbytes dequantizes each 4-bit weight into a compute-dtype copy just before its product, in
     forward and again in backward, and frees it after: the largest projection's, d I c.
   Which of these outlive backward (`step_buffers_bytes`): DeepSpeed's buckets and flattened copies, allocated
   once and reused every step; the others live inside forward and backward.
   Tensor parallelism shards the decoder layers' linear weights and, as tp-ft and tp-sp-ft do, the embedding and
   the LM head over the vocabulary (tied or not: each rank holds V/t rows); the norms are replicated. With loss
   parallel (their default) each rank computes and keeps only its V/t columns of the logits.
   FSDP x TP (fsdp-tp, fsdp-tp-ft: a 2-D mesh of dp = N / t rows of t tensor-parallel ranks; estimate() takes t as
   `tensor_parallel`): each rank holds tp's slice, sharded again by FSDP over the dp ranks. The sharded parts, the
   split weights, their gradients and AdamW state, are divided by dp x t = N; the norms, replicated over t, by dp.
   The buffers are fsdp's (gathered root + 2 layers, unsharded gradients), of the TP slice; activations and logits
   are tp's.
   Pipeline parallelism (1F1B, at least as many micro-batches as stages) splits the layers evenly, puts the
   embedding on the first stage and the final norm and LM head on the last (a tied head becomes a second copy
   there, frozen under LoRA like the embedding); stage k keeps p - k micro-batches of activations in flight, so
   the first stage holds p.

2. CPU offload (`cpu_bytes`: host memory per rank; `cpu_buffers_bytes`: its staging buffers):
   - zero-2-offload (ZeRO-Offload, offload_optimizer device cpu): the GPU keeps the weights (w P) and the buffers
     of section 1 plus a staging buffer for one gradient (w E); the host keeps the fp32 master partition, the fp32
     gradient partition and AdamW's m and v, (4 + 4 + 8) T / N, and copies in the weights' dtype of this rank's
     partition (w T / N) and of the largest gradient (w E).
   - zero-3-offload (offload_optimizer device cpu, parameters on the GPU): the GPU keeps its partition of the
     weights (w P / N), the persistent parameters and the buffers of section 1; the host keeps (4 + 4 + 8) T / N.
   - fsdp-offload: the GPU keeps the units of section 1; the host keeps every sharded state, (4 + 4 + 8) P / N.


3. Mixtures of experts (Qwen3-MoE: every layer's MLP is E SwiGLU experts of width I_e, k per token, chosen by a
   linear router; transformers keeps each layer's experts as two 3-D weights, gate_up_proj [E, 2 I_e, d] and
   down_proj [E, d, I_e]). Two strategies price them, as the two experiments that train them run them: single
   (single-ft) and ep (ep-ft, expert parallelism over W ranks). Every other strategy refuses a mixture of experts
   (a ValueError: mixture of experts: single or ep), as its experiment does; so does LoRA, whose peft adapters on
   the experts' 3-D weights (ParamWrapper) this module does not model.
   - Model states. ep: each rank holds the dense part (embedding, LM head, attention, routers, norms) whole and E / W
     experts of every layer (DTensor Shard(0)), with their fp32 gradients and AdamW state: 16 bytes per held
     parameter under fp32, 18 under --dtype bf16 (bf16 weights, fp32 masters: common/precision.py), no reduce bucket
     counted (ep-ft all-reduces the dense gradients in 25 MiB flat copies, section 1's "none counted" for tp/pp).
     single: the whole model, as for a dense one.
   - Compute copies. single and ep compute in their bf16 weights (common/precision.py) and make no copy. In their
     runs from before those (fp32 weights under autocast, priced so): autocast cached its bf16 casts of the attention
     projections, the routers and the LM head, as for a dense model; torch's grouped_mm is not autocast-aware:
     transformers' experts (single) cast the tokens to the weights' dtype, fp32; ep-ft cast its rows and its E / W
     experts of each layer to bf16 itself, copies that backward kept (the grouped product saves its weight) until the
     layer's backward: every layer's, or with checkpointing one layer's (the recomputed one).
   - Activations, per token of one sparse layer, in place of the dense MLP's 4 c I (symbols of activations.py, and e the
     bytes of the weights, the dtype transformers' experts compute in):
       linear inputs  autocast: 4 c d (q, k, v and the router each save their cast); otherwise 2 r d, as dense
       router         4 E [fp32 probabilities] + 8 k [top-k ids] + 4 k + 4 [top-k probabilities, their sum]
       aux loss       c E + 8 k: common.moe's load-balancing loss, the softmax of the router logits and its top-k
       experts        single: k (2 e d + 4 e I_e + c + 24)  [its k rows gathered, gate_up out (2 I_e), SiLU out,
                      their product, down out, the routing weight, three int64 index vectors]
                      ep: k (2 c d + 4 c I_e + c + 40 + r d)  [the same rows as the experts received them, in c; five
                      index vectors; and the combine's index_add keeps its source, the weighted rows, in r]
   Each term was checked against saved_tensors_hooks for qwen3-moe-tiny (tests/test_memory.py), single and ep-ft's
   block; not counted: each grouped product's int32 offsets (4 E bytes per layer, not per token). ep's rows are
   those this rank receives: k per token when the load is even; the busiest rank receives more, by the imbalance
   factor that summary.json's expert_load reports, and its expert terms grow by as much.
   - Buffers (ep): the dispatch, inside one layer's expert block: the sorted rows, the received rows and their
     copy regrouped by expert, in r bytes, 3 r k d per token, counted once (one block runs at a time; backward's
     all-to-alls move gradients of the same size).

"""

from __future__ import annotations

from dataclasses import dataclass

from common.memory.activations import TENSOR_PARALLEL_TERMS, layer_activation_terms, loss_bytes, \
    outside_layers_bytes_per_token
from common.memory.states import DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS, DEEPSPEED_REDUCE_BUCKET_ELEMENTS, \
    DEEPSPEED_STRATEGIES, ERROR_BAND, ERROR_BAND_FLOOR, FP32_BYTES, FSDP_STRATEGIES, GIB, MASTER_BF16, \
    MESH_STRATEGIES, MOE_STRATEGIES, OFFLOADED_STATES, PEAK_TESTED_FROM_GIB, PROJECT_BF16, QLORA, \
    QLORA_STRATEGIES, STRATEGIES, UNIT_SHARDED, USABLE_FRACTION, ZERO3_STRATEGIES, BytesPerParam, ModelShape, \
    largest_trainable_parameter, model_shape, model_state_bytes, resolve_precision, strategy_precision, \
    zero3_gathered_elements, zero3_persistent_parameters

# Where the gradients exist from the first backward to the optimizer step, whatever the micro-batch count (the
# module docstring, "The peak").
GRADIENTS_ALWAYS_HELD = ("ddp", "pp", *DEEPSPEED_STRATEGIES)


# ---------------------------------------------------------------------------------------------------------------
# One device's share of the model under a strategy
@dataclass(frozen=True)
class DeviceSlice:
    layers: int  # decoder layers this device runs
    layer_trainable: float  # per layer on this device: parameters with gradients (all of them, or the adapters)
    layer_frozen: float  # per layer: parameters without (the base weights and norms under LoRA)
    layer_quantized: float  # per layer: frozen weights held in 4 bits (QLoRA's linear weights; then not in frozen)
    layer_matmul_trainable: float  # per layer: trainable weights the matrix multiplies read (autocast caches them)
    layer_matmul_frozen: float  # per layer: frozen weights the matrix multiplies read (LoRA's base)
    root_trainable: float  # outside the layers (embedding, final norm, LM head), with gradients
    root_frozen: float
    root_matmul: float  # the LM head matrix, where this device computes the logits
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    micro_batches_in_flight: int = 1  # pipeline stages keep several micro-batches of activations
    computes_logits: bool = True
    vocab_share: float = 1.0  # the share of the logits' vocabulary this device computes (tensor parallel: 1/t)
    label: str = ""
    layer_experts_cast: float = 0.0  # per layer: expert weights cast to the compute dtype outside autocast (ep-ft)

    @property
    def trainable(self) -> float:
        return self.layers * self.layer_trainable + self.root_trainable

    @property
    def frozen(self) -> float:
        return self.layers * self.layer_frozen + self.root_frozen

    @property
    def quantized(self) -> float:
        return self.layers * self.layer_quantized


def device_slices(shape: ModelShape, strategy: str, world_size: int, lora_rank: int,
                  tensor_parallel: int = 1, qlora: bool = False) -> list[DeviceSlice]:
    """What one device holds and runs (before data-parallel sharding); one slice per stage for pp. fsdp-tp: tp's
    slice over `tensor_parallel` ranks (model_state_bytes then shards it over the world / t data-parallel ranks).
    `qlora`: the layers' linear weights are 4-bit (LoRA on top)."""
    layer_norms = shape.layer_norm_parameters
    layer_linears = shape.layer_parameters - layer_norms
    adapters = shape.lora_parameters(lora_rank) / shape.layers
    lm_head = shape.embedding_parameters  # the LM head matrix, tied or not

    def piece(layers: int, root: float, root_matmul: float, linear_share: float = 1.0,
              layer_adapters: float = adapters, **kwargs) -> DeviceSlice:
        linears = layer_linears * linear_share
        if lora_rank:
            quantized = linears if qlora else 0.0
            return DeviceSlice(layers, layer_adapters, linears - quantized + layer_norms, quantized, layer_adapters,
                               linears, 0.0, root, root_matmul, **kwargs)
        return DeviceSlice(layers, linears + layer_norms, 0.0, 0.0, linears, 0.0, root, 0.0, root_matmul, **kwargs)

    if shape.is_moe:
        # single: the whole model; ep: the dense part whole and E / W experts of every layer (section 3). Under
        # autocast (ep-ft's earlier bf16 runs) the attention projections, routers and LM head were cast, and ep-ft
        # cast its experts itself.
        experts = shape.layer_expert_parameters / (world_size if strategy == "ep" else 1)
        dense = shape.layer_parameters - shape.layer_expert_parameters
        return [DeviceSlice(shape.layers, dense + experts, 0.0, 0.0, dense - layer_norms, 0.0, shape.root_parameters,
                            0.0, lm_head, layer_experts_cast=experts if strategy == "ep" else 0.0)]
    if strategy in ("tp", "tp-sp", "fsdp-tp"):
        t = tensor_parallel if strategy == "fsdp-tp" else world_size
        if shape.heads % t or shape.kv_heads % t:
            raise ValueError(f"tensor parallelism over {t} needs the {shape.heads} heads and "
                             f"{shape.kv_heads} KV heads to divide by {t}")
        # tp-ft's plan (fsdp-tp-ft's too): every projection of a layer is split (and half of each LoRA adapter:
        # ModelShape.lora_parameters), the embedding and the LM head are split over the vocabulary (V/t rows each;
        # one tensor when tied), the norms are replicated; loss parallel keeps each rank's V/t columns of the logits.
        replicated_norms = shape.root_parameters - shape.embedding_parameters * (1 if shape.tied_embeddings else 2)
        root = (shape.root_parameters - replicated_norms) / t + replicated_norms
        return [piece(shape.layers, root, lm_head / t, linear_share=1 / t,
                      layer_adapters=shape.lora_parameters(lora_rank, t) / shape.layers,
                      tensor_parallel=t, sequence_parallel=strategy == "tp-sp", vocab_share=1 / t)]
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
    logits_bytes: float  # the loss's buffers: logits and the cross-entropy's fp32 tensors (one chunk's if chunked)
    buffers_bytes: float  # communication buckets, gathered FSDP/ZeRO-3 parameters, unsharded gradients
    cpu_bytes: float = 0.0  # host memory of this rank: offloaded model states and the offload's staging buffers
    cpu_buffers_bytes: float = 0.0  # of which staging buffers (DeepSpeed's offload)
    note: str = ""  # e.g. which pipeline stage is the largest
    grads_held_bytes: float = 0.0  # of grads_bytes, what already exists at the start of backward
    step_buffers_bytes: float = 0.0  # of buffers_bytes, what is still held at the optimizer step
    qlora: bool = False
    micro_batch_size: int = 1
    seq_len: int = 1024
    loss_chunk_tokens: int = 0
    compiled: bool = False
    released_at_step_bytes: float = 0.0  # of weights_bytes, what is freed for the optimizer step (single's bf16)

    @property
    def model_states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.master_bytes

    def state_bytes(self) -> dict[str, int]:
        """The model states by kind, in the shape the experiments write `state_bytes_per_rank` (common.metrics)."""
        return dict(weights=int(self.weights_bytes), grads=int(self.grads_bytes),
                    optimizer=int(self.optimizer_bytes), master=int(self.master_bytes))

    @property
    def forward_bytes(self) -> float:
        """At the start of backward: every activation and the loss's buffers, beside the gradients held then."""
        return (self.weights_bytes + self.optimizer_bytes + self.master_bytes + self.grads_held_bytes
                + self.compute_copy_bytes + self.activations_bytes + self.logits_bytes + self.buffers_bytes)

    @property
    def step_bytes(self) -> float:
        """At the optimizer step: every model state (but weights freed for it), and the buffers that outlive
        backward."""
        return self.model_states_bytes - self.released_at_step_bytes + self.step_buffers_bytes

    @property
    def peak_phase(self) -> str:
        return "backward start" if self.forward_bytes >= self.step_bytes else "optimizer step"

    @property
    def total_bytes(self) -> float:
        return max(self.forward_bytes, self.step_bytes)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def needed_gib(self) -> float:
        """The peak with room for the model's own error (ERROR_BAND of it): what must be within a GPU's usable memory.
        Computed as the site's calculator computes it (peak x (1 + band)), so both draw the line at the same GiB."""
        return self.total_gib * (1 + ERROR_BAND)

    @property
    def margin_gib(self) -> float:
        return self.needed_gib - self.total_gib

    def fits(self, gpu_mem_gib: float) -> bool:
        return self.needed_gib <= gpu_mem_gib * USABLE_FRACTION


def estimate(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024, micro_batch_size: int = 1,
             activation_checkpointing: bool = False, lora_rank: int = 0, precision: BytesPerParam | str = "bf16",
             attention: str = "sdpa-packed", grad_accum: int = 1, tensor_parallel: int = 2,
             loss_chunk_tokens: int = 0, compile: bool = False, qlora: bool = False,
             reshard_after_forward: bool = True, lora_fused: bool = False) -> MemoryEstimate:
    """Peak memory of one device (for pp: of the fullest stage), broken down as in the module docstring.
    `precision`: the experiments' --dtype ("bf16", "fp32"), priced as each strategy's experiment keeps it
    (strategy_precision), or one BytesPerParam for every strategy. `grad_accum`: micro-batches per optimizer step
    (their gradients accumulate: held at every backward after the first; fsdp keeps them unsharded, section 1).
    `tensor_parallel`: fsdp-tp's t (fsdp-tp-ft's --tp-degree) among the `world_size` ranks; ignored otherwise.
    `loss_chunk_tokens`, `compile`: the experiments' --loss-chunk-tokens and --compile. `qlora`: --qlora (4-bit
    base, LoRA of rank `lora_rank` on top, bf16 compute: single and ddp). `reshard_after_forward`: fsdp-ft's flag
    (False also for its gather-once setting): every layer stays gathered from its forward to its backward.
    `lora_fused`: --lora-fused (common/lora.py), which keeps fewer casts of the layers' inputs."""
    stages = estimate_stages(config_like, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                             activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
                             precision=precision, attention=attention, grad_accum=grad_accum,
                             tensor_parallel=tensor_parallel, loss_chunk_tokens=loss_chunk_tokens, compile=compile,
                             qlora=qlora, reshard_after_forward=reshard_after_forward, lora_fused=lora_fused)
    return max(stages, key=lambda stage: stage.total_bytes)


def estimate_stages(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024,
                    micro_batch_size: int = 1, activation_checkpointing: bool = False, lora_rank: int = 0,
                    precision: BytesPerParam | str = "bf16", attention: str = "sdpa-packed",
                    grad_accum: int = 1, tensor_parallel: int = 2, loss_chunk_tokens: int = 0,
                    compile: bool = False, qlora: bool = False,
                    reshard_after_forward: bool = True, lora_fused: bool = False) -> list[MemoryEstimate]:
    """The estimate of every distinct device: one per pipeline stage for pp (stage k on rank k), else one for all."""
    if strategy not in STRATEGIES + MESH_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES + MESH_STRATEGIES)}")
    if strategy == "fsdp-tp" and (tensor_parallel < 1 or world_size % tensor_parallel):
        raise ValueError(f"fsdp-tp: the tensor-parallel degree {tensor_parallel} must divide the world size "
                         f"{world_size}")
    if strategy == "single" and world_size != 1:
        raise ValueError("single runs on one device")
    if grad_accum < 1 or micro_batch_size < 1 or seq_len < 1 or loss_chunk_tokens < 0:
        raise ValueError(f"grad_accum, micro_batch_size and seq_len must be >= 1 and loss_chunk_tokens >= 0, got "
                         f"{grad_accum}, {micro_batch_size}, {seq_len}, {loss_chunk_tokens}")
    shape = model_shape(config_like)
    if shape.is_moe and strategy not in MOE_STRATEGIES:
        raise ValueError(f"{shape.name} is a mixture of experts ({shape.experts} experts): single or ep "
                         f"(experiments/single-ft, experiments/ep-ft); {strategy}'s experiment trains dense models")
    if strategy == "ep" and not shape.is_moe:
        raise ValueError(f"ep splits the experts of a mixture of experts; {shape.name} is dense")
    if strategy == "ep" and shape.experts % world_size:
        raise ValueError(f"ep: {shape.experts} experts do not split evenly over {world_size} ranks")
    if shape.is_moe and lora_rank:
        shape.lora_parameters(lora_rank)  # raises: LoRA on a mixture of experts is not priced
    if qlora:
        if strategy not in QLORA_STRATEGIES:
            raise ValueError(f"QLoRA runs in {' and '.join(QLORA_STRATEGIES)} (single-ft, ddp-ft --qlora), not "
                             f"{strategy}")
        if precision in ("fp32", "--dtype fp32") or lora_rank < 1:
            raise ValueError("QLoRA computes in bf16 with LoRA adapters on its 4-bit base: --dtype bf16 and a "
                             "--lora-rank (16 by default in the experiments)")
        precision = QLORA
    precision = resolve_precision(strategy, precision)
    return [_estimate_slice(shape, piece, strategy, world_size, micro_batch_size, seq_len, activation_checkpointing,
                            lora_rank, precision, attention, grad_accum, loss_chunk_tokens, compile, qlora,
                            reshard_after_forward, lora_fused)
            for piece in device_slices(shape, strategy, world_size, lora_rank, tensor_parallel, qlora)]


def estimate_stages_per_rank(config_like, stage_rank: list[int], *, seq_len: int, micro_batch_size: int,
                             lora_rank: int = 0, dtype: str = "bf16", replicas: int = 1,
                             master_weights: bool = True) -> list[dict]:
    """pp-ft's model-state bytes of every rank: the sum of its stages' estimates (weights, gradients, AdamW's moments,
    master copy), in global rank order (stage s on rank stage_rank[s]; each replica's ranks hold the same), in
    common.metrics.state_bytes' keys.

    estimate_stages splits the layers as pp-ft's even split does (the remainder to the first stages) and gives the
    last stage its own copy of the tied LM head, as pp-ft's stages do, so the sum holds for every placement (loop or
    V). Two known differences from the measured bytes: AdamW also keeps a 4-byte fp32 step counter per trainable
    tensor (optimizer), and a one-stage pipeline holds an LM head copy that the model, seeing the first and the last
    stage on one device, does not count. A --split layout is not modelled (predict_state_bytes gives None).
    `master_weights` False: a bf16 run from before pp-ft's fp32 masters, fp32 weights under autocast (PROJECT_BF16)."""
    precision = PROJECT_BF16 if dtype == "bf16" and not master_weights else strategy_precision("pp", dtype)
    estimates = estimate_stages(config_like, "pp", len(stage_rank), seq_len=seq_len, micro_batch_size=micro_batch_size,
                                lora_rank=lora_rank, precision=precision)
    per_rank = [dict(weights=0, grads=0, optimizer=0, master=0) for _ in range(max(stage_rank) + 1)]
    for estimate_, rank in zip(estimates, stage_rank):
        for key, value in estimate_.state_bytes().items():
            per_rank[rank][key] += value
    return per_rank * replicas  # global rank = replica x pipeline ranks + rank in the pipeline


def uses_autocast(strategy: str, precision: BytesPerParam) -> bool:
    """Autocast runs wherever the kept weights are wider than the compute dtype, except under FSDP/ZeRO-3, whose
    mixed-precision policy hands each layer its weights already in the compute dtype. (DeepSpeed's bf16 mode keeps
    the module itself in bf16: weights as wide as the compute dtype, no autocast.)"""
    return precision.weights > precision.compute and strategy not in UNIT_SHARDED


def uses_bf16_optimizer(strategy: str, precision: BytesPerParam) -> bool:
    """DeepSpeed runs ZeRO-1 with low-precision weights and wider gradient accumulation (zero-ft --zero-stage 1
    --dtype bf16) through its BF16_Optimizer, not the ZeRO stage 1-2 optimizer (engine._do_optimizer_sanity_check)."""
    return strategy == "zero-1" and precision.weights < precision.grads


def _estimate_slice(shape: ModelShape, piece: DeviceSlice, strategy: str, world_size: int, micro_batch_size: int,
                    seq_len: int, activation_checkpointing: bool, lora_rank: int, precision: BytesPerParam,
                    attention: str, grad_accum: int, loss_chunk_tokens: int, compiled: bool,
                    qlora: bool, reshard_after_forward: bool = True, lora_fused: bool = False) -> MemoryEstimate:
    # fsdp-tp: FSDP shards the tensor-parallel slice over the data-parallel ranks only, world / t of them.
    data_parallel = world_size // piece.tensor_parallel if strategy == "fsdp-tp" else world_size
    states = model_state_bytes(piece.trainable, piece.frozen, precision, strategy, data_parallel, piece.quantized)
    c, tokens = precision.compute, micro_batch_size * seq_len
    autocast = uses_autocast(strategy, precision)
    # The residual stream is the embedding's dtype under autocast (a frozen one under LoRA), else the compute dtype.
    residual = (precision.frozen if lora_rank else precision.weights) if autocast else c

    compute_copy = 0.0
    if autocast:
        # Autocast caches the cast of each trainable weight until the forward ends, checkpointing or not. A frozen
        # weight wider than the compute dtype (LoRA on an fp32 base) is cast again at each use and kept only by the
        # autograd graph, which checkpointing drops after each layer: one layer's copies (during its recomputation)
        # remain. A frozen bf16 base, and QLoRA's 4-bit weights (bitsandbytes dequantizes one at a time, section
        # 1), leave nothing to cast.
        frozen_cast = precision.frozen > c and not qlora
        frozen_layers = 1 if activation_checkpointing else piece.layers
        trainable_head = piece.root_trainable > 0
        compute_copy = (piece.layers * piece.layer_matmul_trainable
                        + (frozen_layers * piece.layer_matmul_frozen if frozen_cast else 0)) * c
        if trainable_head or precision.frozen > c:
            compute_copy += piece.root_matmul * c
        # ep-ft's own casts of its experts, kept by the grouped products until the layer's backward: with
        # checkpointing only the recomputed layer's.
        compute_copy += (min(1, piece.layers) if activation_checkpointing else piece.layers) \
            * piece.layer_experts_cast * c

    terms = layer_activation_terms(shape, compute_bytes=c, autocast=autocast, seq_len=seq_len, attention=attention,
                                   lora_rank=lora_rank, expert_parallel=strategy == "ep",
                                   weight_bytes=precision.weights, residual_bytes=residual,
                                   projection_bytes=FP32_BYTES if qlora else c, compiled=compiled,
                                   lora_fused=lora_fused)
    tp = piece.tensor_parallel
    layer_per_token = sum(value / tp if name in TENSOR_PARALLEL_TERMS or (piece.sequence_parallel and name != "mask")
                          else value for name, value in terms.items())
    in_flight_layers = piece.micro_batches_in_flight * piece.layers
    if activation_checkpointing:
        checkpoint_per_token = residual * shape.hidden / (tp if piece.sequence_parallel else 1)
        per_token = in_flight_layers * checkpoint_per_token + layer_per_token  # + the layer being recomputed
    else:
        per_token = in_flight_layers * layer_per_token
    logits = 0.0
    if piece.computes_logits:
        per_token += outside_layers_bytes_per_token(shape, compute_bytes=c, autocast=autocast, lora_rank=lora_rank,
                                                    residual_bytes=residual, chunked_loss=loss_chunk_tokens > 0)
        logits = loss_bytes(shape, tokens, compute_bytes=c, vocab_share=piece.vocab_share,
                            loss_chunk_tokens=loss_chunk_tokens, residual_bytes=residual,
                            trainable_head=piece.root_trainable > 0)

    buffers = step_buffers = cpu_buffers = 0.0
    if qlora:
        # bitsandbytes dequantizes each 4-bit weight into a compute-dtype copy just before its product (forward and
        # backward) and frees it after: one linear at a time, the largest an MLP projection.
        buffers += max(shape.hidden * shape.intermediate, shape.heads * shape.head_dim * shape.hidden) * c
    if strategy == "ep":
        # The dispatch inside one expert block: sorted rows, received rows, their copy regrouped by expert.
        buffers += tokens * 3 * (FP32_BYTES if autocast else c) * shape.experts_per_token * shape.hidden
    # ddp: gradient_as_bucket_view=True makes the gradients views into the all-reduce buckets: no second copy. With
    # bf16 weights and fp32 masters (common/precision.py) the buckets are bf16, beside the masters' fp32 gradients,
    # and are freed with the weights for the optimizer step.
    bf16_buckets = piece.trainable * c if strategy == "ddp" and precision.name == MASTER_BF16.name else 0.0
    states["grads"] += bf16_buckets
    if uses_bf16_optimizer(strategy, precision):
        # BF16_Optimizer keeps the bf16 gradients autograd writes in the module beside its own fp32 ones
        # (immediate_grad_update is off by default), and all-reduces the fp32 gradients of each param group in
        # place, unless groups small enough to share one all-reduce bucket are flattened into a copy first.
        states["grads"] += piece.trainable * c
        matrices = piece.trainable - (piece.layers * shape.layer_norm_parameters + shape.hidden
                                      if not lora_rank else 0)  # decay group; the norms are the other one
        if matrices < piece.trainable and matrices <= DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS:
            step_buffers += piece.trainable * precision.grads
    elif strategy in DEEPSPEED_STRATEGIES:
        # The reduce bucket, allocated at its full reduce_bucket_size whatever the trainable count (in the module's
        # dtype for stages 1-2, in the fp32 communication dtype for stage 3), plus the fp32 tensor that the
        # collective reduces, flattened from one full bucket.
        bucket_bytes = FP32_BYTES if strategy in ZERO3_STRATEGIES else precision.weights
        step_buffers += DEEPSPEED_REDUCE_BUCKET_ELEMENTS * bucket_bytes \
            + min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, piece.trainable) * FP32_BYTES
        if strategy != "zero-1":
            # Stages 2-3 reduce each gradient as autograd writes it (in the compute dtype), one parameter at a time;
            # a tied embedding's gradient waits for both uses, so the largest one is alive for the whole backward.
            buffers += largest_trainable_parameter(shape, lora_rank) * c
        if strategy == "zero-2-offload":
            # A GPU staging buffer and a host one, each as large as the largest parameter, for the gradient copies;
            # a host copy of this rank's partition in the weights' dtype, for the updated weights on their way back.
            step_buffers += largest_trainable_parameter(shape, lora_rank) * precision.weights
            cpu_buffers = (largest_trainable_parameter(shape, lora_rank) + piece.trainable / world_size) \
                * precision.weights
    if strategy in ZERO3_STRATEGIES and world_size > 1:  # one rank's "gather" is a view of its partition
        # Released by the coordinator as the step goes (kept whole when the model is smaller than its windows).
        buffers += zero3_gathered_elements(shape, lora_rank, activation_checkpointing) * precision.weights
        # Persistent parameters (too small to be worth releasing) stay gathered, whole, beside their partition.
        states["weights"] += zero3_persistent_parameters(shape, lora_rank) * precision.weights
    elif strategy in FSDP_STRATEGIES:
        layer = piece.layer_trainable + piece.layer_frozen
        # Resharded after forward, a layer is gathered while it runs and the next is prefetched; not resharded
        # (--no-reshard-after-forward, and the gather-once setting), every layer stays gathered until its backward.
        gathered_layers = min(2, piece.layers) if reshard_after_forward else piece.layers
        gathered_weights = (piece.root_trainable + piece.root_frozen + gathered_layers * layer) * c
        # Each unit's gradients arrive in the compute dtype and are copied into a reduce-scatter input in the fp32
        # reduce dtype. The root's reduce-scatter waits for the embedding's gradient at the end of backward, so
        # its gradient (the LM head's part arrives first) is alive beside each layer's.
        reduce_scatter = c + FP32_BYTES
        if grad_accum > 1:
            # fsdp-ft reduce-scatters only in the last micro-batch: before it, every unit keeps its unsharded
            # gradients, upcast to the fp32 reduce dtype to accumulate across backwards.
            unsharded_grads = piece.trainable * FP32_BYTES + piece.layer_trainable * reduce_scatter
        else:
            unsharded_grads = max(piece.root_trainable * c + piece.layer_trainable * reduce_scatter,
                                  piece.root_trainable * reduce_scatter)
        buffers += gathered_weights + unsharded_grads

    cpu = 0.0
    if strategy in OFFLOADED_STATES:
        for state in OFFLOADED_STATES[strategy]:
            cpu += states[state]
            states[state] = 0.0
    held = grad_accum > 1 and strategy not in FSDP_STRATEGIES or strategy in GRADIENTS_ALWAYS_HELD and not bf16_buckets
    return MemoryEstimate(
        strategy=strategy, world_size=world_size, precision=precision,
        activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
        weights_bytes=states["weights"], grads_bytes=states["grads"],
        optimizer_bytes=states["optimizer"], master_bytes=states["master"], compute_copy_bytes=compute_copy,
        activations_bytes=tokens * per_token, logits_bytes=logits, buffers_bytes=buffers + step_buffers,
        cpu_bytes=cpu + cpu_buffers, cpu_buffers_bytes=cpu_buffers, note=piece.label,
        grads_held_bytes=states["grads"] if held else bf16_buckets, step_buffers_bytes=step_buffers, qlora=qlora,
        micro_batch_size=micro_batch_size, seq_len=seq_len, loss_chunk_tokens=loss_chunk_tokens, compiled=compiled,
        # bf16 weights (and ddp's buckets) are freed before the step and rebuilt after it (common/precision.py)
        released_at_step_bytes=piece.trainable * precision.weights + bf16_buckets
        if precision.name == MASTER_BF16.name else 0.0)


# The strategy each experiment runs, as its summary.json names it (zero-ft's and fsdp-ft's flags refine it).
EXPERIMENT_STRATEGY = {"single-ft": "single", "ddp-ft": "ddp", "fsdp-ft": "fsdp", "zero-ft": "zero", "tp-ft": "tp",
                       "tp-sp-ft": "tp-sp", "pp-ft": "pp", "pp-ds-ft": "pp", "fsdp-tp-ft": "fsdp-tp", "ep-ft": "ep"}


def run_model(summary: dict) -> str:
    """The model a recorded run trained, as model_config takes it. A model folder that only existed on the machine
    the run ran on (the peer baseline saves a preset) is the preset with the run's parameter count."""
    from pathlib import Path

    from common.models import MOE_PRESETS, PRESETS, count_parameters, is_preset, model_config

    model = summary["config"]["model"]
    if not is_preset(model) and not Path(model).exists() and "/" in model.strip("/") and model.startswith(("/", ".")):
        same = [name for name in (*PRESETS, *MOE_PRESETS)
                if count_parameters(model_config(name))["total"] == summary["model"]["parameters"]]
        if len(same) != 1:
            raise ValueError(f"{model} is not on this machine, and no one preset has its "
                             f"{summary['model']['parameters']:,} parameters")
        model = same[0]
    return model


def predict_run(summary: dict) -> MemoryEstimate:
    """This model's prediction for the settings a recorded run had (its summary.json: experiment, model, batch
    layout, attention, the chunked loss, compile, LoRA, QLoRA, the weights' layout), so that a run measured with an
    earlier prediction is held to the current one. A LoRA run's frozen bytes per weight are read off its own state
    bytes: runs made before the experiments loaded a LoRA base in bf16 held it in fp32. A model folder that only
    existed on the machine the run ran on (the peer baseline saves a preset) is priced as the preset with the run's
    parameter count (run_model)."""
    from dataclasses import replace

    from common.memory.activations import attention_kind
    from common.memory.states import DEEPSPEED_BF16, strategy_precision
    from common.models import is_moe, model_config

    from common.memory.states import STRATEGIES

    config, experiment = summary["config"], summary["experiment"]
    if experiment not in EXPERIMENT_STRATEGY:
        raise ValueError(f"{experiment} is not one of this repository's experiments: nothing to predict")
    if config.get("lora_rank") and is_moe(model_config(run_model(summary))):
        raise ValueError("no price for LoRA on a mixture of experts (peft also wraps the experts' 3-D weights)")
    strategy = EXPERIMENT_STRATEGY[experiment]
    if strategy == "zero":
        strategy = f"zero-{config['zero_stage']}" + ("-offload" if config.get("cpu_offload") else "")
        if strategy not in STRATEGIES:  # an offload this model lacks: priced without it (the states on the device)
            strategy = f"zero-{config['zero_stage']}"
    elif strategy == "fsdp" and config.get("cpu_offload"):
        strategy = "fsdp-offload"
    world = summary["hardware"]["world_size"]
    if experiment in ("pp-ft", "pp-ds-ft"):
        world = config.get("stages") or world
    elif experiment == "fsdp-ft":  # HSDP: a rank holds what FSDP over its shard group of world / R ranks would
        world //= config.get("replicate_degree") or 1
    precision = DEEPSPEED_BF16 if experiment == "pp-ds-ft" and config["dtype"] == "bf16" else \
        strategy_precision(strategy, config["dtype"])
    if precision is MASTER_BF16 and not summary.get("master_weights"):
        precision = PROJECT_BF16  # a run from before common/precision.py: fp32 weights under autocast
    if config.get("lora_rank") and not config.get("qlora") and summary.get("state_bytes_per_rank"):
        held = summary["state_bytes_per_rank"][0]["weights"]
        adapters = summary["model"]["trainable_parameters"]
        frozen = (held - precision.weights * adapters) / summary["model"]["parameters"]
        if strategy not in UNIT_SHARDED + ("tp", "tp-sp", "pp"):  # whole on each rank: the bytes tell the dtype
            precision = replace(precision, frozen=round(frozen))
    grad_accum = 1 if config.get("reduce_every_micro_batch") else config["grad_accum"]
    return estimate(run_model(summary), strategy, world, seq_len=config["seq_len"],
                    micro_batch_size=config["micro_batch_size"], grad_accum=grad_accum,
                    activation_checkpointing=config["activation_checkpointing"], lora_rank=config.get("lora_rank", 0),
                    precision=precision, attention=attention_kind(summary["attention"], config.get("packing", True)),
                    loss_chunk_tokens=config.get("loss_chunk_tokens") or 0, compile=config.get("compile", False),
                    qlora=config.get("qlora", False),
                    tensor_parallel=summary.get("tensor_parallel") or config.get("tp_degree") or 2,
                    reshard_after_forward=config.get("reshard_after_forward", True),
                    lora_fused=config.get("lora_fused", False))


def predict_state_bytes(summary: dict) -> list[dict] | None:
    """The model-state bytes (weights, grads, optimizer, master) this model predicts for every rank of a recorded
    run, in global rank order, beside its measured `state_bytes_per_rank`: predict_run's device for every rank, or
    pp-ft's sum over each rank's stages (estimate_stages_per_rank). None where the model does not price the run:
    pp-ft's --split layouts, pp-ds-ft's stages (DeepSpeed's own partition); predict_run's ValueError where it prices
    nothing."""
    from common.models import model_config

    config, world = summary["config"], summary["hardware"]["world_size"]
    if summary["experiment"] == "pp-ds-ft":
        return None
    if summary["experiment"] == "pp-ft":
        if config.get("split"):
            return None
        pipeline = summary["pipeline"]
        return estimate_stages_per_rank(model_config(run_model(summary)), pipeline["stage_rank"],
                                        seq_len=config["seq_len"], micro_batch_size=config["micro_batch_size"],
                                        lora_rank=config.get("lora_rank", 0), dtype=config["dtype"],
                                        replicas=pipeline.get("replicas", 1),
                                        master_weights=bool(summary.get("master_weights")))
    return [predict_run(summary).state_bytes()] * world


@dataclass(frozen=True)
class PeakCheck:
    """One committed GPU run against this model: what it reserved, what predict_run says now, and what the run
    itself wrote at its start (predicted_peak_mem_gib: a prediction made before the run, by the model of that day)."""
    run: str  # the run's folder, relative to devlog/data
    predicted_gib: float
    measured_gib: float  # torch.cuda.max_memory_reserved()
    predicted_at_start_gib: float | None

    @property
    def under(self) -> float:
        """How much the run needed beyond the prediction, as a share of it (negative: over-predicted)."""
        return self.measured_gib / self.predicted_gib - 1

    @property
    def under_at_start(self) -> float | None:
        return None if self.predicted_at_start_gib is None else self.measured_gib / self.predicted_at_start_gib - 1


def gpu_peak_checks(data_dir) -> list[PeakCheck]:
    """Every run under `data_dir` (devlog/data) that ran on a GPU (device_kind cuda or rocm), is one of this
    repository's experiments and measured PEAK_TESTED_FROM_GIB or more: the runs that test the model."""
    import json
    from pathlib import Path

    checks = []
    for path in sorted(Path(data_dir).rglob("summary.json")):
        summary = json.loads(path.read_text())
        if summary["hardware"]["device_kind"] not in ("cuda", "rocm") or summary["experiment"] not in \
                EXPERIMENT_STRATEGY or summary["peak_mem_gib"] < PEAK_TESTED_FROM_GIB:
            continue
        checks.append(PeakCheck(path.parent.relative_to(data_dir).as_posix(), predict_run(summary).total_gib,
                                summary["peak_mem_gib"], summary.get("predicted_peak_mem_gib")))
    return checks


def error_band(checks: list[PeakCheck]) -> float:
    """The band ERROR_BAND stores: the largest under-prediction of `checks`, rounded up to a whole percent, never
    below ERROR_BAND_FLOOR."""
    import math

    worst = max((check.under for check in checks), default=0.0)
    return max(ERROR_BAND_FLOOR, math.ceil(round(worst * 100, 9)) / 100)

