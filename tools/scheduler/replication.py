"""Replication between schedulers, as plain data: what this scheduler must hold, what it
lacks, which peers to ask and in what order, and where a cut transfer resumes. The
worker that does the copying is replicator.py.

Every scheduler keeps a whole copy of the weights mirror and of the published releases
on its own disk: after a failover the new leader serves them from there, as the old one
did. The store says what must be held (`mirrored_weights` manifests, `published_releases`);
the bytes come from a peer scheduler that has them. Everything is named by its sha256,
so a copy is checked before it is kept and copying twice changes nothing.
"""

import re
from dataclasses import dataclass

from llmgw.mirror import File

BLOB = "blob"
RELEASE = "release"

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class Item:
    """One thing to hold: a mirror blob (named by its sha256) or a release wheel."""

    kind: str  # BLOB or RELEASE
    sha256: str
    size: int
    name: str  # a blob's sha256; a release's file name
    about: str  # for logs: the models that use a blob, or the release's version
    published_at: float = 0.0  # a release's, kept as its file's time

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Peer:
    name: str
    admin_url: str
    role: str
    seen_s_ago: float


def wanted(manifests: dict[str, list[File]], releases: list[dict]) -> list[Item]:
    """Every blob the manifests name (once, however many models share it) and every
    published release (`releases`: rows of filename, version, sha256, size,
    published_at): releases first, then blobs smallest first, so a small model is
    complete before a large one has finished."""
    users: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for model, files in sorted(manifests.items()):
        for f in files:
            users.setdefault(f.sha256, []).append(model)
            sizes[f.sha256] = f.size
    blobs = [Item(BLOB, sha, sizes[sha], sha, ",".join(models)) for sha, models in users.items()]
    rels = [_release(r) for r in sorted(releases, key=lambda r: r["filename"])]
    return rels + sorted(blobs, key=lambda i: (i.size, i.name))


def _release(r: dict) -> Item:
    size, published = int(r["size"]), float(r["published_at"])
    return Item(RELEASE, r["sha256"], size, r["filename"], str(r["version"]), published)


def missing(items: list[Item], have) -> list[Item]:
    """The items `have(item)` says are not held here, in the same order."""
    return [i for i in items if not have(i)]


def peer_order(rows: list[dict], me: str, max_age_s: float) -> list[Peer]:
    """The other schedulers to ask, from the store's `schedulers` rows: the leader
    first (it pulled what is new), then the most recently seen; none without an admin
    URL, and none silent for longer than `max_age_s` (long gone: asking costs a timeout)."""
    peers = [
        Peer(r["name"], r["admin_url"], r["role"], float(r["seen_s_ago"]))
        for r in rows
        if r["name"] != me and r.get("admin_url") and float(r["seen_s_ago"]) <= max_age_s
    ]
    return sorted(peers, key=lambda p: (p.role != "leader", p.seen_s_ago, p.name))


def resume_from(partial_size: int | None, size: int) -> int:
    """Where a transfer of a `size`-byte blob resumes, given its partial file's length
    (None: there is none): at the partial's end, unless it is longer than the blob,
    which makes it not this blob's beginning, so start again."""
    if partial_size is None or partial_size > size:
        return 0
    return partial_size


def range_start(status: int, content_range: str | None) -> int | None:
    """The offset a peer's answer starts at: 0 for 200 (the whole blob), the first byte
    of Content-Range for 206; None for an answer that is neither (refused)."""
    if status == 200:
        return 0
    if status != 206 or not content_range:
        return None
    m = _CONTENT_RANGE.match(content_range.strip())
    return int(m.group(1)) if m else None


def lag(missing_items: list[Item]) -> tuple[int, int]:
    """(how many, how many bytes) are missing: what `llmgw status` and the gauges say."""
    return len(missing_items), sum(i.size for i in missing_items)
