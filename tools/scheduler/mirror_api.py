"""The admin API's weights mirror (lib/llmgw/mirror.py).

For operators (an operator's or the bootstrap token):
  GET    /v1/weights              every catalog model's weights: mirrored or not
  POST   /v1/weights/pull         {"models": [...]} | {"all": true}: JSON lines, progress
                                  then each model's result, as the pull goes
  POST   /v1/weights/verify       {"models": [...]} | {"all": true}: re-hash every blob
  DELETE /v1/weights/MODEL        forget a model's weights (refused while it runs)

For nodes only:
  GET    /v1/mirror/blobs/SHA256  a blob, with Range (a fetch cut off resumes); 503 with
                                  Retry-After for one still being copied from a peer

For the other schedulers only (replicator.py):
  GET    /v1/replication/blobs/SHA256   a blob this scheduler holds, with Range

A node proves itself with `X-Llmgw-Node: NAME` and `Authorization: Bearer TOKEN`, the
token being HMAC(cluster secret, NAME) that the scheduler sends it inside start_shard
over the CURVE-encrypted bus: only a registered node ever learns it, and removing the
node (`llmgw nodes remove`) shuts it out because the name must still be a registered
agent. None of this takes the scheduler's lock except to read the catalog and replicas.
"""

import json
import os
import threading
import time

from llmgw import hub, log, mirror
from llmgw.catalog import source_kind
from llmgw.errors import Invalid, NotFound
from llmgw.mirror import File, Mirror, content_id, files_from
from llmgw.operators import Who
from llmgw.store import BusPeer, MirroredWeights, SchedulerSeen
from llmgw_scheduler.errors import Unauthorized, Unavailable
from llmgw_scheduler.replication import BLOB

_log = log.get("llmgw.scheduler.mirror")

_pulling: dict[str, threading.Lock] = {}
_pulling_lock = threading.Lock()


def _mirror(h) -> Mirror:
    return Mirror(h.cfg.mirror_dir())


def _hub(h) -> hub.Hub:
    """The hub at HF_ENDPOINT (huggingface_hub's own setting), with the token file the
    config names, read at each pull."""
    name = h.cfg.scheduler.hf_token_file
    return hub.Hub(token_file=h.cfg.file(name) if name else None)


def _bearer(h) -> str:
    """The request's bearer token ('' if none)."""
    given = h.headers.get("Authorization", "")
    return given[7:].strip() if given.startswith("Bearer ") else ""


def authenticate(h) -> Who:
    """A registered node's HMAC token; an operator's token is no use here."""
    node = h.headers.get("X-Llmgw-Node", "")
    token, secret = _bearer(h), h.sched.commands.cluster_secret
    if not node or not mirror.node_token_ok(secret, node, token) or not _registered(node):
        raise Unauthorized("the weights mirror serves registered nodes only")
    return Who(node, "node")


def authenticate_peer(h) -> Who:
    """Another scheduler copying what it lacks (replicator.py): its name, which the
    store's `schedulers` rows must know, and HMAC(cluster secret, that name)."""
    name = h.headers.get("X-Llmgw-Scheduler", "")
    token, secret = _bearer(h), h.sched.commands.cluster_secret
    if not name or not mirror.peer_token_ok(secret, name, token) or not _scheduler(name):
        raise Unauthorized("replication serves the other schedulers only")
    return Who(name, "scheduler")


def blob(h, sha256: str):
    """A blob for a node, with Range. One the store names that this scheduler has not
    copied from a peer yet is 503 with Retry-After, not 404: it will be here, and the
    replication worker is told to copy it first (rather than fetch it through on this
    request: a node's download then never rests on a second transfer it cannot see)."""
    path = _mirror(h).blob(sha256)
    if not path.is_file() and _named(sha256):
        wait = h.sched.replicator.hurry(BLOB, sha256) if h.sched.replicator else 30.0
        raise Unavailable(
            f"blob {sha256} is mirrored but this scheduler ({h.sched.name}) has not copied it"
            " from another scheduler yet; it is being copied: try again shortly",
            wait, "blob_replicating",
        )  # fmt: skip
    send_file(h, path, f"no blob {sha256} in the mirror", "blob_not_found")


def peer_blob(h, sha256: str):
    """A blob for another scheduler: what it has here, nothing fetched on its behalf."""
    send_file(h, _mirror(h).blob(sha256), f"no blob {sha256} here", "blob_not_found")


def send_file(h, path, missing: str, code: str):
    """A file with Range (a fetch cut off resumes); NotFound(missing, code) if absent."""
    try:
        f = open(path, "rb")
    except OSError:
        raise NotFound(missing, code) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        start, end = _range(h.headers.get("Range", ""), size)
        if start is None:
            h.send_response(416)
            h.send_header("Content-Range", f"bytes */{size}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        partial = h.headers.get("Range") is not None
        h.send_response(206 if partial else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end - start))
        if partial:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        h.end_headers()
        h.wfile.flush()
        try:
            # sendfile: the kernel copies page cache to the socket, as nginx would; a
            # Python read/write loop was the slower half of the pipe.
            h.connection.sendfile(f, start, end - start)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the node went away; it resumes from what it has
    h.close_connection = True


def _range(header: str, size: int) -> tuple[int | None, int]:
    """(start, end exclusive) for one `bytes=A-B` / `bytes=A-` / none; start None: 416."""
    if not header:
        return 0, size
    spec = header.removeprefix("bytes=")
    first, _, last = spec.partition("-")
    if header == spec or "," in spec or not first.isdigit():
        return None, size
    start = int(first)
    end = min(size, int(last) + 1) if last.isdigit() else size
    if start >= size or end <= start:
        return None, size
    return start, end


def _registered(node: str) -> bool:
    return BusPeer.select().where((BusPeer.name == node) & (BusPeer.kind == "agent")).exists()


def _scheduler(name: str) -> bool:
    return SchedulerSeen.select().where(SchedulerSeen.name == name).exists()


def _named(sha256: str) -> bool:
    """Whether any model's manifest in the store names this blob."""
    return any(f.sha256 == sha256 for files in _manifests().values() for f in files)


def weights_list(h):
    return 200, listing(h)


def listing(h) -> list[dict]:
    s = h.sched
    with s.lock:
        models = {m.name: m for m in [*s.models.values(), *s.catalog.adapters.values()]}
        used = {name: len(s.inv.of_model(name)) for name in models}
    rows = {r.model: r for r in MirroredWeights.select()}
    mir = _mirror(h)
    out = []
    for name in sorted(set(models) | set(rows)):
        m, r = models.get(name), rows.get(name)
        lacking = [f.name for f in files_from(r.files) if not mir.has(f)] if r else []
        out.append(weights_json(name, m.source if m else r.source, r, used.get(name, 0),
                                in_catalog=m is not None, lacking=lacking))  # fmt: skip
    return out


def weights_json(name: str, source: str, row, replicas: int, in_catalog: bool = True,
                 lacking: list[str] = ()) -> dict:  # fmt: skip
    """The one JSON shape of a model's weights in the mirror. `lacking`: its files that
    this scheduler does not hold (yet): `replicating` rather than `mirrored`, which once
    said only what the store said while the new leader's disk was empty."""
    state = "not pulled" if row is None else "replicating" if lacking else "mirrored"
    return {
        "model": name, "source": source, "state": state, "lacking": list(lacking),
        "sha256": row.sha256 if row else None,
        "size": row.size if row else None,
        "files": json.loads(row.files) if row else [],
        "revision": row.revision if row else None,
        "pinned_at": row.pinned_at if row else None,
        "pulled_at": row.pulled_at if row else None,
        "replicas": replicas, "in_catalog": in_catalog,
    }  # fmt: skip


def _chosen(h) -> list[str]:
    s = h.sched
    with s.lock:
        if h.body.get("all") is True:
            return sorted([*s.models, *s.catalog.adapters])
        names = h.body.get("models")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise Invalid("say which: models (a list of names), or all")
        for n in names:
            s.catalog.entry(n)  # NotFound, answered by the dispatcher
    return names


def weights_verify(h):
    return 200, [verify(h, n) for n in _chosen(h)]


def weights_pull(h):
    """JSON lines as the pull goes: `llmgw weights pull` shows progress from them."""
    names = _chosen(h)
    h.send_response(200)
    h.send_header("Content-Type", "application/x-ndjson")
    h.end_headers()
    h.close_connection = True
    for name in names:
        line = _pull_one(h, name)
        h.wfile.write((json.dumps(line) + "\n").encode())
        h.wfile.flush()


def _pull_one(h, name: str) -> dict:
    with _pulling_lock:
        lock = _pulling.setdefault(name, threading.Lock())
    with lock:
        try:
            return {"result": pull(h, name)}
        except Invalid as e:
            _log.warning("weights_pull_failed", model=name, reason=str(e))
            return {"error": {"model": name, "code": e.code, "message": str(e)}}


def pull(h, name: str) -> dict:
    s = h.sched
    with s.lock:
        m = s.catalog.entry(name)
        source, catalog_sha = m.source, m.sha256
    row = MirroredWeights.get_or_none(MirroredWeights.model == name)
    pinned = files_from(row.files) if row is not None and row.source == source else None
    pinned_sha = content_id(pinned) if pinned else ""
    known = pinned if pinned and (not catalog_sha or pinned_sha == catalog_sha) else None
    last = [0.0]

    def progress(done: int, **about) -> None:
        """`about`: total, file, file_index and files where the source says them."""
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            line = {"progress": {"model": name, "done": done, **about}}
            h.wfile.write((json.dumps(line) + "\n").encode())
            h.wfile.flush()

    mir = _mirror(h)
    started = time.monotonic()
    if source_kind(source) == "hf":
        pinned_commit = (row.revision or "") if pinned else ""
        files, commit = mir.pull_hub(source, _hub(h), name, pinned_commit, known, progress)
    else:
        files, commit = mir.pull(source, known, progress), None
    got = content_id(files)
    try:
        mirror.check_pin(name, got, catalog_sha, pinned_sha)
    except Invalid:
        keep = mirror.used_elsewhere(_manifests(), name) | {f.sha256 for f in pinned or []}
        mir.remove(files, keep)
        raise
    now = time.time()
    size = sum(f.size for f in files)
    new = row is None or row.sha256 != got or row.source != source or row.revision != commit
    values = {
        MirroredWeights.source: source, MirroredWeights.sha256: got,
        MirroredWeights.files: json.dumps([f.json() for f in files]),
        MirroredWeights.size: size, MirroredWeights.pulled_at: now,
        MirroredWeights.revision: commit,
    }  # fmt: skip
    if new:
        values[MirroredWeights.pinned_at] = now
    fields = {"model": name, "pinned_at": now, **{k.name: v for k, v in values.items()}}
    (MirroredWeights.insert(**fields)
     .on_conflict(conflict_target=[MirroredWeights.model], update=values)
     .execute())  # fmt: skip
    at = {"revision": commit} if commit else {}
    if new:
        h.audit(name, sha256=got, size=size, source=source,
                pinned=None if catalog_sha else True, **at)  # fmt: skip
    _log.info("weights_pulled", model=name, sha256=got[:12], bytes=size, new=new,
              seconds=round(time.monotonic() - started, 1), **at)  # fmt: skip
    row = MirroredWeights.get(MirroredWeights.model == name)
    with s.lock:
        used = len(s.inv.of_model(name))
        s.needs.mirrored[name] = (source, got, size)  # placement asks nodes for the disk
    return {**weights_json(name, source, row, used), "new": new}


def _manifests() -> dict[str, list[File]]:
    return {r.model: files_from(r.files) for r in MirroredWeights.select()}


def verify(h, name: str) -> dict:
    row = MirroredWeights.get_or_none(MirroredWeights.model == name)
    if row is None:
        return {"model": name, "state": "not pulled", "files": []}
    mir = _mirror(h)
    files = [{**f.json(), "state": mir.verify(f)} for f in files_from(row.files)]
    bad = [f for f in files if f["state"] != "ok"]
    for f in bad if h.sched.replicator else ():  # copied again from a peer that has it
        h.sched.replicator.hurry(BLOB, f["sha256"])
    if bad:
        _log.error("weights_corrupt", model=name,
                   files=",".join(f"{f['name']}:{f['state']}" for f in bad))  # fmt: skip
        h.audit(name, bad=[f["name"] for f in bad])
    return {"model": name, "state": "ok" if not bad else "bad", "files": files}


def weights_remove(h, model: str):
    name = model
    s = h.sched
    with s.lock:
        replicas = sorted(r.id for r in s.inv.of_model(name))
    mirror.refuse_removal(name, replicas)
    row = MirroredWeights.get_or_none(MirroredWeights.model == name)
    if row is None:
        raise NotFound(f"no weights of {name} in the mirror", "weights_not_found")
    freed = _mirror(h).remove(files_from(row.files), mirror.used_elsewhere(_manifests(), name))
    MirroredWeights.delete().where(MirroredWeights.model == name).execute()
    with s.lock:
        s.needs.mirrored.pop(name, None)
    h.audit(name, sha256=row.sha256, freed=freed)
    return 200, {"model": name, "removed": True, "freed": freed}
