"""Train the built-in models' tokenizer: a byte-level BPE on the sample data, saved to assets/tokenizer/.

    uv run python assets/make_tokenizer.py

It mirrors the shape of Qwen3's tokenizer at a 8k vocabulary instead of 151k: the same pre-tokenizer split
(letters, single digits, punctuation runs, whitespace; digits one by one, which makes arithmetic learnable),
byte-level fallback so any text encodes, Qwen3's special tokens, and a ChatML chat template with {% generation %}
markers so that assistant-only loss masks come from the template itself. Deterministic: the same data gives the
same files.
"""

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # `common`, also for `python3 assets/make_tokenizer.py` without an install
from common.data import CHATML_TEMPLATE  # noqa: E402  (the one ChatML template of the project)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The split Qwen2/Qwen3 tokenizers apply before BPE (their tokenizer.json "pre_tokenizer" pattern).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def training_texts(data_path: Path):
    """The text the chat template will render: role names and contents, in file order."""
    with open(data_path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                for message in json.loads(line)["messages"]:
                    yield f"{message['role']}\n{message['content']}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "assets" / "data" / "sft_en.jsonl")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "tokenizer")
    args = parser.parse_args()

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(training_texts(args.data), trainer)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=40960)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer: {len(tokenizer)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
