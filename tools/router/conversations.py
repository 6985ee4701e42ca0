"""The Responses API's state, which is the router's (engines are stateless): responses
made with `store` true, kept in memory at once and written to the store off the request
path, looked up for previous_response_id, GET, input_items and DELETE.

Each response is kept with its own turn only (its input and the answer) and the id of
the response it continues, so a conversation of n turns is n rows, not n² items: a
continuation walks the chain back (`chain`), bounded by `router.responses_chain_max`.

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
from llmgw_router.errors import ChainBroken, ChainTooLong

_log = log.get("llmgw.router.responses")

_COLUMNS = "id, key_id, created_at, model, previous_id, input, context, body"
_JOINED = ", ".join(f"r.{c}" for c in _COLUMNS.split(", "))

# Writes waiting for the store past this many are dropped (and said once): a store
# that is down must not take the router's memory with it.
_MAX_PENDING = 100_000


@dataclass
class Saved:
    """One stored response: the response it continues (`previous_id`, None for a
    conversation's first), its own input items, and the response object as the client
    had it. `context` is empty but for a response stored before m016 whose previous one
    was already gone, or one a router from before m016 stored: there it holds the whole
    conversation before it, and the chain ends there."""

    id: str
    key_id: str
    created_at: float
    model: str
    previous_id: str | None
    input: list
    context: list
    body: dict


class Conversations:
    def __init__(self, db, cache_size: int = 2048, flush_s: float = 0.2, chain_max: int = 256):
        self.db = db
        self.cache_size = cache_size
        self.chain_max = chain_max
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

    async def chain(self, rid: str, key_id: str, most: int) -> list[Saved] | None:
        """`rid` and the responses it continues, newest first, back to the conversation's
        first; None if `key_id` has no response `rid`. ChainTooLong if that is more than
        `most` responses, ChainBroken if one of them is gone (deleted). The cache answers
        as far back as it holds the chain; the rest is one query on the reader thread."""
        found: list[Saved] = []
        loaded: dict[str, Saved] | None = None
        want = rid
        while want is not None:
            if len(found) == most:
                raise ChainTooLong(rid, most)
            saved = None if want in self._gone else self._cache.get(want)
            if saved is None and loaded is None and want not in self._gone:
                loop = asyncio.get_running_loop()
                rows = await loop.run_in_executor(
                    self._reader, self._load_chain, want, most - len(found)
                )
                loaded = {s.id: s for s in rows}
            if saved is None and loaded is not None and want not in self._gone:
                saved = loaded.get(want)
            if saved is None or saved.key_id != key_id:
                if not found:
                    return None
                raise ChainBroken(found[-1].id, want)
            found.append(saved)
            # A context is the whole conversation before it (m016 kept it where the
            # previous response was gone; a router from before m016 still writes one).
            want = None if saved.context else saved.previous_id
        return found

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

    def _load_chain(self, rid: str, most: int) -> list[Saved]:
        """`rid` and the rows it continues, at most `most` of them, as far as the store
        has them: one recursive query, however long the chain."""
        p = self.db.param
        table = StoredResponse._meta.table_name
        sql = (
            f"WITH RECURSIVE chain ({_COLUMNS}, depth) AS ("
            f" SELECT {_COLUMNS}, 1 FROM {table} WHERE id = {p}"
            f" UNION ALL SELECT {_JOINED}, chain.depth + 1 FROM {table} r"
            f" JOIN chain ON r.id = chain.previous_id"
            f" WHERE chain.depth < {p} AND chain.context = '[]')"
            f" SELECT {_COLUMNS} FROM chain ORDER BY depth"
        )
        rows = self.db.execute_sql(sql, (rid, most)).fetchall()
        return [
            Saved(rid_, key, at, model, prev, json.loads(inp), json.loads(ctx), json.loads(body))
            for rid_, key, at, model, prev, inp, ctx, body in rows
        ]

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
