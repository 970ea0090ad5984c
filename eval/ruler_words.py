"""Words for RULER's common-words extraction (cwe): a list of our own, about a thousand common English
nouns, verbs and adjectives, none contained in another or in the task's question (so string matching
cannot credit "party" for "art", or the question's "words" for "word")."""

_LIST = """
accordion acorn acrobat admire adore adventure agree airplane airport alligator alphabet amber ancient angry
announce antenna anthem anvil anxious apologize apple apricot architect arena argue arrive astronomer athlete
attic author autumn avenue avocado axe axle baboon badger bagpipe bakery balcony ballet balloon bamboo banana
bandit banjo banker banner barge bark barley baron barrel basket bassoon bathtub battery battle beach bean bear
beaver bedroom beer beetle begin beige believe bench bend berry bicycle big biologist birch birthday biscuit
bison bitter blacksmith blanket blink blizzard blossom blouse blue boil bolt bonnet boot border borrow bottle
boulder boundary bowl bracelet branch brass brave bread break breathe breeze bridge bright bronze brooch brown
bucket buckle bud buffalo build bush busy butcher butterfly button buy cabbage cabinet cable cactus calculator
calm camel camera candle candy canoe canyon captain carpenter carpet carriage carrot carry carve castle catch
cave cedar ceiling celery cellar cello center chain chair chance chapel chapter charger chase cheap cheese
cheetah chemist cherry chicken chimney chisel chocolate choose chop chorus church cider cinnamon circle clam
clarinet clay clean clever cliff climb closet cloudy clover clown clumsy coal coast coat coconut coffee cold
collar collect college comedy comet compare compass complain complex concert cone continent continue cookie cool
copper corner cottage couch cough county courage cow crab cracker crater crawl crayon cream create creek cricket
crimson crocodile crown cruel crystal cube cup curious current curtain cut cylinder cymbal daisy dancer danger
dark dawn decide deer defeat dentist depart depth describe desert desk destroy detective dew diamond diary dim
dirty discover distance doctor dog dolphin door doubt dragonfly drama drawer dream dress drill drop drought drum
dry duck duke dull dusk dusty eager eagle early earring earthquake editor electrician elegant elephant elk
emerald emperor empty energy engineer enjoy enormous envelope envy eraser escape evening exit expensive explain
explorer fable falcon famous farmer fast faucet fear feed feel fence fern ferry festival fever fierce fight
finish fire fisherman fix flag flame flamingo flood floor flour flute foggy fold follow foolish force forest
forget forgive fork fortune fox fragile freedom freezer freighter fresh fridge frog frost frown frozen fry full
funeral funny furnace galaxy garage garlic gas gate gather gear general generous gentle giant ginger giraffe
glacier glance glass glider glory glove goat golden goose gorilla grab graceful grammar granite grape
grasshopper grateful gravel gravity gravy gray greedy green greet grill grow guide guitar hail hallway hammer
hamster happy harbor hard harmonica harvest hate hawk headphone healthy hear heavy hedge height helicopter
helmet heron herring hidden highway hill hinge hippo hold holiday hollow holy honest honey honor hope hornet
horse hospital hot hour huge humble humid hunter hurricane hurry idea iguana illness imagine indigo inventor
invite iron island ivory ivy jacket jaguar jam jar jealous jeans jelly journal journey judge juggler juice jump
jungle justice kangaroo kayak kettle keyboard kick kind kitchen knife knight knit knowledge koala ladder ladybug
lagoon lake lamp language latch laugh lavender lawyer lazy lead leaf learn lecture legend lemon lemur lend
leopard letter lettuce library lift lightning lily limestone lion liquid listen lizard llama lobster lock long
lotus loyal luck magician magnet mango maple marble marker market maroon marsh mattress mayor meadow measure
mechanic medal medicine meeting melody melon memory merchant meteor microphone midnight milk miner minute mirror
mitten mix modern monitor monkey month moon moose mop morning mosque mosquito moss moth motion motorcycle
mountain mouse muddy muffin mug museum mustard mystery myth narrow nation necklace needle nervous new nickel
noble nod noodle noon normal notebook novelist nurse nutmeg oak obey oboe obscure ocean octopus office olive
onion open opera orange orchid organ ostrich oval oven oyster page painter palace pale palm pancake panther
parachute parade paragraph parcel parrot party pasta pause peace peach pearl peasant pebble peel pelican pencil
pendant penguin pepper petal pharmacy physicist piano picnic pigeon pillow pilot pine pink pirate piston pizza
planet plant plate platinum platypus play plow plumber pocket poem poet point polish polite pond poor poppy
porch postcard poster potato potter pour power prairie pride princess printer prison professor promise protect
protractor proud province pulley pumpkin purple push pyramid queen quick quiet rabbit radio radish raft rainbow
rainy rake rare raven receipt rectangle reef relax remember repair reporter rescue rhino rhythm ribbon rice ripe
rivet roast robin rocket roof root rope rose rotten royal ruby rude ruler rusty sacred sad safety sailboat
sailor salad salmon salty sandal sandstone sandwich sapphire sardine satellite sauce save saw saxophone scanner
scarf scarlet scatter scholar school scientist scooter screwdriver scrub sculptor scythe seagull season second
secret seed sell senator sentence sergeant serious sew shabby shake shame shape shark sharp sheep sheet shelf
shepherd shiny shirt shoe shore shorts shout shovel shower shrimp shrub shy sickle silly silver simple singer
sink skillet skirt sled sleep sleet sleeve sleigh slice slipper slow slug small smell smile smoke smooth snail
snake sneeze snowy sock soda sofa soft soil soldier solid song sorrow sort soup sour spark sparrow speaker speed
spend sphere spicy spider spinach spiral spoon spring spy square squash squeeze squid squirrel stadium staircase
stale stamp stare station steam steel stem stew stingy stir stool stormy story stove strange stream street
stretch string strong student studio sturdy submarine suburb subway sugar summer sunflower sunny surface surgeon
swamp swan sweater sweep sweet swim symphony syrup table tailor tall tambourine tame tanker taste teacher teapot
telephone television temple thank theater thick think thistle thorn thought thread throw thunder tiara ticket
tide tiger timber time tiny toad toilet tomato tornado tortoise touch towel tower trade tragedy tram travel
triangle tricycle trolley trombone trousers trout truck trumpet trunk trust truth tuba tugboat tulip tuna tunnel
turban turkey turnip turquoise turtle twig twist universe valley valve vanilla victory village vinegar violet
violin visible vitamin vivid volcano volume voyage waffle wagon wait wake walk wall wander warm wash wasp watch
waterfall wave weak weaver wedding weed week weight welcome wet whale wheat wheel whisper white wide width wild
willow window windy wine winter wire wisdom wise wish witch wizard wolf wombat wonder worm worry wrench write
xylophone yacht yawn year yellow yogurt young zebra zinc zipper
"""
WORDS = tuple(_LIST.split())
