"""The Responses API's state, which is the router's (engines are stateless): responses
made with `store` true, kept in memory at once and written to the store off the request
path, looked up for previous_response_id, GET, input_items and DELETE.

A router finds a response it has just made in its own memory before the writer has
committed it, so a continuation sent right after the create works; any other router
sharing the store finds it there once committed. Store reads run on one thread of
their own (one connection for its life), never on the event loop.
"""

import asyncio
import collections
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmgw import log
from llmgw.store import StoredResponse
from llmgw.worker import Worker

_log = log.get("llmgw.router.responses")

# Writes waiting for the store past this many are dropped (and said once): a store
# that is down must not take the router's memory with it.
_MAX_PENDING = 100_000


@dataclass
class Saved:
    """One stored response: its own input items, the conversation's items before them,
    and the response object as the client had it."""

    id: str
    key_id: str
    created_at: float
    model: str
    previous_id: str | None
    input: list
    context: list
    body: dict


class Conversations:
    def __init__(self, db, cache_size: int = 2048, flush_s: float = 0.2):
        self.db = db
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[str, Saved] = collections.OrderedDict()
        self._ops: collections.deque = collections.deque()  # ("put", Saved) | ("delete", id)
        self._lock = threading.Lock()
        self._gone: set[str] = set()  # deleted here, perhaps not yet in the store
        self._dropped = 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="responses_read")
        self.worker = Worker(
            "responses_write", self._tick, flush_s, db=db, logger=_log, on_stop=self._tick
        )

    # -- on the event loop -------------------------------------------------------------------

    def put(self, saved: Saved) -> None:
        self._cache[saved.id] = saved
        self._cache.move_to_end(saved.id)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        self._queue(("put", saved))

    async def get(self, rid: str, key_id: str) -> Saved | None:
        """The response, if `key_id` made it (another key's is not there, for it)."""
        if rid in self._gone:
            return None
        saved = self._cache.get(rid)
        if saved is None:
            loop = asyncio.get_running_loop()
            saved = await loop.run_in_executor(self._reader, self._load, rid)
            if saved is None or rid in self._gone:
                return None
        return saved if saved.key_id == key_id else None

    def delete(self, rid: str) -> None:
        self._cache.pop(rid, None)
        self._gone.add(rid)
        self._queue(("delete", rid))

    def _queue(self, op) -> None:
        with self._lock:
            if len(self._ops) >= _MAX_PENDING:
                if self._dropped == 0:
                    _log.error("responses_pending_full", capacity=_MAX_PENDING)
                self._dropped += 1
                return
            self._ops.append(op)
        self.worker.wake()

    # -- threads -------------------------------------------------------------------------------

    def _load(self, rid: str) -> Saved | None:
        row = StoredResponse.get_or_none(StoredResponse.id == rid)
        if row is None:
            return None
        return Saved(
            row.id,
            row.key_id,
            row.created_at,
            row.model,
            row.previous_id,
            json.loads(row.input),
            json.loads(row.context),
            json.loads(row.body),
        )

    def _tick(self) -> None:
        with self._lock:
            ops = list(self._ops)
            self._ops.clear()
        if not ops:
            return
        try:
            with self.db.atomic():
                for kind, what in ops:
                    if kind == "put":
                        StoredResponse.insert(
                            id=what.id,
                            key_id=what.key_id,
                            created_at=what.created_at,
                            model=what.model[:200],
                            previous_id=what.previous_id,
                            input=json.dumps(what.input),
                            context=json.dumps(what.context),
                            body=json.dumps(what.body),
                        ).on_conflict_ignore().execute()
                    else:
                        StoredResponse.delete().where(StoredResponse.id == what).execute()
        except Exception:
            with self._lock:
                self._ops.extendleft(reversed(ops))  # for the next try, in order
            raise
        for kind, what in ops:
            if kind == "delete":
                self._gone.discard(what)

    def pending(self) -> int:
        return len(self._ops)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self._reader.shutdown(wait=False)
