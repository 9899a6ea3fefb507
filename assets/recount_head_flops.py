"""One-time recount of the committed GPU runs that trained with the fused loss (--loss-chunk-tokens): their steps
counted the LM head on every real token, where it runs on the loss tokens only (common/loss.py). Since issue 34 the
Recorder counts it on the loss tokens (summary.json's `lm_head_flops_on`); this brings the runs recorded before
into the same count, in their own files, so that every page reads one count and no reader recounts:

    uv run python assets/recount_head_flops.py            # rewrites the runs that need it, says which
    uv run python assets/recount_head_flops.py --check    # exits 1 if a run still needs it

Per step, the count drops the LM head (6 x vocabulary x hidden per token, 4 when it is frozen under LoRA/QLoRA:
common/models.py's `TrainingFlops.lm_head`) for each real token that carries no loss, from the step's own
`tokens` and `loss_tokens`; the step's MFU follows from its `tokens_per_s`, and the summary's `flops_per_token` and
`mfu` from the same timed steps as before. Before writing, the run's recorded averages are recomputed from its
records as they stand, so a run whose summary does not follow from its steps is refused, not patched. The summary
keeps the figure it replaces (`mfu_head_every_token`) and says what was done (`lm_head_recount`); `mfu_dense` (every
token attending to its whole row, the head on every token: the count of tools that see neither) is left as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # common, for `python assets/recount_head_flops.py` without an install
    sys.path.insert(0, str(REPO_ROOT))

from common.metrics import flops_averages, mfu, peak_flops_per_device, timed_records  # noqa: E402
from common.memory.cli import preset_for  # noqa: E402
from common.models import count_parameters, model_config, training_flops  # noqa: E402

RECOUNT = ("recounted once from each step's tokens and loss_tokens (assets/recount_head_flops.py): the LM head on "
           "the loss tokens only, where the fused loss runs it; mfu_head_every_token keeps the figure before")


def needs_recount(summary: dict) -> bool:
    """A GPU run with the fused loss whose FLOPs were counted before `lm_head_flops_on` existed."""
    return (summary.get("hardware", {}).get("device_kind") in ("cuda", "rocm")
            and (summary.get("config", {}).get("loss_chunk_tokens") or 0) > 0
            and "lm_head_flops_on" not in summary and summary.get("flops_per_token") is not None)


def head_flops_per_token(summary: dict) -> float:
    """The LM head's training FLOPs per token for the run's model (its preset's geometry, read without a download),
    checked against the parameter count the run recorded."""
    config = summary["config"]
    name, _ = preset_for(config["model"])
    geometry = model_config(name)
    recorded = summary.get("model", {}).get("parameters")
    counted = count_parameters(geometry)["total"]
    # A 4-bit model's parameters are counted as stored (two weights per byte), so only a bf16 run is compared.
    if not config.get("qlora") and recorded != counted:
        raise ValueError(f"{config['model']}: the run recorded {recorded:,} parameters, {name} has {counted:,}")
    return training_flops(geometry, config.get("lora_rank") or 0).lm_head


def recount(summary: dict, records: list[dict]) -> tuple[dict, list[dict]]:
    """(summary, records) with the LM head counted on loss tokens; ValueError if the run's averages do not follow
    from its records as recorded."""
    hardware = summary["hardware"]
    peak, devices = peak_flops_per_device(hardware["device_name"]), hardware.get("world_size") or 1
    warmup, profiled = summary.get("warmup_steps_excluded", 0), summary.get("profiled_steps") or []
    _, timed = timed_records(records, warmup, profiled)
    before = flops_averages(timed, peak, devices)
    for key in ("flops_per_token", "mfu"):
        if not math.isclose(before[key], summary[key], rel_tol=1e-9):
            raise ValueError(f"its {key} {summary[key]} is not its timed steps' {before[key]}")
    head = head_flops_per_token(summary)
    steps = []
    for record in records:
        flops = record["flops"] - head * (record["tokens"] - record["loss_tokens"])
        steps.append({**record, "flops": flops,
                      "mfu": mfu(record["tokens_per_s"], flops / record["tokens"], peak, devices)})
    _, timed = timed_records(steps, warmup, profiled)
    after = dict(summary, **flops_averages(timed, peak, devices), lm_head_flops_on="loss tokens",
                 mfu_head_every_token=summary["mfu"], lm_head_recount=RECOUNT)
    return after, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a run needs the recount")
    parser.add_argument("--root", type=Path, default=REPO_ROOT / "devlog" / "data")
    args = parser.parse_args(argv)
    pending = []
    for path in sorted(args.root.rglob("summary.json")):
        summary = json.loads(path.read_text())
        if not needs_recount(summary):
            continue
        pending.append(path.parent)
        if args.check:
            continue
        metrics = path.parent / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        try:
            summary, records = recount(summary, records)
        except ValueError as error:
            raise SystemExit(f"{path.parent}: {error}") from error
        path.write_text(json.dumps(summary, indent=2) + "\n")
        metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
        before, after = summary["mfu_head_every_token"], summary["mfu"]
        print(f"{path.parent.relative_to(args.root)}: mfu {before:.4f} -> {after:.4f}")
    if args.check and pending:
        print("\n".join(f"needs the recount: {folder}" for folder in pending))
        return 1
    if not pending:
        print("nothing to recount")
    return 0


if __name__ == "__main__":
    sys.exit(main())
