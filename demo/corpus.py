"""The demo's synthetic chat corpus: templated tasks whose answers are long and follow from the prompt.

A tiny target learns them to near certainty in minutes on a CPU, so its greedy continuations are
confident and predictable: the regime where a drafter trained for minutes can reach a useful τ.
Every answer is a deterministic function of its prompt; only the prompts are random.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

NAMES = [
    "Mia",
    "Leo",
    "Ava",
    "Sam",
    "Zoe",
    "Max",
    "Ivy",
    "Ben",
    "Lily",
    "Noah",
    "Emma",
    "Finn",
    "Ruby",
    "Jack",
    "Nora",
    "Owen",
]
ANIMALS = ["dog", "cat", "fox", "owl", "frog", "duck", "goat", "bear", "horse", "rabbit", "mouse", "lion"]
PLACES = ["park", "beach", "forest", "farm", "river", "garden", "market", "library"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "white", "black"]
FRUITS = ["apple", "lemon", "banana", "plum", "melon", "orange", "pear", "grape"]
CITIES = ["Paris", "Rome", "Oslo", "Cairo", "Lima", "Tokyo", "Delhi", "Dublin", "Berlin", "Madrid"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SKIES = ["sunny", "rainy", "cloudy", "windy", "snowy", "foggy"]

Task = Callable[[random.Random], tuple[str, str]]


# Several phrasings of one request: the answer depends on the numbers only, and the larger prompt space
# leaves enough never-trained prompts for the drafters' data and the evaluation (see split_corpus).
COUNT_UP = ["List the numbers from {} to {}.", "Count from {} to {}.", "Write the numbers from {} up to {}."]
COUNT_DOWN = [
    "Count down from {} to {}.",
    "List the numbers from {} down to {}.",
    "Count backwards from {} to {}.",
]
ALPHABET = [
    "Write the letters from {} to {}.",
    "List the alphabet from {} to {}.",
    "Say the letters {} to {}.",
]
TIMES = ["Write the {} times table from {} to {}.", "Show the {} times table from {} to {}."]


def _count_up(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 90)
    b = min(99, a + rng.randint(4, 24))
    return rng.choice(COUNT_UP).format(a, b), ", ".join(str(i) for i in range(a, b + 1)) + "."


def _count_down(rng: random.Random) -> tuple[str, str]:
    b = rng.randint(12, 99)
    a = max(0, b - rng.randint(4, 24))
    return rng.choice(COUNT_DOWN).format(b, a), ", ".join(str(i) for i in range(b, a - 1, -1)) + "."


def _alphabet(rng: random.Random) -> tuple[str, str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = rng.randint(0, 18)
    j = rng.randint(i + 5, 25)
    return rng.choice(ALPHABET).format(letters[i], letters[j]), ", ".join(letters[i : j + 1]) + "."


def _times_table(rng: random.Random) -> tuple[str, str]:
    k, first = rng.randint(2, 9), rng.randint(1, 6)
    last = rng.randint(first + 4, 12)
    rows = ", ".join(f"{i} x {k} = {i * k}" for i in range(first, last + 1))
    return rng.choice(TIMES).format(k, first, last), rows + "."


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 59), rng.randint(10, 39)
    ta, tb, ua, ub = a // 10 * 10, b // 10 * 10, a % 10, b % 10
    steps = f"{a} + {b} = {ta} + {tb} + {ua} + {ub} = {ta + tb} + {ua + ub} = {a + b}"
    return f"What is {a} + {b}?", f"We add the tens and then the ones. {steps}. The answer is {a + b}."


def _story(rng: random.Random) -> tuple[str, str]:
    name, animal, place, color = (
        rng.choice(NAMES),
        rng.choice(ANIMALS),
        rng.choice(PLACES),
        rng.choice(COLORS),
    )
    story = (
        f"Once upon a time, {name} had a little {animal}. Every morning, {name} and the {animal} walked to"
        f" the {place}. One day, the {animal} found a {color} ball near the {place}. {name} threw the"
        f" {color} ball and the {animal} ran after it. When the sun went down, {name} and the {animal}"
        " went home happy. The end."
    )
    return f"Tell me a story about {name} and a {animal} at the {place} with a {color} ball.", story


def _letter(rng: random.Random) -> tuple[str, str]:
    sender, to, place, animal = rng.choice(NAMES), rng.choice(NAMES), rng.choice(PLACES), rng.choice(ANIMALS)
    letter = (
        f"Dear {to}, I hope you are well. Yesterday I went to the {place} and saw a {animal}. The {place}"
        f" was quiet and the {animal} was kind. Please come and visit me soon, and we will go to the"
        f" {place} together. Your friend, {sender}."
    )
    return f"Write a letter from {sender} to {to} about a {animal} at the {place}.", letter


def _recipe(rng: random.Random) -> tuple[str, str]:
    name, color, fruit = rng.choice(NAMES), rng.choice(COLORS), rng.choice(FRUITS)
    count = rng.randint(2, 9)
    recipe = (
        f"To make a {color} {fruit} cake for {name}, you need flour, sugar, two eggs and {count} {fruit}s."
        f" First, mix the flour and the sugar in a big bowl. Then add the eggs and the {count} {fruit}s, and"
        f" stir well. Bake the cake for forty minutes. Let the {color} {fruit} cake cool before {name} eats it."
    )
    return f"Give me a recipe for a {color} {fruit} cake with {count} {fruit}s for {name}.", recipe


def _weather(rng: random.Random) -> tuple[str, str]:
    city, day, sky, degrees = rng.choice(CITIES), rng.choice(DAYS), rng.choice(SKIES), rng.randint(5, 35)
    report = (
        f"Here is the weather in {city} for {day}. The morning will be {sky} at {degrees} degrees. In the"
        f" afternoon, the sky over {city} stays {sky}. In the evening, it will be {sky} and calm. If you go"
        f" out in {city} on {day}, take a coat."
    )
    return f"Describe a {sky} {day} in {city} at {degrees} degrees.", report


TASKS: dict[str, tuple[Task, float]] = {  # name -> (generator, sampling weight)
    "count_up": (_count_up, 2.0),
    "count_down": (_count_down, 1.5),
    "alphabet": (_alphabet, 1.0),
    "times_table": (_times_table, 1.0),
    "addition": (_addition, 0.5),
    "story": (_story, 2.0),
    "letter": (_letter, 1.5),
    "recipe": (_recipe, 1.5),
    "weather": (_weather, 1.5),
}


def generate_corpus(seed: int, n: int) -> list[dict]:
    """`n` chat records, deterministic from `seed`; a prompt may repeat (small tasks repeat often).

    Each is {"messages": [{"role": "user", ...}, {"role": "assistant", ...}], "task": name}.
    """
    rng = random.Random(seed)
    names = list(TASKS)
    weights = [TASKS[t][1] for t in names]
    records = []
    for _ in range(n):
        task = rng.choices(names, weights)[0]
        prompt, answer = TASKS[task][0](rng)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages, "task": task})
    return records


def prompt_of(record: dict) -> str:
    return record["messages"][0]["content"]


def prompt_bucket(prompt: str, buckets: int = 20) -> int:
    """A stable hash of the prompt (not Python's salted hash()), in [0, buckets)."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % buckets


def split_corpus(records: list[dict], held_out: int, drafter: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(pretrain, drafter prompts, held-out prompts), split by prompt so no prompt is in two parts.

    A stable hash sends 1/20 of the prompt space to evaluation and 4/20 to the drafters' data: both are
    prompts the target never trained on, so the drafters learn the target's behaviour on exactly the
    kind of prompt they are evaluated on. The last two parts hold distinct prompts, `drafter` and
    `held_out` of them; ValueError when the records hold fewer.
    """
    parts: tuple[list[dict], dict[str, dict], dict[str, dict]] = ([], {}, {})
    for rec in records:
        bucket = prompt_bucket(prompt_of(rec))
        if bucket >= 5:
            parts[0].append(rec)
        else:
            parts[1 if bucket else 2].setdefault(prompt_of(rec), rec)
    pretrain, to_drafter, to_eval = parts
    for name, got, want in (("drafter", to_drafter, drafter), ("held-out", to_eval, held_out)):
        if len(got) < want:
            raise ValueError(f"split_corpus: only {len(got)} distinct {name} prompts, {want} requested")
    return pretrain, list(to_drafter.values())[:drafter], list(to_eval.values())[:held_out]
