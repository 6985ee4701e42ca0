"""The admin API's releases: `llmgw release publish` and `llmgw release list`.

GET  /v1/releases              every published release, oldest first by version
GET  /v1/releases/FILENAME     a published wheel's bytes
POST /v1/releases/FILENAME     the wheel's bytes as the body (application/octet-stream)

Like registry.py these touch files, not the scheduler's state, and take no lock.
"""

import os
import time

from llmgw.releases import ReleaseDir


def get(h, parts: list[str]) -> bool:
    if len(parts) == 3 and parts[:2] == ["v1", "releases"]:
        return _download(h, parts[2])
    if parts != ["v1", "releases"]:
        return False
    h._send(200, [r.json() for r in ReleaseDir(h.cfg.release_dir()).releases()])
    return True


def _download(h, filename: str) -> bool:
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
    return True


def post(h, parts: list[str]) -> bool:
    if len(parts) != 3 or parts[:2] != ["v1", "releases"]:
        return False
    try:
        length = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        length = 0
    release, new = ReleaseDir(h.cfg.release_dir()).publish(parts[2], h.rfile, length, time.time())
    if new:
        h._change("release.publish", str(release.version), sha256=release.sha256)
    h._send(201 if new else 200, {**release.json(), "new": new})
    return True
