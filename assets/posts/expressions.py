"""The expression language of `value expr=...`: numbers, + - * /, parentheses, a few functions (min, max, abs, sum,
mean, median, len) and dotted paths (`a.steps.-10:.loss`), evaluated without eval(). What a name's path reads is
the caller's: `read(name, path)`."""

from __future__ import annotations

import ast
import re
import statistics
from typing import Callable

from .engine import RegionError


def lookup(value, path: str, prefix: str = ""):
    """Follow a dotted path: dict keys, list indices (negative too); `*` or a slice `a:b` maps over a list.
    `prefix` starts the path in messages (the run's name in an expression)."""
    segments = path.split(".") if path else []
    for index, segment in enumerate(segments):
        where = f"field '{prefix}{'.'.join(segments[:index + 1])}'"
        if segment == "*" or (":" in segment and isinstance(value, list)):
            if not isinstance(value, list):
                raise RegionError(f"{where}: '{segment}' needs a list, found {type(value).__name__}")
            try:
                part = value if segment == "*" else value[slice(*(int(x) if x else None for x in segment.split(":")))]
            except ValueError:
                raise RegionError(f"{where}: '{segment}' is not a slice") from None
            rest = ".".join(segments[index + 1:])
            return [lookup(item, rest, f"{prefix}{'.'.join(segments[:index + 1])}.") for item in part]
        if isinstance(value, dict):
            if segment not in value:
                keys = ", ".join(sorted(map(str, value))[:12]) + (", ..." if len(value) > 12 else "")
                raise RegionError(f"{where}: no field '{segment}' (there are: {keys})")
            value = value[segment]
        elif isinstance(value, list):
            try:
                value = value[int(segment)]
            except ValueError:
                raise RegionError(f"{where}: '{segment}' indexes a list, give a number") from None
            except IndexError:
                raise RegionError(f"{where}: index {segment} is past the list's {len(value)} items") from None
        else:
            raise RegionError(f"{where}: '{segment}' indexes a {type(value).__name__} ({value!r})")
    return value


PATH_IN_EXPRESSION = re.compile(r"(?<![\w.])([A-Za-z_]\w*)((?:\.(?:[A-Za-z_][\w:]*|-?\d+(?::-?\d*)?|:-?\d*|\*))+)")
FUNCTIONS: dict[str, Callable] = {"min": min, "max": max, "abs": abs, "sum": sum, "len": len,
                                  "mean": lambda values: sum(values) / len(values), "median": statistics.median}
BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.Div: lambda a, b: a / b}


def evaluate(expression: str, read: Callable[[str, str], object]) -> float:
    """A small arithmetic expression over named values (posts/README.md, `value`), evaluated without eval().
    `read(name, path)` gives the value of `name.path` (a RegionError where `name` is unbound)."""
    values: dict[str, object] = {}

    def substitute(match: re.Match) -> str:
        placeholder = f"_field{len(values)}"
        values[placeholder] = read(match.group(1), match.group(2)[1:])
        return placeholder

    prepared = PATH_IN_EXPRESSION.sub(substitute, expression)
    try:
        tree = ast.parse(prepared, mode="eval")
    except SyntaxError:
        raise RegionError(f"expr '{expression}' is not an expression") from None

    def number(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RegionError(f"expr '{expression}': {value!r} is not a number (a list needs sum/mean/min/max)")
        return value

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            if values[node.id] is None:
                raise RegionError(f"expr '{expression}': a field it reads is null")
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = number(walk(node.left)), number(walk(node.right))
            if isinstance(node.op, ast.Div) and right == 0:
                raise RegionError(f"expr '{expression}': division by zero")
            return BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = number(walk(node.operand))
            return -operand if isinstance(node.op, ast.USub) else operand
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and not node.keywords and node.args):
            arguments = [walk(arg) for arg in node.args]
            if len(arguments) == 1 and isinstance(arguments[0], list):
                arguments = arguments[0]
            if node.func.id == "len":
                return len(arguments)  # of any list: len(a.steps) is the number of steps
            if not arguments:
                raise RegionError(f"expr '{expression}': {node.func.id}() of an empty list")
            arguments = [number(a) for a in arguments]
            if node.func.id == "abs":
                if len(arguments) != 1:
                    raise RegionError(f"expr '{expression}': abs takes one number")
                return abs(arguments[0])
            return FUNCTIONS[node.func.id](arguments)
        raise RegionError(f"expr '{expression}': only numbers, + - * /, parentheses, "
                          f"{', '.join(FUNCTIONS)} and run fields are allowed")

    return walk(tree.body)
