"""ddp-ft: fine-tune a Qwen3 decoder with DistributedDataParallel: a full replica per rank, gradients all-reduced.

    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --model Qwen/Qwen3-0.6B-Base   # two GPUs
    uv run python experiments/ddp-ft/train.py --model Qwen/Qwen3-0.6B-Base         # one GPU (a 1-rank process group)
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --lora-rank 16 --save-hf runs/lora --merge-lora
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --steps 3 --seq-len 128    # CPU smoke run (gloo)
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --loss-chunk-tokens 1024 --compile  # fast path

One optimizer step consumes B = micro_batch_size x grad_accum x world_size packed rows (common/data.py); rank r
runs the r-th contiguous slice of them. Every rank holds the whole model, gradient and AdamW state. In the backward of
the last micro-batch DDP all-reduces the gradients, bucket by bucket while backward is still running, so every rank
ends the step with the same gradient and takes the same optimizer step: the replicas never exchange weights.
The loss is the token-weighted loss of all B rows, as in single-ft, which this script matches step for step.

Strategy flags: --bucket-cap-mb (size of the gradient buckets DDP all-reduces), --reduce-every-micro-batch.
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
from torch.nn.parallel import DistributedDataParallel

from common.attention import setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.generate import generate, sample_prompt
from common.loss import fused_linear_cross_entropy
from common.metrics import MetricsLogger, Recorder
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_model_4bit, load_tokenizer, qlora_unavailable, record_adapter_base, \
    resolve_model_name, weights_dtype
from common.precision import MasterWeights
from common.step import clip_grad_norm, lr_factor

EXPERIMENT = "ddp-ft"
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
    out_dir: str | None = None  # default runs/ddp-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    qlora: bool = False  # 4-bit NF4 base (bitsandbytes) under LoRA (rank 16 unless --lora-rank); CUDA only
    bucket_cap_mb: float = 25.0  # MiB of gradients per all-reduce bucket, sent while backward goes on (DDP's default)
    reduce_every_micro_batch: bool = False  # all-reduce after every micro-batch, not only the last (no no_sync()):
        # the same step for grad_accum times the traffic, the classic misconfiguration, kept to measure it


def resolve(config: Config) -> Config:
    """Fill the defaults that depend on the machine or the model; every other default lives in Config."""
    config.model, notice = resolve_model_name(config.model)
    if notice:
        print0(notice)
    if config.seq_len is None:
        config.seq_len = 256 if config.model in TINY_PRESETS else 1024
    if config.dtype is None:
        config.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    config.lora_rank = config.lora_rank or (16 if config.qlora else 0)  # --qlora: rank 16 unless given
    if config.lr is None:
        config.lr = 1e-3 if is_preset(config.model) else (1e-4 if config.lora_rank else 2e-5)
    if config.lora_alpha is None:
        config.lora_alpha = 2.0 * config.lora_rank
    resolve_paths(config, EXPERIMENT)  # --data found, --out-dir under the working directory, --resume
    return config


def all_reduce_masters(masters: MasterWeights, bucket):  # no annotations: DDP compares them with types, not strings
    """--dtype bf16: DDP's comm hook. Its buckets are the bf16 weights', but a bucket all-reduces its parameters' fp32
    master gradients, this rank's sum of the step's micro-batches (README), averaged in place. Under
    --reduce-every-micro-batch that sum holds the earlier ones' mean, the same on every rank: each is added once."""
    grads = [master.grad for master in masters.of(bucket.parameters())]
    masters.buckets.append(bucket.buffer())  # zeros, freed with the bf16 weights (common/precision.py)

    def average(future):
        averaged = future.value()[0].div_(dist.get_world_size()).split([grad.numel() for grad in grads])
        for grad, part in zip(grads, averaged):
            grad.copy_(part.view_as(grad))
        return bucket.buffer()  # what DDP copies into its .grad views: unchanged
    flat = torch.cat([grad.flatten() for grad in grads])
    return dist.all_reduce(flat, async_op=True).get_future().then(average)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts
    if config.qlora and (problem := qlora_unavailable(config.merge_lora, config.dtype)):
        raise InputError(problem)  # before anything starts or loads

    # ---------------------------------------------------------------------------------------------------------
    # One process per device, started by torchrun; DDP needs a group even in a plain `python train.py`: one rank.
    dist_info = init_distributed(config.collective_timeout_s, group_of_one=True)
    device = dist_info.device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # bf16: the weights themselves are bf16 (fp32 masters below), no autocast; --qlora's fp32 adapters keep autocast.
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if config.qlora else nullcontext

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
    # Model
    # Loaded in fp32; a LoRA base under --dtype bf16 is frozen and stored in bf16 (--qlora: 4-bit).
    model = load_model_4bit(config.model, tokenizer, attention.impl, device) if config.qlora else \
        load_model(config.model, tokenizer, attention.impl, device=device,
                   dtype=weights_dtype(config.dtype, config.lora_rank))
    if config.activation_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and is the variant PyTorch recommends.
        checkpoint_activations(model, use_reentrant=False)
    if config.lora_rank:
        # fp32 adapters, the rest frozen; --lora-fused: the same adapters in fewer kernels (common/lora.py)
        model = add_lora(model, config.lora_rank, config.lora_alpha, fused=config.lora_fused)
    if config.compile:
        # One graph per decoder layer (as torchtitan): bounded compile time; in place, so parameter names stay.
        for layer in model.get_decoder().layers:
            layer.compile()
    # --loss-chunk-tokens applies the LM head itself, to the hidden states DDP's forward returns (README).
    lm_head, no_positions = model.get_output_embeddings(), torch.empty(0, dtype=torch.long, device=device)
    model.train()
    # --dtype bf16: the trainable weights become bf16, AdamW updates fp32 master copies (common/precision.py).
    masters = MasterWeights(model, torch.bfloat16 if config.dtype == "bf16" and not config.qlora else None)
    n_params = count_parameters(model.config)["total"]
    trainable = masters.parameters  # the fp32 masters, or the model's own trainable weights (fp32, --qlora)
    n_trainable = sum(p.numel() for p in trainable)
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype}")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {world_size} ranks = {rows_per_step} rows "
           f"of {config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # DistributedDataParallel: rank 0's weights broadcast to every replica, then a hook per trainable parameter
    # starts a bucket's all-reduce as soon as backward has filled it, while backward goes on (README).
    model = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=True,  # .grad are views into the buckets: no second full copy of the gradients
        forward_sync_buffers=False)  # the only buffers are RoPE's constant inv_freq: no broadcast before every forward
    if masters.copies:  # --dtype bf16: each bucket all-reduces its fp32 master gradients instead (README)
        model.register_comm_hook(masters, all_reduce_masters)
    print0(f"ddp: {world_size} replicas | {n_trainable * 4 / 2**20:,.1f} MiB of fp32 gradients all-reduced once per "
           f"step, in buckets of {config.bucket_cap_mb:g} MiB | backend {dist.get_backend()}")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU.
    # No empty group (LoRA trains nothing 1-D): a checkpoint's optimizer state cannot load into one.
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([group for group in groups if group["params"]], lr=config.lr,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    sample_messages = sample_prompt(data)  # --sample-every: the turns before the first held-out answer
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_checkpoint(config.resume, masters.module, optimizer, scheduler) if config.resume else 0
    if config.resume:
        masters.copy_to_model()  # the loaded fp32 masters, rounded into the weights the forward reads
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model.module.config, data, rows_per_step, world_size=world_size,
                   rank=rank, steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
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
            # no_sync() on all but the last micro-batch: its forward arms no all-reduce for the backward (README).
            sync = nullcontext() if last or config.reduce_every_micro_batch else model.no_sync()
            # Divided by the whole step's loss tokens: the micro-batches' gradients sum to the step loss's gradient.
            with autocast(), sync:
                # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                if config.loss_chunk_tokens:
                    # The LM head and loss on loss tokens only, picked by the labels' host copy (common/loss.py).
                    # Through DDP's forward, which arms its gradient hooks (README), asking for no logits at all.
                    hidden = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, output_hidden_states=True,
                                   logits_to_keep=no_positions, **packed).hidden_states[-1]
                    loss = fused_linear_cross_entropy(hidden, lm_head.weight, host_batch["labels"],
                                                      config.loss_chunk_tokens, step_scale)
                else:
                    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, **packed).logits
                    loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
            (loss * world_size).backward()  # DDP averages over ranks: world_size x the average is the sum
            step_loss += loss.detach()
        rec.state(step, model.parameters(), optimizer, masters.copies)  # weights, gradients, AdamW, masters
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        # The norm before clipping; the clipping itself rides on fused AdamW's step (GPU), or is done here (CPU).
        grad_norm = clip_grad_norm(optimizer, trainable, max_norm)
        masters.free_weights()  # the bf16 weights are not read again before the next forward (common/precision.py)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        masters.copy_to_model()  # the updated fp32 masters, rounded into the weights the next forward reads
        dist.all_reduce(step_loss)  # each rank holds its rows' share of the step loss: the log line wants the sum
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        values = torch.stack([step_loss, grad_norm.float()]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(model.module, data, config.micro_batch_size, device, autocast))
        if config.sample_every and (step + 1) % config.sample_every == 0 and sample_messages:
            completion = generate(model.module, tokenizer, sample_messages, device, autocast=autocast)
            print0(f"sample step {step + 1}: {completion!r}")
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            saved = save_checkpoint(config.out_dir, step + 1, masters.module, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export; every rank on its own replica (model.module: no DDP hooks, no collective).
    eval_loss = evaluate(model.module, data, config.micro_batch_size, device, autocast)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(attention=asdict(attention), eval_loss=eval_loss, master_weights=masters.summary())

    if config.save_hf and rank == 0:  # the replicas are identical: rank 0 writes its own
        save_dir = Path(config.save_hf)
        masters.restore_masters()  # the fp32 weights, as an export under autocast wrote them
        model = model.module
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
