"""The GPU suite's probe, run as a process of its own after the target rungs (a failure here costs no target):

    python3 assets/gpu_probe.py OUT.json [--device cuda] [--tokens 8192 --hidden 1024 --vocab 151936 ...]

the versions; every attention kernel against SDPA with the block-diagonal mask (torch's varlen_attn, flash-attn,
FlexAttention over flattened tokens and over rows with the document block mask, the per-document reference), forward
and gradients, on packed random q/k/v of Qwen3-0.6B's head geometry; and the LM-head losses on the real shapes (a
step's loss tokens x hidden x vocabulary): the plain loss, common/loss_reference.py's chunked reference,
common/loss.py's fused loss at several chunk sizes, cut-cross-entropy and Liger-Kernel's fused linear cross-entropy
where installed, each timed forward + backward and held to the fp32 loss and gradients. Writes OUT.json;
assets/gpu_suite.py reads it into the entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # common, on a lent machine where nothing is installed
    sys.path.insert(0, str(REPO_ROOT))

LOSS_WHEELS = {"cut-cross-entropy": "25.1.1", "liger-kernel": "0.8.5"}  # pure-Python wheels; Triton comes with torch


@dataclass(frozen=True)
class Bench:
    tokens: int  # loss tokens of the LM-head benchmark
    hidden: int
    vocab: int
    chunk: int  # the chunked reference's chunk
    chunks: tuple[int, ...]  # the fused loss's chunks timed


KERNEL_SHAPE = dict(heads=16, kv_heads=8, head_dim=128)  # Qwen3-0.6B's attention geometry
KERNEL_DOCUMENTS = (700, 300, 24, 1000, 24)  # two rows of 1,024 slots, packed as a real row is (pads included)
KERNEL_ROWS = 2


def versions() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for package in ("transformers", "peft", "triton", "flash-attn", *LOSS_WHEELS, "trl"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def kernel_check(device_name: str) -> list[dict]:
    """Every installed varlen kernel (common/attention.py) on packed random q/k/v, and FlexAttention over the same
    tokens laid out as rows with the document block mask (--attn flex), forward and backward, against SDPA with the
    block-diagonal mask in fp32. The same masked SDPA in the working dtype (bf16 on a GPU) sets the scale of a normal
    rounding error: a kernel passes within 3x that (1e-5 in fp32). FlexAttention has no CPU backward."""
    import torch

    from common import attention

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    tokens = sum(KERNEL_DOCUMENTS)
    shapes = {"q": (tokens, KERNEL_SHAPE["heads"]), "k": (tokens, KERNEL_SHAPE["kv_heads"]),
              "v": (tokens, KERNEL_SHAPE["kv_heads"])}
    base = {name: torch.randn(*shape, KERNEL_SHAPE["head_dim"], generator=generator) for name, shape in shapes.items()}
    grad_out = torch.randn(tokens, KERNEL_SHAPE["heads"], KERNEL_SHAPE["head_dim"], generator=generator)
    bounds = torch.tensor([0, *torch.tensor(KERNEL_DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    longest, scale = max(KERNEL_DOCUMENTS), KERNEL_SHAPE["head_dim"] ** -0.5
    document = torch.searchsorted(bounds[1:].long(), torch.arange(tokens), right=True).to(device)
    mask = (document[:, None] == document[None, :]).tril()
    # The rows' position ids: restarting at each document, as packing lays them out.
    position_ids = torch.cat([torch.arange(n) for n in KERNEL_DOCUMENTS]).view(KERNEL_ROWS, -1)

    def masked_sdpa(q, k, v, cu_seq_lens, max_length, scale):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    def flex_rows(q, k, v, cu_seq_lens, max_length, scale):
        # [tokens, heads, d] -> [rows, heads, seq, d], what a decoder layer hands the attention function
        rows = [t.view(KERNEL_ROWS, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
        block_mask = attention.flex_kwargs(position_ids, device)["document_block_mask"]
        out, _ = attention.flex_attention_forward(None, *rows, None, scaling=scale, document_block_mask=block_mask)
        return out.reshape(tokens, *out.shape[2:])

    def run(function, run_dtype, backward=True):
        inputs = {name: t.to(device, run_dtype).requires_grad_(backward) for name, t in base.items()}
        out = function(inputs["q"], inputs["k"], inputs["v"], bounds.to(device), longest, scale)
        results = {"out": out.detach().float()}
        if backward:
            out.backward(grad_out.to(device, run_dtype))
            results.update({f"d{name}": t.grad.float() for name, t in inputs.items()})
        return results

    def error(result, reference):
        return max(float((result[key] - reference[key]).abs().max() / reference[key].abs().max())
                   for key in result)

    reference = run(masked_sdpa, torch.float32)
    rounding = error(run(masked_sdpa, dtype), reference)
    tolerance = max(3 * rounding, 1e-5)
    rows = [{"kernel": "masked SDPA", "dtype": str(dtype).removeprefix("torch."), "backward": True,
             "max_rel_error": rounding, "tolerance": None, "ok": True}]
    kernels = {k: attention._VARLEN_FUNCTIONS[k] for k in attention.available_varlen_kernels()
               if device.type == "cuda" or k in ("flex", "reference")}
    kernels["flex rows (--attn flex)"] = flex_rows
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU: no compile
    for name, function in kernels.items():
        backward = device.type == "cuda" or not name.startswith("flex")  # FlexAttention has no CPU backward
        row = {"kernel": name, "dtype": str(dtype).removeprefix("torch."), "backward": backward,
               "tolerance": tolerance}
        try:
            row["max_rel_error"] = error(run(function, dtype, backward), reference)
            row["ok"] = row["max_rel_error"] <= tolerance
        except Exception as exc:  # a kernel that cannot run here is a result, not a crash of the suite
            row.update(max_rel_error=None, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    return rows


BENCH_REPEATS = 3  # timed forward + backward passes per loss implementation, after one untimed (compilation)


def loss_implementations(plan: Bench, cuda: bool, missing: dict[str, str]) -> dict:
    """name -> f(hidden [n, d] leaf, weight [V, d] leaf, labels [n] on the host) -> the loss's sum over the n tokens.
    What the experiments run (common/loss.py) under autocast, as in training; the libraries on their own terms (bf16
    leaves, the weight cast once, as a bf16 model would hold it)."""
    import torch
    import torch.nn.functional as F

    from common.data import token_loss_sum
    from common.loss import fused_linear_cross_entropy
    from common.loss_reference import chunked_token_loss_sum

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
        (lambda: torch.autocast("cpu", enabled=False))
    one = torch.ones((), device="cuda" if cuda else "cpu")

    def plain(hidden, weight, labels):
        with autocast():
            return token_loss_sum(F.linear(hidden, weight).unsqueeze(0), labels.to(hidden.device).unsqueeze(0))

    def chunked(hidden, weight, labels):
        with autocast():
            return chunked_token_loss_sum(hidden.unsqueeze(0), weight, labels.unsqueeze(0), plan.chunk)

    def fused(chunk):
        def loss(hidden, weight, labels):
            with autocast():
                return fused_linear_cross_entropy(hidden.unsqueeze(0), weight, labels.unsqueeze(0), chunk, one)
        return loss

    implementations = {"plain (logits, fp32 cross-entropy)": plain,
                       f"common/loss_reference.py chunked reference, chunk {plan.chunk}": chunked,
                       **{f"common/loss.py fused, chunk {chunk}": fused(chunk) for chunk in plan.chunks}}
    if not cuda:
        return implementations
    try:  # each optional library in its own try: one that fails to import is a row, not the end of the probe
        from cut_cross_entropy import linear_cross_entropy

        implementations["cut-cross-entropy"] = lambda hidden, weight, labels: linear_cross_entropy(
            hidden.bfloat16(), weight.bfloat16(), labels.to(hidden.device), reduction="sum")
    except Exception as exc:  # noqa: BLE001  (ImportError, or a Triton/CUDA mismatch at import)
        missing["cut-cross-entropy"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_loss(hidden, weight, labels):
            out = liger(weight.bfloat16(), hidden.bfloat16(), labels.to(hidden.device))
            return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        implementations["liger-kernel fused linear cross-entropy"] = liger_loss
    except Exception as exc:  # noqa: BLE001
        missing["liger-kernel"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return implementations


def loss_bench(plan: Bench, device_name: str) -> list[dict]:
    """Each LM-head loss on `bench_tokens` loss tokens of hidden size `bench_hidden` over `bench_vocab` classes:
    forward + backward time (median of BENCH_REPEATS), the memory it adds at its peak, and its errors against the
    loss and gradients computed in fp32 (relative to the largest value). A loss passes within 3x the plain bf16
    loss's own error (1e-5 in fp32): the rule of the kernel check."""
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(plan.tokens, plan.hidden, generator=generator).to(device)
    weight = (torch.randn(plan.vocab, plan.hidden, generator=generator) * 0.02).to(device)
    labels = torch.randint(0, plan.vocab, (plan.tokens,), generator=generator)  # on the host

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(h, w, labels)
        loss.float().backward()
        return {"loss": loss.detach().float().reshape(1), "dhidden": h.grad.float(), "dweight": w.grad.float()}

    def error(result, reference):
        return max(float((result[key] - reference[key]).abs().max() / reference[key].abs().max())
                   for key in reference)

    with torch.autocast(device.type, enabled=False):
        def fp32(h, w, lab):
            return torch.nn.functional.cross_entropy(h @ w.t(), lab.to(h.device), reduction="sum")
        reference = run(fp32)
    rows, tolerance, missing = [], None, {}
    for name, loss_fn in loss_implementations(plan, cuda, missing).items():
        row = {"loss": name, "library": not name.startswith(("plain", "common/"))}
        try:
            result = run(loss_fn)  # compiles what compiles
            row["max_rel_error"] = error(result, reference)
            if tolerance is None:  # the plain loss comes first: its error in the working dtype sets the scale
                tolerance = max(3 * row["max_rel_error"], 1e-5)
            del result
            times = []
            for _ in range(BENCH_REPEATS):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start_bytes = torch.cuda.memory_allocated() if cuda else 0
                start = time.perf_counter()
                run(loss_fn)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1000)
            row["ms"] = statistics.median(times)
            row["peak_added_gib"] = (torch.cuda.max_memory_allocated() - start_bytes) / 2**30 if cuda else None
            row["tolerance"], row["ok"] = tolerance, row["max_rel_error"] <= tolerance
        except Exception as exc:  # an implementation that cannot run here is a result, not a crash of the suite
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    rows += [{"loss": package, "ok": None, "library": True, "error": "not installed (python3 assets/gpu_suite.py "
              "--wheels)" if error.startswith(("ImportError", "ModuleNotFoundError")) else error}
             for package, error in missing.items()]
    return rows


def probe(plan: Bench, device_name: str) -> dict:
    import torch

    from common import loss

    started = time.perf_counter()
    result = {"versions": versions(), "kernels": kernel_check(device_name), "losses": loss_bench(plan, device_name),
              "shape": {"loss_tokens": plan.tokens, "hidden": plan.hidden, "vocab": plan.vocab},
              # whether the fused loss adds each chunk's bf16 weight-gradient product into fp32 inside the GEMM
              "fused_loss_fp32_gemm_accumulation": loss._addmm_accumulates_in_fp32(torch.device(device_name))}
    result["seconds"] = time.perf_counter() - started
    return result


#


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--chunks", default="1024,4096,8192")
    args = parser.parse_args(argv)
    bench = Bench(args.tokens, args.hidden, args.vocab, args.chunk, tuple(int(c) for c in args.chunks.split(",")))
    result = probe(bench, args.device)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def probe_lines(probed: dict, data: str) -> list[str]:
    found = probed["versions"]
    lines = ["## Probe", "", f"{data}/probe.json, written by assets/gpu_probe.py in {probed['seconds']:.0f} s: "
             + ", ".join(f"{name} {value}" for name, value in found.items() if value) + ".", "",
             "Attention kernels against SDPA with the block-diagonal mask in fp32 (forward and gradients, largest "
             "error relative to the largest value):", ""]
    for row in probed["kernels"]:
        error = "did not run: " + row["error"] if row.get("error") else f"{row['max_rel_error']:.1e}"
        limit = "" if row["tolerance"] is None else \
            f" (tolerance {row['tolerance']:.1e}: {'ok' if row['ok'] else 'FAILED'})"
        lines.append(f"- {row['kernel']}, {row['dtype']}, {'with' if row['backward'] else 'without'} "
                     f"backward: {error}{limit}")
    shape = probed["shape"]
    fp32_run = probed["kernels"] and probed["kernels"][0]["dtype"] == "float32"
    accumulation = "in fp32 GEMMs (an fp32 run)" if fp32_run else \
        "in the GEMM (addmm with an fp32 output)" if probed.get("fused_loss_fp32_gemm_accumulation") else \
        "through a 16-bit product cast up (this torch has no fp32-output addmm here)"
    lines += ["", f"LM-head losses on {shape['loss_tokens']:,} loss tokens x {shape['hidden']:,} x "
              f"{shape['vocab']:,} (forward + backward, median of {BENCH_REPEATS}; errors of the loss and both "
              f"gradients against fp32; the fused loss accumulates the weight gradient {accumulation}):", ""]
    for row in probed["losses"]:
        if row.get("error"):
            lines.append(f"- {row['loss']}: did not run: {row['error']}")
            continue
        memory = "" if row.get("peak_added_gib") is None else f", {row['peak_added_gib']:.2f} GiB at its peak"
        lines.append(f"- {row['loss']}: {row['ms']:.1f} ms{memory}, error {row['max_rel_error']:.1e} (tolerance "
                     f"{row['tolerance']:.1e}: {'ok' if row['ok'] else 'FAILED'})")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
