"""The command line every experiment shares: its Config's flags, --help, one-line errors, and a run's plan.

Reads the Config from the script's source (no torch import): see common/README.md."""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import json
import math
import os
import sys
import time
import tokenize
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # common/ (installed or in the repository)
PROJECT_ROOT = PACKAGE_ROOT.parent  # the repository, when common/ is used from a clone (an editable install)


class InputError(SystemExit):
    """A refusal of the run's input, the same on every rank: exit status 2, reported by rank 0."""


class FlagError(InputError):
    """A mistake on the command line alone (the same on every rank)."""


@dataclass(frozen=True)
class Flag:
    name: str  # the Config field
    annotation: str  # as written: "int", "str | None", "Literal['bf16', 'fp32'] | None", ...
    default: object
    comment: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def base_type(self) -> str:
        parts = [part.strip() for part in self.annotation.split("|")]
        return next(part for part in parts if part != "None") if len(parts) > 1 else parts[0]

    @property
    def choices(self) -> list[str] | None:
        base = self.base_type
        return ast.literal_eval(f"[{base[len('Literal['):-1]}]") if base.startswith("Literal[") else None


def config_flags(path: str | Path) -> tuple[str, list[Flag]]:
    """(module docstring, the fields of `class Config` with their defaults and comments) from a script's source."""
    source = Path(path).read_text(encoding="utf-8")
    tree = ast.parse(source)
    config = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Config"), None)
    if config is None:
        raise SystemExit(f"{path}: no `class Config` to read the flags from")
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    lines = source.splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    def comment(lineno: int) -> str:
        """The field's comment, with the deeper-indented comment-only lines below it that continue it."""
        parts, field_indent = [comments.get(lineno, "")], indent(lines[lineno - 1])
        while lineno < len(lines) and lines[lineno].lstrip().startswith("#") and indent(lines[lineno]) > field_indent:
            lineno += 1
            parts.append(comments[lineno])
        return " ".join(part for part in parts if part)

    flags = [Flag(node.target.id, ast.unparse(node.annotation), ast.literal_eval(node.value), comment(node.lineno))
             for node in config.body if isinstance(node, ast.AnnAssign) and node.value is not None]
    return ast.get_docstring(tree) or "", flags


# ---------------------------------------------------------------------------------------------------------------
# Values every experiment shares: what a field allows (strategy-specific limits stay in the scripts).

AT_LEAST = {  # field -> smallest allowed value
    "seq_len": 1, "micro_batch_size": 1, "grad_accum": 1, "log_every": 1, "stages": 1, "stages_per_rank": 1,
    "tp_degree": 1, "replicate_degree": 1,
    "steps": 0, "warmup_steps": 0, "lora_rank": 0, "eval_every": 0, "sample_every": 0, "checkpoint_every": 0,
    "keep_checkpoints": 0,
    "loss_chunk_tokens": 0, "timing_warmup_steps": 0, "comm_profile_steps": 0, "max_grad_norm": 0,
    "weight_decay": 0,
}
ABOVE_ZERO = ("lr", "lora_alpha", "epochs", "bucket_cap_mb", "dense_bucket_mb")


def _check_values(values: dict, flags: dict[str, Flag]) -> None:
    """Ranges and pairs, on the flags given (defaults are right by construction)."""
    def option(name: str) -> str:
        return flags[name].option

    for name, value in values.items():
        if isinstance(value, bool) or value is None:
            continue
        if name in AT_LEAST and value < AT_LEAST[name]:
            raise FlagError(f"{option(name)} {value}: must be >= {AT_LEAST[name]}")
        if name in ABOVE_ZERO and not value > 0:
            raise FlagError(f"{option(name)} {value}: must be > 0")
        if name == "eval_fraction" and not 0.0 <= value < 1.0:
            raise FlagError(f"{option(name)} {value}: must be in [0, 1) (a share of the conversations)")
    if "steps" in values and values.get("epochs") is not None:
        raise FlagError("--steps and --epochs both given: the run's length is one or the other")
    lora = values.get("lora_rank") or values.get("qlora")
    if values.get("lora_alpha") is not None and not lora:
        raise FlagError(f"--lora-alpha {values['lora_alpha']:g} scales LoRA adapters: it needs --lora-rank N "
                        f"(without it every parameter trains)")
    if values.get("lora_fused") and not lora:
        raise FlagError("--lora-fused computes LoRA adapters in fewer kernels: it needs --lora-rank N (or --qlora)")
    if values.get("merge_lora") and not lora:
        raise FlagError("--merge-lora merges LoRA adapters into the model: it needs --lora-rank N")
    if values.get("merge_lora") and not values.get("save_hf") and not values.get("qlora"):  # --qlora: its own refusal
        raise FlagError("--merge-lora changes what --save-hf writes: add --save-hf DIR")
    if values.get("resume_anyway") and not values.get("resume"):
        raise FlagError("--resume-anyway only changes what --resume accepts: add --resume RUN_DIR")


# ---------------------------------------------------------------------------------------------------------------
# The parser


def _to_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _typed(kind: type, what: str):
    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    return convert


def _one_of(choices: list[str]):
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return convert


CONVERTERS = {"int": _typed(int, "an integer"), "float": _typed(float, "a number"), "str": str}


def _shown_default(flag: Flag) -> str:
    if flag.default is None:
        # The comment explains a default the script derives (from the device or the model), or nothing is set.
        return "" if "default" in flag.comment else " (default: none)"
    if isinstance(flag.default, bool):
        return f" (default: {'on' if flag.default else 'off'})"
    return f" (default: {flag.default})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        message = message.removeprefix("argument ")
        message = message.replace("expected one argument", "needs a value")
        raise FlagError(f"{message} ({self.prog} --help lists every flag)")


def build_parser(path: str | Path) -> tuple[_Parser, dict[str, Flag]]:
    doc, flags = config_flags(path)
    prog = Path(path).name if Path(path).parent.name in ("", ".") else f"{Path(path).parent.name}/{Path(path).name}"
    parser = _Parser(prog=prog, usage="%(prog)s [--flag VALUE ...]", description=doc,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                     argument_default=argparse.SUPPRESS)
    for flag in flags:
        text = (flag.comment or "").replace("%", "%%") + _shown_default(flag)
        if flag.base_type == "bool":
            parser.add_argument(flag.option, dest=flag.name, nargs="?", const=True, type=_to_bool, metavar="BOOL",
                                help=text)
            if flag.default is True:
                parser.add_argument("--no-" + flag.option[2:], dest=flag.name, action="store_const", const=False,
                                    help=f"turn {flag.option} off")
        elif flag.choices is not None:
            parser.add_argument(flag.option, dest=flag.name, type=_one_of(flag.choices),
                                metavar="{" + ",".join(flag.choices) + "}", help=text)
        else:
            parser.add_argument(flag.option, dest=flag.name, type=CONVERTERS[flag.base_type],
                                metavar=flag.base_type.upper(), help=text)
    return parser, {flag.name: flag for flag in flags}


def _normalized(argv: list[str]) -> list[str]:
    """--seq_len -> --seq-len (the value after '=' untouched)."""
    result = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        result.append(arg)
    return result


def parse_flags(path: str | Path, argv: list[str]) -> dict:
    """The flags given on the command line, as {field: value}, checked; FlagError (one line) on any mistake."""
    parser, flags = build_parser(path)
    namespace, unknown = parser.parse_known_args(_normalized([str(arg) for arg in argv]))
    if unknown:
        first = unknown[0]
        if first.startswith("-"):
            options = [option for action in parser._actions for option in action.option_strings]
            close = difflib.get_close_matches(first.partition("=")[0], options, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FlagError(f"{first.partition('=')[0]}: no such flag{hint} ({parser.prog} --help lists every flag)")
        raise FlagError(f"unexpected argument {first!r}: every value follows its flag, e.g. --steps 3 "
                        f"({parser.prog} --help lists every flag)")
    values = vars(namespace)
    _check_values(values, flags)
    return values


def parse_config(config_class, argv: list[str] | None = None):
    """The calling script's Config from `argv`; only the given flags are passed (defaults stay there)."""
    import inspect

    path = inspect.getsourcefile(config_class)
    values = parse_flags(path, sys.argv[1:] if argv is None else list(argv))
    return config_class(**values)


# ---------------------------------------------------------------------------------------------------------------
# Stopping with one line


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report_stop(stop: SystemExit) -> int:
    """Print a stop's message on rank 0, leave it in torchrun's error file; returns the exit status."""
    message = stop.code
    if message is None or isinstance(message, int):
        return message or 0
    message = str(message)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    launched = error_file and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if isinstance(stop, InputError) and launched and _rank() != 0:
        # every rank meets the same refusal: the others leave quietly, so torchrun lists one failure
        return 0
    if error_file:
        # torchrun's failure summary shows the record's "py_callstack" as the failure's traceback: our line.
        record = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        Path(error_file).write_text(json.dumps({"message": record}))
    if _rank() == 0 or not error_file:
        print(message, file=sys.stderr, flush=True)
    if isinstance(stop, InputError):
        if launched:
            time.sleep(1.0)  # the other ranks, stopping on the same refusal, leave first (not killed as failures)
        return 2
    return 1


def stop_early(module_name: str, path: str) -> None:
    """`stop_early(__name__, __file__)` before a script's heavy imports: --help, and a flag mistake, answer now."""
    if module_name != "__main__":
        return
    argv = sys.argv[1:]
    if _rank() != 0 and ("-h" in argv or "--help" in argv):
        raise SystemExit(0)
    try:
        parse_flags(path, argv)
    except SystemExit as stop:
        raise SystemExit(report_stop(stop)) from None


def run(main) -> None:
    """`if __name__ == "__main__": run(main)`: main(), a stop or running out of GPU memory reported as one line."""
    try:
        main()
    except SystemExit as stop:
        raise SystemExit(report_stop(stop)) from None
    except Exception as error:
        if type(error).__name__ != "OutOfMemoryError":
            raise
        raise SystemExit(report_stop(SystemExit(out_of_memory(error)))) from None


def out_of_memory(error: BaseException) -> str:
    """One line for torch.OutOfMemoryError: the step, the peak, the common.memory command to price it."""
    frame_locals = {}
    traceback = error.__traceback__
    while traceback is not None and not frame_locals:  # the outermost main(): the script's
        if traceback.tb_frame.f_code.co_name == "main":
            frame_locals = traceback.tb_frame.f_locals
        traceback = traceback.tb_next
    config, step = frame_locals.get("config"), frame_locals.get("step")
    where = f"at step {step + 1}" if isinstance(step, int) else "before the first step"
    import torch

    peak, gpu = "", ""
    if torch.cuda.is_available():
        total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        peak = f" (peak {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved of {total_bytes / 2**30:.1f} GiB)"
        gpu = f" --gpu-mem-gib {total_bytes / 2**30:.1f}"
    price = "python -m common.memory --model MODEL --seq-len N"
    if config is not None and hasattr(config, "seq_len"):
        flags = [f"--model {config.model}", f"--seq-len {config.seq_len}",
                 f"--micro-batch-size {getattr(config, 'micro_batch_size', 1)}"]
        flags += [f"--lora-rank {config.lora_rank}"] if getattr(config, "lora_rank", 0) else []
        flags += ["--activation-checkpointing"] if getattr(config, "activation_checkpointing", False) else []
        flags += ["--qlora"] if getattr(config, "qlora", False) else []
        price = f"python -m common.memory {' '.join(flags)} --gpus {os.environ.get('WORLD_SIZE', '1')}{gpu}"
    return (f"out of GPU memory {where}{peak}: price this run and what fits with `{price}`; a smaller "
            f"--micro-batch-size, --activation-checkpointing or --lora-rank lowers the peak")


# ---------------------------------------------------------------------------------------------------------------
# Where a run reads and writes, and how long it runs


def find_file(path: str) -> str:
    """A relative path not found here, looked up in the repository's root or the installed package."""
    given = Path(path)
    if given.exists() or given.is_absolute():
        return path
    for root in (PROJECT_ROOT, PACKAGE_ROOT):
        if (root / given).exists():
            return str(root / given)
    return path


def resolve_paths(config, experiment: str) -> None:
    """--data found, --seq-len checked, --resume and --out-dir resolved (after the group exists)."""
    config.data = find_file(config.data)
    check_seq_len(config.model, config.seq_len)
    if config.resume:
        from common.checkpoint import find_checkpoint

        config.resume = str(find_checkpoint(config.resume, experiment))
        if config.out_dir is None and Path(config.resume).parent.name == "checkpoints":
            config.out_dir = str(Path(config.resume).parent.parent)
    if config.out_dir is None:
        import torch.distributed as dist

        stamp = [datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(stamp, src=0)
        config.out_dir = str(Path("runs") / f"{experiment}-{stamp[0]}")


def check_seq_len(model: str, seq_len: int) -> None:
    """Refuses a row longer than the model's positions (never learned) before anything loads."""
    from common.models import model_config

    positions = getattr(model_config(model), "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise FlagError(f"--seq-len {seq_len:,}: longer than {model}'s {positions:,} positions "
                        f"(max_position_embeddings); use --seq-len {positions:,} or less")


def _finished(out_dir: str, steps: int) -> bool:
    """The run in `out_dir` wrote its summary after these many steps (a later checkpoint need not exist)."""
    try:
        summary = json.loads((Path(out_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return summary.get("config", {}).get("steps") == steps and summary.get("final_loss") is not None


@dataclass(frozen=True)
class RunPlan:
    steps: int
    steps_per_epoch: float  # optimizer steps in one pass over the training rows
    identity: dict  # what a resumed run must share with this one (common.checkpoint.check_identity)


REPEATS_NOTED = 3  # a run that goes over its training rows more often than this says so at the start


def plan_run(experiment: str, config, stats: dict, rows_per_step: int, print_fn=print) -> RunPlan:
    """After the data: steps (--epochs), notes on repeats and warm-up, the --resume check. Sets config.steps."""
    n_rows = stats["n_train_rows"]
    steps_per_epoch = n_rows / rows_per_step
    if getattr(config, "epochs", None) is not None:
        config.steps = max(1, math.ceil(config.epochs * steps_per_epoch))
        print_fn(f"--epochs {config.epochs:g}: {config.epochs:g} x {n_rows:,} training rows / {rows_per_step} rows "
                 f"per step -> {config.steps} steps")
    epochs = config.steps / steps_per_epoch
    if epochs > REPEATS_NOTED:
        print_fn(f"note: {config.steps} steps of {rows_per_step} rows go over the {n_rows:,} training rows "
                 f"{epochs:.1f} times (epochs); --epochs N sets the length in passes over the data")
    if 0 < config.steps < config.warmup_steps:
        print_fn(f"note: --warmup-steps {config.warmup_steps} is longer than the run ({config.steps} steps): the "
                 f"learning rate climbs to {config.steps / config.warmup_steps:.0%} of --lr and never decays")
    identity = dict(experiment=experiment, model=config.model, seq_len=config.seq_len, packing=config.packing,
                    rows_per_step=rows_per_step, seed=config.seed, lora_rank=config.lora_rank,
                    data={key: stats[key] for key in ("n_conversations", "n_train_rows", "train_tokens",
                                                      "train_loss_tokens")})
    if config.resume:
        from common.checkpoint import check_identity, checkpoint_step

        check_identity(config.resume, identity, allow=getattr(config, "resume_anyway", False), print_fn=print_fn)
        step = checkpoint_step(config.resume)
        if _finished(config.out_dir, config.steps):
            from common.dist import teardown

            print_fn(f"--resume {config.resume}: the run is complete ({config.steps} steps, summary.json written); "
                     f"nothing to train, {config.out_dir} left as it is")
            teardown()
            raise SystemExit(0)
        if step > config.steps:
            raise SystemExit(f"--resume {config.resume}: the checkpoint is past the run's end (step {step} of --steps "
                             f"{config.steps}); give the --steps it was written with")
        if step == config.steps:
            print_fn(f"--resume {config.resume}: the checkpoint is of the run's last step: no step to train, the "
                     f"evaluation and the summary follow")
    return RunPlan(steps=config.steps, steps_per_epoch=steps_per_epoch, identity=identity)
