"""The admin API's releases: `llmgw release publish` and `llmgw release list`.

GET  /v1/releases              every published release, oldest first by version
GET  /v1/releases/FILENAME     a published wheel's bytes (503 with Retry-After while this
                               scheduler is still copying it from another)
POST /v1/releases/FILENAME     the wheel's bytes as the body (application/octet-stream)
GET  /v1/replication/releases/FILENAME   for the other schedulers: the wheel, with Range

A publish writes the wheel into this scheduler's release directory and records it in
the store (`published_releases`), from which every other scheduler's replication worker
learns to copy it. Like registry.py these take no lock.
"""

import time

from packaging.version import Version

from llmgw.releases import Release, ReleaseDir
from llmgw.store import PublishedRelease
from llmgw_scheduler import mirror_api
from llmgw_scheduler.errors import Unavailable
from llmgw_scheduler.replication import RELEASE


def _dir(h) -> ReleaseDir:
    return ReleaseDir(h.cfg.release_dir())


def _recorded() -> list[Release]:
    return [Release(Version(r.version), r.filename, r.size, r.sha256, r.published_at)
            for r in PublishedRelease.select()]  # fmt: skip


def listing(h):
    """Those here and those the store records (`here`: false until this scheduler has
    copied it from another)."""
    here = {r.filename: r for r in _dir(h).releases()}
    known = {r.filename: r for r in _recorded()}
    rows = [{**r.json(), "here": name in here} for name, r in {**known, **here}.items()]
    return 200, sorted(rows, key=lambda r: Version(r["version"]))


def download(h, filename: str):
    """GET /v1/releases/FILENAME: the wheel, for `llmgw nodes onboard` to install."""
    d = _dir(h)
    path = d.path / filename
    if "/" not in filename and not path.is_file():
        row = PublishedRelease.get_or_none(PublishedRelease.filename == filename)
        if row is not None:
            r = h.sched.replicator
            wait = r.hurry(RELEASE, filename) if r else 30.0
            raise Unavailable(
                f"release {row.version} is published but this scheduler ({h.sched.name}) has"
                " not copied it from another scheduler yet; it is being copied: try again"
                " shortly",
                wait, "release_replicating",
            )  # fmt: skip
    mirror_api.send_file(h, d.file(filename), f"no release file {filename}", "release_not_found")


def peer_file(h, filename: str):
    """A wheel for another scheduler, with Range: what is here, nothing fetched for it."""
    mirror_api.send_file(h, _dir(h).file(filename), f"no release file {filename} here",
                         "release_not_found")  # fmt: skip


def publish(h, filename: str):
    """The body is the wheel's bytes, read here as they come, not parsed."""
    try:
        length = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        length = 0
    release, new = _dir(h).publish(filename, h.rfile, length, time.time())
    # Recorded even when the bytes were here already (a release from before the store
    # kept them): the other schedulers copy what the store names.
    PublishedRelease.insert(
        filename=release.filename, version=str(release.version), sha256=release.sha256,
        size=release.size, published_at=release.published,
    ).on_conflict_ignore().execute()  # fmt: skip
    if new:
        h.audit(str(release.version), sha256=release.sha256)
    return 201 if new else 200, {**release.json(), "new": new}
