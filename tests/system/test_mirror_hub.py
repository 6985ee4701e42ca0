"""hf:// sources through the real scheduler and `llmgw weights pull`, from a fake hub on
loopback (tests/fake_hub.py) reached with huggingface_hub's own HF_ENDPOINT: a branch
pinned to its commit, a private repo pulled with the token file, and every refusal one
line on stderr with a non-zero exit."""

import hashlib
import json

import pytest

from tests.fake_hub import FakeHub
from tests.helpers import eventually
from tests.system.conftest import GiB

GGUF_1 = b"GGUF first" + bytes(4000)
GGUF_2 = b"GGUF second" + bytes(4000)
TOKEN = "hf_ThisIsTheSecretTokenOfTheTest"
REPO = {
    "README.md": b"# card",
    ".gitattributes": b"*.safetensors filter=lfs",
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"model": {}}',
    "model.safetensors": b"S" * 5000,
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


@pytest.fixture
def fake_hub(cluster):
    h = FakeHub()
    cluster.scheduler_env = {
        "HF_ENDPOINT": h.url,
        "HF_HOME": str(cluster.tmp / "hf-home"),
        "HF_HUB_OFFLINE": "0",
    }
    yield h
    h.stop()


def test_a_branch_is_pinned_to_its_commit_and_a_moved_branch_is_refused_naming_both(
    cluster, fake_hub
):
    first = fake_hub.push("org/tiny", {"m.gguf": GGUF_1})
    cluster.add_model("m", memory=GiB, source="hf://org/tiny@main/m.gguf")
    cluster.start_scheduler()
    (pulled,) = json.loads(ok(cluster.ctl("weights", "pull", "m", "--json")))
    assert (pulled["sha256"], pulled["revision"], pulled["new"]) == (sha(GGUF_1), first, True)
    again = cluster.ctl("weights", "pull", "m")
    assert again.returncode == 0 and f"up to date: m {sha(GGUF_1)[:12]}" in again.stderr
    assert f"at commit {first[:12]}" in again.stderr
    assert len(fake_hub.asked("/resolve/")) == 2  # HEAD and GET once: the blob is here

    second = fake_hub.push("org/tiny", {"m.gguf": GGUF_2})  # main moves on
    refused = cluster.ctl("weights", "pull", "m")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip() == (
        f"error: weights of m changed upstream: hf://org/tiny@main/m.gguf was pinned to commit"
        f" {first} at its first pull and now resolves to {second}; to take it, set source ="
        f' "hf://org/tiny@{second}/m.gguf"'
    )
    assert len(fake_hub.asked("/resolve/")) == 2  # refused before any download
    (still,) = json.loads(ok(cluster.ctl("weights", "list", "--json")))
    assert (still["sha256"], still["revision"]) == (sha(GGUF_1), first)

    # The operator names the new commit in the catalog: that is the new pin.
    cluster.scheduler.stop()
    cluster.models[0]["source"] = f"hf://org/tiny@{second}/m.gguf"
    cluster.start_scheduler()
    (taken,) = json.loads(ok(cluster.ctl("weights", "pull", "m", "--json")))
    assert (taken["sha256"], taken["revision"], taken["new"]) == (sha(GGUF_2), second, True)
    pulls = cluster.admin("/v1/audit?action=weights.pull")
    assert [e["detail"]["revision"] for e in pulls] == [first, second]


def test_a_private_repo_is_pulled_with_the_token_file_and_refusals_are_one_line(cluster, fake_hub):
    commit = fake_hub.push("org/private", REPO, token=TOKEN)
    token_file = cluster.tmp / "hf.token"
    token_file.write_text("hf_not_the_right_one\n")
    cluster.scheduler_extra = 'hf_token_file = "hf.token"\n'  # beside the scheduler's config
    cluster.add_model("p", memory=GiB, source="hf://org/private")
    cluster.add_model("gone", memory=GiB, min_=0, source="hf://org/nothing/m.gguf")
    cluster.add_model("norev", memory=GiB, min_=0, source="hf://org/private@v9")
    cluster.add_model("nofile", memory=GiB, min_=0, source="hf://org/private/model.gguf")
    cluster.start_scheduler()

    bad_token = cluster.ctl("weights", "pull", "p")
    assert bad_token.returncode == 1
    assert bad_token.stderr == (
        f"error: weights of p: the hub refused the token in {token_file} (401): put a valid"
        " token in it\n"
    )
    assert not (cluster.tmp / "scheduler-state" / "mirror" / "blobs").exists()

    token_file.write_text(TOKEN + "\n")  # read at each pull: no restart
    (pulled,) = json.loads(ok(cluster.ctl("weights", "pull", "p", "--json")))
    served = ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(f["name"] for f in pulled["files"]) == served
    assert pulled["revision"] == commit
    assert {a for m, p, a in fake_hub.seen if p.startswith("/org/private/")} == {f"Bearer {TOKEN}"}

    for model, says in [
        ("gone", "weights of gone: org/nothing is not on the hub at"),
        ("norev", "weights of norev: org/private has no revision 'v9': name a branch, tag or"),
        ("nofile", "weights of nofile: org/private has no file model.gguf"),
    ]:
        refused = cluster.ctl("weights", "pull", model)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(f"error: {says}"), refused.stderr

    # The token is in no log, no answer and not in the store.
    listed = ok(cluster.ctl("weights", "list", "--json"))
    assert [r["state"] for r in json.loads(listed)] == ["not pulled", "not pulled", "not pulled",
                                                       "mirrored"]  # fmt: skip
    store = b"".join(p.read_bytes() for p in cluster.tmp.glob("llmgw.db*"))
    assert store and TOKEN.encode() not in store
    assert TOKEN not in cluster.scheduler.log() and TOKEN not in listed
    # HF's own cache got no copy: the files are in the mirror alone.
    assert [p for p in (cluster.tmp / "hf-home").rglob("*") if p.is_file()] == []
    assert not list((cluster.tmp / "scheduler-state" / "mirror" / "tmp").iterdir())

    # A node gets the repo from the mirror as one directory.
    cluster.start_agent("node-a", memory=4 * GiB)
    eventually(lambda: [r["state"] for r in cluster.admin("/v1/replicas") if r["model"] == "p"]
               == ["ready"], timeout=30, what="p ready")  # fmt: skip
    got = cluster.tmp / "agent-node-a" / "weights" / "sha256" / pulled["sha256"]
    assert {n: (got / n).read_bytes() for n in served} == {n: REPO[n] for n in served}
