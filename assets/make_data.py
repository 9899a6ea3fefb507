"""Generate a small, deterministic English SFT data set of chat conversations.

Every conversation is built from a templated task with one exact answer:
arithmetic and word problems, reversing, spelling and sorting words, sorting
numbers, counting letters and words, changing case, capitals of countries,
unit conversions, number sequences, plurals, opposites, word categories and
one-sentence definitions. The tasks are simple and the answers follow a fixed
short format, so even a tiny model can visibly learn them within a few hundred
steps: the loss curve then reflects real learning instead of noise, which is
what the training scripts in this project need in order to compare
parallelism strategies.

The words come from a built-in lexicon (words by category, opposites, names,
countries and a glossary of one-line definitions), some 2,500 distinct words.
That breadth matters for the tokenizer trained on this file
(assets/make_tokenizer.py): with only a few hundred distinct words its BPE
runs out of merges long before its 8k vocabulary is full.

The mix also exercises the data pipeline:
  * about 30% of conversations start with a system prompt,
  * about 30% are multi-turn, where the follow-up refers to the previous answer,
  * about 1.5% are long (over 1,200 characters), so that a 256-token row limit
    truncates a few of them.

One seeded random.Random drives everything, so two runs with the same
arguments write byte-identical files.

    uv run python assets/make_data.py [--n 4000] [--seed 0] [--out assets/data/sft_en.jsonl]
"""

import argparse
import json
import random
from pathlib import Path

from sft_data.lexicon import check_lexicon
from sft_data.lexicon_tasks import (category, category_follow_up, define_many, definition, definition_follow_up,
                                    list_range, opposite, opposite_follow_up, plural_of, plural_of_follow_up,
                                    sentence_words, sentence_words_follow_up, sort_words, sort_words_follow_up,
                                    spell_many, word_fact, word_fact_follow_up, word_problem, word_problem_follow_up)
from sft_data.tasks import (Task, addition, capital, capital_follow_up, convert_units, convert_units_follow_up,
                            count_letter, count_letter_follow_up, list_follow_up, lowercase, multiplication,
                            next_in_sequence, next_in_sequence_follow_up, number_follow_up, reverse_word, sort_numbers,
                            spell_word, spell_word_follow_up, subtraction, text_follow_up, uppercase)

SYSTEM_SHARE = 0.30
MULTI_TURN_SHARE = 0.30
LONG_SHARE = 0.015

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are a careful tutor. Always give the exact answer.",
    "You are a friendly assistant that answers questions accurately.",
    "Answer the user's question directly and briefly.",
    "You are a precise assistant. Check your work before you reply.",
]


TASKS = [
    Task(addition, number_follow_up),
    Task(subtraction, number_follow_up),
    Task(multiplication, number_follow_up),
    Task(reverse_word, text_follow_up),
    Task(sort_numbers, list_follow_up),
    Task(count_letter, count_letter_follow_up),
    Task(uppercase, text_follow_up),
    Task(lowercase, text_follow_up),
    Task(capital, capital_follow_up),
    Task(convert_units, convert_units_follow_up),
    Task(next_in_sequence, next_in_sequence_follow_up),
    Task(spell_word, spell_word_follow_up),
    Task(sort_words, sort_words_follow_up),
    Task(plural_of, plural_of_follow_up),
    Task(opposite, opposite_follow_up),
    Task(category, category_follow_up),
    Task(word_fact, word_fact_follow_up),
    Task(definition, definition_follow_up),
    Task(sentence_words, sentence_words_follow_up),
    Task(word_problem, word_problem_follow_up),
]
LONG_TASKS = [Task(list_range), Task(spell_many), Task(define_many)]


def make_conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < SYSTEM_SHARE:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    task = rng.choice(LONG_TASKS if rng.random() < LONG_SHARE else TASKS)
    turns = [task.make(rng)]
    if task.follow_up and rng.random() < MULTI_TURN_SHARE:
        for _ in range(rng.randint(1, 2)):
            turns.append(task.follow_up(rng, turns[-1].state))
    for turn in turns:
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": turn.answer})
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("assets/data/sft_en.jsonl"))
    args = parser.parse_args()

    check_lexicon()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" keeps the bytes identical across platforms.
    with args.out.open("w", encoding="utf-8", newline="\n") as f:
        for _ in range(args.n):
            f.write(json.dumps(make_conversation(rng), ensure_ascii=False) + "\n")
    print(f"wrote {args.n} conversations to {args.out}")


if __name__ == "__main__":
    main()
