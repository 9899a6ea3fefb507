"""SFT data: records -> chat template -> token ids and loss labels -> packed rows -> deterministic batches.

The contract every experiment shares (formats, loss mask, shifted labels, packing, steps): see common/README.md."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")

# ChatML (Qwen3's format) with {% generation %} markers around the assistant's text, for tokenizers without a template
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class DataError(ValueError):
    """Bad training data; the message starts with where: `<file>:<line>:`, `<file>: row <n>:` or the hub id."""


# ---------------------------------------------------------------------------------------------------------------
# Reading and validating records


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    source: str  # "<file>:<line>" or "<file>: row <n>", for error messages and for tracing a row back to its record


# The columns a record may have, by shape, and the names --data-columns maps onto.
SHAPES = {"messages": ("messages",), "conversations": ("conversations",), "instruction": ("instruction", "output"),
          "prompt": ("prompt", "completion")}
KNOWN_COLUMNS = ("messages", "conversations", "instruction", "input", "output", "prompt", "completion")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Formats `datasets` reads (memory-mapped into its cache); .jsonl keeps the reader below, which names lines.
DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SUPPORTED = ".jsonl file or folder, .json, .parquet, .csv or .arrow file, a save_to_disk folder, or a hub id"


def parse_columns(spec: str | None) -> dict[str, str]:
    """--data-columns "prompt=question,completion=answer" -> {"prompt": "question", "completion": "answer"}."""
    if not spec:
        return {}
    pairs = []
    for item in spec.split(","):
        name, sep, column = item.partition("=")
        if not sep or not name.strip() or not column.strip():
            raise DataError(f"--data-columns: '{item}' is not NAME=COLUMN (e.g. prompt=question,completion=answer)")
        pairs.append((name.strip(), column.strip()))
    for name, _ in pairs:
        if name not in KNOWN_COLUMNS:
            raise DataError(f"--data-columns: unknown name '{name}' (expected one of {', '.join(KNOWN_COLUMNS)})")
    return dict(pairs)


def check_columns(columns: dict[str, str], present, where: str) -> None:
    """Every column --data-columns names must be in the data; the error lists the columns it has."""
    missing = [column for column in columns.values() if column not in present]
    if missing:
        raise DataError(f"{where}: column '{missing[0]}' (--data-columns) is not in the data; it has: "
                        f"{', '.join(present)}")


def map_columns(record: object, columns: dict[str, str], where: str) -> object:
    """The record with --data-columns applied: each mapped column renamed to the name this module expects."""
    if not columns or not isinstance(record, dict):
        return record
    check_columns(columns, list(record), where)
    renamed = {key: value for key, value in record.items() if key not in columns.values()}
    renamed.update({name: record[column] for name, column in columns.items()})
    return renamed


def _non_empty_string(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise DataError(f"{where}: missing field '{key}'")
    value = record[key]
    if value is None:
        raise DataError(f"{where}: field '{key}' is empty")
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def _chat_message(message: object, at: str, role_key: str, content_key: str, roles: dict[str, str]) -> dict:
    if not isinstance(message, dict):
        raise DataError(f"{at}: expected an object with '{role_key}' and '{content_key}'")
    role = _non_empty_string(message, role_key, at)
    if role not in roles:
        raise DataError(f"{at}: unknown role '{role}' (expected one of {', '.join(roles)})")
    clean = {"role": roles[role], "content": _non_empty_string(message, content_key, at)}
    # Qwen3's templates render an assistant turn's `reasoning_content` as its <think> block.
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise DataError(f"{at}: field 'reasoning_content' must be a string, got {type(reasoning).__name__}")
        if clean["role"] != "assistant":
            raise DataError(f"{at}: only assistant turns have 'reasoning_content'")
        if reasoning.strip():
            clean["reasoning_content"] = reasoning
    return clean


def _turns(record: dict, key: str, where: str, role_key: str, content_key: str, roles: dict[str, str]) -> list:
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field '{key}' must be a non-empty list")
    clean = [_chat_message(message, f"{where}: message {i}", role_key, content_key, roles)
             for i, message in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing to learn from")
    return clean


def record_to_messages(record: object, where: str) -> list[dict[str, str]]:
    """Validate one record (any of the four shapes) and return it as chat messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _turns(record, "messages", where, "role", "content", {role: role for role in ROLES})
    if "conversations" in record:  # ShareGPT: [{"from": "human" | "gpt" | "system", "value": ...}]
        return _turns(record, "conversations", where, "from", "value", SHAREGPT_ROLES)
    if "instruction" in record or "output" in record:
        prompt = _non_empty_string(record, "instruction", where)
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise DataError(f"{where}: field 'input' must be a string, got {type(extra).__name__}")
        if extra and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _non_empty_string(record, "output", where)}]
    if "prompt" in record or "completion" in record:
        return [{"role": "user", "content": _non_empty_string(record, "prompt", where)},
                {"role": "assistant", "content": _non_empty_string(record, "completion", where)}]
    raise DataError(f"{where}: unknown record format, expected 'messages', 'conversations' (ShareGPT), "
                    f"'instruction'/'output' or 'prompt'/'completion'; found keys {sorted(record)} "
                    f"(--data-columns maps other names, e.g. prompt=question,completion=answer)")


def _jsonl_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: folder holds no .jsonl files and is not a datasets save_to_disk folder "
                        f"(--data takes a {SUPPORTED})")
    return files


def _read_jsonl(path: Path, columns: dict[str, str]) -> list[Conversation]:
    """A JSONL file or a folder of them, read here (not by datasets) so that every error names its line."""
    conversations = []
    for file in _jsonl_files(path):
        n_before = len(conversations)
        with open(file, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{line_number}"
                # without the newline, a string left open reads as unterminated; a BOM may open the file
                line = line.rstrip("\r\n")
                try:
                    record = json.loads(line.removeprefix("\ufeff") if line_number == 1 else line)
                except json.JSONDecodeError as error:
                    raise _invalid_json(where, error, line) from None
                conversations.append(Conversation(record_to_messages(map_columns(record, columns, where), where),
                                                  where))
        if len(conversations) == n_before:
            raise DataError(f"{file}:1: empty file, no records")
    return conversations


def _invalid_json(where: str, error: json.JSONDecodeError, text: str) -> DataError:
    """Where the parser stopped, and for a string left open (a line cut short) where the line ends too."""
    if error.msg.startswith("Unterminated string"):
        end = len(text.splitlines()[error.lineno - 1])
        return DataError(f"{where}: invalid JSON: the string opened at column {error.colno} is still open at the end "
                         f"of the line (column {end}): is the line cut short?")
    return DataError(f"{where}: invalid JSON at column {error.colno}: {error.msg}")


def _raise_json_position(source: Path) -> None:
    """A .json file datasets could not read: a JSON document or JSON Lines, parsed again to name line and column."""
    text = source.read_text(encoding="utf-8-sig")
    try:
        json.loads(text)
        return
    except json.JSONDecodeError as whole:
        if not text.lstrip().startswith("{"):  # one document (an array): its own line and column
            raise _invalid_json(f"{source}:{whole.lineno}", whole, text) from None
    for number, line in enumerate(text.splitlines(), start=1):  # JSON Lines
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise _invalid_json(f"{source}:{number}", error, line) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _load_dataset(path: str, split: str, subset: str | None):
    """(name for messages, datasets.Dataset) for every --data that is not JSONL."""
    import datasets

    datasets.disable_progress_bars()
    # CRITICAL: datasets also logs the errors it raises ("Failed to load JSON ..."); the DataError says it once.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    source = Path(path)
    if source.is_dir():  # written by Dataset.save_to_disk or DatasetDict.save_to_disk
        try:
            loaded = datasets.load_from_disk(str(source))
        except Exception as error:  # e.g. a saved split with no rows, which datasets cannot load back
            raise DataError(f"{path}: datasets cannot load this save_to_disk folder ({_first_line(error)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{path}: no split '{split}' (--data-split); it has: {', '.join(loaded)}")
            loaded = loaded[split]
        return str(source), loaded
    if source.exists():
        builder = DATASETS_BUILDERS[source.suffix]
        if source.stat().st_size == 0 or (builder in ("csv", "json") and not source.read_bytes().strip()):
            raise DataError(f"{path}: empty file, no records")
        try:
            return str(source), datasets.load_dataset(builder, data_files=str(source), split="train")
        except Exception as error:
            if "corresponds to no data" in str(error):  # how datasets says a file has no rows
                raise DataError(f"{path}: the file has no rows") from None
            if builder == "json":  # datasets names neither line nor column: Python's parser does
                _raise_json_position(source)
            raise DataError(f"{path}: datasets cannot read it as {builder} ({_first_line(error)})") from None
    name = f"{path} ({split})"
    from common.models import hub_reachable  # datasets itself retries for half a minute before failing

    if not (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")) and not hub_reachable():
        raise DataError(f"{path}: not a local file or folder, and the Hugging Face Hub cannot be reached from here; "
                        f"pass a local {SUPPORTED[:-12]} (or set HF_HUB_OFFLINE=1 to use a copy in the datasets cache)")
    try:
        return name, datasets.load_dataset(path, subset, split=split)
    except Exception as error:  # the hub's errors vary by version; the first line says which it was
        raise DataError(f"{name}: could not load it from the Hugging Face Hub: {_first_line(error)}") from None


def _dataset_conversations(name: str, dataset, columns: dict[str, str], split: str) -> list[Conversation]:
    if len(dataset) == 0:
        raise DataError(f"{name}: the split has no rows (--data-split {split})")
    present = dataset.column_names
    check_columns(columns, present, name)  # once for the whole dataset, before any row
    mapped = {next((n for n, c in columns.items() if c == column), column) for column in present}
    if not any(all(key in mapped for key in keys) for keys in SHAPES.values()):
        raise DataError(f"{name}: no column set this script knows: it has {', '.join(present)}; expected messages, "
                        f"conversations (ShareGPT), instruction/output or prompt/completion "
                        f"(--data-columns maps yours, e.g. prompt=question,completion=answer)")
    conversations = []
    for index, record in enumerate(dataset):
        where = f"{name}: row {index + 1}"
        conversations.append(Conversation(record_to_messages(map_columns(record, columns, where), where), where))
    return conversations


def read_conversations(path: str | Path, split: str = "train", subset: str | None = None,
                       columns: str | None = None) -> list[Conversation]:
    """Every record of --data as validated chat messages, each with where it came from."""
    columns = parse_columns(columns)
    source = Path(path)
    if source.suffix == ".jsonl" or (source.is_dir() and not _is_saved_dataset(source)):
        if not source.exists():
            raise DataError(f"{path}: no such file or folder (--data)")
        return _read_jsonl(source, columns)
    if source.is_file() and source.suffix not in DATASETS_BUILDERS:
        raise DataError(f"{path}: unknown file type '{source.suffix}' (--data takes a {SUPPORTED})")
    if not source.exists() and not HUB_ID.match(str(path)):
        raise DataError(f"{path}: no such file or folder (--data)")
    name, dataset = _load_dataset(str(path), split, subset)
    return _dataset_conversations(name, dataset, columns, split)


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing: the loss mask from the template's own rendering


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    labels: list[int]  # shifted: labels[t] is the target for input t (or IGNORE_INDEX)
    source: str

    @property
    def n_loss_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def end_of_turn(tokenizer) -> tuple[str, int]:
    """The token that closes an assistant turn: <|im_end|> in ChatML (Qwen3), else the tokenizer's eos."""
    # one lookup, not get_vocab() (a 151k-entry dict per conversation); an absent token is unk's id or None
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    token = "<|im_end|>" if im_end is not None and im_end != tokenizer.unk_token_id else tokenizer.eos_token
    if token is None:
        raise DataError("the tokenizer has neither <|im_end|> nor an eos token: no way to learn where a turn ends")
    return token, tokenizer.convert_tokens_to_ids(token)


EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


def render_template(tokenizer) -> str:
    """The template of training and generation: the tokenizer's own, else ChatML."""
    return getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE


def assistant_spans(tokenizer, messages: list[dict], where: str, train_empty_think: bool = False
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans that carry loss): each assistant turn from where the template's generation
    prompt for it ends to its end-of-turn token, inclusive, after an empty think block unless `train_empty_think`
    (common/README.md)."""
    eot, _ = end_of_turn(tokenizer)
    template = render_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], chat_template=template, tokenize=False,
                                               add_generation_prompt=True)
        if not text.startswith(prefix):
            raise DataError(f"{where}: the chat template renders the turns before message {i} differently once "
                            f"later turns follow, so where that assistant turn starts cannot be found")
        start = len(prefix)
        end = text.find(eot, start)
        if end < 0:
            raise DataError(f"{where}: message {i}: no {eot} closes the assistant turn in the rendered text")
        think = EMPTY_THINK.match(text, start)
        if think and not train_empty_think:
            start = think.end()
        spans.append((start, end + len(eot)))
    return text, spans


def tokenize_conversations(conversations: list[Conversation], tokenizer, batch_size: int = 256,
                           train_empty_think: bool = False) -> list[TokenizedConversation]:
    """Token ids and shifted labels: a token carries loss when it starts inside an assistant span."""
    _, eot_id = end_of_turn(tokenizer)
    tokenized = []
    for first in range(0, len(conversations), batch_size):
        chunk = conversations[first:first + batch_size]
        rendered = [assistant_spans(tokenizer, c.messages, c.source, train_empty_think) for c in chunk]
        encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        for conversation, (_, spans), ids, offsets in zip(chunk, rendered, encoded["input_ids"],
                                                          encoded["offset_mapping"]):
            mask = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
            labels = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
            if eot_id not in {label for label in labels if label != IGNORE_INDEX}:
                raise DataError(f"{conversation.source}: no end-of-turn token carries loss (the chat template "
                                f"marked no assistant tokens), so the model would never learn to stop")
            tokenized.append(TokenizedConversation(list(ids), labels, conversation.source))
    return tokenized


# ---------------------------------------------------------------------------------------------------------------
# Packing into rows


@dataclass
class Rows:
    """Fixed-length rows as tensors of shape [n_rows, seq_len], plus where each conversation went."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    real_tokens: torch.Tensor  # [n_rows]: non-pad tokens per row, for tokens/s and packing efficiency
    # segments[r] lists (conversation index, n_tokens) in row r's order, so every token can be traced back.
    segments: list[list[tuple[int, int]]] = field(repr=False)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_real_tokens(self) -> int:
        return int(self.real_tokens.sum())

    @property
    def packing_efficiency(self) -> float:
        return self.n_real_tokens / max(1, self.input_ids.numel())


def pack_rows(conversations: list[TokenizedConversation], seq_len: int, pad_token_id: int, packing: bool) -> Rows:
    """First-fit packing of whole conversations into rows of seq_len (one per row without packing)."""
    rows: list[list[int]] = []  # conversation indices per row
    free: list[int] = []  # free slots per row
    for index, conversation in enumerate(conversations):
        length = len(conversation.input_ids)
        assert length <= seq_len, "truncate before packing"
        target = next((r for r, space in enumerate(free) if space >= length), None) if packing else None
        if target is None:
            rows.append([])
            free.append(seq_len)
            target = len(rows) - 1
        rows[target].append(index)
        free[target] -= length

    n = len(rows)
    input_ids = torch.full((n, seq_len), pad_token_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, seq_len), dtype=torch.long)
    segments = []
    for r, members in enumerate(rows):
        offset = 0
        row_segments = []
        for index in members:
            conversation = conversations[index]
            length = len(conversation.input_ids)
            input_ids[r, offset:offset + length] = torch.tensor(conversation.input_ids)
            labels[r, offset:offset + length] = torch.tensor(conversation.labels)
            position_ids[r, offset:offset + length] = torch.arange(length)
            row_segments.append((index, length))
            offset += length
        position_ids[r, offset:] = torch.arange(seq_len - offset)
        segments.append(row_segments)
    real_tokens = torch.tensor([sum(n for _, n in row) for row in segments], dtype=torch.long)
    return Rows(input_ids, labels, position_ids, real_tokens, segments)


# ---------------------------------------------------------------------------------------------------------------
# The dataset every experiment builds


@dataclass
class SFTData:
    train: Rows
    eval: Rows | None
    seed: int
    stats: dict
    eval_messages: list[list[dict]] = field(default_factory=list, repr=False)  # the held-out conversations' turns

    def rows_for_step(self, step: int, rows_per_step: int) -> torch.Tensor:
        """Indices (into self.train) of the B rows that optimizer step `step` (0-based) consumes.

        The row sequence is an endless concatenation of epochs, each a seeded permutation of the training rows,
        so it depends only on (seed, data, seq_len) and never on how B is split.
        """
        n = len(self.train)
        positions = range(step * rows_per_step, (step + 1) * rows_per_step)
        orders = {}
        indices = []
        for position in positions:
            epoch = position // n
            if epoch not in orders:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                orders[epoch] = torch.randperm(n, generator=generator)
            indices.append(int(orders[epoch][position % n]))
        return torch.tensor(indices, dtype=torch.long)

    def micro_batches(self, step: int, micro_batch_size: int, grad_accum: int, rank: int = 0,
                      world_size: int = 1) -> list[dict[str, torch.Tensor]]:
        """This rank's `grad_accum` micro-batches of step `step`: a contiguous slice of the step's B rows."""
        per_rank = micro_batch_size * grad_accum
        indices = self.rows_for_step(step, per_rank * world_size)[rank * per_rank:(rank + 1) * per_rank]
        return [self.batch(self.train, indices[i:i + micro_batch_size])
                for i in range(0, per_rank, micro_batch_size)]

    def step_loss_tokens(self, step: int, rows_per_step: int) -> int:
        """Number of loss tokens in the whole step, over all ranks and micro-batches: the loss denominator.

        Every rank holds the same rows, so each can count the global denominator locally, with no collective.
        """
        indices = self.rows_for_step(step, rows_per_step)
        return int((self.train.labels[indices] != IGNORE_INDEX).sum())

    def step_real_tokens(self, step: int, rows_per_step: int) -> int:
        """Non-pad tokens in the whole step, over all ranks: the numerator of tokens/s."""
        return int(self.train.real_tokens[self.rows_for_step(step, rows_per_step)].sum())

    def step_documents(self, step: int, rows_per_step: int) -> list[int]:
        """Token count of every conversation in the whole step, over all ranks: its attention FLOPs' documents."""
        return [length for row in self.rows_for_step(step, rows_per_step).tolist()
                for _, length in self.train.segments[row]]

    @staticmethod
    def batch(rows: Rows, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": rows.input_ids[indices], "labels": rows.labels[indices],
                "position_ids": rows.position_ids[indices]}

    def eval_batches(self, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        if self.eval is None:
            return []
        order = torch.arange(len(self.eval))
        return [self.batch(self.eval, order[i:i + micro_batch_size]) for i in range(0, len(order), micro_batch_size)]


def build_data(path: str | Path, tokenizer, seq_len: int, packing: bool = True, eval_fraction: float = 0.05,
               seed: int = 0, split: str = "train", subset: str | None = None, columns: str | None = None,
               train_empty_think: bool = False) -> SFTData:
    """Read, validate, tokenize, split (by conversation), truncate and pack; deterministic for a seed."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    records = read_conversations(path, split, subset, columns)
    conversations = tokenize_conversations(records, tokenizer, train_empty_think=train_empty_think)
    n_truncated = truncated_tokens = 0
    for conversation in conversations:
        excess = len(conversation.input_ids) - seq_len
        if excess > 0:
            n_truncated += 1
            truncated_tokens += excess
            conversation.input_ids = conversation.input_ids[:seq_len]
            conversation.labels = conversation.labels[:seq_len]
    if all(c.n_loss_tokens == 0 for c in conversations):
        raise DataError(f"{path}: after truncation to --seq-len {seq_len} no assistant token is left")
    eot, eot_id = end_of_turn(tokenizer)
    n_stops = sum(eot_id in c.labels for c in conversations)
    if n_stops == 0:
        raise DataError(f"{path}: after truncation to --seq-len {seq_len} no {eot} carries loss in any "
                        f"conversation, so the model would never learn to stop; raise --seq-len")

    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    n_eval = int(round(eval_fraction * len(conversations)))
    if eval_fraction > 0 and len(conversations) > 1:
        n_eval = max(1, n_eval)
    eval_conversations = [conversations[i] for i in order[:n_eval]]
    train_conversations = [conversations[i] for i in order[n_eval:]]
    if not train_conversations:
        raise DataError(f"{path}: no conversations left for training after holding out {n_eval} for evaluation")

    pad = tokenizer.pad_token_id
    train = pack_rows(train_conversations, seq_len, pad, packing)
    evaluation = pack_rows(eval_conversations, seq_len, pad, packing) if eval_conversations else None
    stats = dict(
        n_conversations=len(conversations),
        n_train_conversations=len(train_conversations),
        n_eval_conversations=len(eval_conversations),
        n_truncated=n_truncated,
        truncated_tokens=truncated_tokens,
        n_train_rows=len(train),
        n_eval_rows=len(evaluation) if evaluation is not None else 0,
        train_tokens=train.n_real_tokens,
        train_loss_tokens=int((train.labels != IGNORE_INDEX).sum()),
        packing_efficiency=train.packing_efficiency,
        n_end_of_turn_trained=n_stops,  # conversations whose closing end-of-turn token carries loss
    )
    return SFTData(train=train, eval=evaluation, seed=seed, stats=stats,
                   eval_messages=[records[i].messages for i in order[:n_eval]])


def describe(stats: dict, seq_len: int, packing: bool) -> str:
    return (f"data: {stats['n_conversations']:,} conversations ({stats['n_train_conversations']:,} train, "
            f"{stats['n_eval_conversations']:,} eval), {stats['n_truncated']} truncated to {seq_len} tokens "
            f"({stats['truncated_tokens']:,} tokens cut) | {stats['n_train_rows']:,} train rows, "
            f"{'packed' if packing else 'one conversation per row'}, "
            f"packing efficiency {stats['packing_efficiency']:.1%}")


def sample_text(data: SFTData, tokenizer, color: bool | None = None) -> str:
    """--show-sample: the first training conversation, its loss-carrying text between [[ and ]]."""
    row = int(data.rows_for_step(0, 1)[0])
    _, length = data.train.segments[row][0]
    ids = data.train.input_ids[row, :length].tolist()
    labels = data.train.labels[row, :length].tolist()
    # labels are shifted: token t + 1 carries loss when labels[t] is set.
    trained = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
    if color is None:
        color = sys.stdout.isatty()
    opening, closing = ("\033[1;32m", "\033[0;2m") if color else ("[[", "]]")
    pieces, start = [], 0
    for t in range(1, length + 1):
        if t == length or trained[t] != trained[start]:
            text = tokenizer.decode(ids[start:t])
            pieces.append(f"{opening}{text}{closing}" if trained[start] else text)
            start = t
    body = "".join(pieces)
    if color:
        body = f"\033[2m{body}\033[0m"
    n_trained = sum(trained)
    return (f"sample (step 1, row {row}): {length} tokens, {n_trained} carry loss"
            f"{'' if color else ' (between [[ and ]])'}:\n{body}")


# ---------------------------------------------------------------------------------------------------------------
# Loss


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over loss tokens (computed in fp32). Divide by the step's loss-token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def to_device(host_batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch on `device`, copied from pinned memory on a GPU (asynchronous); the host copy stays."""
    pin = device.type == "cuda"
    return {key: (value.pin_memory() if pin else value).to(device, non_blocking=True)
            for key, value in host_batch.items()}


@torch.no_grad()
def evaluate(model, data: SFTData, micro_batch_size: int, device: torch.device, autocast) -> float | None:
    """Token-weighted loss over the whole held-out split (the same with and without packing)."""
    batches = data.eval_batches(micro_batch_size)
    if not batches:
        return None
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for batch in batches:
        with autocast():
            logits = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                           attention_mask=None, use_cache=False).logits
        total += token_loss_sum(logits, batch["labels"].to(device)).double()
        count += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    return float(total) / count
