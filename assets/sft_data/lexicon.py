"""The words the conversations are made of: some 2,500 distinct English words by category, opposites, names,
countries and their capitals, units, and the pools the tasks draw from."""

import random

from .english import article, plural
from .glossary import GLOSSARY

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
    "Iceland": "Reykjavik", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius",
    "Slovakia": "Bratislava", "Slovenia": "Ljubljana", "Croatia": "Zagreb", "Serbia": "Belgrade",
    "Bulgaria": "Sofia", "Albania": "Tirana", "North Macedonia": "Skopje",
    "Bosnia and Herzegovina": "Sarajevo", "Montenegro": "Podgorica", "Moldova": "Chisinau",
    "Belarus": "Minsk", "Russia": "Moscow", "Georgia": "Tbilisi", "Armenia": "Yerevan",
    "Azerbaijan": "Baku", "Kazakhstan": "Astana", "Uzbekistan": "Tashkent",
    "Kyrgyzstan": "Bishkek", "Tajikistan": "Dushanbe", "Turkmenistan": "Ashgabat",
    "Mongolia": "Ulaanbaatar", "Afghanistan": "Kabul", "Pakistan": "Islamabad",
    "Bangladesh": "Dhaka", "Nepal": "Kathmandu", "Bhutan": "Thimphu", "Myanmar": "Naypyidaw",
    "Laos": "Vientiane", "Cambodia": "Phnom Penh", "Malaysia": "Kuala Lumpur", "Iran": "Tehran",
    "Iraq": "Baghdad", "Syria": "Damascus", "Jordan": "Amman", "Lebanon": "Beirut",
    "Saudi Arabia": "Riyadh", "Oman": "Muscat", "Qatar": "Doha", "Bahrain": "Manama",
    "Cyprus": "Nicosia", "Malta": "Valletta", "Ethiopia": "Addis Ababa", "Ghana": "Accra",
    "Senegal": "Dakar", "Mali": "Bamako", "Algeria": "Algiers", "Tunisia": "Tunis",
    "Libya": "Tripoli", "Sudan": "Khartoum", "Uganda": "Kampala", "Rwanda": "Kigali",
    "Zambia": "Lusaka", "Zimbabwe": "Harare", "Angola": "Luanda", "Mozambique": "Maputo",
    "Namibia": "Windhoek", "Botswana": "Gaborone", "Madagascar": "Antananarivo",
    "Cameroon": "Yaoundé", "Niger": "Niamey", "Somalia": "Mogadishu", "Colombia": "Bogotá",
    "Venezuela": "Caracas", "Ecuador": "Quito", "Uruguay": "Montevideo",
    "Paraguay": "Asunción", "Cuba": "Havana", "Jamaica": "Kingston", "Costa Rica": "San José",
    "Honduras": "Tegucigalpa", "Nicaragua": "Managua", "Haiti": "Port-au-Prince",
    "Fiji": "Suva", "Papua New Guinea": "Port Moresby", "Samoa": "Apia",
    "Liechtenstein": "Vaduz",
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

# --- lexicon: over a thousand English words plus names and a glossary, so
# that the tokenizer trained on this file learns real words instead of
# stopping at a tiny vocabulary. Lists are whitespace-separated strings to keep them compact.

# Every word belongs to exactly one category (checked in check_lexicon), so a
# "which category" question has a single right answer. Ambiguous words such as
# "orange" (fruit or color), "bat" (animal or tool) or "chicken" (animal or
# food) are left out on purpose.
CATEGORIES = {
    "animal": """
        aardvark albatross alligator alpaca anteater antelope armadillo baboon badger beaver
        beetle bison bluebird boar bobcat butterfly camel canary caterpillar chameleon
        cheetah chimpanzee chipmunk cobra condor cougar coyote crab crocodile crow
        dolphin donkey dove dragonfly eagle eel falcon ferret finch flamingo
        frog gazelle gecko gerbil gibbon giraffe goat goose gorilla grasshopper
        hamster hare hawk hedgehog heron hornet horse hummingbird hyena iguana
        jackal jaguar kangaroo koala ladybug lemur leopard lion lizard llama
        lobster lynx magpie mole mongoose monkey moose mosquito moth mouse
        mule newt ocelot opossum orangutan ostrich otter owl ox panda
        panther parrot peacock pelican penguin pigeon platypus porcupine puffin python
        rabbit raccoon raven reindeer robin salamander scorpion seagull shark sheep
        skunk sloth snail snake sparrow spider squirrel stork swan tapir
        termite tiger toad tortoise toucan turtle viper vulture walrus wasp
        weasel whale wolf wombat woodpecker yak zebra pony bee
        ant flea pig cow bull tadpole hippo rhino mink marten
    """,
    "food": """
        apple apricot avocado banana blackberry blueberry cherry coconut cranberry fig
        grape grapefruit guava kiwi lemon lime lychee mango melon nectarine
        olive papaya peach pear persimmon pineapple plum pomegranate quince raspberry
        strawberry tangerine watermelon artichoke beet carrot cucumber eggplant leek onion
        parsnip pea potato pumpkin radish tomato turnip cabbage cauliflower shallot
        yam mushroom bread rice pasta soup cheese butter yogurt honey
        porridge pancake omelette salad noodles sushi curry stew chocolate cereal
        oatmeal spaghetti lasagna risotto toast jam muffin cookie waffle croissant
        bagel pretzel dumpling burrito taco pizza sandwich hummus tofu popcorn
        granola
    """,
    "tool": """
        hammer screwdriver wrench saw chisel drill axe shovel rake hoe
        trowel spade ladder chainsaw crowbar mallet stapler clamp wheelbarrow pickaxe
        pitchfork sickle scythe anvil needle thimble funnel ladle spatula whisk
        grater peeler corkscrew knife plunger flashlight hacksaw awl broom mop
        bucket compass
    """,
    "plant": """
        oak maple birch willow pine cedar elm cypress redwood sequoia
        cactus fern rose tulip daisy lily orchid sunflower daffodil poppy
        dandelion marigold magnolia geranium carnation chrysanthemum lotus thistle nettle hawthorn
        baobab acacia poplar sycamore bluebell buttercup snowdrop begonia azalea camellia
        peony petunia zinnia
    """,
    "job": """
        baker butcher carpenter plumber electrician farmer firefighter nurse doctor dentist
        surgeon pilot sailor soldier teacher librarian lawyer judge architect engineer
        scientist chemist biologist astronomer astronaut journalist author poet painter sculptor
        musician singer dancer actor photographer chef waiter cashier mechanic tailor
        barber gardener florist jeweler banker accountant economist translator editor programmer
        designer pharmacist veterinarian locksmith blacksmith goldsmith potter weaver shepherd beekeeper
        lifeguard detective ranger janitor referee umpire surveyor geologist historian archaeologist
        psychologist therapist midwife paramedic receptionist secretary
    """,
    "vehicle": """
        bicycle bus car truck tractor tram train subway scooter motorcycle
        van taxi ambulance helicopter airplane jet glider yacht canoe kayak
        ferry submarine sailboat rowboat raft sled sleigh wagon carriage limousine
        minivan jeep rocket spaceship bulldozer forklift trolley skateboard snowmobile caravan
        camper gondola rickshaw tricycle unicycle blimp zeppelin moped lorry ship
        boat steamboat
    """,
    "musical instrument": """
        piano violin viola cello guitar harp flute clarinet oboe bassoon
        saxophone trumpet trombone tuba drum xylophone accordion harmonica banjo mandolin
        ukulele sitar tambourine cymbal bagpipe harpsichord lute lyre marimba bugle
        cornet piccolo synthesizer zither bongo gong didgeridoo castanet glockenspiel
    """,
    "piece of clothing": """
        shirt blouse sweater jacket coat scarf glove sock shoe boot
        sandal hat helmet skirt dress vest tie belt hoodie cardigan
        tuxedo kimono poncho cloak robe apron uniform mitten slipper sneaker
        raincoat overcoat blazer tunic beret bonnet turban sari gown bikini
        swimsuit necktie bandana shawl parka windbreaker
    """,
    "piece of furniture": """
        chair table sofa couch bed desk bench stool shelf bookcase
        cupboard wardrobe dresser cabinet armchair ottoman recliner hammock cradle crib
        nightstand footstool sideboard futon loveseat
    """,
    "part of the body": """
        arm leg hand foot knee elbow shoulder wrist ankle finger
        thumb toe heel nose ear eye mouth lip tongue tooth
        cheek chin forehead eyebrow eyelash neck throat chest stomach liver
        kidney lung heart brain skull spine rib hip thigh shin
        muscle bone vein artery nostril jaw knuckle fingernail
    """,
    "building": """
        house cottage castle palace tower lighthouse church cathedral mosque temple
        synagogue school library museum hospital bakery factory warehouse barn garage
        cabin hut igloo skyscraper hotel motel inn theater cinema stadium
        airport station prison pharmacy observatory greenhouse windmill fortress pagoda chapel
        monastery embassy courthouse gym arena mansion bungalow villa supermarket restaurant
        cafe
    """,
    "sport": """
        tennis soccer football basketball baseball volleyball hockey golf rugby badminton
        boxing wrestling fencing sailing rowing swimming cycling skiing snowboarding surfing
        archery karate judo taekwondo gymnastics handball lacrosse polo softball bowling
        curling triathlon skating climbing diving netball bobsleigh canoeing
    """,
    "color": """
        red blue green yellow purple pink brown black white gray
        crimson scarlet maroon turquoise teal beige magenta cyan indigo ochre
        mauve khaki burgundy vermilion azure taupe
    """,
    "shape": """
        triangle circle rectangle pentagon hexagon heptagon octagon decagon oval cube
        sphere cylinder cone prism trapezoid parallelogram ellipse
    """,
    "natural feature": """
        island peninsula desert canyon waterfall delta lagoon continent valley plateau
        marsh oasis archipelago volcano glacier mountain cliff hill river lake
        swamp meadow prairie tundra reef beach cave dune fjord bay
        geyser gorge
    """,
}
CATEGORIES = {name: words.split() for name, words in CATEGORIES.items()}

# Categories whose words are all countable, so "plural of" and "how many"
# questions make sense. Food is left out because it mixes "pear" with "rice".
COUNTABLE_CATEGORIES = [
    "animal", "tool", "plant", "job", "vehicle", "musical instrument", "piece of clothing",
    "piece of furniture", "part of the body", "building", "shape", "natural feature",
]
COUNTABLE_FOODS = """
    apple apricot avocado banana blackberry blueberry cherry coconut cranberry fig
    grape grapefruit lemon lime mango melon nectarine olive peach pear
    plum pomegranate raspberry strawberry tangerine watermelon carrot cucumber onion potato
    pumpkin radish tomato turnip muffin cookie waffle croissant bagel pretzel
    dumpling taco pancake
""".split()

# Pairs of opposites; each word appears once, so every question has one answer.
ANTONYM_PAIRS = """
    ancient-modern happy-sad hot-cold big-small long-short wide-narrow heavy-light thick-thin
    fast-slow early-late rich-poor strong-weak hard-soft easy-difficult loud-quiet clean-dirty
    full-empty open-closed wet-dry young-old high-low deep-shallow sharp-blunt smooth-rough
    sweet-sour brave-cowardly kind-cruel generous-stingy polite-rude honest-dishonest
    patient-impatient careful-careless cheap-expensive safe-dangerous wise-foolish true-false
    healthy-ill asleep-awake alive-dead visible-invisible possible-impossible legal-illegal
    regular-irregular active-passive common-rare simple-complex public-private positive-negative
    major-minor maximum-minimum inner-outer upper-lower interior-exterior internal-external
    horizontal-vertical straight-crooked tight-loose shiny-dull bright-dim fresh-stale raw-cooked
    fierce-gentle huge-tiny sunny-cloudy fertile-barren humble-proud optimistic-pessimistic
    friendly-hostile cheerful-gloomy busy-idle sturdy-fragile flexible-rigid transparent-opaque
    permanent-temporary frequent-occasional accurate-inaccurate complete-incomplete formal-informal
    logical-illogical mature-immature natural-artificial optional-mandatory present-absent
    guilty-innocent ascending-descending beautiful-ugly spicy-mild lazy-hardworking dense-sparse
    warm-cool first-last male-female singular-plural odd-even valid-invalid loyal-disloyal
    tidy-messy clumsy-graceful bold-timid strict-lenient humid-arid wild-tame native-foreign
    urban-rural senior-junior superior-inferior fake-genuine real-imaginary hollow-solid
    victorious-defeated ordinary-extraordinary calm-anxious noisy-silent
"""
ANTONYMS = {}
for pair in ANTONYM_PAIRS.split():
    first, second = pair.split("-")
    ANTONYMS[first], ANTONYMS[second] = second, first

# Adjectives that fit any object in a made-up sentence ("a shiny bassoon").
SENTENCE_ADJECTIVES = """
    ancient modern big small heavy light old shiny dull bright tiny huge fragile sturdy
    clean dirty wet dry cheap expensive strange famous lovely hollow solid rare common
    broken colorful dusty elegant enormous faded gleaming golden wooden plain polished
    rusty spotless striped tidy messy odd ordinary peculiar precious quiet noisy simple
    smooth rough soft hard warm cool fake genuine unusual wonderful mysterious
""".split()

# Past-tense verbs that work with any object, for the same sentences.
SENTENCE_VERBS = """
    saw noticed painted drew photographed described found remembered admired mentioned
    imagined liked discovered spotted sketched studied ignored counted borrowed bought
    sold carried cleaned measured weighed wrapped packed delivered polished repaired
    followed chose ordered collected hid moved lifted dropped lost received sent
    showed inspected examined compared praised sorted stored dusted guarded
""".split()

SENTENCE_TIMES = [
    "yesterday", "today", "last night", "last week", "this morning", "on Monday", "on Tuesday",
    "on Wednesday", "on Thursday", "on Friday", "on Saturday", "on Sunday", "in the spring",
    "in the summer", "in the autumn", "in the winter", "before breakfast", "after lunch",
    "at noon", "at midnight", "in January", "in February", "in March", "in April", "in May",
    "in June", "in July", "in August", "in September", "in October", "in November", "in December",
]

NUMBER_WORDS = "two three four five six seven eight nine ten eleven twelve".split()

NAMES = """
    Aaliyah Abdul Ada Adele Ahmed Aiko Alan Alejandro Alice Amara Amelia Ana Andrei Anika
    Anton Arjun Astrid Aurora Beatriz Benjamin Bianca Boris Bruno Camila Carlos Carmen Chen
    Chiara Chloe Clara Daniel Daria Deepa Diego Dmitri Elena Elias Elif Emeka Emil Emma Erik
    Esther Fatima Felix Fiona Francesca Freya Gabriel George Greta Hana Hannah Hassan Helga
    Hiroshi Hugo Ibrahim Ines Ingrid Irene Isaac Isabel Ivan Jamal James Javier Jin Jonas
    Jorge Julia Kai Kamal Karim Kasia Keiko Kenji Kofi Lara Layla Leila Leo Liam Lina Lucas
    Lucia Luis Maja Malik Marco Maria Mateo Maya Mehmet Mei Mila Mina Mohammed Nadia Naomi
    Nia Nikolai Nina Noah Nora Olga Oliver Omar Oscar Pablo Paolo Priya Rafael Rahul Ravi
    Rosa Ruth Sakura Samir Sara Sebastian Sofia Sven Tariq Thomas Tomas Uma Valentina Victor
    Wei Yara Yuki Yusuf Zara Zoe Zainab
""".split()


def check_lexicon() -> None:
    """Fail loudly if an edit to the lists above makes some answer ambiguous."""
    seen = {}
    for category, words in CATEGORIES.items():
        for word in words:
            assert word not in seen, f"{word!r} is both {seen[word]!r} and {category!r}"
            seen[word] = category
    assert len(ANTONYMS) == 2 * len(ANTONYM_PAIRS.split()), "a word appears in two antonym pairs"
    assert set(COUNTABLE_FOODS) <= set(CATEGORIES["food"])
    assert len(set(map(plural, COUNTABLE_NOUNS))) == len(COUNTABLE_NOUNS), "two nouns share a plural"


# Every single word of the lexicon, for the tasks that play with letters.
# Sets are sorted back into lists: set order changes from run to run, and
# rng.choice on it would break determinism.
WORD_POOL = sorted(
    set(WORDS) | {word for words in CATEGORIES.values() for word in words} | set(ANTONYMS) | set(GLOSSARY)
)
COUNTABLE_NOUNS = sorted({word for c in COUNTABLE_CATEGORIES for word in CATEGORIES[c]} | set(COUNTABLE_FOODS))
CATEGORY_OF = {word: category for category, words in CATEGORIES.items() for word in words}
# Things a person can own, carry or draw, for word problems and made-up
# sentences ("Maria has 12 violins"); jobs and body parts would read oddly.
OBJECT_CATEGORIES = [
    "animal", "tool", "plant", "vehicle", "musical instrument", "piece of clothing", "piece of furniture", "shape",
]
OBJECT_NOUNS = sorted({word for c in OBJECT_CATEGORIES for word in CATEGORIES[c]} | set(COUNTABLE_FOODS))


def make_sentence(rng: random.Random) -> str:
    """A made-up sentence without final punctuation, so word operations stay clean."""
    name, noun, adjective = rng.choice(NAMES), rng.choice(OBJECT_NOUNS), rng.choice(SENTENCE_ADJECTIVES)
    verb, when = rng.choice(SENTENCE_VERBS), rng.choice(SENTENCE_TIMES)
    shape = rng.randint(1, 3)
    if shape == 1:
        return f"{name} {verb} {article(adjective)} {noun} {when}"
    if shape == 2:
        friend = rng.choice([n for n in NAMES if n != name])
        return f"{name} and {friend} {verb} {rng.choice(NUMBER_WORDS)} {adjective} {plural(noun)} {when}"
    return f"the {noun} near the {rng.choice(CATEGORIES['building'])} looked {adjective} {when}"
