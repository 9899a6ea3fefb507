"""single-ft, the reference: batch-split invariance, packing invariance, learning, export, LoRA, CLI contract."""

import json
from collections import Counter
from contextlib import nullcontext
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import build_data, evaluate
from conftest import REPO_ROOT, load_experiment

single_ft = load_experiment("single-ft")


def run(tmp_path, name, data, *args):
    out = tmp_path / name
    summary = single_ft.main(["--data", str(data), "--seq-len", "128", "--out-dir", str(out), "--dtype", "fp32",
                              *map(str, args)])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, losses


def test_any_split_of_the_batch_is_the_same_step(tmp_path, small_data):
    _, four_by_one = run(tmp_path, "4x1", small_data, "--steps", 4, "--micro-batch-size", 4, "--grad-accum", 1)
    _, one_by_four = run(tmp_path, "1x4", small_data, "--steps", 4, "--micro-batch-size", 1, "--grad-accum", 4)
    _, two_by_two = run(tmp_path, "2x2", small_data, "--steps", 4, "--micro-batch-size", 2, "--grad-accum", 2)
    assert len(four_by_one) == 4
    assert one_by_four == pytest.approx(four_by_one, rel=1e-5)
    assert two_by_two == pytest.approx(four_by_one, rel=1e-5)
    assert four_by_one[-1] != pytest.approx(four_by_one[0], rel=1e-3)  # the steps really trained


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path, small_data):
    _, plain = run(tmp_path, "plain", small_data, "--steps", 3, "--micro-batch-size", 2)
    _, recomputed = run(tmp_path, "ckpt", small_data, "--steps", 3, "--micro-batch-size", 2,
                        "--activation-checkpointing")
    assert recomputed == pytest.approx(plain, rel=1e-5)


def test_packed_and_unpacked_eval_loss_are_equal(tmp_path, small_data):
    packed, _ = run(tmp_path, "packed", small_data, "--steps", 0, "--eval-fraction", 0.2)
    unpacked, _ = run(tmp_path, "unpacked", small_data, "--steps", 0, "--eval-fraction", 0.2, "--no-packing")
    assert packed["data"]["n_eval_rows"] < unpacked["data"]["n_eval_rows"]  # packing really changed the rows
    assert packed["eval_loss"] == pytest.approx(unpacked["eval_loss"], rel=1e-5)


def test_loss_falls(tmp_path, small_data):
    _, losses = run(tmp_path, "learn", small_data, "--steps", 40, "--micro-batch-size", 2, "--warmup-steps", 5)
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < first - 3.0, (first, last)


def test_bf16_tracks_fp32(tmp_path, small_data):
    _, fp32 = run(tmp_path, "fp32", small_data, "--steps", 4, "--micro-batch-size", 2)
    _, bf16 = run(tmp_path, "bf16", small_data, "--steps", 4, "--micro-batch-size", 2, "--dtype", "bf16")
    # bf16 rounds every matmul input to 8 bits of mantissa: losses agree to about 1%, not to 1e-5.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


def test_save_hf_reloads_with_the_same_eval_loss(tmp_path, small_data):
    export = tmp_path / "hf"
    summary, _ = run(tmp_path, "export", small_data, "--steps", 3, "--save-hf", export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    data = build_data(small_data, tokenizer, 128, seed=0)
    reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(summary["eval_loss"], rel=1e-5)


def test_lora_trains_only_adapters_and_merges(tmp_path, small_data):
    export = tmp_path / "merged"
    summary, losses = run(tmp_path, "lora", small_data, "--steps", 6, "--micro-batch-size", 2, "--lora-rank", 4,
                          "--save-hf", export, "--merge-lora")
    layers, d, inter = 4, 256, 768
    q, kv = 8 * 32, 4 * 32  # query and key/value widths of qwen3-tiny
    # rank x (in + out) per adapted projection: q, k, v, o, gate, up, down
    per_layer = 4 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inter) + (inter + d))
    assert summary["model"]["trainable_parameters"] == layers * per_layer
    assert losses[-1] < losses[0]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())
    data = build_data(small_data, AutoTokenizer.from_pretrained(export), 128, seed=0)
    reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(summary["eval_loss"], rel=1e-5)


def test_bad_data_stops_before_training_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit, match=rf"{re.escape(str(bad))}:2: conversation has no assistant turn"):
        single_ft.main(["--data", str(bad), "--out-dir", str(tmp_path / "out")])


def test_command_line_run_writes_the_results_contract(tmp_path, small_data):
    out = tmp_path / "cli"
    result = subprocess.run([sys.executable, "experiments/single-ft/train.py", "--data", str(small_data),
                             "--steps", "3", "--seq_len", "128", "--out-dir", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("config: {") for line in lines) == 1
    step_line = re.compile(r"^step (\d+)/3 \| loss \d+\.\d{4} \| lr \d\.\de[-+]\d\d \| grad_norm \d+\.\d\d \| "
                           r"step_ms \d+ \| comm_ms (\d+|-) \| tok/s [\d,]+ \| mfu (\d\.\d\d|-) \| mem \d+\.\d GiB$")
    assert [int(m.group(1)) for m in map(step_line.match, lines) if m] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("experiment", "command", "config", "hardware", "model", "step_ms", "comm_ms", "tokens_per_s",
                "tokens_per_s_per_device", "peak_mem_gib", "mfu", "t_eff", "final_loss", "eval_loss",
                "packing_efficiency", "n_conversations", "n_truncated", "warmup_steps_excluded"):
        assert key in summary, key
    assert summary["experiment"] == "single-ft" and summary["t_eff"] == 128
    assert summary["config"]["seq_len"] == 128 and summary["config"]["model"] == "qwen3-tiny"
    assert summary["hardware"]["torch"] == torch.__version__
    assert summary["model"]["parameters"] == summary["model"]["trainable_parameters"] > 1_000_000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert summary["final_loss"] == records[-1]["loss"]


def test_resume_equals_the_uninterrupted_run(tmp_path, small_data):
    args = ("--steps", 6, "--micro-batch-size", 2, "--warmup-steps", 2)
    _, uninterrupted = run(tmp_path, "whole", small_data, *args)
    _, first_half = run(tmp_path, "first", small_data, *args, "--checkpoint-every", 3)
    checkpoints = tmp_path / "first" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3", "step-6"]
    # A save killed half-way leaves only a .tmp folder; the previous checkpoint is what resuming uses.
    (checkpoints / "step-6").rename(checkpoints / "step-6.tmp")
    (checkpoints / "step-6.tmp" / ".metadata").unlink()
    with pytest.raises(SystemExit, match="unfinished checkpoint"):
        single_ft.main(["--data", str(small_data), "--resume", str(checkpoints / "step-6.tmp")])
    _, resumed = run(tmp_path, "resumed", small_data, *args, "--resume", checkpoints / "step-3")
    assert first_half == pytest.approx(uninterrupted, rel=1e-5)
    assert len(resumed) == 3
    assert resumed == pytest.approx(uninterrupted[3:], rel=1e-5)


def test_lora_resume_equals_the_uninterrupted_run(tmp_path, small_data):
    # Under LoRA only 2-D adapter matrices train, so the no-weight-decay group would be empty: a checkpoint of an
    # optimizer with an empty group could not be loaded back (IndexError in torch's flattened optimizer state).
    args = ("--steps", 4, "--warmup-steps", 2, "--lora-rank", 4)
    _, uninterrupted = run(tmp_path, "whole", small_data, *args, "--checkpoint-every", 2)
    _, resumed = run(tmp_path, "resumed", small_data, *args, "--resume", tmp_path / "whole" / "checkpoints" / "step-2")
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-5)


def test_varlen_attention_computes_the_masked_sdpa_steps(tmp_path, small_data):
    """--attn varlen (on CPU: the per-document reference, fed the same cu_seq_lens a GPU kernel gets) against the
    block-diagonal mask of --attn sdpa, full SFT and LoRA, two rows per micro-batch (documents of both rows flattened
    into one list) and through the chunked loss's decoder-only call."""
    args = ("--steps", 3, "--micro-batch-size", 2, "--grad-accum", 2, "--comm-profile-steps", 0)
    for name, extra in (("full", ()), ("lora", ("--lora-rank", 4)), ("chunked", ("--loss-chunk-tokens", 64))):
        sdpa_summary, sdpa = run(tmp_path, f"sdpa-{name}", small_data, *args, *extra, "--attn", "sdpa")
        varlen_summary, varlen = run(tmp_path, f"varlen-{name}", small_data, *args, *extra, "--attn", "varlen")
        assert varlen_summary["attention"]["impl"] == "varlen"
        assert varlen_summary["attention"]["varlen_kernel"] == "reference"
        assert sdpa_summary["attention"]["impl"] == "sdpa"
        assert varlen == pytest.approx(sdpa, rel=1e-5), name
        assert varlen_summary["eval_loss"] == pytest.approx(sdpa_summary["eval_loss"], rel=1e-5)


def test_the_step_reads_the_device_once(tmp_path, small_data, monkeypatch):
    """The training step's own code waits for the device once per optimizer step: loss and gradient norm read
    together for the step line. Counted on CPU by wrapping every Tensor method that copies a value to the host,
    for calls made from train.py, with and without the chunked loss and varlen. (Syncs inside libraries are the GPU
    suite's to count, with torch.cuda.set_sync_debug_mode.)"""
    script = str(REPO_ROOT / "experiments" / "single-ft" / "train.py")
    calls = []

    def counting(method):
        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == script:
                calls.append(method.__name__)
            return method(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    for extra in ((), ("--loss-chunk-tokens", 64, "--attn", "varlen")):
        per_run = []
        for steps in (2, 5):
            calls.clear()
            run(tmp_path, f"syncs-{steps}-{len(extra)}", small_data, "--steps", steps, "--grad-accum", 2,
                "--comm-profile-steps", 0, "--eval-fraction", 0, *extra)
            per_run.append(list(calls))
        # 3 more steps, one read each, and nothing else: a .item() added to the step would show here.
        assert Counter(per_run[1]) - Counter(per_run[0]) == Counter({"tolist": 3}), (per_run, extra)
