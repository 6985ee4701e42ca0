"""A fake engine that speaks enough of the OpenAI API to test the router against.

Run it as `python tests/fake_engine.py --port N [--key K | --key-file PATH]`. It answers
chat, completions, embeddings and reranking (with `native`, Messages and Responses too),
streams SSE the way llama-server does (or framed with CRLF or CR), and can be told
how to misbehave with `POST /_control` `{"mode": ..., "chunks": N, "delay_s": S,
"first_delay_s": S, "n_slots": N, "extra_busy": N, "cache": "on"|"off", "pieces": [TEXT…],
"framing": "lf"|"crlf"|"cr", "native": BOOL}` (`GET /slots` shows `n_slots` slots, 64
unless told, busy with its own requests and `extra_busy` more, and `GET /load` says
the same as `{"running": N, "waiting": 0}` for tests/third_engine.py; `pieces` is the
answer, one streamed chunk a piece, and its completion tokens).

With `cache` set, it counts a prompt's tokens as its characters / 4 and keeps the
`n_slots` (at most 4) latest prompts the way llama-server keeps one per slot: "on" says
the longest prefix shared with one of them as `usage.prompt_tokens_details.cached_tokens`
and `timings.cache_n`, "off" says 0 (an engine that caches nothing). Unset, every prompt
is 7 tokens and nothing is said about caching.

    ok      answer normally
    fail    answer 500 with an error body
    busy    answer 503 (as an engine still loading does)
    stall   accept, then send nothing until the client gives up
    drop    stream `drop_after` chunks, then close the connection without [DONE]
    hold    stream `drop_after` chunks, then wait for `{"release": true}` before the rest

Like llama-server, it answers with its weights' path as `model` (one with a quote and a
trailing backslash, so JSON escapes it) unless started with `--alias NAME`.

`GET /_stats` says how many requests it saw, which were cancelled by the client, the most
it answered at once (`peak_active`), and the
last request's headers and body, so tests can check what the router forwarded. Any other
path (as /v1/messages or /v1/responses: it serves neither) is answered 404 and listed in
`unknown_paths`. With `{"native": true}` it serves both itself, with `{"responses": true}`
/v1/responses alone, whole and streamed, with exactly the fields llama-server's own
answers have (no instructions, tools, temperature..., events without sequence numbers,
no [DONE]), and refuses previous_response_id as llama-server does.
"""

import argparse
import asyncio
import json
import os
import time
import uuid

from aiohttp import web

# What llama-server says as `model` without --alias: its weights' path (made awkward).
PATH = '/var/lib/llmgw/weights/gemma-"q4"/m.gguf\\'

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]


class Engine:
    def __init__(self, key: str | None, name: str, alias: str = ""):
        self.key = key
        self.name = name
        self.model = alias or PATH  # what every answer says as `model`
        self.mode = "ok"
        self.chunks = 5
        self.delay_s = 0.0
        self.first_delay_s = 0.0
        self.drop_after = 2
        # GET /slots, as llama-server's: this many slots, the first ones busy with its
        # own requests and `extra_busy` more (as if another router's).
        self.n_slots = 64
        self.extra_busy = 0
        self.cache = None  # None: say nothing about caching; "on" or "off"
        self.pieces = None  # the answer's pieces of text (None: `chunks` of WORDS)
        self.framing = "lf"  # the streams' line ends: "lf", "crlf" or "cr"
        self.native = False  # serve /v1/messages and /v1/responses itself
        self.prompts: list[str] = []  # the latest prompts, as slots keep them
        self.released = asyncio.Event()
        self.requests = 0
        self.cancelled = 0
        self.streamed_chunks = 0  # stream chunks written, all requests together
        self.active = 0
        self.peak_active = 0  # the most requests it answered at once
        self.last_headers: dict = {}
        self.last_body: dict = {}
        self.unknown_paths: list[str] = []
        self.load_reads = 0  # GET /load answered
        self.responses = False  # serve /v1/responses natively, as llama-server does

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_post("/v1/reranking", self.rerank)
        app.router.add_get("/health", self.health)
        app.router.add_post("/_control", self.control)
        app.router.add_get("/_stats", self.stats)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/load", self.load)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        return app

    async def unknown(self, request):
        """A path it does not serve (/v1/messages, /v1/responses unless `native`): 404,
        and noted."""
        native = self.native or (self.responses and request.path == "/v1/responses")
        if native and request.method == "POST" and request.path in NATIVE:
            return await self.generate(request)
        self.unknown_paths.append(request.path)
        return web.json_response({"error": {"message": "File Not Found"}}, status=404)

    async def health(self, request):
        return web.json_response({"status": "ok"})

    async def control(self, request):
        body = await request.json()
        for field in (
            "mode",
            "chunks",
            "delay_s",
            "first_delay_s",
            "drop_after",
            "n_slots",
            "extra_busy",
            "cache",
            "pieces",
            "framing",
            "native",
            "responses",
        ):
            if field in body:
                setattr(self, field, body[field])
        if body.get("release"):
            self.released.set()
        elif "mode" in body:
            self.released = asyncio.Event()
        return web.json_response({"ok": True})

    async def stats(self, request):
        return web.json_response(
            {
                "requests": self.requests,
                "cancelled": self.cancelled,
                "streamed_chunks": self.streamed_chunks,
                "active": self.active,
                "peak_active": self.peak_active,
                "last_headers": self.last_headers,
                "last_body": self.last_body,
                "unknown_paths": self.unknown_paths,
                "prompts": len(self.prompts),
                "load_reads": self.load_reads,
            }
        )

    async def slots(self, request):
        """As llama-server's: one entry per slot, busy while a request is answered."""
        denied = self._check(request)
        if denied:
            return denied
        busy = self.active + self.extra_busy
        return web.json_response([{"id": i, "is_processing": i < busy}
                                  for i in range(self.n_slots)])  # fmt: skip

    async def load(self, request):
        """The third engine's load signal (tests/third_engine.py): what runs, as /slots."""
        denied = self._check(request)
        if denied:
            return denied
        self.load_reads += 1
        return web.json_response({"running": self.active + self.extra_busy, "waiting": 0})

    def _usage(self, body: dict) -> dict:
        """Usage (and llama-server's timings) for a request, with its prompt cache."""
        n = len(self._pieces())
        if self.cache is None:
            return {"usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}
        if isinstance(body.get("messages"), list):
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body["messages"])
        else:
            text = str(body.get("prompt", ""))
        best = max((len(os.path.commonprefix([old, text])) for old in self.prompts), default=0)
        self.prompts = [*self.prompts, text][-min(4, self.n_slots) :]
        prompt = max(1, len(text) // 4)
        cached = min(best // 4, prompt - 1) if self.cache == "on" else 0
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": n,
                "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            "timings": {"cache_n": cached, "prompt_n": prompt - cached},
        }

    def _check(self, request):
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response(
                {"error": {"message": "Invalid API Key", "type": "authentication_error"}},
                status=401,
            )
        return None

    async def embeddings(self, request):
        denied = self._check(request)
        if denied:
            return denied
        body = await request.json()
        self.requests += 1
        self.last_headers, self.last_body = dict(request.headers), body
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]}
            for i, _ in enumerate(inputs)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": 3 * len(inputs), "total_tokens": 3 * len(inputs)},
            }
        )

    async def rerank(self, request):
        """As llama-server's: a score per document, the longer the higher."""
        denied = self._check(request)
        if denied:
            return denied
        body = await request.json()
        self.requests += 1
        self.last_headers, self.last_body = dict(request.headers), body
        docs = body["documents"]
        results = sorted(
            ({"index": i, "relevance_score": float(len(d))} for i, d in enumerate(docs)),
            key=lambda r: -r["relevance_score"],
        )[: body.get("top_n") or len(docs)]
        return web.json_response(
            {
                "model": self.model,
                "object": "list",
                "usage": {"prompt_tokens": 4 * len(docs), "total_tokens": 4 * len(docs)},
                "results": results,
            }
        )

    async def generate(self, request):
        denied = self._check(request)
        if denied:
            return denied
        body = await request.json()
        self.requests += 1
        self.last_headers, self.last_body = dict(request.headers), body
        api = NATIVE.get(request.path)
        if api is Responses and "previous_response_id" in body:  # llama-server keeps no state
            error = {
                "message": "previous_response_id is not supported",
                "code": 400,
                "type": "invalid_request_error",
            }
            return web.json_response({"error": error}, status=400)
        if self.mode == "fail":
            return web.json_response(
                {"error": {"message": "fake engine told to fail", "type": "server_error"}},
                status=500,
            )
        if self.mode == "busy":
            return web.json_response({"error": {"message": "Loading model"}}, status=503)
        chat = request.path.endswith("chat/completions")
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            if self.mode == "stall":
                await asyncio.sleep(3600)
            if body.get("stream"):
                return await self._stream(request, body, chat, api)
            await asyncio.sleep(self.first_delay_s)
            usage = self._usage(body)
            text = "".join(self._pieces())
            if api is not None:
                return web.json_response(api.whole(self.model, text, usage["usage"]))
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            return web.json_response(
                {
                    "id": "fake-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [choice],
                    **usage,
                }
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    def _pieces(self) -> list[str]:
        if self.pieces is not None:
            return self.pieces
        return [WORDS[i % len(WORDS)] for i in range(self.chunks)]

    def _frame(self, event: bytes) -> bytes:
        """An event as written with LF line ends, in this engine's framing."""
        return event.replace(b"\n", LINE_ENDS[self.framing])

    async def _stream(self, request, body, chat, api):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_delay_s)
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = self._usage(body)["usage"]
        pieces = self._pieces()
        if api is not None:
            await resp.write(self._frame(api.head(self.model, usage)))
        for i, word in enumerate(pieces):
            if self.mode == "drop" and i == self.drop_after:
                request.transport.close()
                return resp
            if self.mode == "hold" and i == self.drop_after:
                await self.released.wait()
            if api is not None:
                event = api.delta(word)
            else:
                choice = (
                    {"index": 0, "delta": {"content": word}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": word, "finish_reason": None}
                )
                chunk = {"id": "fake-1", "object": obj, "model": self.model, "choices": [choice]}
                event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await resp.write(self._frame(event))
            self.streamed_chunks += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        if api is not None:
            await resp.write(self._frame(api.tail(self.model, "".join(pieces), usage)))
        else:
            if (body.get("stream_options") or {}).get("include_usage"):
                chunk = {"id": "fake-1", "object": obj, "model": self.model, "choices": []}
                chunk["usage"] = usage
                await resp.write(self._frame(b"data: " + json.dumps(chunk).encode() + b"\n\n"))
            await resp.write(self._frame(b"data: [DONE]\n\n"))
        await resp.write_eof()
        return resp


LINE_ENDS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def sse(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


class Messages:
    """Anthropic's Messages API, as llama-server serves it natively."""

    @staticmethod
    def message(model, content, usage) -> dict:
        return {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }

    @staticmethod
    def whole(model, text, usage) -> dict:
        usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
        }
        return Messages.message(model, [{"type": "text", "text": text}], usage)

    @staticmethod
    def head(model, usage) -> bytes:
        start = Messages.message(
            model, [], {"input_tokens": usage["prompt_tokens"], "output_tokens": 1}
        )
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        return sse("message_start", {"type": "message_start", "message": start}) + sse(
            "content_block_start", block
        )

    @staticmethod
    def delta(text) -> bytes:
        delta = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": text},
        }
        return sse("content_block_delta", delta)

    @staticmethod
    def tail(model, text, usage) -> bytes:
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": usage["completion_tokens"]},
        }
        return (
            sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + sse("message_delta", end)
            + sse("message_stop", {"type": "message_stop"})
        )


class Responses:
    """The Responses API, as llama-server serves it natively: exactly the fields its
    answers have (its server-task.cpp: no instructions, tools, temperature..., events
    without sequence numbers)."""

    @staticmethod
    def _item(text: str, status: str = "completed") -> dict:
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
        return {
            "content": [part] if text else [],
            "id": "msg_fake1",
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    @staticmethod
    def whole(model, text, usage) -> dict:
        now = int(time.time())
        usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
        }
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": now,
            "completed_at": now,
            "status": "completed",
            "model": model,
            "output": [Responses._item(text)],
            "usage": usage,
        }

    @staticmethod
    def head(model, usage) -> bytes:
        started = {"id": "resp_fake", "object": "response", "status": "in_progress"}
        added = Responses._item("", "in_progress")
        return (
            sse("response.created", {"type": "response.created", "response": started})
            + sse("response.in_progress", {"type": "response.in_progress", "response": started})
            + sse(
                "response.output_item.added", {"type": "response.output_item.added", "item": added}
            )
        )

    @staticmethod
    def delta(text) -> bytes:
        delta = {"type": "response.output_text.delta", "delta": text, "item_id": "msg_fake1"}
        return sse("response.output_text.delta", delta)

    @staticmethod
    def tail(model, text, usage) -> bytes:
        resp = Responses.whole(model, text, usage)
        item = resp["output"][0]
        return b"".join(
            sse(kind, {"type": kind, **data})
            for kind, data in (
                ("response.output_text.done", {"item_id": "msg_fake1", "text": text}),
                (
                    "response.content_part.done",
                    {"item_id": "msg_fake1", "part": item["content"][0]},
                ),
                ("response.output_item.done", {"item": item}),
                ("response.completed", {"response": resp}),
            )
        )


NATIVE = {"/v1/messages": Messages, "/v1/responses": Responses}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", default=None, help="the engine key it demands, if any")
    parser.add_argument(
        "--key-file", default=None, help="read the key from this file (as llmgw-agentd passes it)"
    )
    parser.add_argument("--name", default="fake")
    parser.add_argument("--alias", default="", help="the model name to answer with")
    # As if set by /_control from the start: a model's profile.args can slow its engine.
    parser.add_argument("--first-delay-s", type=float, default=0.0,
                        help="seconds before each answer (or a stream's first chunk)")  # fmt: skip
    parser.add_argument("--slots", type=int, default=64, help="the slots /slots shows")
    args = parser.parse_args()
    key = args.key
    if args.key_file:
        with open(args.key_file) as f:
            key = f.read().strip()
    engine = Engine(key, args.name, args.alias)
    engine.first_delay_s, engine.n_slots = args.first_delay_s, args.slots
    print(f"fake engine {args.name} listening on port {args.port}", flush=True)
    web.run_app(
        engine.app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
