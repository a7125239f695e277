"""Long documents for the KV evaluation, generated deterministically from a seed.

Each seed builds a small fictional region (towns, rivers, people, trades, years) and
writes its history as plain English paragraphs. The facts are consistent within a
document and are restated far from where they first appear ("the town founded by
X in 1712"), so predicting the text well needs the distant context: the part of the
KV cache whose precision the evaluation is about. Names are made of syllables, so
no fact is known to the model from pre-training; nothing is downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
          "st", "t", "th", "v", "w"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk"]
SUFFIXES = ["ford", "wick", "ham", "ton", "mere", "by", "stead", "holm", "bury", "dale"]
GIVEN = ["Anna", "Tomas", "Elise", "Marten", "Ingrid", "Pavel", "Clara", "Oskar", "Helena",
         "Jonas", "Mira", "Lukas", "Sofia", "Anton", "Greta", "Felix", "Irene", "Viktor"]
TRADES = ["wool", "salt", "timber", "copper", "barley", "glass", "leather", "cheese",
          "paper", "rope", "iron nails", "dyed cloth"]
PROFESSIONS = ["miller", "surveyor", "merchant", "priest", "schoolteacher", "engineer",
               "physician", "shipwright", "printer", "magistrate"]
EVENTS = ["flood", "fire", "harsh winter", "fever", "drought", "bank failure"]
DIRECTIONS = ["north", "south", "east", "west", "north-east", "south-west"]
BUILDINGS = ["a stone bridge", "a grammar school", "a covered market", "a water mill",
             "a lending library", "a hospital", "a customs house", "a clock tower"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                for _ in range(syllables))
    return w.capitalize()


@dataclass(slots=True)
class Town:
    name: str
    river: str
    founded: int
    founder: str
    population: int
    trade: str
    building: str
    built: int


@dataclass(slots=True)
class Person:
    name: str
    profession: str
    born: int
    town: str


class Region:
    """The facts of one document: drawn once from the seed, then told and retold."""

    def __init__(self, seed: int, *, num_towns: int = 10, num_people: int = 12):
        self.rng = rng = random.Random(seed)
        self.name = _word(rng, 2)
        self.rivers = [_word(rng, 2) for _ in range(4)]
        self.people = [Person(f"{rng.choice(GIVEN)} {_word(rng, 2)}", rng.choice(PROFESSIONS),
                              rng.randrange(1600, 1780), "") for _ in range(num_people)]
        self.towns = []
        for _ in range(num_towns):
            founded = rng.randrange(1620, 1800)
            self.towns.append(Town(_word(rng, rng.choice((1, 2))) + rng.choice(SUFFIXES),
                                   rng.choice(self.rivers), founded,
                                   rng.choice(self.people).name, rng.randrange(8, 400) * 100,
                                   rng.choice(TRADES), rng.choice(BUILDINGS),
                                   founded + rng.randrange(20, 120)))
        for p in self.people:
            p.town = rng.choice(self.towns).name

    def _pop(self, n: int) -> str:
        return f"{n:,}"

    def town_paragraph(self, t: Town) -> list[str]:
        r = self.rng
        other = r.choice([o for o in self.towns if o is not t])
        return [
            f"{t.name} lies on the {r.choice(['left', 'right'])} bank of the {t.river}, "
            f"some {r.randrange(3, 40)} miles {r.choice(DIRECTIONS)} of {other.name}.",
            r.choice([f"It was founded in {t.founded} by {t.founder}.",
                      f"The town was established in {t.founded}, when {t.founder} "
                      f"bought the land along the river.",
                      f"{t.founder} laid out its first streets in {t.founded}."]),
            f"Its people lived mostly from the {t.trade} trade, and by the census of "
            f"{r.randrange(1850, 1900)} it counted about {self._pop(t.population)} inhabitants.",
            r.choice([f"In {t.built} the town council paid for {t.building}, which still "
                      f"stands near the market square.",
                      f"The best known building of {t.name} is {t.building}, finished in "
                      f"{t.built}."]),
        ]

    def person_paragraph(self, p: Person) -> list[str]:
        r = self.rng
        t = next(t for t in self.towns if t.name == p.town)
        return [
            f"{p.name} was born in {p.born} and worked as a {p.profession} in {p.town}.",
            r.choice([f"Letters kept in the archive of {t.name} show that {p.name.split()[0]} "
                      f"traded in {t.trade} with merchants from the {t.river} valley.",
                      f"{p.name.split()[0]} is remembered for a survey of the {t.river} "
                      f"written in {p.born + r.randrange(25, 45)}."]),
            r.choice([f"Contemporaries described the {p.profession} as patient and "
                      f"stubborn in equal measure.",
                      f"A portrait of {p.name} hangs in {t.building} to this day."]),
        ]

    def event_paragraph(self) -> list[str]:
        r = self.rng
        t = r.choice(self.towns)
        year = r.randrange(max(t.founded + 5, 1700), 1900)
        event = r.choice(EVENTS)
        return [
            f"In {year} a {event} struck {t.name}.",
            r.choice([f"Nearly a third of the households on the {t.river} lost their "
                      f"income from {t.trade} that year.",
                      f"The council of {t.name} borrowed money from {r.choice(self.towns).name} "
                      f"to feed the poor until the next harvest."]),
            f"Older residents still compare every {event} to the one of {year}.",
        ]

    def recall_paragraph(self) -> list[str]:
        # restates facts told earlier: the long-range part of the text
        r = self.rng
        t, p = r.choice(self.towns), r.choice(self.people)
        return [
            r.choice([f"As noted above, {t.name} was founded in {t.founded} by {t.founder}, "
                      f"and it grew on the {t.trade} trade.",
                      f"Recall that {t.name}, on the {t.river}, had about "
                      f"{self._pop(t.population)} inhabitants.",
                      f"{t.building.capitalize()} of {t.name}, finished in {t.built}, "
                      f"was mentioned before."]),
            f"Likewise {p.name}, the {p.profession} of {p.town} born in {p.born}, "
            f"appears again in the records of the {self.name} region.",
        ]

    def paragraphs(self) -> Iterator[list[str]]:
        """Endless paragraphs (lists of sentences): towns and people first, then a mix."""
        yield [f"This is a history of the {self.name} region, its towns on the rivers "
               f"{', '.join(self.rivers[:-1])} and {self.rivers[-1]}, and the people who "
               f"built them."]
        for t in self.towns:
            yield self.town_paragraph(t)
        for p in self.people:
            yield self.person_paragraph(p)
        kinds = [self.event_paragraph, self.recall_paragraph,
                 lambda: self.town_paragraph(self.rng.choice(self.towns)),
                 lambda: self.person_paragraph(self.rng.choice(self.people))]
        while True:
            yield self.rng.choice(kinds)()


def document(seed: int, min_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """A document of at least ``min_tokens`` tokens (paragraphs joined by blank lines)."""
    parts: list[str] = []
    estimate = 0
    for para in Region(seed).paragraphs():
        text = " ".join(para)
        parts.append(text)
        estimate += count_tokens(text) + 1
        if estimate >= min_tokens and count_tokens("\n\n".join(parts)) >= min_tokens:
            return "\n\n".join(parts)
    raise AssertionError("unreachable: paragraphs() is endless")


def sentences(seed: int) -> Iterator[str]:
    """Endless filler sentences (for haystacks), paragraph breaks dropped."""
    for para in Region(seed).paragraphs():
        yield from para
