import json
import os

import pytest
import requests

from tests.helpers import eventually, free_port, start_fake_engine, start_router

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
