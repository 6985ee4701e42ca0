"""`llmgw-certmon serve` as a real process: it reads the certificates at every scrape."""

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.certmon.conftest import certmon
from tests.helpers import BIN, Proc, eventually, free_port


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(metric, cert): value} from one scrape."""
    text = requests.get(url, timeout=5).text
    return {
        (s.name, s.labels["cert"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "cert" in s.labels
    }


def expiry_of(pki, name: str) -> float:
    from cryptography import x509

    return x509.load_pem_x509_certificate(
        (pki / f"{name}.crt").read_bytes()
    ).not_valid_after_utc.timestamp()


@pytest.fixture
def serve(ca, isolated_paths):
    port = free_port()
    cfg = isolated_paths / "etc" / "llmgw.toml"
    cfg.write_text(cfg.read_text() + f'\n[certmon]\nlisten = "127.0.0.1:{port}"\n')
    url = f"http://127.0.0.1:{port}/metrics"
    proc = Proc([str(BIN / "llmgw-certmon"), "serve"], isolated_paths / "certmon.log", health=url)
    proc.wait_healthy()
    yield proc, url
    assert proc.stop() == 0, proc.log()


EXPIRY = "llmgw_certificate_expiry_timestamp_seconds"
ERRORS = "llmgw_certificate_read_errors"


def test_a_replaced_certificate_is_seen_at_the_next_scrape_without_a_restart(ca, serve):
    proc, url = serve
    certmon("issue", "web", "--san", "web.lan", "--days", "5")
    first = expiry_of(ca, "web")
    assert eventually(lambda: scrape(url).get((EXPIRY, "web")) == first, what="web's expiry")

    certmon("issue", "web", "--san", "web.lan", "--days", "60", "--force")
    second = expiry_of(ca, "web")
    assert second > first
    eventually(lambda: scrape(url).get((EXPIRY, "web")) == second, what="the new expiry")
    assert scrape(url)[(EXPIRY, "ca")] == expiry_of(ca, "ca")
    assert proc.p.poll() is None


def test_an_unreadable_certificate_is_reported_not_fatal(ca, serve):
    proc, url = serve
    certmon("issue", "web", "--san", "web.lan")
    (ca / "web.crt").write_text("-----BEGIN CERTIFICATE-----\ntruncated\n")

    metrics = eventually(lambda: (m := scrape(url)).get((ERRORS, "web")) == 1 and m)
    assert (EXPIRY, "web") not in metrics
    assert metrics[(ERRORS, "ca")] == 0 and (EXPIRY, "ca") in metrics
    assert proc.p.poll() is None
    eventually(lambda: "cert_unreadable cert=web" in proc.log(), what="the warning")


def test_serve_refuses_a_port_that_is_taken_with_one_line(ca, serve):
    _, url = serve
    port = url.split(":")[2].split("/")[0]
    result = certmon("serve", "--listen", f"127.0.0.1:{port}", check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: cannot listen on")
