"""The engine client against a scripted raw HTTP server on loopback."""

import asyncio
import time

import pytest

from llmgw_router.upstream import Pool, UpstreamError

HEAD = b"POST /v1/completions HTTP/1.1\r\n"


class Server:
    """Answers each request with the next item of `replies`: bytes, a list of bytes written
    one by one, or None to close the connection without answering."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.connections = 0
        self.requests = []
        self.writers = []

    async def handle(self, reader, writer):
        self.connections += 1
        self.writers.append(writer)
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    break
                for part in reply if isinstance(reply, list) else [reply]:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.01)  # let the parts arrive as separate reads
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.pool = Pool()
        return self

    async def __aexit__(self, *exc):
        self.pool.close()
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()
        await asyncio.sleep(0)  # let the transports finish closing


def run(coro):
    return asyncio.run(coro)


def test_a_content_length_body_is_read_and_the_connection_reused():
    async def main():
        body = b'{"ok": true}'
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        async with Server([reply, reply]) as srv:
            for _ in range(2):
                resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"{}")
                assert resp.status == 200 and await resp.read() == body
                resp.release()
        assert srv.connections == 1
        assert srv.requests[0].endswith(b"Content-Length: 2\r\n\r\n{}")

    run(main())


def test_a_body_that_has_all_come_is_taken_whole_and_one_still_coming_is_not():
    async def main():
        body = b'{"ok": true}'
        whole = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        split = [whole[:-4], whole[-4:]]  # the body's end comes in a later read
        async with Server([whole, split, whole]) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"{}")
            deadline = time.monotonic() + 5
            while (got := resp.whole()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # the head may come a read before the body
            assert got == body
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"{}")
            assert resp.whole() is None  # part of the body is still on its way
            assert await resp.read() == body
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"{}")  # the same connection, reused
            assert await resp.read() == body
            resp.release()
        assert srv.connections == 1

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece_even_when_split_across_reads():
    async def main():
        reply = [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
            b"lo\r\n6\r\n world\r",
            b"\n0\r\n\r\n",
        ]
        async with Server([reply]) as srv:
            resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
            pieces = []
            while (piece := await resp.next()) is not None:
                pieces.append(piece)
            resp.release()
        assert b"".join(pieces) == b"hello world"
        assert len(pieces) >= 2

    run(main())


def test_a_refused_connection_is_a_connect_error():
    async def main():
        async with Server([]) as srv:
            url = srv.url
        pool = Pool()
        with pytest.raises(UpstreamError) as err:
            await pool.request(pool.origin(url), HEAD, b"")
        assert err.value.kind == "connect"

    run(main())


def test_an_engine_that_closes_mid_body_is_reported_not_silently_truncated():
    async def main():
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
        async with Server([reply]) as srv:
            resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
            with pytest.raises(UpstreamError, match="mid-response"):
                await resp.read()
            resp.release()

    run(main())


def test_a_kept_alive_connection_the_engine_closed_is_replaced_transparently():
    async def main():
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        async with Server([ok, None, ok]) as srv:
            for _ in range(2):
                resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
                assert await resp.read() == b"ok"
                resp.release()
        # The engine dropped the kept-alive connection on the second request unanswered.
        assert srv.connections == 2

    run(main())


def test_an_engine_slower_than_the_deadline_times_out():
    async def main():
        async with Server([[b"HTTP/1.1 200 OK\r\n"] + [b""] * 100]) as srv:
            srv.pool.total_timeout = 0.2
            with pytest.raises(UpstreamError) as err:
                await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
        assert err.value.kind == "timeout"

    run(main())


def test_garbage_instead_of_http_is_a_protocol_error():
    async def main():
        async with Server([b"SSH-2.0-OpenSSH\r\n\r\n"]) as srv:
            with pytest.raises(UpstreamError) as err:
                await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
        assert err.value.kind == "protocol"

    run(main())


def test_an_origin_that_left_the_routing_table_is_forgotten_and_its_connections_closed():
    async def main():
        body = b"{}"
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + body
        async with Server([reply, reply, reply]) as srv:
            pool = srv.pool
            busy = await pool.request(pool.origin(srv.url), HEAD, b"{}")
            idle = await pool.request(pool.origin(srv.url), HEAD, b"{}")  # a second one
            await idle.read()
            idle.release()  # kept alive, idle
            assert srv.connections == 2 and pool.origin(srv.url).idle
            pool.retain(["http://127.0.0.1:1"])  # a table without this engine
            assert srv.url not in pool._origins
            assert idle.conn.transport is None  # the idle one closed at once
            await busy.read()
            busy.release()  # the one answering closes when its answer ends...
            assert busy.conn.transport is None
            # ...and an engine that comes back gets a fresh origin.
            again = await pool.request(pool.origin(srv.url), HEAD, b"{}")
            assert await again.read() == body
            again.release()
            assert srv.connections == 3
            pool.retain([srv.url])
            assert pool.origin(srv.url).idle  # an origin that stays keeps its connections

    run(main())


def test_past_max_conns_requests_wait_for_a_connection_to_come_free():
    """Six requests at once over at most two connections: none fails, the engine sees
    two connections, and a connection lost gives its place to the next waiting."""

    async def main():
        body = b'{"ok": true}'
        reply = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body]
        async with Server([reply] * 6 + [None, None, reply]) as srv:
            srv.pool.max_conns = 2
            origin = srv.pool.origin(srv.url)

            async def one():
                resp = await srv.pool.request(origin, HEAD, b"{}")
                got = await resp.read()
                resp.release()
                return resp.status, got

            assert await asyncio.gather(*(one() for _ in range(6))) == [(200, body)] * 6
            assert srv.connections == 2
            assert origin.open == 2 and not origin.waiters
            # The engine closes both kept-alive connections unanswered: their places
            # come back, so the retry opens a third rather than waiting for ever.
            assert await asyncio.wait_for(one(), 5) == (200, body)
            assert srv.connections == 3 and origin.open == 1

    run(main())
