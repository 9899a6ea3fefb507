"""SFT data: JSONL records -> chat template -> token ids and loss labels -> packed rows -> deterministic batches.

The semantics here are the contract every experiment shares (the tests hold each one to it):
- Records are {"messages": [...]} (roles system/user/assistant), {"instruction", "input"?, "output"} or
  {"prompt", "completion"}. Bad input stops the run before training with `<file>:<line>: <what is wrong>`.
- Text is rendered with the tokenizer's chat template; only assistant tokens (and the <|im_end|> that closes each
  assistant turn, so the model learns to stop) carry loss. The mask comes from the template's
  {% generation %} markers, never from string matching.
- `labels` are already shifted: labels[t] is the token that should follow input t, or -100. Shifting per
  conversation (not per row) means the last token of one packed conversation never predicts the first of the next.
- Packing puts whole conversations into rows of seq_len tokens (first-fit); position_ids restart at 0 for
  each conversation, which is what lets transformers' SDPA/eager attention keep them apart when attention_mask is
  None. A conversation longer than seq_len is truncated, and counted.
- Optimizer step k consumes rows [k*B, (k+1)*B) of a fixed row sequence (B = micro x accum x data-parallel ranks),
  so any split of the same B is the same step, and the loss is sum(token losses) / number of loss tokens in the step.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")

# ChatML, the format Qwen3 uses, with {% generation %} markers around what the assistant says so that
# apply_chat_template(return_assistant_tokens_mask=True) can tell us which tokens carry loss. Used when the
# tokenizer's own template has no such markers (Qwen3's published templates do not).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class DataError(ValueError):
    """Bad training data; the message starts with `<file>:<line>:`."""


# ---------------------------------------------------------------------------------------------------------------
# Reading and validating records


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    source: str  # "<file>:<line>", for error messages and for tracing a row back to its record


def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise DataError(f"{path}: folder holds no .jsonl files")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such file or folder (--data)")
    return [path]


def _non_empty_string(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise DataError(f"{where}: missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return value


def record_to_messages(record: object, where: str) -> list[dict[str, str]]:
    """Validate one parsed JSON record (any of the three formats) and return it as chat messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list")
        clean = []
        for i, message in enumerate(messages):
            at = f"{where}: message {i}"
            if not isinstance(message, dict):
                raise DataError(f"{at}: expected an object with 'role' and 'content'")
            role = _non_empty_string(message, "role", at)
            if role not in ROLES:
                raise DataError(f"{at}: unknown role '{role}' (expected one of {', '.join(ROLES)})")
            clean.append({"role": role, "content": _non_empty_string(message, "content", at)})
        if not any(m["role"] == "assistant" for m in clean):
            raise DataError(f"{where}: conversation has no assistant turn, so nothing to learn from")
        return clean
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
    raise DataError(f"{where}: unknown record format, expected 'messages', 'instruction'/'output' or "
                    f"'prompt'/'completion'; found keys {sorted(record)}")


def read_conversations(path: str | Path) -> list[Conversation]:
    """Read a JSONL file or a folder of them. Blank lines are allowed; anything else must be a valid record."""
    conversations = []
    for file in _data_files(Path(path)):
        n_before = len(conversations)
        with open(file, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
                conversations.append(Conversation(record_to_messages(record, where), where))
        if len(conversations) == n_before:
            raise DataError(f"{file}:1: empty file, no records")
    return conversations


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    labels: list[int]  # shifted: labels[t] is the target for input t (or IGNORE_INDEX)
    source: str

    @property
    def n_loss_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def chat_template_for(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "{% generation %}" in template:
        return template
    return CHATML_TEMPLATE


def tokenize_conversations(conversations: list[Conversation], tokenizer, batch_size: int = 256
                           ) -> list[TokenizedConversation]:
    template = chat_template_for(tokenizer)
    tokenized = []
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start:start + batch_size]
        encoded = tokenizer.apply_chat_template([c.messages for c in chunk], chat_template=template, tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
        for conversation, ids, mask in zip(chunk, encoded["input_ids"], encoded["assistant_masks"]):
            labels = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
            if all(label == IGNORE_INDEX for label in labels):
                raise DataError(f"{conversation.source}: the chat template marked no assistant tokens")
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
    """First-fit packing of whole conversations (in the given order) into rows of seq_len tokens.

    Without packing every conversation gets its own row. Conversations must already be at most seq_len long.
    Pad slots carry no loss and get their own restarted position_ids, so they form a separate "document"
    that no real token attends to.
    """
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
               seed: int = 0) -> SFTData:
    """Read, validate, tokenize, split (by conversation), truncate and pack. Deterministic for a given seed."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    conversations = tokenize_conversations(read_conversations(path), tokenizer)
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
    )
    return SFTData(train=train, eval=evaluation, seed=seed, stats=stats)


def describe(stats: dict, seq_len: int, packing: bool) -> str:
    return (f"data: {stats['n_conversations']:,} conversations ({stats['n_train_conversations']:,} train, "
            f"{stats['n_eval_conversations']:,} eval), {stats['n_truncated']} truncated to {seq_len} tokens "
            f"({stats['truncated_tokens']:,} tokens cut) | {stats['n_train_rows']:,} train rows, "
            f"{'packed' if packing else 'one conversation per row'}, "
            f"packing efficiency {stats['packing_efficiency']:.1%}")


# ---------------------------------------------------------------------------------------------------------------
# Loss


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over loss tokens (computed in fp32). Divide by the step's loss-token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def to_device(host_batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a micro-batch to `device`. On a GPU the host tensors are pinned first, so the copy is asynchronous (from
    pageable memory the host waits for it); the batch's host copy stays usable for host-side work."""
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
