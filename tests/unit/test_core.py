"""The request path without a transport or an engine: the real Proxy, policies, limits,
admission and routing table, a fake pool of engines and a fake request. What only
subprocesses could reach before: a failing first endpoint, fallbacks, a budget's
regrade for a dearer fallback, and admission by band."""

import asyncio
import json
import time

import pytest
from multidict import CIMultiDict

from llmgw import apikeys
from llmgw import config as configmod
from llmgw_router.admission import Admission
from llmgw_router.exchange import Answer
from llmgw_router.keycache import KeyCache
from llmgw_router.limits import Limiter
from llmgw_router.policy import Policies, State
from llmgw_router.proxy import Proxy
from llmgw_router.quota import Quota
from llmgw_router.routes import CHAT
from llmgw_router.routing import Endpoint, RoutingTable
from llmgw_router.upstream import UpstreamError


class Reply:
    def __init__(self, status: int, body: bytes):
        self.status, self._body = status, body
        self.headers = {"content-type": "application/json"}

    def whole(self) -> bytes:
        return self._body

    async def read(self) -> bytes:
        return self._body

    async def next(self):
        body, self._body = self._body, b""
        return body or None

    def release(self) -> None:
        pass


class Engines:
    """The pool: each engine (by url) answers as told, and what it was sent is kept."""

    def __init__(self):
        self.how: dict[str, object] = {}  # url -> "ok" | "refuse" | status | asyncio.Event
        self.sent: list[tuple[str, dict]] = []

    def origin(self, url: str) -> str:
        return url

    async def request(self, origin: str, head: bytes, body: bytes):
        payload = json.loads(body)
        self.sent.append((origin, payload))
        how = self.how.get(origin, "ok")
        if isinstance(how, asyncio.Event):
            await how.wait()
        elif how == "refuse":
            raise UpstreamError("connect", f"cannot connect to {origin}")
        elif how == "emfile":
            raise UpstreamError("local", f"cannot connect to {origin}: Too many open files")
        elif isinstance(how, int):
            return Reply(how, b'{"error": {"message": "overloaded", "type": "server_error"}}')
        answer = {
            "id": "x", "object": "chat.completion", "model": payload["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 1000},
        }  # fmt: skip
        return Reply(200, json.dumps(answer).encode())


class Rows:
    def __init__(self):
        self.rows = []

    def record(self, row) -> None:
        self.rows.append(row)


class Request:
    def __init__(self, secret: str, body: dict):
        self.headers = CIMultiDict({"Authorization": f"Bearer {secret}"})
        self.body = json.dumps(body).encode()
        self.content_length = len(self.body)
        self.method, self.path, self.app, self.values = "POST", CHAT.path, {}, {}

    async def read(self) -> bytes:
        return self.body

    def get(self, name, default=None):
        return self.values.get(name, default)


def models(*defs: dict) -> list:
    return [configmod.model_from({"source": f"/models/{d['name']}.gguf", **d}) for d in defs]


CATALOG = models(
    {"name": "cheap", "fallbacks": ["dear"],
     "pricing": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
    {"name": "dear", "pricing": {"input_per_mtok": 100.0, "output_per_mtok": 100.0}},
    {"name": "one", "profile": {"parallel": 1}},
)  # fmt: skip


class Core:
    """One router's request path, with keys made by `key`."""

    def __init__(self, endpoints: list[Endpoint]):
        self.clock = 1000.0
        self.limiter = Limiter()
        self.policies = Policies(self.limiter, ["gold", "bronze"], "bronze", models=CATALOG)
        self.policies.loaded.set()
        self.keys = KeyCache()
        self.keys.loaded.set()
        self.table = RoutingTable(endpoints, cooldown_s=5.0)
        self.engines = Engines()
        self.usage = Rows()
        self.admission = Admission(
            self.policies.bands,
            lambda m: 1 if m == "one" else None,
            clock=lambda: self.clock,
        )
        self.proxy = Proxy(
            self.table, self.keys, self.usage, self.engines, 1 << 20, retries=2,
            keepalive_interval_s=5.0, policies=self.policies,
            quota=Quota(self.limiter, None, 0.0, 256), admission=self.admission,
        )  # fmt: skip
        self._rows = []

    def key(self, name: str, band: str = "", budget_cost: float | None = None) -> str:
        secret = f"sk-{name}"
        row = type("Row", (), dict(
            id=f"key_{name}", secret_hash=apikeys.hash_secret(secret), model_list=[],
            expires_at=None, user=None, project=None, band=band, revoked_at=None,
            updated_at=time.time()))  # fmt: skip
        self._rows.append(row)
        self.keys.apply(self._rows)
        if budget_cost is not None:
            st = self.policies.state
            budgets = {**st.budgets, ("key", row.id): [("month", None, budget_cost)]}
            self.policies.state = State(st.users, st.projects, st.limits, budgets, st.models)
            self.policies.generation += 1
            policy = self.policies.policy(self.keys.lookup(secret))
            now = time.time()
            for c in policy.costs:  # this router holds the whole budget
                c.roll(now)
                self.limiter.granted(c, c.window, c.limit, c.limit, False, now)
        return secret

    async def ask(self, secret: str, **body) -> Answer:
        return await self.proxy.forward(Request(secret, {**CHAT_BODY, **body}), CHAT)


CHAT_BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 1000}  # fmt: skip


def run(coro):
    return asyncio.run(coro)


def test_a_failing_first_endpoint_is_tried_no_more_and_the_next_one_answers():
    core = Core([Endpoint("e0", "http://e0", ("cheap",)), Endpoint("e1", "http://e1", ("cheap",))])
    secret = core.key("k")
    core.engines.how["http://e0"] = "refuse"

    async def go():
        first = await core.ask(secret)
        second = await core.ask(secret)
        return first, second

    first, second = run(go())
    assert first.status == 200 and second.status == 200
    tried = [url for url, _ in core.engines.sent]
    assert tried.count("http://e0") == 1, "in cooldown after it failed"
    assert [r.endpoint for r in core.usage.rows] == ["e1", "e1"]
    assert first.headers["x-llmgw-served-model"] == "cheap"


def test_the_routers_own_lack_of_file_descriptors_is_a_503_and_blames_no_engine():
    core = Core([Endpoint("e0", "http://e0", ("cheap",))])
    secret = core.key("k")
    core.engines.how["http://e0"] = "emfile"
    got = run(core.ask(secret))
    assert got.status == 503 and json.loads(got.body)["error"]["code"] == "router_overloaded"
    assert got.headers["Retry-After"] == "1"
    core.engines.how["http://e0"] = "ok"
    assert run(core.ask(secret)).status == 200, "e0 was not put in cooldown"
    assert [r.status for r in core.usage.rows] == [503, 200]


def test_a_model_whose_engines_all_fail_falls_back_and_the_row_says_who_answered():
    core = Core([Endpoint("c", "http://c", ("cheap",)), Endpoint("d", "http://d", ("dear",))])
    secret = core.key("k")
    core.engines.how["http://c"] = 503
    got = run(core.ask(secret))
    assert got.status == 200
    assert json.loads(got.body)["model"] == "dear"
    assert core.engines.sent[-1] == ("http://d", {**CHAT_BODY, "model": "dear"})
    (row,) = core.usage.rows
    assert (row.model, row.served_model, row.status) == ("cheap", "dear", 200)
    # 1,000 prompt and 1,000 completion tokens at 100 per million each way.
    assert row.cost == pytest.approx(0.2)


@pytest.mark.parametrize("budget, answers", [(0.5, "dear"), (0.05, None)])
def test_a_dearer_fallback_answers_only_if_the_cost_budget_covers_its_prices(budget, answers):
    """Reserved at cheap's prices; before dear may answer, the reservation is regraded
    to its prices, and a budget that cannot cover them skips it."""
    core = Core([Endpoint("c", "http://c", ("cheap",)), Endpoint("d", "http://d", ("dear",))])
    secret = core.key("k", budget_cost=budget)
    core.engines.how["http://c"] = 503
    got = run(core.ask(secret))
    sent_to = [url for url, _ in core.engines.sent]
    if answers is None:
        assert got.status == 502, got.body  # cheap's own failure, not a budget refusal
        assert "http://d" not in sent_to
        assert core.usage.rows[-1].cost in (0, None)
    else:
        assert got.status == 200 and json.loads(got.body)["model"] == "dear"
        assert core.usage.rows[-1].cost == pytest.approx(0.2)
    # Whatever happened, what was reserved is settled: nothing is left held.
    (cost,) = core.policies.policy(core.keys.lookup(secret)).costs
    spent = core.usage.rows[-1].cost or 0.0
    assert cost.local == cost.limit - round(spent * 1_000_000)  # in millionths of the unit


def test_a_freed_slot_goes_to_the_highest_band_waiting_whoever_came_first():
    core = Core([Endpoint("o", "http://o", ("one",))])
    gold, bronze = core.key("g", band="gold"), core.key("b", band="bronze")
    hold = core.engines.how["http://o"] = asyncio.Event()
    order = []

    async def ask(secret, name):
        got = await core.ask(secret, model="one")
        order.append((name, got.status))

    async def go():
        first = asyncio.create_task(ask(bronze, "first"))
        await wait_for(lambda: len(core.engines.sent) == 1)
        later = [asyncio.create_task(ask(bronze, "bronze")), asyncio.create_task(ask(gold, "gold"))]
        await wait_for(lambda: core.admission.waiting.get("one") == 2)
        assert len(core.engines.sent) == 1, "the one slot is taken: both wait"
        core.engines.how["http://o"] = "ok"
        hold.set()
        await asyncio.gather(first, *later)

    run(go())
    assert order == [("first", 200), ("gold", 200), ("bronze", 200)]


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
