"""API keys in memory: the request path checks a key with (at most) one hash and a dict
lookup.

A background worker mirrors the store's keys into memory and then polls for changes
(`updated_at` moves on create and revoke), on the one store connection it keeps, so a
new or revoked key is seen within `refresh_s`. The mirror is complete, so an unknown key
is rejected without asking the store: a flood of bad keys costs a hash each and never
reaches the database.
"""

import threading
from dataclasses import dataclass

from llmgw import apikeys, log
from llmgw.store import ApiKey
from llmgw.worker import Worker

_log = log.get("llmgw.router.keys")

# Rows written by another process can commit with an updated_at a little older than
# the newest one we have already seen; re-reading this window catches them.
_OVERLAP_S = 10.0
_DIGESTS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Key:
    id: str
    models: frozenset | None  # None: every model
    expires_at: float | None
    user: str | None = None
    project: str | None = None
    band: str = ""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyCache:
    def __init__(self, refresh_s: float = 2.0):
        self.refresh_s = refresh_s
        self._by_hash: dict[str, Key] = {}
        self._digests: dict[str, str] = {}  # secret -> its hash, for the keys in use
        self._since = 0.0
        self.loaded = threading.Event()
        self.worker: Worker | None = None

    def lookup(self, secret: str) -> Key | None:
        # A client sends the same key on every request: its digest is remembered (a
        # bounded dict, emptied when full, so a flood of made-up keys costs what it did),
        # and the key itself is looked up each time, so a revocation applies at once.
        digest = self._digests.get(secret)
        if digest is None:
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            digest = self._digests[secret] = apikeys.hash_secret(secret)
        return self._by_hash.get(digest)

    def __len__(self) -> int:
        return len(self._by_hash)

    def apply(self, rows) -> None:
        """Fold changed rows into the mirror (rows: ApiKey-like objects)."""
        by_hash = dict(self._by_hash)
        for row in rows:
            if row.revoked_at is not None:
                by_hash.pop(row.secret_hash, None)
            else:
                models = frozenset(row.model_list) or None
                by_hash[row.secret_hash] = Key(
                    row.id, models, row.expires_at, row.user, row.project, row.band or ""
                )
            self._since = max(self._since, row.updated_at)
        # Swap in one assignment: lookups on the event loop never see a half-built dict.
        self._by_hash = by_hash

    def refresh(self) -> None:
        since = self._since - _OVERLAP_S if self._since else -1.0
        rows = list(ApiKey.select().where(ApiKey.updated_at >= since))
        if rows:
            self.apply(rows)
        self.loaded.set()

    def start(self, db) -> None:
        # The store may be down: the worker says so once, and we keep the keys we have.
        self.worker = Worker("keys_refresh", self.refresh, self.refresh_s, db=db, logger=_log)
        self.worker.start()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
