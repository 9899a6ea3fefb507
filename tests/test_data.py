"""common/data.py: validation with file:line (or row) errors, every --data format, assistant-only labels from the
template's rendering (thinking on, off, mixed), --show-sample, packing, counts, batch semantics."""

import json
import re

import pytest
import torch

from common.data import (CHATML_TEMPLATE, IGNORE_INDEX, Conversation, DataError, build_data, pack_rows,
                         read_conversations, sample_text, tokenize_conversations)
from conftest import REPO_ROOT

GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}


def write_lines(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# One entry per kind of bad input: the bad record sits on line 3 after two good ones (and a blank line),
# and the error must name that file and line and say what is wrong.
BAD_RECORDS = {
    "invalid json": ('{"messages": [', "invalid JSON"),
    "not an object": ('["user", "hi"]', "expected a JSON object"),
    "unknown format": ('{"text": "hello"}', "unknown record format"),
    "messages not a list": ('{"messages": "hi"}', "non-empty list"),
    "empty messages": ('{"messages": []}', "non-empty list"),
    "missing content": ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}',
                        "message 0: missing field 'content'"),
    "missing role": ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}',
                     "message 0: missing field 'role'"),
    "empty content": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
                      "message 1: field 'content' is empty"),
    "content not a string": ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
                             "must be a string"),
    "unknown role": ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
                     "unknown role 'robot'"),
    "no assistant turn": ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    "instruction without output": ('{"instruction": "Say hi"}', "missing field 'output'"),
    "empty completion": ('{"prompt": "Say hi", "completion": ""}', "field 'completion' is empty"),
}


@pytest.mark.parametrize("kind", sorted(BAD_RECORDS))
def test_bad_record_names_file_and_line(tmp_path, kind):
    record, expected = BAD_RECORDS[kind]
    path = write_lines(tmp_path, [json.dumps(GOOD), "", record, json.dumps(GOOD)])
    with pytest.raises(DataError) as error:
        read_conversations(path)
    message = str(error.value)
    assert message.startswith(f"{path}:3: "), message
    assert expected in message


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path, ["", "   "])
    with pytest.raises(DataError, match=rf"^{path}:1: empty file"):
        read_conversations(path)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_conversations(tmp_path / "nope.jsonl")


def test_other_formats_become_messages(tmp_path):
    path = write_lines(tmp_path, [
        json.dumps({"instruction": "Add", "input": "2 and 3", "output": "5"}),
        json.dumps({"instruction": "Say hi", "input": "", "output": "hi"}),
        json.dumps({"prompt": "Capital of France?", "completion": "Paris"}),
    ])
    conversations = read_conversations(path)
    assert [c.messages for c in conversations] == [
        [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}],
    ]
    assert [c.source for c in conversations] == [f"{path}:1", f"{path}:2", f"{path}:3"]


def test_folder_reads_every_jsonl_in_order(tmp_path):
    write_lines(tmp_path, [json.dumps({"prompt": "b", "completion": "2"})], "b.jsonl")
    write_lines(tmp_path, [json.dumps({"prompt": "a", "completion": "1"})], "a.jsonl")
    assert [c.messages[0]["content"] for c in read_conversations(tmp_path)] == ["a", "b"]


def test_labels_are_exactly_the_assistant_turns(tmp_path, tokenizer):
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse 'abc'."},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "And uppercase?"},
        {"role": "assistant", "content": "CBA"},
    ]}
    (conversation,) = tokenize_conversations(read_conversations(write_lines(tmp_path, [json.dumps(record)])),
                                             tokenizer)
    ids, labels = conversation.input_ids, conversation.labels
    assert len(ids) == len(labels) and labels[-1] == IGNORE_INDEX
    # labels are shifted: wherever a label is set it is the next input token
    assert all(label == ids[t + 1] for t, label in enumerate(labels[:-1]) if label != IGNORE_INDEX)
    targets = [label for label in labels if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "cba<|im_end|>CBA<|im_end|>"
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_template_without_generation_markers_falls_back_to_chatml(tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "assets"))
    from peer_baseline import chat_template_for  # TRL's assistant_only_loss needs the markers

    class NoMarkers:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    assert chat_template_for(NoMarkers()) == CHATML_TEMPLATE
    assert chat_template_for(tokenizer) == tokenizer.chat_template


def test_packing_puts_every_token_in_exactly_one_row(small_data, tokenizer):
    conversations = tokenize_conversations(read_conversations(small_data), tokenizer)
    seq_len = 128
    conversations = [c for c in conversations if len(c.input_ids) <= seq_len]
    rows = pack_rows(conversations, seq_len, tokenizer.pad_token_id, packing=True)
    placed = []
    for r, segments in enumerate(rows.segments):
        offset = 0
        for index, length in segments:
            assert rows.input_ids[r, offset:offset + length].tolist() == conversations[index].input_ids
            assert rows.labels[r, offset:offset + length].tolist() == conversations[index].labels
            assert rows.position_ids[r, offset:offset + length].tolist() == list(range(length))
            placed.append(index)
            offset += length
        assert (rows.labels[r, offset:] == IGNORE_INDEX).all()  # padding carries no loss
        assert rows.real_tokens[r] == offset
    assert sorted(placed) == list(range(len(conversations)))
    assert len(rows) < len(conversations) / 2  # short conversations really share rows
    unpacked = pack_rows(conversations, seq_len, tokenizer.pad_token_id, packing=False)
    assert len(unpacked) == len(conversations) and unpacked.n_real_tokens == rows.n_real_tokens


def test_build_data_counts_everything(small_data, tokenizer):
    seq_len = 64  # short enough that some conversations are truncated
    lengths = [len(c.input_ids) for c in tokenize_conversations(read_conversations(small_data), tokenizer)]
    data = build_data(small_data, tokenizer, seq_len, packing=True, eval_fraction=0.1, seed=0)
    stats = data.stats
    assert stats["n_conversations"] == len(lengths) == stats["n_train_conversations"] + stats["n_eval_conversations"]
    assert stats["n_eval_conversations"] == round(0.1 * len(lengths))
    assert stats["n_truncated"] == sum(n > seq_len for n in lengths) > 0
    assert stats["truncated_tokens"] == sum(max(0, n - seq_len) for n in lengths)
    # nothing dropped without being counted: kept tokens + cut tokens = all tokens
    assert data.train.n_real_tokens + data.eval.n_real_tokens + stats["truncated_tokens"] == sum(lengths)


def test_rows_are_deterministic_and_depend_on_the_seed(small_data, tokenizer):
    first = build_data(small_data, tokenizer, 128, seed=0)
    again = build_data(small_data, tokenizer, 128, seed=0)
    other = build_data(small_data, tokenizer, 128, seed=1)
    assert torch.equal(first.train.input_ids, again.train.input_ids)
    assert torch.equal(first.rows_for_step(3, 8), again.rows_for_step(3, 8))
    assert not torch.equal(first.rows_for_step(0, 8), other.rows_for_step(0, 8))


def test_any_split_of_a_step_covers_the_same_rows(small_data, tokenizer):
    data = build_data(small_data, tokenizer, 128, seed=0)

    def rows(batches):
        return torch.cat([b["input_ids"] for b in batches])

    for step in (0, 5, 40):  # step 40 x 4 rows runs past one epoch of this small file
        whole = rows(data.micro_batches(step, 4, 1))
        assert torch.equal(whole, rows(data.micro_batches(step, 1, 4)))
        assert torch.equal(whole, rows(data.micro_batches(step, 1, 2, rank=0, world_size=2)
                                       + data.micro_batches(step, 1, 2, rank=1, world_size=2)))
        assert data.step_loss_tokens(step, 4) == int((data.batch(data.train, data.rows_for_step(step, 4))["labels"]
                                                      != IGNORE_INDEX).sum())
    # consecutive steps consume consecutive, distinct rows within an epoch
    assert set(data.rows_for_step(0, 4).tolist()).isdisjoint(data.rows_for_step(1, 4).tolist())


def test_eval_split_does_not_depend_on_packing(small_data, tokenizer):
    packed = build_data(small_data, tokenizer, 128, packing=True, seed=0)
    unpacked = build_data(small_data, tokenizer, 128, packing=False, seed=0)
    assert packed.eval.n_real_tokens == unpacked.eval.n_real_tokens
    assert int((packed.eval.labels != IGNORE_INDEX).sum()) == int((unpacked.eval.labels != IGNORE_INDEX).sum())
    assert len(packed.eval) < len(unpacked.eval)


# ---------------------------------------------------------------------------------------------------------------
# The loss mask from the template's own rendering


def test_mask_from_the_rendering_equals_the_generation_markers(small_data, tokenizer):
    """The built-in template marks assistant text with {% generation %}: transformers' own assistant mask from
    those markers and the mask derived from rendering prefixes agree on every token of the sample data."""
    conversations = read_conversations(small_data)
    ours = tokenize_conversations(conversations, tokenizer)
    encoded = tokenizer.apply_chat_template([c.messages for c in conversations], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    for mine, ids, mask in zip(ours, encoded["input_ids"], encoded["assistant_masks"]):
        assert mine.input_ids == list(ids)
        assert mine.labels == [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [-100]


@pytest.fixture(scope="module")
def thinking_tokenizer():
    """The built-in tokenizer with a template that renders reasoning the way Qwen3's published one does."""
    from common.models import load_tokenizer

    tokenizer = load_tokenizer("qwen3-tiny")
    tokenizer.chat_template = (REPO_ROOT / "assets" / "tokenizer" / "chat_template_thinking.jinja").read_text()
    return tokenizer


def trained_text(tokenizer, messages, **kwargs) -> list[str]:
    """The decoded runs of tokens that carry loss, one string per run."""
    (conversation,) = tokenize_conversations([Conversation(messages, "test:1")], tokenizer, **kwargs)
    runs, current = [], []
    for label in conversation.labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(label)
    return runs + ([tokenizer.decode(current)] if current else [])


USER = {"role": "user", "content": "What is 2 + 2?"}


def test_thinking_on_trains_the_reasoning_and_the_answer(thinking_tokenizer):
    by_field = [USER, {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."}]
    inline = [USER, {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4"}]
    expected = ["<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>"]
    assert trained_text(thinking_tokenizer, by_field) == expected
    assert trained_text(thinking_tokenizer, inline) == expected


def test_thinking_off_leaves_the_empty_think_block_untrained(thinking_tokenizer):
    messages = [USER, {"role": "assistant", "content": "4"}]
    text = thinking_tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<think>\n\n</think>\n\n4<|im_end|>" in text  # the template does render the empty block
    assert trained_text(thinking_tokenizer, messages) == ["4<|im_end|>"]
    assert trained_text(thinking_tokenizer, messages, train_empty_think=True) == ["<think>\n\n</think>\n\n4<|im_end|>"]


def test_mixed_thinking_in_one_conversation(thinking_tokenizer):
    # An earlier turn's reasoning is not rendered once a later user turn follows (as in Qwen3's template), so
    # only its answer is trained; the last turn, without reasoning, gets its answer and end-of-turn only.
    messages = [USER, {"role": "assistant", "content": "4", "reasoning_content": "Easy."},
                {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
    assert trained_text(thinking_tokenizer, messages) == ["4<|im_end|>", "6<|im_end|>"]
    messages[-1]["reasoning_content"] = "Three twice."
    assert trained_text(thinking_tokenizer, messages) == ["4<|im_end|>",
                                                          "<think>\nThree twice.\n</think>\n\n6<|im_end|>"]


def test_mixed_thinking_across_a_dataset(tmp_path, thinking_tokenizer):
    records = [{"messages": [USER, {"role": "assistant", "content": "4", "reasoning_content": "Sum."}]},
               {"messages": [USER, {"role": "assistant", "content": "4"}]}] * 20
    path = write_lines(tmp_path, [json.dumps(r) for r in records])
    data = build_data(path, thinking_tokenizer, 64, eval_fraction=0.0)
    assert data.stats["n_end_of_turn_trained"] == 40
    think = thinking_tokenizer.encode("<think>", add_special_tokens=False)
    labels = data.train.labels.flatten().tolist()
    starts = [t for t in range(len(labels) - len(think)) if labels[t:t + len(think)] == think]
    assert len(starts) == 20  # exactly the conversations with reasoning train a <think> block


def test_no_trained_end_of_turn_stops_the_run(tmp_path, tokenizer):
    class NoEndOfTurn:
        """A template whose assistant turns never close: the model would never learn to stop."""

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"

    with pytest.raises(DataError, match=r"test:1: message 1: no <\|im_end\|> closes the assistant turn"):
        tokenize_conversations([Conversation([USER, {"role": "assistant", "content": "4"}], "test:1")], NoEndOfTurn())
    # Truncation that cuts every conversation before its end-of-turn token is caught after truncation.
    path = write_lines(tmp_path, [json.dumps({"messages": [USER, {"role": "assistant", "content": "four " * 40}]})])
    with pytest.raises(DataError, match="no <\\|im_end\\|> carries loss in any conversation"):
        build_data(path, tokenizer, 24, eval_fraction=0.0)


def test_show_sample_marks_what_carries_loss(small_data, tokenizer):
    data = build_data(small_data, tokenizer, 128, seed=0)
    plain = sample_text(data, tokenizer, color=False)
    header, body = plain.split("\n", 1)
    assert "carry loss (between [[ and ]])" in header
    # Every bracketed piece is assistant text ending in the end-of-turn token; nothing else is bracketed.
    pieces = re.findall(r"\[\[(.*?)\]\]", body, re.S)
    assert pieces and all(piece.endswith("<|im_end|>") for piece in pieces)
    assert body.count("<|im_start|>assistant\n[[") == len(pieces)
    assert "\033[1;32m" in sample_text(data, tokenizer, color=True)


# ---------------------------------------------------------------------------------------------------------------
# Formats other than JSONL, through datasets


def test_every_format_reads_as_its_jsonl(formats, small_data, tokenizer):
    expected = [c.messages for c in read_conversations(small_data)]
    for name in ("data.parquet", "sharegpt.json", "saved"):
        conversations = read_conversations(formats / name)
        assert [c.messages for c in conversations] == expected, name
        assert conversations[2].source == f"{formats / name}: row 3"
    csv = read_conversations(formats / "pairs.csv", columns="prompt=question,completion=answer")
    assert [c.messages for c in csv] == [c.messages for c in read_conversations(formats / "pairs.jsonl")]
    assert len(read_conversations(formats / "saved", split="test")) == 5
    # So build_data makes the same rows of them, which is all an experiment trains on (the launched tests train
    # one format besides JSONL: a CSV under --data-columns).
    reference = build_data(small_data, tokenizer, 128, seed=0)
    for name in ("data.parquet", "sharegpt.json", "saved"):
        built = build_data(formats / name, tokenizer, 128, seed=0)
        for rows, want in ((built.train, reference.train), (built.eval, reference.eval)):
            assert torch.equal(rows.input_ids, want.input_ids) and torch.equal(rows.labels, want.labels), name
            assert torch.equal(rows.position_ids, want.position_ids), name


BAD_SOURCES = {
    "mapped column missing": ("pairs.csv", dict(columns="prompt=query,completion=answer"),
                              "pairs.csv: column 'query' (--data-columns) is not in the data; it has: question, answer"),
    "no known columns": ("pairs.csv", {}, "no column set this script knows: it has question, answer"),
    "unknown split": ("saved", dict(split="validation"), "saved: no split 'validation' (--data-split); it has: train, test"),
    "bad mapping": ("pairs.csv", dict(columns="prompt"), "--data-columns: 'prompt' is not NAME=COLUMN"),
    "unknown name": ("pairs.csv", dict(columns="question=prompt"), "--data-columns: unknown name 'question'"),
}


@pytest.mark.parametrize("kind", sorted(BAD_SOURCES))
def test_bad_sources_are_one_clear_line(formats, kind):
    name, kwargs, expected = BAD_SOURCES[kind]
    with pytest.raises(DataError) as error:
        read_conversations(formats / name, **kwargs)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_bad_row_and_empty_split_name_the_row(tmp_path):
    import datasets

    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": " "}]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad.parquet'}: row 2: field 'completion' is empty")):
        read_conversations(tmp_path / "bad.parquet")
    datasets.Dataset.from_dict({"prompt": [], "completion": []}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: the file has no rows"):
        read_conversations(tmp_path / "empty.parquet")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DataError, match=r"data.txt: unknown file type '.txt'"):
        read_conversations(tmp_path / "data.txt")


def test_unreachable_hub_id_is_one_line(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(DataError) as error:
        read_conversations("some-org/some-dataset")
    message = str(error.value)
    assert message.startswith("some-org/some-dataset: not a local file or folder, and the Hugging Face Hub cannot "
                              "be reached") and "pass a local" in message and "\n" not in message
