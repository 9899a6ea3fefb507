"""Spelling rules the answers follow: plurals, "a" or "an", letters spelled out, counts."""

# Nouns that do not follow the spelling rules in plural(). Everything else is
# regular: -s, -es after s/x/z/ch/sh, and -ies after a consonant plus y.
IRREGULAR_PLURALS = {
    "mouse": "mice", "goose": "geese", "tooth": "teeth", "foot": "feet", "ox": "oxen",
    "sheep": "sheep", "moose": "moose", "bison": "bison", "reindeer": "reindeer",
    "wolf": "wolves", "knife": "knives", "shelf": "shelves", "scarf": "scarves",
    "midwife": "midwives", "potato": "potatoes", "tomato": "tomatoes", "volcano": "volcanoes",
    "mosquito": "mosquitoes", "mango": "mangoes", "cactus": "cacti", "oasis": "oases", "stomach": "stomachs",
}


def spelled(word: str) -> str:
    return "-".join(word.upper())


def times(n: int) -> str:
    return "1 time" if n == 1 else f"{n} times"


# "a" or "an" goes by sound, not spelling; these are the lexicon's exceptions.
A_BEFORE_VOWEL = {"ukulele", "uniform", "unicycle", "unicorn", "unique", "useful", "usual", "eucalyptus", "one"}
AN_BEFORE_CONSONANT = {"hour", "honest", "heir", "honor"}


def article(word: str) -> str:
    if word in AN_BEFORE_CONSONANT or (word[0] in "aeiou" and word not in A_BEFORE_VOWEL):
        return f"an {word}"
    return f"a {word}"


def plural(noun: str) -> str:
    if noun in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def counted(n: int, noun: str) -> str:
    return f"{n} {noun if n == 1 else plural(noun)}"


def capitalized(text: str) -> str:
    # Not str.title(), which would also lowercase the rest of each word.
    return " ".join(word[0].upper() + word[1:] for word in text.split())
