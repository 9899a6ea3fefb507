"""common.memory's answers, regenerated from the code so they never drift: `memory-cli` (what the command prints),
`memory-table` (several settings in one table) and `answer-table` (the decision guide's commands and tokens/s)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

from ..engine import RegionError, generator
from ..markup import fence, markdown_table
from ..site import Context
from .runs import median_of


@generator("memory-cli", ("args",))
def gen_memory_cli(ctx: Context, args: dict) -> str:
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    argv = shlex.split(args["args"])
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            memory.main(argv)
        except SystemExit as stop:
            if stop.code not in (0, 1, None):  # 1: the CLI answered that nothing fits
                message = errors.getvalue().strip().splitlines() or [str(stop.code)]
                raise RegionError(f"python -m common.memory {args['args']}: {message[-1]}") from None
    return fence(f"$ uv run python -m common.memory {shlex.join(argv)}\n{printed.getvalue().rstrip()}", "text")


def memory_case(text: str):
    """One case of a memory-table or answer-table: the flags of `python -m common.memory`, parsed and answered as the
    command line answers them (common.memory.ask)."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    parser = memory.build_parser()
    parser.exit_on_error = False
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return memory.ask(shlex.split(text), parser)
    except (argparse.ArgumentError, memory.AnswerError, ValueError) as error:
        raise RegionError(f"case '{text.strip()}': {error}") from None
    except SystemExit:
        message = errors.getvalue().strip().splitlines() or ["bad flags"]
        raise RegionError(f"case '{text.strip()}': {message[-1]}") from None


def model_label(shape) -> str:
    """qwen3-4b -> Qwen3-4B, as the posts write the published sizes."""
    name = shape.name.replace("qwen3", "Qwen3").replace("-0.6b", "-0.6B").replace("-1.7b", "-1.7B")
    return re.sub(r"-(\d+)b\b", lambda m: f"-{m.group(1)}B", name).replace("-a3b", "-A3B")


@generator("memory-table", ("cases",), ("strategies",))
def gen_memory_table(ctx: Context, args: dict) -> str:
    """common.memory's prediction for several settings in one table: GiB per GPU of every strategy, each at the
    largest micro-batch that fits (or the micro-batch a case fixes), and the rung recommend() picks (a prediction,
    regenerated from the code)."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    cases = [memory_case(text) for text in args["cases"].split(";") if text.strip()]
    if not cases:
        raise RegionError("memory-table needs cases=\"--model ... --gpus ...; --model ...\"")
    strategies = [name for name in memory.STRATEGIES if any(e.strategy == name for c in cases
                                                            for e in c.advice.estimates)]
    if "strategies" in args:
        wanted = [name.strip() for name in args["strategies"].split(",") if name.strip()]
        unknown = [name for name in wanted if name not in memory.STRATEGIES]
        if unknown:
            raise RegionError(f"memory-table: unknown strategies {', '.join(unknown)}; common.memory has "
                              f"{', '.join(memory.STRATEGIES)}")
        strategies = [name for name in wanted if name in strategies]

    def label(estimate) -> str:
        return (estimate.strategy + (" + checkpointing" if estimate.activation_checkpointing else "")
                + (f" + QLoRA r{estimate.lora_rank}" if estimate.qlora else
                   f" + LoRA r{estimate.lora_rank}" if estimate.lora_rank else "")
                + (f", micro-batch {estimate.micro_batch_size}" if estimate.micro_batch_size > 1 else ""))

    rows = []
    for case in cases:
        flags = case.args
        details = [f"{flags.gpus} x {case.gpu_mem_gib:g} GiB"]
        details += [f"seq {flags.seq_len:,}"] * (flags.seq_len != 1024)
        details += [f"micro-batch {flags.micro_batch_size}"] * bool(flags.micro_batch_size)
        details += [f"LoRA r{flags.lora_rank}"] * bool(flags.lora_rank) + ["QLoRA"] * flags.qlora
        details += ["checkpointing"] * flags.activation_checkpointing + ["no speed flags"] * (not flags.fast)
        details += [flags.interconnect.replace("nvlink", "NVLink").replace("pcie", "PCIe")] * (flags.gpus > 1)
        cells = []
        chosen = case.advice.choice
        for strategy in strategies:
            found = next((e for e in case.advice.estimates if e.strategy == strategy), None)
            if found is None:
                cells.append("-")
                continue
            text = f"{found.total_gib:.1f}" + ("" if found.fits(case.gpu_mem_gib) else " ✗")
            if chosen is not None and label(chosen) == label(found):
                text = f"**{text}**"
            cells.append(text)
        verdict = "none fits" if chosen is None else f"{label(chosen)} ({chosen.total_gib:.1f} GiB)"
        rows.append([f"{model_label(case.shape)}, {', '.join(details)}"] + cells + [verdict])
    table = markdown_table(["setting"] + strategies + ["first rung that fits"], rows,
                           [False] + [True] * len(strategies) + [False])
    return (f"{table}\n\nGiB per GPU predicted by common.memory (`--dtype bf16`, each strategy as its experiment "
            f"keeps it, with the speed flags it takes unless the row says otherwise, at the largest micro-batch of 8 "
            f"rows per step that fits); usable: {memory.USABLE_FRACTION:.0%} of the card; ✗: over it once the "
            f"{memory.ERROR_BAND:.0%} margin for the model's own error is added; bold: the rung "
            f"`recommend()` picks when it needs no more than the setting gives (else its own total, last column).")


# The flags a GPU run takes by default (DESIGN.md section 3): the answer table leaves them out of its short form.
GPU_DEFAULT_FLAGS = ("--seq-len 1024", "--micro-batch-size 1", "--grad-accum 1", "--dtype bf16")


def short_command(command: str, model: str) -> str:
    """`uv run ... experiments/single-ft/train.py --model M --seq-len 1024 --micro-batch-size 8 ...` -> `single-ft
    --micro-batch-size 8 ...`: the experiment and the flags that differ from a GPU run's defaults."""
    short = re.sub(r"^uv run (python|torchrun --nproc_per_node=\d+) experiments/([\w-]+)/train\.py", r"\2", command)
    short = short.replace(f" --model {model}", "")
    for flag in GPU_DEFAULT_FLAGS:
        short = re.sub(rf" {flag}(?= |$)", "", short)
    return short


def total_rate(run) -> float:
    """Tokens over time across the measured steps: sum(tokens) / sum(step time), host waits included."""
    from .runs import timed_steps

    steps = timed_steps(run)
    return sum(step["tokens"] for step in steps) / (sum(step["step_ms"] for step in steps) / 1000)


@generator("answer-table", ("cases", "reference"), ("measured",))
def gen_answer_table(ctx: Context, args: dict) -> str:
    """The answer of the decision guide: per setting (GPUs x model, and what to train: full, or `--lora-rank` for
    adapters, where recommend() takes bf16 LoRA if it fits and QLoRA if not), the rung recommend() gives as its
    experiment and the flags that differ from the defaults (the full commands one click away, below the table), its
    peak per GPU with the margin for the model's error, and its tokens/s: measured where one of the `measured` runs
    ran that command on that GPU, otherwise projected from the `reference` run (a measured GPU run): its tokens over
    its time, scaled by the card's peak FLOP/s and the model's FLOPs per token (the reference's MFU assumed)."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction
    from common.metrics import peak_flops_per_device
    from common.models import model_config, training_flops

    cases = [memory_case(text) for text in args["cases"].split(";") if text.strip()]
    if not cases:
        raise RegionError("answer-table needs cases=\"--model ... --gpus ... --gpu ...; ...\"")
    reference = ctx.site.run(args["reference"])
    reference_device = reference.summary["hardware"]["device_name"]
    reference_peak = peak_flops_per_device(reference_device)
    if reference_peak is None:
        raise RegionError(f"answer-table: the reference ran on {reference_device}, whose peak is not in the table")
    reference_tokens_s = total_rate(reference)

    def flops_per_token(model: str, lora_rank: int, seq_len: int) -> float:
        return training_flops(model_config(model), lora_rank).dense_per_token(seq_len)

    reference_flops = flops_per_token(reference.config["model"], reference.config["lora_rank"],
                                      reference.config["seq_len"])
    measured = ctx.site.runs(args.get("measured", args["reference"]), allow_missing=True)

    def ran(run, case) -> bool:
        """`run` is the rung's command on this case's kind of GPU."""
        rung, config = case.advice.rung, run.config
        same_card = peak_flops_per_device(run.summary["hardware"]["device_name"]) == \
            peak_flops_per_device(case.args.gpu.replace("-", " "))
        return (run.summary["experiment"] == memory.RUN_WITH[rung.strategy].split("/")[1] and same_card
                and run.summary["model"]["parameters"] == case.shape.total_parameters
                and (config["seq_len"], config["micro_batch_size"], config["grad_accum"], config["lora_rank"],
                     config["activation_checkpointing"], bool(config.get("qlora"))) == (
                         case.args.seq_len, rung.micro_batch_size, rung.grad_accum, rung.lora_rank,
                         rung.activation_checkpointing, rung.qlora)
                and ((config["attn"] == "varlen", bool(config.get("loss_chunk_tokens")), bool(config.get("compile")))
                     == rung.fast))

    rows, commands = [], []
    for number, case in enumerate(cases, 1):
        flags, advice = case.args, case.advice
        if not flags.gpu:
            raise RegionError(f"answer-table: case '{flags.model}' names no --gpu (its peak sets the tokens/s)")
        gpus, model = f"{flags.gpus} x {flags.gpu.replace('-', ' ')}", model_label(case.shape)
        if advice.rung is None:
            rows.append([f"{number}. {gpus}, {model}", "nothing fits", "-", "-"])
            continue
        rung = advice.rung
        training = f"QLoRA r{rung.lora_rank}" if rung.qlora else f"LoRA r{rung.lora_rank}" if rung.lora_rank else "full"
        peak = peak_flops_per_device(flags.gpu.replace("-", " "))
        run = next((run for run in measured if ran(run, case)), None)
        source = ""
        if run is not None:
            tokens = f"{median_of('tokens_per_s')(run):,.0f} measured"
            source = f" (measured: {run.name.rsplit('/', 1)[-1]})"
        elif rung.strategy in memory.OFFLOAD_LADDER:
            tokens = "- (AdamW runs on the CPU)"
        elif peak is None:
            tokens = f"- (no peak FLOP/s for {flags.gpu} in common/metrics.py)"
        else:
            replicas = 1 if rung.strategy == "single" else flags.gpus
            scaled = (reference_tokens_s * peak / reference_peak * reference_flops
                      / flops_per_token(flags.model, rung.lora_rank, flags.seq_len) * replicas)
            tokens = f"~{scaled:,.0f} projected"
        commands.append(f"# {number}: {gpus}, {model}, {training}{source}\n{advice.command()}")
        choice = advice.choice
        rows.append([f"{number}. {gpus}, {model}, {training}", f"`{short_command(advice.command(), advice.model)}`",
                     f"{choice.total_gib:.1f} + {choice.margin_gib:.1f} of "
                     f"{case.gpu_mem_gib * memory.USABLE_FRACTION:.1f}", tokens])
    table = markdown_table(["setting", "experiment and flags", "GiB per GPU", "tokens/s"], rows,
                           [False, False, True, True])
    full = fence("\n".join(commands), "bash")
    return (f"{table}\n\n<details><summary>The full commands</summary>\n\n{full}\n\n</details>\n\n"
            f"Each row is what `uv run python -m common.memory --model ... --gpus N --gpu NAME` answers (with "
            f"`--lora-rank 16` where the row trains adapters: bf16 LoRA where it fits, QLoRA where it does not): the "
            f"experiment of its `run:` line and the flags that differ from the defaults (`--seq-len 1024 "
            f"--micro-batch-size 1 --grad-accum 1 --dtype bf16`; add `--model`), and its predicted peak per GPU plus "
            f"the {memory.ERROR_BAND:.0%} margin for the memory model's own error, of what is usable (90% of the "
            f"card, in GiB as the driver reports it). Projected tokens/s take {reference.name.rsplit('/', 1)[-1]}'s "
            f"tokens over its time ({reference_tokens_s:,.0f} tokens/s over its measured steps, host waits included, "
            f"on one {reference_device}) and scale them by the card's dense bf16 peak and the model's FLOPs per token, "
            f"times the GPUs. The assumption: the same MFU as that run, and no time for communication. Neither bounds "
            f"the answer: a slower card waits less on the host, so its MFU can be higher; the GPUs' collectives "
            f"add time.")


def peak_checks(ctx: Context):
    """common.memory.gpu_peak_checks over the committed runs (each run read through the site, so --check names it)."""
    from common import memory

    checks = memory.gpu_peak_checks(ctx.site.root / "devlog" / "data")
    for check in checks:
        ctx.site.run(f"devlog/data/{check.run}")
    if not checks:
        raise RegionError("no committed GPU run measured at or above common.memory.PEAK_TESTED_FROM_GIB")
    return checks


@generator("memory-error", ("stat",), inline=True)
def gen_memory_error(ctx: Context, args: dict) -> str:
    """One number about the memory model's error over the committed GPU runs: `band` (ERROR_BAND, the margin a rung
    keeps, as a whole percentage), `under-now` (the current model's largest under-prediction, reserved / predicted -
    1: in sample, the runs its terms were fitted on), `over-now` (its largest over-prediction, as predicted / reserved),
    `under-start`, `over-start` (the same for the predictions the runs wrote at their start), `count-start` (how many
    runs wrote one)."""
    from common import memory

    checks = peak_checks(ctx)
    now = [(check.predicted_gib, check.measured_gib) for check in checks]
    start = [(check.predicted_at_start_gib, check.measured_gib) for check in checks
             if check.predicted_at_start_gib is not None]
    stat = args["stat"]
    if stat == "band":
        return f"{memory.ERROR_BAND:.0%}"
    if stat == "count-start":
        return str(len(start))
    pairs = {"under-now": now, "over-now": now, "under-start": start, "over-start": start}.get(stat)
    if pairs is None:
        raise RegionError("memory-error: stat is one of band, under-now, over-now, under-start, over-start, "
                          "count-start")
    if not pairs:
        raise RegionError(f"memory-error {stat}: no committed GPU run wrote a prediction at its start")
    if stat.startswith("under"):
        return f"{max(measured / predicted - 1 for predicted, measured in pairs):.1%}"
    return f"{max(predicted / measured for predicted, measured in pairs):.2f}x"


@generator("memory-errors")
def gen_memory_errors(ctx: Context, args: dict) -> str:
    """Every committed GPU run the memory model is tested on, against the current prediction (in sample) and against
    the prediction the run wrote at its start (made before the run, by the model of that day)."""
    from common import memory

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:+.0%}"

    checks = peak_checks(ctx)
    rows = [[ctx.site.run(f"devlog/data/{check.run}").summary["hardware"]["device_name"], check.run.split("/")[-1],
             f"{check.measured_gib:.2f}", f"{check.predicted_gib:.2f}", share(check.under),
             "-" if check.predicted_at_start_gib is None else f"{check.predicted_at_start_gib:.2f}",
             share(check.under_at_start)] for check in checks]
    table = markdown_table(["device", "run", "reserved GiB", "predicted now", "under by", "predicted at its start",
                            "under by"], rows, [False, False, True, True, True, True, True])
    return (f"{table}\n\nUnder by: reserved / predicted - 1 (positive: the run needed more than predicted). Runs "
            f"measured under {memory.PEAK_TESTED_FROM_GIB:g} GiB are left out (fixed per-process allocations the "
            f"model does not price dominate there), as are the peer baseline's TRL runs. `predicted now` is in "
            f"sample where the memory terms were fitted on the run (the H200 suite's). `predicted at its start` is "
            f"what the run wrote before its first step, by the model of that day.")
