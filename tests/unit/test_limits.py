"""Limits arithmetic as one router counts it, with the time passed in."""

import asyncio

import pytest

from llmgw_router.admission import Admission
from llmgw_router.limits import COST_KINDS, Limiter, Reservation, Shortfall, cost_units
from llmgw_router.probe import Signal, capacity
from llmgw_router.routing import Endpoint

T0 = 1_800_000_000.0  # a minute boundary: 30_000_000 * 60


def lease(lim, c, amount, now=T0, fleet=None, full=False):
    c.roll(now)
    lim.granted(c, c.window, amount, fleet if fleet is not None else amount, full, now)


def test_a_request_is_admitted_only_against_allowance_this_router_has_leased():
    lim = Limiter()
    c = lim.counter("rpm", "key", "k", 10)
    short = lim.reserve([(c, 1)], T0)
    assert isinstance(short, Shortfall) and short.wait, "nothing leased yet: wait for a lease"
    lease(lim, c, 2)
    assert isinstance(lim.reserve([(c, 1)], T0), Reservation)
    assert isinstance(lim.reserve([(c, 1)], T0 + 1), Reservation)
    assert isinstance(lim.reserve([(c, 1)], T0 + 2), Shortfall)


def test_a_reservation_takes_from_every_counter_or_from_none():
    lim = Limiter()
    rpm = lim.counter("rpm", "user", "ada", 100)
    tpm = lim.counter("tpm", "org", "acme", 1000)
    lease(lim, rpm, 5)
    lease(lim, tpm, 300)
    short = lim.reserve([(rpm, 1), (tpm, 400)], T0)
    assert isinstance(short, Shortfall) and short.counter is tpm
    assert (rpm.local, tpm.local) == (5, 300), "the refused reservation took nothing"
    assert isinstance(lim.reserve([(rpm, 1), (tpm, 250)], T0), Reservation)
    assert (rpm.local, tpm.local) == (4, 50)


def test_a_reservation_is_corrected_to_what_the_request_used():
    lim = Limiter()
    tpm = lim.counter("tpm", "key", "k", 1000)
    lease(lim, tpm, 500)
    r = lim.reserve([(tpm, 400)], T0)
    lim.settle(r, tokens=120, cost_units=0, now=T0 + 5)
    assert tpm.local == 380
    lim.settle(r, tokens=120, cost_units=0, now=T0 + 5)  # settling twice changes nothing
    assert tpm.local == 380


def test_using_more_than_was_reserved_is_a_debt_that_blocks_until_leased_again():
    lim = Limiter()
    tok = lim.counter("tokens/day", "user", "ada", 10_000)
    lease(lim, tok, 100)
    r = lim.reserve([(tok, 100)], T0)
    lim.settle(r, tokens=130, cost_units=0, now=T0)
    assert tok.local == -30
    assert isinstance(lim.reserve([(tok, 1)], T0), Shortfall)


def test_a_new_window_starts_empty_and_a_grant_for_an_ended_window_is_void():
    lim = Limiter()
    c = lim.counter("rpm", "key", "k", 10)
    lease(lim, c, 5)
    old_window = c.window
    assert isinstance(lim.reserve([(c, 1)], T0 + 61), Shortfall)  # the next minute
    assert c.local == 0 and c.window == old_window + 60
    lim.granted(c, old_window, 5, 5, False, T0 + 61)
    assert c.local == 0


def test_rpm_is_not_given_back_when_a_request_ends_but_tokens_are():
    lim = Limiter()
    rpm, tpm = lim.counter("rpm", "key", "k", 10), lim.counter("tpm", "key", "k", 100)
    lease(lim, rpm, 1)
    lease(lim, tpm, 50)
    r = lim.reserve([(rpm, 1), (tpm, 50)], T0)
    lim.settle(r, tokens=0, cost_units=0, now=T0)
    assert (rpm.local, tpm.local) == (0, 50)


def test_concurrency_slots_come_back_when_a_request_ends():
    lim = Limiter()
    c = lim.counter("concurrent", "key", "k", 2)
    lim.held(c, 2, 2, False, T0, T0 + 25)
    a, b = lim.reserve([(c, 1)], T0), lim.reserve([(c, 1)], T0)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    assert isinstance(lim.reserve([(c, 1)], T0), Shortfall)
    lim.settle(a, 0, 0, T0)
    assert isinstance(lim.reserve([(c, 1)], T0), Reservation)


def test_a_concurrency_hold_the_store_could_not_renew_admits_nothing_once_it_may_have_lapsed():
    lim = Limiter()
    c = lim.counter("concurrent", "key", "k", 5)
    lim.held(c, 5, 5, False, T0, T0 + 25)
    assert isinstance(lim.reserve([(c, 1)], T0 + 24), Reservation)
    assert isinstance(lim.reserve([(c, 1)], T0 + 25), Shortfall)


def test_a_hold_smaller_than_what_is_in_flight_admits_nothing_until_enough_end():
    lim = Limiter()
    c = lim.counter("concurrent", "key", "k", 3)
    lim.held(c, 3, 3, False, T0, T0 + 25)
    rs = [lim.reserve([(c, 1)], T0) for _ in range(3)]
    lim.held(c, 1, 3, True, T0, T0 + 25)  # others took two slots while the store was away
    assert c.local == -2
    lim.settle(rs[0], 0, 0, T0)
    lim.settle(rs[1], 0, 0, T0)
    assert isinstance(lim.reserve([(c, 1)], T0), Shortfall)
    lim.settle(rs[2], 0, 0, T0)
    assert isinstance(lim.reserve([(c, 1)], T0), Reservation)


def test_when_the_fleet_is_out_requests_are_refused_without_waiting_until_asked_again():
    lim = Limiter()
    c = lim.counter("rpm", "key", "k", 10)
    lease(lim, c, 0, fleet=10, full=True)
    short = lim.reserve([(c, 1)], T0)
    assert isinstance(short, Shortfall) and not short.wait
    assert lim.reserve([(c, 1)], T0 + 1.0).wait, "after a second the store is asked again"
    assert c.remaining() == 0


def test_a_request_larger_than_the_whole_limit_is_refused_at_once():
    lim = Limiter()
    c = lim.counter("tpm", "key", "k", 100)
    short = lim.reserve([(c, 101)], T0)
    assert isinstance(short, Shortfall) and not short.wait


def test_cost_is_counted_in_millionths_and_rounded_up():
    # 1,000 prompt tokens at 0.1 per million and 10 completion at 0.4: 0.00014
    assert cost_units(1000, 10, 0.1, 0.4) == 104
    assert cost_units(1, 0, 0.0001, 0.0) == 1


# -- admission by band ----------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def test_an_idle_model_admits_at_once_and_a_saturated_one_queues():
    async def main():
        adm = Admission(["gold", "silver"], capacity=lambda m: 1)
        assert await adm.enter("m", 1, 1.0)
        waiter = asyncio.ensure_future(adm.enter("m", 1, 5.0))
        await asyncio.sleep(0)
        assert adm.depth("m") == 1 and not waiter.done()
        adm.leave("m")
        assert await waiter
        assert adm.inflight["m"] == 1 and adm.depth("m") == 0

    run(main())


def test_a_freed_slot_goes_to_the_highest_band_waiting_whatever_the_arrival_order():
    async def main():
        adm = Admission(["gold", "silver", "bronze"], capacity=lambda m: 1)
        assert adm.enter_now("m")
        order = []

        async def ask(band, name):
            assert await adm.enter("m", band, 5.0)
            order.append(name)

        tasks = [asyncio.ensure_future(ask(b, n)) for b, n in
                 ((2, "bronze-1"), (1, "silver"), (2, "bronze-2"), (0, "gold"))]  # fmt: skip
        await asyncio.sleep(0)
        for _ in range(4):
            adm.leave("m")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["gold", "silver", "bronze-1", "bronze-2"]

    run(main())


def test_a_queued_request_whose_deadline_passes_is_not_admitted_and_leaves_the_queue():
    async def main():
        adm = Admission(["gold"], capacity=lambda m: 1)
        assert adm.enter_now("m")
        assert not await adm.enter("m", 0, 0.05)
        assert adm.depth("m") == 0
        adm.leave("m")
        assert adm.inflight["m"] == 0

    run(main())


def test_a_model_of_unknown_capacity_is_never_saturated():
    adm = Admission(["gold"], capacity=lambda m: None)
    assert all(adm.enter_now("m") for _ in range(1000))


@pytest.mark.parametrize("cap", [0, 2])
def test_capacity_that_grows_admits_the_queue_when_pumped(cap):
    async def main():
        slots = {"n": cap}
        adm = Admission(["gold"], capacity=lambda m: slots["n"])
        for _ in range(cap):
            assert adm.enter_now("m")
        waiter = asyncio.ensure_future(adm.enter("m", 0, 5.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        slots["n"] += 1  # a replica came up
        adm.pump_all()
        assert await waiter

    run(main())


# -- the engines' own signal ----------------------------------------------------------


def ep(outstanding=0, signal=None, cooldown=0.0):
    e = Endpoint("e", "http://127.0.0.1:1", ("m",))
    e.outstanding, e.signal, e.cooldown_until = outstanding, signal, cooldown
    return e


def test_capacity_counts_slots_busy_with_other_routers_and_an_engine_that_queues_as_full():
    now = 1000.0
    # The catalog says 4 slots; nothing from the engine: 4.
    assert capacity([ep()], 4, 0.0, now) == 4
    # The engine says 2 slots, both busy, one of them ours: one is someone else's.
    assert capacity([ep(1, Signal(2, 2, 0, now))], 4, 0.0, now) == 1
    # vLLM queues requests itself: no more than we already have there.
    assert capacity([ep(3, Signal(0, 8, 1, now))], 4, 0.0, now) == 3
    # An old signal is ignored; an endpoint in cooldown counts for nothing.
    assert capacity([ep(0, Signal(2, 2, 0, now - 60))], 4, 0.0, now) == 4
    assert capacity([ep(cooldown=5.0), ep()], 4, 1.0, now) == 4
    assert capacity([ep(cooldown=5.0)], 4, 1.0, now) is None, "503 at once, not a queue"
    # Unknown slots and no word from the engine: never saturated.
    assert capacity([ep()], 0, 0.0, now) is None
    assert capacity([ep(0, Signal(3, 0, 0, now))], 0, 0.0, now) == 3


def test_a_reservation_is_topped_up_for_a_dearer_fallback_only_if_it_fits():
    lim = Limiter()
    cost = lim.counter("cost/month", "org", "acme", 1000)
    rpm = lim.counter("rpm", "org", "acme", 10)
    lease(lim, cost, 300)
    lease(lim, rpm, 5)
    r = lim.reserve([(rpm, 1), (cost, 100)], T0)
    assert lim.top_up(r, COST_KINDS, 150, T0)
    assert cost.local == 50 and rpm.local == 4
    assert not lim.top_up(r, COST_KINDS, 51, T0), "only what this router holds"
    lim.settle(r, tokens=0, cost_units=200, now=T0)
    assert cost.local == 100  # 250 reserved, 200 spent
