"""The gateway's HTTP/1.1 client for engines: pooled keep-alive connections, one asyncio Protocol
and an httptools parser per connection.

The request path needs little of a general HTTP client: POST a JSON body, read the status, then
either the whole body or its pieces as they arrive, with the connection going back to the pool
when the answer is complete. aiohttp's client machinery was about a quarter of the gateway's sampled
CPU in a py-spy profile at 400 RPS; this sends a request with one `transport.write` and allocates
little beyond the response object.

    pool = UpstreamPool(connect_timeout_s=5, read_timeout_s=300)
    resp = await pool.post(Endpoint.parse("http://127.0.0.1:8101/v1/completions"), body)
    data = await resp.read()          # or: async for piece in resp.iter_chunks(): ...
    resp.release()                    # keep-alive if complete, else the connection is closed

Errors are `UpstreamConnectionError` (connect refused / reset / closed mid-answer; the subclass
`UpstreamConnectError` means nothing listens) and `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

import httptools

log = logging.getLogger(__name__)

# vLLM's uvicorn closes idle keep-alive connections 5 s after it sent the last answer; drop ours
# well before that (our clock starts when we have read the answer, later than the engine's when our
# loop is busy), so a request rarely lands on a connection the engine is closing. When one does
# anyway, `post` sends it again on a new connection.
KEEPALIVE_S = 2.0
# Body bytes buffered per connection before reading pauses: a slow client slows the engine's
# socket instead of growing the gateway's memory (aiohttp's default read limit).
_HIGH_WATER = 1 << 16


class UpstreamConnectionError(ConnectionError):
    """The connection failed or closed before the answer was complete."""


class UpstreamConnectError(UpstreamConnectionError):
    """Could not connect: nothing listens there."""


class UpstreamAborted(UpstreamConnectionError):
    """The gateway ended the answer itself (`UpstreamResponse.abort`): no fault of the replica."""


class Endpoint:
    """A parsed upstream URL: where to connect and the bytes of the request line and Host header."""

    __slots__ = ("host", "port", "ssl", "key", "head")

    def __init__(self, host: str, port: int, path: str, tls: bool) -> None:
        self.host, self.port = host, port
        self.ssl = tls
        self.key = (host, port, tls)
        host_header = host if port == (443 if tls else 80) else f"{host}:{port}"
        self.head = f"POST {path or '/'} HTTP/1.1\r\nhost: {host_header}\r\n".encode("latin-1")

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"unsupported upstream URL {url!r}")
        tls = u.scheme == "https"
        path = u.path + (f"?{u.query}" if u.query else "")
        return cls(u.hostname, u.port or (443 if tls else 80), path, tls)


class UpstreamResponse:
    """One answer: the status after the headers, then the body as it arrives."""

    __slots__ = ("status", "_conn", "_pieces", "_buffered", "_done", "_error", "_whole")

    def __init__(self, conn: "_Connection") -> None:
        self.status = 0
        self._conn: _Connection | None = conn
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False       # the whole body arrived
        self._error: BaseException | None = None
        self._whole = False      # read() wants the whole body: no flow control

    @property
    def complete(self) -> bool:
        return self._done

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self._done:
            await self._wait()
        data = b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (whatever arrived since the last step, joined)."""
        while True:
            if self._pieces:
                pieces = self._pieces
                data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                yield data
            elif self._done:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        conn = self._conn
        if conn is None:
            raise UpstreamConnectionError("response already released")
        await conn.wait()
        if self._error is not None and not self._pieces:
            raise self._error

    def release(self) -> None:
        """Done with this answer: back to the pool if it ended cleanly, else close the
        connection (an unfinished answer: the engine sees the close and aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reuse=self._done and self._error is None)

    close = release

    def abort(self, exc: UpstreamAborted) -> None:
        """End the answer from outside: the reader gets `exc` once the bytes already here are read,
        and the connection closes (the engine aborts the request)."""
        if self._conn is not None:
            self._conn._abort(exc)

    # -- fed by the connection -------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "endpoint", "transport", "parser", "response", "waiter", "timer",
                 "closed", "paused", "keep_alive", "idle_since", "_begun", "_headers_done",
                 "_framed", "_reusable")

    def __init__(self, pool: "UpstreamPool", endpoint: Endpoint) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.paused = False
        self.keep_alive = True
        self.idle_since = 0.0
        self._begun = False      # a byte of the answer arrived
        self._headers_done = False
        self._framed = False     # content-length or chunked: the end of the body is known
        self._reusable = True

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is out of step
            self._abort(UpstreamConnectionError("unexpected bytes from upstream"))
            return
        self._begun = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._abort(UpstreamConnectionError("upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._abort(UpstreamConnectionError(f"malformed upstream answer: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool._forget(self)
        resp = self.response
        if resp is not None and not resp._done:
            if self._headers_done and not self._framed:
                resp._done = True  # a body delimited by the connection's end
            elif resp._error is None:  # an abort's own reason stays (UpstreamAborted, a bad answer)
                resp._error = UpstreamConnectionError(
                    "upstream closed the connection" + (f": {exc}" if exc else ""))
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        resp = self.response
        if resp is not None:
            resp.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is None:
            return
        resp._feed(body)
        if resp._buffered > _HIGH_WATER and not resp._whole and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp._done = True
        self._wake()

    # -- used by the pool and the response ---------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None
        self.response = resp = UpstreamResponse(self)
        self._begun = self._headers_done = self._framed = False
        self.transport.write(head + body)
        return resp

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Until the parser has something new (headers, body bytes, the end) or the timeout."""
        if self.closed:
            return
        loop = self.pool.loop
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(self.pool.read_timeout_s, self._timeout, waiter)
        try:
            await waiter
        finally:
            timer.cancel()

    def _timeout(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError("upstream read timed out"))

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    def finish(self, reuse: bool) -> None:
        self.response = None
        self.waiter = None
        if self.paused:
            self.resume()
        if reuse and self.keep_alive and not self.closed:
            self.pool._put(self)
        else:
            self._abort(None)

    def _abort(self, exc: BaseException | None) -> None:
        resp = self.response
        if exc is not None and resp is not None and not resp._done:
            resp._error = exc
        if self.transport is not None:
            self.transport.close()  # connection_lost follows and forgets the connection
        self.closed = True
        self._wake()


class UpstreamPool:
    """Idle keep-alive connections per upstream (most recently used first), opened on demand and
    unbounded in number, like the aiohttp pool it replaced (limit=0)."""

    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0
        self.stale_retries = 0  # requests re-sent because a kept-alive connection was closed under them
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def start(self) -> None:
        """Bind to the running loop (the pool is then usable from it only)."""
        self._loop = asyncio.get_running_loop()

    @property
    def in_use(self) -> int:
        """Connections lent to a response right now."""
        return sum(1 for c in self._all if c.response is not None)

    @property
    def open(self) -> int:
        return len(self._all)

    async def post(self, endpoint: Endpoint, body: bytes, headers: bytes = b"") -> UpstreamResponse:
        """Send `body` (JSON) and wait for the answer's status line and headers. `headers` are
        extra raw header lines, each ending in CRLF."""
        head = b"%scontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
            endpoint.head, len(body), headers)
        conn = self._take(endpoint)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(endpoint)
        while True:
            resp = conn.send(head, body)
            try:
                while not conn._headers_done:
                    if resp._error is not None:
                        raise resp._error
                    if conn.closed:
                        raise UpstreamConnectionError("upstream closed the connection")
                    await conn.wait()
                return resp
            except UpstreamConnectionError as exc:
                resp.release()
                if not reused or conn._begun:
                    raise
                error = exc
            except BaseException:
                resp.release()
                raise
            # A kept-alive connection closed with not a byte of answer: the engine dropped it as
            # the request went out (uvicorn's idle timer, when our loop lagged; under heavy load
            # also seen on a connection idle 10 ms, cause unknown). Nothing was answered: send it
            # once more on a new connection, as HTTP clients do for requests on reused connections.
            self.stale_retries += 1
            log.info("re-sending a request to %s:%d on a new connection: a kept-alive one closed with no "
                     "answer %.2f s after it went idle (%s)", endpoint.host, endpoint.port,
                     time.monotonic() - conn.idle_since, error)
            reused = False
            conn = await self._connect(endpoint)

    def _take(self, endpoint: Endpoint) -> _Connection | None:
        idle = self._idle.get(endpoint.key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn._abort(None)
        return None

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        loop = self.loop
        tls = None
        if endpoint.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, endpoint),
                                                       endpoint.host, endpoint.port, ssl=tls)
        except TimeoutError:
            raise TimeoutError(f"connect to {endpoint.host}:{endpoint.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {endpoint.host}:{endpoint.port}: {exc}") from None
        self._all.add(conn)
        self.opened += 1
        return conn

    def _put(self, conn: _Connection) -> None:
        conn.idle_since = now = time.monotonic()
        idle = self._idle.setdefault(conn.endpoint.key, [])
        while idle and now - idle[0].idle_since >= self.keepalive_s:  # oldest first: expired
            idle.pop(0)._abort(None)
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.endpoint.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        for conn in list(self._all):
            conn._abort(None)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
