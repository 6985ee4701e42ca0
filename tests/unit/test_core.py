"""The request path without a transport or an engine: the real Proxy, policies, limits,
admission and routing table, a fake pool of engines and a fake request. What only
subprocesses could reach before: a failing first endpoint, fallbacks, a budget's
regrade for a dearer fallback, and admission by band."""

import asyncio
import json
import time

import pytest

from llmgw_router.routes import CHAT
from llmgw_router.routing import Endpoint
from tests.fake_core import EMFILE, REFUSE, Engine, Got, models
from tests.fake_core import Core as _Core

CATALOG = models(
    {"name": "cheap", "fallbacks": ["dear"],
     "pricing": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
    {"name": "dear", "pricing": {"input_per_mtok": 100.0, "output_per_mtok": 100.0}},
    {"name": "one", "profile": {"parallel": 1}},
)  # fmt: skip

CHAT_BODY = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 1000}  # fmt: skip


class Core(_Core):
    """The catalog above; "one" takes one request at a time; every engine answers "hi"
    for 1,000 prompt and 1,000 completion tokens."""

    def __init__(self, endpoints: list[Endpoint]):
        engine = Engine(pieces=["hi"], usage=(1000, 1000))
        super().__init__(endpoints, CATALOG, slots={"one": 1}, engine=engine, keepalive_s=5.0)

    async def ask(self, secret: str, **body) -> Got:
        return await super().ask(CHAT, secret, {**CHAT_BODY, **body})


def run(coro):
    return asyncio.run(coro)


def test_a_failing_first_endpoint_is_tried_no_more_and_the_next_one_answers():
    core = Core([Endpoint("e0", "http://e0", ("cheap",)), Endpoint("e1", "http://e1", ("cheap",))])
    secret = core.key("k")
    core.engines.engine("http://e0").fail = REFUSE

    async def go():
        first = await core.ask(secret)
        second = await core.ask(secret)
        return first, second

    first, second = run(go())
    assert first.status == 200 and second.status == 200
    tried = [s.url for s in core.engines.sent]
    assert tried.count("http://e0") == 1, "in cooldown after it failed"
    assert [r.endpoint for r in core.usage.rows] == ["e1", "e1"]
    assert first.headers["x-llmgw-served-model"] == "cheap"


def test_the_routers_own_lack_of_file_descriptors_is_a_503_and_blames_no_engine():
    core = Core([Endpoint("e0", "http://e0", ("cheap",))])
    secret = core.key("k")
    core.engines.engine("http://e0").fail = EMFILE
    got = run(core.ask(secret))
    assert got.status == 503 and json.loads(got.body)["error"]["code"] == "router_overloaded"
    assert got.headers["Retry-After"] == "1"
    core.engines.engine("http://e0").fail = None
    assert run(core.ask(secret)).status == 200, "e0 was not put in cooldown"
    assert [r.status for r in core.usage.rows] == [503, 200]


def test_a_model_whose_engines_all_fail_falls_back_and_the_row_says_who_answered():
    core = Core([Endpoint("c", "http://c", ("cheap",)), Endpoint("d", "http://d", ("dear",))])
    secret = core.key("k")
    core.engines.engine("http://c").fail = 503
    got = run(core.ask(secret))
    assert got.status == 200
    assert json.loads(got.body)["model"] == "dear"
    last = core.engines.sent[-1]
    assert (last.url, last.body) == ("http://d", {**CHAT_BODY, "model": "dear"})
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
    core.engines.engine("http://c").fail = 503
    got = run(core.ask(secret))
    sent_to = [s.url for s in core.engines.sent]
    if answers is None:
        assert got.status == 502, got.body  # cheap's own failure, not a budget refusal
        assert "http://d" not in sent_to
        assert core.usage.rows[-1].cost in (0, None)
    else:
        assert got.status == 200 and json.loads(got.body)["model"] == "dear"
        assert core.usage.rows[-1].cost == pytest.approx(0.2)
    # Whatever happened, what was reserved is settled: nothing is left held.
    (cost,) = core.costs(secret)
    spent = core.usage.rows[-1].cost or 0.0
    assert cost.local == cost.limit - round(spent * 1_000_000)  # in millionths of the unit


def test_a_freed_slot_goes_to_the_highest_band_waiting_whoever_came_first():
    core = Core([Endpoint("o", "http://o", ("one",))])
    gold, bronze = core.key("g", band="gold"), core.key("b", band="bronze")
    hold = core.engines.engine("http://o").hold = asyncio.Event()
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
        hold.set()
        await asyncio.gather(first, *later)

    run(go())
    assert order == [("first", 200), ("gold", 200), ("bronze", 200)]


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
