"""What an engine says a request cost: usage objects of every API read alike, and
llama-server's prompt-progress events taken out of a stream with what they say."""

import json

from llmgw_router import sse, tokens

# As llama-server 0.3.36 sends them with "return_progress": true (captured).
CHAT_PROGRESS = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
    b'"content":null}}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk",'
    b'"prompt_progress":{"total":18,"cache":4,"processed":4,"time_ms":0}}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
    b'"content":null}}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk",'
    b'"prompt_progress":{"total":18,"cache":4,"processed":18,"time_ms":83}}\n\n'
)
CHAT_FIRST = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
    b'"content":null}}],"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Say"}}],'
    b'"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}\n\n'
)


def responses_event(kind: str, **extra) -> bytes:
    data = {"type": kind, "response": {"id": "r", "object": "response", "status": "in_progress"}}
    data.update(extra)
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


PROGRESS = {"prompt_progress": {"total": 30, "cache": 0, "processed": 0, "time_ms": 0}}


def test_usage_of_every_api_says_the_whole_prompt_and_what_the_cache_held():
    chat = {
        "prompt_tokens": 18,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    assert tokens.counts(chat) == (18, 5, 12)
    responses = {
        "input_tokens": 18,
        "output_tokens": 5,
        "input_tokens_details": {"cached_tokens": 12},
    }
    assert tokens.counts(responses) == (18, 5, 12)
    # llama-server's Messages: input_tokens = prompt - cached
    anthropic = {"cache_read_input_tokens": 12, "input_tokens": 6, "output_tokens": 5}
    assert tokens.counts(anthropic) == (18, 5, 12)
    written = {"input_tokens": 6, "cache_creation_input_tokens": 100, "output_tokens": 0}
    assert tokens.counts(written) == (106, 0, None)
    assert tokens.counts({"output_tokens": 9}) == (None, 9, None)  # a message_delta
    assert tokens.counts({"prompt_tokens": True, "completion_tokens": "7"}) == (None, None, None)


def test_progress_is_asked_for_once_and_never_over_a_clients_own_asking():
    body = b' {"model":"m","stream":true}'
    assert tokens.ask_progress(body) == b' {"return_progress":true,"model":"m","stream":true}'
    assert json.loads(tokens.ask_progress(body))["return_progress"] is True
    assert tokens.ask_progress(b'{"return_progress":false,"model":"m"}') is None
    assert tokens.ask_progress(b"[1]") is None


def test_only_llama_cpp_streams_other_than_its_own_messages_ask_for_progress():
    assert tokens.wants_progress("llama.cpp", native=False, dialect=None)
    assert tokens.wants_progress("llama.cpp", native=False, dialect="anthropic")  # as chat
    assert tokens.wants_progress("llama.cpp", native=True, dialect="responses")
    assert not tokens.wants_progress("llama.cpp", native=True, dialect="anthropic")
    assert not tokens.wants_progress("vllm", native=False, dialect=None)
    assert not tokens.wants_progress(None, native=False, dialect=None)  # a static endpoint


def take(p: tokens.Progress, block: bytes) -> bytes:
    """The block as the router relays it, progress taken out (events from sse.split)."""
    return b"".join(e + b"\n\n" for e in p.take(sse.split(block)))


def test_a_chat_streams_progress_events_are_taken_out_and_their_count_kept():
    p = tokens.Progress()
    assert take(p, CHAT_PROGRESS) == b""
    assert (p.total, p.cached) == (18, 4)
    assert take(p, CHAT_FIRST) == CHAT_FIRST  # the role comes again with the first token
    assert (p.total, p.cached) == (18, 4)


def test_progress_mixed_with_content_in_one_block_leaves_the_content_as_it_came():
    p = tokens.Progress()
    block = CHAT_FIRST[: CHAT_FIRST.index(b"\n\n") + 2] + CHAT_PROGRESS + CHAT_FIRST
    assert take(p, block) == CHAT_FIRST[: CHAT_FIRST.index(b"\n\n") + 2] + CHAT_FIRST
    assert p.total == 18


def test_a_responses_stream_keeps_its_first_in_progress_event_without_the_progress():
    p = tokens.Progress()
    created = responses_event("response.created")
    first = created + responses_event("response.in_progress", **PROGRESS)
    assert take(p, first) == created + responses_event("response.in_progress")
    assert p.total == 30
    assert take(p, responses_event("response.in_progress", **PROGRESS)) == b""
