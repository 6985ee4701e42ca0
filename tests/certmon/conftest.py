"""Run the real llmgw-certmon against a PKI directory under the test's temporary paths."""

import os
import subprocess

import pytest

from tests.helpers import BIN


def certmon(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the `llmgw-certmon` executable; with check, fail the test if it exits non-zero."""
    result = subprocess.run(
        [str(BIN / "llmgw-certmon"), *args], capture_output=True, text=True, env=os.environ
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"llmgw-certmon {' '.join(args)} exited {result.returncode}: {result.stderr}"
        )
    return result


@pytest.fixture
def pki(isolated_paths):
    """The PKI directory the isolated config points at: <config_dir>/pki."""
    return isolated_paths / "etc" / "pki"


@pytest.fixture
def ca(pki):
    """A CA made with the real CLI."""
    certmon("init-ca", "--cn", "test CA")
    return pki
