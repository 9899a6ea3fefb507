"""`lora-states`: what a LoRA or QLoRA run held, per kind of parameter, from its summary.json's state bytes."""

from __future__ import annotations

from ..engine import RegionError, generator
from ..markup import markdown_table
from ..site import Context

FP32_BYTES = 4  # the adapters' weights, and (QLoRA) the embedding and norms bitsandbytes leaves unquantized


@generator("lora-states", ("runs",))
def gen_lora_states(ctx: Context, args: dict) -> str:
    """Per run (rank 0): bytes per frozen base weight, (weights - 4 x trained) / base parameters; bytes per trained
    parameter, (4 x trained + gradients + AdamW state) / trained; for QLoRA the bytes per 4-bit weight, counting the
    embedding and norms at 4 bytes; the weights' bytes against common.memory's prediction for the run; its peak."""
    from common import memory

    rows = []
    for run in ctx.site.runs(args["runs"]):
        summary, config = run.summary, run.config
        trained, parameters = summary["model"]["trainable_parameters"], summary["model"]["parameters"]
        if not config.get("lora_rank") or not summary.get("state_bytes_per_rank"):
            raise RegionError(f"lora-states: {run.name} is not a LoRA run with state_bytes_per_rank")
        held = summary["state_bytes_per_rank"][0]
        base = held["weights"] - FP32_BYTES * trained
        per_trained = (FP32_BYTES * trained + held["grads"] + held["optimizer"]) / trained
        four_bit = "-"
        if config.get("qlora"):
            shape = memory.model_shape(config["model"])
            unquantized = shape.embedding_parameters + shape.layers * shape.layer_norm_parameters + shape.hidden
            four_bit = f"{(base - FP32_BYTES * unquantized) / (parameters - unquantized):.3f}"
        predicted = memory.predict_run(summary).weights_bytes
        training = f"QLoRA r{config['lora_rank']}" if config.get("qlora") else f"LoRA r{config['lora_rank']}"
        rows.append([run.name.rsplit("/", 1)[-1], summary["hardware"]["device_name"], config["model"],
                     f"{training}, --dtype {config['dtype']}", f"{trained:,} ({trained / parameters:.2%})",
                     f"{base / parameters:.2f}", four_bit, f"{per_trained:.2f}",
                     f"{held['weights'] / predicted:.4f}", f"{summary['peak_mem_gib']:.2f}"])
    table = markdown_table(["run", "device", "model", "training", "trained parameters", "bytes per base weight",
                            "bytes per 4-bit weight", "bytes per trained parameter", "weights / predicted",
                            "peak GiB"], rows, [False, False, False, False, True, True, True, True, True, True])
    return (f"{table}\n\nRank 0's state bytes as the run recorded them (`state_bytes_per_rank`): bytes per base weight "
            f"= (weights - 4 x trained) / all parameters; bytes per trained parameter = (4 x trained + gradients + "
            f"AdamW state) / trained; bytes per 4-bit weight (QLoRA) counts the embedding and the norms, which stay "
            f"unquantized, at 4 bytes; weights / predicted: the weights' bytes against common.memory's prediction for "
            f"the run's flags; peak: `max_memory_reserved` on a GPU, the process's peak RSS on a CPU.")
