"""python -m common.memory: each strategy's memory per GPU for a model, and the command to run first.

    uv run python -m common.memory --model qwen3-4b --gpus 2 --gpu RTX-4090
    uv run python -m common.memory --model qwen3-1.7b --gpus 1 --gpu-mem-gib 80 --lora-rank 16
    uv run python -m common.memory --model qwen3-4b --gpus 1 --gpu-mem-gib 16 --qlora
    uv run python -m common.memory --model qwen3-4b --gpus 8 --gpu-mem-gib 24 --micro-batch-size 1 --grad-accum 4
    uv run python -m common.memory --zero-paper          # reproduce Figure 1 of the ZeRO paper

Exit codes: 0 with an answer, 1 when nothing fits (the line says what would), 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from common.memory.activations import ATTENTION_KINDS, layer_activation_terms
from common.memory.estimate import MemoryEstimate, estimate, uses_autocast
from common.memory.recommend import DEFAULT_ROWS_PER_GPU, Ladder, Recommendation, format_multi_node, \
    multi_node_layouts, recommend
from common.memory.states import DTYPES, ERROR_BAND, GIB, NF4_BYTES_PER_WEIGHT, PRECISIONS, STRATEGIES, \
    USABLE_FRACTION, QLORA, ZERO_PAPER, BytesPerParam, ModelShape, model_shape, resolve_precision, strategy_precision, \
    zero_paper_figure1

ZERO_PAPER_FIGURE1_GB = {"baseline": 120, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.9}  # as printed in the paper
COLUMNS = (("weights", "weights_bytes"), ("grads", "grads_bytes"), ("optim", "optimizer_bytes"),
           ("master", "master_bytes"), ("copies", "compute_copy_bytes"), ("activ", "activations_bytes"),
           ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))
# Memory of one GPU for --gpu, in MiB as the driver reports its total (nvidia-smi, rocm-smi), from the cards'
# listings: the workstation cards this project is written for and the data-centre ones its runs use. The makers' "80GB"
# is rounded GiB: an H100 80GB has 81,559 MiB, 79.6 GiB. Names are matched without case, spaces or dashes.
GPU_MEMORY_MIB = {
    "RTX 3090": 24576, "RTX 4090": 24564, "RTX 5090": 32607, "RTX A6000": 49140, "RTX 6000 Ada": 49140,
    "L40S": 46068, "A100 40GB": 40960, "A100 80GB": 81920, "H100": 81559, "H100 NVL": 95830, "H200": 143771,
    "MI100": 32752, "MI210": 65520, "MI300X": 196288,
}
GPU_MEMORY_GIB = {name: round(mib / 1024, 2) for name, mib in GPU_MEMORY_MIB.items()}


class AnswerError(Exception):
    """Bad input that argparse cannot see: one line, exit code 2."""


def gpu_memory_gib(name: str) -> float:
    key = "".join(name.lower().replace("-", " ").split())
    for known, gib in GPU_MEMORY_GIB.items():
        if "".join(known.lower().split()) == key:
            return gib
    raise AnswerError(f"--gpu {name!r} is not in the table; known: {', '.join(GPU_MEMORY_GIB)}; or give "
                      f"--gpu-mem-gib")


def format_zero_paper() -> str:
    lines = [f"ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B parameters, N_d = 64 devices, "
             f"K = {ZERO_PAPER.zero_k}, model states per device in GB (1e9 bytes)",
             f"{'stage':<10} {'formula':<28} {'computed':>9} {'paper':>6}"]
    for stage, formula, gb in zero_paper_figure1():
        lines.append(f"{stage:<10} {formula:<28} {gb:>9.3f} {ZERO_PAPER_FIGURE1_GB[stage]:>6}")
    return "\n".join(lines)


def format_table(estimates: list[MemoryEstimate], gpu_mem_gib: float) -> str:
    header = (f"{'strategy':<14}{'micro':>6}" + "".join(f"{title:>8}" for title, _ in COLUMNS)
              + f"{'peak':>8}  fits  note")
    lines = [header]
    for e in estimates:
        cells = "".join(f"{getattr(e, field) / GIB:>8.2f}" for _, field in COLUMNS)
        adapters = f"QLoRA r{e.lora_rank} (4-bit base)" if e.qlora else f"LoRA r{e.lora_rank}" if e.lora_rank else ""
        note = ", ".join(filter(None, [adapters, e.note, "checkpointing" if e.activation_checkpointing else "",
                                       f"+ {e.cpu_bytes / GIB:.1f} GiB in CPU memory per rank" if e.cpu_bytes else "",
                                       f"peak at the {e.peak_phase}" if e.peak_phase != "backward start" else ""]))
        fits = "yes" if e.fits(gpu_mem_gib) else "no"
        lines.append(f"{e.strategy:<14}{e.micro_batch_size:>6}{cells}{e.total_gib:>8.2f}  {fits:<4}  {note}".rstrip())
    return "\n".join(lines)


def describe_precisions(strategies: list[str], precision: BytesPerParam | str, qlora: bool = False) -> str:
    """Which bytes per parameter the rows use: one convention, or each strategy's experiment under --dtype; under
    QLoRA the 4-bit base's bytes (its frozen weights are NF4, not a bf16 weight of 2 bytes)."""
    if qlora:
        return (f"bytes per trainable parameter under QLoRA ({', '.join(strategies)}): {QLORA.description} = "
                f"{QLORA.trainable}")
    if not isinstance(precision, str):
        return (f"precision {precision.name} for every strategy: {precision.description} = {precision.trainable} "
                f"bytes per trainable parameter")
    groups: dict[BytesPerParam, list[str]] = {}
    for strategy in strategies:
        groups.setdefault(strategy_precision(strategy, precision), []).append(strategy)
    return f"bytes per trainable parameter under --dtype {precision}, as each experiment keeps them:\n" + "\n".join(
        f"  {layout.name}: {layout.description} = {layout.trainable} ({', '.join(members)})"
        for layout, members in groups.items())


def describe_activations(shape: ModelShape, precision: BytesPerParam, tokens: int, seq_len: int, attention: str,
                         lora_rank: int, compiled: bool = False) -> str:
    """The per-layer activation terms for the ddp regime (autocast; single for a mixture of experts, which ddp does not
    train), in bytes per token and in MiB per micro-batch."""
    regime = "single" if shape.is_moe else "ddp"
    autocast = uses_autocast(regime, precision)
    residual = (precision.frozen if lora_rank else precision.weights) if autocast else precision.compute
    terms = layer_activation_terms(shape, compute_bytes=precision.compute, autocast=autocast, seq_len=seq_len,
                                   attention=attention, lora_rank=lora_rank, weight_bytes=precision.weights,
                                   residual_bytes=residual, compiled=compiled)
    total = sum(terms.values())
    listed = " + ".join(f"{name.replace('_', ' ')} {value:,.0f}" for name, value in terms.items() if value)
    how = ", ".join(["autocast" if autocast else "no autocast", attention] + ["compiled"] * compiled)
    return (f"activations per layer of {regime} ({how}): {listed} = {total:,.0f} bytes/token -> "
            f"{total * tokens / 2**20:.1f} MiB per layer per micro-batch of {tokens:,} tokens; checkpointed: "
            f"{residual * shape.hidden:,} bytes/token (the layer's input)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="preset, hub id or local folder (or give the raw counts below)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        parser.add_argument(f"--{flag}", type=int, help="raw geometry, instead of --model")
    parser.add_argument("--untied", action="store_true", help="raw geometry: the LM head is not the embedding")
    for flag in ("experts", "experts-per-token", "expert-intermediate"):
        parser.add_argument(f"--{flag}", type=int, default=0, help="raw geometry of a mixture of experts")
    parser.add_argument("--parameters", type=float, help="raw geometry: a stated total parameter count")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs available")
    parser.add_argument("--gpu", help=f"the GPU's name, for its memory: {', '.join(GPU_MEMORY_GIB)}")
    parser.add_argument("--gpu-mem-gib", type=float,
                        help="memory of one GPU in GiB, as the driver reports it (nvidia-smi's MiB / 1024: an H100 "
                             "80GB has 79.6); default 24, or --gpu's")
    parser.add_argument("--gpu-mem-gb", type=float, help=argparse.SUPPRESS)  # the old name: refused, saying why
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rows-per-gpu", type=int, default=DEFAULT_ROWS_PER_GPU,
                        help="rows of --seq-len tokens each replica takes per optimizer step; the answer splits them "
                             "into the largest micro-batch that fits and --grad-accum")
    parser.add_argument("--micro-batch-size", type=int, help="fix the micro-batch instead of choosing it")
    parser.add_argument("--grad-accum", type=int,
                        help="micro-batches per optimizer step, with --micro-batch-size (1 if not given)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="always checkpoint (otherwise taken where it buys a larger micro-batch)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA of this rank on a frozen base")
    parser.add_argument("--qlora", action="store_true", help="QLoRA: a 4-bit base (single-ft, ddp-ft; CUDA)")
    parser.add_argument("--no-fast", dest="fast", action="store_false",
                        help="price without the speed flags (--attn varlen, --loss-chunk-tokens, --compile)")
    parser.add_argument("--strategy", choices=STRATEGIES, help="show only this strategy")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="the experiments' --dtype; each strategy is priced as its experiment keeps it (zero-ft: "
                             "DeepSpeed's own bf16 or fp32 layout; the others: fp32 weights, autocast or FSDP2 casts)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="instead of --dtype, one bytes-per-parameter convention for every strategy (e.g. "
                             "zero-paper, bf16-rule-of-thumb)")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="sdpa-packed",
                        help="with --no-fast: sdpa-packed (the experiments' default: packed rows through SDPA), sdpa "
                             "(unpacked rows), flash (no mask, grouped K/V heads), flash-expanded-kv")
    parser.add_argument("--interconnect", choices=("pcie", "nvlink"), default="pcie",
                        help="links between the GPUs: decides TP before PP (nvlink) or PP before TP (pcie)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes the --gpus are spread over (evenly): also print the multi-node layouts (HSDP, "
                             "FSDP over all, FSDP x TP) and which to take")
    parser.add_argument("--json", action="store_true",
                        help="print the whole ladder for these settings as JSON instead (every rung in the order the "
                             "recommendation tries them, with its command and GiB per GPU by part: the first that fits "
                             "a GPU's memory is the answer)")
    parser.add_argument("--zero-paper", action="store_true", help="print the ZeRO paper's Figure 1 and exit")
    return parser


def preset_for(name: str) -> tuple[str, str | None]:
    """(name to price, note): a Qwen3 hub id with a preset (base or post-trained, any letter case, with or without
    the `Qwen/`) or a preset in other letter case -> the preset, with a note saying so; anything else unchanged."""
    from common.models import PRESET_HUB_IDS, is_preset

    if is_preset(name) or Path(name).exists():
        return name, None
    # The hub ids that have a preset, in lower case and without "-Base": the post-trained models share its geometry.
    hub_presets = {hub.lower().removesuffix("-base"): preset for preset, hub in PRESET_HUB_IDS.items()}
    key = name.lower().removesuffix("-base")
    key = key if key.startswith("qwen/") else f"qwen/{key}"
    preset = hub_presets.get(key) or (name.lower() if is_preset(name.lower()) else None)
    if preset is None:
        return name, None
    return preset, (f"note: {name} is priced with the {preset} preset: the published geometry of Qwen3's "
                    f"{preset.removeprefix('qwen3-').upper()} model (layers, widths, heads, vocabulary), read "
                    f"without a download")


def _shape(args, parser) -> tuple[ModelShape, str | None]:
    """The model to price, and a note when a hub id is priced with its preset's published geometry (no download)."""
    if args.model:
        name, note = preset_for(args.model)
        try:
            return model_shape(name), note
        except SystemExit as error:  # common.models' loading failure: its first line says what and the fix follows
            raise AnswerError(" ".join(str(error).split("\n"))) from None
        except (OSError, ValueError) as error:
            raise AnswerError(f"--model {args.model}: {error}") from None
    geometry = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
    missing = [name for name, value in geometry.items() if value is None]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        parser.error(f"give --model, or all of the raw counts (missing: {flags})")
    return ModelShape(name="custom", tied_embeddings=not args.untied,
                      parameters=int(args.parameters) if args.parameters else None, experts=args.experts,
                      experts_per_token=args.experts_per_token, expert_intermediate=args.expert_intermediate,
                      **geometry), None


def _command_model(args) -> str:
    """What the command's --model names: the published checkpoint of a real-size preset, else what was asked."""
    from common.models import PRESET_HUB_IDS

    return PRESET_HUB_IDS.get(args.model, args.model or "") if args.model else ""


def varlen_repeats_kv() -> bool:
    """Whether this machine's torch repeats K/V heads in its variable-length attention (common.attention)."""
    try:
        from common.attention import torch_varlen_takes_gqa

        return not torch_varlen_takes_gqa()
    except ImportError:  # no torch.nn.attention.varlen: flash-attn or FlexAttention take grouped heads
        return False


@dataclass
class Asked:
    """A question as the command line asks it, and recommend()'s answer: what answer() prints, and what the posts'
    tables quote (assets/make_posts.py), so both say the same."""
    args: argparse.Namespace
    shape: ModelShape
    gpu_mem_gib: float
    precision: BytesPerParam | str
    kv_expanded: bool
    advice: Recommendation
    ladder: Ladder  # every rung of the question, whatever the memory
    note: str | None = None  # a hub id priced with its preset's geometry


def ask(argv: list[str], parser: argparse.ArgumentParser | None = None) -> Asked:
    """Parse and check `python -m common.memory`'s flags (one line for bad input: argparse's error, or AnswerError)
    and ask recommend() the question they make."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    for flag, value, least in (("--gpus", args.gpus, 1), ("--seq-len", args.seq_len, 1),
                               ("--rows-per-gpu", args.rows_per_gpu, 1), ("--nodes", args.nodes, 1),
                               ("--micro-batch-size", args.micro_batch_size, 1), ("--grad-accum", args.grad_accum, 1),
                               ("--lora-rank", args.lora_rank, 0)):
        if value is not None and value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.gpu_mem_gb is not None:
        parser.error("--gpu-mem-gb is now --gpu-mem-gib: memory is in GiB as the driver reports it (nvidia-smi's MiB "
                     "/ 1024; an H100 80GB has 79.6 GiB), or name the card with --gpu")
    if args.gpu_mem_gib is not None and args.gpu_mem_gib <= 0:
        parser.error(f"--gpu-mem-gib must be > 0, got {args.gpu_mem_gib:g}")
    if args.gpu_mem_gib is not None and args.gpu:
        parser.error(f"--gpu {args.gpu} and --gpu-mem-gib {args.gpu_mem_gib:g} both give the GPU's memory: give one")
    if args.qlora and (args.dtype == "fp32" or args.precision):
        parser.error("--qlora computes in bf16 (its 4-bit weights are dequantized to bf16): drop --dtype fp32 / "
                     "--precision")
    if args.grad_accum and not args.micro_batch_size:
        args.micro_batch_size = 1  # a fixed layout: --grad-accum micro-batches of one row
    if args.gpus % args.nodes:
        parser.error(f"--gpus {args.gpus} must divide evenly over --nodes {args.nodes}")
    gpu_mem_gib = args.gpu_mem_gib or (gpu_memory_gib(args.gpu) if args.gpu else 24.0)
    shape, note = _shape(args, parser)
    if shape.is_moe and (args.lora_rank or args.qlora):
        parser.error(f"{shape.name} is a mixture of experts: LoRA on its experts is not priced (full SFT only)")
    usable_gib = args.gpus * gpu_mem_gib * USABLE_FRACTION
    if not shape.is_moe and shape.total_parameters * NF4_BYTES_PER_WEIGHT / GIB > usable_gib:
        four_bit_gib = shape.total_parameters * NF4_BYTES_PER_WEIGHT / GIB
        raise AnswerError(f"{args.gpus} x {gpu_mem_gib:g} GiB ({usable_gib:.1f} usable in all) cannot hold even "
                          f"{shape.name}'s weights in 4 bits ({four_bit_gib:.1f} GiB): more or larger GPUs")
    precision = PRECISIONS[args.precision] if args.precision else args.dtype
    kv_expanded = varlen_repeats_kv()
    question = dict(seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
                    rows_per_gpu=args.rows_per_gpu, activation_checkpointing=args.activation_checkpointing,
                    lora_rank=args.lora_rank, qlora=args.qlora, precision=precision, attention=args.attention,
                    interconnect=args.interconnect, fast=args.fast, kv_expanded=kv_expanded)
    advice = recommend(shape, args.gpus, gpu_mem_gib, model=_command_model(args), **question)
    return Asked(args, shape, gpu_mem_gib, precision, kv_expanded, advice, Ladder(shape, args.gpus, **question), note)


def answer(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if parser.parse_args(argv).zero_paper:
        print(format_zero_paper())
        return 0
    asked = ask(argv, parser)
    args, shape, gpu_mem_gib, precision, kv_expanded, advice = (asked.args, asked.shape, asked.gpu_mem_gib,
                                                               asked.precision, asked.kv_expanded, asked.advice)
    if asked.note and not args.json:
        print(asked.note)
    if args.json:
        usable_gib = gpu_mem_gib * USABLE_FRACTION
        rungs = [dict(rung, fits=rung["peak_gib"] * (1 + ERROR_BAND) <= usable_gib)
                 for rung in asked.ladder.to_json(_command_model(args))]
        chosen = advice.command()  # the first rung that fits (recommend), as its command; "" when nothing fits
        print(json.dumps(dict(model=shape.name, parameters=shape.total_parameters, gpus=args.gpus,
                              gpu_mem_gib=gpu_mem_gib, usable_gib=usable_gib, seq_len=args.seq_len,
                              usable_fraction=USABLE_FRACTION, error_band=ERROR_BAND, rungs=rungs,
                              choice=next((i for i, rung in enumerate(rungs) if rung["command"] == chosen), None),
                              recommendation=chosen or None,
                              full_fine_tuning_fits=any(rung["fits"] and not rung["lora_rank"] for rung in rungs)),
                         indent=1))
        return 0
    shown = [e for e in advice.estimates if args.strategy in (None, e.strategy)]
    if args.strategy and not shown:  # single on several GPUs, or a layout these GPUs cannot take
        world = 1 if args.strategy == "single" else args.gpus
        try:
            shown = [estimate(shape, args.strategy, world, seq_len=args.seq_len,
                              micro_batch_size=args.micro_batch_size or 1, lora_rank=args.lora_rank,
                              activation_checkpointing=args.activation_checkpointing, precision=precision,
                              attention=args.attention, grad_accum=args.grad_accum or 1, qlora=args.qlora)]
        except ValueError as error:
            raise AnswerError(str(error)) from None
    trainable = shape.lora_parameters(advice.lora_rank or args.lora_rank) if (advice.lora_rank or args.lora_rank) \
        else shape.total_parameters
    mlp = (f"{shape.experts} experts x {shape.expert_intermediate} ({shape.experts_per_token} per token, "
           f"{shape.layers * shape.layer_expert_parameters:,} expert parameters)" if shape.is_moe
           else f"MLP {shape.intermediate}")
    print(f"model {shape.name}: {shape.total_parameters:,} parameters, {trainable:,} trainable | {shape.layers} "
          f"layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, {mlp}, "
          f"vocab {shape.vocab:,}{'' if shape.tied_embeddings else ', untied LM head'}")
    adapters_only = bool(advice.lora_rank) and not (args.lora_rank or args.qlora)  # full SFT fits nowhere
    print(describe_precisions([e.strategy for e in shown], precision, qlora=any(e.qlora for e in shown)))
    chosen = advice.choice
    tokens = (chosen.micro_batch_size if chosen else 1) * args.seq_len
    regime = "single" if shape.is_moe else "ddp"  # describe_activations' regime
    print(describe_activations(shape, resolve_precision(regime, precision), tokens, args.seq_len,
                               "flash-expanded-kv" if args.fast and kv_expanded else "flash" if args.fast
                               else args.attention, advice.lora_rank, compiled=args.fast))
    layout = (f"micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, {args.grad_accum or 1} per step"
              if args.micro_batch_size else
              f"{args.rows_per_gpu} rows of {args.seq_len} tokens per replica per step (the largest micro-batch that "
              f"fits, the rest as --grad-accum)")
    speed = "with each experiment's speed flags (varlen, fused loss, compile)" if args.fast else \
        f"without speed flags ({args.attention})"
    print(f"{layout}, {speed}")
    print(f"\nGiB per device on {args.gpus} x {gpu_mem_gib:g} GiB ({gpu_mem_gib * USABLE_FRACTION:.1f} usable), "
          f"each strategy at its largest micro-batch that fits: a rung fits when its peak plus a {ERROR_BAND:.0%} "
          f"margin for the model's own error (the largest under-prediction over the committed GPU runs) is within the "
          f"usable memory; copies = autocast's bf16 weight copies, buffers = reduce "
          f"buckets, ep's dispatch, gathered FSDP/ZeRO-3 parameters and unsharded gradients; peak = the larger of "
          f"the start of backward and the optimizer step")
    if adapters_only:
        kind = f"QLoRA adapters of rank {advice.lora_rank} on a 4-bit base" if chosen.qlora else \
            f"LoRA adapters of rank {advice.lora_rank}"
        print(f"full fine-tuning fits nowhere on {args.gpus} x {gpu_mem_gib:g} GiB: the rows below train only {kind} "
              f"({trainable:,} parameters), not every weight")
    print(format_table(shown, gpu_mem_gib))
    print()
    if advice.strategy is None:
        print(f"recommendation: none. {advice.reason}")
        return 1
    from common.memory.recommend import _label

    print(f"recommendation: {_label(chosen)}. {advice.reason[0].upper()}{advice.reason[1:]}.")
    print(f"predicted peak: {chosen.total_gib:.2f} GiB per GPU (at the {chosen.peak_phase}) + {chosen.margin_gib:.2f} "
          f"margin ({ERROR_BAND:.0%}) = {chosen.needed_gib:.2f} of {gpu_mem_gib * USABLE_FRACTION:.2f} GiB usable")
    print(f"run: {advice.command()}")
    if args.model and _command_model(args) != args.model:
        print(f"(the preset {args.model} has the same geometry at random init, without a download)")
    if args.nodes > 1:
        layouts = multi_node_layouts(shape, args.nodes, args.gpus // args.nodes, seq_len=args.seq_len,
                                     micro_batch_size=args.micro_batch_size or 1, lora_rank=args.lora_rank,
                                     activation_checkpointing=args.activation_checkpointing, precision=precision,
                                     attention=args.attention, grad_accum=args.grad_accum or 1)
        print()
        print(format_multi_node(layouts, args.nodes, args.gpus // args.nodes, gpu_mem_gib))
    return 0


def main(argv: list[str] | None = None) -> None:
    """The command line; exits with answer()'s code (SystemExit), as a CLI does."""
    try:
        code = answer(argv)
    except AnswerError as error:
        print(f"python -m common.memory: error: {error}", file=sys.stderr)
        code = 2
    if code:
        raise SystemExit(code)
