"""Generate a small, deterministic English SFT data set of chat conversations.

Every conversation is built from a templated task with one exact answer:
arithmetic, reversing and spelling words, sorting numbers, counting letters,
changing case, capitals of countries, unit conversions and number sequences.
The tasks are simple and the answers follow a fixed short format, so even a
tiny model can visibly learn them within a few hundred steps: the loss curve
then reflects real learning instead of noise, which is what the training
scripts in this project need in order to compare parallelism strategies.

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
from typing import Callable, NamedTuple

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

# Mixed lengths, plus words with repeated letters so that letter counting is
# not always "1 time".
WORDS = [
    "apple", "banana", "cherry", "garden", "planet", "river", "window", "orange",
    "pencil", "rocket", "silver", "winter", "summer", "forest", "island", "castle",
    "bottle", "button", "candle", "dragon", "engine", "flower", "guitar", "hammer",
    "jacket", "kitten", "ladder", "marble", "needle", "pepper", "rabbit", "saddle",
    "tunnel", "violin", "wallet", "yellow", "zipper", "coffee", "balloon", "letter",
    "mirror", "puzzle", "street", "school", "teacher", "library", "kitchen", "morning",
    "picture", "weather", "blanket", "chicken", "diamond", "example", "freedom",
    "holiday", "journey", "lantern", "mountain", "notebook", "elephant", "computer",
    "sandwich", "umbrella", "strawberry", "mississippi", "committee", "bookkeeper",
    "address", "success", "parallel", "tomorrow", "assessment", "cat",
    "dog", "sun", "tree", "book", "moon",
]

PHRASES = [
    "good morning", "the quick brown fox", "see you tomorrow", "happy birthday",
    "thank you very much", "open the window", "the sky is blue", "time for lunch",
    "hello world", "keep it simple", "practice makes perfect", "a cup of tea",
    "read the manual", "turn left at the bridge", "the train is late",
    "welcome to the team", "small steps every day", "call me later",
    "the cat sat on the mat", "learning is fun", "close the door please",
    "meet me at noon", "rain is coming", "the river runs north",
]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Netherlands": "Amsterdam", "Belgium": "Brussels",
    "Austria": "Vienna", "Switzerland": "Bern", "Poland": "Warsaw",
    "Sweden": "Stockholm", "Norway": "Oslo", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Ireland": "Dublin", "Greece": "Athens",
    "Hungary": "Budapest", "Czechia": "Prague", "Romania": "Bucharest",
    "Ukraine": "Kyiv", "Turkey": "Ankara", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Morocco": "Rabat", "South Africa": "Pretoria",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "South Korea": "Seoul", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Indonesia": "Jakarta", "Australia": "Canberra", "New Zealand": "Wellington",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasília",
    "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
}

# (from unit, to unit, factor); all plural because amounts start at 2.
CONVERSIONS = [
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
]


class Turn(NamedTuple):
    question: str
    answer: str
    # Whatever a follow-up needs to refer back to this answer.
    state: object = None


class Task(NamedTuple):
    make: Callable[[random.Random], Turn]
    follow_up: Callable[[random.Random, object], Turn] | None = None


def spelled(word: str) -> str:
    return "-".join(word.upper())


def times(n: int) -> str:
    return "1 time" if n == 1 else f"{n} times"


# --- follow-ups: each takes the previous turn's state and returns a Turn whose
# state has the same shape, so follow-ups can be chained.

NUMBER_FOLLOW_UPS = [
    ("×", (2, 2), ["Now double it.", "Double that.", "What is twice that?"]),
    ("×", (3, 5), ["Now multiply it by {k}.", "Multiply that by {k}.", "And times {k}?"]),
    ("+", (2, 20), ["Now add {k} to it.", "Add {k} to that.", "And if you add {k}?"]),
    ("-", (2, 20), ["Now subtract {k}.", "Take {k} away from that.", "And minus {k}?"]),
]
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}


def number_follow_up(rng: random.Random, n: int) -> Turn:
    symbol, (low, high), templates = rng.choice(NUMBER_FOLLOW_UPS)
    k = rng.randint(low, high)
    result = APPLY[symbol](n, k)
    return Turn(rng.choice(templates).format(k=k), f"{n} {symbol} {k} = {result}.", result)


def text_follow_up(rng: random.Random, text: str) -> Turn:
    # Only offer changes that actually change the text.
    options = ["reverse"]
    if text != text.upper():
        options.append("upper")
    if text != text.lower():
        options.append("lower")
    choice = rng.choice(options)
    if choice == "reverse":
        result = text[::-1]
        question = rng.choice(["And the reverse of that?", "Now reverse it.", "Write that backwards."])
        return Turn(question, f'The reverse of "{text}" is "{result}".', result)
    if choice == "upper":
        question = rng.choice(["Now in uppercase.", "Write that in capital letters.", "And in all caps?"])
        return Turn(question, text.upper(), text.upper())
    question = rng.choice(["Now in lowercase.", "Write that in small letters.", "And all lowercase?"])
    return Turn(question, text.lower(), text.lower())


def list_follow_up(rng: random.Random, numbers: list[int]) -> Turn:
    choice = rng.choice(["reverse", "add", "drop"] if len(numbers) > 2 else ["reverse", "add"])
    if choice == "reverse":
        result = numbers[::-1]
        question = rng.choice(["Now in the opposite order.", "Reverse that list.", "And backwards?"])
    elif choice == "add":
        k = rng.randint(1, 10)
        result = [n + k for n in numbers]
        question = rng.choice([f"Add {k} to each number.", f"Now add {k} to every number in that list."])
    else:
        result = numbers[1:]
        question = rng.choice(["Drop the first number.", "Now remove the first one."])
    return Turn(question, ", ".join(map(str, result)), result)


# --- tasks: each returns the first question and answer of a conversation.

def arithmetic(rng: random.Random, symbol: str, a: int, b: int) -> Turn:
    result = APPLY[symbol](a, b)
    word = {"+": "plus", "-": "minus", "×": "times"}[symbol]
    question = rng.choice([
        f"What is {a} {symbol} {b}?",
        f"Calculate {a} {symbol} {b}.",
        f"What is {a} {word} {b}?",
        f"Compute {a} {symbol} {b} for me.",
    ])
    return Turn(question, f"{a} {symbol} {b} = {result}.", result)


def addition(rng: random.Random) -> Turn:
    return arithmetic(rng, "+", rng.randint(1, 99), rng.randint(1, 99))


def subtraction(rng: random.Random) -> Turn:
    # Keep results non-negative: negatives are a separate skill.
    a = rng.randint(10, 99)
    return arithmetic(rng, "-", a, rng.randint(1, a))


def multiplication(rng: random.Random) -> Turn:
    return arithmetic(rng, "×", rng.randint(2, 12), rng.randint(2, 12))


def reverse_word(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    question = rng.choice([
        f'Reverse the word "{word}".',
        f'What is "{word}" spelled backwards?',
        f'Write "{word}" in reverse.',
        f'Can you reverse "{word}"?',
    ])
    return Turn(question, f'The reverse of "{word}" is "{word[::-1]}".', word[::-1])


def sort_numbers(rng: random.Random) -> Turn:
    numbers = rng.sample(range(1, 100), rng.randint(3, 7))
    shown = ", ".join(map(str, numbers))
    question = rng.choice([
        f"Sort these numbers from smallest to largest: {shown}.",
        f"Put {shown} in ascending order.",
        f"Order these from lowest to highest: {shown}.",
        f"Sort in increasing order: {shown}.",
    ])
    result = sorted(numbers)
    return Turn(question, ", ".join(map(str, result)), result)


def count_letter_turn(rng: random.Random, word: str, letter: str, templates: list[str]) -> Turn:
    answer = f'The letter "{letter}" appears {times(word.count(letter))} in "{word}".'
    return Turn(rng.choice(templates), answer, word)


def count_letter(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    # Mostly ask about a letter that occurs, sometimes one that does not, so
    # that "0 times" is learned too.
    absent = sorted(set("abcdefghijklmnopqrstuvwxyz") - set(word))
    letter = rng.choice(absent) if rng.random() < 0.2 else rng.choice(word)
    return count_letter_turn(rng, word, letter, [
        f'How many times does the letter "{letter}" appear in "{word}"?',
        f'Count the letter "{letter}" in the word "{word}".',
        f'How many "{letter}"s are in "{word}"?',
    ])


def count_letter_follow_up(rng: random.Random, word: str) -> Turn:
    letter = rng.choice(word)
    return count_letter_turn(rng, word, letter, [f'And the letter "{letter}"?', f'What about "{letter}"?'])


def uppercase(rng: random.Random) -> Turn:
    phrase = rng.choice(PHRASES)
    question = rng.choice([
        f"Convert to uppercase: {phrase}",
        f'Write "{phrase}" in capital letters.',
        f"Make this all caps: {phrase}",
    ])
    return Turn(question, phrase.upper(), phrase.upper())


def lowercase(rng: random.Random) -> Turn:
    phrase = rng.choice([str.upper, str.title])(rng.choice(PHRASES))
    question = rng.choice([
        f"Convert to lowercase: {phrase}",
        f'Write "{phrase}" in small letters.',
        f"Make this all lowercase: {phrase}",
    ])
    return Turn(question, phrase.lower(), phrase.lower())


def capital_turn(rng: random.Random, country: str, templates: list[str]) -> Turn:
    question = rng.choice(templates).format(country=country)
    return Turn(question, f"The capital of {country} is {CAPITALS[country]}.", country)


def capital(rng: random.Random) -> Turn:
    return capital_turn(rng, rng.choice(list(CAPITALS)), [
        "What is the capital of {country}?",
        "Which city is the capital of {country}?",
        "Name the capital of {country}.",
        "What's {country}'s capital city?",
    ])


def capital_follow_up(rng: random.Random, previous: str) -> Turn:
    country = rng.choice([c for c in CAPITALS if c != previous])
    return capital_turn(rng, country, ["What about {country}?", "And {country}?", "And the capital of {country}?"])


def conversion_turn(rng: random.Random, conversion: tuple, amount: int, templates: list[str]) -> Turn:
    source, target, factor = conversion
    question = rng.choice(templates).format(n=amount, source=source, target=target)
    return Turn(question, f"{amount} {source} = {amount * factor} {target}.", conversion)


def convert_units(rng: random.Random) -> Turn:
    return conversion_turn(rng, rng.choice(CONVERSIONS), rng.randint(2, 50), [
        "How many {target} are in {n} {source}?",
        "Convert {n} {source} to {target}.",
        "{n} {source} is how many {target}?",
        "What is {n} {source} in {target}?",
    ])


def convert_units_follow_up(rng: random.Random, conversion: tuple) -> Turn:
    return conversion_turn(rng, conversion, rng.randint(2, 50), ["And {n} {source}?", "What about {n} {source}?"])


def sequence_turn(rng: random.Random, last: int, step: int, templates: list[str], shown: str = "") -> Turn:
    following = [last + step * i for i in range(1, 4)]
    question = rng.choice(templates).format(shown=shown)
    return Turn(question, ", ".join(map(str, following)), (following[-1], step))


def next_in_sequence(rng: random.Random) -> Turn:
    start, step = rng.randint(1, 30), rng.randint(2, 9)
    terms = [start + step * i for i in range(rng.randint(4, 5))]
    return sequence_turn(rng, terms[-1], step, [
        "What are the next three numbers in {shown}?",
        "Continue the sequence with three more numbers: {shown}",
        "Give the next three terms: {shown}, ...",
    ], shown=", ".join(map(str, terms)))


def next_in_sequence_follow_up(rng: random.Random, state: tuple[int, int]) -> Turn:
    last, step = state
    return sequence_turn(rng, last, step, ["And the three after that?", "Keep going: three more.", "What comes next?"])


def spell_word(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    question = rng.choice([
        f'Spell "{word}" letter by letter.',
        f'How do you spell "{word}"?',
        f'Spell out the word "{word}".',
    ])
    return Turn(question, spelled(word), (word, False))


def spell_word_follow_up(rng: random.Random, state: tuple[str, bool]) -> Turn:
    word, backwards = state
    if backwards:
        question = rng.choice(["And forwards again?", "Now spell it the normal way."])
        return Turn(question, spelled(word), (word, False))
    question = rng.choice(["Now spell it backwards.", "And in reverse order?"])
    return Turn(question, spelled(word[::-1]), (word, True))


# --- long tasks: rare on purpose, so a 256-token limit truncates only a few rows.

def list_range(rng: random.Random) -> Turn:
    a = rng.randint(100, 600)
    b = a + rng.randint(250, 400)
    question = rng.choice([
        f"List the numbers from {a} to {b}.",
        f"Count from {a} to {b}.",
        f"Write out every integer from {a} to {b}, separated by commas.",
    ])
    return Turn(question, ", ".join(map(str, range(a, b + 1))))


def spell_many(rng: random.Random) -> Turn:
    words = rng.sample(WORDS, rng.randint(40, 55))
    question = rng.choice([
        "Spell each of these words letter by letter: ",
        "Spell out every word in this list: ",
        "How do you spell each of these words? ",
    ]) + ", ".join(words)
    return Turn(question, "\n".join(f"{word}: {spelled(word)}" for word in words))


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
]
LONG_TASKS = [Task(list_range), Task(spell_many)]


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

    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" keeps the bytes identical across platforms.
    with args.out.open("w", encoding="utf-8", newline="\n") as f:
        for _ in range(args.n):
            f.write(json.dumps(make_conversation(rng), ensure_ascii=False) + "\n")
    print(f"wrote {args.n} conversations to {args.out}")


if __name__ == "__main__":
    main()
