"""Cache-friendliness advisor: finds clients whose prompts break the prefix cache.

Prefix caching only reuses a prompt's longest common prefix with earlier prompts. A timestamp in
the system prompt or tools serialized in a different order make consecutive prompts of a session
diverge early even though most of their content repeats, so everything after the divergence is
recomputed and billed at the uncached price. For consecutive prompts of one key/session we find
the first divergence and count how many tokens after it reappear in the new prompt anyway:
those are the tokens lost to the break.

Works on token ids, or on per-block *content* hashes (not vLLM's chained block hashes: with those
everything after the first differing block differs, so realignment cannot be seen).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Literal

import msgspec

WINDOW = 8           # tokens that must match to count as realigned content
MIN_LOST_TOKENS = 32  # smaller losses are ordinary edits, not cache breaks


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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


def diagnose(prev: Sequence[Hashable], cur: Sequence[Hashable], window: int = WINDOW,
             min_lost: int = MIN_LOST_TOKENS) -> Divergence:
    """Compare a prompt with the previous prompt of the same session. O(len) time.

    volatile_span: content realigns shortly after the divergence at the same place (timestamp,
    request id, random nonce in the prefix). reordered: the repeated content shows up at other
    offsets (tool/document order changed). edited: little repeated content — a real change."""
    p = common_prefix_len(prev, cur)
    if p >= len(prev):
        return Divergence(p, p, 0, "none", len(prev), len(cur))
    # Index every window of the new prompt's tail, then walk the old tail greedily.
    starts: dict[tuple, int] = {}
    for j in range(p, len(cur) - window + 1):
        starts.setdefault(tuple(cur[j:j + window]), j)
    lost = 0
    shifts: list[int] = []
    i = p
    while i <= len(prev) - window:
        j = starts.get(tuple(prev[i:i + window]))
        if j is None:
            i += 1
            continue
        k = window
        while i + k < len(prev) and j + k < len(cur) and prev[i + k] == cur[j + k]:
            k += 1
        shifts.append(j - i)
        lost += k
        i += k
    if lost < min_lost:
        kind: Literal["none", "volatile_span", "reordered", "edited"] = "edited"
    elif len(set(shifts)) <= 2 and all(abs(s) <= 64 for s in shifts):
        kind = "volatile_span"  # one realignment near the break: a changed span of similar length
    else:
        kind = "reordered"
    return Divergence(p, p, lost, kind, len(prev), len(cur))


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
        self._last: OrderedDict[tuple[str, str], tuple] = OrderedDict()
        self._reports: OrderedDict[str, KeyCacheReport] = OrderedDict()

    def observe(self, key_id: str, session_id: str | None, prompt: Sequence[Hashable]) -> Divergence | None:
        """Feed one request's prompt; returns the diagnosis against the session's previous prompt."""
        head = tuple(prompt[:self.max_tokens])
        sk = (key_id, session_id or "")
        prev = self._last.pop(sk, None)
        self._last[sk] = head
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        if prev is None:
            return None
        d = diagnose(prev, head)
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
