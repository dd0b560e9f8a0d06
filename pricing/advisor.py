"""Cache-friendliness advisor: finds clients whose prompts break the prefix cache.

Prefix caching only reuses a prompt's longest common prefix with earlier prompts. A timestamp in
the system prompt or tools serialized in a different order make consecutive prompts of a session
diverge early even though most of their content repeats, so everything after the divergence is
recomputed and billed at the uncached price. For consecutive prompts of one key/session we find
the first divergence and count how many tokens after it reappear in the new prompt anyway:
those are the tokens lost to the break.

Works on token ids, or on per-block *content* hashes (not vLLM's chained block hashes: with those
everything after the first differing block differs, so realignment cannot be seen). Prompts are held
as int64 arrays and compared with vectorised window hashes: a diagnosis costs tens of microseconds
on the event loop instead of the ~150 µs a pure-Python comparison of a 600-token prompt took.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Literal

import msgspec
import numpy as np

WINDOW = 8           # tokens that must match to count as realigned content
MIN_LOST_TOKENS = 32  # smaller losses are ordinary edits, not cache breaks
_MUL = np.uint64(0x100000001B3)  # FNV prime: mixes the tokens of a window


def as_tokens(seq: Sequence[Hashable] | np.ndarray) -> np.ndarray:
    """A prompt as an int64 array (token ids as they are; anything else by its hash)."""
    if isinstance(seq, np.ndarray):
        return seq if seq.dtype == np.int64 else seq.astype(np.int64)
    try:
        return np.array(seq, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):  # block content hashes, strings...
        return np.fromiter(map(hash, seq), np.int64, len(seq))


def _kept(prompt: Sequence[Hashable]) -> Sequence[Hashable] | np.ndarray:
    """A copy of a prompt that the garbage collector does not track: token ids packed in one C call
    into an int64 array (~6 µs for 600 tokens, vs ~15 µs for np.array); anything else as a tuple."""
    try:
        return np.frombuffer(struct.pack(f"{len(prompt)}q", *prompt), dtype=np.int64)
    except (struct.error, TypeError):
        return tuple(prompt)


def common_prefix_len(a: Sequence[Hashable] | np.ndarray, b: Sequence[Hashable] | np.ndarray,
                      i: int = 0, j: int = 0) -> int:
    """Length of the common run of a[i:] and b[j:]."""
    x, y = as_tokens(a), as_tokens(b)
    n = max(min(len(x) - i, len(y) - j), 0)
    differ = np.flatnonzero(x[i:i + n] != y[j:j + n])
    return int(differ[0]) if len(differ) else n


def _square(m: np.uint64) -> np.uint64:
    return np.uint64(int(m) * int(m) % 2**64)  # wrapping, without numpy's scalar-overflow warning


def _window_hashes(x: np.ndarray, window: int) -> np.ndarray:
    """A 64-bit polynomial hash of every `window`-token run of x (wrapping arithmetic): h[k]
    depends on x[k:k + window] only, so the hashes of a tail are a slice of the whole prompt's."""
    h, mul, width = x.view(np.uint64), _MUL, 1
    while width * 2 <= window:  # doubling: log2(window) passes instead of window
        h = h[:-width] * mul + h[width:]
        mul, width = _square(mul), width * 2
    if width < window:
        u = x.view(np.uint64)
        h = h[:len(h) - (window - width)].copy()
        for k in range(width, window):
            h *= _MUL
            h += u[k:k + len(h)]
    return h


class Divergence(msgspec.Struct, frozen=True):
    position: int           # first differing token of the new prompt vs the previous one
    reused_tokens: int      # = position: what the prefix cache can serve
    lost_tokens: int        # tokens after the divergence that repeat content of the previous prompt
    kind: Literal["none", "volatile_span", "reordered", "edited"]
    prev_len: int
    cur_len: int

    @property
    def is_break(self) -> bool:
        return self.kind in ("volatile_span", "reordered")


def diagnose(prev: Sequence[Hashable] | np.ndarray, cur: Sequence[Hashable] | np.ndarray,
             window: int = WINDOW, min_lost: int = MIN_LOST_TOKENS) -> Divergence:
    """Compare a prompt with the previous prompt of the same session. O(len log len) time, vectorised.

    volatile_span: content realigns shortly after the divergence at the same place (timestamp,
    request id, random nonce in the prefix). reordered: the repeated content shows up at other
    offsets (tool/document order changed). edited: little repeated content — a real change."""
    return _diagnose(as_tokens(prev), as_tokens(cur), window, min_lost, None)[0]


def _diagnose(prev: np.ndarray, cur: np.ndarray, window: int, min_lost: int,
              prev_hashes: np.ndarray | None) -> tuple[Divergence, np.ndarray | None]:
    p = common_prefix_len(prev, cur)
    if p >= len(prev):
        return Divergence(p, p, 0, "none", len(prev), len(cur)), None
    # Windows of the old tail that also occur in the new tail, found with vectorised window hashes;
    # then a greedy walk over those candidates only, each verified on the tokens.
    lost = 0
    shifts: list[int] = []
    cand: list[int] = []
    firsts: list[int] = []
    cur_hashes = None
    if len(prev) - p >= window and len(cur) - p >= window:
        cur_hashes = _window_hashes(cur, window)
        hp = (_window_hashes(prev, window) if prev_hashes is None else prev_hashes)[p:]
        uniq, first = np.unique(cur_hashes[p:], return_index=True)  # earliest offset of each window
        at = np.minimum(np.searchsorted(uniq, hp), len(uniq) - 1)
        hit = np.flatnonzero(uniq[at] == hp)
        cand, firsts = (hit + p).tolist(), (first[at[hit]] + p).tolist()
    i = p
    for a, j in zip(cand, firsts):
        if a < i:
            continue
        k = common_prefix_len(prev, cur, a, j)
        if k < window:  # a hash collision
            continue
        shifts.append(j - a)
        lost += k
        i = a + k
    if lost < min_lost:
        kind: Literal["none", "volatile_span", "reordered", "edited"] = "edited"
    elif len(set(shifts)) <= 2 and all(abs(s) <= 64 for s in shifts):
        kind = "volatile_span"  # one realignment near the break: a changed span of similar length
    else:
        kind = "reordered"
    return Divergence(p, p, lost, kind, len(prev), len(cur)), cur_hashes


class KeyCacheReport(msgspec.Struct):
    key_id: str
    requests: int = 0               # prompts compared with a previous prompt of their session
    breaks: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    lost_tokens: int = 0            # tokens recomputed although their content was seen just before
    volatile_span_breaks: int = 0
    reordered_breaks: int = 0
    median_break_position: int | None = None
    break_positions: list[int] = msgspec.field(default_factory=list)  # most recent, bounded
    advice: str = ""


def _advice(r: KeyCacheReport) -> str:
    if not r.breaks:
        return "prompts are prefix-stable"
    if r.volatile_span_breaks >= r.reordered_breaks:
        return (f"a value changes near token {r.median_break_position} on every request (timestamp, "
                "id or nonce in the system prompt?): move volatile content to the end of the prompt")
    return (f"content is reordered near token {r.median_break_position} (tools or documents in a "
            "different order?): serialize them in a stable order")


class CacheAdvisor:
    """Bounded in-memory tracker: last prompt per (key, session) in an LRU, counters per key."""

    def __init__(self, max_sessions: int = 10_000, max_tokens: int = 16_384,
                 max_keys: int = 10_000, keep_positions: int = 64) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens   # only the head of long prompts is kept: breaks sit early
        self.max_keys = max_keys
        self.keep_positions = keep_positions
        # (key, session) -> (head of the last prompt, as given or as an array; its window hashes when
        # they were computed)
        self._last: OrderedDict[tuple[str, str],
                                tuple[Sequence[Hashable] | np.ndarray, np.ndarray | None]] = OrderedDict()
        self._reports: OrderedDict[str, KeyCacheReport] = OrderedDict()

    def observe(self, key_id: str, session_id: str | None,
                prompt: Sequence[Hashable] | np.ndarray | bytes) -> Divergence | None:
        """Feed one request's prompt; returns the diagnosis against the session's previous prompt.
        `prompt`: token ids, an array of them, or the ids packed as little-endian int32s
        (cache.blocks.pack_tokens: the gateway packs each prompt once, for block hashing too)."""
        # Packed, not a tuple, until the session sends another prompt (most sessions are one request):
        # the collector walked every int of every kept tuple once before it stopped tracking it, so
        # 10,000 kept 600-token prompts made young-generation passes of ~100 ms (the gateway's p99).
        if isinstance(prompt, bytes):  # a view of the caller's bytes, widened only if compared
            prompt = np.frombuffer(prompt, dtype="<i4")
        head: Sequence[Hashable] | np.ndarray
        if isinstance(prompt, np.ndarray):  # a long prompt's head is copied: a view would keep it all
            head = prompt if len(prompt) <= self.max_tokens else prompt[:self.max_tokens].copy()
        else:
            head = _kept(prompt[:self.max_tokens])
        sk = (key_id, session_id or "")
        prev = self._last.pop(sk, None)
        self._last[sk] = (head, None)
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        if prev is None:
            return None
        cur = as_tokens(head)
        d, hashes = _diagnose(as_tokens(prev[0]), cur, WINDOW, MIN_LOST_TOKENS, prev[1])
        if sk in self._last:  # the next prompt of the session reuses the array and its hashes
            self._last[sk] = (cur, hashes)
        r = self._reports.pop(key_id, None) or KeyCacheReport(key_id=key_id)
        self._reports[key_id] = r
        if len(self._reports) > self.max_keys:
            self._reports.popitem(last=False)
        r.requests += 1
        r.prompt_tokens += len(prompt)
        r.reused_tokens += d.reused_tokens
        if d.is_break:
            r.breaks += 1
            r.lost_tokens += d.lost_tokens
            r.volatile_span_breaks += d.kind == "volatile_span"
            r.reordered_breaks += d.kind == "reordered"
            r.break_positions.append(d.position)
            del r.break_positions[:-self.keep_positions]
        return d

    def report(self, key_id: str) -> KeyCacheReport:
        r = self._reports.get(key_id) or KeyCacheReport(key_id=key_id)
        return self._finish(r)

    def reports(self) -> list[KeyCacheReport]:
        """All keys, worst (most tokens lost) first."""
        return sorted((self._finish(r) for r in self._reports.values()), key=lambda r: -r.lost_tokens)

    def _finish(self, r: KeyCacheReport) -> KeyCacheReport:
        pos = sorted(r.break_positions)
        r = msgspec.structs.replace(r, break_positions=list(r.break_positions),
                                    median_break_position=pos[len(pos) // 2] if pos else None)
        return msgspec.structs.replace(r, advice=_advice(r))
