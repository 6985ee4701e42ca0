"""The fleet every chaos test breaks, and the table each one prints."""

import pytest

from tests.helpers import eventually
from tests.system.conftest import GiB

from .fleet import NODE_MEMORY, ChaosCluster, ready, role
from .report import TABLES


@pytest.fixture
def fleet(tmp_path, pg_store, api_key):
    """s1 leading and s2 standing by on PostgreSQL; node-a and node-b serving one replica
    each of model m; routers r1 and r2; every engine slowed to SLOW's pace."""
    c = ChaosCluster(tmp_path)
    c.add_scheduler("s2")
    c.add_model("m", memory=GiB, min_=2, max_=2)
    try:
        c.start_scheduler("s1")
        eventually(lambda: role(c, "s1") == "leader", what="s1 to lead")
        c.start_scheduler("s2")
        c.start_agent("node-a", memory=NODE_MEMORY)
        c.start_agent("node-b", memory=NODE_MEMORY)
        c.start_named_router("r1")
        c.start_named_router("r2")
        c.secret = api_key[1]
        eventually(lambda: ready(c, "s1") == 2, timeout=40, what="two ready replicas")
        eventually(
            lambda: all(len(c.shards(n)) == 1 for n in ("node-a", "node-b")),
            what="one replica on each node",
        )
        for name, url in c.router_urls.items():
            eventually(lambda u=url: c.serves_at(u, "m"), timeout=20, what=f"{name} to serve m")
        c.slow_engines()
        yield c
    finally:
        c.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The chaos table in every run's output, -s or not."""
    for table in config.stash.get(TABLES, []):
        terminalreporter.write_sep("-", "chaos")
        terminalreporter.write_line(table)
