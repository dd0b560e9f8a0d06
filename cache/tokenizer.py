"""Prompt tokenization that matches the engine token for token.

Fast path: a ``tiktoken.Encoding`` built locally from the served model's own
byte-level BPE ``tokenizer.json`` (vocab + merges -> mergeable ranks through the
GPT-2 byte<->unicode table, the Split pre-tokenizer regex, added tokens as
specials). tiktoken never downloads anything here. Fallback: HF ``tokenizers``
when the file is not convertible (normalizers, Metaspace/SentencePiece models,
added tokens with strip flags, merges that disagree with token ids...).

Engine defaults mirrored (vLLM /v1/completions and /tokenize):
- completions prompts: ``add_special_tokens=True`` (the post-processor's BOS/EOS);
- chat: template rendered with ``add_generation_prompt=True``, then tokenized
  with ``add_special_tokens=False`` because the template already emits BOS.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import tiktoken
import tokenizers

from .blocks import drop_oldest, pack_tokens
from .chat_template import ChatTemplate

Backend = Literal["tiktoken", "hf"]

# The pre-tokenizer ByteLevel(use_regex=True) uses GPT-2's split pattern.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits) before it (SmolLM2's tokenizer): every digit a piece of its own, and GPT-2's
# split inside the pieces between them, so whitespace before a digit ends its piece as text's end does.
_GPT2_SINGLE_DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


# Segments cached (oldest dropped first). Short ones too: tiktoken's call overhead alone (~3 µs for
# a role name like "user\n") is 10-30x a dict lookup, and a chat template repeats a few of them.
_CACHE_MAX_SEGMENTS = 4096

class NotConvertible(ValueError):
    """The HF tokenizer cannot be expressed exactly as a tiktoken Encoding."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split_pattern(pre: dict[str, Any] | None) -> str:
    """The regex the pre-tokenizer splits with, if it is plain byte-level BPE."""
    if pre is None:
        raise NotConvertible("no pre-tokenizer")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    pattern: str | None = None
    byte_level = single_digits = False
    for step in steps:
        kind = step.get("type")
        if kind == "Digits" and step.get("individual_digits") and pattern is None and not byte_level:
            single_digits = True
        elif kind == "Split":
            if single_digits:
                raise NotConvertible("Digits before a Split")
            if pattern is not None or step.get("invert") or step.get("behavior") != "Isolated":
                raise NotConvertible(f"unsupported Split {step}")
            pat = step.get("pattern", {})
            if "Regex" in pat:
                pattern = pat["Regex"]
            else:
                raise NotConvertible("Split on a literal string")
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise NotConvertible("ByteLevel add_prefix_space")
            if step.get("use_regex", True):
                if pattern is not None:
                    raise NotConvertible("two split regexes")
                pattern = _GPT2_SINGLE_DIGITS_PATTERN if single_digits else _GPT2_PATTERN
            elif single_digits:
                raise NotConvertible("Digits before a ByteLevel without its regex")
            byte_level = True
        else:
            raise NotConvertible(f"pre-tokenizer {kind}")
    if not byte_level or pattern is None:
        raise NotConvertible("not byte-level")
    return pattern


def build_tiktoken_encoding(spec: dict[str, Any], name: str = "model"
                            ) -> tuple[tiktoken.Encoding, list[int] | None, re.Pattern[str] | None]:
    """tokenizer.json (parsed) -> (Encoding, optional rank->id table, text only HF encodes exactly).

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and
    returns ranks as ids, while HF applies merges in list order and returns vocab
    ids. When merge order and id order agree (BPE trainers append merged tokens in
    order) ranks are the ids; otherwise ranks follow merge order and a table maps
    them back to ids.

    A vocabulary may lack some single bytes (SmolLM2's lacks 21, control characters among them). HF
    drops such a byte and merges across it; tiktoken cannot, so those bytes get placeholder ranks
    and the third value matches the characters whose text must be encoded by HF instead.
    """
    if spec.get("normalizer") is not None:
        raise NotConvertible("normalizer present")
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix") or model.get("byte_fallback"):
        raise NotConvertible("not a plain BPE model")
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    added = spec.get("added_tokens") or []
    token_bytes, merged_ids, missing = _byte_vocab(model, {t["id"] for t in added})
    specials: dict[str, int] = {}
    for tok in added:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word") or \
                (tok.get("normalized") and not tok.get("special")):
            raise NotConvertible(f"added token {tok['content']!r} has matching flags tiktoken lacks")
        specials[tok["content"]] = tok["id"]
    ranks, special_ranks, rank_to_id = _ranks(token_bytes, merged_ids, specials)
    hf_only = _chars_with_bytes(missing)
    if missing:
        top = max([*ranks.values(), *special_ranks.values()]) + 1
        for k, b in enumerate(missing):
            ranks[bytes([b])] = top + k
        if rank_to_id is not None:  # never looked up: text holding these bytes goes to HF
            rank_to_id.extend([-1] * (top + len(missing) - len(rank_to_id)))
    enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_ranks)
    return enc, rank_to_id, hf_only


def _chars_with_bytes(missing: list[int]) -> re.Pattern[str] | None:
    """A pattern of the characters whose UTF-8 holds one of `missing` (ASCII bytes and lead bytes;
    0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8)."""
    ranges: list[str] = []
    for b in missing:
        if b < 0x80:
            ranges.append(re.escape(chr(b)))
        elif 0xC2 <= b <= 0xDF:
            ranges.append(f"\\u{(b & 0x1F) << 6:04x}-\\u{((b & 0x1F) << 6) | 0x3F:04x}")
        elif 0xE0 <= b <= 0xEF:
            lo = max((b & 0x0F) << 12, 0x800)
            ranges.append(f"\\u{lo:04x}-\\u{lo | 0xFFF:04x}")
        elif 0xF0 <= b <= 0xF4:
            lo = max((b & 0x07) << 18, 0x10000)
            ranges.append(f"\\U{lo:08x}-\\U{min(lo | 0x3FFFF, 0x10FFFF):08x}")
        elif 0x80 <= b <= 0xBF:
            raise NotConvertible(f"continuation byte {b:#x} missing from vocab")
    return re.compile("[" + "".join(ranges) + "]") if ranges else None


def _byte_vocab(model: dict[str, Any], added_ids: set[int]) -> tuple[dict[bytes, int], list[int], list[int]]:
    """The BPE vocab as bytes -> id, the id each merge produces, in merge order, and the single
    bytes the vocab lacks; refuses what tiktoken would tokenize differently."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def to_bytes(token: str) -> bytes:
        try:
            return bytes(byte_of[c] for c in token)
        except KeyError as exc:
            raise NotConvertible(f"token {token!r} is not byte-level") from exc

    token_bytes = {to_bytes(tok): i for tok, i in model["vocab"].items() if i not in added_ids}
    missing = [b for b in range(256) if bytes([b]) not in token_bytes]
    merged_ids: list[int] = []
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = to_bytes(left) + to_bytes(right)
        if merged not in token_bytes:
            raise NotConvertible(f"merge result {merged!r} not in vocab")
        merged_ids.append(token_bytes[merged])
    merged_set = set(merged_ids)
    if len(merged_set) != len(merged_ids):
        raise NotConvertible("two merges produce the same token")
    unreachable = [b for b, i in token_bytes.items() if len(b) > 1 and i not in merged_set]
    if unreachable and not model.get("ignore_merges"):
        # tiktoken looks a whole pre-token up in the vocab first; HF without
        # ignore_merges does not, so a token no merge produces would diverge.
        raise NotConvertible(f"{len(unreachable)} multi-byte tokens no merge produces")
    return token_bytes, merged_ids, missing


def _ranks(token_bytes: dict[bytes, int], merged_ids: list[int], specials: dict[str, int]
           ) -> tuple[dict[bytes, int], dict[str, int], list[int] | None]:
    """tiktoken ranks: the ids themselves when merge order and id order agree, else ranks in
    merge order with a rank -> id table."""
    singles = [bytes([b]) for b in range(256) if bytes([b]) in token_bytes]
    single_ids = sorted(token_bytes[b] for b in singles)
    monotone = all(a < b for a, b in zip(merged_ids, merged_ids[1:])) and \
        (not merged_ids or max(single_ids) < merged_ids[0])
    if monotone:
        return token_bytes, specials, None
    ranks = {b: r for r, b in enumerate(sorted(singles, key=token_bytes.__getitem__))}
    id_to_bytes = {i: b for b, i in token_bytes.items()}
    for r, i in enumerate(merged_ids, start=len(singles)):
        ranks[id_to_bytes[i]] = r
    next_rank = len(singles) + len(merged_ids)
    special_ranks = {}
    for content in specials:
        special_ranks[content] = next_rank
        next_rank += 1
    table = [0] * next_rank
    for b, r in ranks.items():
        table[r] = token_bytes[b]
    for content, r in special_ranks.items():
        table[r] = specials[content]
    return ranks, special_ranks, table


class Tokenizer:
    """The served model's tokenizer, as the engine applies it.

    >>> tok = Tokenizer.from_model_dir(path)
    >>> tok.encode("hello")                        # completions: with BOS
    >>> tok.encode_chat([{"role": "user", "content": "hi"}])
    """

    def __init__(self, hf: tokenizers.Tokenizer, chat_template: ChatTemplate | None,
                 encoding: tiktoken.Encoding | None = None, rank_to_id: list[int] | None = None,
                 not_convertible_reason: str | None = None, hf_only: re.Pattern[str] | None = None) -> None:
        self.hf = hf
        self._hf_only = hf_only  # text holding these characters is encoded by HF (see build_tiktoken_encoding)
        self.chat_template = chat_template
        self.encoding = encoding
        self._rank_to_id = rank_to_id
        self.not_convertible_reason = not_convertible_reason
        self.backend: Backend = "tiktoken" if encoding is not None else "hf"
        # segment -> (ids, the ids packed as cache.blocks.pack_tokens packs them)
        self._segment_cache: dict[str, tuple[tuple[int, ...], bytes | None]] = {}
        self._special_split = None
        self._special_ids: dict[str, int] = {}
        self._special_packed: dict[str, bytes | None] = {}
        if encoding is not None and encoding.special_tokens_set:
            specials = sorted(encoding.special_tokens_set, key=len, reverse=True)
            self._special_ids = {t: self._ids([encoding.encode_single_token(t)])[0] for t in specials}
            self._special_packed = {t: pack_tokens([i]) for t, i in self._special_ids.items()}
            self._special_split = re.compile("(" + "|".join(map(re.escape, specials)) + ")").split
        # Post-processor template (e.g. BOS + A): found by diffing one encode
        # with and without special tokens, which works for any template processor.
        plain = hf.encode("a", add_special_tokens=False).ids
        full = hf.encode("a", add_special_tokens=True).ids
        self._prefix: list[int] = []
        self._suffix: list[int] = []
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                self._prefix, self._suffix = full[:i], full[i + len(plain):]
                break
        else:  # post-processor rewrites content: only HF can apply it
            self.encoding = None
            self.backend = "hf"
            self.not_convertible_reason = "post-processor changes the sequence"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, backend: Backend | None = None) -> "Tokenizer":
        """Load tokenizer.json (+ chat template). backend=None: tiktoken when convertible."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        hf = tokenizers.Tokenizer.from_file(str(path))
        try:
            chat_template: ChatTemplate | None = ChatTemplate.from_model_dir(model_dir)
        except ValueError:
            chat_template = None
        encoding = rank_to_id = hf_only = None
        reason = None
        if backend != "hf":
            try:
                encoding, rank_to_id, hf_only = build_tiktoken_encoding(json.loads(path.read_text()), model_dir.name)
            except NotConvertible as exc:
                if backend == "tiktoken":
                    raise
                reason = str(exc)
        return cls(hf, chat_template, encoding, rank_to_id, reason, hf_only)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.encoding is None or (self._special_split is None and self._needs_hf(text)):
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        # HF splits added tokens out of any text, whatever add_special_tokens says.
        ids = self._encode_segments(text)
        if add_special_tokens and (self._prefix or self._suffix):
            return self._prefix + ids + self._suffix
        return ids

    def _needs_hf(self, text: str) -> bool:
        return self._hf_only is not None and self._hf_only.search(text) is not None

    def count(self, text: str) -> int:
        """How many tokens `text` is on its own: generated text (no special tokens, nothing cached)."""
        if self.encoding is None or self._needs_hf(text):
            return len(self.hf.encode(text, add_special_tokens=False).ids)
        return len(self.encoding.encode_ordinary(text))

    def _encode_segments(self, text: str, packed: list[bytes | None] | None = None) -> list[int]:
        """tiktoken's encode, one special-token-delimited segment at a time, segments cached.

        BPE never merges across a special token, so encoding the text between special tokens on its
        own gives the same ids; a system prompt or tool list shared by many requests is then
        encoded once (the rendered chat template puts each message between special tokens).
        With `packed`, each piece's ids packed (cache.blocks.pack_tokens) are appended to it, cached
        alongside the ids: joining them is cheaper than packing the whole prompt again.
        """
        assert self.encoding is not None
        if self._special_split is None:
            ids = self._ids(self.encoding.encode(text, allowed_special="all"))
            if packed is not None:
                packed.append(pack_tokens(ids))
            return ids
        out: list[int] = []
        cache = self._segment_cache
        for i, piece in enumerate(self._special_split(text)):
            if not piece:
                continue
            if i % 2:  # odd pieces are the special tokens the split captured
                out.append(self._special_ids[piece])
                if packed is not None:
                    packed.append(self._special_packed[piece])
                continue
            entry = cache.get(piece)
            if entry is None:
                # A tuple, not a list: the collector stops tracking a tuple of ints after one pass,
                # while a kept list of ids is walked again by every older-generation pass.
                ids = tuple(self.hf.encode(piece, add_special_tokens=False).ids if self._needs_hf(piece)
                            else self._ids(self.encoding.encode_ordinary(piece)))
                if len(cache) >= _CACHE_MAX_SEGMENTS:
                    drop_oldest(cache, _CACHE_MAX_SEGMENTS // 16)
                entry = cache[piece] = (ids, pack_tokens(ids))
            out.extend(entry[0])
            if packed is not None:
                packed.append(entry[1])
        return out

    def _ids(self, ranks: list[int]) -> list[int]:
        table = self._rank_to_id
        return ranks if table is None else [table[r] for r in ranks]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if self.encoding is None:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return [self.encode(t, add_special_tokens) for t in texts]

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        if self.chat_template is None:
            from .chat_template import ChatTemplateError
            raise ChatTemplateError("model has no chat template")
        return self.chat_template.render(messages, tools, add_generation_prompt, **template_kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Chat messages -> prompt token ids as vLLM's chat endpoint builds them."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def encode_chat_packed(self, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None = None) -> tuple[list[int], bytes | None]:
        """`encode_chat`'s ids and the same ids packed (cache.blocks.pack_tokens), for the block
        hasher: shared segments are packed once, not on every request."""
        if self.encoding is None:
            ids = self.encode_chat(messages, tools)
            return ids, pack_tokens(ids)
        pieces: list[bytes | None] = []
        ids = self._encode_segments(self.render_chat(messages, tools), pieces)
        return ids, None if None in pieces else b"".join(pieces)  # type: ignore[arg-type]
