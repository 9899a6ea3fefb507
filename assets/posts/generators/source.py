"""The repository's source as it is now: `code` (a symbol or a span of a file), `diff` (hunks of a unified diff)
and `diffstat` (lines added and removed per file against a base)."""

from __future__ import annotations

import ast
import difflib
import glob
import textwrap
from pathlib import Path

from ..engine import RegionError, generator
from ..markup import fence, markdown_table
from ..site import Context

LANGUAGES = {".py": "python", ".sh": "bash", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json",
             ".md": "markdown", ".jinja": "jinja"}


def symbol_lines(source: str, symbol: str, name: str) -> tuple[int, int]:
    """First and last line (1-based) of a top-level function, class or assignment, or `Class.method`."""
    body = ast.parse(source).body
    *parents, last = symbol.split(".")
    for parent in parents:
        classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == parent]
        if not classes:
            raise RegionError(f"{name} has no class {parent}")
        body = classes[0].body

    def names(node) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    found = [node for node in body if last in names(node)]
    if not found:
        raise RegionError(f"{name} defines no {symbol} at its top level")
    if len(found) > 1:
        lines = ", ".join(str(node.lineno) for node in found)
        raise RegionError(f"{name} defines {symbol} {len(found)} times (lines {lines})")
    node = found[0]
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def line_matching(lines: list[str], text: str, name: str, what: str, after: int = 0, unique: bool = True) -> int:
    hits = [index for index in range(after, len(lines)) if text in lines[index]]
    if not hits:
        raise RegionError(f"{what}: no line of {name}{' after the start' if after else ''} contains '{text}'")
    if unique and len(hits) > 1:
        raise RegionError(f"{what}: '{text}' is on {len(hits)} lines of {name} "
                          f"({', '.join(str(h + 1) for h in hits[:6])}): make it unique")
    return hits[0]


@generator("code", ("file",), ("symbol", "start", "end", "lang"))
def gen_code(ctx: Context, args: dict) -> str:
    name = args["file"]
    source = ctx.site.file(name).read_text()
    lines = source.splitlines()
    if "symbol" in args:
        if "start" in args or "end" in args:
            raise RegionError("code takes symbol= or start= and end=, not both")
        first, last = symbol_lines(source, args["symbol"], name)
        first, last = first - 1, last - 1
    elif "start" in args and "end" in args:
        first = line_matching(lines, args["start"], name, "start")
        last = line_matching(lines, args["end"], name, "end", after=first, unique=False)
    else:
        raise RegionError("code needs symbol=NAME, or start=\"TEXT\" and end=\"TEXT\"")
    language = args.get("lang", LANGUAGES.get(Path(name).suffix, ""))
    return fence(textwrap.dedent("\n".join(lines[first:last + 1])), language)


def unified_diff_ignoring_whitespace(a: list[str], b: list[str], fromfile: str, tofile: str, n: int) -> list[str]:
    """A unified diff in which lines that differ only in whitespace (a re-indented block) are the same, as
    `git diff -w` shows it: such lines appear as context, in b's spelling."""
    def squeeze(lines: list[str]) -> list[str]:
        return [" ".join(line.split()) for line in lines]

    def span(start: int, stop: int) -> str:
        length = stop - start
        return f"{start + 1 if length else start},{length}" if length != 1 else f"{start + 1}"

    matcher = difflib.SequenceMatcher(None, squeeze(a), squeeze(b))  # as difflib.unified_diff matches
    diff = []
    for group in matcher.get_grouped_opcodes(n):
        if not diff:
            diff += [f"--- {fromfile}", f"+++ {tofile}"]
        diff.append(f"@@ -{span(group[0][1], group[-1][2])} +{span(group[0][3], group[-1][4])} @@")
        for tag, a_start, a_stop, b_start, b_stop in group:
            if tag == "equal":
                diff += [" " + line for line in b[b_start:b_stop]]
                continue
            diff += ["-" + line for line in a[a_start:a_stop]]
            diff += ["+" + line for line in b[b_start:b_stop]]
    return diff


@generator("diff", ("a", "b"), ("match", "context"))
def gen_diff(ctx: Context, args: dict) -> str:
    """The hunks of a unified diff that ignores whitespace-only changes (a block re-indented under a new `with` is
    context, not 2 x its length of - and + lines)."""
    a, b = ctx.site.file(args["a"]).read_text().splitlines(), ctx.site.file(args["b"]).read_text().splitlines()
    try:
        context = int(args.get("context", 3))
    except ValueError:
        raise RegionError(f"context={args['context']} is not a number of lines") from None
    diff = unified_diff_ignoring_whitespace(a, b, args["a"], args["b"], context)
    if not diff:
        raise RegionError(f"{args['a']} and {args['b']} are the same")
    hunks: list[list[str]] = []
    for line in diff[2:]:
        if line.startswith("@@"):
            hunks.append([])
        hunks[-1].append(line)
    if "match" in args:
        hunks = [hunk for hunk in hunks if any(args["match"] in line for line in hunk)]
        if not hunks:
            raise RegionError(f"no hunk of the diff of {args['a']} and {args['b']} contains '{args['match']}'")
    return fence("\n".join(diff[:2] + [line for hunk in hunks for line in hunk]), "diff")


@generator("diffstat", ("base", "files"))
def gen_diffstat(ctx: Context, args: dict) -> str:
    base_name = args["base"]
    base = ctx.site.file(base_name).read_text().splitlines()
    names = sorted(ctx.site.relative(Path(path)) for path in glob.glob(str(ctx.site.root / args["files"]))
                   if Path(path).is_file())
    names = [name for name in names if name != ctx.site.relative(ctx.site.root / base_name)]
    if not names:
        raise RegionError(f"diffstat: files={args['files']} matches no file besides the base")
    rows = []
    for name in names:
        lines = ctx.site.file(name).read_text().splitlines()
        changes = list(difflib.unified_diff(base, lines, n=0, lineterm=""))[2:]
        added = sum(1 for line in changes if line.startswith("+"))
        removed = sum(1 for line in changes if line.startswith("-"))
        rows.append([f"`{name}`", f"{len(lines):,}", f"+{added:,}", f"-{removed:,}"])
    table = markdown_table(["file", "lines", "added", "removed"], rows, [False, True, True, True])
    return f"{table}\n\nLines added and removed against `{base_name}` ({len(base):,} lines), as difflib counts them."
