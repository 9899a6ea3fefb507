"""The glossary: one-line definitions of countable nouns ("A lighthouse is a tall tower ...")."""

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
