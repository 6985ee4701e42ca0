"""File helpers more than one tool needs."""

import hashlib
import os

_CHUNK = 1024 * 1024


def sha256_of(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in 1 MiB blocks (weights are gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()
