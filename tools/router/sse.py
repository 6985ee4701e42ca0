"""Server-sent events: the router's one framer, reader and writer.

Every stream the router reads (an engine's chat or completions stream, another API's
stream passed through, the chat stream a translation reads, the last block the Responses
store keeps) is cut into events here, and every event the router writes (translated
streams, in-band errors, keepalives) is written here, so there is one rule for what an
event is. The rules are the HTML standard's for `text/event-stream`:

- a line ends with CRLF, LF or CR (CRLF is the default of common SSE servers; seen: an
  engine framed that way was answered 502, since every reader split on LF LF only);
- a blank line ends an event; a stream that ends before it has no such event;
- a line that starts with `:` is a comment;
- `name: value`, one space after the colon dropped if there is one (`data:x` is `x`);
- an event's `data` lines join with LF; `event` names it (unnamed: a message); `id`
  sets its id.

Which events end a stream, and what they cost, is the reader's (meter.py): a stream has
ended only on a whole event that is its API's end, never on bytes found inside one (a
model asked to repeat `data: [DONE]` once ended its own stream's accounting).
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass

_LF = b"\n"
_CR = b"\r"


class Framer:
    """Bytes in as they arrive, whole events out.

    Each event comes out as its lines joined by LF, without the blank line that ended
    it: CR and CRLF line ends are read as LF, so the same events come out however they
    were framed and however the bytes were cut. A CR at the end of a piece is held until
    the next piece says whether an LF follows it."""

    __slots__ = ("_tail",)

    def __init__(self):
        self._tail = b""

    def feed(self, piece: bytes) -> list[bytes]:
        buf = self._tail + piece if self._tail else piece
        held = b""
        if _CR in buf:
            if buf.endswith(_CR):
                buf, held = buf[:-1], _CR
            buf = buf.replace(b"\r\n", _LF).replace(_CR, _LF)
        parts = buf.split(b"\n\n")
        self._tail = parts.pop() + held
        if len(parts) == 1:  # the usual piece: one event
            one = parts[0]
            if one[:1] == _LF:
                one = one.lstrip(_LF)
            return [one] if one else []
        events = []
        for one in parts:
            if one[:1] == _LF:  # blank lines beyond the one that ended the last event
                one = one.lstrip(_LF)
            if one:
                events.append(one)
        return events

    def close(self) -> list[bytes]:
        """The stream's end: a CR held back was a line end, and the events it completes
        come out; an event still without its blank line is dropped, as the standard
        says (`pending` tells whether there was one)."""
        if not self._tail.endswith(_CR):
            return []
        self._tail = self._tail[:-1] + _LF
        return self.feed(b"")

    @property
    def pending(self) -> bool:
        """Some of an event came, and not its end (at the stream's end, it is dropped)."""
        return bool(self._tail.strip(b"\r\n"))


def split(block: bytes) -> list[bytes]:
    """The whole events in `block` (a piece of a stream that ends on an event's end)."""
    return Framer().feed(block)


@dataclass(slots=True)
class Event:
    """One event's fields: `name` ("" for an unnamed one), `data` (None: no data
    line), `id` (None: none)."""

    name: str
    data: bytes | None
    id: bytes | None

    def json(self):
        """The data, decoded as JSON; None if it is not JSON."""
        if self.data is None:
            return None
        try:
            return json.loads(self.data)
        except ValueError:
            return None


def parse(event: bytes) -> Event:
    """The fields of one event as Framer gives it (lines joined by LF)."""
    name, data, ident = "", None, None
    for line in event.split(_LF):
        if not line or line[0] == 0x3A:  # ':' a comment
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            data = value if data is None else data + _LF + value
        elif field == b"event":
            name = value.decode(errors="replace")
        elif field == b"id" and b"\0" not in value:
            ident = value
    return Event(name, data, ident)


def data_of(event: bytes) -> bytes | None:
    """The data of one event; quick for the usual `data: …` on one line."""
    if event.startswith(b"data: ") and _LF not in event:
        return event[6:]
    return parse(event).data


DONE = b"[DONE]"  # the data of the event that ends an OpenAI stream


def chat_chunks(events: list[bytes]) -> Iterator[dict | None]:
    """Each chunk of an OpenAI chat stream in `events`, decoded; None for its end
    (`[DONE]`). Comments, events without data and data that is not JSON are skipped."""
    for one in events:
        data = data_of(one)
        if data is None:
            continue
        if data == DONE:
            yield None
            continue
        try:
            yield json.loads(data)
        except ValueError:
            continue


# -- writing ---------------------------------------------------------------------------


def event(data: bytes, name: str = "") -> bytes:
    """One event, ended: `event: NAME` when named, and a `data:` line per line of data."""
    if _LF in data or _CR in data:
        lines = data.replace(b"\r\n", _LF).replace(_CR, _LF).split(_LF)
        body = b"".join(b"data: " + line + _LF for line in lines)
    else:
        body = b"data: " + data + _LF
    if name:
        return b"event: " + name.encode() + _LF + body + _LF
    return body + _LF


def json_event(obj, name: str = "") -> bytes:
    """One event whose data is `obj` as JSON (one line: JSON escapes line ends)."""
    return event(json.dumps(obj).encode(), name)


def comment(text: bytes) -> bytes:
    return b": " + text + b"\n\n"


KEEPALIVE = comment(b"keepalive")


def join(events: list[bytes]) -> bytes:
    """Events as Framer gave them, framed again (LF line ends) to be written on."""
    if len(events) == 1:
        return events[0] + b"\n\n"
    return b"\n\n".join(events) + b"\n\n"
