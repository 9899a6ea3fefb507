"""Every command line the documentation quotes is accepted by the parser of the script it runs, without running it.

Commands are read from README.md, blogs/*.md, devlog/*.md, experiments/*/README.md, common/README.md and the
docstrings of experiments/*/train.py, common/memory/*.py, common/sweep.py and common/soak.py: every line of a fenced
code block (or docstring) and every `inline code` span, with backslash continuations joined and trailing comments
dropped. A command is one that launches experiments/<name>/train.py (through python, uv run, torchrun or python -m
torch.distributed.run), experiments/infer.py, python -m common.memory, common.sweep or common.soak. Its arguments go
through that script's own parser: common.cli.parse_flags for an experiment (the parser its train.py runs, from its
Config), and the argparse parsers of common.memory, common.soak and common.sweep (whose grids are expanded, so every
cell's flags are parsed by the experiment they launch). A renamed or removed flag anywhere in the docs fails here,
naming the file and line. Commands with a placeholder (`<run>`, `...`, a shell `$variable`) are not exact commands
and are left out.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from common.cli import parse_flags
from conftest import REPO_ROOT, load_experiment, load_infer

DOCUMENTS = ("README.md", "blogs/*.md", "devlog/*.md", "experiments/*/README.md", "common/README.md")
DOCSTRINGS = ("experiments/*/train.py", "experiments/infer.py", "common/memory/*.py", "common/sweep.py",
              "common/soak.py")
MODULES = ("common.memory", "common.sweep", "common.soak")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
SCRIPT = re.compile(r"(?:\./)?experiments/([\w-]+)/train\.py")
LAUNCHER = re.compile(r"(?:.*/)?(?:python3?(?:\.\d+)?|torchrun|uv)")
SHELL_OPERATORS = ("|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1")


@dataclass(frozen=True)
class Command:
    file: str  # relative to the repository root
    line: int
    text: str
    kind: str  # "experiment" or "module"
    target: str  # the experiment's folder name, or the module
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Logical lines of a code block: a line ending in a backslash continues on the next."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        pending = None
        joined.append((number, line))
    if pending is not None:
        joined.append(pending)
    return joined


def markdown_snippets(text: str) -> list[tuple[int, str]]:
    """(line, text) of every logical line of the fenced code blocks and of every inline code span."""
    snippets: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    block: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, block = match.group(1), []
        elif fence is not None and match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
            snippets += join_continuations(block)
            fence = None
        elif fence is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    # Inline code may wrap onto the next line of a paragraph: search the prose as one text.
    prose_text = "\n".join(line for _, line in prose)
    for span in CODE_SPAN.finditer(prose_text):
        line = prose[prose_text.count("\n", 0, span.start())][0]
        snippets.append((line, " ".join(span.group(2).split())))
    return snippets


def docstring_snippets(source: str) -> list[tuple[int, str]]:
    """The module docstring's lines, as a code block (that is how the scripts quote their commands)."""
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[0], ast.Expr) or not isinstance(tree.body[0].value, ast.Constant):
        return []
    first = tree.body[0].lineno
    lines = [(first + index, line) for index, line in enumerate(tree.body[0].value.value.splitlines())]
    return join_continuations(lines)


def as_command(file: str, line: int, snippet: str) -> Command | None:
    """The command a snippet runs, or None when it runs none of the scripts checked here."""
    text = snippet.strip()
    text = text[2:] if text.startswith("$ ") else text  # a shell prompt
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:  # unbalanced quotes: prose, not a command
        return None
    for index, token in enumerate(tokens):
        if token in SHELL_OPERATORS or token.startswith(("2>", ">")):
            tokens = tokens[:index]
            break
    for index, token in enumerate(tokens):
        launched = any(LAUNCHER.fullmatch(t) for t in tokens[:index])
        script = SCRIPT.fullmatch(token)
        if script and launched:
            return Command(file, line, text, "experiment", script.group(1), tuple(tokens[index + 1:]))
        if token in ("experiments/infer.py", "./experiments/infer.py") and launched:
            return Command(file, line, text, "module", "infer", tuple(tokens[index + 1:]))
        if token == "-m" and index + 1 < len(tokens) and tokens[index + 1] in MODULES and launched:
            return Command(file, line, text, "module", tokens[index + 1], tuple(tokens[index + 2:]))
    return None


def is_placeholder(command: Command) -> bool:
    return any(token in ("...", "…") or re.search(r"<[^<>]+>|\$", token) for token in command.argv)


def collect(root: Path = REPO_ROOT) -> tuple[list[Command], list[Command]]:
    """(commands to parse, placeholder commands left out) quoted anywhere in the documentation."""
    found: list[Command] = []
    for pattern in DOCUMENTS + DOCSTRINGS:
        for path in sorted(root.glob(pattern)):
            text = path.read_text(encoding="utf-8")
            snippets = docstring_snippets(text) if path.suffix == ".py" else markdown_snippets(text)
            for line, snippet in snippets:
                command = as_command(path.relative_to(root).as_posix(), line, snippet)
                if command is not None and command not in found:
                    found.append(command)
    exact = [command for command in found if not is_placeholder(command)]
    return exact, [command for command in found if is_placeholder(command)]


COMMANDS, PLACEHOLDERS = collect()


# ---------------------------------------------------------------------------------------------------------------
# Parsing without running


class Parsed(Exception):
    """Raised in place of returning from ArgumentParser.parse_args, so main() stops right after parsing."""


def parse_only(main, argv: list[str]) -> argparse.Namespace | None:
    """Run `main(argv)` only as far as its argparse parser (common.memory builds its parser inside main)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except Parsed as parsed:
            return parsed.args[0]
    raise AssertionError("main() returned without parsing its arguments")


@functools.cache
def experiment_config(name: str):
    if not (REPO_ROOT / "experiments" / name / "train.py").exists():
        raise AssertionError(f"no experiments/{name}/train.py")
    return load_experiment(name).Config


def parse_experiment(name: str, argv: list[str]) -> None:
    experiment_config(name)
    parse_flags(REPO_ROOT / "experiments" / name / "train.py", argv)  # the parser each train.py runs


def parse_module(module_name: str, argv: list[str]) -> None:
    if module_name == "infer":
        load_infer().parse_args(argv)
        return
    if module_name == "common.memory":
        from common import memory

        if hasattr(memory, "build_parser"):
            memory.build_parser().parse_args(argv)
        else:
            parse_only(memory.main, argv)
        return
    if module_name == "common.soak":
        from common import soak

        soak.parse_args(argv)
        return
    from common import sweep

    args = sweep.parse_args(argv)
    if args.grid is None and args.strategies is None:
        return  # an incomplete command (e.g. --help-like); sweep itself reports what is missing
    cells = sweep.expand(sweep.grid_from_args(args), tuple(shlex.split(args.extra_args)))
    # Each cell is a launch of an experiment: its flags must parse there too (--extra-args included).
    for cell in cells:
        experiment, _ = sweep.parse_strategy(cell.strategy)
        argv = sweep.command(cell, Path("runs/cell"))
        parse_experiment(experiment, argv[argv.index(f"experiments/{experiment}/train.py") + 1:])


def refusal(command: Command) -> str | None:
    """Why the command's parser refuses it, or None when it accepts it."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            if command.kind == "experiment":
                parse_experiment(command.target, list(command.argv))
            else:
                parse_module(command.target, list(command.argv))
    except SystemExit as stop:
        if isinstance(stop.code, str):  # a one-line refusal (common/cli.py)
            return stop.code
        if stop.code not in (0, None):  # 0: --help
            return (errors.getvalue().strip().splitlines() or [f"exit {stop.code}"])[-1]
    except (ValueError, AssertionError) as error:
        return str(error)
    return None


def check(command: Command) -> None:
    why = refusal(command)
    if why is not None:
        pytest.fail(f"{command.where}: `{command.text}` is refused by its parser: {why}", pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("command", COMMANDS, ids=[command.where for command in COMMANDS])
def test_quoted_command_parses(command: Command):
    check(command)


def test_every_experiment_has_a_quoted_command(capsys):
    """The extraction finds the commands of every experiment's README (an extractor that finds nothing would let
    every renamed flag through)."""
    experiments = sorted(path.parent.name for path in REPO_ROOT.glob("experiments/*/README.md"))
    quoted = {command.target for command in COMMANDS if command.kind == "experiment"}
    assert experiments and not set(experiments) - quoted, f"no quoted command runs {set(experiments) - quoted}"
    with capsys.disabled():
        print(f"\n{len(COMMANDS)} quoted commands parsed ({sum(c.kind == 'experiment' for c in COMMANDS)} experiment "
              f"launches, {sum(c.kind == 'module' for c in COMMANDS)} common.memory/common.sweep); "
              f"{len(PLACEHOLDERS)} with placeholders left out")


SAMPLE = """
Run `uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py
--grad-accum 2` or see `experiments/ddp-ft/train.py` alone (not a command).

```bash
uv run python experiments/single-ft/train.py --steps 3 \\
    --seq-len 64   # a smoke run
DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 3 | tee
uv run python -m common.memory --model qwen3-4b --gpus 2
diff experiments/single-ft/train.py experiments/ddp-ft/train.py
uv run python experiments/ddp-ft/train.py --out-dir runs/<name>
```
"""


def test_extraction_joins_continuations_and_drops_comments_and_pipes():
    commands = [as_command("sample.md", line, snippet) for line, snippet in markdown_snippets(SAMPLE)]
    commands = [command for command in commands if command is not None]
    found = [(command.line, command.target, command.argv) for command in commands]
    assert found == [
        (6, "single-ft", ("--steps", "3", "--seq-len", "64")),
        (8, "zero-ft", ("--zero-stage", "3")),
        (9, "common.memory", ("--model", "qwen3-4b", "--gpus", "2")),
        (11, "ddp-ft", ("--out-dir", "runs/<name>")),
        (2, "ddp-ft", ("--grad-accum", "2")),
    ]
    assert [is_placeholder(command) for command in commands] == [False, False, False, True, False]


def test_a_renamed_flag_is_refused_naming_file_and_line():
    command = as_command("blogs/01-x.md", 12, "uv run python experiments/single-ft/train.py --grad-accumulation 4")
    with pytest.raises(pytest.fail.Exception, match=r"blogs/01-x\.md:12: .*--grad-accumulation"):
        check(command)
    memory = as_command("devlog/x.md", 3, "uv run python -m common.memory --model qwen3-4b --gpu-memory 24")
    with pytest.raises(pytest.fail.Exception, match=r"devlog/x\.md:3: .*--gpu-memory"):
        check(memory)
    sweep = as_command("README.md", 9, "uv run python -m common.sweep --grid cpu-small --extra-args '--no-such-flag'")
    with pytest.raises(pytest.fail.Exception, match=r"README\.md:9: .*--no-such-flag"):
        check(sweep)
