"""`value`: one number from a run's field, or an expression over several runs (posts/expressions.py)."""

from __future__ import annotations

from run_files import Run

from ..engine import RegionError, generator
from ..expressions import FUNCTIONS, evaluate, lookup
from ..site import Context
from .runs import run_fields, show


def evaluate_runs(expression: str, runs: dict[str, Run]) -> float:
    """The expression with each of its names bound to a run: `a.steps.-1.loss` is a path into run_fields(a)."""
    def read(name: str, path: str):
        if name not in runs:
            raise RegionError(f"expr: '{name}' is not a run: give {name}=<run folder>")
        first = path.split(".")[0]
        return lookup(run_fields(runs[name], prediction=first == "prediction", formula=first == "formula"), path,
                      f"{name}.")

    return evaluate(expression, read)


@generator("value", (), ("*",), inline=True)
def gen_value(ctx: Context, args: dict) -> str:
    fmt = args.pop("fmt", "")
    if "expr" in args:
        expression = args.pop("expr")
        bad = [name for name in args if not name.isidentifier() or name in FUNCTIONS]
        if bad:
            raise RegionError(f"expr: {', '.join(bad)} cannot name a run (use a plain name such as a=, fsdp=)")
        value = evaluate_runs(expression, {name: ctx.site.run(path) for name, path in args.items()})
    else:
        missing = [key for key in ("run", "field") if key not in args]
        extra = [key for key in args if key not in ("run", "field")]
        if missing or extra:
            raise RegionError("value takes run= and field= (or expr= and one NAME=<run> per run it reads)"
                              + (f"; unknown: {', '.join(extra)}" if extra else ""))
        value = lookup(run_fields(ctx.site.run(args["run"])), args["field"])
    if isinstance(value, (list, dict)):
        raise RegionError(f"the value is a {type(value).__name__}: index it, or reduce it with sum/mean/min/max")
    return show(value, fmt)
