"""The admin API's releases: `llmgw release publish` and `llmgw release list`.

GET  /v1/releases              every published release, oldest first by version
GET  /v1/releases/FILENAME     a published wheel's bytes
POST /v1/releases/FILENAME     the wheel's bytes as the body (application/octet-stream)

Like registry.py these touch files, not the scheduler's state, and take no lock.
"""

import os
import time

from llmgw.releases import ReleaseDir


def listing(h):
    return 200, [r.json() for r in ReleaseDir(h.cfg.release_dir()).releases()]


def download(h, filename: str):
    """GET /v1/releases/FILENAME: the wheel, for `llmgw nodes onboard` to install."""
    path = ReleaseDir(h.cfg.release_dir()).file(filename)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(size))
        h.end_headers()
        h.wfile.flush()
        h.connection.sendfile(f, 0, size)


def publish(h, filename: str):
    """The body is the wheel's bytes, read here as they come, not parsed."""
    try:
        length = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        length = 0
    release, new = ReleaseDir(h.cfg.release_dir()).publish(filename, h.rfile, length, time.time())
    if new:
        h.audit(str(release.version), sha256=release.sha256)
    return 201 if new else 200, {**release.json(), "new": new}
