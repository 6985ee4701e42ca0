"""Prefix-aware routing's bookkeeping: keys, matching, LRU bounds, the load guard,
self-correction from what the engine says it reused, and waiting for a prompt another
request is evaluating."""

import asyncio
import logging
from dataclasses import dataclass

from llmgw_router.prefix import (
    BLOCK_CHARS,
    DECODE_WEIGHT_MAX,
    ENTRY_BYTES,
    PrefixIndex,
    answered,
    cached_tokens,
    canonical,
    decode_weight,
    hold,
    request_key,
)

SYSTEM = "You are a careful assistant. " * 60  # ~1,700 characters, ~13 blocks


@dataclass(eq=False)
class Ep:
    id: str
    outstanding: int = 0


def holds(idx: PrefixIndex, replica: str, payload: dict) -> None:
    """`replica` was sent `payload` and answered it: it holds that prompt."""
    key = request_key(payload)
    idx.sent(replica, key, 0)
    idx.served(replica, key, 0, None)


def chat(*turns, system=SYSTEM, model="m", **extra):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": model, "messages": messages, **extra}


def test_a_later_turn_shares_the_leading_blocks_of_the_earlier_one():
    first = request_key(chat("What is a fox?"))
    later = request_key(chat("What is a fox?", "An animal.", "And a dog?"))
    shared = len(canonical(chat("What is a fox?"))) // BLOCK_CHARS
    assert later.blocks[:shared] == first.blocks[:shared]
    assert len(later.blocks) > len(first.blocks)


def test_the_key_follows_template_order_not_the_first_message_or_the_json():
    a = request_key(chat("hello"))
    other_user = request_key(chat("goodbye"))
    assert a.blocks != other_user.blocks  # same messages[0], different prompts
    # Key order in the JSON body, or a field the template does not render, changes nothing.
    reordered = {"messages": chat("hello")["messages"], "model": "m", "temperature": 0.3}
    assert request_key(reordered).blocks == a.blocks
    assert request_key(chat("hello", model="n")).blocks[0] != a.blocks[0]
    with_tools = request_key(chat("hello", tools=[{"type": "function", "name": "f"}]))
    assert with_tools.blocks[0] != a.blocks[0]


def test_a_completion_keys_on_its_prompt_and_embeddings_have_no_key():
    assert request_key({"model": "m", "prompt": "x" * 300}).chars > 300
    assert request_key({"model": "m", "input": ["a", "b"]}) is None  # embeddings
    assert canonical({"model": "m"}) is None


def test_a_replica_holding_the_conversation_gets_its_next_turn():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    k1 = request_key(chat("q1"))
    first = idx.choose([a, b], k1)
    idx.served(first.id, k1, 0, None)
    other = b if first is a else a
    key = request_key(chat("q1", "a1", "q2"))
    assert idx.match(first.id, key) > 0 and idx.match(other.id, key) == 0
    assert idx.choose([a, b], key) is first


def test_a_prompt_nobody_holds_goes_to_the_least_loaded():
    for busy, idle in (("a", "b"), ("b", "a")):  # whichever is its hash's first choice
        idx = PrefixIndex()
        eps = {"a": Ep("a"), "b": Ep("b")}
        eps[busy].outstanding = 1
        idx.sent(busy, request_key(chat("other", system="other")), 0)
        key = request_key(chat("q", system="fresh " * 50))
        assert idx.choose(list(eps.values()), key).id == idle


def test_routers_that_never_saw_each_others_traffic_send_a_new_prompt_one_way():
    """Two routers, each with its own memory and its candidates in its own order: a
    prompt neither has seen goes to the same replica from both (rendezvous hashing on
    its first block), so a shared system prompt is evaluated once, not once per router.
    Prompts that differ from the first block spread over the replicas."""
    chosen = {}
    for n in range(40):
        system = f"Team {n} rules. " + "Be brief. " * 40
        key1, key2 = request_key(chat("q", system=system)), request_key(chat("r", system=system))
        one = PrefixIndex().choose([Ep("a"), Ep("b"), Ep("c")], key1)
        two = PrefixIndex().choose([Ep("c"), Ep("b"), Ep("a")], key2)
        assert one.id == two.id
        chosen[n] = one.id
    assert set(chosen.values()) == {"a", "b", "c"}


def test_decoded_tokens_weigh_what_the_engine_says_they_cost():
    idx = PrefixIndex()
    key = request_key(chat("q", system="short", max_tokens=32))
    idx.sent("a", key, 0)
    prompt_only = idx.inflight("a") - 32
    idx.served("a", key, 0, None, decode_weight=6.5)
    assert idx.decode_weight("m") == 6.5
    idx.served("a", key, 0, None, decode_weight=3.0)  # learned as a moving average
    assert 5 < idx.decode_weight("m") < 6.5
    key = request_key(chat("q", system="short", max_tokens=32))
    idx.sent("a", key, 0)
    assert idx.inflight("a") == prompt_only + 32 * idx.decode_weight("m")
    idx.served("a", key, 0, None, decode_weight=1e6)  # a nonsense figure is bounded
    assert idx.decode_weight("m") <= DECODE_WEIGHT_MAX
    assert idx.decode_weight("other") == 1.0


def test_a_decoded_tokens_cost_is_read_from_llama_server_timings():
    timings = {"prompt_n": 28, "prompt_per_token_ms": 8.0, "predicted_per_token_ms": 50.0}
    assert decode_weight({"timings": timings}) == 6.25
    assert decode_weight({"timings": {**timings, "prompt_n": 2}}) is None  # too few to time
    assert decode_weight({"timings": {**timings, "prompt_per_token_ms": 0}}) is None
    assert decode_weight({"usage": {"prompt_tokens": 3}}) is None


def test_a_shared_system_prompt_held_by_both_still_spreads_by_load():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    idx.sent("a", request_key(chat("x")), 0)
    idx.sent("b", request_key(chat("y")), 0)
    idx.served("a", request_key(chat("x")), 0, None)
    for rid in ("a", "b"):
        idx._replicas[rid].inflight = 0
    a.outstanding = 1
    assert idx.choose([a, b], request_key(chat("z"))) is b


def test_tokens_in_flight_outweigh_a_small_cache_advantage():
    idx = PrefixIndex(alpha=1.0)
    a, b = Ep("a"), Ep("b")
    key = request_key(chat("q", system="short"))
    idx.sent("a", key, 0)
    idx._replicas["a"].inflight = 5000  # a long prompt is being evaluated there
    assert idx.choose([a, b], request_key(chat("q", "r", "s", system="short"))) is b


def test_the_session_header_breaks_a_tie():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    k1 = request_key(chat("q", system="s"), session="user-7")
    first = idx.choose([a, b], k1)
    idx.served(first.id, k1, 0, None)
    unrelated = request_key({"model": "m", "prompt": "p"}, session="user-7")
    for _ in range(3):
        chosen = idx.choose([a, b], unrelated)
        idx.served(chosen.id, unrelated, 0, None)
        assert chosen is first


def test_each_replica_remembers_at_most_its_engine_cache():
    idx = PrefixIndex()
    idx.size("a", cache_tokens=2 * 512)  # two slots of 512 tokens
    cap = idx.blocks_for(1024)
    for i in range(50):
        idx.sent("a", request_key(chat(f"conversation {i}", system=f"s{i} " * 100)), 0)
    assert idx.held("a") == cap
    latest = request_key(chat("conversation 49", system="s49 " * 100))
    assert idx.match("a", latest) == len(latest.blocks)  # the newest is kept
    oldest = request_key(chat("conversation 0", system="s0 " * 100))
    assert idx.match("a", oldest) == 0  # the oldest went first


def test_every_replica_together_stays_under_the_memory_ceiling():
    idx = PrefixIndex(memory_bytes=100 * ENTRY_BYTES, default_capacity_tokens=1 << 20)
    for i in range(40):
        rid = "ab"[i % 2]
        idx.sent(rid, request_key(chat(f"q{i}", system=f"sys {i} " * 40)), 0)
    assert idx.held("a") + idx.held("b") <= 100
    assert idx.held("a") > 0 and idx.held("b") > 0


def test_the_load_guard_sends_to_the_least_loaded_and_records_the_prefix_there():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q"))
    a.outstanding, b.outstanding = 3, 0  # 3 more than b, and over 1.5× as many
    key = request_key(chat("q", "r", "s"))
    assert idx.choose([a, b], key) is b
    assert idx.match("b", key) == len(key.blocks)


def test_the_load_guard_waits_for_more_than_the_slots_of_a_replica():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q"))
    a.outstanding, b.outstanding = 3, 0
    key = request_key(chat("q", "r", "s"))
    assert idx.choose([a, b], key, slots_of=lambda ep: 4) is a  # 3 more is within 4 slots
    idx.served("a", key, 0, None)
    a.outstanding, b.outstanding = 4, 2  # 2 more, not over max(2, slots)
    assert idx.choose([a, b], request_key(chat("q", "r", "t"))) is a


def _busy_with(idx, ep, *payloads):
    """`ep` has these requests of this router in flight, each sent where it matched."""
    for payload in payloads:
        key = request_key(payload)
        idx.sent(ep.id, key, idx.match(ep.id, key))
    ep.outstanding += len(payloads)


TEAM_X, TEAM_Y = "Team x rules. " * 400, "Team y rules. " * 400  # ~1,400 tokens each


def test_the_load_guard_keeps_a_request_where_its_prompt_is_when_several_fill_it():
    """3 requests against 0, but of two prompts: moving the fourth would evaluate its
    whole prompt again on b, and a's queue drains as those conversations end."""
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q", system=TEAM_X))
    holds(idx, "a", chat("q", system=TEAM_Y))
    _busy_with(idx, a, chat("1", system=TEAM_X), chat("2", system=TEAM_X),
               chat("3", system=TEAM_Y))  # fmt: skip
    key = request_key(chat("4", system=TEAM_X))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2) is a
    assert key.matched > 0


def test_the_load_guard_moves_a_prompt_that_alone_fills_its_replica():
    """One hot prompt: every request on a shares it, and the move puts it on b too."""
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q", system=TEAM_X))
    _busy_with(idx, a, *(chat(str(i), system=TEAM_X) for i in range(3)))
    key = request_key(chat("4", system=TEAM_X))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2) is b
    assert key.matched == 0
    idx.served("b", key, 0, None)
    # b holds it now: a later request of it goes wherever the load says.
    assert idx.match("b", request_key(chat("5", system=TEAM_X))) > 0


def test_the_load_guard_moves_a_request_freely_where_the_other_replica_holds_its_prompt():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    for rid in ("a", "b"):
        holds(idx, rid, chat("q", system=TEAM_X))
    holds(idx, "a", chat("q", system=TEAM_Y))
    _busy_with(idx, a, chat("1", system=TEAM_X, max_tokens=1),
               chat("2", system=TEAM_Y, max_tokens=1),
               chat("3", system=TEAM_Y, max_tokens=1))  # fmt: skip
    # a holds one turn more of this conversation than b, under HOLD_MIN_TOKENS to
    # evaluate again: the cache favours a, the load guard moves it.
    reply = "A reply of some length. " * 25
    holds(idx, "a", chat("4", reply, system=TEAM_X))
    key = request_key(chat("4", reply, "5", system=TEAM_X))
    assert idx.match("a", key) > idx.match("b", key) > 0
    assert idx.choose([a, b], key, slots_of=lambda ep: 2) is b


def test_the_load_guard_counts_other_routers_requests_at_this_routers_share():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q", system=TEAM_X))
    holds(idx, "a", chat("q", system=TEAM_Y))
    _busy_with(idx, a, chat("1", system=TEAM_X))
    key = request_key(chat("2", system=TEAM_X))
    # a has 1 of this router's requests and 2 of others': 3 against 0. All it knows of
    # them is its own, of this prompt: counted so, the prompt alone fills a.
    others = {"a": 2, "b": 0}
    assert idx.choose([a, b], key, slots_of=lambda ep: 2,
                      others_of=lambda ep: others[ep.id]) is b  # fmt: skip
    idx.served("b", key, 0, None)
    _busy_with(idx, a, chat("3", system=TEAM_Y))  # now half of its own are of another
    others = {"a": 2, "b": 0}  # 4 against 0, 2 of them this prompt's: not over 2
    key = request_key(chat("4", system=TEAM_Y))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2,
                      others_of=lambda ep: others[ep.id]) is a  # fmt: skip


def test_requests_other_routers_have_in_flight_count_against_a_replica():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q"))
    key = request_key(chat("q", "r", "s"))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2) is a  # this router's view alone
    idx.served("a", key, 0, None)
    # The engine says a is busy with three requests of other routers: the load guard
    # sees 3 against 0, as it would had they been this router's own.
    others = {"a": 3, "b": 0}
    key = request_key(chat("q", "r", "t"))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2, others_of=lambda ep: others[ep.id]) is b


def test_other_routers_work_weighs_against_a_small_cache_advantage():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    system = "Be short. " * 30
    short = request_key(chat("q", system=system))
    idx.sent("a", short, 0)
    idx.served("a", short, 0, None)  # a holds a prompt of a few blocks; this router's
    # average request is what that one was (its prompt and max_tokens' 256)
    key = request_key(chat("q", "r", "s", system=system))
    assert idx.match("a", key) >= 2
    assert idx.choose([a, b], key) is a
    idx.served("a", key, 0, None)
    key = request_key(chat("q", "r", "t", system=system))
    assert idx.choose([a, b], key, others_of=lambda ep: 1 if ep is a else 0) is b


def test_an_engine_that_cached_far_less_than_predicted_loses_the_chain():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    k1 = request_key(chat("q"))
    idx.choose([a, b], k1)
    rid = "a" if idx.held("a") else "b"
    idx.served(rid, k1, prompt_tokens=k1.chars // 4, cached=0)
    k2 = request_key(chat("q", "r", "s"))
    assert idx.choose([a, b], k2).id == rid
    assert k2.matched > 0
    out = idx.served(rid, k2, prompt_tokens=k2.chars // 4, cached=0)
    assert out.predicted > 100 and out.actual == 0 and out.dropped > 0
    assert idx.match(rid, request_key(chat("q", "r", "s", "t", "u"))) == 0


def test_an_engine_that_cached_what_was_predicted_keeps_the_chain():
    idx = PrefixIndex()
    k1 = request_key(chat("q"))
    idx.sent("a", k1, 0)
    idx.served("a", k1, prompt_tokens=k1.chars // 4, cached=0)
    k2 = request_key(chat("q", "r", "s"))
    idx.sent("a", k2, idx.match("a", k2))
    out = idx.served("a", k2, prompt_tokens=k2.chars // 4, cached=k1.chars // 4 - 3)
    assert out.dropped == 0
    assert idx.match("a", k2) == len(k2.blocks)


def test_tokens_in_flight_are_given_back_when_a_request_ends():
    idx = PrefixIndex()
    k = request_key(chat("q"))
    idx.sent("a", k, 0)
    assert idx.inflight("a") > 0
    idx.served("a", k, 0, None)
    assert idx.inflight("a") == 0


def test_replicas_that_left_the_table_are_forgotten():
    idx = PrefixIndex()
    idx.sent("a", request_key(chat("q"), session="s"), 0)
    idx.sent("b", request_key(chat("r")), 0)
    idx.forget({"b"})
    assert idx.held("a") == 0 and idx.held("b") > 0
    assert idx._entries == idx.held("b")


def test_cached_tokens_are_read_from_usage_or_llama_server_timings():
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 12}}}) == 12
    assert cached_tokens({"usage": {"prompt_tokens": 3}, "timings": {"cache_n": 7}}) == 7
    assert cached_tokens({"usage": {"prompt_tokens": 3}}) is None


def test_at_debug_level_each_choice_says_why_and_each_outcome_what_the_engine_kept(caplog):
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q"))
    a.outstanding, b.outstanding = 3, 0
    with caplog.at_level(logging.DEBUG, logger="llmgw.router.prefix"):
        key = request_key(chat("q", "r", "s"))  # at debug level it carries its prompt's crc
        held = idx.match("a", key)
        assert 0 < held < len(key.blocks)
        assert idx.choose([a, b], key) is b  # the load guard overrides a's cache
        idx.served("b", key, prompt_tokens=key.chars // 4, cached=0)
    chose, served = (r.getMessage() for r in caplog.records)
    assert chose.startswith("prefix chose replica=b ")
    assert f"crc={key.crc}" in chose and key.crc and "load-guard" in chose
    assert f"a:matched={held}," in chose and "own=3" in chose
    assert served.startswith("prefix served replica=b ") and "cached=0" in served


def test_below_debug_level_the_choice_builds_no_trace(caplog):
    idx = PrefixIndex()
    with caplog.at_level(logging.INFO, logger="llmgw.router.prefix"):
        idx.choose([Ep("a"), Ep("b")], request_key(chat("q")))
    assert caplog.records == []


def test_block_hashes_are_alike_in_every_process():
    """Routers tell each other block hashes (share.py): str's hash() is salted per
    process, so the chain must not use it."""
    import subprocess
    import sys

    text = canonical(chat("What is a fox?", "An animal.", "And a ünïcode dog?"))
    code = "import sys; from llmgw_router.prefix import chain; print(list(chain(sys.stdin.read())))"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=text, text=True,
                             capture_output=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PYTHONIOENCODING": "utf-8"})  # fmt: skip
        assert eval(out.stdout) == list(request_key(chat("What is a fox?", "An animal.",
                                                         "And a ünïcode dog?")).blocks)  # fmt: skip


def test_what_another_router_sent_counts_as_held_there():
    idx = PrefixIndex()
    idx.forget({"a", "b"})
    a, b = Ep("a"), Ep("b")
    first = request_key(chat("q1", system="Team rules. " * 40))
    later_turn = chat("q1", "a1", "q2", system="Team rules. " * 40)
    later = request_key(later_turn)
    # This router's own pick for the later turn, knowing nothing:
    own = PrefixIndex().choose([a, b], request_key(later_turn))
    other = b if own is a else a
    # The peer sent turn 1 there (and, when it ended, said it has nothing in flight).
    idx.inbox.append(("peer", other.id, 0, 0.0, first.blocks))
    assert idx.choose([a, b], later) is other
    assert later.matched >= len(first.blocks) - 1 > 0


def test_a_peer_is_believed_only_about_replicas_of_this_routers_table():
    idx = PrefixIndex()
    idx.forget({"a", "b"})
    key = request_key(chat("q"))
    idx.learn("peer", "z", 1, 10.0, key.blocks)  # not a replica here
    idx.learn("peer", "", 0, 0.0)  # a heartbeat from a router with no replica yet
    assert idx.held("z") == 0 and idx._peer_load == {}
    idx.learn("peer", "a", 1, 10.0, key.blocks)
    assert idx.match("a", key) == len(key.blocks)


def test_peers_word_on_their_work_replaces_the_probes_and_lapses_when_they_go_silent():
    idx = PrefixIndex()
    idx.forget({"a", "b"})
    a, b = Ep("a"), Ep("b")
    holds(idx, "a", chat("q"))
    probe = {"a": 0, "b": 3}  # the engines' last word, a second old
    idx.learn("peer", "a", 3, 3000.0)  # the peer has three requests on a now
    idx.learn("peer", "b", 0, 0.0)
    key = request_key(chat("q", "r", "s"))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2, others_of=lambda ep: probe[ep.id]) is b
    idx.served("b", key, 0, None)
    idx.learn("peer", None, 0, 0.0)  # silent: its word lapses, the probe's counts again
    key = request_key(chat("q", "r", "t"))
    assert idx.choose([a, b], key, slots_of=lambda ep: 2, others_of=lambda ep: probe[ep.id]) is a


def test_each_choice_and_each_end_is_offered_to_the_peers():
    said = []
    idx = PrefixIndex(on_change=lambda *args: said.append(args))
    key = request_key(chat("q"))
    ep = idx.choose([Ep("a")], key)
    replica, requests, work, blocks = said[0]
    assert (replica, requests, blocks) == (ep.id, 1, key.blocks) and work == key.load > 0
    assert idx.loads() == {"a": (1, key.load)}
    idx.served("a", key, 0, None)
    assert said[1] == ("a", 0, 0.0, ())
    assert idx.loads() == {"a": (0, 0.0)}


def test_a_prompt_still_being_evaluated_is_waited_for_not_evaluated_beside_it():
    idx = PrefixIndex()
    a = Ep("a")
    first = request_key(chat("q1"))
    assert idx.choose([a], first) is a and first.holder is None  # nothing there yet
    second = request_key(chat("q2"))  # the same system prompt, first still in flight
    assert idx.choose([a], second) is a
    assert second.holder is first
    idx.served("a", first, 0, None)
    third = request_key(chat("q3"))  # the system prompt is in the engine now
    idx.choose([a], third)
    assert third.holder is None
    # The second's own blocks are pending: a later turn of its conversation sent while
    # it is in flight shares only its short tail (< HOLD_MIN_TOKENS) beyond the system
    # prompt, which is no longer pending: nothing to wait for.
    idx.choose([a], later := request_key(chat("q2", "r2", "q2b")))
    assert later.holder is None


def test_a_short_shared_prefix_is_not_worth_waiting_for():
    idx = PrefixIndex()
    a = Ep("a")
    idx.choose([a], request_key(chat("q1", system="Be brief. " * 20)))  # ~200 chars
    second = request_key(chat("q2", system="Be brief. " * 20))
    idx.choose([a], second)
    assert second.holder is None


def _waiting(idx, a):
    first = request_key(chat("q1"))
    idx.choose([a], first)
    second = request_key(chat("q2"))
    idx.choose([a], second)
    assert second.holder is first
    return first, second


def test_the_wait_ends_when_the_other_request_ends():
    async def scenario():
        idx, a = PrefixIndex(), Ep("a")
        first, second = _waiting(idx, a)
        # It took a minute to start answering: the wait it allows once answering (a share
        # of that) outlasts this test. Sent just now, the allowance was as long as the
        # test's own steps took, and a fast run ended the wait before the first ended.
        first.sent_at = asyncio.get_running_loop().time() - 60
        task = asyncio.ensure_future(hold(second, 20))
        for _ in range(5):  # it waits on an event, not a clock: give it turns
            await asyncio.sleep(0)
        assert not task.done()
        answered(first, asyncio.get_running_loop().time())  # prompt evaluated, answering
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()  # the slot's prompt reaches the cache when it ends
        idx.served("a", first, 0, None)
        waited = await asyncio.wait_for(task, 5)
        assert 0 <= waited < 20 and second.holder is None

    asyncio.run(scenario())


def test_a_long_answer_ahead_is_not_waited_out():
    async def scenario():
        idx, a = PrefixIndex(), Ep("a")
        first, second = _waiting(idx, a)
        now = asyncio.get_running_loop().time()
        # It took 0.2 s to start answering and is still answering: wait at most half that.
        first.sent_at, first.answered_at = now - 0.2, now
        waited = await asyncio.wait_for(hold(second, 20), 5)
        assert waited < 1 and not first.ended
        # Answering for long already: no wait at all.
        third = request_key(chat("q3"))
        idx.choose([a], third)
        first.sent_at, first.answered_at = now - 20, now - 10
        assert third.holder is first
        assert await asyncio.wait_for(hold(third, 20), 5) < 0.05

    asyncio.run(scenario())


def test_a_retry_elsewhere_makes_the_request_a_holder_again():
    idx = PrefixIndex()
    a, b = Ep("a"), Ep("b")
    first = request_key(chat("q1"))
    idx.choose([a], first)
    idx.served("a", first, 0, None)  # failed there
    assert first.ended
    idx.choose([b], first)  # the retry
    assert not first.ended
    second = request_key(chat("q2"))
    idx.choose([b], second)
    assert second.holder is first


def test_a_router_told_never_to_wait_does_not():
    idx = PrefixIndex(hold_s=0)
    a = Ep("a")
    idx.choose([a], request_key(chat("q1")))
    second = request_key(chat("q2"))
    idx.choose([a], second)
    assert second.holder is None


def test_a_miss_while_another_request_used_the_prefix_keeps_the_chain():
    """llama-server keeps a prompt in the slot that last had it: a second request of a
    group, sent while the first has that slot, evaluates the prompt again though the
    engine holds it. That miss says nothing about what the engine keeps."""
    idx = PrefixIndex()
    a = Ep("a")
    holds(idx, "a", chat("q"))
    first = request_key(chat("q", "r", "s"))
    second = request_key(chat("q", "r", "t"))
    idx.choose([a], first)
    idx.choose([a], second)
    assert second.contended and not first.contended
    out = idx.served("a", second, 500, 0)
    assert out.dropped == 0
    assert idx.match("a", second) == len(second.blocks)  # the chain stays whole
    # The same miss with nothing else in flight drops the chain.
    idx.served("a", first, 500, 480)
    third = request_key(chat("q", "r", "v"))
    idx.choose([a], third)
    assert not third.contended
    assert idx.served("a", third, 500, 0).dropped > 0
