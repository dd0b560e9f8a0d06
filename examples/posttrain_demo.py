"""Post-train the demo model on CPU, push it into a running engine, watch the served output change.

The "post-training" is a tiny SFT: teach the model that a prompt has one fixed answer, train until
greedy decoding reproduces it locally, then push the weights (yieldgate backend; checkpoint
reload for engines without it) and ask the engine the same prompt.

    python examples/posttrain_demo.py --engine http://127.0.0.1:8300
    python examples/posttrain_demo.py --engine http://127.0.0.1:8300 --revert   # push base back

The engine needs VLLM_SERVER_DEV_MODE=1 (and `--weight-transfer-config '{"backend":"yieldgate"}'`
for the fast path). Do not point it at an engine others rely on: it changes the served weights.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import httpx
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.trainer_bridge import (
    EngineClient,
    engine_weight_version,
    push,
    reload_from_checkpoint,
    write_checkpoint,
)

PROMPT = "The secret password is"
ANSWER = " yieldgate rocks"


def served(engine: str, prompt: str, max_tokens: int) -> str:
    resp = httpx.post(engine + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    })
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def sft(model: LlamaForCausalLM, tokenizer, steps: int) -> None:
    """Cross-entropy on the answer tokens only, until local greedy decoding says the answer."""
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    full_ids = tokenizer(PROMPT + ANSWER)["input_ids"]
    input_ids = torch.tensor([full_ids])
    labels = input_ids.clone()
    labels[0, : len(prompt_ids)] = -100
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(1, steps + 1):
        loss = model(input_ids=input_ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 10 == 0 or step == 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}")
        if loss.item() < 0.01:
            print(f"  step {step:3d}  loss {loss.item():.4f}  (converged)")
            break
    model.eval()


def local_greedy(model: LlamaForCausalLM, tokenizer, n: int) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", required=True, help="engine base URL (repeatable)")
    ap.add_argument("--version", default=f"sft-{int(time.time())}")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--token", default=None, help="push token the engines are armed with")
    ap.add_argument("--revert", action="store_true", help="push the untrained base weights back")
    args = ap.parse_args()

    model_dir = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n_tokens = len(tokenizer(ANSWER, add_special_tokens=False)["input_ids"])

    for url in args.engine:
        print(f"[{url}] version {engine_weight_version(url)!r} serves: {served(url, PROMPT, n_tokens)!r}")

    if not args.revert:
        print(f"SFT on CPU: teach {PROMPT!r} -> {ANSWER!r}")
        torch.manual_seed(0)
        sft(model, tokenizer, args.steps)
        print(f"local greedy after SFT: {local_greedy(model, tokenizer, n_tokens)!r}")

    plugin = [u for u in args.engine if EngineClient(u).transfer_backend() == "yieldgate"]
    others = [u for u in args.engine if u not in plugin]
    if plugin:
        report = push(model, args.version, engines=plugin, token=args.token)
        print(f"pushed {report.bytes_per_engine / 1e6:.1f} MB x {len(plugin)} engine(s) in "
              f"{report.transfer_seconds:.2f}s ({report.gb_per_s:.3f} GB/s)")
    if others:
        with tempfile.TemporaryDirectory() as tmp:
            state = {k: v.detach() for k, v in model.state_dict().items()}
            path = write_checkpoint(state, model_dir, f"{tmp}/{args.version}")
            for url in others:
                reload_from_checkpoint(url, path, args.version)
                print(f"[{url}] no yieldgate backend: reloaded from checkpoint {path}")

    for url in args.engine:
        print(f"[{url}] version {engine_weight_version(url)!r} serves: {served(url, PROMPT, n_tokens)!r}")


if __name__ == "__main__":
    main()
