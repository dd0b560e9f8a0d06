"""Streams read by a process of their own while a test acts on the server.

A drain drill times what the gateway does after a signal while streams of hundreds of events a
second run through it. Reading them in a child process keeps that reading off the test process,
whose own steps (probes, requests, signals) are what the drill times; the child says on stdout
when each stream starts and ends and how many events it has received.

    with StreamReader(url + "/v1/chat/completions", bodies) as streams:
        streams.wait_started(60)
        ... act on the server ...
        results = streams.results(120)    # one StreamResult per body, in order
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class StreamResult:
    """One streamed response as the client saw it."""

    request_id: str = ""
    gateway: str = ""
    events: list[dict] = field(default_factory=list)
    done: bool = False           # ended with data: [DONE]
    error: str = ""              # an error event's message, or the client's exception

    @property
    def usage(self) -> dict | None:
        """The final usage (its event has no choices)."""
        return next((e["usage"] for e in self.events if e.get("usage") and not e.get("choices")), None)

    @property
    def token_events(self) -> int:
        """Events carrying generated tokens: all but the role event and the usage event."""
        return sum(1 for e in self.events if e.get("choices") and "role" not in e["choices"][0].get("delta", {}))

    @property
    def text(self) -> str:
        return "".join(_piece(e["choices"][0]) for e in self.events if e.get("choices"))

    @property
    def engine_tokens(self) -> int:
        """The engine's own count of the tokens in the events received (continuous usage stats)."""
        return max((e["usage"]["completion_tokens"] for e in self.events if e.get("choices") and e.get("usage")),
                   default=0)


def _piece(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


class StreamReader:
    """POST each body to `url` as a stream, all at once, from a child process."""

    def __init__(self, url: str, bodies: list[dict], timeout_s: float = 300.0):
        self.n = len(bodies)
        self._dir = tempfile.TemporaryDirectory(prefix="yg-streams-")
        spec = Path(self._dir.name) / "spec.json"
        self._out = Path(self._dir.name) / "out.json"
        spec.write_text(json.dumps({"url": url, "bodies": bodies, "timeout_s": timeout_s}))
        self.process = subprocess.Popen([sys.executable, __file__, str(spec), str(self._out)],
                                        stdout=subprocess.PIPE, text=True)
        self.started = [threading.Event() for _ in bodies]
        self.ended = [threading.Event() for _ in bodies]
        self.events = [0] * self.n      # events received so far, in steps of PROGRESS
        self._watch = threading.Thread(target=self._follow, daemon=True)
        self._watch.start()

    def _follow(self) -> None:
        for line in self.process.stdout:
            what, i, *count = line.split()
            if what in ("started", "ended"):
                (self.started if what == "started" else self.ended)[int(i)].set()
            elif what == "events":
                self.events[int(i)] = int(count[0])

    def __enter__(self) -> "StreamReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the child if it still runs (a test that failed midway)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._dir.cleanup()

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, event in enumerate(self.started):
            assert event.wait(max(0.0, deadline - time.monotonic())), f"stream {i} never started"

    def any_ended(self) -> bool:
        return any(e.is_set() for e in self.ended)

    def results(self, timeout_s: float) -> list[StreamResult]:
        """Wait for every stream to end; what each one received."""
        self.process.wait(timeout_s)
        self._watch.join(5)
        return [StreamResult(**r) for r in json.loads(self._out.read_text())]


# The child says how many events a stream has received every this many.
PROGRESS = 10


def sse_lines(r: httpx.Response):
    """Lines split on "\n" only: httpx's iter_lines also splits on U+2028 and friends, which the
    demo model's gibberish text carries unescaped inside JSON strings."""
    buffer = b""
    for chunk in r.iter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode()


# -- the child -----------------------------------------------------------------------------------------

def _read(url: str, body: dict, i: int, timeout_s: float, out: list[dict], say: threading.Lock) -> None:
    result: dict = {"request_id": "", "gateway": "", "events": [], "done": False, "error": ""}
    out[i] = result
    started = False

    def tell(what: str, *more: int) -> None:
        with say:
            print(what, i, *more, flush=True)

    try:
        with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
            result["request_id"] = r.headers.get("x-request-id", "")
            result["gateway"] = r.headers.get("x-yieldgate-gateway", "")
            if r.status_code != 200:
                result["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
            for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                if not started:
                    started = True
                    tell("started")
                if line == "data: [DONE]":
                    result["done"] = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result["error"] = event["error"]["message"]
                else:
                    result["events"].append(event)
                    if len(result["events"]) % PROGRESS == 0:
                        tell("events", len(result["events"]))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if not started:
            tell("started")
        tell("ended")


def _child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out: list[dict] = [{} for _ in spec["bodies"]]
    say = threading.Lock()
    threads = [threading.Thread(target=_read, args=(spec["url"], body, i, spec["timeout_s"], out, say))
               for i, body in enumerate(spec["bodies"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
