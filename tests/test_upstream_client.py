"""serving.upstream: the gateway's pooled HTTP/1.1 client for engines, against small raw servers
that answer the way uvicorn does (content-length or chunked) or misbehave on purpose."""

from __future__ import annotations

import asyncio

import pytest

from yieldgate.serving.upstream import Endpoint, UpstreamConnectError, UpstreamConnectionError, UpstreamPool


class Server:
    """A raw TCP server whose handler writes whatever the test scripts, per request."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    def endpoint(self, path: str = "/v1/completions") -> Endpoint:
        return Endpoint.parse(f"http://127.0.0.1:{self.port}{path}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.handler(writer, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _fixed(writer, body) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))
    return True


async def test_unary_answers_reuse_one_connection():
    async with Server(_fixed) as server:
        pool = UpstreamPool()
        for i in range(5):
            resp = await pool.post(server.endpoint(), b'{"n":%d}' % i, b"x-request-id: r%d\r\n" % i)
            assert resp.status == 200
            assert await resp.read() == b'{"n":%d}' % i
            resp.release()
        assert server.connections == 1 and pool.opened == 1 and pool.in_use == 0
        head = server.requests[0].split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"post /v1/completions http/1.1")
        assert b"x-request-id: r0" in head and b"content-type: application/json" in head
        await pool.close()


async def test_chunked_stream_arrives_piece_by_piece():
    handed_on: asyncio.Queue[None] = asyncio.Queue()

    async def paced(writer, body) -> bool:
        # Each chunk goes out only once the client has handed on the previous one: a client that
        # buffered to the end of the body would never see the next (the wait times out, we hang up).
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.wait_for(handed_on.get(), 5)
        writer.write(b"0\r\n\r\n")
        return True

    async def pieces_of(resp) -> list[bytes]:
        pieces = []
        async for piece in resp.iter_chunks():
            pieces.append(piece)
            handed_on.put_nowait(None)
        return pieces

    async with Server(paced) as server:
        pool = UpstreamPool()
        resp = await pool.post(server.endpoint(), b"{}")
        assert await pieces_of(resp) == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        resp.release()
        resp = await pool.post(server.endpoint(), b"{}")  # the finished stream's connection is reused
        assert b"".join(await pieces_of(resp)) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        resp.release()
        assert server.connections == 1
        await pool.close()


async def test_close_mid_body_is_a_connection_error_and_not_pooled():
    async def dies(writer, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n")
        await writer.drain()
        return False  # the server closes the connection mid-answer

    async with Server(dies) as server:
        pool = UpstreamPool()
        resp = await pool.post(server.endpoint(), b"{}")
        with pytest.raises(UpstreamConnectionError):
            async for _ in resp.iter_chunks():
                pass
        resp.release()
        assert pool.open == 0


async def test_connection_closed_before_answer_is_retryable_error():
    async def hangs_up(writer, body) -> bool:
        return False

    async with Server(hangs_up) as server:
        pool = UpstreamPool()
        with pytest.raises(UpstreamConnectionError):
            await pool.post(server.endpoint(), b"{}")
        assert pool.open == 0
        assert len(server.requests) == 1  # a new connection's close is the server's answer: not re-sent


async def test_a_kept_alive_connection_closed_under_a_request_is_retried_on_a_new_one():
    """uvicorn closes a connection idle past its keep-alive timeout; when its loop was busy the
    close can come after our next request went out on it. Nothing was answered (the app never saw
    the request), so the pool sends it again on a new connection, once."""
    served: dict[int, int] = {}

    async def idles_out(writer, body) -> bool:
        n = served[id(writer)] = served.get(id(writer), 0) + 1
        if n == 2:
            return False  # the keep-alive timer's close: no answer
        return await _fixed(writer, body)

    async with Server(idles_out) as server:
        pool = UpstreamPool()
        for i in range(3):
            resp = await pool.post(server.endpoint(), b'{"n":%d}' % i)
            assert resp.status == 200 and await resp.read() == b'{"n":%d}' % i
            resp.release()
        # Every connection's second request meets the close: each is sent twice, once per connection.
        assert server.connections == 3 and pool.stale_retries == 2
        assert [r.split(b"\r\n\r\n")[1] for r in server.requests] == [
            b'{"n":0}', b'{"n":1}', b'{"n":1}', b'{"n":2}', b'{"n":2}']
        await pool.close()


async def test_an_answer_cut_after_it_began_is_not_sent_again():
    served: dict[int, int] = {}

    async def cuts(writer, body) -> bool:
        n = served[id(writer)] = served.get(id(writer), 0) + 1
        if n == 2:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-")  # the answer began: the engine saw the request
            await writer.drain()
            return False
        return await _fixed(writer, body)

    async with Server(cuts) as server:
        pool = UpstreamPool()
        resp = await pool.post(server.endpoint(), b"{}")
        await resp.read()
        resp.release()
        with pytest.raises(UpstreamConnectionError):
            await pool.post(server.endpoint(), b"{}")
        assert len(server.requests) == 2 and pool.stale_retries == 0
        await pool.close()


async def test_nothing_listening_is_a_connect_error():
    pool = UpstreamPool(connect_timeout_s=2)
    async with Server(_fixed) as server:
        endpoint = server.endpoint()
    with pytest.raises(UpstreamConnectError):
        await pool.post(endpoint, b"{}")


async def test_read_timeout():
    async def silent(writer, body) -> bool:
        await asyncio.sleep(2)
        return False

    async with Server(silent) as server:
        pool = UpstreamPool(read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await pool.post(server.endpoint(), b"{}")
        await pool.close()


async def test_idle_connections_expire_before_the_engines_keepalive():
    async with Server(_fixed) as server:
        pool = UpstreamPool(keepalive_s=0.1)
        for _ in range(2):
            resp = await pool.post(server.endpoint(), b"{}")
            await resp.read()
            resp.release()
            await asyncio.sleep(0.2)
        assert server.connections == 2  # the idle one was dropped, not reused
        await pool.close()


async def test_slow_reader_pauses_the_connection():
    big = b"x" * (1 << 20)

    async def floods(writer, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()
        return True

    async with Server(floods) as server:
        pool = UpstreamPool()
        resp = await pool.post(server.endpoint(), b"{}")
        chunks = resp.iter_chunks()
        first = await chunks.__anext__()
        await asyncio.sleep(0.2)  # the consumer stalls: reading stops past 64 KB (+ one socket read)
        assert resp._buffered <= (1 << 16) + (256 << 10) < len(big)
        rest = [c async for c in chunks]
        assert len(first) + sum(map(len, rest)) == len(big)
        resp.release()
        await pool.close()
