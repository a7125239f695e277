"""Prompt sets of the KV evaluation and how their answers are scored (no model needed).

- needle in a haystack: facts ("The secret code of the blue door is 4817.") placed at
  chosen depths of a filler document of a given token length, asked for one at a time;
- structured output: prompts that ask for a JSON object, scored by `extract_json`;
- greedy agreement: short chat prompts, scored by `agreement` against a reference run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from app.eval.docs import sentences

NEEDLE_KEYS = [
    "secret code of the blue door",
    "combination of the harbour master's safe",
    "room number of the night archivist",
    "registration number of the red tram",
    "PIN of the lighthouse radio",
    "serial number of the brass telescope",
    "locker number of the chess club",
    "house number of the retired clockmaker",
    "badge number of the museum guard",
    "access code of the greenhouse gate",
    "ticket number of the winning raffle",
    "frequency of the mountain rescue beacon",
]


@dataclass(frozen=True, slots=True)
class Needle:
    key: str  # "secret code of the blue door"
    value: str  # "4817"

    @property
    def fact(self) -> str:
        return f"The {self.key} is {self.value}."

    @property
    def question(self) -> str:
        return f"What is the {self.key}?"


@dataclass(frozen=True, slots=True)
class NeedleProbe:
    """One question about one needle of one haystack."""

    context_tokens: int  # the haystack's target length (the whole prompt, tokens)
    haystack: int  # index of the haystack: probes with the same one share its text
    depth: float  # requested share of the document before the needle
    placed_depth: float  # share of the document's tokens actually before it
    needle: Needle
    prompt: str  # document + question (goes through the chat template)

    def recalled(self, answer: str) -> bool:
        return self.needle.value in answer


def needle_prompt(document: str, needle: Needle) -> str:
    return (f"{document}\n\nQuestion: {needle.question} "
            "Answer with the number from the text above.")


def depths(num_needles: int) -> list[float]:
    """Evenly spread depths, centred in equal slices: 2 -> [0.25, 0.75]."""
    return [(i + 0.5) / num_needles for i in range(num_needles)]


def pick_needles(seed: int, num: int) -> list[Needle]:
    """``num`` needles with distinct keys and distinct 4-digit values from 2000..9999.

    The filler's numbers are years before 1950 and populations with a thousands
    separator, so a value can only be found in its needle.
    """
    rng = random.Random(seed)
    keys = rng.sample(NEEDLE_KEYS, num)
    values = rng.sample(range(2000, 10000), num)
    return [Needle(k, str(v)) for k, v in zip(keys, values, strict=True)]


def place(filler: list[str], items: list[tuple[float, str]],
          count_tokens: Callable[[str], int]) -> tuple[str, list[float]]:
    """Insert each (depth, sentence) at the filler's sentence boundary nearest its depth.

    Returns the text and, per item, the share of the text's tokens before it.
    """
    sizes = [count_tokens(" " + s) for s in filler]
    total = sum(sizes)
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    cuts = [min(range(len(cum)), key=lambda i, d=d: abs(cum[i] - d * total)) for d, _ in items]
    out: list[str] = []
    before: dict[int, float] = {}
    order = sorted(range(len(items)), key=lambda j: (cuts[j], j))
    k = 0
    for i in range(len(filler) + 1):
        while k < len(order) and cuts[order[k]] == i:
            before[order[k]] = count_tokens(" ".join(out)) if out else 0
            out.append(items[order[k]][1])
            k += 1
        if i < len(filler):
            out.append(filler[i])
    text = " ".join(out)
    n = count_tokens(text)
    return text, [before[j] / n for j in range(len(items))]


def haystack(seed: int, needles: list[Needle], target_tokens: int,
             count_tokens: Callable[[str], int], *, overhead: int = 0) -> tuple[str, list[float]]:
    """A filler document with ``needles`` at `depths`, as long as fits ``target_tokens``.

    ``overhead`` counts the tokens the prompt adds around the document (chat template,
    question), so the whole prompt stays within the target.
    """
    budget = target_tokens - overhead - sum(count_tokens(" " + n.fact) for n in needles)
    filler: list[str] = []
    used = 0
    for s in sentences(seed):
        n = count_tokens(" " + s)
        if used + n > budget:
            break
        filler.append(s)
        used += n
    items = list(zip(depths(len(needles)), (n.fact for n in needles), strict=True))
    text, placed = place(filler, items, count_tokens)
    while count_tokens(text) > target_tokens - overhead and len(filler) > 1:
        filler.pop()  # the sum of sentence counts can undercount the joined text
        text, placed = place(filler, items, count_tokens)
    return text, placed


def needle_probes(plan: Iterable[tuple[int, int, int]], count_tokens: Callable[[str], int],
                  *, overhead: int = 0, seed: int = 1000) -> list[NeedleProbe]:
    """Probes for ``plan`` rows (context tokens, haystacks, needles per haystack)."""
    probes: list[NeedleProbe] = []
    h = 0
    for context, num_haystacks, num_needles in plan:
        for _ in range(num_haystacks):
            needles = pick_needles(seed + h, num_needles)
            text, placed = haystack(seed + h, needles, context, count_tokens, overhead=overhead)
            for needle, depth, at in zip(needles, depths(num_needles), placed, strict=True):
                probes.append(NeedleProbe(context, h, depth, at, needle,
                                          needle_prompt(text, needle)))
            h += 1
    return probes


# -- structured output -------------------------------------------------------------------

JSON_PROMPTS: list[tuple[str, tuple[str, ...]]] = [
    ('Give a JSON object with the keys "name" and "age" for a person called Alice who is '
     '30 years old. Reply with JSON only.', ("name", "age")),
    ('Describe the city of Paris as a JSON object with the keys "city", "country" and '
     '"population". Reply with JSON only.', ("city", "country", "population")),
    ('Return a JSON object with the key "colors" holding a list of three colors. '
     'Reply with JSON only.', ("colors",)),
    ('Write a JSON object for a book with the keys "title", "author" and "year". '
     'Reply with JSON only.', ("title", "author", "year")),
    ('Convert this to JSON with the keys "item" and "price": a coffee costs 3 dollars. '
     'Reply with JSON only.', ("item", "price")),
    ('Give a JSON object with the keys "animal" and "legs" for a spider. '
     'Reply with JSON only.', ("animal", "legs")),
    ('Produce a JSON object with the keys "language" and "creator" for the Python '
     'programming language. Reply with JSON only.', ("language", "creator")),
    ('Return the weather as a JSON object with the keys "temperature" and "condition": '
     'it is 21 degrees and sunny. Reply with JSON only.', ("temperature", "condition")),
    ('Make a JSON object with the keys "planet" and "moons" for Mars. '
     'Reply with JSON only.', ("planet", "moons")),
    ('Write a JSON object with the keys "first_name", "last_name" and "email" for John '
     'Smith, john@example.com. Reply with JSON only.', ("first_name", "last_name", "email")),
    ('Give a JSON object with the key "fruits" listing apple, banana and cherry. '
     'Reply with JSON only.', ("fruits",)),
    ('Create a JSON object with the keys "product", "quantity" and "in_stock" for 5 '
     'notebooks that are available. Reply with JSON only.', ("product", "quantity", "in_stock")),
]


def extract_json(answer: str) -> object | None:
    """The JSON value of the answer: the whole text, a ``` fence, or its first {...}.

    Returns None when nothing parses. The first balanced object is found by brace
    depth, skipping braces inside strings.
    """
    text = answer.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    start = text.find("{")
    while start != -1:
        end = _matching_brace(text, start)
        if end != -1:
            try:
                return json.loads(text[start:end + 1])
            except ValueError:
                pass
        start = text.find("{", start + 1)
    return None


def _matching_brace(text: str, start: int) -> int:
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            esc, in_str = (not esc and c == "\\"), in_str and (esc or c != '"')
        elif c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def json_score(answer: str, keys: tuple[str, ...]) -> tuple[bool, bool]:
    """(valid JSON, a JSON object holding every requested key)."""
    value = extract_json(answer)
    return value is not None, isinstance(value, dict) and all(k in value for k in keys)


# -- greedy agreement ----------------------------------------------------------------------

AGREEMENT_PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a tip for learning a new language.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "How do vaccines work?",
    "Write the opening line of a detective story.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
    "How many days are in a leap year, and why?",
    "Explain what a prime number is.",
    "What should I pack for a weekend hike?",
    "Summarize the story of Cinderella.",
    "Translate 'good morning' into Spanish and French.",
    "What is gravity?",
    "Give two arguments for reading books.",
    "Write a short thank-you note to a teacher.",
    "How does a refrigerator keep food cold?",
    "What is the largest ocean on Earth?",
    "Describe the water cycle.",
    "Why do leaves change color in autumn?",
    "What is machine learning?",
    "Invent a new ice cream flavor and describe it.",
    "How do bees make honey?",
    "What are the three states of matter?",
    "Give advice to someone starting their first job.",
    "Explain how a bicycle stays upright.",
    "What is the Pythagorean theorem?",
    "Write a two-line poem about coffee.",
]


def agreement(reference: list[int], candidate: list[int]) -> float:
    """Share of the reference's positions that match before the first divergence.

    1.0 only for an identical sequence; a candidate that stops early (or a reference
    that is empty while the candidate is not) counts its missing positions as different.
    """
    if not reference:
        return 1.0 if not candidate else 0.0
    n = 0
    for a, b in zip(reference, candidate, strict=False):
        if a != b:
            break
        n += 1
    return n / max(len(reference), len(candidate))
