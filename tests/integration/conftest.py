import json
import os

import pytest
import requests

from tests.helpers import eventually, free_port, llmgw, start_fake_engine, start_router

ENGINE_KEY = "engine-key-for-tests"


class Router:
    def __init__(self, proc, url, secret, store_url):
        self.proc, self.url, self.secret, self.store_url = proc, url, secret, store_url

    def post(self, path, body=None, key=..., raw=None, **kw):
        headers = kw.pop("headers", {})
        key = self.secret if key is ... else key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else json.dumps(body)
        return requests.post(self.url + path, data=data, headers=headers, timeout=30, **kw)

    def get(self, path, key=...):
        key = self.secret if key is ... else key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.get(self.url + path, headers=headers, timeout=30)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text


class Engine:
    def __init__(self, proc, url):
        self.proc, self.url = proc, url

    def control(self, **kw):
        requests.post(self.url + "/_control", json=kw, timeout=5).raise_for_status()

    def stats(self):
        return requests.get(self.url + "/_stats", timeout=5).json()


@pytest.fixture
def engine(tmp_path):
    proc, url = start_fake_engine(tmp_path, key=ENGINE_KEY)
    yield Engine(proc, url)
    proc.stop()


@pytest.fixture
def make_router(tmp_path, api_key):
    """Start a router in front of `engine_urls` (model 'm'), with extra [router] settings."""
    started = []
    (tmp_path / "engine.key").write_text(ENGINE_KEY + "\n")

    def make(engine_urls, **settings):
        settings = {"key_refresh_s": 0.2, **settings}
        lines = ["[router]", 'listen = "127.0.0.1:{port}"']
        lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        for i, url in enumerate(engine_urls):
            lines += [
                "[[router.endpoints]]",
                f'id = "e{i}"',
                f'url = "{url}"',
                'models = ["m"]',
                f'key = "@{tmp_path / "engine.key"}"',
            ]
        proc, url = start_router(tmp_path, "\n".join(lines) + "\n")
        router = Router(proc, url, api_key[1], os.environ["LLMGW_STORE"])
        # The key was made before the router started; it is in the first load.
        eventually(
            lambda: router.get("/v1/models").status_code == 200, what="the router to accept the key"
        )
        started.append(proc)
        return router

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def router(make_router, engine):
    return make_router([engine.url])


def dead_url() -> str:
    """An address where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


# -- routers with tenancy, limits, bands and a catalog ---------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def ctl(*args):
    return json.loads(llmgw(*args, "--store", "--json").stdout)


class Client:
    def __init__(self, url, secret):
        self.url, self.secret = url, secret

    def chat(self, body=None, secret=None, **kw):
        return requests.post(
            self.url + "/v1/chat/completions",
            data=json.dumps(body or CHAT),
            headers={"Authorization": f"Bearer {secret or self.secret}"},
            timeout=30,
            **kw,
        )

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text


@pytest.fixture
def limited_router(tmp_path, engine):
    """Start a router in front of the fake engine, with extra config text."""
    started = []
    (tmp_path / "engine.key").write_text(ENGINE_KEY + "\n")

    def make(secret, extra="", models=("m",), endpoints=None):
        endpoints = endpoints or [("e0", engine.url, models)]
        text = (
            '[router]\nlisten = "127.0.0.1:{port}"\nkey_refresh_s = 0.2\n'
            "limits_refresh_s = 0.2\nlease_wait_s = 3.0\n" + extra
        )
        for ident, url, served in endpoints:
            text += (
                f'[[router.endpoints]]\nid = "{ident}"\nurl = "{url}"\n'
                f"models = {json.dumps(list(served))}\n"
                f'key = "@{tmp_path / "engine.key"}"\n'
            )
        # Ready once keys and limits are loaded: those made before it are in the first load.
        proc, url = start_router(tmp_path, text)
        started.append(proc)
        return Client(url, secret)

    yield make
    for proc in started:
        proc.stop()
