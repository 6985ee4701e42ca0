"""Server-sent events of an OpenAI chat stream, read by the translations to other APIs."""

import json
from collections.abc import Iterator


def chat_chunks(block: bytes) -> Iterator[dict | None]:
    """Each chat chunk in `block` (whole events), decoded; None for `data: [DONE]`.
    Comments, other fields and events that are not JSON are skipped."""
    for event in block.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data:"):
            continue
        data = event[5:].strip()
        if data == b"[DONE]":
            yield None
            continue
        try:
            yield json.loads(data)
        except ValueError:
            continue
