"""fsdp-ft: fine-tune a Qwen3 decoder with FSDP2 (torch.distributed.fsdp.fully_shard): weights, gradients and AdamW
state sharded over the ranks, each decoder layer's weights all-gathered just before it runs.

    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --model Qwen/Qwen3-0.6B-Base   # two GPUs
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --model qwen3-4b --activation-checkpointing
    uv run python experiments/fsdp-ft/train.py --model Qwen/Qwen3-0.6B-Base        # one GPU (a 1-rank process group)
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --lora-rank 16 --save-hf runs/lora --merge-lora
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --steps 3 --seq-len 128   # CPU smoke run (gloo)
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --loss-chunk-tokens 1024 --compile  # fast path

One optimizer step consumes B = micro_batch_size x grad_accum x world_size packed rows (common/data.py), as in
ddp-ft. Each decoder layer is one FSDP unit: its backward gathers its weights again and reduce-scatters the gradient,
so each rank receives the sum over ranks of its own 1/W and updates only that (README). The loss is the
token-weighted loss of all B rows, as in single-ft, which this script matches step for step.

Strategy flags: --no-reshard-after-forward, --no-reshard-after-backward, --cpu-offload, --reduce-every-micro-batch.
"""

from __future__ import annotations

import json
import warnings
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
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from common.attention import setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.generate import generate, sample_prompt
from common.loss import fused_linear_cross_entropy
from common.metrics import MetricsLogger, Recorder
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_tokenizer, model_config, record_adapter_base, refuse_moe, resolve_model_name, \
    weights_dtype
from common.step import clip_grad_norm, lr_factor

EXPERIMENT = "fsdp-ft"
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
    seq_len: int | None = None  # tokens per packed row; default 256 for qwen3-tiny and qwen3-moe-tiny, 1024 otherwise
    micro_batch_size: int = 1  # rows per forward pass, per rank
    grad_accum: int = 1  # micro-batches per optimizer step, per rank
    steps: int = 300  # optimizer steps (0 = only evaluate / export); 300: a minute or two of qwen3-tiny on 2 CPU cores
    epochs: float | None = None  # instead of --steps: passes over the training rows (e.g. 2, 0.5), rounded up to steps
    lr: float | None = None  # peak learning rate; default 1e-3 for presets, 2e-5 for pretrained models (1e-4 with LoRA)
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on norms)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    seed: int = 0  # one seed for init, data order and held-out split
    dtype: Literal["bf16", "fp32"] | None = None  # bf16: bf16 compute, fp32 master weights (GPU default); fp32 (CPU)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of storing activations
    loss_chunk_tokens: int = 0  # N > 0: the LM head and loss on loss tokens only, N at a time (common/loss.py)
    compile: bool = False  # torch.compile each decoder layer (GPU speed; on CPU it only costs compile time)
    packing: bool = True  # pack conversations into rows (--no-packing: one padded conversation per row)
    lora_rank: int = 0  # 0 = full-parameter SFT; N = LoRA of rank N on every linear projection of the decoder layers
    lora_alpha: float | None = None  # LoRA scaling numerator; default 2 x rank
    lora_fused: bool = False  # LoRA: one adapter input product for q/k/v and gate/up, each added by its product
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen", "flex"] = "auto"  # attention kernel (common/attention.py)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    sample_every: int = 0  # every N steps print a short greedy completion of a fixed held-out prompt (0 = never)
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/fsdp-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    qlora: bool = False  # refused here (README: QLoRA); use single-ft or ddp-ft --qlora
    reshard_after_forward: bool = True  # free each layer's gathered weights after its forward, gather them again in
        # backward (--no-reshard-after-forward: one all-gather per layer less, the whole gathered model alive)
    reshard_after_backward: bool = True  # free them after each micro-batch's backward (--no-reshard-after-backward,
        # with --no-reshard-after-forward: each unit gathered once per optimizer step, whatever --grad-accum)
    cpu_offload: bool = False  # the sharded fp32 weights, gradients and AdamW state in CPU memory; the update on CPU
    reduce_every_micro_batch: bool = False  # reduce-scatter after every micro-batch: more traffic, no full-size
        # fp32 gradient per rank between micro-batches
    replicate_degree: int = 1  # HSDP: R replicas of an FSDP group of world/R ranks (1 = plain FSDP over all ranks)


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
    if not config.reshard_after_backward and config.reshard_after_forward:
        raise InputError("--no-reshard-after-backward keeps the gathered weights from one micro-batch to the next only "
                         "if forward keeps them too: add --no-reshard-after-forward")
    return config


def build_model(config: Config, tokenizer, attn_implementation: str, on_meta: bool):
    """single-ft's model (with its LoRA adapters): real weights on the CPU, or on the meta device (shapes only: nothing
    allocated or read; the weights arrive after sharding, and the embedding and LM head stay one tied Parameter)."""
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
        # fp32 adapters, the rest frozen; --lora-fused: the same adapters in fewer kernels (common/lora.py)
        model = add_lora(model, config.lora_rank, config.lora_alpha, fused=config.lora_fused)
    return model


def apply_fsdp(model, mesh: DeviceMesh, param_dtype: torch.dtype | None, reshard_after_forward: bool,
               cpu_offload: bool) -> list[torch.nn.Module]:
    """One FSDP unit per decoder layer, then the root (embedding, final norm, LM head), bottom-up: fully_shard takes
    the parameters no earlier call claimed. A unit is one all-gather in forward, one more in backward if resharded,
    and one reduce-scatter; the tied embedding / LM head, one Parameter, lives in the root unit (README)."""
    # Mixed precision: the sharded parameters (and so AdamW's state) stay fp32, the master weights; the all-gather
    # casts them to param_dtype, so compute and the gathered weights are bf16, and gradients are reduced in fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for layer in layers:  # transformers' decoder layers (Qwen3DecoderLayer), LoRA adapters included
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy)
    # The root stays gathered after forward (FSDP's default for it): backward starts with the LM head, and
    # --loss-chunk-tokens reads the head's weight after the model's forward has returned.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy)
    return layers


def init_rope_buffers(model, device: torch.device) -> None:
    """RoPE's inv_freq is a non-persistent buffer: in no state dict, so neither to_empty nor loading fills it."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq"):  # transformers' rotary embedding modules
            fresh = type(module)(module.config)
            module.inv_freq = fresh.inv_freq.to(device)
            module.original_inv_freq = fresh.original_inv_freq.to(device)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts
    if config.qlora:
        raise InputError("--qlora is not offered by fsdp-ft: fully_shard would have to shard bitsandbytes' packed "
                         "4-bit weights (bnb_4bit_quant_storage=bf16), which is unverified here; use ddp-ft --qlora "
                         "(a 4-bit Qwen3-4B fits one 24 GB GPU)")

    # ---------------------------------------------------------------------------------------------------------
    # One process per device, started by torchrun; FSDP needs a group even in a plain `python train.py`: one rank.
    dist_info = init_distributed(config.collective_timeout_s, group_of_one=True)
    device = dist_info.device
    # --cpu-offload: loading the CPU shards and their gradient norm are collectives on CPU tensors, not for NCCL.
    if config.cpu_offload and "cpu:" not in dist.get_backend_config():
        raise InputError(f"--cpu-offload needs a process group with a CPU backend, e.g. 'cpu:gloo,cuda:nccl'; this "
                         f"one is '{dist.get_backend_config()}' (common/dist.py creates it)")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # HSDP (--replicate-degree R): a 2-D mesh, R replicas x world/R shards; only the gradient all-reduce crosses
    # between shard groups (README).
    replicas = config.replicate_degree
    if replicas < 1 or world_size % replicas:
        raise InputError(f"--replicate-degree {replicas} must divide the world size {world_size}")
    shard_size = world_size // replicas
    mesh = (init_device_mesh(device.type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
            if replicas > 1 else init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",)))
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # bf16 mixed precision: FSDP's MixedPrecisionPolicy (apply_fsdp) gathers the fp32 shards (the "master weights")
    # as bf16 and the layers compute in bf16, no autocast. fp32: everything in fp32, which is what the parity tests use.
    autocast = nullcontext

    # ---------------------------------------------------------------------------------------------------------
    # Data: every row of every step is fixed by (seed, data, seq_len); see common/data.py.
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
    rows_per_step = config.micro_batch_size * config.grad_accum * world_size
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model: no rank ever holds the whole model on its device; rank 0 alone builds or reads it, in CPU memory.
    full_state = {}
    if rank == 0:
        full_state = build_model(config, tokenizer, attention.impl, on_meta=False).state_dict()
    # Every rank builds the same model on the meta device: shapes, no memory.
    model = build_model(config, tokenizer, attention.impl, on_meta=True)
    if config.activation_checkpointing:
        # Before sharding, so FSDP's hooks stay outside the recomputed region (README).
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and is the variant PyTorch recommends.
        checkpoint_activations(model, use_reentrant=False)
    if config.compile:
        # One graph per decoder layer (as torchtitan): bounded compile time; in place, so parameter names stay.
        for layer in model.get_decoder().layers:
            layer.compile()
    layer_units = apply_fsdp(model, mesh, torch.bfloat16 if config.dtype == "bf16" else None,
                             config.reshard_after_forward, config.cpu_offload)
    n_units = len(layer_units) + 1
    # Only now memory: each rank allocates its 1/W shard of every parameter (on the CPU with --cpu-offload) ...
    model.to_empty(device="cpu" if config.cpu_offload else device)
    init_rope_buffers(model, device)
    # ... and fills it: rank 0 broadcasts each full tensor and every rank keeps its own slice of it.
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tie lost in sharding"
    # --loss-chunk-tokens applies the LM head itself, to the hidden states the whole model returns (README).
    lm_head, no_positions = model.get_output_embeddings(), torch.empty(0, dtype=torch.long, device=device)
    if config.loss_chunk_tokens:
        # Its logits of no position are a view, which FSDP2 warns of; nothing here writes to them in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    model.train()
    n_params = count_parameters(model.config)["total"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype}")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {world_size} ranks = {rows_per_step} rows "
           f"of {config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")
    print0(f"fsdp: {n_units} units ({n_units - 1} decoder layers + root) sharded over {shard_size} ranks"
           f"{f' x {replicas} replicas (HSDP)' if replicas > 1 else ''}: "
           f"{n_params / shard_size * 4 / 2**30:.2f} GiB of fp32 weights per rank"
           f"{' in CPU memory' if config.cpu_offload else ''} | gradients reduced in fp32 | reshard after forward: "
           f"{config.reshard_after_forward} | backend {dist.get_backend()}")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU.
    # No empty group (LoRA trains nothing 1-D): a checkpoint's optimizer state cannot load into one.
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([group for group in groups if group["params"]], lr=config.lr,
                                  fused=device.type == "cuda" and not config.cpu_offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    sample_messages = sample_prompt(data)  # --sample-every: the turns before the first held-out answer
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_checkpoint(config.resume, model, optimizer, scheduler) if config.resume else 0
    if config.resume:
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model.config, data, rows_per_step, world_size=world_size, rank=rank,
                   steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
                   n_parameters=n_params, n_trainable=n_trainable, flops_per_token=model_flops_per_token)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, rank, world_size)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the denominator of the whole step, all its rows
        # The same, as a device tensor: the fused loss scales its gradients by it without reading anything back.
        step_scale = torch.full((), 1.0 / max(loss_tokens, 1), device=device)
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # The step's micro-batches go to the device up front (pinned on a GPU): the copies overlap queued compute.
        batches = [to_device(host_batch, device) for host_batch in micro_batches]
        step_loss = torch.zeros((), device=device)
        for index, (host_batch, batch) in enumerate(zip(micro_batches, batches)):
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            last = index == len(micro_batches) - 1
            # Reduce-scatter in the last micro-batch's backward only; before it, each rank accumulates its full-size
            # fp32 gradient (README), which --reduce-every-micro-batch trades for a reduce-scatter per micro-batch.
            model.set_requires_gradient_sync(last or config.reduce_every_micro_batch)
            # --no-reshard-after-backward: the weights stay gathered through the step; the last backward frees them.
            model.set_reshard_after_backward(last or config.reshard_after_backward)
            # Divided by the whole step's loss tokens: the micro-batches' gradients sum to the step loss's gradient.
            with autocast():
                # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                if config.loss_chunk_tokens:
                    # The LM head and loss on loss tokens only, picked by the labels' host copy (common/loss.py).
                    # The whole model runs: only the root's forward gathers the LM head, kept gathered (README).
                    hidden = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, output_hidden_states=True,
                                   logits_to_keep=no_positions, **packed).hidden_states[-1]
                    loss = fused_linear_cross_entropy(hidden, lm_head.weight, host_batch["labels"],
                                                      config.loss_chunk_tokens, step_scale)
                else:
                    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, **packed).logits
                    loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
            (loss * world_size).backward()  # the reduce-scatter averages over ranks: W x the average is the sum
            step_loss += loss.detach()
        rec.state(step, model.parameters(), optimizer)  # this rank's shards of every weight, gradient, AdamW state
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        # The norm of the shards, summed over the mesh, before clipping; each rank then updates its own shard.
        grad_norm = clip_grad_norm(optimizer, trainable, max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)  # each rank holds its rows' share of the step loss: the log line wants the sum
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        # (With --cpu-offload the norm of the CPU shards is a CPU tensor, moved to the device for the same read.)
        values = torch.stack([step_loss, grad_norm.to(device, torch.float32)]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(model, data, config.micro_batch_size, device, autocast))
        if config.sample_every and (step + 1) % config.sample_every == 0 and sample_messages:
            completion = generate(model, tokenizer, sample_messages, device, autocast=autocast,
                                  synced_gpus=world_size > 1)
            print0(f"sample step {step + 1}: {completion!r}")
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            saved = save_checkpoint(config.out_dir, step + 1, model, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export; every rank evaluates every batch, as each forward's all-gathers need all ranks.
    eval_loss = evaluate(model, data, config.micro_batch_size, device, autocast)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(attention=asdict(attention), eval_loss=eval_loss)

    if config.save_hf:
        # Collective: every rank sends its shards, rank 0 receives the full tensors, one at a time, into CPU memory.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if config.save_hf and rank == 0:
        # A plain CPU copy of the trained weights, from here on single-ft's export; to_empty untied the LM head.
        model = build_model(config, tokenizer, attention.impl, on_meta=True)
        model.to_empty(device="cpu")
        model.tie_weights()
        model.load_state_dict(full_state)
        save_dir = Path(config.save_hf)
        if config.lora_rank and config.merge_lora:
            model = model.merge_and_unload()
        model.save_pretrained(save_dir)  # safetensors; a peft model writes only its adapter
        tokenizer.save_pretrained(save_dir)
        record_adapter_base(save_dir, config.model, config.seed)  # a LoRA adapter's base, loadable from anywhere
        print0(f"saved {'adapter' if config.lora_rank and not config.merge_lora else 'model'} to {save_dir}")
    teardown()
    return summary


if __name__ == "__main__":
    run(main)
