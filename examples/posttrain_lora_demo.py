"""Post-train a LoRA adapter of the demo model on CPU, push it through the gateway, and watch
the adapter's answer change while the base model's does not.

The "post-training" is a tiny SFT with `peft`: teach an adapter that a prompt has one fixed
answer, train until local greedy decoding reproduces it, then `push_adapter` (one checksummed
upload; the gateway checks it, stores it and loads it on every replica) and ask the gateway the
same prompt under the adapter's name and under the base model's.

    python examples/posttrain_lora_demo.py --gateway http://127.0.0.1:8000 --token $ADMIN_TOKEN

The gateway's engines need LoRA on (the demo stack's are: `[fleet.lora]`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaForCausalLM

from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.trainer_bridge import AdapterPushReport, push_adapter

PROMPT = "The secret password is"
ANSWER = " yieldgate rocks"


def served(gateway: str, model: str, max_tokens: int) -> str:
    resp = httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def train_adapter(model_dir: Path, steps: int = 300, rank: int = 8, margin: float = 1.5, log=print):
    """SFT of a rank-`rank` LoRA on the attention projections: cross-entropy on the answer
    tokens only, until every answer token leads the next-best token by `margin` logits (greedy
    decoding then says the answer, with room for the engine's own float arithmetic).
    -> (peft model, tokenizer)."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    input_ids = torch.tensor([tokenizer(PROMPT + ANSWER)["input_ids"]])
    labels = input_ids.clone()
    labels[0, :prompt_len] = -100
    answer = input_ids[0, prompt_len:]
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optim = torch.optim.AdamW(trained.values(), lr=5e-3)
    best, best_lead = {}, float("-inf")
    for step in range(1, steps + 1):
        out = model(input_ids=input_ids, labels=labels)
        # Teacher forcing on the answer is greedy decoding's path once every token leads.
        logits = out.logits[0, prompt_len - 1:-1].detach()
        target = logits.gather(1, answer[:, None])[:, 0]
        lead = (target - logits.scatter(1, answer[:, None], float("-inf")).max(1).values).min().item()
        if lead > best_lead:  # near its limit the loss wanders: keep the best adapter seen
            best, best_lead = {n: p.detach().clone() for n, p in trained.items()}, lead
        if lead >= margin:
            log(f"  step {step:3d}  loss {out.loss.item():.3f}  every answer token leads by {lead:.2f} logits")
            break
        if step % 20 == 0:
            log(f"  step {step:3d}  loss {out.loss.item():.3f}  lead {lead:+.2f}")
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    with torch.no_grad():
        for n, p in trained.items():
            p.copy_(best[n])
    log(f"  the adapter's answer tokens lead by {best_lead:.2f} logits")
    model.eval()
    return model, tokenizer


def local_greedy(model, tokenizer) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    n = answer_tokens(tokenizer)
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def answer_tokens(tokenizer) -> int:
    return len(tokenizer(ANSWER, add_special_tokens=False)["input_ids"])


def run(gateway: str, token: str, name: str, version: str, model_dir: Path, steps: int = 300,
        log=print) -> dict:
    """The whole demo: base answer, train, push, then the adapter's and the base's answers."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n = answer_tokens(tokenizer)
    before = served(gateway, "demo", n)
    log(f"base model says: {before!r}")
    log(f"SFT of a LoRA adapter on CPU: teach {PROMPT!r} -> {ANSWER!r}")
    model, _ = train_adapter(model_dir, steps, log=log)
    report: AdapterPushReport = push_adapter(model, name=name, version=version, gateway=gateway, token=token)
    log(f"pushed {name}@{version}: {report.bytes / 1e3:.0f} kB in {report.seconds:.2f}s, "
        f"resident on {sorted(report.adapter['replicas'])}")
    result = {"base_before": before, "adapter": served(gateway, name, n), "base_after": served(gateway, "demo", n),
              "target": ANSWER, "report": report}
    log(f"adapter {name!r} says: {result['adapter']!r}")
    log(f"base model says: {result['base_after']!r}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", required=True, help="the gateway's base URL")
    ap.add_argument("--token", required=True, help="the gateway's admin token")
    ap.add_argument("--name", default="password-lora")
    ap.add_argument("--version", default=f"sft-{int(time.time())}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model-dir", type=Path, default=None, help="the served model (default: the demo model)")
    args = ap.parse_args()
    run(args.gateway.rstrip("/"), args.token, args.name, args.version, args.model_dir or ensure_demo_model(),
        args.steps)


if __name__ == "__main__":
    main()
