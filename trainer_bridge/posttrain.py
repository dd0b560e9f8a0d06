"""The continuous post-training loop: graded traffic in, a LoRA adapter out, the gateway's gate decides.

    loop = PosttrainLoop(PosttrainSettings(gateway=URL, admin_token=ADMIN, adapter="math", rounds=3))
    rows = loop.run()          # resumes at the next round if the state file says rounds are done

Each round: (1) train a LoRA with `peft` on CPU from the model's own graded successes so far
(rejection sampling: the replies the checker passed, never the answer key); (2) `push_adapter`
it as a canary; (3) send task prompts through the gateway as ordinary client traffic (the
official openai client, at temperature), grade each reply and post the outcome to
`/v1/feedback`: these grades decide the canary and add to the training set; (4) wait until the
gateway's own timer promotes or rolls back the canary; (5) grade the held-out split greedily on
the version that now serves. Round 0 puts a zero-initialised adapter (the base model's answers)
in service and gathers the first graded samples. The state (rounds done, training set) is a JSON
file that a restarted trainer continues from (docs/posttraining.md).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import msgspec

from yieldgate.serving import home_dir

from .adapter_push import push_adapter
from .tasks import Task, check, task_split


class PosttrainSettings(msgspec.Struct, forbid_unknown_fields=True):
    gateway: str                                  # the gateway's base URL (no /v1)
    admin_token: str                              # pushes adapters and reads their state
    model_dir: str                                # the served base model's directory (for training)
    adapter: str = "posttrain"                    # the adapter's name: clients ask for this model
    api_key: str = "none"                         # an inference key, when the gateway requires keys
    families: list[str] = msgspec.field(default_factory=lambda: ["arithmetic"])
    rounds: int = 3
    seed: int = 0
    samples_per_round: int = 96                   # graded train-split requests a round sends at least
    group: int = 4                                # samples per prompt (rejection sampling keeps the passed)
    temperature: float = 0.8
    eval_tasks: int = 40                          # held-out tasks per family, graded greedily
    canary: float = 0.5                           # the candidate's share while the gate judges it
    decision_timeout_s: float = 900.0             # grading traffic stops after this with no decision
    concurrency: int = 4
    # Training: a rank-`rank` LoRA on every linear layer, fp32 on CPU.
    rank: int = 8
    lr: float = 1e-3
    epochs: int = 1
    max_examples: int = 400                       # the newest graded successes, deduplicated
    threads: int = 2                              # torch threads while training
    cpu_usd_per_hour: float = 0.10                # what an hour of the trainer's CPU costs
    state_path: str = ""                          # "" = $YIELDGATE_HOME/posttrain/<adapter>.json


class Sample(msgspec.Struct):
    prompt: str
    reply: str
    passed: bool
    version: str                                  # <adapter>@<version> that answered
    cost_usd: str
    tokens: int


class RoundRow(msgspec.Struct):
    round: int
    version: str                                  # the version the round pushed (v0: the base model)
    decision: str                                 # promote, rollback, base, timeout
    reason: str
    serving: str                                  # the version serving after the decision
    eval_success: float
    eval_solved: int
    eval_tasks: int
    usd_per_solved: float | None                  # held-out: spend / solved tasks
    train_examples: int
    train_cpu_s: float
    grading_requests: int
    grading_tokens: int
    grading_usd: float
    round_usd: float                              # grading traffic + trainer CPU at cpu_usd_per_hour
    seconds: float


class LoopState(msgspec.Struct):
    adapter: str
    rounds: list[RoundRow] = []
    successes: list[list[str]] = []               # [prompt, reply] the checker passed, oldest first


def _log(msg: str) -> None:
    print(msg, flush=True)


class PosttrainLoop:
    def __init__(self, settings: PosttrainSettings, log: Callable[[str], None] = _log):
        from openai import OpenAI

        self.s, self.log = settings, log
        self.path = Path(settings.state_path or home_dir() / "posttrain" / f"{settings.adapter}.json")
        self.client = OpenAI(base_url=settings.gateway.rstrip("/") + "/v1", api_key=settings.api_key,
                             max_retries=0, timeout=600)
        self.admin = httpx.Client(base_url=settings.gateway.rstrip("/"), timeout=120,
                                  headers={"Authorization": f"Bearer {settings.admin_token}"})
        self.feedback = httpx.Client(base_url=settings.gateway.rstrip("/"), timeout=60,
                                     headers={"Authorization": f"Bearer {settings.api_key}"})
        self.train_tasks = [t for f in settings.families for t in task_split(f, "train", 2000, settings.seed, exact=False)]
        self.eval_tasks = [t for f in settings.families for t in task_split(f, "eval", settings.eval_tasks, settings.seed)]
        self.rng = random.Random(settings.seed)
        self.state = self.load()

    # --- state ----------------------------------------------------------------------------------

    def load(self) -> LoopState:
        if self.path.exists():
            state = msgspec.json.decode(self.path.read_bytes(), type=LoopState)
            if state.adapter != self.s.adapter:
                raise ValueError(f"{self.path} holds the state of adapter {state.adapter!r}")
            return state
        return LoopState(self.s.adapter)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.state))
        os.replace(tmp, self.path)  # a trainer killed mid-write leaves the previous state whole

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> list[RoundRow]:
        if not self.state.rounds:
            self.round_zero()
        while len(self.state.rounds) <= self.s.rounds:
            self.round(len(self.state.rounds))
        return self.state.rounds

    def round_zero(self) -> None:
        """The base model in service as version v0 (a LoRA whose B matrices are zero), its first
        graded samples, and its held-out score."""
        started = time.monotonic()
        doc = self.adapter_doc()
        if doc is None or not any(v["version"] == "v0" for v in doc["versions"]):
            model, _ = self.new_lora()
            push_adapter(model, name=self.s.adapter, version="v0", gateway=self.s.gateway, token=self.s.admin_token)
        samples = self.grade_traffic(self.s.samples_per_round, lambda: False)
        self.finish_round(0, "v0", "base", "the base model's answers (a zero LoRA)", samples, 0.0, 0, started)

    def round(self, n: int) -> None:
        started = time.monotonic()
        version = f"r{n}-{int(time.time())}"
        self.log(f"round {n}: training on the graded successes so far")
        cpu_s, examples = self.train_and_push(version)
        stop = lambda: (self.adapter_doc() or {}).get("canary") is None  # noqa: E731
        deadline = time.monotonic() + self.s.decision_timeout_s
        samples: list[Sample] = []
        while not stop() and time.monotonic() < deadline:  # the gate's grades, and the next round's data
            samples += self.grade_traffic(max(8, self.s.concurrency * 2), stop)
        decision, reason = self.decision(version)
        self.finish_round(n, version, decision, reason, samples, cpu_s, examples, started)

    def finish_round(self, n: int, version: str, decision: str, reason: str, samples: list[Sample],
                     cpu_s: float, examples: int, started: float) -> None:
        self.state.successes += [[x.prompt, x.reply] for x in samples if x.passed]
        serving = (self.adapter_doc() or {}).get("current", "")
        solved, spend = self.evaluate()
        grading_usd = float(sum(Decimal(x.cost_usd) for x in samples))
        row = RoundRow(
            round=n, version=version, decision=decision, reason=reason, serving=serving,
            eval_success=solved / len(self.eval_tasks), eval_solved=solved, eval_tasks=len(self.eval_tasks),
            usd_per_solved=spend / solved if solved else None, train_examples=examples, train_cpu_s=cpu_s,
            grading_requests=len(samples), grading_tokens=sum(x.tokens for x in samples), grading_usd=grading_usd,
            round_usd=grading_usd + cpu_s / 3600 * self.s.cpu_usd_per_hour, seconds=time.monotonic() - started)
        self.state.rounds.append(row)
        self.save()
        self.log(format_row(row))

    # --- traffic --------------------------------------------------------------------------------

    def ask(self, task: Task, temperature: float) -> tuple[str, str, str, str, int]:
        """One request through the gateway -> (reply, request id, weight version, cost, tokens)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.s.adapter, messages=[{"role": "user", "content": task.prompt}],
            max_tokens=task.max_tokens, temperature=temperature)
        body = raw.parse()
        usage = body.usage
        return (body.choices[0].message.content or "", raw.headers["x-request-id"],
                raw.headers.get("x-yieldgate-weight-version", ""), raw.headers.get("x-yieldgate-cost-usd", "0"),
                usage.total_tokens if usage else 0)

    def grade_one(self, task: Task) -> Sample:
        reply, request_id, version, cost, tokens = self.ask(task, self.s.temperature)
        passed = check(task, reply)
        r = self.feedback.post("/v1/feedback", json={"request_id": request_id, "passed": passed})
        r.raise_for_status()
        return Sample(task.prompt, reply, passed, version, cost, tokens)

    def grade_traffic(self, n: int, stop: Callable[[], bool]) -> list[Sample]:
        """About `n` graded train-split requests, `group` per prompt, ended early once `stop()`."""
        tasks: list[Task] = []
        while len(tasks) < n:
            tasks += [self.rng.choice(self.train_tasks)] * self.s.group
        out: list[Sample] = []
        with ThreadPoolExecutor(self.s.concurrency) as pool:
            for i in range(0, len(tasks), self.s.concurrency * 2):
                out += pool.map(self.grade_one, tasks[i:i + self.s.concurrency * 2])
                if stop():
                    break
        passed = sum(x.passed for x in out)
        by_version: dict[str, list[int]] = {}
        for x in out:
            by_version.setdefault(x.version, [0, 0])
            by_version[x.version][0] += 1
            by_version[x.version][1] += x.passed
        self.log(f"  graded {len(out)} requests, {passed} passed: "
                 + ", ".join(f"{v} {p}/{k}" for v, (k, p) in sorted(by_version.items())))
        return out

    def evaluate(self) -> tuple[int, float]:
        """Greedy replies of the serving version on the held-out split -> (solved, spend in $)."""
        def one(task: Task) -> tuple[bool, float]:
            reply, _, _, cost, _ = self.ask(task, 0.0)
            return check(task, reply), float(cost)

        with ThreadPoolExecutor(self.s.concurrency) as pool:
            results = list(pool.map(one, self.eval_tasks))
        return sum(ok for ok, _ in results), sum(c for _, c in results)

    # --- the gateway's side -----------------------------------------------------------------------

    def adapter_doc(self) -> dict[str, Any] | None:
        r = self.admin.get("/admin/adapters")
        r.raise_for_status()
        return next((a for a in r.json()["data"] if a["name"] == self.s.adapter), None)

    def decision(self, version: str) -> tuple[str, str]:
        doc = self.adapter_doc() or {}
        if doc.get("canary") is not None:  # no decision in time: this trainer ends the trial itself
            self.admin.post(f"/admin/adapters/{self.s.adapter}/rollback").raise_for_status()
            return "timeout", f"no decision within {self.s.decision_timeout_s:.0f} s; rolled back by the trainer"
        r = self.admin.get(f"/admin/adapters/{self.s.adapter}/canary/decisions")
        found = [d for d in r.json()["data"] if d["version"] == version] if r.status_code == 200 else []
        reason = found[-1]["reason"] if found else "decided by another gateway"
        return ("promote" if doc.get("current") == version else "rollback"), reason

    # --- training -------------------------------------------------------------------------------

    def new_lora(self):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.manual_seed(self.s.seed)
        tokenizer = AutoTokenizer.from_pretrained(self.s.model_dir)
        base = LlamaForCausalLM.from_pretrained(self.s.model_dir, dtype=torch.float32)
        config = LoraConfig(r=self.s.rank, lora_alpha=2 * self.s.rank, lora_dropout=0.0,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        return get_peft_model(base, config), tokenizer

    def train_and_push(self, version: str) -> tuple[float, int]:
        pairs = list(dict.fromkeys(map(tuple, self.state.successes)))[-self.s.max_examples:]
        cpu_started = time.process_time()
        model = train_lora(self, pairs)
        cpu_s = time.process_time() - cpu_started
        report = push_adapter(model, name=self.s.adapter, version=version, gateway=self.s.gateway,
                              token=self.s.admin_token, canary=self.s.canary)
        self.log(f"  trained on {len(pairs)} examples ({cpu_s:.0f} CPU s); pushed {version} "
                 f"({report.bytes / 1e6:.1f} MB) on canary for {self.s.canary:.0%} of requests")
        return cpu_s, len(pairs)


def train_lora(loop: PosttrainLoop, pairs: list[tuple[str, str]]):
    """One pass (or `epochs`) of SFT over (prompt, reply) pairs, loss on the reply tokens only."""
    import torch

    torch.set_num_threads(loop.s.threads)
    model, tokenizer = loop.new_lora()
    if not pairs:
        return model
    examples = []
    for prompt, reply in pairs:
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        tail_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        examples.append((head_ids + tail_ids, [-100] * len(head_ids) + tail_ids))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=loop.s.lr)
    model.train()
    order = list(range(len(examples)))
    batch = 8
    for _ in range(loop.s.epochs):
        random.Random(loop.s.seed).shuffle(order)
        for i in range(0, len(order), batch):
            chunk = [examples[j] for j in order[i:i + batch]]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.tensor([x + [tokenizer.pad_token_id or 0] * (width - len(x)) for x, _ in chunk])
            labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in chunk])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in chunk])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.eval()
    return model


HEADER = f"{'round':>5}  {'version':<16} {'decision':<9} {'serving':<16} {'held-out':>9} {'$/solved':>10} {'round $':>9} {'min':>5}"


def format_row(r: RoundRow) -> str:
    per = f"{r.usd_per_solved:.3g}" if r.usd_per_solved is not None else "-"
    return (f"{r.round:>5}  {r.version:<16} {r.decision:<9} {r.serving:<16} "
            f"{r.eval_solved:>3}/{r.eval_tasks:<3}  {per:>10} {r.round_usd:>9.4f} {r.seconds / 60:>5.1f}")


def format_table(rows: list[RoundRow]) -> str:
    return "\n".join([HEADER, *map(format_row, rows)])


def state_json(rows: list[RoundRow]) -> str:
    return json.dumps(msgspec.to_builtins(rows), indent=2)
