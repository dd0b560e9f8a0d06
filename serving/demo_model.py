"""The demo model: a tiny seeded Llama with a byte-level BPE tokenizer, in Hugging Face format.

No hub is reachable from the machines yieldgate targets, so the demo model is generated, never
downloaded. Everything is derived from the seed and the corpus shipped in this package, so the same
seed gives byte-identical files (tests compare hashes across two runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import msgspec

from .chatml import chatml_template
from .paths import home_dir

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]

# The cl100k / Llama-3 pre-tokenizer split; tiktoken supports the same pattern natively.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML with Hermes-style tool calling; BOS comes from the template, so chat prompts are tokenized
# without add_special_tokens (what vLLM does for chat).
CHAT_TEMPLATE = chatml_template(bos=True)


class DemoModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The generated model's shape; also `[fleet.demo_model]` in the config (a bigger model for benchmarks)."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 8192

    @property
    def key(self) -> str:
        """Directory name: changes whenever anything that shapes the files changes."""
        blob = (json.dumps(msgspec.structs.asdict(self), sort_keys=True).encode() + _corpus_bytes()
                + CHAT_TEMPLATE.encode())
        return f"demo-llama-s{self.seed}-{hashlib.sha256(blob).hexdigest()[:10]}"


def default_cache_dir() -> Path:
    return home_dir() / "models"


def ensure_demo_model(cache_dir: Path | None = None, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Return the demo model directory, generating it first if it is missing."""
    target = (cache_dir or default_cache_dir()) / spec.key
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    return make_demo_model(target, spec)


def make_demo_model(target: Path, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Write the model to `target` atomically (built in a temp dir, then renamed)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        _write_tokenizer(tmp, spec)
        _write_weights(tmp, spec)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def files_digest(model_dir: Path) -> str:
    """sha256 over every file's name and bytes, in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).rglob("*")):
        if path.is_file():
            h.update(path.relative_to(model_dir).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _corpus_bytes() -> bytes:
    return resources.files("yieldgate.serving").joinpath("data/corpus.txt").read_bytes()


def _write_tokenizer(out: Path, spec: DemoModelSpec) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _corpus_bytes().decode("utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)


def _write_weights(out: Path, spec: DemoModelSpec) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = LlamaConfig(
        vocab_size=max(len(vocab), max(specials.values()) + 1),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=specials[BOS],
        eos_token_id=[specials[EOS], specials[IM_END]],
        pad_token_id=specials[EOS],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=specials[BOS], eos_token_id=[specials[EOS], specials[IM_END]], do_sample=False
    ).save_pretrained(out)
