"""ep-ft: fine-tune a Qwen3 mixture of experts with expert parallelism: each rank holds E / W of every layer's
experts, the rest of the model is replicated, and tokens travel to their experts' rank and back (all-to-all).

    uv run torchrun --nproc_per_node=2 experiments/ep-ft/train.py                       # CPU: qwen3-moe-tiny (gloo)
    uv run torchrun --nproc_per_node=2 experiments/ep-ft/train.py --steps 3 --seq-len 128    # CPU smoke run
    uv run torchrun --nproc_per_node=2 experiments/ep-ft/train.py --model Qwen/Qwen3-30B-A3B-Base  # see README

One step consumes B = micro_batch_size x grad_accum x world_size packed rows, rank r the r-th slice (as ddp-ft). Each
sparse layer's expert block (ExpertParallelExperts) sends its (token, expert) rows to the experts' ranks and the
results back (all-to-all). With fp32 every step is single-ft's on the same micro-batches (tests/test_ep_ft.py).

Strategy flags: --dense-bucket-mb (size of the all-reduce buckets of the dense gradients).
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
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Shard

from common.attention import setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.generate import generate, sample_prompt
from common.loss import fused_linear_cross_entropy
from common.metrics import MetricsLogger, Recorder
from common.models import TINY_PRESETS, checkpoint_activations, count_parameters, flops_per_token, is_moe, \
    is_preset, load_model, load_tokenizer, model_config, record_adapter_base, resolve_model_name, weights_dtype
from common.ep import Dispatches, clip_expert_parallel_grad_norm, grouped_linear
from common.moe import RouterStats
from common.precision import MasterWeights
from common.step import all_reduce_in_buckets, lr_factor

EXPERIMENT = "ep-ft"
SCRIPT_DIR = Path(__file__).resolve().parent  # a copy of this script runs from any folder (README)


@dataclass
class Config:
    model: str = "qwen3-moe-tiny"  # a mixture of experts: preset (README), hub id (Qwen/Qwen3-30B-A3B-Base) or folder
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
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen", "flex"] = "auto"  # attention kernel (common/attention.py)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    sample_every: int = 0  # every N steps print a short greedy completion of a fixed held-out prompt (0 = never)
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/ep-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    qlora: bool = False  # 4-bit NF4 base (bitsandbytes) under LoRA (rank 16 unless --lora-rank); CUDA only
    dense_bucket_mb: float = 25.0  # MiB of dense (replicated) gradients per all-reduce call at the end of the step


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
    resolve_paths(config, EXPERIMENT)  # --data found, --out-dir under the working directory, --resume
    return config


# ---------------------------------------------------------------------------------------------------------------
# The expert-parallel block: this rank's experts, and the two all-to-alls around them


class ExpertParallelExperts(nn.Module):
    """Stands in for one sparse layer's `mlp.experts` (transformers' Qwen3MoeExperts, all E experts as two 3-D
    weights) with this rank's E / W of them. Same parameter names and layout (gate_up_proj [E, 2 I, d], down_proj
    [E, d, I]), now DTensors sharded on the expert dimension: checkpoints and exports keep the model's keys."""

    def __init__(self, experts: nn.Module, mesh, group):
        super().__init__()
        self.group, self.world, self.rank = group, mesh.size(), mesh.get_local_rank()
        self.num_experts = experts.num_experts
        self.local_experts = self.num_experts // self.world
        self.act_fn = experts.act_fn
        first = self.rank * self.local_experts

        def shard(weight: torch.Tensor) -> nn.Parameter:
            # Every rank built the whole model from the same seed (the same weights as single-ft) and keeps its rows.
            local = weight.detach()[first:first + self.local_experts].clone()
            return nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))

        self.gate_up_proj = shard(experts.gate_up_proj)
        self.down_proj = shard(experts.down_proj)
        # Per forward since the trainer last took them: the rows sent to each rank, and the rows received.
        self.forwards: list[tuple[list[int], int]] = []

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        k = top_k_index.shape[1]
        W, L = self.world, self.local_experts

        # 1. Dispatch. Sort the rank's (token, slot) pairs by expert: the rows for rank r's experts are one block.
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        rows = hidden_states[order // k]  # in the weights' dtype: bf16 under --dtype bf16
        per_expert = torch.bincount(expert_ids, minlength=self.num_experts)  # [E] = W blocks of L
        # Every rank tells every other how many rows it sends to each of that rank's experts...
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=self.group)  # [W blocks of L]: block s = from rank s
        # ...on the host, since they size the exchange: the one device-to-host read of the layer.
        per_expert_out, per_expert_in = torch.stack([per_expert, incoming]).tolist()
        send = [sum(per_expert_out[r * L:(r + 1) * L]) for r in range(W)]
        receive = [sum(per_expert_in[s * L:(s + 1) * L]) for s in range(W)]
        self.forwards.append((send, sum(receive)))
        # ...then the rows themselves, in variable blocks. The functional all-to-all is differentiable: its
        # backward sends the rows' gradients back the same way (torch's own autograd collective, as torchtitan uses).
        received = wait_tensor(all_to_all_single_autograd(rows, receive, send, self.group))

        # 2. Compute. The received rows come by source rank, then by expert: regroup them by local expert.
        local_id = torch.arange(L, device=rows.device).repeat(W).repeat_interleave(
            torch.tensor(per_expert_in, device=rows.device))
        regroup = torch.argsort(local_id, stable=True)
        counts = [sum(per_expert_in[s * L + e] for s in range(W)) for e in range(L)]
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        x = received[regroup]
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        gate, up = grouped_linear(x, gate_up, offsets, counts).chunk(2, dim=-1)
        out = grouped_linear(self.act_fn(gate) * up, down, offsets, counts)
        out = out[torch.argsort(regroup)]  # back in the order the rows arrived

        # 3. Combine. The results go back along the reverse routes, get the router's weights, sum per token.
        back = wait_tensor(all_to_all_single_autograd(out, send, receive, self.group))
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, order // k, weighted.to(hidden_states.dtype))


def shard_experts(model: nn.Module, mesh) -> list[ExpertParallelExperts]:
    """Replace every sparse layer's experts with this rank's slice; returns the new modules in layer order."""
    group, sharded = mesh.get_group("ep"), []
    for layer in model.get_decoder().layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:  # a dense layer (mlp_only_layers): replicated like attention
            continue
        if experts.num_experts % mesh.size():
            raise InputError(f"{experts.num_experts} experts do not split evenly over {mesh.size()} ranks")
        layer.mlp.experts = ExpertParallelExperts(experts, mesh, group)
        sharded.append(layer.mlp.experts)
    if not sharded:  # a hub id or a folder, known once loaded (a dense preset stops before anything starts)
        raise InputError("ep-ft splits the experts of a mixture of experts; this model is dense: use ddp-ft or fsdp-ft")
    return sharded


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts
    if config.lora_rank or config.qlora:
        raise InputError("ep-ft trains every parameter: LoRA on its sharded experts is not built here (single-ft "
                         "--lora-rank trains LoRA on a mixture of experts in one process)")
    if is_preset(config.model) and not is_moe(model_config(config.model)):
        raise InputError(f"ep-ft splits the experts of a mixture of experts; {config.model} is dense: use ddp-ft or "
                         "fsdp-ft")

    # ---------------------------------------------------------------------------------------------------------
    # Processes and device: one process per device, started by torchrun (NCCL/RCCL on GPUs, gloo on CPU).
    dist_info = init_distributed(config.collective_timeout_s, group_of_one=True)
    device = dist_info.device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # bf16: the weights themselves are bf16 (fp32 masters below): no autocast, in evaluation and sampling neither.
    autocast = nullcontext

    # ---------------------------------------------------------------------------------------------------------
    # Data: every rank builds the same rows and takes its own slice of each step (as ddp-ft).
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
    # Every rank builds the whole model (same seed: single-ft's weights), then keeps 1/W of the experts.
    model = load_model(config.model, tokenizer, attention.impl, device=device, allow_moe=True,
                       dtype=weights_dtype(config.dtype, config.lora_rank))
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",))
    ep_layers = shard_experts(model, mesh)
    if config.activation_checkpointing:
        # The recomputed forward runs the layer's all-to-alls again, in backward, on every rank in the same order.
        checkpoint_activations(model, use_reentrant=False)
    if config.compile:
        # One graph per decoder layer (as torchtitan): bounded compile time; in place, so parameter names stay.
        # A graph break stays inside its layer: the expert block's host read of the split sizes is one.
        for layer in model.get_decoder().layers:
            layer.compile()
    # --loss-chunk-tokens runs the decoder body (no LM head) and applies the head itself.
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    moe = RouterStats.attach(model)  # a mixture of experts: each forward's load-balancing loss and expert load
    model.train()
    # --dtype bf16: the trainable weights become bf16, AdamW updates fp32 master copies (common/precision.py).
    masters = MasterWeights(model, torch.bfloat16 if config.dtype == "bf16" else None)  # DTensors: their placements
    n_params = count_parameters(model.config)["total"]
    trainable = masters.parameters  # the fp32 masters, or the model's own trainable weights (fp32)
    n_trainable = sum(p.numel() for p in trainable)
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype}")
    experts = masters.of([p for module in ep_layers for p in module.parameters()])  # DTensors: each rank's shard
    dense = [p for p in trainable if not isinstance(p, DTensor)]  # replicated, as in ddp-ft
    local_expert_params = sum(p.to_local().numel() for p in experts)
    print0(f"ep: {world_size} ranks, each with {ep_layers[0].local_experts} experts of every layer "
           f"({local_expert_params:,} parameters) and every dense parameter ({sum(p.numel() for p in dense):,}) | "
           f"2 all-to-alls per layer forward, 2 backward | backend {dist.get_backend()}")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {world_size} ranks = {rows_per_step} rows "
           f"of {config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU.
    # The experts are a group of their own: their DTensors do not mix with plain tensors in one fused update.
    groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0},
              {"params": experts, "weight_decay": config.weight_decay}]
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
    rec = Recorder(EXPERIMENT, config, device, model.config, data, rows_per_step, world_size=world_size, rank=rank,
                   steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
                   n_parameters=n_params, n_trainable=n_trainable, flops_per_token=model_flops_per_token)
    rec.model.update(expert_parameters_per_rank=local_expert_params)
    dispatches = Dispatches(ep_layers, world_size)  # the rows each expert block sent to each rank (summary.json)
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
        for host_batch, batch in zip(micro_batches, batches):
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            moe.begin()
            dispatches.begin()
            # Divided by the whole step's loss tokens: the micro-batches' gradients sum to the step loss's gradient.
            with autocast():
                # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                if config.loss_chunk_tokens:
                    # The LM head and loss on loss tokens only, picked by the labels' host copy (common/loss.py).
                    hidden = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     attention_mask=None, use_cache=False, **packed).last_hidden_state
                    loss = fused_linear_cross_entropy(hidden, lm_head.weight, host_batch["labels"],
                                                      config.loss_chunk_tokens, step_scale)
                else:
                    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   attention_mask=None, use_cache=False, **packed).logits
                    loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
            # This micro-batch's share of the mean over all ranks' micro-batches: summed over the ranks, single-ft's.
            loss = loss + moe.aux_loss(len(micro_batches) * world_size)
            dispatches.end()
            loss.backward()
            step_loss += loss.detach()
        # The dense gradients: one sum over the ranks per step (after the last micro-batch, as ddp-ft's no_sync).
        all_reduce_in_buckets([p.grad for p in dense if p.grad is not None], int(config.dense_bucket_mb * 2**20))
        rec.state(step, model.parameters(), optimizer, masters.copies)  # weights, gradients, AdamW, masters
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        # The norm before clipping: the dense part counted once, the experts' squares summed over their owners.
        grad_norm = clip_expert_parallel_grad_norm(trainable, max_norm)
        masters.free_weights()  # the bf16 weights are not read again before the next forward (common/precision.py)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        masters.copy_to_model()  # the updated fp32 masters, rounded into the weights the next forward reads
        # The step's loss, aux loss and expert load, summed over the ranks in one call.
        logged = torch.cat([step_loss.reshape(1), moe.step_values()])
        dist.all_reduce(logged)
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        values = torch.cat([logged[:1], grad_norm.reshape(1).float(), logged[1:]]).tolist()
        rec.step(step, values[0], lr, values[1], extra=moe.read(values[2:]))
        dispatches.end_step(profiled=rec.comm.profiled[-1:] == [step + 1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(model, data, config.micro_batch_size, device, autocast))
        if config.sample_every and (step + 1) % config.sample_every == 0 and sample_messages:
            # Every rank generates the same text: each forward's all-to-alls need all of them.
            completion = generate(model, tokenizer, sample_messages, device, autocast=autocast)
            print0(f"sample step {step + 1}: {completion!r}")
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            saved = save_checkpoint(config.out_dir, step + 1, masters.module, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export. Every rank evaluates the whole held-out split (the experts need every rank).
    eval_loss = evaluate(model, data, config.micro_batch_size, device, autocast)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(attention=asdict(attention), eval_loss=eval_loss, master_weights=masters.summary(),
                         **dispatches.summary())

    if config.save_hf:
        masters.restore_masters()  # the fp32 weights, as an export under autocast wrote them
        # Each expert weight gathered from its shards (a collective: every rank calls); rank 0 writes the model.
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.state_dict().items()}
    if config.save_hf and rank == 0:
        save_dir = Path(config.save_hf)
        model.save_pretrained(save_dir, state_dict=full)  # safetensors
        tokenizer.save_pretrained(save_dir)
        record_adapter_base(save_dir, config.model, config.seed)  # a full model: only the files' permissions
        print0(f"saved model to {save_dir}")
    teardown()
    return summary


if __name__ == "__main__":
    run(main)
