"""A starting router is live but not ready until its first routing table arrives, and
never says a model it may yet serve does not exist (issue 17, fault 2)."""

import threading

import pytest
import requests
import zmq

from llmgw import bus
from tests.helpers import eventually, free_port, start_router
from tests.integration.conftest import ENGINE_KEY, Client


class Publisher:
    """A scheduler's PUB socket, CURVE as the real one, sending a table when told to."""

    def __init__(self, curve_dir):
        bus.create_keypair(curve_dir, bus.SCHEDULER)
        bus.create_keypair(curve_dir, "router")
        self.ctx = zmq.Context()
        self.port = free_port()
        keys = bus.load_keypair(curve_dir, bus.SCHEDULER)
        self.sock = bus.serve(self.ctx, zmq.PUB, f"tcp://127.0.0.1:{self.port}", keys)
        self.body = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        seq = 0
        while not self._stop.wait(0.1):
            if self.body is not None:
                seq += 1
                self.sock.send(bus.encode("routes", "scheduler", {**self.body, "seq": seq}, 1))

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def publisher(isolated_paths):
    pub = Publisher(isolated_paths / "etc" / "pki" / "curve")
    yield pub
    pub.close()


def test_a_router_without_its_first_table_is_live_not_ready_and_never_says_not_found(
    isolated_paths, publisher, engine, api_key
):
    common = (isolated_paths / "etc" / "llmgw.toml").read_text()
    proc, url = start_router(
        isolated_paths,
        common + '[router]\nlisten = "127.0.0.1:{port}"\nkey_refresh_s = 0.2\n'
        f'schedulers = ["tcp://127.0.0.1:{publisher.port}"]\nactivation_window_s = 1.0\n',
        wait=False,
    )
    try:
        proc.wait_healthy(ok=(503,))  # up, keys loaded or not: it answers /ready
        live = requests.get(url + "/health", timeout=5)
        assert live.status_code == 200 and live.json()["ready"] is False
        client = Client(url, api_key[1])

        def not_ready_for_the_table():
            r = requests.get(url + "/ready", timeout=5)
            return r.status_code == 503 and "routing table" in r.json()["reason"]

        eventually(not_ready_for_the_table, what="keys loaded, the table still missing")
        chat = client.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503, chat.text
        assert chat.json()["error"]["code"] == "router_not_ready"
        assert int(chat.headers["Retry-After"]) >= 1
        listed = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key[1]}"},
                              timeout=5)  # fmt: skip
        assert listed.status_code == 503

        publisher.body = {
            "replicas": [{"id": "r-1", "endpoint": engine.url, "model": "m", "aliases": [],
                          "key": ENGINE_KEY, "state": "ready"}],
            "models": [{"name": "m", "aliases": [], "state": "serving", "reason": ""}],
        }  # fmt: skip
        eventually(lambda: requests.get(url + "/ready", timeout=5).status_code == 200,
                   what="the router to be ready once the table came")  # fmt: skip
        ready = requests.get(url + "/ready", timeout=5).json()
        assert ready["ready"] is True and ready["models"] == ["m"]
        chat = client.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        # With a table, a model nobody serves or knows does not exist.
        gone = client.chat({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert gone.status_code == 404
    finally:
        proc.stop()
