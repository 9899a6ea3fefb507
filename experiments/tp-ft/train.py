"""tp-ft: fine-tune a Qwen3 decoder with tensor parallelism: every rank holds 1/tp of each weight matrix.

    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py                    # CPU (gloo): built-in qwen3-tiny
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py --model Qwen/Qwen3-0.6B-Base    # 2 GPUs
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py --lora-rank 16 --save-hf runs/lora --merge-lora
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py --steps 3 --seq-len 128            # smoke run
    uv run python experiments/tp-ft/train.py --steps 3 --seq-len 128     # one process: tp = 1, the same plan, no-op

Megatron-LM's plan (Shoeybi et al. 2019) as a DTensor `parallelize_module` plan in `apply_tp`: q, k, v, gate and
up split by output columns, o and down by input rows (an all-reduce of [tokens x hidden] after attention and after
the MLP, forward and backward), the tied embedding / LM head over the vocabulary, the loss on the logits' shards.
TP splits the model, not the batch: every rank reads the same B = micro_batch_size x grad_accum rows, the same step
as single-ft's; the tp degree is the number of processes (the README says more).
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, loss_parallel, \
    parallelize_module
from transformers import AutoModelForCausalLM

from common.attention import setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.metrics import MetricsLogger, Recorder, local_tensor
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_tokenizer, record_adapter_base, resolve_model_name, weights_dtype
from common.precision import MasterWeights
from common.step import clip_grad_norm, lr_factor
from common.tp import FullLogits, SavedActivations, replica_drift

EXPERIMENT = "tp-ft"
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
    micro_batch_size: int = 1  # rows per forward pass
    grad_accum: int = 1  # micro-batches per optimizer step
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
    compile: bool = False  # not available here: refused at start (the README says why); tp-sp-ft has it
    loss_chunk_tokens: int = 0  # not built here: 0 only (the README says why)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/tp-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    # Tensor parallelism
    loss_parallel: bool = True  # keep the logits split over the vocabulary and compute the cross-entropy on the shards
        # (--no-loss-parallel: gather the full logits on every rank)
    sync_qk_norm_grads: bool = True  # sum the q_norm/k_norm gradients over the TP group (--no-sync-qk-norm-grads only
        # to watch the replicas drift apart)


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
        raise InputError(f"{EXPERIMENT} refuses --compile: a compiled decoder layer under this plan fails in backward "
                         "inside DTensor's redistribution (torch 2.15); tp-sp-ft's plan compiles (see the README)")
    if config.loss_chunk_tokens:
        raise InputError(f"{EXPERIMENT} has no --loss-chunk-tokens: loss parallelism already splits the logits over "
                         "the vocabulary; chunking them too is not built yet (see the README)")
    return config


def check_divisible(config, tp: int) -> None:
    """Every rank must get whole heads, whole KV groups and equal slices; say which number breaks it."""
    # q_norm/k_norm and the softmax work per head; a rank's query heads must read its own KV heads (GQA); equal
    # shards for the MLP width and the vocabulary (the README says more).
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % tp:
            raise InputError(f"tensor parallelism over {tp} ranks needs {field} ({value}) divisible by {tp}; "
                             f"run with a --nproc_per_node that divides it")


def apply_tp(model, tp_mesh, loss_parallel: bool) -> list[torch.nn.Parameter]:
    """Split `model` (a Qwen3ForCausalLM, optionally wrapped by peft) over `tp_mesh`, in place.

    Returns the parameters that stay plain replicated tensors but whose gradient each rank computes from its own
    heads only (q_norm and k_norm): the training loop sums those over the group.
    """
    tp = tp_mesh.size()
    check_divisible(model.config, tp)
    partial_grad_params = []
    for layer in model.get_decoder().layers:
        plan = {
            # The block's (replicated) input enters as a DTensor once: q, k and v (gate and up) share it, and the
            # backward all-reduces their summed input gradient once per block, not once per column-parallel linear.
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
        # q_norm/k_norm: one weight per head_dim entry, shared by all heads, applied by each rank to its own heads:
        # replicated, with a partial gradient.
        partial_grad_params += [attention.q_norm.weight, attention.k_norm.weight]

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
    return partial_grad_params


def with_lora_adapters(layer, plan: dict, tp_mesh) -> dict:
    """Extend a layer's plan to peft's LoRA layers: y = W x + B A x, each adapter linear split to match W.
    peft wraps the unsplit model (single-ft's init); the README says why the plan must name the adapters."""
    expanded = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not hasattr(module, "lora_A"):
            expanded[name] = style
            continue
        expanded[f"{name}.base_layer"] = style
        for adapter in module.lora_A:
            if isinstance(style, ColwiseParallel):
                # x is the replicated DTensor input: A [r, in] is replicated, B [out, r] is split by rows like W,
                # so B A x lands on this rank's output columns. A's gradient arrives as a partial sum (B's input
                # gradient, per rank) and is summed with the q_norm/k_norm gradients.
                distribute_module(module.lora_A[adapter], tp_mesh)  # no partition_fn: replicated
                expanded[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            else:
                # x is split over its features: A [r, in] is split like W (columns) and A x [tokens, r] is summed by
                # an all-reduce of r numbers per token; B [out, r] stays a plain replicated tensor.
                expanded[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
    return expanded


def all_reduce_partial_grads(plain: list[torch.nn.Parameter], trainable: list[torch.nn.Parameter], tp_mesh) -> None:
    """Sum over the TP group, in one all-reduce per step, the gradients that each rank holds only its part of.

    `plain` are replicated plain tensors named by apply_tp (q_norm/k_norm); among the DTensor parameters the
    ones concerned show it by a Partial(sum) gradient (LoRA A of the column-parallel projections), which becomes
    Replicate. Without this the plain replicas drift apart step by step, each rank following its own heads.
    """
    plain_grads = [p.grad for p in plain if p.grad is not None]
    partial = [p for p in trainable if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()]
    grads = plain_grads + [p.grad.to_local() for p in partial]
    if not grads:
        return
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=tp_mesh.get_group())
    summed = [total.view_as(grad) for grad, total in zip(grads, flat.split([grad.numel() for grad in grads]))]
    for grad, total in zip(plain_grads, summed):
        grad.copy_(total)
    for p, total in zip(partial, summed[len(plain_grads):]):
        p.grad = DTensor.from_local(total, tp_mesh, [Replicate()], run_check=False)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # Processes, device and mesh: one process per device (torchrun), all of them one TP group.
    dist_info = init_distributed(config.collective_timeout_s, group_of_one=True)
    device = dist_info.device
    tp = dist_info.world_size
    tp_mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # Under loss_parallel() cross_entropy takes logits split over the vocabulary: each rank reduces its shard and
    # three all-reduces of one number per token combine them.
    loss_context = loss_parallel if config.loss_parallel else nullcontext

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
    rows_per_step = config.micro_batch_size * config.grad_accum
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model: built whole on every rank from the same seed (single-ft's init, LoRA's too), then split by apply_tp.
    model = load_model(config.model, tokenizer, attention.impl, device=device,
                       dtype=weights_dtype(config.dtype, config.lora_rank))  # a LoRA base in bf16 under bf16
    if config.lora_rank:
        model = add_lora(model, config.lora_rank, config.lora_alpha)  # fp32 adapters; the rest frozen
    if config.activation_checkpointing:
        # early_stop=False and disable_input_require_grads: no asynchronous DTensor collective left unwaited
        # under LoRA, no unused gradient for the embedding's output (the README says why).
        checkpoint_activations(model, use_reentrant=False, early_stop=False)
        model.disable_input_require_grads()
    partial_grad_params = apply_tp(model, tp_mesh, config.loss_parallel)
    if not config.sync_qk_norm_grads:
        partial_grad_params = []
    model.train()
    # --dtype bf16: the trainable weights become bf16, AdamW updates fp32 master copies (common/precision.py).
    masters = MasterWeights(model, torch.bfloat16 if config.dtype == "bf16" else None)  # DTensors: their placements
    partial_grad_params = masters.of(partial_grad_params)  # their gradients accumulate on the masters
    n_params = count_parameters(model.config)["total"]
    trainable = masters.parameters  # the fp32 masters, or the model's own trainable weights (fp32)
    n_trainable = sum(p.numel() for p in trainable)  # a DTensor's numel() is its global size
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype}")
    print0(f"tensor parallel: {tp} ranks, mesh {tp_mesh} | {model.config.num_attention_heads // tp} query heads, "
           f"{model.config.num_key_value_heads // tp} KV heads, {model.config.intermediate_size // tp} MLP columns "
           f"per rank | loss parallel {'on' if config.loss_parallel else 'off'} | the same rows on every rank")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} = {rows_per_step} rows of {config.seq_len} "
           f"-> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU. DTensor rejects a list that
    # mixes DTensors with plain tensors (the norms, row-parallel LoRA B): one group per kind.
    def by_kind(params):
        return [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]

    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    # No empty group (LoRA trains nothing 1-D): a checkpoint's optimizer state cannot load into one.
    groups = [{"params": kind, "weight_decay": decay_rate} for params, decay_rate in
              ((decay, config.weight_decay), (no_decay, 0.0)) for kind in by_kind(params)]
    optimizer = torch.optim.AdamW([group for group in groups if group["params"]], lr=config.lr,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_checkpoint(config.resume, masters.module, optimizer, scheduler) if config.resume else 0
    if config.resume:
        masters.copy_to_model()  # the loaded fp32 masters, rounded into the weights the forward reads
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model.config, data, rows_per_step, world_size=tp,  # MFU over tp devices
                   rank=dist_info.rank,
                   steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
                   n_parameters=n_params, n_trainable=n_trainable, flops_per_token=model_flops_per_token)
    activations = SavedActivations(model)  # what the first micro-batch's forward keeps for backward (common/tp.py)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the denominator of the whole step, all its rows
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # The step's micro-batches go to the device up front (pinned on a GPU): the copies overlap queued compute.
        batches = [to_device(host_batch, device) for host_batch in micro_batches]
        step_loss = torch.zeros((), device=device)
        for host_batch, batch in zip(micro_batches, batches):
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            # Divided by the whole step's loss tokens: the micro-batches' gradients sum to the step loss's gradient.
            with loss_context():  # loss parallelism: the backward of the sharded cross-entropy must run inside it
                with activations.once():
                    # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, **packed).logits
                loss = token_loss_sum(logits, batch["labels"]) / loss_tokens  # a Replicate DTensor under loss parallel
                loss.backward()
            step_loss += local_tensor(loss.detach())
        rec.state(step, model.parameters(), optimizer, masters.copies)  # weights, gradients, AdamW, masters
        all_reduce_partial_grads(partial_grad_params, trainable, tp_mesh)
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        # The norm before clipping, the split gradients' squares summed over the ranks (DTensor: no fused folding).
        grad_norm = clip_grad_norm(optimizer, trainable, max_norm)
        masters.free_weights()  # the bf16 weights are not read again before the next forward (common/precision.py)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        masters.copy_to_model()  # the updated fp32 masters, rounded into the weights the next forward reads
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        values = torch.stack([step_loss, grad_norm.float()]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(FullLogits(model), data, config.micro_batch_size, device, nullcontext))
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            # DCP writes each rank's shards of the DTensors and rank 0's copy of the replicated tensors.
            saved = save_checkpoint(config.out_dir, step + 1, masters.module, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export
    eval_loss = evaluate(FullLogits(model), data, config.micro_batch_size, device, nullcontext)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(
        attention=asdict(attention), eval_loss=eval_loss,
        tensor_parallel=tp, activation_mib=activations.mib, master_weights=masters.summary(),
        replica_drift=replica_drift(masters.module.parameters(), tp_mesh))  # a collective: every rank calls finish

    if config.save_hf:
        masters.restore_masters()  # the fp32 weights, as an export under autocast wrote them
        # Every rank takes part: each DTensor is all-gathered into a full tensor on rank 0 (CPU memory); a copy of
        # the architecture on the meta device takes them (assign=True), and from there the export is single-ft's.
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist_info.is_main:
            save_dir = Path(config.save_hf)
            with torch.device("meta"):
                export = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
                if config.lora_rank:
                    export = add_lora(export, config.lora_rank, config.lora_alpha)  # the same adapters, on meta
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
