"""common/data.py: validation with file:line errors, assistant-only labels, packing, counts, batch semantics."""

import json

import pytest
import torch

from common.data import (CHATML_TEMPLATE, IGNORE_INDEX, DataError, build_data, chat_template_for, pack_rows,
                         read_conversations, tokenize_conversations)

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


def test_template_without_generation_markers_falls_back_to_chatml(tokenizer):
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
