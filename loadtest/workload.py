"""Seeded, reproducible workloads: each yields an endless stream of sessions (one or more turns).

A single-turn workload yields one-turn sessions. Token counts are approximate (words-per-token
estimate): tokenizing would put a tokenizer on the timing path and tie the tool to one model.
The same workload and seed always yield the same sessions, so several targets can be compared
on identical traffic.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

# OpenAI's rule of thumb (~0.75 English words per token); byte-level BPE with a small vocabulary
# (the demo model) needs more tokens per word, so the estimate is a knob, not a constant.
DEFAULT_WORDS_PER_TOKEN = 0.75

_WORDS = (
    "the of and to in is that for it as with was on be at by this had not are but from or have an "
    "they which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two may "
    "then do first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since "
    "against go came right used take three cache token model router engine latency budget tenant "
    "prefix request stream batch policy replica tier price ledger weight decode prompt kernel queue"
).split()

_IDENTIFIERS = (
    "count total items value index result buffer offset limit window score weight name path size "
    "tokens blocks prefix cache price budget tenant replica queue batch stream"
).split()


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call the client's agent made after the previous answer (scripted: a demo model's
    own calls are random, and a seeded workload must send the same conversation to every target)."""

    id: str
    name: str
    arguments: str  # JSON object, as OpenAI's wire carries it


class Turn(msgspec.Struct, frozen=True):
    """One request's worth of new client-side content in a session."""

    user: str
    max_tokens: int
    input_tokens_est: int  # approximate tokens of the new content (not the whole context)
    tool_output: str | None = None  # simulated tool result, sent before `user` on agent turns
    think_time_s: float = 0.0  # client pause before this turn (agent "thinking" / tool running)
    # With a call, the previous answer becomes an assistant tool call and `tool_output` its result
    # message (role tool / function_call_output / tool_result); without, the output is user text.
    tool_call: ToolCall | None = None


class Session(msgspec.Struct, frozen=True):
    id: str
    turns: list[Turn]
    system: str | None = None
    group: str = ""  # tenant / category, reported per request
    arrival_s: float | None = None  # trace replay: offset from the start of the run
    tools: list[dict] | None = None  # OpenAI chat function tools, sent unchanged on every turn
    adapter: str | None = None  # a LoRA adapter its requests name as their model (None: the target's model)


class WorkloadError(ValueError):
    """A workload is misconfigured or its trace file cannot be read."""


def _text(rng: random.Random, tokens: int, words_per_token: float) -> str:
    n = max(1, round(tokens * words_per_token))
    return " ".join(rng.choices(_WORDS, k=n))


def _tokens_of(text: str, words_per_token: float) -> int:
    return max(1, math.ceil(len(text.split()) / words_per_token))


def _spread(rng: random.Random, mean: int, range_ratio: float, dist: str) -> int:
    """A length around `mean`: uniform in [mean*(1-r), mean*(1+r)] as `vllm bench serve --random-range-ratio`."""
    if dist == "fixed" or range_ratio <= 0:
        return max(1, mean)
    if dist == "normal":
        return max(1, round(rng.gauss(mean, mean * range_ratio)))
    if dist == "lognormal":
        sigma = range_ratio
        return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


class _Base(msgspec.Struct, kw_only=True, tag_field="kind"):
    seed: int = 0
    words_per_token: float = DEFAULT_WORDS_PER_TOKEN

    def _rng(self, stream: str) -> random.Random:
        # String seeds are hashed with SHA-512 by random.Random: stable across processes/PYTHONHASHSEED.
        return random.Random(f"{self.seed}:{type(self).__name__}:{stream}")

    def sessions(self) -> Iterator[Session]:  # pragma: no cover - abstract
        raise NotImplementedError

    def take(self, n: int) -> list[Session]:
        it = self.sessions()
        return [s for _, s in zip(range(n), it)]

    def describe(self) -> dict:
        return msgspec.to_builtins(self)  # tagged: includes "kind"


class SharedPrefixWorkload(_Base, tag="shared_prefix"):
    """Multi-tenant shared prefix: each tenant has a long system prompt shared by its users.

    Request = tenant prefix + per-user context + fresh suffix; the prefix is what a cache-aware
    router should keep on one replica.
    """

    tenants: int = 4
    prefix_tokens: int = 512
    users_per_tenant: int = 8
    user_context_tokens: int = 32
    suffix_tokens: int = 64
    output_tokens: int = 64
    # 0: tenants equally popular; s > 0: tenant k (from 1) is picked with weight 1 / k**s (Zipf),
    # a few hot prefixes and a long tail, as on a real multi-tenant fleet.
    tenant_zipf: float = 0.0

    def sessions(self) -> Iterator[Session]:
        if self.tenants < 1 or self.users_per_tenant < 1:
            raise WorkloadError("tenants and users_per_tenant must be >= 1")
        if self.tenant_zipf < 0:
            raise WorkloadError("tenant_zipf must be >= 0")
        prefixes, users = _tenant_texts(self._rng("fixed"), self.tenants, self.prefix_tokens, self.users_per_tenant,
                                        self.user_context_tokens, self.words_per_token)
        rng = self._rng("stream")
        cum = list(itertools.accumulate(1.0 / (k + 1) ** self.tenant_zipf for k in range(self.tenants)))
        i = 0
        while True:
            if self.tenant_zipf:
                t = rng.choices(range(self.tenants), cum_weights=cum)[0]
            else:
                t = rng.randrange(self.tenants)
            u = rng.randrange(self.users_per_tenant)
            suffix = _text(rng, self.suffix_tokens, self.words_per_token)
            user = f"[user {u}] {users[t][u]}\n{suffix}"
            yield Session(
                id=f"sp-{i}",
                system=prefixes[t],
                group=f"tenant-{t}",
                turns=[
                    Turn(
                        user=user,
                        max_tokens=self.output_tokens,
                        input_tokens_est=self.prefix_tokens + self.user_context_tokens + self.suffix_tokens,
                    )
                ],
            )
            i += 1


def _tenant_texts(fixed: random.Random, tenants: int, prefix_tokens: int, users_per_tenant: int,
                  user_context_tokens: int, words_per_token: float) -> tuple[list[str], list[list[str]]]:
    """Each tenant's system prefix, and its users' context texts (drawn in this order from `fixed`)."""
    prefixes = [f"You are the assistant of tenant {t}. " + _text(fixed, prefix_tokens, words_per_token)
                for t in range(tenants)]
    users = [[_text(fixed, user_context_tokens, words_per_token) for _ in range(users_per_tenant)]
             for _ in range(tenants)]
    return prefixes, users


class AdapterWorkload(_Base, tag="adapters"):
    """Many LoRA adapters, each a tenant's fine-tune: adapter k belongs to tenant k % tenants and
    its requests carry that tenant's system prefix. Adapter k (from 1) is picked with weight
    1 / k**adapter_zipf, a few hot adapters and a long tail; `base_share` of the requests go to the
    base model with the picked adapter's tenant prefix. Request = prefix + user context + suffix,
    as SharedPrefixWorkload's; the engine caches an adapter's blocks apart from the base model's.
    """

    adapters: int = 8
    tenants: int = 8
    adapter_zipf: float = 1.0
    base_share: float = 0.0
    prefix_tokens: int = 512
    users_per_tenant: int = 8
    user_context_tokens: int = 32
    suffix_tokens: int = 64
    output_tokens: int = 64

    def sessions(self) -> Iterator[Session]:
        if self.adapters < 1 or self.tenants < 1 or self.users_per_tenant < 1:
            raise WorkloadError("adapters, tenants and users_per_tenant must be >= 1")
        if self.adapter_zipf < 0 or not 0 <= self.base_share <= 1:
            raise WorkloadError("adapter_zipf must be >= 0 and base_share within [0, 1]")
        prefixes, users = _tenant_texts(self._rng("fixed"), self.tenants, self.prefix_tokens, self.users_per_tenant,
                                        self.user_context_tokens, self.words_per_token)
        rng = self._rng("stream")
        cum = list(itertools.accumulate(1.0 / (k + 1) ** self.adapter_zipf for k in range(self.adapters)))
        i = 0
        while True:
            a = rng.choices(range(self.adapters), cum_weights=cum)[0]
            base = rng.random() < self.base_share
            t = a % self.tenants
            u = rng.randrange(self.users_per_tenant)
            user = f"[user {u}] {users[t][u]}\n" + _text(rng, self.suffix_tokens, self.words_per_token)
            yield Session(
                id=f"lora-{i}",
                system=prefixes[t],
                group="base" if base else f"adapter-{a}",
                adapter=None if base else f"adapter-{a}",
                turns=[Turn(user=user, max_tokens=self.output_tokens,
                            input_tokens_est=self.prefix_tokens + self.user_context_tokens + self.suffix_tokens)],
            )
            i += 1


class AgentSessionWorkload(_Base, tag="agent"):
    """Multi-turn agent sessions: append-only context, simulated tool outputs, think time.

    Each turn's request carries the whole history including earlier assistant answers (the
    runner appends them), so every turn after the first is a long cached prefix + a new tail.
    """

    system_tokens: int = 256
    first_user_tokens: int = 128
    turns_min: int = 3
    turns_max: int = 6
    tool_output_tokens: int = 128
    followup_tokens: int = 32
    output_tokens: int = 64
    think_time_s: float = 0.0  # mean of an exponential pause between turns

    def sessions(self) -> Iterator[Session]:
        if self.turns_min < 1 or self.turns_max < self.turns_min:
            raise WorkloadError("need 1 <= turns_min <= turns_max")
        fixed = self._rng("fixed")
        system = "You are a coding agent with tools. " + _text(fixed, self.system_tokens, self.words_per_token)
        rng = self._rng("stream")
        i = 0
        while True:
            n = rng.randint(self.turns_min, self.turns_max)
            turns = [
                Turn(
                    user="Task: " + _text(rng, self.first_user_tokens, self.words_per_token),
                    max_tokens=self.output_tokens,
                    input_tokens_est=self.first_user_tokens,
                )
            ]
            for k in range(1, n):
                tool = f"<tool_result step={k}>\n" + _text(rng, self.tool_output_tokens, self.words_per_token) + "\n</tool_result>"
                think = rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
                turns.append(
                    Turn(
                        user=_text(rng, self.followup_tokens, self.words_per_token),
                        tool_output=tool,
                        max_tokens=self.output_tokens,
                        input_tokens_est=self.tool_output_tokens + self.followup_tokens,
                        think_time_s=think,
                    )
                )
            yield Session(id=f"agent-{i}", system=system, group="agent", turns=turns)
            i += 1


def _tool(name: str, description: str, **params: str) -> dict:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(params)}}}


# A coding agent's tool list: fixed and in a fixed order, as a cache-friendly client sends it.
AGENT_TOOLS: list[dict] = [
    _tool("read_file", "Read a file of the repository.", path="Path relative to the repository root."),
    _tool("search_code", "Search the repository for a pattern.", pattern="A regular expression.",
          glob="Files to search, e.g. *.py."),
    _tool("run_tests", "Run the test suite or part of it.", selector="A pytest node id or -k expression."),
    _tool("edit_file", "Replace text in a file.", path="Path relative to the repository root.",
          old="Text to replace.", new="Replacement text."),
]


class AgentToolsWorkload(_Base, tag="agent_tools"):
    """An agent with tools: the same tool list on every request, and after each answer a tool call
    and its result appended to the conversation, then a short follow-up.

    Turn k re-sends the whole conversation (system, tools, task, every earlier answer, call and
    result), so its prompt is the previous prompt plus the new tail: what prefix caching and
    cache-aware routing are for. The runner renders it in the target's wire format
    (chat completions, Responses or Messages).
    """

    system_tokens: int = 256
    first_user_tokens: int = 96
    turns_min: int = 3
    turns_max: int = 6
    tool_output_tokens: int = 96
    followup_tokens: int = 16
    output_tokens: int = 32
    think_time_s: float = 0.0  # mean of an exponential pause between turns (the tool running)

    def sessions(self) -> Iterator[Session]:
        if self.turns_min < 1 or self.turns_max < self.turns_min:
            raise WorkloadError("need 1 <= turns_min <= turns_max")
        fixed = self._rng("fixed")
        system = ("You are a coding agent. Call one tool at a time and explain each step briefly. "
                  + _text(fixed, self.system_tokens, self.words_per_token))
        rng = self._rng("stream")
        i = 0
        while True:
            sid = f"tools-{i}"
            n = rng.randint(self.turns_min, self.turns_max)
            turns = [Turn(user="Task: " + _text(rng, self.first_user_tokens, self.words_per_token),
                          max_tokens=self.output_tokens, input_tokens_est=self.first_user_tokens)]
            for k in range(1, n):
                call = self._call(rng, f"call_{sid}_{k}")
                think = rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
                turns.append(Turn(
                    user=_text(rng, self.followup_tokens, self.words_per_token),
                    tool_output=_text(rng, self.tool_output_tokens, self.words_per_token),
                    tool_call=call, max_tokens=self.output_tokens, think_time_s=think,
                    input_tokens_est=self.tool_output_tokens + self.followup_tokens,
                ))
            yield Session(id=sid, system=system, group="agent_tools", turns=turns, tools=AGENT_TOOLS)
            i += 1

    @staticmethod
    def _call(rng: random.Random, call_id: str) -> ToolCall:
        tool = rng.choice(AGENT_TOOLS)["function"]
        args = {k: f"{rng.choice(_IDENTIFIERS)}/{rng.choice(_IDENTIFIERS)}.py" if k == "path"
                else " ".join(rng.choices(_IDENTIFIERS, k=3)) for k in tool["parameters"]["properties"]}
        return ToolCall(id=call_id, name=tool["name"], arguments=msgspec.json.encode(args).decode())


class RandomLengthWorkload(_Base, tag="random"):
    """Random input/output lengths (uniform by default, like `vllm bench serve --dataset-name random`)."""

    input_tokens: int = 256
    output_tokens: int = 128
    range_ratio: float = 0.0
    distribution: Literal["uniform", "normal", "lognormal", "fixed"] = "uniform"
    prefix_tokens: int = 0  # shared prefix in front of every prompt (vllm's --random-prefix-len)

    def sessions(self) -> Iterator[Session]:
        prefix = _text(self._rng("fixed"), self.prefix_tokens, self.words_per_token) + "\n" if self.prefix_tokens else ""
        rng = self._rng("stream")
        i = 0
        while True:
            n_in = _spread(rng, self.input_tokens, self.range_ratio, self.distribution)
            n_out = _spread(rng, self.output_tokens, self.range_ratio, self.distribution)
            yield Session(
                id=f"rand-{i}",
                group="random",
                turns=[Turn(user=prefix + _text(rng, n_in, self.words_per_token), max_tokens=n_out,
                            input_tokens_est=self.prefix_tokens + n_in)],
            )
            i += 1


# Plain, readable functions: what a small instruct model copies faithfully (it rewrites code it
# cannot read, such as the synthetic arithmetic below, instead of copying it).
_NATURAL_FUNCTIONS = (
    "def celsius_to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32\n",
    "def is_even(number):\n    return number % 2 == 0\n",
    "def average(values):\n    if not values:\n        return 0\n    return sum(values) / len(values)\n",
    "def greet(name):\n    return f\"Hello, {name}!\"\n",
    "def count_words(text):\n    return len(text.split())\n",
    "def reverse_string(text):\n    return text[::-1]\n",
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
    "def find_max(numbers):\n    largest = numbers[0]\n    for number in numbers:\n        if number > largest:\n"
    "            largest = number\n    return largest\n",
    "def is_palindrome(word):\n    word = word.lower()\n    return word == word[::-1]\n",
    "def area_of_circle(radius):\n    return 3.14159 * radius * radius\n",
    "def fizzbuzz(n):\n    if n % 15 == 0:\n        return \"FizzBuzz\"\n    if n % 3 == 0:\n        return \"Fizz\"\n"
    "    if n % 5 == 0:\n        return \"Buzz\"\n    return str(n)\n",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.strip() for line in f]\n",
)
CODE_EDITOR_SYSTEM = "You are a code editor. You output the full edited file and nothing else."


class CodeEditWorkload(_Base, tag="code_edit"):
    """Input-grounded code editing: return a code block with one small change.

    The answer mostly copies the prompt, which is where n-gram speculative decoding shines.
    `natural`: readable functions and a code-editor system prompt, which a small real model (SmolLM2)
    edits by copying; otherwise synthetic arithmetic functions (fine for a random-weight model).
    """

    functions: int = 6
    lines_per_function: int = 6
    output_slack: float = 1.2  # max_tokens = estimated code tokens * slack
    natural: bool = False

    def sessions(self) -> Iterator[Session]:
        rng = self._rng("stream")
        i = 0
        while True:
            code, names = self._natural(rng) if self.natural else self._code(rng)
            old = rng.choice(names)
            new = old + "_" + rng.choice(_IDENTIFIERS) if not self.natural else "compute_" + old
            code_tokens = _tokens_of(code, self.words_per_token)
            if self.natural:
                user = f"Rename the function `{old}` to `{new}`.\n\n```python\n{code}```"
            else:
                user = (
                    f"Rename the function `{old}` to `{new}` everywhere in this file and return the whole "
                    f"file in one code block, otherwise unchanged.\n\n```python\n{code}```"
                )
            yield Session(
                id=f"edit-{i}",
                group="code_edit",
                system=CODE_EDITOR_SYSTEM if self.natural else None,
                turns=[Turn(user=user, max_tokens=max(8, round(code_tokens * self.output_slack)),
                            input_tokens_est=code_tokens + 30)],
            )
            i += 1

    def _natural(self, rng: random.Random) -> tuple[str, list[str]]:
        chosen = rng.sample(_NATURAL_FUNCTIONS, min(self.functions, len(_NATURAL_FUNCTIONS)))
        return "\n".join(chosen), [f[4:f.index("(")] for f in chosen]

    def _code(self, rng: random.Random) -> tuple[str, list[str]]:
        lines: list[str] = []
        names: list[str] = []
        for f in range(self.functions):
            a, b = rng.sample(_IDENTIFIERS, 2)
            name = f"{rng.choice(_IDENTIFIERS)}_{rng.choice(_IDENTIFIERS)}_{f}"
            names.append(name)
            lines.append(f"def {name}({a}, {b}):")
            for k in range(self.lines_per_function - 1):
                var = rng.choice(_IDENTIFIERS)
                lines.append(f"    {var}_{k} = {a} * {rng.randint(2, 99)} + {b} // {rng.randint(1, 9)}")
            lines.append(f"    return {a} + {b}\n")
        return "\n".join(lines) + "\n", names


class TraceWorkload(_Base, tag="trace"):
    """Replay a JSONL trace; one request per line, in file order.

    Each line: a timestamp (`timestamp` seconds, or `timestamp_ms`) and either `prompt` text /
    `messages`, or token counts (`input_tokens`|`input_length`, `output_tokens`|`output_length`).
    Mooncake-style `hash_ids` rebuild shared prefixes: equal ids give equal text blocks.
    """

    path: str = ""
    default_output_tokens: int = 128
    hash_block_tokens: int = 64
    loop: bool = False  # start again at the top when the file is exhausted

    def sessions(self) -> Iterator[Session]:
        rows = self._rows()
        if not rows:
            raise WorkloadError(f"trace {self.path!r} has no requests")
        t0 = min(r[0] for r in rows)
        span = max(r[0] for r in rows) - t0
        lap = 0
        i = 0
        while True:
            for ts, session in rows:
                offset = ts - t0 + lap * (span + 1.0)
                yield msgspec.structs.replace(session, id=f"trace-{i}", arrival_s=offset)
                i += 1
            if not self.loop:
                return
            lap += 1

    def _rows(self) -> list[tuple[float, Session]]:
        path = Path(self.path)
        try:
            raw_lines = path.read_bytes().splitlines()
        except OSError as exc:
            raise WorkloadError(f"cannot read trace {self.path!r}: {exc}") from exc
        blocks: dict[object, str] = {}
        block_rng = self._rng("blocks")
        out: list[tuple[float, Session]] = []
        for n, line in enumerate(raw_lines, 1):
            if not line.strip():
                continue
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise WorkloadError(f"{self.path}:{n}: not JSON: {exc}") from exc
            if "timestamp_ms" in row:
                ts = float(row["timestamp_ms"]) / 1000.0
            else:
                ts = float(row.get("timestamp", 0.0))
            max_tokens = int(row.get("output_tokens") or row.get("output_length") or row.get("max_tokens")
                             or self.default_output_tokens)
            system = None
            if "messages" in row:
                msgs = row["messages"]
                system = next((m["content"] for m in msgs if m.get("role") == "system"), None)
                user = "\n".join(m["content"] for m in msgs if m.get("role") != "system")
                est = _tokens_of(user + (system or ""), self.words_per_token)
            elif "prompt" in row:
                user = str(row["prompt"])
                est = _tokens_of(user, self.words_per_token)
            else:
                n_in = int(row.get("input_tokens") or row.get("input_length") or 0)
                if n_in <= 0:
                    raise WorkloadError(f"{self.path}:{n}: needs prompt, messages or input_tokens")
                parts: list[str] = []
                used = 0
                for h in row.get("hash_ids") or []:
                    if h not in blocks:
                        blocks[h] = _text(block_rng, self.hash_block_tokens, self.words_per_token)
                    parts.append(blocks[h])
                    used += self.hash_block_tokens
                if used < n_in:
                    parts.append(_text(random.Random(f"{self.seed}:row:{n}"), n_in - used, self.words_per_token))
                user = " ".join(parts)
                est = n_in
            out.append((ts, Session(id="", system=system, group=str(row.get("group", "trace")),
                                    turns=[Turn(user=user, max_tokens=max_tokens, input_tokens_est=est)])))
        out.sort(key=lambda r: r[0])
        return out


Workload = (SharedPrefixWorkload | AdapterWorkload | AgentSessionWorkload | AgentToolsWorkload | RandomLengthWorkload
            | CodeEditWorkload | TraceWorkload)
