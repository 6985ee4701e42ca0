"""Byte edits on the request path, made without parsing and serialising JSON: every answer
names the served model (`set_model`), a client that asked no usage gets none
(`without_usage`), and a streamed request asks the engine for usage (`ask_usage`).

Each is sound on valid JSON by one argument (set_model's docstring), and property-tested
against parsing and serialising (tests/unit/test_splice.py).
"""

import functools
import json

_MODEL_KEY = b'"model"'


@functools.lru_cache(maxsize=1024)
def model_field(name: str) -> bytes:
    """The `"model":"NAME"` an answer should carry, as bytes to splice in."""
    return b'"model":' + json.dumps(name).encode()


def set_model(data: bytes, field: bytes) -> bytes:
    """Every `"model": "..."` member of the JSON in `data` (one answer, or a block of SSE
    events) set to `field` (from model_field), without parsing or re-serialising.

    Sound on valid JSON: a `"` that no backslash escapes always opens or closes a
    string, and a string followed by `:` is a member's name, so an unescaped
    `"model"` then `:` is that member and never text inside a string (where its quotes
    would be escaped). Only string values are replaced; a member already holding the
    name is left alone, so an engine started with the served name as its alias costs a
    search and a comparison.

    The usual block is one engine's events, every member naming the model alike: when
    each `"model"` in it is where `field` (or the engine's one name for it) begins, it
    is one bytes.replace (or nothing), done in C. A quote before `model` that a
    backslash escapes could begin a name that only ends in `model`; such a block takes
    the careful way.
    """
    n = data.count(_MODEL_KEY)
    if n == 0 or n == data.count(field):
        return data
    if _ESCAPED_MODEL_KEY not in data:
        i = data.find(_MODEL_KEY)
        end = _member_end(data, i)
        if end > 0:
            engines = data[i:end]
            if data.count(engines) == n:
                return data.replace(engines, field)
    return _set_model_each(data, field)


_ESCAPED_MODEL_KEY = b'\\"model"'


def _member_end(data: bytes, i: int) -> int:
    """Just past the string value of the `"model"` member whose name's quote is at `i`
    (-1: it is not a member with a string value, or the bytes are not JSON)."""
    if not _unescaped(data, i):
        return -1
    n = len(data)
    j = i + len(_MODEL_KEY)
    while j < n and data[j] in b" \t\r\n":
        j += 1
    if j >= n or data[j] != 0x3A:  # ':'
        return -1
    j += 1
    while j < n and data[j] in b" \t\r\n":
        j += 1
    if j >= n or data[j] != 0x22:  # '"'
        return -1
    return _string_end(data, j)


def _set_model_each(data: bytes, field: bytes) -> bytes:
    """set_model, one member at a time."""
    out = None
    pos = pos_done = 0
    n = len(data)
    while (i := data.find(_MODEL_KEY, pos)) >= 0:
        pos = i + len(_MODEL_KEY)
        b = i - 1
        while b >= 0 and data[b] == 0x5C:  # backslashes before the quote
            b -= 1
        if (i - 1 - b) % 2:
            continue  # an escaped quote: text inside a string
        j = pos
        while j < n and data[j] in b" \t\r\n":
            j += 1
        if j >= n or data[j] != 0x3A:  # ':'
            continue  # the string "model" as a value, not a member's name
        j += 1
        while j < n and data[j] in b" \t\r\n":
            j += 1
        if j >= n or data[j] != 0x22:  # '"': only string values are replaced
            continue
        end = j + 1
        while True:
            end = data.find(b'"', end)
            if end < 0:  # not JSON after all: leave the rest as it came
                return data if out is None else b"".join(out) + data[pos_done:]
            k = end - 1
            while data[k] == 0x5C:
                k -= 1
            if (end - 1 - k) % 2 == 0:
                break
            end += 1
        end += 1  # past the closing quote
        if data[i:end] == field:
            pos = end
            continue
        if out is None:
            out = []
        out.append(data[pos_done:i])
        out.append(field)
        pos_done = pos = end
    return data if out is None else b"".join(out) + data[pos_done:]


_USAGE_KEY = b'"usage"'
_WS = b" \t\r\n"


def _unescaped(data: bytes, quote: int) -> bool:
    """The `"` at `quote` is not escaped by a backslash."""
    b = quote - 1
    while b >= 0 and data[b] == 0x5C:
        b -= 1
    return (quote - 1 - b) % 2 == 0


def _string_end(data: bytes, start: int) -> int:
    """Just past the string whose opening quote is at `start` (-1: it does not end)."""
    end = start + 1
    while (end := data.find(b'"', end)) >= 0:
        if _unescaped(data, end):
            return end + 1
        end += 1
    return -1


def _object_end(data: bytes, start: int) -> int:
    """Just past the JSON object whose `{` is at `start`, braces in strings skipped
    (-1: it does not end)."""
    depth, i, n = 0, start, len(data)
    while i < n:
        c = data[i]
        if c == 0x22:
            i = _string_end(data, i)
            if i < 0:
                return -1
            continue
        if c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def without_usage(event: bytes) -> bytes | None:
    """`event` (one `data: {...}` SSE event whose top-level `usage` is an object) with
    that member cut out of the bytes; None where that cannot be told from the bytes
    alone (the caller then parses and re-serialises).

    Sound on valid JSON, by set_model's argument: an unescaped `"usage"` followed by `:`
    is a member's name, never text in a string. The caller knows (it parsed the event)
    that the top level has one holding an object, so if the bytes hold exactly one such
    name, it is that member, and its value runs from its `{` to the matching `}`. Cutting
    the name, the value and one comma beside them leaves the same object without
    `usage`, each other member's bytes as the engine wrote them: what json.dumps would
    write for it whenever the engine writes compact JSON, as engines do (the unit test
    checks this over the captured streams)."""
    found = -1
    pos = 0
    while (i := event.find(_USAGE_KEY, pos)) >= 0:
        pos = i + len(_USAGE_KEY)
        if not _unescaped(event, i):
            continue
        j = pos
        while j < len(event) and event[j] in _WS:
            j += 1
        if j >= len(event) or event[j] != 0x3A:
            continue  # "usage" as a value
        if found >= 0:
            return None  # a second member named usage, at some depth: cannot tell which
        found = i
        value = j + 1
    if found < 0:
        return None
    while value < len(event) and event[value] in _WS:
        value += 1
    if value >= len(event) or event[value] != 0x7B:
        return None
    end = _object_end(event, value)
    if end < 0:
        return None
    after = end
    while after < len(event) and event[after] in _WS:
        after += 1
    if after < len(event) and event[after] == 0x2C:  # a member follows: take its comma
        return event[:found] + event[after + 1 :].lstrip(_WS)
    before = found - 1
    while before >= 0 and event[before] in _WS:
        before -= 1
    if before >= 0 and event[before] == 0x2C:  # the last member: take the comma before
        return event[:before] + event[end:]
    return None  # the only member: not a chunk worth keeping as it is


_ASK_USAGE = b'"stream_options":{"include_usage":true},'


def ask_usage(body: bytes) -> bytes | None:
    """A request body (a JSON object with members, and no `stream_options`) asking for
    the stream's usage, spliced in as its first member; None if it does not start like
    an object (the caller serialises the payload instead). Both mean the same object to
    the engine: only a new member is added, and the object had none of that name."""
    return first_member(body, _ASK_USAGE)


def first_member(body: bytes, member: bytes) -> bytes | None:
    """`member` (`"name":value,`) spliced in as the first member of the JSON object in
    `body`, which has members and none of that name; None if it does not start like an
    object."""
    i = 0
    while i < len(body) and body[i] in b" \t\r\n":
        i += 1
    if i >= len(body) or body[i] != 0x7B:
        return None
    return body[: i + 1] + member + body[i + 1 :]
