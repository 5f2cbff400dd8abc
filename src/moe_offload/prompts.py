"""Built-in English text: benchmark prompts and a small corpus for the tiny tokenizer.

``PROMPTS`` gives each concurrent benchmark sequence its own prompt. Identical prompts
would route identically through every MoE layer and make a batch look cheaper (fewer
distinct experts per step) than real traffic, so the prompts deliberately cover unrelated
subjects and differ in length and style.

``CORPUS`` is a few kilobytes of plain prose on mixed subjects. ``moe_offload.tiny`` trains
its byte-level BPE tokenizer on it (together with ``PROMPTS``), so the tiny test models
tokenize ordinary English into sensible, multi-character pieces.

All of the text here was written for this project.
"""

from __future__ import annotations

__all__ = ["PROMPTS", "CORPUS"]

PROMPTS: tuple[str, ...] = (
    # cooking
    "To make a good risotto, toast the rice in butter before adding any stock. "
    "Then add warm stock a ladle at a time and keep stirring until the grains are creamy.",
    # astronomy
    "Jupiter is so massive that the centre of mass it shares with the Sun lies just outside "
    "the Sun's surface. Explain why this does not happen with Earth.",
    # history
    "The printing press spread across Europe within a few decades of its invention. "
    "Describe how cheaper books changed who could read and what they read.",
    # programming
    "Write a Python function that returns the longest common prefix of a list of strings, "
    "and explain what it should do when the list is empty.",
    # weather
    "Why does fog often form in valleys on clear, calm nights? "
    "Walk through what happens to the air near the ground after sunset.",
    # music
    "A major chord and a minor chord differ by a single note. "
    "Describe how that one semitone changes the mood a listener hears.",
    # law
    "In many countries a contract needs an offer, an acceptance and something of value "
    "exchanged. Give an everyday example where one of these is missing.",
    # biology
    "Mitochondria carry their own small ring of DNA, separate from the cell's nucleus. "
    "What does this suggest about where they came from?",
    # geography
    "The Nile flows north for thousands of kilometres through desert. "
    "How did its yearly flood shape farming along its banks?",
    # economics
    "When a central bank raises interest rates, borrowing becomes more expensive. "
    "Trace the effect on house prices, savings and unemployment.",
    # gardening
    "Tomato seedlings grown indoors often become tall and weak. "
    "List three simple changes that produce shorter, sturdier plants.",
    # physics
    "A spinning ice skater speeds up when she pulls her arms in. "
    "Explain this using conservation of angular momentum, without equations.",
    # literature
    "Many detective stories reveal the culprit only in the final chapter. "
    "Why do readers enjoy being misled, and what makes a fair clue?",
    # sport
    "In a marathon, runners who start too fast usually slow down badly after thirty "
    "kilometres. What is happening in their muscles?",
    # chemistry
    "Table salt dissolves easily in water but hardly at all in oil. "
    "Describe what the water molecules do to the sodium and chloride ions.",
    # travel
    "Plan a three day walking route through an old harbour town, "
    "with one museum, one market and one quiet place to watch the sea.",
    # medicine
    "Vaccines train the immune system by showing it a harmless piece of a germ. "
    "Why do some vaccines need a booster dose years later?",
    # architecture
    "Gothic cathedrals used flying buttresses to hold up very tall, thin walls. "
    "How did this let builders fill the walls with large windows?",
    # mathematics
    "Prove that the sum of the first n odd numbers is always a perfect square, "
    "and draw a picture that makes the reason obvious.",
    # linguistics
    "Children learning English often say 'goed' instead of 'went'. "
    "What does this mistake tell us about how they learn grammar?",
)

CORPUS: str = """\
The kitchen was quiet except for the slow bubbling of a pot of lentils. Cooking dried
beans takes patience: soak them overnight, rinse them well, and simmer them gently with
an onion, a bay leaf and a little salt added near the end. Bread is another lesson in
patience. Flour, water, yeast and salt become a dough that rises twice, and the loaf that
comes out of a hot oven has a crackling crust and a soft, open crumb.

On a clear winter night, far from city lights, the sky holds thousands of visible stars.
The bright band of the Milky Way is the disc of our own galaxy seen from the inside.
Planets do not twinkle as much as stars because they show a tiny disc rather than a single
point of light. Astronomers measure the distance to nearby stars by watching how they
shift against the background as the Earth travels around the Sun.

History is written from records, and records are never complete. A tax list from a
medieval village tells us who owned land, but not what they sang at harvest. Letters,
court cases, ship logs and account books each show a different corner of the past.
Historians compare these sources, ask who wrote them and why, and build careful
arguments rather than simple stories.

A computer program is a list of precise instructions. Good programmers write code that
other people can read: clear names, short functions and tests that show what each part
is supposed to do. When a program fails, the error message is a clue, not an insult.
Reading it slowly, reproducing the problem with the smallest possible example, and
changing one thing at a time will solve most bugs.

The weather changes because the Sun heats the Earth unevenly. Warm air rises, cool air
sinks, and the spinning planet bends the winds into great curving patterns. Clouds form
when moist air cools until its water vapour condenses into droplets. A sudden drop in air
pressure often means a storm is on its way, while a steady high pressure brings calm,
dry days and cold, starry nights.

Music is organised sound. A melody is a sequence of notes, harmony is notes sounding
together, and rhythm is the pattern of long and short sounds in time. A string that
vibrates twice as fast sounds an octave higher. Every culture has its own scales and
instruments, from the bamboo flute to the pipe organ, yet people everywhere clap, hum
and dance to a steady beat.

The law sets out rules that a society agrees to follow and the ways to settle disputes.
A judge listens to both sides, weighs the evidence and applies the relevant statutes and
earlier decisions. Contracts, property, family matters and crime are separate branches,
each with its own procedures. A fair legal system treats similar cases alike and gives
every person a chance to be heard.

Living things are built from cells. A single bacterium can divide every twenty minutes
when food is plentiful, while the cells of a tree or a whale work together in tissues
and organs. Genes carry the instructions for building proteins, and small changes in
those instructions, passed from parents to offspring over many generations, allow
populations to adapt to new conditions.

Rivers carve valleys, carry sand to the sea and build wide deltas where they slow down.
Mountains rise where the plates of the Earth's crust push against each other, and they
are slowly worn away by frost, rain and ice. Maps show these shapes from above, but a
walk along a riverbank shows how water, rock and time work together.

Markets bring buyers and sellers together. When many people want something that is
scarce, its price rises; when a product is plentiful, its price falls. Governments collect
taxes to pay for roads, schools and hospitals, and central banks try to keep prices
stable. Trade between countries lets each one specialise in what it does best.

In the garden, spring begins with sowing seeds in trays on a sunny windowsill. Young
plants need light, water and a gentle breeze to grow strong stems. Compost feeds the
soil, and worms turn fallen leaves into rich, dark earth. By late summer the beds are
full of beans, courgettes, tomatoes and bright flowers that feed the bees.

Physics describes how matter and energy behave. A ball thrown upward slows, stops and
falls back because gravity pulls it toward the ground. Light travels faster than anything
else, about three hundred thousand kilometres every second. Heat flows from hot objects
to cold ones, and energy is never created or destroyed, only changed from one form into
another.

Stories have been told around fires, written on clay tablets and printed in paperback
novels. A good story has characters we care about, a problem they must face and a change
by the end. Poets choose each word for its sound as well as its meaning, and a short poem
can hold as much feeling as a long book.

Athletes train for months to improve by a few seconds. They balance hard sessions with
rest, eat enough to recover, and practise the same movements until they become natural.
Team sports add another challenge: players must read each other's intentions and react
together, often in less than a second.

Chemistry studies how atoms join and separate. Water is two hydrogen atoms bound to one
oxygen atom, and its slightly uneven charge lets it dissolve salts and sugars. When iron
meets air and moisture it slowly rusts, and when wood burns it combines with oxygen and
releases heat and light. Chemists weigh, mix, heat and measure with great care.

Travellers have always carried stories home. Merchants crossed deserts with camels,
sailors followed the trade winds, and pilgrims walked for weeks to reach distant shrines.
Today a train can cross a continent overnight, yet the best journeys still include a slow
walk through an unfamiliar street, a meal shared with strangers and a new word learned.

Doctors listen, examine and test before they decide on a treatment. Clean water, good
food, vaccines and soap have saved more lives than any single medicine. Sleep, exercise
and friendship also protect health, and a patient who understands the plan is more likely
to follow it.

Numbers describe the world with surprising power. Counting, measuring and comparing lead
to arithmetic, geometry and algebra. A proof shows that a statement must be true in every
case, not only in the examples we happened to try. Prime numbers, which have no divisors
except one and themselves, still hide questions that nobody has answered.

Languages change as people use them. New words arrive with new inventions, old words
shift their meanings, and pronunciations drift from one generation to the next. Children
learn the grammar of their first language without lessons, by listening and trying, and
their mistakes often follow rules more regular than the language itself.
"""
