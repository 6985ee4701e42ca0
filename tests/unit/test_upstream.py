"""The engine client against a scripted raw HTTP server on loopback."""

import asyncio
import time

import pytest

from llmgw_router.upstream import Pool, UpstreamError

HEAD = b"POST /v1/completions HTTP/1.1\r\n"


class Server:
    """Answers each request with the next item of `replies`: bytes, a list of bytes written
    one by one (None in it: close the connection there), or None to close the connection
    without answering."""

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
                    if part is None:
                        return
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


async def until(cond, timeout: float = 5.0):
    """Wait (in the loop) for `cond()` to hold; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_interim_answers_are_passed_over_for_the_real_one():
    async def main():
        reply = (
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nX-Real: yes\r\n\r\nok"
        )
        async with Server([reply]) as srv:
            resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
            assert (resp.status, resp.headers.get("x-real"), await resp.read()) == (
                201,
                "yes",
                b"ok",
            )
            resp.release()

    run(main())


def test_a_204_with_a_content_length_has_no_body_and_the_next_answer_is_read_whole():
    """RFC 9110: 204 and 304 carry no body. Taking the Content-Length at its word made the
    next answer on the kept-alive connection the 204's body."""

    async def main():
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsecond!"
        replies = [b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n", ok]
        async with Server(replies) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"")
            assert resp.status == 204 and await resp.read() == b""
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")
            assert resp.status == 200 and await resp.read() == b"second!"
            resp.release()
        assert srv.connections == 1

    run(main())


def test_a_body_without_length_runs_to_the_close_and_the_connection_is_not_reused():
    async def main():
        reply = [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nfirst ", b"second", None]
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        async with Server([reply, ok]) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"first second"
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"ok"
            resp.release()
        assert srv.connections == 2

    run(main())


def test_chunked_trailers_are_read_past_and_the_connection_kept():
    async def main():
        chunked = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\n\r\n"
        )
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"
        async with Server([chunked, ok]) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"ok" and "x-t" not in resp.headers
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"next"
            resp.release()
        assert srv.connections == 1

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        # The hand-written parser took some meaning from each of these but the last.
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nnot a header\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        [b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * 40000, b"x" * 40000, b"\r\n\r\n"],
    ],
    ids=[
        "length-and-chunked",
        "two-lengths",
        "negative-length",
        "no-colon",
        "upgrade",
        "head-too-large",
    ],  # fmt: skip
)
def test_a_response_that_breaks_http_framing_is_a_protocol_error(reply):
    async def main():
        async with Server([reply]) as srv:
            with pytest.raises(UpstreamError) as err:
                resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
                await resp.read()
        assert err.value.kind == "protocol"

    run(main())


def test_a_bad_chunk_mid_body_fails_after_the_good_ones_are_handed_on():
    async def main():
        reply = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", b"-5\r\n"]
        async with Server([reply]) as srv:
            resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
            assert await resp.next() == b"hello"
            with pytest.raises(UpstreamError) as err:
                await resp.next()
            resp.release()
        assert err.value.kind == "protocol"

    run(main())


def test_bytes_after_an_answer_are_never_taken_as_the_next_answer():
    """An engine that writes more than it was asked for: the hand-written parser kept
    the extra bytes and gave them to the next request as its answer."""

    async def main():
        stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale"
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        mine = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nmine"
        async with Server([ok + stray, mine, [ok, stray], [ok, stray], mine]) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"")  # the extra in the same read
            assert await resp.read() == b"ok"
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"mine"
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")  # the extra before release()
            assert await resp.read() == b"ok"
            await until(lambda: not resp.conn.reusable())
            resp.release()
            resp = await srv.pool.request(origin, HEAD, b"")  # the extra once it is idle
            assert await resp.read() == b"ok"
            resp.release()
            await until(lambda: origin.open == 0)
            resp = await srv.pool.request(origin, HEAD, b"")
            assert await resp.read() == b"mine"
            resp.release()
        assert srv.connections == 4

    run(main())


def test_reading_from_the_engine_pauses_while_a_megabyte_waits_for_the_caller():
    async def main():
        size = 3 << 20
        part = b"x" * (256 << 10)
        reply = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size] + [part] * 12
        async with Server([reply]) as srv:
            resp = await srv.pool.request(srv.pool.origin(srv.url), HEAD, b"")
            await until(lambda: resp.conn.paused)
            assert resp.conn.buffered < size
            assert len(await resp.read()) == size
            assert not resp.conn.paused
            resp.release()

    run(main())


def test_push_hands_each_read_to_the_sink_until_the_body_ends_or_the_sink_detaches():
    async def main():
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        reply = [head, b"1\r\na\r\n", b"1\r\nb\r\n2\r\ncd\r\n", b"1\r\ne\r\n0\r\n\r\n"]
        async with Server([reply, reply]) as srv:
            origin = srv.pool.origin(srv.url)
            resp = await srv.pool.request(origin, HEAD, b"")
            got = []
            await resp.push(got.append)
            # What one read brought (b, then cd) is handed on as one piece.
            assert b"".join(got) == b"abcde" and b"b" not in got and b"cd" not in got
            resp.release()

            resp = await srv.pool.request(origin, HEAD, b"")
            got = []

            def sink(piece):
                got.append(piece)
                resp.detach()

            await resp.push(sink)
            rest = await resp.read()
            assert len(got) == 1 and b"".join(got) + rest == b"abcde"
            resp.release()

    run(main())
