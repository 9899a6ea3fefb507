"""single-ft, the reference: batch-split invariance, packing invariance, learning, export, LoRA, CLI contract."""

import io
import json
from collections import Counter
from contextlib import nullcontext
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.memory import predict_state_bytes
from common.data import build_data, evaluate
from common.models import model_config, training_flops
from conftest import REPO_ROOT, load_experiment, load_infer

single_ft = load_experiment("single-ft")


def run(tmp_path, name, data, *args):
    out = tmp_path / name
    summary = single_ft.main(["--data", str(data), "--seq-len", "128", "--out-dir", str(out), "--dtype", "fp32",
                              *map(str, args)])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, losses


@pytest.mark.slow
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


@pytest.mark.slow
def test_packed_and_unpacked_eval_loss_are_equal(tmp_path, small_data):
    packed, _ = run(tmp_path, "packed", small_data, "--steps", 0, "--eval-fraction", 0.2)
    unpacked, _ = run(tmp_path, "unpacked", small_data, "--steps", 0, "--eval-fraction", 0.2, "--no-packing")
    assert packed["data"]["n_eval_rows"] < unpacked["data"]["n_eval_rows"]  # packing really changed the rows
    assert packed["eval_loss"] == pytest.approx(unpacked["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_loss_falls(tmp_path, small_data):
    _, losses = run(tmp_path, "learn", small_data, "--steps", 40, "--micro-batch-size", 2, "--warmup-steps", 5)
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < first - 3.0, (first, last)


@pytest.mark.slow
def test_bf16_tracks_fp32(tmp_path, small_data):
    _, fp32 = run(tmp_path, "fp32", small_data, "--steps", 4, "--micro-batch-size", 2)
    _, bf16 = run(tmp_path, "bf16", small_data, "--steps", 4, "--micro-batch-size", 2, "--dtype", "bf16")
    # bf16 rounds every matmul input to 8 bits of mantissa: losses agree to about 1%, not to 1e-5.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


@pytest.mark.slow
def test_save_hf_reloads_with_the_same_eval_loss(tmp_path, small_data):
    export = tmp_path / "hf"
    summary, _ = run(tmp_path, "export", small_data, "--steps", 3, "--save-hf", export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    data = build_data(small_data, tokenizer, 128, seed=0)
    reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(summary["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_lora_trains_only_adapters_and_merges(tmp_path, small_data, tokenizer):
    export = tmp_path / "merged"
    summary, losses = run(tmp_path, "lora", small_data, "--steps", 6, "--micro-batch-size", 2, "--lora-rank", 4,
                          "--save-hf", export, "--merge-lora")
    layers, d, inter = 4, 256, 768
    q, kv = 8 * 32, 4 * 32  # query and key/value widths of qwen3-tiny
    # rank x (in + out) per adapted projection: q, k, v, o, gate, up, down
    per_layer = 4 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inter) + (inter + d))
    assert summary["model"]["trainable_parameters"] == layers * per_layer
    assert losses[-1] < losses[0]
    # Each step's FLOPs: LoRA's count (4 per frozen weight, 6 per adapter parameter) over the documents of its rows.
    flops = training_flops(model_config("qwen3-tiny"), 4)
    data = build_data(small_data, tokenizer, 128, seed=0)
    records = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert [r["flops"] for r in records] == [flops.of_documents(data.step_documents(k, 2)) for k in range(6)]
    timed = records[summary["warmup_steps_excluded"]:]
    assert summary["flops_per_token"] == pytest.approx(sum(r["flops"] for r in timed) / sum(r["tokens"] for r in timed))
    assert summary["model"]["flops_per_token"] == flops.dense_per_token(128) > summary["flops_per_token"]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())
    # experiments/infer.py on the merged export: the eval loss training printed, and plain greedy decoding's answer.
    infer = load_infer()
    assert infer.main(["--model", export, "--eval-data", small_data, "--seq-len", 128]) == \
        pytest.approx(summary["eval_loss"], rel=1e-5)
    prompt = "Spell 'cat' backwards."
    assert infer.main(["--model", export, "--prompt", prompt, "--max-new-tokens", 6]) == \
        [greedy_by_hand(export, prompt, 6)]


@pytest.mark.slow
def test_lora_on_a_bf16_base_tracks_fp32_and_holds_what_was_predicted(tmp_path, small_data):
    """--dtype bf16 under LoRA: the frozen base is stored in bf16 (2 bytes a weight), the adapters compute in bf16
    with fp32 masters, gradients and AdamW state (common/precision.py). The steps track the fp32 run's within bf16
    rounding; the model states held are common.memory's prediction (besides AdamW's step counters); the merged
    export is a bf16 model, as its base was."""
    export = tmp_path / "merged"
    lora = ("--steps", 4, "--micro-batch-size", 2, "--lora-rank", 4)
    fp32_summary, fp32 = run(tmp_path, "fp32", small_data, *lora)
    summary, bf16 = run(tmp_path, "bf16", small_data, *lora, "--dtype", "bf16", "--save-hf", export, "--merge-lora")
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != pytest.approx(fp32, rel=1e-6)
    adapters, base = summary["model"]["trainable_parameters"], summary["model"]["parameters"]
    (held,) = summary["state_bytes_per_rank"]
    assert held["weights"] == 2 * (base + adapters) and held["grads"] == held["master"] == 4 * adapters
    assert fp32_summary["state_bytes_per_rank"][0]["weights"] == 4 * (base + adapters)
    assert {**held, "optimizer": held["optimizer"] - 4 * 2 * 4 * 7} == predict_state_bytes(summary)[0]
    model = AutoModelForCausalLM.from_pretrained(export)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    data = build_data(small_data, AutoTokenizer.from_pretrained(export), 128, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    # merged into bf16 weights: the adapters' products are rounded once more than in the run's own evaluation
    assert reloaded == pytest.approx(summary["eval_loss"], rel=2e-2)


def test_bad_data_stops_before_training_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit, match=rf"{re.escape(str(bad))}:2: conversation has no assistant turn"):
        single_ft.main(["--data", str(bad), "--out-dir", str(tmp_path / "out")])


def test_command_line_run_writes_the_results_contract(tmp_path, small_data, capsys):
    """The command line's flags (underscores accepted too) and the printed contract, in this process (the README's
    main command is run as a new user runs it in tests/test_ddp_fsdp.py)."""
    out = tmp_path / "cli"
    single_ft.main(["--data", str(small_data), "--steps", "3", "--seq_len", "128", "--out-dir", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("config: {") for line in lines) == 1
    step_line = re.compile(r"^step (\d+)/3 \| epoch \d+\.\d\d \| loss \d+\.\d{4} \| lr \d\.\de[-+]\d\d \| grad_norm \d+\.\d\d \| "
                           r"step_ms \d+ \| comm_ms (\d+|-) \| tok/s [\d,]+ \| mfu (\d\.\d\d|-) \| mem \d+\.\d GiB \| eta \d+m\d\ds$")
    assert [int(m.group(1)) for m in map(step_line.match, lines) if m] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("experiment", "command", "commit", "commit_diff", "config", "hardware", "model", "step_ms", "comm_ms",
                "tokens_per_s", "tokens_per_s_per_device", "peak_mem_gib", "mfu", "t_eff", "final_loss", "eval_loss",
                "packing_efficiency", "n_conversations", "n_truncated", "warmup_steps_excluded", "flops_per_token",
                "mfu_dense"):
        assert key in summary, key
    assert summary["experiment"] == "single-ft" and summary["t_eff"] == 128
    assert summary["config"]["seq_len"] == 128 and summary["config"]["model"] == "qwen3-tiny"
    assert summary["hardware"]["torch"] == torch.__version__
    assert summary["model"]["parameters"] == summary["model"]["trainable_parameters"] > 1_000_000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert summary["final_loss"] == records[-1]["loss"]


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("lora", [(), ("--lora-rank", 4)], ids=["full", "lora"])
def test_bf16_resume_continues_exactly_and_exports_the_fp32_masters(tmp_path, small_data, lora):
    """--dtype bf16: bf16 weights, fp32 masters (common/precision.py). A checkpoint holds the masters and AdamW's
    state (a LoRA run's bf16 base too), so the resumed steps are the uninterrupted run's, bit for bit (weights
    rebuilt from the bf16 ones would have lost the masters' low bits). The states held are common.memory's
    prediction; --save-hf writes the fp32 masters, as it wrote the fp32 weights under autocast."""
    args = ("--steps", 4, "--warmup-steps", 2, "--dtype", "bf16", *lora)
    summary, uninterrupted = run(tmp_path, "whole", small_data, *args, "--checkpoint-every", 2,
                                 "--save-hf", tmp_path / "hf")
    _, resumed = run(tmp_path, "resumed", small_data, *args, "--resume", tmp_path / "whole" / "checkpoints" / "step-2")
    assert resumed == uninterrupted[2:]
    assert summary["master_weights"]["master_dtype"] == "float32"
    (held,) = summary["state_bytes_per_rank"]
    trainable, frozen = summary["model"]["trainable_parameters"], summary["model"]["parameters"] if lora else 0
    assert (held["weights"], held["grads"], held["master"]) == (2 * (trainable + frozen), 4 * trainable, 4 * trainable)
    counters = 4 * summary["master_weights"]["tensors"]  # AdamW's fp32 step, one per tensor, which it does not price
    assert {**held, "optimizer": held["optimizer"] - counters} == predict_state_bytes(summary)[0]
    if not lora:
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").get_output_embeddings().weight
        assert exported.dtype == torch.float32 and not torch.equal(exported, exported.bfloat16().float())


@pytest.mark.slow
def test_lora_resume_equals_the_uninterrupted_run(tmp_path, small_data):
    # Under LoRA only 2-D adapter matrices train, so the no-weight-decay group would be empty: a checkpoint of an
    # optimizer with an empty group could not be loaded back (IndexError in torch's flattened optimizer state).
    args = ("--steps", 4, "--warmup-steps", 2, "--lora-rank", 4)
    _, uninterrupted = run(tmp_path, "whole", small_data, *args, "--checkpoint-every", 2)
    _, resumed = run(tmp_path, "resumed", small_data, *args, "--resume", tmp_path / "whole" / "checkpoints" / "step-2")
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-5)


@pytest.mark.slow
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


PLUMBING = ("torch/_tensor.py", "torch/_ops.py", "torch/utils/_python_dispatch.py", "torch/_dynamo/eval_frame.py",
            "torch/_compile.py")


class ScalarReads(TorchDispatchMode):
    """Every _local_scalar_dense (the op behind item(), bool(), int(), float(), also when C++ code asks for one)."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.record("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_the_step_reads_the_device_once(tmp_path, small_data, monkeypatch):
    """The training step waits for the device once per optimizer step: loss and gradient norm read together for
    the step line. Counted on CPU by wrapping every Tensor method that copies a value to the host and by a dispatch
    mode that sees every scalar read (C++ ones too), each attributed to the last frame outside torch that led to it,
    with and without the fused loss and varlen; the difference between a 5-step and a 2-step run is 3 steps' reads.
    Besides train.py's one read, a step may read only where the code runs on the batch's host copy by design
    (common/attention.py's document boundaries; on CPU, the reference varlen kernel, which a GPU never runs):
    neither transformers nor the loss reads anything. With --attn sdpa, transformers' packed-row check reads once
    per forward: the count sees reads made outside train.py. (On a GPU, the suite counts syncs with
    torch.cuda.set_sync_debug_mode.)"""
    script = str(REPO_ROOT / "experiments" / "single-ft" / "train.py")
    calls = []

    def record(name):
        frame = sys._getframe(1)
        while frame.f_code.co_filename == __file__ or frame.f_code.co_filename.endswith(PLUMBING):
            frame = frame.f_back  # this test's wrappers, Tensor methods written in Python, the dispatcher's frames
        filename = frame.f_code.co_filename
        where = "train.py" if filename == script else "torch" if "/torch/" in filename else \
            f"{Path(filename).name}:{frame.f_code.co_name}"
        calls.append((name, where))

    def counting(method):
        def wrapper(self, *args, **kwargs):
            record(method.__name__)
            return method(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    # Reads of host tensors by design: the batch's host copy (data.py, the document boundaries), the CPU-only
    # reference kernel; torch's own (e.g. AdamW's step counts, which it keeps on the CPU unless fused) are not
    # this test's subject.
    host_side = {"attention.py:document_boundaries", "attention.py:document_kwargs", "attention.py:_reference_varlen",
                 "data.py:rows_for_step", "data.py:step_real_tokens", "data.py:step_loss_tokens", "data.py:step_documents",
                 "torch"}
    # (A mixture of experts too: its aux loss and expert load join the same read.)
    for extra in ((), ("--loss-chunk-tokens", 64, "--attn", "varlen"), ("--model", "qwen3-moe-tiny")):
        per_run = []
        for steps in (2, 5):
            calls.clear()
            with ScalarReads(lambda name: record(name)):
                run(tmp_path, f"syncs-{steps}-{len(extra)}", small_data, "--steps", steps, "--grad-accum", 2,
                    "--comm-profile-steps", 0, "--eval-fraction", 0, *extra)
            per_run.append(list(calls))
        three_steps = Counter(per_run[1]) - Counter(per_run[0])
        # 3 more steps, one read each from train.py, and nothing else: a .item() added to the step would show here.
        assert {key: n for key, n in three_steps.items() if key[1] == "train.py"} == {("tolist", "train.py"): 3}, \
            (three_steps, extra)
        elsewhere = {key: n for key, n in three_steps.items() if key[1] not in host_side | {"train.py"}}
        if "varlen" in extra:
            assert elsewhere == {}
        elif "--model" not in extra:  # SDPA over packed rows: transformers' check, once per forward (2 per step)
            assert elsewhere == {("__bool__", "masking_utils.py:find_packed_sequence_indices"): 6,
                                 ("_local_scalar_dense", "masking_utils.py:find_packed_sequence_indices"): 6}, elsewhere


def test_a_data_format_trains_the_steps_of_its_jsonl(tmp_path, small_data, formats):
    """A CSV with its own column names (--data-columns): the same steps as its records written as prompt/completion
    JSONL. Every other format (parquet, ShareGPT JSON, save_to_disk) reads as its JSONL (tests/test_data.py), and
    training sees only what build_data made of the records."""
    _, pairs = run(tmp_path, "pairs", formats / "pairs.jsonl", "--steps", 2)
    _, csv = run(tmp_path, "csv", formats / "pairs.csv", "--steps", 2,
                 "--data-columns", "prompt=question,completion=answer")
    assert csv == pytest.approx(pairs, rel=1e-6)


def test_bad_data_sources_stop_with_one_line(tmp_path, formats):
    with pytest.raises(SystemExit, match=r"^bad training data: .*pairs.csv: column 'query' \(--data-columns\) is not "
                                         r"in the data; it has: question, answer$"):
        single_ft.main(["--data", str(formats / "pairs.csv"), "--data-columns", "prompt=query,completion=answer",
                        "--out-dir", str(tmp_path / "out")])


def greedy_by_hand(folder, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding without transformers' generate: the whole sequence through the model at every step."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids[0].tolist() + new])).logits[0, -1].argmax())
            if token in stop:
                break
            new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.slow
def test_infer_generates_and_evaluates_every_kind_of_export(tmp_path, small_data, monkeypatch, capsys):
    infer = load_infer()
    base = tmp_path / "base-hf"
    summary, _ = run(tmp_path, "base", small_data, "--steps", 30, "--save-hf", base)  # says a word
    prompt = "Spell 'cat' backwards."
    (reply,) = infer.main(["--model", str(base), "--prompt", prompt, "--max-new-tokens", 12])
    assert reply == greedy_by_hand(base, prompt, 12) and reply.strip()
    assert reply in capsys.readouterr().out  # streamed to the terminal
    # --eval-data: the number training printed, from the export alone.
    assert infer.main(["--model", str(base), "--eval-data", str(small_data), "--seq-len", "128"]) == \
        pytest.approx(summary["eval_loss"], rel=1e-5)
    # A prompts file (plain and JSON lines) gives what --prompt gives.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    replies = infer.main(["--model", str(base), "--prompts", str(prompts), "--max-new-tokens", 12])
    assert replies == [reply, infer.main(["--model", str(base), "--prompt", "Say hi.", "--max-new-tokens", 12])[0]]
    # Interactive chat: two turns, the second sees the first; an empty line is skipped, the end of input ends it,
    # and so does "exit".
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{prompt}\n\nAnd again?\n"))
    chat = infer.main(["--model", str(base), "--max-new-tokens", 12])
    assert len(chat) == 2 and chat[0] == reply
    monkeypatch.setattr(sys, "stdin", io.StringIO("exit\nnot read\n"))
    assert infer.main(["--model", str(base), "--max-new-tokens", 12]) == []

    # A LoRA adapter trained on that export as its base: loaded through the base its adapter_config names.
    adapter = tmp_path / "adapter"
    lora, _ = run(tmp_path, "lora", small_data, "--model", base, "--steps", 3, "--lora-rank", 4, "--lr", 1e-3,
                  "--save-hf", adapter)
    assert (adapter / "adapter_config.json").exists() and not (adapter / "config.json").exists()
    assert infer.main(["--model", str(adapter), "--eval-data", str(small_data), "--seq-len", "128"]) == \
        pytest.approx(lora["eval_loss"], rel=1e-5)
    assert infer.main(["--model", str(adapter), "--prompt", prompt, "--max-new-tokens", 4])[0] is not None
    # An adapter whose base is a preset (random init, never saved) needs --base; a folder that is no export stops.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "qwen3-tiny"}))
    with pytest.raises(SystemExit, match="a LoRA adapter of qwen3-tiny, .* pass --base"):
        infer.main(["--model", str(adapter), "--prompt", prompt])
    assert infer.main(["--model", str(adapter), "--base", str(base), "--eval-data", str(small_data),
                       "--seq-len", "128"]) == pytest.approx(lora["eval_loss"], rel=1e-5)
    with pytest.raises(SystemExit, match="neither config.json .* nor adapter_config.json"):
        infer.main(["--model", str(tmp_path), "--prompt", prompt])


def test_sample_every_prints_a_completion_and_changes_no_step(tmp_path, small_data, capsys):
    _, plain = run(tmp_path, "plain", small_data, "--steps", 3)
    capsys.readouterr()
    _, sampled = run(tmp_path, "sampled", small_data, "--steps", 3, "--sample-every", 2)
    assert sampled == plain
    assert len(re.findall(r"^sample step 2: '.*'$", capsys.readouterr().out, re.M)) == 1


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_writes_the_step_metrics(tmp_path, small_data):
    summary, losses = run(tmp_path, "tb", small_data, "--steps", 3, "--eval-every", 2, "--report-to", "tensorboard")
    scalars = tensorboard_scalars(tmp_path / "tb" / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx(losses, rel=1e-6)  # stored as float32
    assert {"train/lr", "train/grad_norm", "train/step_ms", "train/tokens_per_s", "train/peak_mem_gib"} <= set(scalars)
    assert [step for step, _ in scalars["eval/loss"]] == [2, 3]
    assert scalars["eval/loss"][-1][1] == pytest.approx(summary["eval_loss"], rel=1e-6)


def test_report_to_tensorboard_without_the_package_stops_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    loaded = []
    monkeypatch.setattr(single_ft, "load_tokenizer", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as error:
        single_ft.main(["--report-to", "tensorboard", "--out-dir", str(tmp_path / "out")])
    assert str(error.value) == "--report-to tensorboard needs the tensorboard package: uv sync --group tensorboard"
    assert not loaded and not (tmp_path / "out").exists()


@pytest.mark.parametrize("experiment", ["single-ft", "ddp-ft", "fsdp-ft"])
def test_qlora_refuses_clearly_before_anything_starts(experiment, tmp_path, monkeypatch):
    """On a machine without CUDA (this one, CI's), --qlora stops with one line before a process group, the data or
    a model exists; --merge-lora and --dtype fp32 are refused with it anywhere; fsdp-ft does not offer it."""
    import torch.distributed as dist

    module = single_ft if experiment == "single-ft" else load_experiment(experiment)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr(module, "load_tokenizer", lambda *a, **k: loaded.append(a))
    expected = {"single-ft": "--qlora needs a CUDA GPU", "ddp-ft": "--qlora needs a CUDA GPU",
                "fsdp-ft": "--qlora is not offered by fsdp-ft"}[experiment]
    with pytest.raises(SystemExit, match=expected) as error:
        module.main(["--qlora", "--out-dir", str(tmp_path / "out")])
    assert "\n" not in str(error.value) and not loaded and not dist.is_initialized()
    if experiment != "fsdp-ft":
        with pytest.raises(SystemExit, match="--merge-lora with --qlora: merging would round"):
            module.main(["--qlora", "--merge-lora", "--out-dir", str(tmp_path / "out")])
        with pytest.raises(SystemExit, match="--qlora computes in bf16"):
            module.main(["--qlora", "--dtype", "fp32", "--out-dir", str(tmp_path / "out")])


def test_qlora_without_bitsandbytes_names_the_group(monkeypatch):
    import importlib.util

    from common.models import qlora_unavailable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert qlora_unavailable() == "--qlora needs bitsandbytes, which is not installed: uv sync --group qlora"


def test_the_step_never_synchronises_explicitly(tmp_path, small_data, monkeypatch):
    """The step's time comes from two CUDA events read after its one host read (common.metrics.StepClock), not from
    a synchronize around the step: counted here by wrapping every explicit synchronisation the step could call (the
    metrics helper is called on any device, so a synchronize added to the loop shows on a CPU too)."""
    import common.metrics

    calls = []

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(common.metrics, "synchronize", counting("metrics.synchronize", common.metrics.synchronize))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting("Event.synchronize", torch.cuda.Event.synchronize))
    run(tmp_path, "no-sync", small_data, "--steps", 3, "--comm-profile-steps", 0, "--eval-fraction", 0)
    assert calls == []
