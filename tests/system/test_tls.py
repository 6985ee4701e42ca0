"""HTTPS with certificates from llmgw-certmon: the router, and the admin API with llmgw."""

import os
import ssl

import openai
import pytest
import requests

from tests.helpers import BIN, Proc, eventually, free_port, start_fake_engine


def certmon(etc, *args):
    import subprocess

    cfg = etc / "certmon.toml"
    cfg.write_text(f'[paths]\nconfig_dir = "{etc}"\n')
    result = subprocess.run(
        [str(BIN / "llmgw-certmon"), "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return etc / "pki"


@pytest.fixture
def pki(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    certmon(etc, "init-ca")
    return certmon(etc, "issue", "localhost", "--san", "127.0.0.1", "--san", "localhost")


def test_the_router_serves_https_with_an_issued_certificate(tmp_path, pki, api_key):
    engine, engine_url = start_fake_engine(tmp_path)
    port = free_port()
    cfg = tmp_path / "router.toml"
    cfg.write_text(
        f'[router]\nlisten = "127.0.0.1:{port}"\nkey_refresh_s = 0.2\n'
        f'tls_cert = "{pki / "localhost.crt"}"\ntls_key = "{pki / "localhost.key"}"\n'
        f'[[router.endpoints]]\nid = "e0"\nurl = "{engine_url}"\nmodels = ["m"]\n'
        f'[paths]\nstate_dir = "{tmp_path / "state"}"\n'
    )
    router = Proc([str(BIN / "llmgw-router"), "--config", str(cfg)], tmp_path / "router.log")
    base = f"https://127.0.0.1:{port}"
    ca = str(pki / "ca.crt")
    try:
        eventually(
            lambda: requests.get(f"{base}/ready", verify=ca, timeout=2).ok,
            timeout=20,
            what="the router over https",
        )
        http = openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca))
        with openai.OpenAI(
            base_url=base + "/v1", api_key=api_key[1], max_retries=0, http_client=http
        ) as client:
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        assert reply.choices[0].message.content
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{base}/health", timeout=5)  # the system's CAs do not know ours
    finally:
        router.stop()
        engine.stop()


def test_llmgw_reaches_an_https_admin_api_verifying_the_cluster_ca(cluster, pki):
    cluster.scheduler_extra = (
        f'admin_tls_cert = "{pki / "localhost.crt"}"\nadmin_tls_key = "{pki / "localhost.key"}"\n'
    )
    cluster.admin_scheme = "https"
    cluster.start_scheduler()
    result = cluster.ctl("models", "--json")  # the CA is in <config_dir>/pki: found alone
    assert result.returncode == 0, result.stderr
    (cluster.tmp / "other").mkdir()
    other_ca = certmon(cluster.tmp / "other", "init-ca") / "ca.crt"
    os.environ["LLMGW_CA"] = str(other_ca)  # trust another CA only: the handshake fails
    try:
        refused = cluster.ctl("models", "--json")
    finally:
        del os.environ["LLMGW_CA"]
    assert refused.returncode == 1
    assert "cannot reach the scheduler" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
