"""fsdp-tp-ft: fine-tune a Qwen3 decoder with FSDP2 x tensor parallelism on a 2-D device mesh ("dp", "tp").

    uv run torchrun --nproc_per_node=4 experiments/fsdp-tp-ft/train.py --tp-degree 2   # CPU (gloo): 2 x 2, qwen3-tiny
    uv run torchrun --nproc_per_node=8 experiments/fsdp-tp-ft/train.py --model Qwen/Qwen3-4B-Base --tp-degree 2 \\
        --activation-checkpointing
    uv run torchrun --nproc_per_node=4 experiments/fsdp-tp-ft/train.py --lora-rank 16 --save-hf runs/lora --merge-lora
    uv run torchrun --nproc_per_node=4 experiments/fsdp-tp-ft/train.py --steps 3 --seq-len 128   # CPU smoke run (gloo)
    uv run torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 --rdzv-id=job1 \\
        experiments/fsdp-tp-ft/train.py --tp-degree 8

The layout torchtitan uses for large models. The W ranks form a mesh of dp = W / tp rows and tp columns, and the tp
ranks of one row are consecutive (one node's GPUs under torchrun). Tensor parallelism runs inside a row: tp-ft's
Megatron-LM plan (apply_tp below), q, k, v, gate and up split by output columns, o and down by input rows, the tied
embedding / LM head by vocabulary, two all-reduces of [tokens x hidden] per layer in forward and two in backward.
FSDP2 runs along each column: `fully_shard` over the "dp" dimension of the mesh, on top of the tensor-parallel
modules, shards every rank's TP slice once more over the dp ranks that hold the same slice. Each decoder layer is
one FSDP unit, all-gathered (over dp only) just before it runs and reduce-scattered (over dp only) in backward.
A rank holds 1/(dp x tp) of every split weight, of its gradient and of its AdamW state, and 1/dp of the norms.

Why both (the README says more): TP's per-layer all-reduces stay on a node's fast links, FSDP's all-gathers and
reduce-scatters cross nodes once per layer on tp times fewer bytes each, and the batch is split over the dp rows.

The data is split over the dp coordinate of the mesh, never over the global rank: all tp ranks of one row read the
same rows, so one optimizer step consumes B = micro_batch_size x grad_accum x dp rows and is the same step as
single-ft's on that B (the token-weighted loss over all B rows; tests/test_ddp_fsdp.py holds it to single-ft).
Strategy flags: --tp-degree (default 2), --loss-parallel / --no-loss-parallel, --reshard-after-forward /
--no-reshard-after-forward, --sync-qk-norm-grads / --no-sync-qk-norm-grads.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.cli import InputError, parse_config, plan_run, resolve_paths, run, stop_early

stop_early(__name__, __file__)  # --help and a flag mistake answer now, before torch and transformers load
import torch  # noqa: E402
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, loss_parallel, \
    parallelize_module
from transformers import AutoModelForCausalLM

from common.attention import setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.metrics import MetricsLogger, Recorder, local_tensor
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_tokenizer, model_config, record_adapter_base, refuse_moe, resolve_model_name, \
    weights_dtype
from common.step import lr_factor
from common.tp import FullLogits, on_tp_mesh, replica_drift

EXPERIMENT = "fsdp-tp-ft"
SCRIPT_DIR = Path(__file__).resolve().parent  # a copy of this script runs from any folder (README)


@dataclass
class Config:
    model: str = "auto"  # preset (README), hub id or folder; auto: Qwen/Qwen3-0.6B-Base on GPU, qwen3-tiny on CPU
    data: str = "assets/data/sft_en.jsonl"  # JSONL/JSON/parquet/CSV/arrow file or folder, save_to_disk folder or hub id
    data_split: str = "train"  # with a hub id or a saved DatasetDict: the split to train on
    data_config: str | None = None  # with a hub id: the dataset's configuration (subset)
    data_columns: str | None = None  # your column names for the expected ones, e.g. prompt=question,completion=answer
    train_empty_think: bool = False  # also train the empty <think></think> block Qwen3 puts before a plain answer
    show_sample: bool = False  # before training, print the first conversation with the text that carries loss marked
    seq_len: int | None = None  # tokens per packed row; default 256 for qwen3-tiny, 1024 otherwise
    micro_batch_size: int = 1  # rows per forward pass, per data-parallel row of the mesh (its tp ranks share them)
    grad_accum: int = 1  # micro-batches per optimizer step, per data-parallel row of the mesh
    steps: int = 300  # optimizer steps (0 = only evaluate / export); 300: a minute or two of qwen3-tiny on 2 CPU cores
    epochs: float | None = None  # instead of --steps: passes over the training rows (e.g. 2, 0.5), rounded up to steps
    lr: float | None = None  # peak learning rate; default 1e-3 for presets, 2e-5 for pretrained models (1e-4 with LoRA)
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on norms)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    seed: int = 0  # one seed for init, data order and held-out split
    dtype: Literal["bf16", "fp32"] | None = None  # bf16: bf16 compute, fp32 master weights (GPU default); fp32 (CPU)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of storing activations
    packing: bool = True  # pack conversations into rows (--no-packing: one padded conversation per row)
    lora_rank: int = 0  # 0 = full-parameter SFT; N = LoRA of rank N on every linear projection of the decoder layers
    lora_alpha: float | None = None  # LoRA scaling numerator; default 2 x rank
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen", "flex"] = "auto"  # attention kernel (common/attention.py)
    compile: bool = False  # not available here: refused at start (tp-ft's plan does not compile; the README says why)
    loss_chunk_tokens: int = 0  # not built here: 0 only (loss parallelism already splits the logits, as in tp-ft)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/fsdp-tp-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    # The 2-D mesh
    tp_degree: int = 2  # tensor-parallel ranks per data-parallel row (the mesh's "tp" size; keep it within one node);
        # the rest, world / tp, is the FSDP dimension "dp"
    loss_parallel: bool = True  # keep the logits split over the vocabulary and compute the cross-entropy on the shards
        # (--no-loss-parallel: gather the full logits on every tp rank)
    sync_qk_norm_grads: bool = True  # sum the q_norm/k_norm gradients over the tp ranks (--no-sync-qk-norm-grads only
        # to watch the replicas drift apart)
    reshard_after_forward: bool = True  # free each layer's gathered weights after its forward and all-gather them again
        # in backward (--no-reshard-after-forward: keep them until backward)


def resolve(config: Config) -> Config:
    """Fill the defaults that depend on the machine or the model; every other default lives in Config."""
    config.model, notice = resolve_model_name(config.model)
    if notice:
        print0(notice)
    if config.seq_len is None:
        config.seq_len = 256 if config.model in TINY_PRESETS else 1024
    if config.dtype is None:
        config.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    if config.lr is None:
        config.lr = 1e-3 if is_preset(config.model) else (1e-4 if config.lora_rank else 2e-5)
    if config.lora_alpha is None:
        config.lora_alpha = 2.0 * config.lora_rank
    resolve_paths(config, EXPERIMENT)  # --data found, --out-dir under the working directory, --resume
    if config.compile:
        raise InputError(f"{EXPERIMENT} refuses --compile: it uses tp-ft's plan, whose compiled decoder layer fails in "
                         "backward inside DTensor's redistribution (torch 2.15 on CPU; see tp-ft's README)")
    if config.loss_chunk_tokens:
        raise InputError(f"{EXPERIMENT} has no --loss-chunk-tokens: loss parallelism already splits the logits over "
                         "the vocabulary; chunking them too is not built yet (see tp-ft's README)")
    return config


def build_model(config: Config, tokenizer, attn_implementation: str, on_meta: bool):
    """single-ft's model (with its LoRA adapters): real weights on the CPU, or on the meta device (shapes only).

    On the meta device nothing is allocated, initialised or read from disk; the weights arrive after sharding.
    Creating the model there keeps the tie of the embedding and the LM head (one Parameter, two modules).
    """
    if on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(config.model, tokenizer),
                                                     dtype=weights_dtype(config.dtype, config.lora_rank),
                                                     attn_implementation=attn_implementation)
        refuse_moe(model.config)  # as load_model does on the other ranks, before any collective
    else:
        # fp32 weights, the master copy FSDP shards; a LoRA base under --dtype bf16 is frozen and stored in bf16.
        model = load_model(config.model, tokenizer, attn_implementation, device="cpu",
                           dtype=weights_dtype(config.dtype, config.lora_rank))
    if config.lora_rank:
        model = add_lora(model, config.lora_rank, config.lora_alpha)  # fp32 adapters; the rest frozen
    return model


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallelism inside a row of the mesh: tp-ft's plan, unchanged


def check_divisible(config, tp: int) -> None:
    """Every tp rank must get whole heads, whole KV groups and equal slices; say which number breaks it."""
    # q_norm/k_norm and the softmax work per head; a rank's query heads must read its own KV heads (GQA); equal
    # shards for the MLP width and the vocabulary (tp-ft's README says more).
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % tp:
            raise InputError(f"tensor parallelism over {tp} ranks needs {field} ({value}) divisible by {tp}; "
                             f"choose a --tp-degree that divides it")


def apply_tp(model, tp_mesh: DeviceMesh, loss_parallel: bool) -> list[torch.nn.Module]:
    """Split `model` (a Qwen3ForCausalLM, optionally wrapped by peft) over the tp ranks of its row, in place.

    tp-ft's apply_tp on the "tp" dimension of the mesh, inside one row (one node). Returns q_norm and k_norm, whose
    gradients the loop sums over the row: modules, not parameters, since fully_shard replaces every parameter.
    """
    tp = tp_mesh.size()
    check_divisible(model.config, tp)
    partial_grad_modules = []
    for layer in model.get_decoder().layers:
        plan = {
            # The attention's and the MLP's (replicated) input enters the plan once as a DTensor, so backward
            # all-reduces one summed input gradient per block instead of one per column-parallel linear.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            # Column-parallel: weight [out/tp, in] on each rank; the output is this rank's heads, kept local.
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            # Row-parallel: weight [out, in/tp]; each rank's partial [tokens, hidden] is summed by an all-reduce.
            "self_attn.o_proj": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),  # the SiLU(gate) * up product is elementwise, so it stays local
        }
        parallelize_module(layer, tp_mesh, with_lora_adapters(layer, plan, tp_mesh))
        attention = layer.self_attn
        # Qwen3Attention reshapes with -1 heads (local counts from the local shapes); versions that keep the head
        # counts on the module need them divided.
        for name in ("num_heads", "num_key_value_heads"):
            if hasattr(attention, name):
                setattr(attention, name, getattr(attention, name) // tp)
        # q_norm/k_norm: one weight per head_dim entry, shared by all heads, applied by each rank to its own heads.
        partial_grad_modules += [attention.q_norm, attention.k_norm]

    # Embedding and LM head split over the vocabulary; the tied [V, d] weight is one Shard(0) DTensor for both
    # (parallelize_module makes a new parameter per module, so the head is pointed at the embedding's again).
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if loss_parallel:
        # The logits stay a DTensor split over the vocabulary: no rank holds the full [tokens x V] tensor.
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    else:
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))  # all-gather of the logits
    if tied:
        head.weight = embedding.weight
    return partial_grad_modules


def with_lora_adapters(layer, plan: dict, tp_mesh: DeviceMesh) -> dict:
    """Extend a layer's plan to peft's LoRA layers: y = W x + B A x, each adapter linear split to match W.

    As in tp-ft (its README says why): for a column-parallel W, A is replicated and B column-parallel; for a
    row-parallel W, A is row-parallel and B stays a plain tensor.
    """
    expanded = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not hasattr(module, "lora_A"):
            expanded[name] = style
            continue
        expanded[f"{name}.base_layer"] = style
        for adapter in module.lora_A:
            if isinstance(style, ColwiseParallel):
                # A's gradient is a Partial(sum) DTensor over the tp ranks; FSDP redistributes it to A's Replicate
                # placement (an all-reduce over the row) before its reduce-scatter over the column.
                distribute_module(module.lora_A[adapter], tp_mesh)  # no partition_fn: replicated
                expanded[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            else:
                expanded[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
    return expanded


# ---------------------------------------------------------------------------------------------------------------
# FSDP across the rows of the mesh, over the tensor-parallel modules


def apply_fsdp(model, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None, reshard_after_forward: bool
               ) -> list[torch.nn.Module]:
    """fsdp-ft's units (one per decoder layer, then the root) on the "dp" dimension of the mesh. Returns the layers.

    fully_shard over "dp" cuts each rank's TP slice again along dim 0 (a DTensor on the 2-D mesh; the norms become
    1/dp shards on the "dp" mesh). Its all-gathers and reduce-scatters run over "dp" only, the only collectives that
    cross the rows (nodes); the plan's all-reduces stay inside a row (the README says more).
    """
    # Mixed precision as in fsdp-ft: fp32 shards (the master weights and AdamW's state), bf16 gathers and compute,
    # fp32 reduce-scatters. No autocast.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = list(model.get_decoder().layers)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    # The root (embedding = tied LM head, final norm) stays gathered after forward: backward starts with the head.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return layers


def init_rope_buffers(model, device: torch.device) -> None:
    """RoPE's inv_freq is a non-persistent buffer: in no state dict, so neither to_empty nor loading fills it."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq"):  # transformers' rotary embedding modules
            fresh = type(module)(module.config)
            module.inv_freq = fresh.inv_freq.to(device)
            module.original_inv_freq = fresh.original_inv_freq.to(device)


def all_reduce_partial_grads(plain: list[torch.nn.Parameter], tp_mesh: DeviceMesh) -> None:
    """Sum over the tp ranks of a row, in one all-reduce per step, the q_norm/k_norm gradients.

    FSDP has already reduce-scattered them over "dp"; the tp ranks of a row hold the same 1/dp shard, each the
    partial gradient of its own heads, so summing the local shards over the row completes the gradient.
    """
    grads = [p.grad.to_local() for p in plain if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=tp_mesh.get_group())
    for grad, total in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(total.view_as(grad))


def by_mesh(parameters) -> list[list[torch.nn.Parameter]]:
    """The parameters grouped by the mesh of their DTensor: the 2-D mesh (TP slices, LoRA adapters) and the "dp"
    mesh (the norms). DTensor refuses an operation over tensors of two meshes, which AdamW's foreach/fused kernels
    and gradient clipping would apply to a mixed list."""
    groups: dict = {}
    for p in parameters:
        groups.setdefault(p.device_mesh, []).append(p)
    return list(groups.values())


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, tp: int) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for gradients sharded over a 2-D mesh, with one all-reduce.

    A TP slice's block differs on every rank, so its sum of squares is summed over all ranks; the other gradients
    (norms, LoRA's replicated adapters) are the same block on every tp rank of a row, hence the / tp (the README).
    """
    split = [p.grad.to_local() for p in parameters if p.grad is not None and on_tp_mesh(p)]
    shared = [p.grad.to_local() for p in parameters if p.grad is not None and not on_tp_mesh(p)]
    squares = torch.nn.utils.get_total_norm(split).pow(2) + torch.nn.utils.get_total_norm(shared).pow(2) / tp
    dist.all_reduce(squares)
    total_norm = squares.sqrt()
    for group in by_mesh(parameters):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # Processes, device and the 2-D mesh: one process per device (torchrun). A plain `python train.py` gets a
    # one-rank group in memory (DTensor and FSDP need one even then), and so a 1 x 1 mesh.
    dist_info = init_distributed(config.collective_timeout_s, group_of_one=True)
    device = dist_info.device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tp = config.tp_degree if world_size > 1 else 1
    if config.tp_degree < 1 or world_size % tp:
        raise InputError(f"--tp-degree {config.tp_degree} must divide the world size {world_size}: run torchrun "
                         f"--nproc_per_node=<a multiple of {config.tp_degree}>")
    dp = world_size // tp
    # Row-major: rank = dp_index x tp + tp_index, so the tp ranks of a row are consecutive, one node's GPUs when
    # tp <= GPUs per node. mesh["tp"] and mesh["dp"] are this rank's row and column as 1-D meshes.
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()  # which data shard this rank reads: its row, never its global rank
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    if world_size == 1 and config.tp_degree != 1:
        print0(f"one process: a 1 x 1 mesh, no parallelism (--tp-degree {config.tp_degree} takes effect under "
               f"torchrun with a multiple of {config.tp_degree} processes)")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # Under loss_parallel() cross_entropy accepts logits split over the vocabulary (three all-reduces of one number
    # per token over the row); the backward must run inside it too.
    loss_context = loss_parallel if config.loss_parallel else nullcontext

    # ---------------------------------------------------------------------------------------------------------
    # Data: every row of every step is fixed by (seed, data, seq_len); see common/data.py. Every rank builds the
    # same rows; a dp row of the mesh takes the dp_rank-th slice of each step, and its tp ranks all read that slice.
    tokenizer = load_tokenizer(config.model)
    try:
        data = build_data(config.data, tokenizer, config.seq_len, packing=config.packing,
                          eval_fraction=config.eval_fraction, seed=config.seed, split=config.data_split,
                          subset=config.data_config, columns=config.data_columns,
                          train_empty_think=config.train_empty_think)
    except DataError as error:
        raise InputError(f"bad training data: {error}") from None
    print0(describe(data.stats, config.seq_len, config.packing))
    if config.show_sample:
        print0(sample_text(data, tokenizer))
    rows_per_step = config.micro_batch_size * config.grad_accum * dp
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model: as in fsdp-ft, no rank ever holds the whole model on its device. Rank 0 alone builds (preset, same seed
    # and order as single-ft, so the same weights) or reads (hub id, folder) the full model in CPU memory; every rank
    # builds it on the meta device, splits it (TP) and shards it (FSDP) there, then allocates only its shards.
    full_state = {}
    if rank == 0:
        full_state = build_model(config, tokenizer, attention.impl, on_meta=False).state_dict()
    model = build_model(config, tokenizer, attention.impl, on_meta=True)
    if config.activation_checkpointing:
        # Before the plan and the sharding (the TP and FSDP hooks stay outside the recomputed region); early_stop
        # and disable_input_require_grads as in tp-ft (its README says why).
        checkpoint_activations(model, use_reentrant=False, early_stop=False)
        model.disable_input_require_grads()
    # Order matters: TP first, then FSDP over the TP-parallelized modules (FSDP shards the DTensor slices the plan
    # made; a plan applied after fully_shard would find FSDP's flat shards instead of nn.Linear weights).
    partial_grad_modules = apply_tp(model, tp_mesh, config.loss_parallel)
    layer_units = apply_fsdp(model, dp_mesh, torch.bfloat16 if config.dtype == "bf16" else None,
                             config.reshard_after_forward)
    model.to_empty(device=device)
    init_rope_buffers(model, device)
    # Rank 0 broadcasts each full tensor; every rank keeps its (dp, tp) block of it.
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tie lost in sharding"
    # Taken now: fully_shard replaced q_norm's and k_norm's weights with new (sharded) parameters.
    partial_grad_params = [module.weight for module in partial_grad_modules] if config.sync_qk_norm_grads else []
    model.train()
    n_params = count_parameters(model.config)["total"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)  # a DTensor's numel() is its global size
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype}")
    print0(f"mesh: {dp} (dp) x {tp} (tp) = {world_size} ranks | tensor parallel inside a row: "
           f"{model.config.num_attention_heads // tp} query heads, {model.config.num_key_value_heads // tp} KV heads, "
           f"{model.config.intermediate_size // tp} MLP columns per rank, loss parallel "
           f"{'on' if config.loss_parallel else 'off'} | fsdp across rows: {len(layer_units) + 1} units sharded over "
           f"{dp} ranks, reshard after forward: {config.reshard_after_forward} | backend {dist.get_backend()}")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {dp} dp rows = {rows_per_step} rows of "
           f"{config.seq_len} (each row's {tp} tp ranks read the same) -> T_eff = {rows_per_step * config.seq_len:,} "
           f"token slots per optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU. Built on the sharded parameters,
    # so each rank keeps and updates the AdamW state of its own shards; one parameter group per mesh (see by_mesh).
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": group, "weight_decay": config.weight_decay} for group in by_mesh(decay)] + \
             [{"params": group, "weight_decay": 0.0} for group in by_mesh(no_decay)]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_checkpoint(config.resume, model, optimizer, scheduler) if config.resume else 0
    if config.resume:
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    # MFU divides by every rank; tokens/s counts the step's real tokens, the dp rows' different rows, each once.
    rec = Recorder(EXPERIMENT, config, device, model.config, data, rows_per_step, world_size=world_size, rank=rank,
                   steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
                   n_parameters=n_params, n_trainable=n_trainable, flops_per_token=model_flops_per_token)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, dp_rank, dp)
        # The denominator of the whole step, over all dp rows: every rank counts it locally, no collective.
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the denominator of the whole step, all its rows
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # The step's micro-batches go to the device up front (pinned on a GPU): the copies overlap queued compute.
        batches = [to_device(host_batch, device) for host_batch in micro_batches]
        step_loss = torch.zeros((), device=device)
        for index, (host_batch, batch) in enumerate(zip(micro_batches, batches)):
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            # As in fsdp-ft: reduce-scatter over "dp" only in the last micro-batch's backward.
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            with loss_context():  # loss parallelism: the backward of the sharded cross-entropy must run inside it
                # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               attention_mask=None, use_cache=False, **packed).logits
                # Divide by the whole step's loss tokens (all micro-batches, all dp rows); FSDP's reduce-scatter
                # averages over the dp ranks, so backward runs on dp x loss (README: the loss).
                loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
                (loss * dp).backward()
            step_loss += local_tensor(loss.detach())
        rec.state(step, model.parameters(), optimizer)  # this rank's (dp, tp) blocks, 1/dp of the norms, grads, AdamW
        all_reduce_partial_grads(partial_grad_params, tp_mesh)
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        grad_norm = clip_grad_norm(trainable, max_norm, tp)  # one all-reduce over the 2-D mesh (README)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Each dp row summed its own rows' token losses over the global count: the step loss is the sum over "dp".
        dist.all_reduce(step_loss, group=dp_mesh.get_group())
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        values = torch.stack([step_loss, grad_norm.float()]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(FullLogits(model), data, config.micro_batch_size, device, nullcontext))
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            # Collective: DCP writes each rank's (dp, tp) blocks; a block shared by several ranks is written once.
            saved = save_checkpoint(config.out_dir, step + 1, model, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export. Every rank evaluates the whole held-out split (each forward runs the plan's and
    # FSDP's collectives, which every rank must join), so every rank gets the same eval_loss.
    eval_loss = evaluate(FullLogits(model), data, config.micro_batch_size, device, nullcontext)
    # A forward without backward leaves the root gathered (reshard_after_forward=False): back to the shards, so that
    # model.parameters() are the sharded DTensors again for the drift check below.
    model.reshard()
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(
        attention=asdict(attention), eval_loss=eval_loss,
        tensor_parallel=tp, data_parallel=dp, mesh=dict(shape=[dp, tp], dim_names=["dp", "tp"]),
        replica_drift=replica_drift(model.parameters(), tp_mesh))  # a collective: every rank calls finish

    if config.save_hf:
        # Every rank takes part: each DTensor is all-gathered over both dimensions into a full tensor under its
        # original name (on rank 0, in CPU memory). A copy of the architecture on the meta device takes them with
        # assign=True, and from there the export is single-ft's: save_pretrained, of the adapter or merged.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_dir = Path(config.save_hf)
            export = build_model(config, tokenizer, attention.impl, on_meta=True)
            export.load_state_dict(full_state, assign=True)
            export.tie_weights()
            if config.lora_rank and config.merge_lora:
                export = export.merge_and_unload()
            export.save_pretrained(save_dir)  # safetensors; a peft model writes only its adapter
            tokenizer.save_pretrained(save_dir)
            record_adapter_base(save_dir, config.model, config.seed)  # a LoRA adapter's base, loadable from anywhere
            print0(f"saved {'adapter' if config.lora_rank and not config.merge_lora else 'model'} to {save_dir}")
        dist.barrier()
    teardown()
    return summary


if __name__ == "__main__":
    run(main)
