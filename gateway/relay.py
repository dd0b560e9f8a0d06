"""One stream on its way from an engine to a client, and its bill: the one billing rule for the
request pipeline (gateway/exchange.py), behind the proxy and the endpoint picker alike.

Events pass through as they arrive; only the event with the final usage is decoded, billed, and
rewritten with tier and cost (or dropped when the client did not ask for usage: the gateway asked
for it, to bill). A stream that ends without that event (the client left, the gateway stopped, the
engine failed) is billed for the output tokens it relayed. vLLM puts several tokens in one event
when its output falls behind the engine, so those are counted by tokenizing the relayed text, once,
when such a stream ends; the way there only keeps the relayed blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from .apis import Api
from yieldgate.pricing import Usage

from .context import RequestContext
from .sse import EVENT_END, EventSplitter, events

if TYPE_CHECKING:
    from yieldgate.cache import Tokenizer

    from .accounting import Accounting

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode


class StreamRelay:
    __slots__ = ("api", "ctx", "accounting", "want_usage", "tokenizer", "usage", "final", "_splitter", "_relayed")

    def __init__(self, api: Api, ctx: RequestContext, accounting: "Accounting", want_usage: bool,
                 tokenizer: "Tokenizer | None") -> None:
        self.api = api
        self.ctx = ctx
        self.accounting = accounting
        self.want_usage = want_usage
        self.tokenizer = tokenizer            # None: a cut stream is billed one token per content event
        self.usage: Usage | None = None       # the engine's final usage, once its event came
        self.final: dict[str, Any] | None = None   # that event, decoded
        self._splitter = EventSplitter()
        self._relayed: list[bytes] = []       # blocks sent on, kept for the bill of a cut stream

    def feed(self, data: bytes) -> bytes:
        """The complete events in `data` (and in what earlier calls held back), ready for the client."""
        api = self.api
        got = self._splitter.feed(data)
        if not got:
            return got
        if api.final_marker not in got:
            self._relayed.append(got)
            return got
        out = []
        for event in events(got):
            if api.is_final(event):
                rewritten = self._final_event(event)
                if rewritten:
                    out.append(rewritten)
            else:
                event += EVENT_END
                self._relayed.append(event)
                out.append(event)
        return b"".join(out)

    def close(self) -> bytes:
        """The engine ended the stream: bill it, and return the bytes still to send. Without a final
        usage (vLLM ends a failed generation with an error event and [DONE]) it is billed as an
        upstream error, on what was relayed."""
        rest = self._splitter.rest()
        self.end("ok" if self.usage is not None else "upstream_error")
        return rest

    def end(self, status: str) -> None:
        """Bill the stream if nothing has yet (once, however it ended)."""
        if self.ctx.finished:
            return
        if self.usage is None:
            self.ctx.relayed_tokens = self.relayed_tokens()
        self.accounting.finish(self.ctx, self.usage, status)

    def relayed_tokens(self) -> int:
        """The output tokens relayed: the relayed text tokenized, and never fewer than the content
        events (each carries a token or more; the text of adjacent tokens can tokenize as one)."""
        texts, content_events = self.api.generated(b"".join(self._relayed))
        if self.tokenizer is None:
            return content_events
        return max(content_events, sum(map(self._count, texts)))

    def _count(self, text: str) -> int:
        # U+FFFD stands for a generated token the engine could not decode into a character (a byte
        # of an unfinished UTF-8 sequence): one token, not the two or three its own bytes make.
        replaced = text.count("\ufffd")
        return self.tokenizer.count(text.replace("\ufffd", "") if replaced else text) + replaced

    def _final_event(self, event: bytes) -> bytes | None:
        """Bill the final usage; the event rewritten with tier and cost, or None to drop it."""
        at = event.index(b"data: ") + 6
        chunk = self.final = _decode(event[at:])
        usage = self.usage = self.api.final_usage(chunk)
        extra = self.accounting.finish(self.ctx, usage, "ok")
        if not self.want_usage:
            return None
        self.api.decorate_final(chunk, self.ctx, usage, extra)
        return event[:at] + _encode(chunk) + EVENT_END
