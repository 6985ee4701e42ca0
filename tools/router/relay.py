"""Writing one attempt's answer to the client: a whole answer, or a stream relayed event
by event as the engine sends it (pushed from the engine connection's callback once the
client has the stream's head), keepalives while the first token is awaited, and errors
in-band once the client has had anything. What the engine said it cost is the Meter's
(meter.py), its events the framer's (sse.py).

`Relay` is the part of a `Call` (call.py) that faces the client; the Call chooses the
endpoint, retries and translates, and hands the engine's response here."""

import asyncio
import json
import time

from llmgw_router import prefix, sse
from llmgw_router.api import OPENAI
from llmgw_router.exchange import Answer, Stream
from llmgw_router.splice import set_model
from llmgw_router.upstream import Response, UpstreamError


class Relay:
    """The client's side of a Call: its stream, keepalive, and the answer's shape. The
    Call sets every field; this part reads the route's Api, the prefix key (to say when
    the engine began answering) and the endpoint (to book a failure)."""

    __slots__ = (
        "request", "rid", "model", "stream", "client_usage", "headers", "t_first", "status",
        "meter", "overhead", "resp", "_keepalive", "_keepalive_task", "_waiting_first",
        "before_done", "_broke", "field", "translator", "translating", "_framer", "_reader",
        "on_answer", "route", "endpoint", "affinity", "keepalive_s", "_answered", "trace",
        "attempt",
    )  # fmt: skip

    def _upstream_failed(self, ep, err, kind: str) -> str:
        """Book an engine's failure (metrics, cooldown, a log line); the reason, said.
        The Call's, which knows the routing table."""
        raise NotImplementedError

    # -- relaying --------------------------------------------------------------------

    async def _relay_whole(self, upstream: Response) -> Answer | Stream | None:
        try:
            data = upstream.whole()
            if data is None:
                data = await upstream.read()
        except UpstreamError as e:
            return await self._engine_broke(e)
        if self._keepalive_task is not None:
            await self._settle()
        t = time.perf_counter()
        self.status = upstream.status
        if upstream.status == 200:
            self.meter.whole(data)
            if self.translating:
                data = self.translator.whole(data)
            else:
                data = set_model(data, self.field)
            data = self._final(data)
        elif self.resp is None:
            data = engine_error_body(upstream.status, data)
        if self.resp is not None:  # the stream was committed by a keepalive: say it in-band
            await self._write_error_event(error_message(data), upstream.status)
            return self.resp
        resp = Answer(
            upstream.status,
            data,
            {"Content-Type": upstream.headers.get("content-type", "application/json")},
        )
        self.overhead += time.perf_counter() - t
        return self._finish(resp)

    async def _relay_stream(self, upstream: Response) -> Answer | Stream | None:
        self.status = 200
        self._framer = sse.Framer()
        self._reader = self._stream_reader()
        key = self.affinity
        try:
            while (chunk := await upstream.next()) is not None:
                out = self._relay_piece(chunk)
                # Not at a prompt-progress event: the engine has not begun answering.
                if key is not None and not key.answered_at and (out or self.meter.progress is None):
                    prefix.answered(key, asyncio.get_running_loop().time())
                if out:
                    await self._write(out, last=self.meter.ended)
                if self.resp is not None and not self._waiting_first:
                    await self._push(upstream)
            out = self._relay_piece(b"", end=True)
            if out:
                await self._write(out, last=self.meter.ended)
        except UpstreamError as e:
            return await self._engine_broke(e)
        if not self.meter.ended:
            # An event cut off before its blank line is no event (as the standard says):
            # only a whole end event makes a stream complete.
            reason = self._upstream_failed(
                self.endpoint, "stream ended without its end event", kind="stream_interrupted"
            )
            if not self._answered:
                self._broke = reason
                return None
            self.status = 502
            await self._write_error_event("The engine ended the stream early.", 502)
            return self.resp
        await self.resp.write_eof()
        return self.resp

    def _stream_reader(self):
        """The reader of this attempt's stream: an OpenAI stream (chat, completions, or
        the chat stream a translation reads), or another API's own."""
        if self.translating:  # the translator needs chat's usage chunk
            return OPENAI.reader(self.meter, True)
        return self.route.api.reader(self.meter, self.client_usage)

    def _relay_piece(self, chunk: bytes, end: bool = False) -> bytes:
        """A piece of the engine's stream in (`end`: the stream's end); the whole events
        it completes out, as the client is to read them (the rest waits in the framer
        for the next piece)."""
        t = time.perf_counter()
        events = self._framer.close() if end else self._framer.feed(chunk)
        meter = self.meter
        if meter.progress is not None and events:
            events = meter.progress.take(events)
        if not events:
            return b""
        ended = meter.ended
        events = self._reader.read(events)
        if self.t_first is None and meter.events:
            self.t_first = t
            self._stop_keepalive()
        out = b""
        if events:
            if meter.ended and not ended:
                self._done()
                out = self._final(self._shape(events))
            else:
                out = self._shape(events)
        self.overhead += time.perf_counter() - t
        return out

    async def _push(self, upstream: Response) -> None:
        """Relay what follows from the engine connection's callback, each piece written
        to the client as it comes, with no task woken for it: a stream's chunks arrive
        one by one, and waking this task for each cost more CPU than relaying it. Back
        to the task when the stream ends or fails, or while the client is slow to read
        (the engine is then read no faster than the client reads). Only once the client
        has the stream's head and no keepalive can write alongside."""
        resp = self.resp
        push = getattr(resp, "push", None)  # the http1 transport's streams have it
        keepalive = self._keepalive_task
        if push is None or (keepalive is not None and not keepalive.done()):
            return
        self._answered = True  # what it pushes goes to the client unseen by _write
        failed = []

        def sink(piece: bytes) -> None:
            try:
                out = self._relay_piece(piece)
                # The piece with the end event ends the body in the same write.
                if out and not (push(out, last=True) if self.meter.ended else push(out)):
                    upstream.detach()
            except BaseException as e:  # noqa: BLE001 - raised again in the task
                failed.append(e)
                upstream.detach()

        await upstream.push(sink)
        if failed:
            raise failed[0]
        await resp.drain()

    def _shape(self, events: list[bytes]) -> bytes:
        """Events as the client's API says them, naming the served model."""
        if self.translator is not None:
            return self.translator.feed(events)
        return set_model(sse.join(events), self.field)

    def _final(self, data: bytes) -> bytes:
        """The whole answer, or a stream's last block, past the route's hook (the
        Responses API keeps it)."""
        hook = self.on_answer
        return (hook(data) or data) if hook is not None else data

    def _done(self) -> None:
        hook, self.before_done = self.before_done, None
        if hook is not None:
            hook()

    async def _engine_broke(self, err: UpstreamError) -> Answer | Stream | None:
        """The engine failed after it had started answering. Before anything reached the
        client, None: try another endpoint (an engine killed while it read a long prompt
        had sent its stream's headers, and the chaos suite saw that answered 502). After,
        too late: the client hears it."""
        reason = self._upstream_failed(self.endpoint, err, kind="stream_interrupted")
        if not self._answered:
            self._broke = reason
            return None
        self.status = 502
        await self._write_error_event(f"The engine failed mid-response: {err}", 502)
        return self.resp

    # -- writing to the client ---------------------------------------------------------

    async def _ensure_stream(self) -> Stream:
        if self.resp is None:
            headers = self._client_headers(
                {
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            self.resp = await self.request.open_stream(200, headers)
        return self.resp

    async def _write(self, data: bytes, last: bool = False) -> None:
        if self._keepalive_task is not None:
            await self._settle()
        resp = self.resp or await self._ensure_stream()
        self._answered = True
        await resp.write(data, last)

    async def _write_error_event(self, message: str, status: int) -> None:
        try:
            await self._write(self.route.api.error_event(message, status), last=True)
            await self.resp.write_eof()
        except ConnectionError:
            pass  # the client left too; the usage row still says what happened

    def _client_headers(self, extra: dict) -> dict:
        extra["x-request-id"] = self.rid
        extra["x-llmgw-served-model"] = self.model
        if self.headers:
            extra.update(self.headers)
        return extra

    def _finish(self, resp: Answer) -> Answer:
        resp.headers["x-request-id"] = self.rid
        resp.headers["x-llmgw-served-model"] = self.model
        if self.headers:
            resp.headers.update(self.headers)
        return resp

    # -- keepalive while waiting for the first token ----------------------------------

    def _arm_keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        self._keepalive = loop.call_later(self.keepalive_s, self._keepalive_due)

    def _keepalive_due(self) -> None:
        self._keepalive_task = asyncio.ensure_future(self._send_keepalive())

    async def _send_keepalive(self) -> None:
        try:
            resp = self.resp or await self._ensure_stream()
            await resp.write(sse.KEEPALIVE)
        except ConnectionError:
            return
        if self._waiting_first:
            self._arm_keepalive()

    def _stop_keepalive(self) -> None:
        self._waiting_first = False
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def _settle(self) -> None:
        """Let a keepalive write under way finish, so two writers never interleave.
        (Callers look at _keepalive_task first: most requests never had one.)"""
        task = self._keepalive_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.shield(task)


# -- helpers -----------------------------------------------------------------------------


def error_message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")


def engine_error_body(status: int, data: bytes) -> bytes:
    """An engine's error, passed on in OpenAI's shape whatever shape it came in."""
    try:
        obj = json.loads(data)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return data
    except ValueError:
        pass
    text = data[:500].decode(errors="replace").strip() or f"HTTP {status}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps(
        {
            "error": {
                "message": f"The engine answered: {text}",
                "type": kind,
                "param": None,
                "code": f"engine_{status}",
            }
        }
    ).encode()
