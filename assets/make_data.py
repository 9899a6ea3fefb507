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

# Nouns that do not follow the spelling rules in plural(). Everything else is
# regular: -s, -es after s/x/z/ch/sh, and -ies after a consonant plus y.
IRREGULAR_PLURALS = {
    "mouse": "mice", "goose": "geese", "tooth": "teeth", "foot": "feet", "ox": "oxen",
    "sheep": "sheep", "moose": "moose", "bison": "bison", "reindeer": "reindeer",
    "wolf": "wolves", "knife": "knives", "shelf": "shelves", "scarf": "scarves",
    "midwife": "midwives", "potato": "potatoes", "tomato": "tomatoes", "volcano": "volcanoes",
    "mosquito": "mosquitoes", "mango": "mangoes", "cactus": "cacti", "oasis": "oases", "stomach": "stomachs",
}

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

# One-line definitions: "A lighthouse is a tall tower ...". Only countable
# nouns, so "A/An <word> is <definition>." is always a correct sentence.
GLOSSARY = """
aardvark: an African mammal with a long snout that eats ants and termites
albatross: a large seabird with very long wings that glides over the ocean
alligator: a large reptile with strong jaws that lives in rivers and swamps
alpaca: a South American animal related to the camel, kept for its soft wool
anteater: a mammal with a long sticky tongue that feeds on ants
armadillo: a small mammal protected by a shell of bony plates
badger: a short-legged animal with a striped face that digs burrows
beaver: a large rodent that builds dams across streams
camel: a large desert animal with one or two humps on its back
chameleon: a lizard that can change the color of its skin
cheetah: a spotted wild cat and the fastest animal on land
dolphin: an intelligent sea mammal that breathes air and lives in groups
eagle: a large bird of prey with sharp eyes and strong claws
elephant: a very large animal with a trunk, big ears and ivory tusks
falcon: a fast bird of prey that dives to catch other birds
flamingo: a pink wading bird with long legs that often stands on one leg
giraffe: a tall African animal with a very long neck and a spotted coat
gorilla: a large and strong ape from the forests of Africa
hedgehog: a small animal covered in spines that rolls into a ball when scared
kangaroo: an Australian animal that hops on strong back legs and carries its young in a pouch
koala: an Australian animal that lives in trees and eats eucalyptus leaves
owl: a bird that hunts at night and can turn its head very far
penguin: a black and white seabird that cannot fly but swims very well
porcupine: a rodent covered in long sharp quills
raccoon: a furry animal with a masked face and a ringed tail
salamander: a small amphibian with a long tail and moist skin
sloth: a slow animal that hangs upside down from trees in tropical forests
squirrel: a small rodent with a bushy tail that lives in trees and stores nuts
tortoise: a slow reptile with a hard shell that lives on land
walrus: a large sea mammal with long tusks and whiskers
woodpecker: a bird that pecks holes in trees to find insects
zebra: an African animal like a horse with black and white stripes
caterpillar: a wormlike larva that later turns into a butterfly or moth
hummingbird: a tiny bird that beats its wings very fast and drinks nectar from flowers
ostrich: a very large bird that cannot fly but runs very fast
peacock: a male bird with a long colorful tail that spreads like a fan
platypus: an Australian mammal with a bill like a duck that lays eggs
scorpion: a small animal with eight legs, pincers and a stinging tail
termite: a small insect that lives in large colonies and eats wood
vulture: a large bird that feeds on dead animals
yak: a shaggy animal of the cattle family that lives in the high mountains of Asia
tadpole: a young frog or toad that lives in water and breathes through gills
beetle: an insect with hard front wings that cover its back
lobster: a sea animal with a hard shell, two large claws and ten legs
apple: a round fruit with red, green or yellow skin that grows on trees
avocado: a pear-shaped fruit with a large stone and soft green flesh
banana: a long curved fruit with a yellow skin that you peel
coconut: a large nut with a hard brown shell, white flesh and sweet water inside
grapefruit: a large round citrus fruit with a sour taste
lemon: a yellow citrus fruit with very sour juice
mango: a sweet tropical fruit with orange flesh and a large flat stone
pineapple: a tropical fruit with spiky skin and sweet yellow flesh
pomegranate: a round fruit full of juicy red seeds
strawberry: a small red fruit with tiny seeds on its surface
watermelon: a large fruit with green skin, red flesh and black seeds
carrot: an orange root vegetable that grows underground
cucumber: a long green vegetable often eaten raw in salads
onion: a round vegetable with layers and a strong smell that can make you cry
potato: a starchy vegetable that grows underground and is often boiled or fried
pumpkin: a large round orange vegetable with a thick skin
radish: a small red root vegetable with a sharp taste
croissant: a flaky crescent-shaped pastry made with butter
dumpling: a small ball of dough, often filled with meat or vegetables
muffin: a small sweet cake baked in a cup-shaped tin
pancake: a thin flat cake made from batter and cooked in a pan
pretzel: a baked snack twisted into a knot and sprinkled with salt
sandwich: a meal made of two slices of bread with a filling between them
taco: a folded tortilla filled with meat, beans or vegetables
omelette: a dish of beaten eggs cooked in a pan and folded over
hammer: a tool with a heavy metal head used to hit nails
screwdriver: a tool used to turn screws
wrench: a tool used to grip and turn nuts and bolts
saw: a tool with a toothed blade used to cut wood
chisel: a tool with a sharp flat edge used to shape wood or stone
drill: a tool that makes round holes
axe: a tool with a heavy blade on a long handle used to chop wood
shovel: a tool with a broad blade used to dig and move soil
rake: a garden tool with a row of teeth used to gather leaves
trowel: a small tool with a flat blade used for gardening or spreading cement
wheelbarrow: a small cart with one wheel and two handles used to carry loads
anvil: a heavy iron block on which a blacksmith hammers hot metal
funnel: a cone-shaped tube used to pour liquid into a narrow opening
ladle: a deep spoon with a long handle used to serve soup
whisk: a kitchen tool made of wire loops used to beat eggs and cream
grater: a kitchen tool with sharp holes used to shred cheese and vegetables
corkscrew: a tool with a metal spiral used to pull corks out of bottles
thimble: a small cap worn on a finger to push a needle when sewing
compass: an instrument with a magnetic needle that points north
flashlight: a small portable lamp that runs on batteries
broom: a brush with a long handle used to sweep floors
stapler: a device that joins sheets of paper with small metal staples
crowbar: an iron bar used to pry things open
pickaxe: a tool with a pointed iron head used to break rock
oak: a large tree that produces acorns and has hard wood
maple: a tree with broad leaves that turn red in autumn and sap that is made into syrup
willow: a tree with long thin branches that often grows near water
pine: an evergreen tree with needles and cones
redwood: a very tall evergreen tree that grows in California
baobab: an African tree with a very thick trunk that stores water
cactus: a desert plant with thick stems and sharp spines that stores water
fern: a green plant with feathery leaves that grows in shady places
sunflower: a tall plant with a large yellow flower
tulip: a spring flower with a cup-shaped bloom that grows from a bulb
daisy: a small flower with white petals around a yellow center
dandelion: a yellow flower whose seeds float away on the wind
orchid: a plant with unusual and often colorful flowers
rose: a flower with a sweet scent and thorny stems
lotus: a water plant with large flowers that floats on ponds
thistle: a prickly plant with purple flowers
magnolia: a tree with large fragrant white or pink flowers
baker: a person who makes bread and cakes
butcher: a person who cuts and sells meat
carpenter: a person who makes and repairs things made of wood
plumber: a person who installs and repairs water pipes
electrician: a person who installs and repairs electrical wiring
farmer: a person who grows crops or raises animals
firefighter: a person whose job is to put out fires and rescue people
nurse: a person who cares for sick or injured people
dentist: a doctor who looks after teeth
surgeon: a doctor who performs operations
pilot: a person who flies an aircraft
sailor: a person who works on a ship
astronaut: a person trained to travel into space
architect: a person who designs buildings
astronomer: a scientist who studies stars, planets and galaxies
journalist: a person who writes news stories
librarian: a person who looks after the books in a library
lawyer: a person who gives legal advice and represents people in court
judge: a person who decides cases in a court of law
translator: a person who changes writing from one language into another
mechanic: a person who repairs engines and machines
tailor: a person who makes and alters clothes
barber: a person who cuts hair and shaves beards
gardener: a person who looks after gardens
florist: a person who sells flowers
blacksmith: a person who shapes iron by heating and hammering it
locksmith: a person who makes and repairs locks
shepherd: a person who looks after sheep
beekeeper: a person who keeps bees to collect their honey
lifeguard: a person who watches swimmers and rescues them when they are in danger
detective: a person who investigates crimes
veterinarian: a doctor who treats animals
pharmacist: a person who prepares and sells medicines
archaeologist: a person who studies the past by digging up old objects and ruins
geologist: a scientist who studies rocks and the structure of the earth
programmer: a person who writes computer programs
photographer: a person who takes photographs
sculptor: an artist who makes statues by carving or shaping materials
cashier: a person who takes payments in a shop
waiter: a person who serves food in a restaurant
chef: a professional cook in a restaurant
umpire: a person who makes sure the rules are followed in a game
bicycle: a vehicle with two wheels that you ride by pushing pedals
ambulance: a vehicle that carries sick or injured people to hospital
helicopter: an aircraft with spinning blades on top that can hover
submarine: a ship that can travel under water
canoe: a narrow light boat moved with a paddle
kayak: a small narrow boat with a covered top, moved with a double paddle
ferry: a boat that carries people and vehicles across water on a regular route
tractor: a powerful vehicle used on farms to pull machinery
bulldozer: a heavy vehicle with a broad blade used to push earth
forklift: a small vehicle with two prongs used to lift heavy loads
sled: a vehicle that slides over snow on runners
gondola: a long narrow boat used on the canals of Venice
rickshaw: a small two-wheeled or three-wheeled vehicle that carries passengers
tram: a passenger vehicle that runs on rails along city streets
unicycle: a vehicle with only one wheel that you balance on while pedaling
snowmobile: a motor vehicle that travels over snow on skis and a track
yacht: a boat with sails or an engine used for racing or pleasure
blimp: an airship filled with gas that floats through the air
scooter: a small vehicle with a narrow platform that you stand on
skateboard: a short board on four wheels that you ride standing up
limousine: a large luxurious car driven by a chauffeur
caravan: a vehicle with beds and a kitchen that is towed behind a car
piano: a large musical instrument played by pressing black and white keys
violin: a string instrument held under the chin and played with a bow
cello: a large string instrument played with a bow while sitting down
harp: a large string instrument with a triangular frame played by plucking
flute: a woodwind instrument played by blowing across a hole
clarinet: a woodwind instrument with a single reed
oboe: a woodwind instrument with a double reed and a clear, piercing sound
saxophone: a curved metal woodwind instrument with a reed, often used in jazz
trumpet: a brass instrument with three valves and a bright sound
trombone: a brass instrument with a sliding tube
tuba: a large brass instrument with a very deep sound
drum: an instrument that you hit with sticks or with your hands
xylophone: an instrument with wooden bars that you strike with mallets
accordion: an instrument with bellows and keys that you squeeze in and out
harmonica: a small instrument that you play by blowing into it
banjo: a string instrument with a round body, often used in folk music
ukulele: a small four-string guitar from Hawaii
sitar: a long-necked string instrument from India
tambourine: a small drum with metal jingles around the rim
bagpipe: an instrument with a bag of air and several pipes, traditional in Scotland
harpsichord: a keyboard instrument whose strings are plucked
didgeridoo: a long wooden wind instrument of Aboriginal Australians
gong: a large metal disc that makes a deep ringing sound when struck
scarf: a long piece of cloth worn around the neck
glove: a covering for the hand with a separate part for each finger
mitten: a glove that covers the four fingers together and the thumb separately
sweater: a warm knitted piece of clothing for the upper body
apron: a garment worn over the front of clothes to keep them clean
kimono: a long traditional Japanese robe with wide sleeves
poncho: a blanket-like cloak with a hole in the middle for the head
tuxedo: a formal evening suit, usually black
sari: a long piece of cloth wrapped around the body, worn in South Asia
raincoat: a coat that keeps you dry in the rain
sandal: a light shoe with straps, worn in warm weather
helmet: a hard hat that protects the head
uniform: a set of clothes worn by all members of a group or organization
turban: a long cloth wound around the head
beret: a round flat soft hat
cardigan: a knitted jacket that fastens at the front
slipper: a soft shoe worn indoors
parka: a warm hooded jacket for cold weather
chair: a seat for one person with a back and usually four legs
sofa: a long soft seat with a back and arms for several people
bench: a long seat for several people, often made of wood
stool: a seat without a back or arms
wardrobe: a tall cupboard for hanging clothes
bookcase: a piece of furniture with shelves for books
hammock: a hanging bed made of canvas or net
cradle: a small bed for a baby that can rock
crib: a bed with high sides for a baby
dresser: a piece of furniture with drawers for clothes
recliner: an armchair whose back can lean backward
futon: a thin mattress that can be used as a bed or a seat
ottoman: a low padded seat without a back
heart: a muscular organ that pumps blood around the body
lung: an organ in the chest used for breathing
brain: an organ inside the head that controls thinking and movement
liver: a large organ that cleans the blood
kidney: an organ that filters waste from the blood
skull: the bony frame of the head
spine: the column of bones that runs down the middle of the back
elbow: the joint in the middle of the arm
knee: the joint in the middle of the leg
ankle: the joint between the foot and the leg
wrist: the joint between the hand and the arm
thumb: the short thick finger on the side of the hand
eyebrow: a line of hair above the eye
tongue: a soft muscle in the mouth used for tasting and speaking
rib: one of the curved bones that protect the chest
nostril: one of the two openings of the nose
knuckle: a joint of a finger
lighthouse: a tall tower with a bright light that guides ships at night
castle: a large fortified building from the past, with thick walls and towers
cathedral: a large and important church
mosque: a building where Muslims worship
synagogue: a building where Jewish people worship
temple: a building used for worship in many religions
museum: a building where interesting and valuable objects are displayed
hospital: a building where sick and injured people are treated
bakery: a shop where bread and cakes are baked and sold
factory: a building where goods are made by machines
warehouse: a large building used to store goods
barn: a farm building for storing crops or keeping animals
skyscraper: a very tall building with many floors
igloo: a dome-shaped shelter built from blocks of snow
windmill: a building with sails that the wind turns to grind grain or pump water
greenhouse: a glass building where plants are grown
observatory: a building with telescopes for studying the sky
stadium: a large sports ground surrounded by rows of seats
airport: a place where airplanes take off and land
pharmacy: a shop where medicines are prepared and sold
embassy: an office that represents one country in another country
cottage: a small house in the countryside
palace: a large grand house where a king, a queen or a president lives
pagoda: a tower with several roofs, often part of a temple in Asia
monastery: a building where monks live and work
fortress: a strongly protected building built to defend a place
mansion: a very large and impressive house
triangle: a flat shape with three straight sides
rectangle: a flat shape with four straight sides and four right angles
pentagon: a flat shape with five straight sides
hexagon: a flat shape with six straight sides
octagon: a flat shape with eight straight sides
circle: a round flat shape whose edge is always the same distance from its center
cube: a solid shape with six square faces
sphere: a perfectly round solid shape, like a ball
cylinder: a solid shape with two circular ends and straight sides
cone: a solid shape with a circular base that narrows to a point
prism: a solid shape with two identical ends and flat sides
island: a piece of land surrounded by water
peninsula: a piece of land almost surrounded by water
desert: a dry region that gets very little rain
canyon: a deep valley with steep sides, often cut by a river
waterfall: a place where a river flows over a steep drop
delta: an area of flat land where a river splits before it reaches the sea
lagoon: a shallow body of water separated from the sea by sand or a reef
continent: one of the seven very large areas of land on earth
valley: a low area of land between hills or mountains
plateau: a large area of high flat land
oasis: a fertile place in a desert where there is water
archipelago: a group of islands
volcano: a mountain with an opening through which lava and gas erupt
glacier: a huge mass of ice that moves slowly over land
geyser: a hot spring that shoots water and steam into the air
fjord: a long narrow inlet of the sea between high cliffs
reef: a ridge of rock or coral just below the surface of the sea
dune: a hill of sand formed by the wind
meadow: a field of grass and wild flowers
swamp: an area of wet, spongy land often partly covered with water
atom: a tiny particle that is the basic unit of a chemical element
molecule: a group of atoms bonded together
electron: a tiny particle with a negative charge that moves around the nucleus of an atom
proton: a particle with a positive charge found in the nucleus of an atom
neutron: a particle with no charge found in the nucleus of an atom
planet: a large round object that orbits a star
comet: a ball of ice and dust that grows a glowing tail near the sun
galaxy: a huge system of stars, gas and dust held together by gravity
asteroid: a rocky object smaller than a planet that orbits the sun
magnet: an object that attracts iron
thermometer: an instrument that measures temperature
telescope: an instrument that makes distant objects look closer
microscope: an instrument that makes very small things look larger
fossil: the remains of an ancient plant or animal preserved in rock
crystal: a solid whose atoms are arranged in a regular repeating pattern
battery: a device that stores energy and supplies electricity
circuit: a closed path through which electricity flows
lens: a curved piece of glass that bends light
cell: the smallest unit of life that can live on its own
gene: a unit of heredity that is passed from parents to their children
fraction: a number that represents a part of a whole
equation: a statement that two mathematical expressions are equal
earthquake: a sudden shaking of the ground caused by movements deep in the earth
hurricane: a violent storm with very strong winds that forms over warm seas
tornado: a spinning column of air that reaches down from a storm cloud to the ground
rainbow: an arc of colors in the sky made by sunlight shining through raindrops
avalanche: a large mass of snow sliding quickly down a mountain
thunderstorm: a storm with thunder, lightning and heavy rain
calendar: a chart that shows the days, weeks and months of a year
dictionary: a book that lists words in alphabetical order and explains their meanings
encyclopedia: a book or set of books with information on many subjects
map: a drawing of an area that shows where places are
globe: a round model of the earth
passport: an official document that lets you travel to other countries
umbrella: a folding frame covered with cloth that keeps the rain off you
candle: a stick of wax with a wick that gives light when it burns
lantern: a lamp with a protective case that can be carried
kettle: a pot with a spout used for boiling water
microwave: an oven that heats food quickly using radio waves
refrigerator: an appliance that keeps food cold
blender: a kitchen machine that chops and mixes food into a liquid
toaster: a machine that browns slices of bread
robot: a machine that can carry out tasks automatically
satellite: an object that orbits a planet, often a machine that sends signals to earth
keyboard: a set of keys used to type on a computer
password: a secret word that lets you into a computer account
website: a collection of pages on the internet
algorithm: a set of step-by-step instructions for solving a problem
spreadsheet: a computer program that arranges numbers in rows and columns
novel: a long written story about imaginary people and events
poem: a piece of writing arranged in lines, often with rhythm and rhyme
riddle: a puzzling question with a clever answer
proverb: a short well-known saying that gives advice
diary: a book in which you write about what happens each day
trophy: a cup or prize given to the winner of a competition
medal: a metal disc given as an award
festival: a day or period of celebration
marathon: a running race of about forty-two kilometers
orchestra: a large group of musicians who play classical music together
choir: a group of people who sing together
puppet: a doll that is moved by strings or by a hand inside it
kite: a light frame covered with cloth or paper that flies in the wind
"""
GLOSSARY = dict(line.split(": ", 1) for line in GLOSSARY.strip().splitlines())


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
