"""Gradable tasks for post-training: seeded task families, each with a checker.

    tasks = task_split("arithmetic", "train", 400)        # the same 400 for the same seed, always
    passed = check(tasks[0], reply_text)                    # the family's own checker

A family makes (prompt, expected) pairs from a random generator; the held-out `eval` split and the
`train` split share no prompt. The expected answer is what the checker grades against: the trainer
never trains on it (it learns from the model's own graded replies, trainer_bridge/posttrain.py).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

SPLITS = ("train", "eval")


class Task(msgspec.Struct, frozen=True):
    family: str
    id: str                 # "<family>-<split>-<index>"
    prompt: str             # the user's message
    expected: str           # what the checker compares the reply with (JSON for structured answers)
    max_tokens: int = 32


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[random.Random], tuple[str, str]]     # rng -> (prompt, expected)
    check: Callable[[str, str], bool]                     # (expected, reply) -> passed
    max_tokens: int = 32


# --- checkers -----------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number in a reply ("1,250" is 1250), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group().replace(",", ""))
    except ValueError:
        return None


def check_number(expected: str, reply: str) -> bool:
    """The reply's first number is the answer: "85", "85.", "The answer is 85" pass; "47 + 38 = 85" does not."""
    got = first_number(reply)
    return got is not None and abs(got - float(expected)) < 1e-9


def first_json_object(text: str) -> dict | None:
    """The first {...} in a reply that parses as a JSON object (code fences and prose around it allowed)."""
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _norm(value) -> str:
    return str(value).strip().lower()


def check_fields(expected: str, reply: str) -> bool:
    """The reply holds a JSON object whose fields equal the expected ones (strings case-blind,
    numbers by value; extra fields allowed)."""
    got, want = first_json_object(reply), json.loads(expected)
    if got is None:
        return False
    for key, value in want.items():
        if key not in got:
            return False
        if isinstance(value, (int, float)):
            if first_number(str(got[key])) != float(value):
                return False
        elif _norm(got[key]) != _norm(value):
            return False
    return True


def check_tool_call(expected: str, reply: str) -> bool:
    """The reply is a call {"name": ..., "arguments": {...}} of the right tool with the right arguments."""
    got, want = first_json_object(reply), json.loads(expected)
    if got is None or _norm(got.get("name", "")) != want["name"]:
        return False
    args = got.get("arguments")
    if isinstance(args, str):  # OpenAI's wire form carries the arguments as a JSON string
        args = first_json_object(args)
    return isinstance(args, dict) and check_fields(json.dumps(want["arguments"]), json.dumps(args))


# --- families -----------------------------------------------------------------------------------

def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """0..999 in English words: 347 -> "three hundred forty-seven"."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_words(rest))


def _addition_words(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return (f"What is {number_words(a)} plus {number_words(b)}? Answer with the number in digits only.",
            str(a + b))


_UNITS = [("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
          ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24),
          ("liters", "milliliters", 1000), ("weeks", "days", 7), ("feet", "inches", 12)]


def _conversion(rng: random.Random) -> tuple[str, str]:
    src, dst, factor = rng.choice(_UNITS)
    value = rng.randint(2, 99)
    return f"Convert {value} {src} to {dst}. Answer with the number only.", str(value * factor)


_NAMES = ["Maria", "John", "Aisha", "Kenji", "Lucas", "Emma", "Omar", "Sofia", "Ivan", "Chen", "Fatima",
          "Peter", "Ana", "David", "Yuki", "Noah", "Leila", "Carlos", "Nina", "Tom"]
_CITIES = ["Lisbon", "Paris", "Berlin", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Seoul", "Dublin",
           "Nairobi", "Toronto", "Rome", "Vienna", "Prague", "Athens"]
_JOBS = ["teacher", "nurse", "pilot", "baker", "engineer", "lawyer", "chef", "farmer", "painter", "doctor"]


def _extraction(rng: random.Random) -> tuple[str, str]:
    name, city, job, age = rng.choice(_NAMES), rng.choice(_CITIES), rng.choice(_JOBS), rng.randint(19, 80)
    sentence = rng.choice([
        f"{name} is a {age}-year-old {job} who lives in {city}.",
        f"Living in {city}, {name} works as a {job} and turned {age} this year.",
        f"Our new {job}, {name}, is {age} years old and comes from {city}.",
    ])
    prompt = (f'Extract the person\'s name, age and city from this text as JSON with the keys "name", "age" '
              f'and "city": "{sentence}" Answer with the JSON only.')
    return prompt, json.dumps({"name": name, "age": age, "city": city})


_CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD"]
_TOOLS = ('You can call two tools: get_weather(city: string, unit: "celsius" or "fahrenheit") and '
          'convert_currency(amount: number, source: string, target: string). Reply with only a JSON object '
          '{"name": ..., "arguments": {...}} that calls the right one for this request: ')


def _tool_call(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
        ask = rng.choice([f"What's the weather in {city} in {unit}?", f"Tell me the temperature in {city}, in {unit}.",
                          f"How warm is it in {city} right now? Use {unit}."])
        call = {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
    else:
        amount, (source, target) = rng.randint(2, 500), rng.sample(_CURRENCIES, 2)
        ask = rng.choice([f"How much is {amount} {source} in {target}?", f"Convert {amount} {source} to {target}."])
        call = {"name": "convert_currency", "arguments": {"amount": amount, "source": source, "target": target}}
    return _TOOLS + ask, json.dumps(call)


_CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Peru": "Lima", "Norway": "Oslo", "Ireland": "Dublin", "Austria": "Vienna",
    "Greece": "Athens", "Portugal": "Lisbon", "Russia": "Moscow", "China": "Beijing", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Australia": "Canberra", "Sweden": "Stockholm", "Poland": "Warsaw",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Hungary": "Budapest", "Thailand": "Bangkok",
    "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi", "Turkey": "Ankara",
    "Cuba": "Havana", "Chile": "Santiago", "Belgium": "Brussels", "the Netherlands": "Amsterdam",
    "South Korea": "Seoul", "Indonesia": "Jakarta", "Vietnam": "Hanoi", "Iran": "Tehran",
    "Colombia": "Bogota", "Venezuela": "Caracas", "Czechia": "Prague", "Switzerland": "Bern",
    "Brazil": "Brasilia", "Morocco": "Rabat", "Nigeria": "Abuja", "Ukraine": "Kyiv", "Romania": "Bucharest",
}
_CAPITAL_ASKS = ["What is the capital of {}? Answer with the city's name only.",
                 "Name the capital city of {}. Reply with the name only.",
                 "Which city is the capital of {}? One or two words, please.",
                 "{}: what is its capital? Just the city."]


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(_CAPITALS))
    return rng.choice(_CAPITAL_ASKS).format(country), _CAPITALS[country]


def check_mentions(expected: str, reply: str) -> bool:
    """The expected words appear in the reply (case-blind)."""
    return expected.lower() in reply.lower()


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("arithmetic", _addition, check_number, 16),
    Family("arithmetic_words", _addition_words, check_number, 16),
    Family("units", _conversion, check_number, 16),
    Family("json_extract", _extraction, check_fields, 48),
    Family("tool_call", _tool_call, check_tool_call, 48),
    Family("capitals", _capital, check_mentions, 16),     # one the base model mostly solves
)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown task family {name!r}; choose from {sorted(FAMILIES)}") from None


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, from its hash: one in five is held out. Train and eval are
    disjoint by construction, for any number of tasks drawn."""
    return "eval" if int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 5 == 0 else "train"


def task_split(name: str, split: str, n: int, seed: int = 0, exact: bool = True) -> list[Task]:
    """`n` distinct tasks of family `name` from split "train" or "eval", the same for the same seed
    (`exact=False`: at most `n`, for a pool of tasks to sample from)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    fam = family(name)
    rng = random.Random(f"{name}:{split}:{seed}")
    out: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            if not exact:
                break
            raise ValueError(f"family {name!r} has fewer than {n} distinct {split} prompts")
        prompt, expected = fam.make(rng)
        if prompt in seen or split_of(prompt) != split:
            continue
        seen.add(prompt)
        out.append(Task(name, f"{name}-{split}-{len(out)}", prompt, expected, fam.max_tokens))
    return out


def check(task: Task, reply: str) -> bool:
    """Whether `reply` solves `task`, by its family's checker."""
    return family(task.family).check(task.expected, reply)
