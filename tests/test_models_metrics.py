"""common/models.py and common/metrics.py: parameter and FLOP counts, MFU, the step line, comm time, load errors."""

import gc
import json
import tempfile

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config

import common.metrics
from common.attention import setup_attention
from common.data import build_data
from common.metrics import (MetricsLogger, _merged_length, collective_bytes, collective_counts, collective_ms,
                            format_step_line, mfu, peak_flops_per_device, state_bytes)
from common.models import PRESET_COMMON, PRESETS, checkpoint_activations, count_parameters, flops_per_token, \
    load_model, model_config, resolve_model_name, training_flops


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_parameter_count_matches_a_real_model(tied, bias):
    config = Qwen3Config(**{**PRESETS["qwen3-tiny"], **PRESET_COMMON, "tie_word_embeddings": tied,
                            "attention_bias": bias})
    model = AutoModelForCausalLM.from_config(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())


def test_activation_checkpointing_under_either_name_transformers_gives_it(recwarn):
    """transformers 5.2x names the method activation_checkpointing_enable (the old name warns); 5.0-5.1x only has
    gradient_checkpointing_enable: the GPU machine's 5.17 failed on the new name. Both get the same options."""
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**PRESETS["qwen3-tiny"], **PRESET_COMMON}))
    checkpoint_activations(model, use_reentrant=False)
    assert not [w for w in recwarn if "checkpointing" in str(w.message)]
    assert model.model.layers[0].gradient_checkpointing  # the flag each layer reads, under both versions

    class OlderTransformers:  # what 5.17's PreTrainedModel offers
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    older = OlderTransformers()
    checkpoint_activations(older, use_reentrant=False, early_stop=False)
    assert older.kwargs == {"use_reentrant": False, "early_stop": False}


def test_qwen3_0_6b_counts_by_hand():
    config = model_config("qwen3-0.6b")
    d, layers, vocab = 1024, 28, 151936
    attention = d * 16 * 128 + 2 * d * 8 * 128 + 16 * 128 * d + 2 * 128  # q, k, v, o, q_norm, k_norm
    per_layer = attention + 3 * d * 3072 + 2 * d  # + gate/up/down + two RMSNorms
    counts = count_parameters(config)
    assert counts["per_layer"] == per_layer == 15_730_944
    assert counts["total"] == vocab * d + layers * per_layer + d == 596_049_920  # the published "0.6B"
    assert counts["total"] - counts["embedding"] == 440_467_456  # the published "0.44B non-embedding"

    # 6 x (the weights a token multiplies: q, k, v, o, gate, up, down; the LM head) + 12 x L x H x head_dim x S
    matmul = layers * (d * 16 * 128 + 2 * d * 8 * 128 + 16 * 128 * d + 3 * d * 3072) + vocab * d
    expected = 6 * matmul + 12 * layers * 16 * 128 * 1024
    assert flops_per_token(config, 1024) == expected
    assert 4.2e9 < expected < 4.35e9  # "about 4.3 GFLOP per token" at seq 1024
    # LoRA of rank 16: the frozen weights cost 4 per token, the adapters 6 per parameter; no gradient has to reach
    # the frozen embedding, so the first layer's q, k, v (and their adapters' A) take no input gradient.
    adapters = layers * 16 * ((d + 2048) + 2 * (d + 1024) + (2048 + d) + 2 * (d + 3072) + (3072 + d))
    first_qkv = d * 2048 + 2 * d * 1024 + 3 * 16 * d
    assert training_flops(config, 16).per_token == 4 * matmul + 6 * adapters - 2 * first_qkv


def test_mfu_by_hand():
    flops = flops_per_token(model_config("qwen3-0.6b"), 1024)
    # 100k tokens/s on one H100 SXM (989.4 dense bf16 TFLOP/s) is about 43% MFU
    value = mfu(100_000, flops, peak_flops_per_device("NVIDIA H100 80GB HBM3"), 1)
    assert value == pytest.approx(100_000 * flops / 989.4e12)
    assert 0.42 < value < 0.44
    # two devices doing the same total work: half the utilisation each
    assert mfu(100_000, flops, 989.4e12, 2) == pytest.approx(value / 2)
    assert mfu(100_000, flops, None, 1) is None


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA GeForce RTX 3090", 71.0),
    ("NVIDIA RTX A6000", 154.8), ("AMD Instinct MI100", 92.3), ("AMD Instinct MI250X", 191.5),
    ("AMD Instinct MI250", 181.0),
    # other chips under a known card's name: no peak rather than their namesake's
    ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("NVIDIA RTX 6000 Ada Generation", None),
    ("x86_64", None), ("NVIDIA GeForce GTX 1080", None)])
def test_peak_flops_table(name, tflops):
    value = peak_flops_per_device(name)
    assert (value is None) if tflops is None else value == pytest.approx(tflops * 1e12)


def adapted(model, rank):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def test_lora_flops_count_the_real_peft_model(tokenizer):
    """4 per frozen weight and 6 per adapter parameter, summed over the linear layers of a real peft model."""
    model = adapted(load_model("qwen3-tiny", tokenizer, "sdpa"), 8)
    per_token = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # the adapters' A and B, the frozen projections, the tied LM head
            weight = module.weight
            per_token += (6 if weight.requires_grad else 4) * weight.numel()
            # The embedding's output needs no gradient: the first layer's q, k, v and their A take no input one.
            if ".layers.0.self_attn." in name and any(p in name for p in ("q_proj", "k_proj", "v_proj")) \
                    and "lora_B" not in name:
                per_token -= 2 * weight.numel()
    assert per_token == training_flops(model.config, 8).per_token
    assert training_flops(model.config, 8).per_token < 0.75 * training_flops(model.config).per_token


@pytest.mark.parametrize("preset,lora_rank", [("qwen3-tiny", 0), ("qwen3-tiny", 8), ("qwen3-moe-tiny", 0),
                                              ("qwen3-moe-tiny", 4)])
def test_training_flops_are_what_a_step_multiplies(tokenizer, preset, lora_rank):
    """torch's FLOP counter over a real forward and backward of a packed row (varlen: one attention call per
    document): every matrix multiply is the count's weights part, the attention forward a third of its part."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    attention = setup_attention(torch.device("cpu"), "varlen", print_fn=lambda line: None)
    model = load_model(preset, tokenizer, attention.impl, allow_moe=True)
    if preset == "qwen3-moe-tiny":
        model.set_experts_implementation("eager")  # one F.linear per expert, which the counter sees
    if lora_rank:
        model = adapted(model, lora_rank)
    lengths = [7, 19, 3, 11]  # short: the count is exact at any length, the LM head's cost is not small
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=torch.randint(0, 8000, position_ids.shape), position_ids=position_ids,
                       attention_mask=None, use_cache=False,
                       **attention.forward_kwargs(position_ids, torch.device("cpu"))).logits
        logits.sum().backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    flops = training_flops(model.config, lora_rank)
    assert counted["aten.mm"] == flops.per_token * sum(lengths)
    # The attention kernel's forward (its backward also recomputes the scores, which MFU does not count).
    forward = sum(flops for op, flops in counted.items() if "scaled_dot_product" in op and "backward" not in op)
    assert 3 * forward == flops.per_pair * sum(n * n for n in lengths)
    assert flops.of_documents(lengths) == counted["aten.mm"] + 3 * forward


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_the_fused_loss_runs_the_lm_head_on_loss_tokens_only(tokenizer, lora_rank):
    """torch's FLOP counter over the decoder and common/loss.py's fused loss (what --loss-chunk-tokens runs): the
    weights' matrix multiplies are the count with the LM head on the loss tokens alone, 6 V d each (4 under LoRA,
    whose head is frozen), and nothing for the other tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    from common.data import IGNORE_INDEX
    from common.loss import fused_linear_cross_entropy

    torch.manual_seed(0)
    attention = setup_attention(torch.device("cpu"), "varlen", print_fn=lambda line: None)
    model = load_model("qwen3-tiny", tokenizer, attention.impl)
    if lora_rank:
        model = adapted(model, lora_rank)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    lengths = [7, 19, 3, 11]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.randint(0, 8000, position_ids.shape)
    labels[0, ::3] = IGNORE_INDEX  # 14 of the 40 tokens carry no loss
    loss_tokens = int((labels != IGNORE_INDEX).sum())
    def inplace_addmm(accumulator, first, second, *args, out_shape=None, **kwargs):  # the counter knows addmm only
        return 2 * first[0] * first[1] * second[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: inplace_addmm}) as counter:
        hidden = decoder(input_ids=torch.randint(0, 8000, position_ids.shape), position_ids=position_ids,
                         attention_mask=None, use_cache=False,
                         **attention.forward_kwargs(position_ids, torch.device("cpu"))).last_hidden_state
        fused_linear_cross_entropy(hidden, head.weight, labels, 16, torch.tensor(1.0)).backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    flops = training_flops(model.config, lora_rank)
    weights = counted["aten.mm"] + counted.get("aten.addmm_", 0)  # the head's weight gradient: addmm_, in fp32
    assert flops.lm_head == (4 if lora_rank else 6) * 8192 * 256  # V x d of qwen3-tiny
    assert weights == flops.per_token * sum(lengths) - flops.lm_head * (sum(lengths) - loss_tokens)
    forward = sum(flops for op, flops in counted.items() if "scaled_dot_product" in op and "backward" not in op)
    assert flops.of_documents(lengths, loss_tokens) == weights + 3 * forward
    with pytest.raises(ValueError, match="cannot run on 41 of 40 tokens"):
        flops.of_documents(lengths, 41)


def test_a_steps_flops_by_hand_with_and_without_the_fused_loss(tmp_path, monkeypatch):
    """qwen3-tiny (d 256, 4 layers, 8 heads of 32, 4 KV heads, MLP 768, vocabulary 8,192, tied head), one step of two
    conversations of 3 and 5 tokens, 4 of them loss tokens, counted by hand; the Recorder turns the fused loss's
    count on from --loss-chunk-tokens."""
    monkeypatch.setattr(common.metrics, "peak_memory_gib", lambda device: 1.0)
    per_layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 768  # q, k, v, o; gate, up, down
    head = 8192 * 256
    pairs = 12 * 4 * 8 * 32 * (3 * 3 + 5 * 5)  # scores and weighted sum, forward and backward, per (query, key)
    every_token = 6 * (4 * per_layer + head) * 8 + pairs
    assert every_token == 252_076_032
    for fused, expected in ((False, every_token), (True, every_token - 6 * head * (8 - 4))):
        logger = MetricsLogger(out_dir=tmp_path / str(fused), total_steps=1, warmup_steps=0,
                               model_config=model_config("qwen3-tiny"), device=torch.device("cpu"), world_size=1,
                               is_main=True, head_on_loss_tokens=fused)
        record = logger.log_step(1, 1.0, 1e-3, 1.0, tokens=8, loss_tokens=4, step_ms=10.0, comm_ms=None,
                                 print_fn=lambda line: None, documents=[3, 5])
        summary = logger.write_summary()
        assert record["flops"] == expected
        assert summary["flops_per_token"] == expected / 8
        assert summary["lm_head_flops_on"] == ("loss tokens" if fused else "every token")
    assert expected == 201_744_384

    class Config:  # the Recorder's view of a train.py Config
        out_dir, steps, timing_warmup_steps, comm_profile_steps, lora_rank = tmp_path / "rec", 2, 0, 0, 0
        report_to, log_every, model = "none", 1, "qwen3-tiny"

    from common.metrics import Recorder

    for chunk, fused in ((None, False), (0, False), (64, True)):  # None: an experiment without the flag
        if chunk is not None:
            Config.loss_chunk_tokens = chunk
        recorder = Recorder("test", Config, torch.device("cpu"), model_config("qwen3-tiny"), None, 1)
        recorder.collector.close()
        gc.callbacks.remove(recorder.metrics._time_gc)
        assert recorder.metrics.head_on_loss_tokens is fused, chunk


@pytest.mark.parametrize("packing", [True, False])
def test_attention_is_counted_per_document_of_each_step(tokenizer, small_data, packing):
    """The step's documents against a brute-force count of the (query, key) pairs that share a conversation in its
    rows; without packing each row is one conversation of its real length."""
    data = build_data(small_data, tokenizer, 256, packing=packing, seed=0)
    rows = data.rows_for_step(3, 4)
    documents = data.step_documents(3, 4)
    assert sum(documents) == data.step_real_tokens(3, 4)
    pairs = 0
    for row in rows.tolist():
        real = int(data.train.real_tokens[row])  # the row's conversations, then its padding
        conversation = torch.cumsum(data.train.position_ids[row, :real] == 0, dim=0)
        pairs += int((conversation[:, None] == conversation[None, :]).sum())
    assert sum(n * n for n in documents) == pairs
    if packing:
        assert len(documents) > len(rows) and pairs < 0.5 * len(rows) * 256 ** 2  # far below the whole rows
    else:
        assert len(documents) == len(rows)
    flops = training_flops(model_config("qwen3-tiny"))
    assert flops.of_documents(documents) == flops.per_token * sum(documents) + flops.per_pair * pairs


def test_mfu_counts_each_steps_documents_and_an_unknown_gpu_says_so_once(tmp_path, monkeypatch):
    config = model_config("qwen3-tiny")
    flops = training_flops(config)
    monkeypatch.setattr(common.metrics, "peak_memory_gib", lambda device: 1.0)
    steps = [([100, 300], 200.0), ([400], 100.0), ([50] * 8, 300.0)]  # (documents, step_ms)

    def run(name: str, is_main: bool = True):
        monkeypatch.setattr(common.metrics, "device_name", lambda device: name)
        logger = MetricsLogger(out_dir=tmp_path / name, total_steps=3, warmup_steps=0, model_config=config,
                               device=torch.device("cuda"), world_size=2, is_main=is_main)
        lines = []
        for step, (documents, step_ms) in enumerate(steps, start=1):
            logger.log_step(step, 1.0, 1e-3, 1.0, sum(documents), 10, step_ms, None, print_fn=lines.append,
                            documents=documents)
        return logger, lines, logger.write_summary(model=dict(flops_per_token=flops.dense_per_token(400)))

    logger, lines, summary = run("NVIDIA H100 NVL")
    total = sum(flops.of_documents(documents) for documents, _ in steps)
    assert [r["flops"] for r in logger.records] == [flops.of_documents(documents) for documents, _ in steps]
    assert summary["flops_per_token"] == pytest.approx(total / 1200)
    assert summary["mfu"] == pytest.approx(total / 0.6 / (835.5e12 * 2))
    assert logger.records[1]["mfu"] == pytest.approx(flops.of_documents([400]) / 0.1 / (835.5e12 * 2))
    # every token attending to a whole row of 400: the figure of tools that do not see documents
    assert summary["mfu_dense"] == pytest.approx(1200 / 0.6 * flops.dense_per_token(400) / (835.5e12 * 2))
    assert summary["mfu_dense"] > summary["mfu"]
    assert not any(line.startswith("mfu:") for line in lines)

    logger, lines, summary = run("NVIDIA GeForce GTX 1080")
    notices = [line for line in lines if line.startswith("mfu:")]
    assert len(notices) == 1 and "GTX 1080" in notices[0] and lines.index(notices[0]) == 0
    assert summary["mfu"] is None and all(r["mfu"] is None for r in logger.records)
    assert summary["flops_per_token"] == pytest.approx(total / 1200)  # the work is known, the peak is not
    assert run("NVIDIA GeForce GTX 1080", is_main=False)[1] == []  # rank 0 says it
    with pytest.raises(ValueError, match="documents hold 400 tokens, not its 300"):
        logger.log_step(4, 1.0, 1e-3, 1.0, 300, 10, 100.0, None, documents=[400])


def test_step_line_has_the_contract_format():
    record = dict(step=12, loss=2.31412, lr=3e-4, grad_norm=1.0213, step_ms=812.2, comm_ms=95.4,
                  tokens_per_s=5031.2, mfu=0.4123, peak_mem_gib=13.61)
    assert format_step_line(record, 50) == ("step 12/50 | loss 2.3141 | lr 3.0e-04 | grad_norm 1.02 | step_ms 812 | "
                                            "comm_ms 95 | tok/s 5,031 | mfu 0.41 | mem 13.6 GiB")
    assert format_step_line(record, 50, eta_s=92.4).endswith("mem 13.6 GiB | eta 1m32s")
    assert format_step_line(record, 50, eta_s=3900).endswith("| eta 1h05m")
    record.update(comm_ms=None, mfu=None)
    assert "comm_ms - |" in format_step_line(record, 50) and "mfu - |" in format_step_line(record, 50)


def test_merged_intervals_count_overlap_once():
    assert _merged_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert _merged_length([]) == 0


def test_collective_time_counts_and_bytes_are_seen_by_the_profiler():
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        tensor = torch.randn(1_000_000)
        profile = lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        with profile() as with_comm:
            dist.all_reduce(tensor)
            dist.all_gather_into_tensor(torch.empty(1000, dtype=torch.bfloat16), torch.ones(1000, dtype=torch.bfloat16))
        with profile() as without_comm:
            tensor @ tensor
    finally:
        dist.destroy_process_group()
    assert collective_ms(with_comm) > 0
    assert collective_ms(without_comm) == 0
    assert collective_counts(with_comm) == {"c10d::allreduce_": 1, "c10d::_allgather_base_": 1}
    assert collective_counts(without_comm) == {}
    # fp32 all-reduce of 1e6 elements, bf16 all-gather of a 1000-element shard (the input each rank hands over)
    assert collective_bytes(with_comm) == {"gloo:all_reduce": {"calls": 1, "bytes": 4_000_000},
                                           "gloo:all_gather": {"calls": 1, "bytes": 2_000}}
    assert collective_bytes(without_comm) == {}


def test_state_bytes_count_each_storage_once():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5, bias=False))
    n = sum(p.numel() for p in model.parameters())  # 220 + 100
    optimizer = torch.optim.AdamW(model.parameters())
    assert state_bytes(model.parameters(), optimizer) == dict(weights=4 * n, grads=0, optimizer=0, master=0)
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    flat = torch.zeros(n)  # a master copy as one flat buffer, handed over as views: counted once
    views = [flat[:220], flat[220:]]
    measured = state_bytes(model.parameters(), optimizer, master=views)
    # AdamW: exp_avg and exp_avg_sq per parameter (4 bytes each) + one fp32 step counter per parameter tensor
    assert measured == dict(weights=4 * n, grads=4 * n, optimizer=8 * n + 3 * 4, master=4 * n)


def test_summary_excludes_warmup_and_profiled_steps(tmp_path):
    logger = MetricsLogger(out_dir=tmp_path, total_steps=5, warmup_steps=2, model_config=model_config("qwen3-tiny"),
                           device=torch.device("cpu"), world_size=2, is_main=True)
    lines = []
    for step, step_ms in enumerate([1000.0, 500.0, 900.0, 100.0, 300.0], start=1):
        if step == 2:
            gc.collect()  # a full collection between step lines 1 and 2 is timed into step 2's record
        logger.log_step(step, loss=1.0 / step, lr=1e-3, grad_norm=1.0, tokens=1000, loss_tokens=500,
                        step_ms=step_ms, comm_ms=10.0 if step == 3 else None, print_fn=lines.append)
    # The first line's eta is 4 steps of its own step_ms; the last has nothing left.
    assert lines[0].endswith("| eta 0m04s") and lines[-1].endswith("| eta 0m00s")
    # Step 3 ran under the profiler (comm_ms): slower, so it is left out of the speed averages.
    summary = logger.write_summary(experiment="test", comm_timer=type("Timer", (), dict(
        profiled=[3], collectives_per_step=lambda self: {"c10d::allreduce_": 1.0},
        collective_bytes_per_step=lambda self: {"gloo:all_reduce": {"calls": 1.0, "bytes": 8.0}}))())
    assert summary["step_ms"] == pytest.approx(200.0)  # steps 4 and 5 only
    # tokens over time, not the mean of the two steps' rates (10,000 and 3,333 tokens/s)
    assert summary["tokens_per_s"] == pytest.approx(2000 / 0.4)
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 2)
    assert summary["comm_ms"] == 10.0 and summary["mfu"] is None and summary["final_loss"] == 0.2
    assert summary["profiled_steps"] == [3] and summary["profiled_step_ms"] == 900.0
    assert (summary["measured_steps"], summary["timed_steps"], summary["warmup_steps_excluded"]) == (3, 2, 2)
    assert summary["collective_bytes_per_step"] == {"gloo:all_reduce": {"calls": 1.0, "bytes": 8.0}}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert logger._time_gc not in gc.callbacks  # the garbage-collection timer ends with the run
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert set(records[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "loss_tokens", "step_ms", "comm_ms",
                               "tokens_per_s", "peak_mem_gib", "mfu", "flops", "gc_ms", "compiles"}
    assert records[1]["gc_ms"] > 0 and records[1]["gc_ms"] > records[2]["gc_ms"]  # counted once, then reset
    # A run too short to have unprofiled measured steps averages what it has.
    short = MetricsLogger(out_dir=tmp_path / "short", total_steps=2, warmup_steps=1,
                          model_config=model_config("qwen3-tiny"), device=torch.device("cpu"), world_size=1,
                          is_main=False)
    for step in (1, 2):
        short.log_step(step, 1.0, 1e-3, 1.0, 100, 50, 100.0 * step, None, print_fn=lambda line: None)
    assert short.averages(profiled=[2])["step_ms"] == 200.0


def test_auto_model_on_cpu_is_the_tiny_preset(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name, notice = resolve_model_name("auto")
    assert name == "qwen3-tiny" and "no GPU" in notice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_model_name("auto")[0] == "Qwen/Qwen3-0.6B-Base"
    assert resolve_model_name("qwen3-4b") == ("qwen3-4b", None)


def test_unloadable_models_name_the_fix(tmp_path, tokenizer, monkeypatch):
    with pytest.raises(SystemExit, match="check the path"):
        load_model(str(tmp_path / "missing-model"), tokenizer, "sdpa")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="needs config.json"):
        load_model(str(tmp_path / "empty"), tokenizer, "sdpa")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit, match="hf download no-such-org/no-such-model.*HF_HUB_OFFLINE=1.*qwen3-tiny"):
        load_model("no-such-org/no-such-model", tokenizer, "sdpa")


class PackedLinear(torch.nn.Module):
    """A stand-in for bitsandbytes' Linear4bit: a frozen integer weight whose state dict also carries its
    quantization constants, which load_state_dict cannot take back (as with a loaded 4-bit model)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randint(0, 255, (8, 1), dtype=torch.uint8), requires_grad=False)
        self.weight.absmax = torch.ones(2)  # Params4bit answers its constants as attributes, too
        self.adapter = torch.nn.Linear(4, 4, bias=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight.absmax"] = self.weight.absmax


def test_checkpoint_of_a_quantized_model_holds_only_its_trainable_parameters(tmp_path):
    """QLoRA's resume: the packed base is not saved (the resuming run loads it from its source); the adapters and
    AdamW's state come back exactly."""
    import torch.distributed.checkpoint as dcp

    from common.checkpoint import load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(PackedLinear())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    model, optimizer, scheduler = build()
    model[0].adapter(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    folder = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    saved = set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    assert "model.0.adapter.weight" in saved and not any(key.startswith("model.0.weight") for key in saved)

    fresh, fresh_optimizer, fresh_scheduler = build()
    base = fresh[0].weight.clone()
    assert not torch.equal(fresh[0].adapter.weight, model[0].adapter.weight)
    assert load_checkpoint(folder, fresh, fresh_optimizer, fresh_scheduler) == 1
    assert torch.equal(fresh[0].adapter.weight, model[0].adapter.weight)
    assert torch.equal(fresh[0].weight, base)
    restored = fresh_optimizer.state[fresh[0].adapter.weight]["exp_avg_sq"]
    assert torch.equal(restored, optimizer.state[model[0].adapter.weight]["exp_avg_sq"])


def test_warm_up_is_counted_until_the_step_time_settles():
    from common.metrics import steps_until_settled

    # Compilation in steps 1-2, a straggler at step 6: the warm-up is the leading slow steps only.
    assert steps_until_settled([9000.0, 2500.0, 110.0, 100.0, 105.0, 900.0, 100.0, 98.0]) == 2
    assert steps_until_settled([100.0, 101.0, 99.0, 100.0]) == 0
    assert steps_until_settled([100.0, 101.0, 99.0]) is None  # too short to tell


def test_compilations_are_counted_per_step(tmp_path):
    from torch._dynamo.utils import counters

    from common.metrics import MetricsLogger

    logger = MetricsLogger(out_dir=tmp_path, total_steps=3, warmup_steps=1, model_config=model_config("qwen3-tiny"),
                           device=torch.device("cpu"), world_size=1, is_main=True)
    for step, new_frames in ((1, 2), (2, 0), (3, 1)):  # step 3 recompiles one frame
        counters["frames"]["ok"] += new_frames
        logger.log_step(step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=10, loss_tokens=5, step_ms=10.0,
                        comm_ms=None, print_fn=lambda line: None)
    summary = logger.write_summary(experiment="test")
    assert [record["compiles"] for record in logger.records] == [2, 0, 1]
    assert summary["compiled_frames"] == 3 and summary["recompiles"] == 1


def test_every_committed_gpu_run_carries_the_flops_of_its_steps():
    """MFU is the FLOPs of the work done over the time: every GPU run under devlog/data carries its FLOPs per token
    (and each step's), recorded by the run or recounted once into its files (`mfu_recount`), so no reader recounts."""
    import json

    from conftest import REPO_ROOT

    runs = [path.parent for path in (REPO_ROOT / "devlog" / "data").rglob("summary.json")
            if json.loads(path.read_text())["hardware"]["device_kind"] in ("cuda", "rocm")]
    assert len(runs) >= 15
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert "flops_per_token" in summary, run
        if summary["flops_per_token"] is not None:
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
            assert all(record["flops"] > record["tokens"] * summary["model"]["parameters"] for record in records), run
        if (summary["config"].get("loss_chunk_tokens") or 0) > 0 and summary["flops_per_token"] is not None:
            assert summary["lm_head_flops_on"] == "loss tokens", run  # recorded so, or recounted once


def test_the_recount_of_a_fused_loss_run_gives_what_the_recorder_now_records(tmp_path, monkeypatch):
    """assets/recount_head_flops.py on a run recorded with the head on every token gives the files the Recorder
    writes now (per-step FLOPs and MFU, the summary's averages, warm-up and profiled steps left out as the run did);
    a summary that does not follow from its steps is refused; the committed runs need no recount."""
    import sys

    from conftest import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "assets"))
    import recount_head_flops

    monkeypatch.setattr(common.metrics, "peak_memory_gib", lambda device: 1.0)
    monkeypatch.setattr(common.metrics, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    steps = [([100, 300], 150, 200.0), ([400], 90, 100.0), ([50] * 8, 300, 300.0), ([250, 5], 20, 120.0)]

    def recorded(fused: bool):
        logger = MetricsLogger(out_dir=tmp_path / str(fused), total_steps=4, warmup_steps=1, world_size=1,
                               device=torch.device("cuda"), model_config=model_config("qwen3-0.6b"), is_main=True,
                               head_on_loss_tokens=fused)
        for step, (documents, loss_tokens, step_ms) in enumerate(steps, start=1):
            logger.log_step(step, 1.0, 1e-3, 1.0, sum(documents), loss_tokens, step_ms, None,
                            print_fn=lambda line: None, documents=documents)
        summary = logger.averages(profiled=[3])
        gc.callbacks.remove(logger._time_gc)  # write_summary would, which this run does not call
        summary.update(hardware=dict(device_kind="cuda", device_name="NVIDIA H100 80GB HBM3", world_size=1),
                       config=dict(model="Qwen/Qwen3-0.6B-Base", loss_chunk_tokens=1024, lora_rank=0),
                       model=dict(parameters=596_049_920))
        return summary, logger.records

    before, before_steps = recorded(False)
    now, now_steps = recorded(True)
    assert recount_head_flops.needs_recount(before)
    summary, records = recount_head_flops.recount(before, before_steps)
    assert [r["flops"] for r in records] == pytest.approx([r["flops"] for r in now_steps], rel=1e-12)
    assert [r["mfu"] for r in records] == pytest.approx([r["mfu"] for r in now_steps], rel=1e-12)
    assert summary["flops_per_token"] == pytest.approx(now["flops_per_token"], rel=1e-12)
    assert summary["mfu"] == pytest.approx(now["mfu"], rel=1e-12) and summary["mfu"] < before["mfu"]
    assert summary["mfu_head_every_token"] == before["mfu"] and summary["lm_head_flops_on"] == "loss tokens"
    assert not recount_head_flops.needs_recount(summary)
    with pytest.raises(ValueError, match="is not its timed steps'"):
        recount_head_flops.recount(dict(before, mfu=before["mfu"] * 1.01), before_steps)
    assert recount_head_flops.main(["--check"]) == 0


def test_a_dirty_tree_is_told_apart_by_the_hash_of_its_diff(tmp_path):
    """git_commit marks uncommitted changes "-dirty"; git_diff_hash names which: the same changes give the same hash
    (from any folder of the checkout), other changes or another untracked file another one, an ignored file none, a
    clean tree None."""
    import subprocess

    from common.metrics import git_commit, git_diff_hash

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "sub").mkdir()
    (tmp_path / "train.py").write_text("lr = 1e-3\n")
    (tmp_path / "sub" / "keep.txt").write_text("kept\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    assert git_diff_hash(tmp_path) is None and not git_commit(tmp_path).endswith("-dirty")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "summary.json").write_text("{}")  # ignored: the tree is still clean
    (tmp_path / "devlog" / "data" / "a-series").mkdir(parents=True)
    (tmp_path / "devlog" / "data" / "a-series" / "summary.json").write_text("{}")  # what run_series keeps
    assert git_diff_hash(tmp_path) is None

    (tmp_path / "train.py").write_text("lr = 2e-3\n")
    first = git_diff_hash(tmp_path)
    assert git_commit(tmp_path).endswith("-dirty") and len(first) == 16
    assert git_diff_hash(tmp_path / "sub") == first  # where the script lives does not change the tree's hash
    (tmp_path / "train.py").write_text("lr = 3e-3\n")
    assert git_diff_hash(tmp_path) not in (None, first)
    (tmp_path / "train.py").write_text("lr = 2e-3\n")
    assert git_diff_hash(tmp_path) == first  # the same change, the same hash
    (tmp_path / "sub" / "notes.txt").write_text("new\n")  # untracked, not ignored
    with_untracked = git_diff_hash(tmp_path)
    assert with_untracked not in (None, first)
    (tmp_path / "train.py").write_text("lr = 1e-3\n")  # back to the commit: only the untracked file differs
    assert git_diff_hash(tmp_path) not in (None, first, with_untracked)
    assert not git_commit(tmp_path).endswith("-dirty")  # "-dirty" counts tracked files only; the hash sees both
    assert git_diff_hash(tmp_path.parent / "nowhere") is None


def test_run_series_runs_from_a_commit_only(monkeypatch, tmp_path):
    """assets/run_series.py refuses a checkout with uncommitted changes (its runs would record a commit that does not
    hold what they ran) unless --allow-dirty; a dry run lists the commands either way; devlog/data/ (where the series
    keep their runs) does not count as a change."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "assets"))
    import run_series

    ran = []
    monkeypatch.setattr(run_series, "run_series", lambda name, day, dry_run, force: ran.append((name, dry_run)) or [])
    monkeypatch.setattr(run_series, "uncommitted_changes", lambda: ["common/loss.py", "README.md"])
    with pytest.raises(SystemExit, match=r"uncommitted changes \(common/loss.py, README.md\): .* commit first"):
        run_series.main(["workload"])
    assert ran == []
    run_series.main(["workload", "--dry-run"])
    run_series.main(["workload", "--allow-dirty"])
    assert ran == [("workload", True), ("workload", False)]

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "devlog" / "data" / "s").mkdir(parents=True)
    (tmp_path / "devlog" / "data" / "s" / "summary.json").write_text("{}")
    monkeypatch.undo()  # the real uncommitted_changes, on a checkout that holds only a kept run
    monkeypatch.setattr(run_series, "REPO_ROOT", tmp_path)
    assert run_series.uncommitted_changes() == []
    (tmp_path / "notes.txt").write_text("x")
    assert run_series.uncommitted_changes() == ["notes.txt"]
