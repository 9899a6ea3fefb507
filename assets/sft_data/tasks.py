"""The tasks on numbers, letters and phrases, and their follow-ups: each task returns the first question and answer
of a conversation (a Turn); a follow-up takes the previous turn's state and asks about its answer."""

import random
from typing import Callable, NamedTuple

from .english import capitalized, spelled, times
from .lexicon import CAPITALS, CONVERSIONS, PHRASES, WORD_POOL, make_sentence


class Turn(NamedTuple):
    question: str
    answer: str
    # Whatever a follow-up needs to refer back to this answer.
    state: object = None


class Task(NamedTuple):
    make: Callable[[random.Random], Turn]
    follow_up: Callable[[random.Random, object], Turn] | None = None


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
    word = rng.choice(WORD_POOL)
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
    word = rng.choice(WORD_POOL)
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


def some_phrase(rng: random.Random) -> str:
    # Fixed phrases keep a few familiar strings; made-up sentences add variety.
    return rng.choice(PHRASES) if rng.random() < 0.3 else make_sentence(rng)


def uppercase(rng: random.Random) -> Turn:
    phrase = some_phrase(rng)
    question = rng.choice([
        f"Convert to uppercase: {phrase}",
        f'Write "{phrase}" in capital letters.',
        f"Make this all caps: {phrase}",
    ])
    return Turn(question, phrase.upper(), phrase.upper())


def lowercase(rng: random.Random) -> Turn:
    phrase = rng.choice([str.upper, capitalized])(some_phrase(rng))
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
    word = rng.choice(WORD_POOL)
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
