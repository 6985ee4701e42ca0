"""Models named by their Hugging Face repo: `hf://ORG/REPO[@REVISION][/FILE]`.

REVISION is a branch, a tag or a 40-hex commit (the repo's default branch when left
out); one that holds a `/` (`refs/pr/1`) is written with `%2F`. FILE names one file
(a GGUF in a repo of many quantizations; the first part of a split GGUF brings its
siblings); without it the whole repo is one manifest, less what no server reads (see
`choose`).

Parsing and the choice of files are plain functions: the catalog checks a source with
them when a tool starts. Talking to the hub goes through huggingface_hub, imported only
when a pull needs it, so a router never loads it. The token is read from its file at
each pull and handed to huggingface_hub alone: no message here names it.
"""

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from llmgw.errors import ConfigError, Invalid
from llmgw.gguf import SPLIT

PREFIX = "hf://"
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# The hub's names for users, organizations and repos.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_BAD_REVISION = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|^/|/$|//")

# What no server reads: repo furniture, docs and pictures ...
_FURNITURE = {".gitattributes", ".gitignore"}
_DOCS = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".pdf")
# ... weights in formats the engines do not load (TensorFlow, Flax, ONNX, TFLite,
# Core ML, rust-bert) ...
_OTHER_FORMATS = (".h5", ".msgpack", ".ot", ".onnx", ".onnx_data", ".tflite", ".mlmodel")
# ... and, where a repo has safetensors, its second copy of the same weights.
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".bin.index.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class SourceError(ConfigError):
    """An hf:// source that is not ORG/REPO[@REVISION][/FILE]."""


class HubError(Invalid):
    """The hub would not give a source's files: no such repo, revision or file, a token
    it refuses, or no answer."""

    code = "hub_failed"


@dataclass(frozen=True)
class HubSource:
    repo: str  # ORG/REPO
    revision: str  # as written, unquoted; "" for the repo's default branch
    file: str  # a path in the repo; "" for the whole repo

    def at(self, revision: str) -> str:
        """This source as the catalog would name it at `revision`."""
        rev = f"@{urllib.parse.quote(revision, safe='')}" if revision else ""
        return f"{PREFIX}{self.repo}{rev}" + (f"/{self.file}" if self.file else "")

    @property
    def names_commit(self) -> bool:
        return bool(COMMIT.match(self.revision))


def parse(source: str) -> HubSource:
    """`hf://ORG/REPO[@REVISION][/FILE]` taken apart; SourceError says what is wrong."""
    if not source.startswith(PREFIX):
        raise SourceError(f"{source!r} does not start with {PREFIX}")
    org, _, rest = source[len(PREFIX) :].partition("/")
    repo_rev, _, file = rest.partition("/")
    name, at, revision = repo_rev.partition("@")
    if not _NAME.match(org) or not _NAME.match(name) or "--" in name or ".." in name:
        raise SourceError(
            f"{source!r} must name a repo as hf://ORG/REPO[@REVISION][/FILE] (letters,"
            " digits and ._- in ORG and REPO)"
        )
    revision = urllib.parse.unquote(revision)
    if at and (not revision or _BAD_REVISION.search(revision)):
        raise SourceError(
            f"{source!r}: @{revision} is not a branch, tag or commit (write a / in one as %2F)"
        )
    parts = file.split("/") if file else []
    if "/" in rest and (not parts or any(p in ("", ".", "..") for p in parts)):
        raise SourceError(f"{source!r}: FILE after ORG/REPO must be a path in the repo")
    return HubSource(f"{org}/{name}", revision, file)


def choose(src: HubSource, names: list[str]) -> list[str]:
    """The repo's files a pull takes. One FILE: it (all parts of a split GGUF). The
    whole repo: every file but repo furniture, docs and pictures, hidden folders, weights
    in formats the engines do not load, and, when it has safetensors, its PyTorch
    pickles and GGUFs (the same weights again). HubError when that leaves no weights."""
    unsafe = [n for n in names if n.startswith("/") or ".." in PurePosixPath(n).parts]
    if unsafe:
        raise HubError(f"{src.repo}: the hub named a file outside the repo: {unsafe[0]!r}")
    have = set(names)
    if src.file:
        if src.file not in have:
            suffix = PurePosixPath(src.file).suffix
            near = sorted(n for n in names if PurePosixPath(n).suffix == suffix)
            more = ", …" if len(near) > 5 else ""
            hint = f" (it holds {', '.join(near[:5])}{more})" if near else ""
            raise HubError(f"{src.repo} has no file {src.file}{hint}", code="hub_file_not_found")
        m = SPLIT.match(PurePosixPath(src.file).name)
        if not m:
            return [src.file]
        folder = str(PurePosixPath(src.file).parent)
        parts = [str(PurePosixPath(folder, f"{m['stem']}-{i:05d}-of-{m['n']}.gguf"))
                 for i in range(1, int(m["n"]) + 1)]  # fmt: skip
        missing = [p for p in parts if p not in have]
        if missing:
            raise HubError(f"{src.repo}: split GGUF {src.file} is missing {', '.join(missing)}",
                           code="hub_file_not_found")  # fmt: skip
        return parts
    kept = [n for n in sorted(names) if _served(n)]
    if any(n.endswith(".safetensors") for n in kept):
        kept = [n for n in kept if not n.endswith(_PICKLES)]
    weights = [n for n in kept if n.endswith(_WEIGHTS)]
    if not weights:
        raise HubError(f"{src.repo} holds no weights (safetensors, PyTorch or GGUF)",
                       code="hub_no_weights")  # fmt: skip
    ggufs = {SPLIT.sub(r"\g<stem>", n) for n in weights if n.endswith(".gguf")}
    if len(ggufs) > 1 and all(n.endswith(".gguf") for n in weights):  # quantizations
        raise HubError(
            f"{src.repo} holds {len(ggufs)} GGUF models: name one as {src.at(src.revision)}/FILE",
            code="hub_many_ggufs",
        )
    return kept


def _served(name: str) -> bool:
    path = PurePosixPath(name)
    if path.name in _FURNITURE or any(p.startswith(".") for p in path.parts):
        return False
    lower = name.lower()
    return not lower.endswith(_DOCS) and not lower.endswith(_OTHER_FORMATS)


@dataclass(frozen=True)
class Remote:
    """A file of a repo at one commit, as the hub describes it."""

    name: str
    size: int | None
    sha256: str | None  # an LFS file's; None for one kept in git itself


@dataclass(frozen=True)
class Snapshot:
    commit: str
    files: dict[str, Remote]


class Hub:
    """The hub at `endpoint` (None: huggingface_hub's, HF_ENDPOINT), with the token in
    `token_file` (None: no token, not even one lying in HF_TOKEN or HF_HOME: what the
    scheduler sends must be what its config says)."""

    def __init__(self, endpoint: str | None = None, token_file: Path | None = None,
                 timeout_s: float = 30.0):  # fmt: skip
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.token_file = token_file
        self.timeout_s = timeout_s

    @property
    def where(self) -> str:
        if self.endpoint:
            return self.endpoint
        from huggingface_hub import constants

        return constants.ENDPOINT

    def token(self) -> str | bool:
        """The token, read now (a rotated file needs no restart); False with none."""
        if self.token_file is None:
            return False
        try:
            text = self.token_file.read_text().strip()
        except OSError as e:
            raise HubError(
                f"cannot read the hub token from scheduler.hf_token_file ({self.token_file}):"
                f" {e.strerror}",
                code="hub_token_unreadable",
            ) from None
        if not text:
            raise HubError(f"scheduler.hf_token_file ({self.token_file}) is empty",
                           code="hub_token_unreadable")  # fmt: skip
        return text

    def resolve(self, src: HubSource, token: str | bool) -> Snapshot:
        """The commit `src`'s revision names now, and the repo's files there."""
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint, token=token).model_info(
                src.repo, revision=src.revision or None, files_metadata=True,
                timeout=self.timeout_s,
            )  # fmt: skip
        except Exception as e:  # huggingface_hub's and httpx's: each mapped to a reason
            raise self._refusal(e, src, token) from None
        if not info.sha or not COMMIT.match(info.sha):
            raise HubError(f"the hub at {self.where} named no commit for {src.repo}")
        files = {s.rfilename: Remote(s.rfilename, s.lfs.size if s.lfs else s.size,
                                     s.lfs.sha256 if s.lfs else None)
                 for s in info.siblings or []}  # fmt: skip
        return Snapshot(info.sha, files)

    def download(self, src: HubSource, commit: str, name: str, folder: Path, token: str | bool,
                 report=None) -> Path:  # fmt: skip
        """`name` at `commit` into `folder`, as huggingface_hub's local_dir and its cache
        alike: the caller keeps the file, and HF_HOME's cache is neither read nor given a
        second copy. `report(n)` for each n bytes that arrive."""
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(
                src.repo, name, revision=commit, local_dir=folder, token=token,
                cache_dir=folder / ".cache", endpoint=self.endpoint, etag_timeout=self.timeout_s,
                tqdm_class=_bar(report) if report else None,
            )  # fmt: skip
        except Exception as e:  # as in resolve
            raise self._refusal(e, src, token, name) from None
        return Path(path)

    def _refusal(self, e: Exception, src: HubSource, token, name: str = "") -> HubError:
        """One line saying what the hub refused and what to do, never the token."""
        from huggingface_hub import errors
        from huggingface_hub.utils import httpx  # its HTTP client, whichever its version uses

        cause = e.__cause__ if isinstance(e, errors.LocalEntryNotFoundError) else None
        if isinstance(cause, errors.HfHubHTTPError):
            e = cause  # hf_hub_download hides a refused HEAD behind "not in the cache"
        status = e.response.status_code if isinstance(e, errors.HfHubHTTPError) else None
        held = f"the token in {self.token_file}"
        if isinstance(e, errors.GatedRepoError):
            whose = (
                f"whose token is in {self.token_file}"
                if token
                else ("and put its token in a file named by scheduler.hf_token_file")
            )
            return HubError(f"{src.repo} is gated: accept its terms on the hub with an account"
                            f" {whose}", code="hub_gated")  # fmt: skip
        if isinstance(e, errors.RevisionNotFoundError):
            return HubError(f"{src.repo} has no revision {src.revision!r}: name a branch, tag or"
                            " commit it has", code="hub_revision_not_found")  # fmt: skip
        if isinstance(e, errors.RemoteEntryNotFoundError):
            return HubError(f"{src.repo} has no file {name}", code="hub_file_not_found")
        if isinstance(e, errors.RepositoryNotFoundError):
            private = (f"{held} cannot see it" if token
                       else "no token is set (scheduler.hf_token_file)")  # fmt: skip
            return HubError(f"{src.repo} is not on the hub at {self.where}, or it is private and"
                            f" {private}: check ORG/REPO in the source",
                            code="hub_repo_not_found")  # fmt: skip
        if status == 401:
            if token:
                return HubError(f"the hub refused {held} (401): put a valid token in it",
                                code="hub_unauthorized")  # fmt: skip
            return HubError("the hub wants a token (401): set scheduler.hf_token_file",
                            code="hub_unauthorized")  # fmt: skip
        if status == 403:
            who = held if token else "no token"
            return HubError(f"{src.repo} is refused to {who} (403): give the token's account"
                            " read access, or set scheduler.hf_token_file",
                            code="hub_forbidden")  # fmt: skip
        if status is not None:
            return HubError(f"the hub at {self.where} answered {status} for {src.repo}:"
                            " try again later", code="hub_failed")  # fmt: skip
        if isinstance(e, errors.OfflineModeIsEnabled):
            return HubError("HF_HUB_OFFLINE is set in the scheduler's environment: unset it",
                            code="hub_offline")  # fmt: skip
        if isinstance(e, httpx.HTTPError | errors.LocalEntryNotFoundError):
            return HubError(f"cannot reach the hub at {self.where}: {type(e).__name__}",
                            code="hub_unreachable")  # fmt: skip
        if isinstance(e, OSError):
            return HubError(f"{src.repo}: {e.strerror or type(e).__name__}", code="hub_failed")
        return HubError(f"{src.repo}: {type(e).__name__}", code="hub_failed")


def _bar(report):
    """A progress bar class for huggingface_hub that draws nothing and tells `report`."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True  # the scheduler has no terminal; `llmgw` draws
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if n:
                report(n)
            return super().update(n)

    return Bar
