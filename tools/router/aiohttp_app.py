"""router.transport = "aiohttp": the router served by aiohttp's server, the way it was
before http1.py. Kept as a fallback an operator can switch to; every handler is the
same, only this adapter differs."""

from aiohttp import web

from llmgw_router.errors import ApiError
from llmgw_router.exchange import Answer, BodyTooLarge, Stream
from llmgw_router.proxy import request_id


class _Stream(Stream):
    __slots__ = ("inner", "status", "headers")

    def __init__(self, inner: web.StreamResponse):
        self.inner = inner
        self.status = inner.status
        self.headers = inner.headers

    async def write(self, data: bytes, last: bool = False) -> None:
        await self.inner.write(data)
        if last:
            await self.inner.write_eof()

    async def write_eof(self) -> None:
        await self.inner.write_eof()


class _Request:
    """An aiohttp request as the core reads one (exchange.py)."""

    __slots__ = ("inner", "app", "method", "path", "headers", "query", "match_info", "values")

    def __init__(self, inner: web.Request, state: dict):
        self.inner = inner
        self.app = state
        self.method = inner.method
        self.path = inner.path
        self.headers = inner.headers
        self.query = inner.query
        self.match_info = inner.match_info
        self.values = {}

    @property
    def content_length(self):
        return self.inner.content_length

    async def read(self) -> bytes:
        try:
            return await self.inner.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge() from None

    async def open_stream(self, status: int, headers: dict) -> _Stream:
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(self.inner)
        return _Stream(resp)

    def get(self, name, default=None):
        return self.values.get(name, default)

    def __setitem__(self, name, value):
        self.values[name] = value


def build(router) -> web.Application:
    """The aiohttp application serving `router` (app.Router)."""
    # aiohttp's own limit answers with plain text; ours answers in OpenAI's shape, so let
    # bodies through aiohttp up to one byte past the limit and judge them in the proxy.
    app = web.Application(client_max_size=router.rc.max_body_bytes + 1)

    async def on_startup(app):
        await router.start()

    async def on_cleanup(app):
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def handle(request: web.Request) -> web.StreamResponse:
        handler, info = router.routes.resolve(request.method, request.path)
        req = _Request(request, router.state)
        if info:
            req.match_info = info
        try:
            got = await handler(req)
        except ApiError as e:
            got = e.answer(request_id(req))
        if isinstance(got, Answer):
            return web.Response(status=got.status, body=got.body, headers=got.headers)
        return got.inner

    app.router.add_route("*", "/{tail:.*}", handle)
    return app
