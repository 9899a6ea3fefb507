"""Peer baseline: the same fine-tuning through TRL's SFTTrainer (what users would otherwise pick), next to single-ft.

    uv run --group peer python assets/peer_baseline.py --steps 4 --seq-len 128      # CPU smoke run, qwen3-tiny
    uv run --group peer python assets/peer_baseline.py --model Qwen/Qwen3-0.6B-Base --seq-len 1024 \\
        --micro-batch-size 4 --grad-accum 8 --steps 34 --dtype bf16 --activation-checkpointing   # one GPU

One invocation does three things, in this order, and writes everything under --out-dir:
1. `single-ft --steps 0 --save-hf <out>/model`: exports the starting model once (for a preset, its seeded random
   init), so both trainers start from identical weights and the same tokenizer files.
2. single-ft on that folder, as a subprocess: <out>/single-ft/{metrics.jsonl,summary.json}.
3. TRL's SFTTrainer on that folder, in this process: <out>/trl-sft/{metrics.jsonl,summary.json}, written by
   common/metrics.py's MetricsLogger from a TrainerCallback, so the step line, the averages (warm-up steps
   excluded) and the files have the same definitions as every experiment's.
Then it prints both runs' tokens/s (real tokens) and final loss with their ratio, and writes
<out>/peer_baseline.json and <out>/peer_baseline.md.

The same in both runs:
- weights, tokenizer, attention implementation and SDPA backends (common/attention.py decides for both);
- data: the records of --data, validated and converted to messages by common/data.py (`read_conversations`),
  rendered with the same ChatML template with {% generation %} markers, assistant-only loss (TRL's
  `assistant_only_loss=True` reads the same assistant mask); no held-out split in either (single-ft gets
  --eval-fraction 0), so both train on every conversation; conversations longer than --seq-len are cut to their
  first --seq-len tokens in both (the script checks that both count the same number of real tokens);
- B = micro-batch x grad-accum packed rows of at most --seq-len tokens per optimizer step (TRL:
  per_device_train_batch_size x gradient_accumulation_steps), --steps optimizer steps;
- loss normalisation: both divide the summed token losses of a step by the step's number of loss tokens
  (TRL through the Trainer's `num_items_in_batch`), so a step's loss is token-weighted, not a mean of means;
- AdamW (torch; fused on GPU) with betas (0.9, 0.999), eps 1e-8, the same peak LR and weight decay, decay on
  matrices only (the Trainer skips biases and norms by name; Qwen3 has no biases), gradient clipping, bf16
  autocast with fp32 master weights or plain fp32, non-reentrant activation checkpointing when asked;
- the measurement: step time from just after the step's batches are ready to the end of the optimizer step,
  the device synchronised at both ends; tokens/s counts real (non-pad) tokens; the first
  --timing-warmup-steps steps are left out of the averages; peak memory measured the same way.

Not the same (and why the losses are close but not equal):
- packing: single-ft packs first-fit in a seeded shuffled order into padded rows of --seq-len (batch shape
  [micro, seq_len]); TRL packs best-fit decreasing ("bfd") over the whole data set and runs padding-free (each
  micro-batch is its packed rows concatenated into one row without pad, position_ids restarting per
  conversation). So the rows, their order and the real tokens per step differ; TRL's packing is usually a little
  denser. Both keep conversations apart inside a row through the restarted position_ids.
- data order: TRL's sampler shuffles the packed rows with --seed; single-ft's rows follow its own seeded order.
- LR schedule: both warm up linearly over --warmup-steps W and then follow the same cosine to 0 at the last step,
  but transformers' warm-up gives step k (0-based) lr x k/W, so TRL's first step has LR 0 and its warm-up trails
  single-ft's lr x (k+1)/W by one step (single-ft reaches the peak one step earlier). transformers' scheduler has
  no option for the other convention.
- the loss kernel: TRL asks the model for a fused LM-head + cross-entropy (`fused_lm_head=True`, no full
  [tokens, vocab] logits tensor); single-ft materialises the logits and takes cross-entropy in fp32.
- TRL's per-step token counts go through a host synchronisation per micro-batch (its own logging), which
  single-ft avoids; that is part of what a TRL user pays.
- peak memory on CPU is each process's peak RSS: TRL's includes this script, datasets and TRL's own imports,
  and its tokenized copy of the data; on a GPU both are max_memory_reserved of their own process.
- one process and one device only: TRL's multi-GPU launch (accelerate) is not compared here.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, TrainerCallback

from common.attention import document_boundaries, setup_attention
from common.data import CHATML_TEMPLATE, read_conversations
from common.dist import init_distributed
from common.metrics import MetricsLogger, StepClock, hardware_info, repository_relative, summary_table
from common.models import count_parameters, flops_per_token, is_preset, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    model: str = "qwen3-tiny"  # preset, hub id or local folder: exported once, then trained by both
    data: str = "assets/data/sft_en.jsonl"  # JSONL file or folder of them
    seq_len: int = 128  # tokens per packed row (TRL: max_length)
    micro_batch_size: int = 1  # packed rows per forward (TRL: per_device_train_batch_size)
    grad_accum: int = 4  # micro-batches per optimizer step (TRL: gradient_accumulation_steps)
    steps: int = 6  # optimizer steps (TRL: max_steps)
    lr: float | None = None  # peak learning rate; default as single-ft's: 1e-3 for presets, 2e-5 otherwise
    warmup_steps: int = 2  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    seed: int = 0  # single-ft's init and data order; TRL's sampler
    dtype: Literal["bf16", "fp32"] | None = None  # default bf16 on GPU, fp32 on CPU (as single-ft)
    activation_checkpointing: bool = False  # both: non-reentrant recomputation of each decoder layer
    attn: Literal["auto", "sdpa", "eager", "flash"] = "auto"  # passed to both; common/attention.py decides
    timing_warmup_steps: int = 2  # first steps left out of the averages, in both runs
    out_dir: str = "runs/peer-baseline"  # model/, single-ft/, trl-sft/, peer_baseline.{json,md}


def resolve(config: Config) -> Config:
    if config.dtype is None:
        config.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    if config.lr is None:
        config.lr = 1e-3 if is_preset(config.model) else 2e-5
    data = Path(config.data)
    if not data.is_absolute() and not data.exists():
        config.data = str(REPO_ROOT / data)
    return config


def run_single_ft(*args) -> None:
    """Run experiments/single-ft/train.py with this invocation's python; stop with its output if it fails."""
    argv = [sys.executable, str(REPO_ROOT / "experiments" / "single-ft" / "train.py"), *map(str, args)]
    print(f"$ {shlex.join(argv)}", flush=True)
    if subprocess.run(argv, cwd=REPO_ROOT).returncode != 0:
        raise SystemExit("single-ft failed (output above)")


# ---------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer, measured with the project's metrics


class StepMetrics(TrainerCallback):
    """Times each optimizer step and logs it through MetricsLogger once the Trainer has logged its loss.

    The Trainer fetches a step's micro-batches before on_step_begin, so (as in single-ft) data loading is not in
    step_ms. It calls on_log right after on_step_end with the step's token-weighted loss (logging_steps=1).
    """

    def __init__(self, metrics: MetricsLogger, device: torch.device):
        self.metrics = metrics
        self.clock = StepClock(device)  # as single-ft's Recorder times its steps
        self.tokens_before = 0
        self.step_ms = 0.0
        self.step_tokens = 0
        self.collated: deque[list[int]] = deque()  # conversation lengths per micro-batch collated, not yet run
        self.step_documents: list[int] = []  # those of the micro-batches this step ran: its attention FLOPs

    def watch(self, model, collator):
        """TRL's collator, also noting the conversation lengths of each padding-free micro-batch (its position_ids
        restart at 0 for every conversation), and a hook that hands them to the step whose forward takes the
        micro-batch: accelerate's data loader collates one micro-batch ahead, so collation says nothing of steps."""
        def collate(examples):
            batch = collator(examples)
            cu_seq_lens, _ = document_boundaries(batch["position_ids"].reshape(1, -1))
            self.collated.append((cu_seq_lens[1:] - cu_seq_lens[:-1]).tolist())
            return batch

        model.register_forward_pre_hook(lambda module, args: self.step_documents.extend(self.collated.popleft()))
        return collate

    def on_step_begin(self, args, state, control, **kwargs):
        self.tokens_before = state.num_input_tokens_seen
        self.step_documents = []
        self.clock.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.stop()
        self.step_ms = self.clock.elapsed_ms()
        self.step_tokens = state.num_input_tokens_seen - self.tokens_before

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            # loss_tokens is None: the Trainer keeps the step's loss-token count (num_items_in_batch) to itself.
            self.metrics.log_step(state.global_step, logs["loss"], logs["learning_rate"],
                                  logs.get("grad_norm") or math.nan, self.step_tokens, None, self.step_ms, 0.0,
                                  documents=self.step_documents)


def chat_template_for(tokenizer) -> str:
    """A template with {% generation %} markers, for tools that need them (TRL's assistant_only_loss)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "{% generation %}" in template:
        return template
    return CHATML_TEMPLATE


def run_trl(config: Config, model_dir: Path, out_dir: Path, expected_real_tokens: int) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    device = init_distributed().device
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn)
    tokenizer = load_tokenizer(str(model_dir))
    # The template single-ft renders with (the tokenizer's own when it has {% generation %} markers, else
    # common/data.py's ChatML), so TRL does not swap in a training template of its own.
    tokenizer.chat_template = chat_template_for(tokenizer)
    records = [{"messages": conversation.messages} for conversation in read_conversations(config.data)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention.impl)

    # TRL turns checkpointing on by default; here it follows the flag, as in single-ft. transformers renamed the
    # argument (transformers 5.17 knows only gradient_checkpointing, later ones activation_checkpointing too).
    name = next(n for n in ("activation_checkpointing", "gradient_checkpointing") if n in SFTConfig.__dataclass_fields__)
    checkpointing = {name: config.activation_checkpointing, f"{name}_kwargs": {"use_reentrant": False}}
    arguments = SFTConfig(
        **checkpointing, output_dir=str(out_dir), max_steps=config.steps, per_device_train_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.grad_accum, learning_rate=config.lr, lr_scheduler_type="cosine",
        warmup_steps=config.warmup_steps, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch", seed=config.seed, data_seed=config.seed,
        bf16=config.dtype == "bf16", fp16=False, use_cpu=device.type == "cpu",
        max_length=config.seq_len, packing=True, packing_strategy="bfd", assistant_only_loss=True,
        include_num_input_tokens_seen="non_padding", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True)
    metrics = MetricsLogger(out_dir=out_dir, total_steps=config.steps,
                            warmup_steps=min(config.timing_warmup_steps, max(0, config.steps - 1)),
                            model_config=model.config, device=device, world_size=1, is_main=True)
    step_metrics = StepMetrics(metrics, device)
    trainer = SFTTrainer(model=model, args=arguments, train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer, callbacks=[step_metrics])
    trainer.data_collator = step_metrics.watch(model, trainer.data_collator)

    # Same data check: after templating and truncation both must hold exactly the same real tokens.
    packed = trainer.train_dataset
    trl_real_tokens = sum(sum(lengths) for lengths in packed["seq_lengths"])
    if trl_real_tokens != expected_real_tokens:
        raise SystemExit(f"TRL's data holds {trl_real_tokens:,} real tokens, single-ft's {expected_real_tokens:,}: "
                         f"the two runs would not train on the same data")
    print(f"TRL data: {len(packed):,} packed rows (bfd), {trl_real_tokens:,} real tokens, packing efficiency "
          f"{trl_real_tokens / (len(packed) * config.seq_len):.1%}")

    started = time.perf_counter()
    trainer.train()
    wall_s = time.perf_counter() - started
    n_params = count_parameters(model.config)["total"]
    return metrics.write_summary(
        experiment="trl-sft", command=shlex.join(["uv", "run", "--group", "peer", "python", *repository_relative(sys.argv)]),
        config=asdict(config), trl_args=arguments.to_dict(),
        hardware=hardware_info(device, world_size=1), attention=asdict(attention),
        model=dict(name=str(model_dir), parameters=n_params, trainable_parameters=n_params,
                   flops_per_token=flops_per_token(model.config, config.seq_len)),
        t_eff=config.micro_batch_size * config.grad_accum * config.seq_len, eval_loss=None,
        packing_efficiency=trl_real_tokens / (len(packed) * config.seq_len), train_wall_s=wall_s,
        n_conversations=len(records), versions=dict(trl=_version("trl")))


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# The comparison


def comparison(single: dict, trl: dict) -> dict:
    """Headline numbers of both runs and TRL / single-ft ratios (> 1 means TRL has more of it)."""
    keys = ("tokens_per_s", "step_ms", "peak_mem_gib", "final_loss", "packing_efficiency")
    result = {"single-ft": {k: single.get(k) for k in keys}, "trl-sft": {k: trl.get(k) for k in keys}}
    result["trl_over_single_ft"] = {k: (trl[k] / single[k] if trl.get(k) is not None and single.get(k) else None)
                                    for k in keys}
    result["measured_steps"] = {"single-ft": single.get("measured_steps"), "trl-sft": trl.get("measured_steps")}
    result["memory_measure"] = single.get("memory_measure")
    return result


def markdown(result: dict, config: Config) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    formats = {"tokens_per_s": ",.0f", "step_ms": ",.0f", "peak_mem_gib": ".2f", "final_loss": ".4f",
               "packing_efficiency": ".1%"}
    checkpointing = ", activation checkpointing" if config.activation_checkpointing else ""
    title = (f"Peer baseline: {config.model}, seq_len {config.seq_len}, B = {config.micro_batch_size} x "
             f"{config.grad_accum} rows, {config.steps} steps, {config.dtype}{checkpointing}")
    lines = [title, "", "| metric | single-ft | TRL SFTTrainer | TRL / single-ft |", "|---|---|---|---|"]
    for key, fmt in formats.items():
        lines.append(f"| {key} | {number(result['single-ft'][key], fmt)} | {number(result['trl-sft'][key], fmt)} | "
                     f"{number(result['trl_over_single_ft'][key], '.3f')} |")
    measured = result["measured_steps"]
    lines += ["", (f"Averages over {measured['single-ft']} (single-ft) and {measured['trl-sft']} (TRL) measured "
                   f"steps; tokens/s counts real tokens; peak memory: {result['memory_measure']}.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    (config,) = HfArgumentParser(Config).parse_args_into_dataclasses(args=argv)
    config = resolve(config)
    out = Path(config.out_dir).resolve()  # single-ft runs with the repository root as its working directory
    model_dir = out / "model"
    print(f"config: {json.dumps(asdict(config))}")

    shared = ["--seq-len", config.seq_len, "--seed", config.seed, "--dtype", config.dtype, "--attn", config.attn,
              "--data", config.data]
    run_single_ft("--model", config.model, "--steps", 0, "--eval-fraction", 0, "--save-hf", model_dir,
                  "--out-dir", out / "export", *shared)
    training = ["--micro-batch-size", config.micro_batch_size, "--grad-accum", config.grad_accum, "--steps",
                config.steps, "--lr", config.lr, "--warmup-steps", config.warmup_steps, "--weight-decay",
                config.weight_decay, "--max-grad-norm", config.max_grad_norm, "--timing-warmup-steps",
                config.timing_warmup_steps, "--eval-fraction", 0, *shared]
    if config.activation_checkpointing:
        training.append("--activation-checkpointing")
    run_single_ft("--model", model_dir, "--out-dir", out / "single-ft", *training)
    single = json.loads((out / "single-ft" / "summary.json").read_text())

    print("\n--- TRL SFTTrainer on the same model, data and batch ---", flush=True)
    trl = run_trl(config, model_dir, out / "trl-sft", expected_real_tokens=single["data"]["train_tokens"])
    print(summary_table(trl))

    result = comparison(single, trl)
    result["config"] = asdict(config)
    (out / "peer_baseline.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result, config)
    (out / "peer_baseline.md").write_text(table)
    print(f"\n{table}\nwrote {out / 'peer_baseline.json'} and {out / 'peer_baseline.md'}")
    return result


if __name__ == "__main__":
    main()
