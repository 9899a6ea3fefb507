"""The tasks on the lexicon's words: sorting, plurals, opposites, categories, facts, definitions, sentences, word
problems, and the long tasks."""

import random

from .english import article, capitalized, counted, plural, spelled
from .glossary import GLOSSARY
from .lexicon import ANTONYMS, CATEGORIES, CATEGORY_OF, COUNTABLE_NOUNS, NAMES, OBJECT_NOUNS, WORD_POOL, make_sentence
from .tasks import APPLY, Turn

# --- lexicon tasks: the answer follows from a rule or a table above, in one
# fixed sentence shape per task.


def sort_words(rng: random.Random) -> Turn:
    words = rng.sample(WORD_POOL, rng.randint(4, 8))
    shown = ", ".join(words)
    question = rng.choice([
        f"Sort these words alphabetically: {shown}.",
        f"Put these words in alphabetical order: {shown}.",
        f"Arrange in dictionary order: {shown}.",
        f"Order these words from A to Z: {shown}.",
    ])
    result = sorted(words)
    return Turn(question, ", ".join(result), result)


def sort_words_follow_up(rng: random.Random, words: list[str]) -> Turn:
    choice = rng.choice(["reverse", "add", "drop"] if len(words) > 2 else ["reverse", "add"])
    if choice == "reverse":
        # Always from Z to A, even after an earlier "reverse", so the answer
        # depends only on the words and not on the history.
        result = sorted(words, reverse=True)
        question = rng.choice(["Now sort them from Z to A.", "And in reverse alphabetical order?"])
    elif choice == "add":
        new = rng.choice([w for w in WORD_POOL if w not in words])
        result = sorted(words + [new])
        question = rng.choice([f'Add "{new}" and sort again.', f'Now include "{new}" in the sorted list.'])
    else:
        result = words[1:]
        question = rng.choice(["Drop the first word.", "Now remove the first one."])
    return Turn(question, ", ".join(result), result)


# Keyed by direction: False asks for the plural, True for the singular.
PLURAL_QUESTIONS = {
    False: ['What is the plural of "{word}"?', 'Write the plural form of "{word}".', "One {word}, two what?",
            'How do you say "{word}" in the plural?'],
    True: ['What is the singular of "{word}"?', 'Write the singular form of "{word}".'],
}
PLURAL_FOLLOW_UPS = {
    False: ['And the plural of "{word}"?', 'Now the plural of "{word}".'],
    True: ['And the singular of "{word}"?', 'Now the singular of "{word}".'],
}


def plural_turn(rng: random.Random, noun: str, to_singular: bool, templates: list[str]) -> Turn:
    if to_singular:
        question = rng.choice(templates).format(word=plural(noun))
        return Turn(question, f'The singular of "{plural(noun)}" is "{noun}".', (noun, to_singular))
    question = rng.choice(templates).format(word=noun)
    return Turn(question, f'The plural of "{noun}" is "{plural(noun)}".', (noun, to_singular))


def plural_of(rng: random.Random) -> Turn:
    # Mostly singular to plural; sometimes the other way round.
    to_singular = rng.random() < 0.25
    return plural_turn(rng, rng.choice(COUNTABLE_NOUNS), to_singular, PLURAL_QUESTIONS[to_singular])


def plural_of_follow_up(rng: random.Random, state: tuple[str, bool]) -> Turn:
    previous, was_singular = state
    noun = rng.choice([n for n in COUNTABLE_NOUNS if n != previous])
    to_singular = rng.random() < 0.25
    templates = PLURAL_FOLLOW_UPS[to_singular]
    if to_singular == was_singular:
        # A bare "And X?" is only clear when the direction stays the same
        # ("sheep" is both singular and plural).
        templates = templates + ['And "{word}"?', 'What about "{word}"?']
    return plural_turn(rng, noun, to_singular, templates)


def opposite_turn(rng: random.Random, word: str, templates: list[str]) -> Turn:
    question = rng.choice(templates).format(word=word)
    return Turn(question, f'The opposite of "{word}" is "{ANTONYMS[word]}".', word)


def opposite(rng: random.Random) -> Turn:
    return opposite_turn(rng, rng.choice(list(ANTONYMS)), [
        'What is the opposite of "{word}"?',
        'Give the antonym of "{word}".',
        'Which word means the opposite of "{word}"?',
        'What is an antonym for "{word}"?',
    ])


def opposite_follow_up(rng: random.Random, previous: str) -> Turn:
    # Never the previous word's own opposite: "and the opposite of that?" is
    # a different skill.
    word = rng.choice([w for w in ANTONYMS if w not in (previous, ANTONYMS[previous])])
    return opposite_turn(rng, word, ['And "{word}"?', 'What about "{word}"?', 'And the opposite of "{word}"?'])


def category_turn(rng: random.Random, word: str, options: list[str], templates: list[str]) -> Turn:
    shown = f"{article(options[0])}, {article(options[1])} or {article(options[2])}"
    question = rng.choice(templates).format(word=word, options=shown)
    return Turn(question, f'The word "{word}" names {article(CATEGORY_OF[word])}.', (word, options))


def category(rng: random.Random) -> Turn:
    # The right category plus two others, in random order.
    options = rng.sample(list(CATEGORIES), 3)
    word = rng.choice(CATEGORIES[rng.choice(options)])
    return category_turn(rng, word, options, [
        'Is "{word}" {options}?',
        'Which is "{word}": {options}?',
        'Does the word "{word}" name {options}?',
        'Classify "{word}": is it {options}?',
    ])


def category_follow_up(rng: random.Random, state: tuple[str, list[str]]) -> Turn:
    # Same three options, another word, so "And ...?" keeps its meaning.
    previous, options = state
    word = rng.choice([w for c in options for w in CATEGORIES[c] if w != previous])
    return category_turn(rng, word, options, ['And "{word}"?', 'What about "{word}"?'])


# (question, answer) pairs about one word, keyed by which fact they ask.
WORD_FACTS = {
    "first": (['What is the first letter of "{word}"?', 'Which letter does "{word}" start with?'],
              'The first letter of "{word}" is "{first}".'),
    "last": (['What is the last letter of "{word}"?', 'Which letter does "{word}" end with?'],
             'The last letter of "{word}" is "{last}".'),
    "length": (['How many letters are in "{word}"?', 'How long is the word "{word}"?'],
               'The word "{word}" has {length} letters.'),
}
WORD_FACT_FOLLOW_UPS = {
    "first": ["And its first letter?", "What letter does it start with?"],
    "last": ["And its last letter?", "What letter does it end with?"],
    "length": ["And how many letters does it have?", "How long is it?"],
}


def word_fact_answer(word: str, fact: str) -> str:
    return WORD_FACTS[fact][1].format(word=word, first=word[0], last=word[-1], length=len(word))


def word_fact(rng: random.Random) -> Turn:
    word, fact = rng.choice(WORD_POOL), rng.choice(list(WORD_FACTS))
    question = rng.choice(WORD_FACTS[fact][0]).format(word=word)
    return Turn(question, word_fact_answer(word, fact), (word, (fact,)))


def word_fact_follow_up(rng: random.Random, state: tuple[str, tuple[str, ...]]) -> Turn:
    # Ask about a fact not asked yet; there are three facts and at most three turns.
    word, asked = state
    fact = rng.choice([f for f in WORD_FACTS if f not in asked])
    return Turn(rng.choice(WORD_FACT_FOLLOW_UPS[fact]), word_fact_answer(word, fact), (word, asked + (fact,)))


def definition_turn(rng: random.Random, word: str, templates: list[str]) -> Turn:
    question = rng.choice(templates).format(word=word, a_word=article(word))
    answer = f"{article(word)} is {GLOSSARY[word]}."
    return Turn(question, answer[0].upper() + answer[1:], word)


def definition(rng: random.Random) -> Turn:
    return definition_turn(rng, rng.choice(list(GLOSSARY)), [
        "What is {a_word}?",
        "Describe {a_word} in one sentence.",
        'What does the word "{word}" mean?',
        'Define "{word}" in one sentence.',
    ])


def definition_follow_up(rng: random.Random, previous: str) -> Turn:
    word = rng.choice([w for w in GLOSSARY if w != previous])
    return definition_turn(rng, word, ["And {a_word}?", "What about {a_word}?", 'And "{word}"?'])


def word_count_answer(text: str) -> str:
    return f"The sentence has {len(text.split())} words."


def sentence_words(rng: random.Random) -> Turn:
    sentence = make_sentence(rng)
    choice = rng.choice(["reverse", "capitalize", "count"])
    if choice == "reverse":
        question = rng.choice([
            f'Reverse the order of the words in "{sentence}".',
            f'Write "{sentence}" with the words in reverse order.',
        ])
        result = " ".join(reversed(sentence.split()))
        return Turn(question, result, (result, False))
    if choice == "capitalize":
        question = rng.choice([
            f'Capitalize the first letter of every word in "{sentence}".',
            f'Start every word of "{sentence}" with a capital letter.',
        ])
        return Turn(question, capitalized(sentence), (capitalized(sentence), False))
    question = rng.choice([f'How many words are in "{sentence}"?', f'Count the words in "{sentence}".'])
    return Turn(question, word_count_answer(sentence), (sentence, True))


def sentence_words_follow_up(rng: random.Random, state: tuple[str, bool]) -> Turn:
    # Only offer changes that actually change the text, and no second count in
    # a row (the text has not changed, so neither has the answer).
    text, just_counted = state
    options = ["reverse"] if just_counted else ["reverse", "count"]
    if capitalized(text) != text:
        options.append("capitalize")
    if text.upper() != text:
        options.append("upper")
    choice = rng.choice(options)
    if choice == "reverse":
        result = " ".join(reversed(text.split()))
        question = rng.choice(["Now reverse the order of the words.", "And with the words backwards?"])
    elif choice == "capitalize":
        result = capitalized(text)
        question = rng.choice(["Now capitalize every word.", "Start each word with a capital letter."])
    elif choice == "upper":
        result = text.upper()
        question = rng.choice(["Now write it all in capital letters.", "And in all caps?"])
    else:
        question = rng.choice(["How many words is that?", "And how many words does it have?"])
        return Turn(question, word_count_answer(text), (text, True))
    return Turn(question, result, (result, False))


def story_answer(name: str, noun: str, before: int, symbol: str, k: int) -> str:
    after = APPLY[symbol](before, k)
    return f"{before} {symbol} {k} = {after}, so {name} has {counted(after, noun)}."


def word_problem(rng: random.Random) -> Turn:
    name, noun = rng.choice(NAMES), rng.choice(OBJECT_NOUNS)
    things = plural(noun)
    a = rng.randint(2, 60)
    if rng.random() < 0.5:
        b = rng.randint(1, 40)
        symbol, question = "+", rng.choice([
            f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
            f"{name} had {a} {things} and then found {b} more. How many {things} does {name} have?",
            f"{name} collects {a} {things}, then {b} more. How many {things} does {name} have in total?",
        ])
    else:
        b = rng.randint(1, a)
        symbol, question = "-", rng.choice([
            f"{name} has {a} {things} and gives {b} away. How many {things} are left?",
            f"{name} had {a} {things} but lost {b}. How many {things} does {name} have now?",
        ])
    return Turn(question, story_answer(name, noun, a, symbol, b), (name, noun, APPLY[symbol](a, b)))


def word_problem_follow_up(rng: random.Random, state: tuple[str, str, int]) -> Turn:
    name, noun, count = state
    # Giving away needs something to give.
    if count > 0 and rng.random() < 0.5:
        k = rng.randint(1, count)
        symbol, question = "-", rng.choice([f"Then {name} gives {k} away. How many now?",
                                            f"And if {name} loses {k}?"])
    else:
        k = rng.randint(1, 30)
        symbol, question = "+", rng.choice([f"Then {name} gets {k} more. How many now?",
                                            f"And if {name} finds {k} more?"])
    return Turn(question, story_answer(name, noun, count, symbol, k), (name, noun, APPLY[symbol](count, k)))


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
    words = rng.sample(WORD_POOL, rng.randint(40, 55))
    question = rng.choice([
        "Spell each of these words letter by letter: ",
        "Spell out every word in this list: ",
        "How do you spell each of these words? ",
    ]) + ", ".join(words)
    return Turn(question, "\n".join(f"{word}: {spelled(word)}" for word in words))


def define_many(rng: random.Random) -> Turn:
    words = rng.sample(list(GLOSSARY), rng.randint(22, 28))
    question = rng.choice([
        "Give a one-line definition of each of these words: ",
        "Define every word in this list: ",
        "Explain each of these words in a few words: ",
    ]) + ", ".join(words)
    return Turn(question, "\n".join(f"{word}: {GLOSSARY[word]}" for word in words))
