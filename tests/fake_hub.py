"""A Hugging Face hub for tests, on loopback: only the paths huggingface_hub asks for
in a pull, answered as the real hub answers them (read from huggingface_hub 2.4's
hf_api.model_info, file_download.get_hf_file_metadata / http_get and
utils._http.hf_raise_for_status):

  GET  /api/models/ORG/REPO[/revision/REV]?blobs=true
       {"id", "sha": the commit REV names, "siblings": [{"rfilename", "size", "blobId",
       "lfs": {"size", "sha256", "pointerSize"}}]} (lfs for weights only, as git-lfs keeps)
  HEAD /ORG/REPO/resolve/REV/FILE   X-Repo-Commit, ETag (the sha256 of an LFS file, the
                                    git blob id of another), Content-Length
  GET  /ORG/REPO/resolve/REV/FILE   the bytes, with Range

and the hub's refusals: 401 with X-Error-Message "Invalid credentials in Authorization
header" for a token it does not know; 401 (no token) or 404 (a token) with X-Error-Code
RepoNotFound for a repo that is not there or that the token may not see; 404
RevisionNotFound and EntryNotFound. Every request's method, path and Authorization header
is kept in `seen`.
"""

import hashlib
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_LFS = (".safetensors", ".gguf", ".bin", ".pth", ".onnx", ".h5", ".msgpack")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # private: only this token sees it


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.tokens: set[str] = set()  # every token the hub knows (valid ones)
        self.seen: list[tuple[str, str, str]] = []  # (method, path, Authorization or "")
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):
                pass

            def do_GET(self):
                outer._answer(self, body=True)

            def do_HEAD(self):
                outer._answer(self, body=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the repos -------------------------------------------------------------------

    def push(self, repo: str, files: dict[str, bytes], branch: str = "main",
             token: str | None = None) -> str:  # fmt: skip
        """A new commit of `files` on `branch` (the repo is made on first push); its id."""
        with self._lock:
            r = self.repos.setdefault(repo, Repo())
            if token:
                r.token = token
                self.tokens.add(token)
            commit = hashlib.sha1(f"{repo}:{len(r.commits)}:{branch}".encode()).hexdigest()
            r.commits[commit] = dict(files)
            r.refs[branch] = commit
            return commit

    def tag(self, repo: str, name: str, commit: str) -> None:
        self.repos[repo].refs[name] = commit

    def asked(self, path_part: str) -> list[tuple[str, str, str]]:
        return [s for s in self.seen if path_part in s[1]]

    # -- answering -------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        auth = h.headers.get("Authorization", "")
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        self.seen.append((h.command, url.path, auth))
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        if token and token not in self.tokens:
            return _refuse(h, 401, message="Invalid credentials in Authorization header")
        api = path.startswith("/api/models/")
        parts = (path[len("/api/models/") :] if api else path[1:]).split("/")
        name = "/".join(parts[:2])
        r = self.repos.get(name)
        if r is None or (r.token and token != r.token):
            return _refuse(h, 404 if token else 401, code="RepoNotFound")
        if api:
            rev = "/".join(parts[3:]) if parts[2:3] == ["revision"] else "main"
        elif parts[2:3] == ["resolve"] and len(parts) > 4:
            rev = parts[3]
        else:
            return _refuse(h, 404)
        commit = rev if rev in r.commits else r.refs.get(rev)
        if commit is None:
            return _refuse(h, 404, code="RevisionNotFound")
        files = r.commits[commit]
        if api:
            siblings = [_sibling(n, d) for n, d in sorted(files.items())]
            return _json(h, {"id": name, "sha": commit, "private": bool(r.token),
                             "siblings": siblings})  # fmt: skip
        file = "/".join(parts[4:])
        if file not in files:
            return _refuse(h, 404, code="EntryNotFound", commit=commit)
        _file(h, files[file], file, commit, body)


def _sibling(name: str, data: bytes) -> dict:
    out = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
    if name.endswith(_LFS):
        out["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "pointerSize": 134}  # fmt: skip
    return out


def _file(h, data: bytes, name: str, commit: str, body: bool) -> None:
    etag = hashlib.sha256(data).hexdigest() if name.endswith(_LFS) else git_blob_id(data)
    start = 0
    rng = h.headers.get("Range", "")
    if rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
        start = int(rng[6:].rstrip("-"))
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
    else:
        h.send_response(200)
    h.send_header("X-Repo-Commit", commit)
    h.send_header("ETag", f'"{etag}"')
    h.send_header("Accept-Ranges", "bytes")
    h.send_header("Content-Length", str(len(data) - start))
    h.end_headers()
    if body:
        h.wfile.write(data[start:])


def _json(h, doc: dict) -> None:
    data = json.dumps(doc).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)


def _refuse(h, status: int, code: str = "", message: str = "", commit: str = "") -> None:
    data = json.dumps({"error": message or code or "not found"}).encode()
    h.send_response(status)
    if code:
        h.send_header("X-Error-Code", code)
    if message:
        h.send_header("X-Error-Message", message)
    if commit:
        h.send_header("X-Repo-Commit", commit)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)
