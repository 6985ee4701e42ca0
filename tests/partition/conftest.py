"""Hosts for the partition tests, and the table each scenario prints."""

import pytest

from .fleet import PG_BIN, Fleet
from .net import Network, missing_tools
from .report import TABLES


@pytest.fixture
def net():
    """A network of this test's own, removed afterwards whatever happened."""
    why = missing_tools()
    if why:
        pytest.skip(f"partition tests: {why}")
    network = Network()
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def hosts(tmp_path, net, monkeypatch):
    """PostgreSQL running on `pg`, scheduler hosts `s1` and `s2`, nothing else started:
    each scenario adds its catalog, then `hosts.start()` starts the schedulers, agents and
    routers. The test process is the operator and the clients (LLMGW_STORE: pg)."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(
            f"partition tests: no PostgreSQL server in {PG_BIN} (apt-get install postgresql-15)"
        )
    f = Fleet(tmp_path, net)
    try:
        f.start_pg()
        monkeypatch.setenv("LLMGW_STORE", f.store)
        f.add_scheduler("s1")
        f.add_scheduler("s2")
        yield f
    finally:
        f.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The partition tables in every run's output, -s or not."""
    for table in config.stash.get(TABLES, []):
        terminalreporter.write_sep("-", "partition")
        terminalreporter.write_line(table)
