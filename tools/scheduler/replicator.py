"""The replication worker: copies into this scheduler's own disk every mirror blob and
published release the store names and it lacks, from a peer scheduler that has them.

Why: the mirror and the releases lived on the leading scheduler's disk only. In a
trial with a disk per machine, after a failover the new leader's `llmgw weights` said
`mirrored` while its mirror directory was empty, and an agent got 404 blob_not_found.

Every scheduler runs it, leader and standby alike (a leader can lack something too:
one whose disk was replaced). It runs on its own thread, never on a request's path.
Peers are the other schedulers in the store's `schedulers` rows (their admin URLs),
the leader first; each is asked over its admin API with a token derived from the
cluster secret (mirror.peer_token). A copy goes into a `.partial` file that a later
try continues with Range, is checked against its sha256 before it is renamed into
place (a bad one is deleted and counted), and a copy that fails is tried again with
backoff up to scheduler.replicate_backoff_max_s, never in a hot loop.
"""

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests
import urllib3

from llmgw import lease, log, mirror
from llmgw.errors import ConfigError, Error, Invalid
from llmgw.mirror import File, Mirror, files_from
from llmgw.reconciler import Backoff, after_failure
from llmgw.releases import ReleaseDir, wheel_version
from llmgw.store import MirroredWeights, PublishedRelease, SchedulerSeen
from llmgw.worker import Worker, first_line
from llmgw_scheduler import metrics, replication
from llmgw_scheduler.replication import BLOB, Item, Peer

_log = log.get("llmgw.scheduler.replication")

CHUNK = 1 << 20
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
# A scheduler silent this long is not asked: it is gone, and asking costs a timeout.
PEER_MAX_AGE_S = 600.0


class TransferError(Error):
    """A peer did not give a whole blob; `reason` names why (the failures counter's label).
    What arrived stays in the `.partial` file for the next try to continue."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Corrupt(TransferError):
    """What a peer gave does not hash to the sha256 it must: deleted, never kept."""

    def __init__(self, message: str):
        super().__init__(message, "corrupt")


def check_timings(cfg) -> None:
    s = cfg.scheduler
    if not 0 < s.replicate_s <= s.replicate_backoff_max_s:
        raise ConfigError(
            f"scheduler.replicate_s ({s.replicate_s:g}) must be > 0 and at most"
            f" replicate_backoff_max_s ({s.replicate_backoff_max_s:g})"
        )


def _hash_prefix(path: Path, length: int):
    digest = hashlib.sha256()
    if length:
        with open(path, "rb") as f:
            left = length
            while left and (block := f.read(min(CHUNK, left))):
                digest.update(block)
                left -= len(block)
    return digest


def transfer(url: str, headers: dict, partial: Path, sha256: str, size: int, *,
             verify=True, stopping: Callable[[], bool] = lambda: False,
             received: Callable[[int], None] = lambda n: None) -> None:  # fmt: skip
    """Fetch `url` into `partial` until it holds the `size` bytes whose sha256 is
    `sha256`, continuing a partial file that an earlier try left (Range). Returns when
    it does; TransferError keeps what arrived, Corrupt deletes it."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        have = replication.resume_from(partial.stat().st_size, size)
    except FileNotFoundError:
        have = 0
    if have == 0:
        partial.unlink(missing_ok=True)
    digest = _hash_prefix(partial, have)
    if have < size:
        ask = {**headers, **({"Range": f"bytes={have}-"} if have else {})}
        try:
            with requests.get(url, headers=ask, stream=True, verify=verify,
                              timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as r:  # fmt: skip
                start = replication.range_start(r.status_code, r.headers.get("Content-Range"))
                if r.status_code == 404:
                    raise TransferError(f"{url}: the peer does not have it", "absent")
                if start is None or start not in (0, have):
                    raise TransferError(f"{url}: HTTP {r.status_code} {r.text[:200]}",
                                        "peer_error")  # fmt: skip
                if start == 0 and have:  # the peer sent it whole: begin again
                    have, digest = 0, hashlib.sha256()
                with open(partial, "ab" if have else "wb") as out:
                    # read1: whatever has arrived, so a cut loses nothing that came
                    # (iter_content's whole-chunk reads dropped the last one's bytes).
                    while block := r.raw.read1(CHUNK):
                        if stopping():
                            raise TransferError(f"{url}: stopped at {have} of {size}", "cut")
                        if have + len(block) > size:
                            partial.unlink(missing_ok=True)
                            raise Corrupt(f"{url}: more than the {size} bytes it must be")
                        digest.update(block)
                        out.write(block)
                        have += len(block)
                        received(len(block))
        except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
            raise TransferError(f"{url}: {type(e).__name__}: {first_line(e)}",
                                "cut" if have else "peer_error") from None  # fmt: skip
    if have != size:
        raise TransferError(f"{url}: ended at {have} of {size} bytes", "cut")
    got = digest.hexdigest()
    if got != sha256:
        partial.unlink(missing_ok=True)
        raise Corrupt(f"{url}: sha256 {got}, not {sha256}: deleted")


class Replicator:
    """The worker. `leading()`: whether this scheduler leads now (only a leader records,
    in the store, releases that its release directory has from before the store kept
    them)."""

    def __init__(self, cfg, db, name: str, cluster_secret: str, leading: Callable[[], bool],
                 rng: random.Random | None = None, clock=time.monotonic):  # fmt: skip
        self.cfg = cfg
        self.db = db
        self.name = name
        self.secret = cluster_secret
        self.leading = leading
        self.rng = rng or random.Random()
        self.clock = clock
        self.mirror = Mirror(cfg.mirror_dir())
        self.releases = ReleaseDir(cfg.release_dir())
        self.interval_s = cfg.scheduler.replicate_s
        self.backoff_max_s = cfg.scheduler.replicate_backoff_max_s
        # Shared with the admin API's threads (hurry), under _lock.
        self._lock = threading.Lock()
        self.retries: dict[str, Backoff] = {}  # item key -> its failures and next try
        self.urgent: set[str] = set()  # item keys a node asked for: copied first
        self.lacking: list[Item] = []  # as last counted
        self._reported: tuple[int, int] | None = None  # as last written to the store
        self.worker = Worker("replication", self.tick, self.interval_s, db=db, logger=_log,
                             backoff_max_s=self.backoff_max_s)  # fmt: skip

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    # -- asked by the admin API ----------------------------------------------------------

    def hurry(self, kind: str, name: str) -> float:
        """A node (or an operator) asked for something this scheduler lacks: copy it
        next, now rather than after its backoff. Returns the seconds to tell the caller
        to wait (Retry-After)."""
        key = Item(kind, "", 0, name, "").key
        with self._lock:
            self.urgent.add(key)
            self.retries.pop(key, None)
        self.worker.wake()
        return max(5.0, self.interval_s)

    # -- the worker ----------------------------------------------------------------------

    def tick(self) -> float:
        rows = [{"filename": r.filename, "version": r.version, "sha256": r.sha256,
                 "size": r.size, "published_at": r.published_at}
                for r in PublishedRelease.select()]  # fmt: skip
        if self.leading():
            self._record_local_releases({r["filename"] for r in rows})
        manifests = {r.model: files_from(r.files) for r in MirroredWeights.select()}
        lacking = replication.missing(replication.wanted(manifests, rows), self.has)
        self._report(lacking)
        keys = {i.key for i in lacking}
        now = self.clock()
        with self._lock:
            self.retries = {k: b for k, b in self.retries.items() if k in keys}
            self.urgent &= keys
            due = [i for i in lacking if self.retries.get(i.key, Backoff()).next_at <= now]
            due.sort(key=lambda i: i.key not in self.urgent)  # stable: the rest keep order
        if due:
            peers = replication.peer_order(lease.schedulers(self.db), self.name,
                                           PEER_MAX_AGE_S)  # fmt: skip
            for item in due:
                if self.worker.stopping:
                    break
                self._copy(item, peers)
            lacking = [i for i in lacking if not self.has(i)]
            self._report(lacking)
        return self._wait(lacking)

    def _wait(self, lacking: list[Item]) -> float:
        """Until the next try that is due, at most replicate_s; none for an urgent one
        not tried yet (asked for while this pass ran)."""
        with self._lock:
            if any(i.key in self.urgent and i.key not in self.retries for i in lacking):
                return 0.0
            nexts = [self.retries[i.key].next_at for i in lacking if i.key in self.retries]
        return max(0.0, min([self.interval_s, *(n - self.clock() for n in nexts)]))

    def has(self, item: Item) -> bool:
        if item.kind == BLOB:
            return self.mirror.has(File(item.name, item.sha256, item.size))
        d = self.releases.path
        try:
            if (d / item.name).stat().st_size != item.size:
                return False
            return (d / f"{item.name}.sha256").read_text().split()[0] == item.sha256
        except (OSError, IndexError):
            return False

    def _copy(self, item: Item, peers: list[Peer]) -> None:
        try:
            partial = self._partial(item)
        except Invalid as e:  # a name in the store that cannot be a file here
            self._failed(item, TransferError(str(e), "invalid"))
            return
        if not peers:
            self._failed(item, TransferError("no other scheduler to copy it from", "no_peer"))
            return
        last = None
        for peer in peers:
            t0 = time.monotonic()
            try:
                self._fetch(peer, item, partial)
            except TransferError as e:
                metrics.REPLICATION_FAILURES.labels(self.name, e.reason).inc()
                if isinstance(e, Corrupt):  # rare and serious: said every time
                    _log.error("replication_corrupt", item=item.key, peer=peer.name,
                               reason=str(e))  # fmt: skip
                last = e
                continue
            metrics.REPLICATION_COPIED.labels(self.name).inc()
            with self._lock:
                was = self.retries.pop(item.key, None)
                self.urgent.discard(item.key)
            _log.info("replicated", kind=item.kind, name=item.name[:64], about=item.about,
                      bytes=item.size, peer=peer.name,
                      seconds=round(time.monotonic() - t0, 1),
                      after_failures=was.failures if was else None)  # fmt: skip
            return
        self._failed(item, last)

    def _failed(self, item: Item, e: TransferError) -> None:
        """Back off: said once when a copy starts failing, and once when its wait has
        reached replicate_backoff_max_s (from then on it is tried that often)."""
        if e.reason in ("no_peer", "invalid"):  # not counted per peer by _copy
            metrics.REPLICATION_FAILURES.labels(self.name, e.reason).inc()
        with self._lock:
            was = self.retries.get(item.key, Backoff())
            b = after_failure(was, self.clock(), self.rng, self.interval_s, self.backoff_max_s)
            self.retries[item.key] = b
        step = self._step(b.failures)
        if b.failures == 1:
            _log.warning("replication_failed", kind=item.kind, name=item.name[:64],
                         about=item.about, reason=str(e)[:300],
                         retry_in_s=round(step, 1))  # fmt: skip
        elif step >= self.backoff_max_s > self._step(b.failures - 1):
            _log.warning("replication_backed_off", kind=item.kind, name=item.name[:64],
                         failures=b.failures, reason=str(e)[:300],
                         retry_every_s=self.backoff_max_s)  # fmt: skip
        self._set_backoff()

    def _step(self, failures: int) -> float:
        """The nominal wait after `failures` failures in a row (before jitter)."""
        return min(self.backoff_max_s, self.interval_s * 2 ** min(max(failures - 1, 0), 62))

    def _set_backoff(self) -> None:
        with self._lock:
            steps = [self._step(b.failures) for b in self.retries.values()]
        metrics.REPLICATION_BACKOFF.labels(self.name).set(max(steps, default=0.0))

    def _fetch(self, peer: Peer, item: Item, partial: Path) -> None:
        path = "blobs" if item.kind == BLOB else "releases"
        url = f"{peer.admin_url.rstrip('/')}/v1/replication/{path}/{item.name}"
        token = mirror.peer_token(self.secret, self.name)
        headers = {"X-Llmgw-Scheduler": self.name, "Authorization": f"Bearer {token}"}
        copied = metrics.REPLICATION_COPIED_BYTES.labels(self.name)
        transfer(url, headers, partial, item.sha256, item.size, verify=self._verify(url),
                 stopping=lambda: self.worker.stopping, received=copied.inc)  # fmt: skip
        self._keep(item, partial)

    def _verify(self, url: str):
        """An https peer is checked against the cluster CA where there is one."""
        ca = self.cfg.ca_file()
        return str(ca) if url.startswith("https:") and ca.is_file() else True

    def _partial(self, item: Item) -> Path:
        """Where a copy grows until it is checked; Invalid for a name that is not a
        sha256 or a wheel's file name."""
        if item.kind == BLOB:
            if not mirror.is_sha256(item.name):
                raise Invalid(f"{item.name!r} is not a sha256")
            return self.mirror.root / "partial" / item.name
        wheel_version(item.name)
        if "/" in item.name:
            raise Invalid(f"{item.name!r} is not a file name")
        return self.releases.path / f".{item.name}.partial"

    def _keep(self, item: Item, partial: Path) -> None:
        """Rename a checked copy into place (the release's sha256 file first, as a
        publish writes it, so a reader never sees a wheel without one)."""
        if item.kind == BLOB:
            target = self.mirror.blob(item.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial.replace(target)
            return
        d = self.releases.path
        (d / f"{item.name}.sha256").write_text(f"{item.sha256}  {item.name}\n")
        os.utime(partial, (item.published_at, item.published_at))
        partial.replace(d / item.name)

    def _record_local_releases(self, known: set[str]) -> None:
        """Releases published before the store kept them are in the leader's directory
        only: record them, so the other schedulers copy them too."""
        for r in self.releases.releases():
            if r.filename not in known:
                PublishedRelease.insert(
                    filename=r.filename, version=str(r.version), sha256=r.sha256, size=r.size,
                    published_at=r.published,
                ).on_conflict_ignore().execute()  # fmt: skip
                _log.info("release_recorded", version=str(r.version), file=r.filename)

    def _report(self, lacking: list[Item]) -> None:
        """The gauges, and this scheduler's row in the store (for `llmgw status` through
        any scheduler), written only when the figures change."""
        self.lacking = lacking
        count, size = replication.lag(lacking)
        metrics.REPLICATION_MISSING.labels(self.name).set(count)
        metrics.REPLICATION_MISSING_BYTES.labels(self.name).set(size)
        self._set_backoff()
        if self._reported == (count, size):
            return
        n = (SchedulerSeen.update(missing_blobs=count, missing_bytes=size)
             .where(SchedulerSeen.name == self.name).execute())  # fmt: skip
        if n:  # no row yet (the lease worker writes it): try again next time
            self._reported = (count, size)
