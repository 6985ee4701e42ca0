"""The mirror pulling hf:// sources through the real huggingface_hub from a fake hub on
loopback (tests/fake_hub.py): one file, a whole repo as one manifest, progress, the
token file, and refusals that leave nothing behind."""

import hashlib

import pytest

from llmgw import hub
from llmgw.mirror import Mirror, PullError, content_id
from tests.fake_hub import FakeHub

GGUF = b"GGUF" + bytes(range(256)) * 40
SHARDS = {f"model-0000{i}-of-00002.safetensors": bytes([i]) * 3000 for i in (1, 2)}
REPO = {
    "README.md": b"# a model card",
    ".gitattributes": b"*.safetensors filter=lfs",
    "assets/logo.png": b"\x89PNG",
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"model": {}}',
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "pytorch_model.bin": b"a pickle of the same weights",
    **SHARDS,
}
SERVED = sorted(set(REPO) - {"README.md", ".gitattributes", "assets/logo.png", "pytorch_model.bin"})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")  # must never be sent
    h = FakeHub()
    yield h
    h.stop()


def leftovers(tmp_path) -> list[str]:
    """Files anywhere but the mirror's blobs and the test's own token file."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.is_file() and "blobs" not in p.parts and p.name != "hf.token"
                  and p.suffix not in (".toml", ".db"))  # fmt: skip


def test_one_file_comes_into_the_mirror_by_sha256_and_no_other_copy_is_left(fake_hub, tmp_path):
    commit = fake_hub.push("org/tiny", {"m.gguf": GGUF, "other.gguf": b"GGUF other"})
    m = Mirror(tmp_path / "mirror")
    files, got = m.pull_hub("hf://org/tiny/m.gguf", hub.Hub(fake_hub.url), "tiny")
    assert got == commit
    assert [(f.name, f.sha256, f.size) for f in files] == [("m.gguf", sha(GGUF), len(GGUF))]
    assert m.blob(sha(GGUF)).read_bytes() == GGUF
    assert leftovers(tmp_path) == []  # no staging folder, nothing in HF_HOME
    assert {a for _, _, a in fake_hub.seen} == {""}  # no token: not even HF_TOKEN's
    assert fake_hub.asked("other.gguf") == []


def test_a_whole_repo_is_one_manifest_of_what_a_server_reads_with_progress(fake_hub, tmp_path):
    commit = fake_hub.push("org/llama", REPO)
    seen = []
    files, got = Mirror(tmp_path / "mirror").pull_hub(
        f"hf://org/llama@{commit}", hub.Hub(fake_hub.url), "llama",
        progress=lambda done, **about: seen.append((done, about)),
    )  # fmt: skip
    assert got == commit
    assert sorted((f.name, f.sha256) for f in files) == [(n, sha(REPO[n])) for n in SERVED]
    assert len({content_id(files), *(f.sha256 for f in files)}) == len(files) + 1
    total = sum(len(REPO[n]) for n in SERVED)
    assert seen[-1] == (total, {"total": total, "file": SERVED[-1],
                                "file_index": len(SERVED), "files": len(SERVED)})  # fmt: skip
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert {a["file"] for _, a in seen} == set(SERVED)
    assert fake_hub.asked("README.md") == fake_hub.asked("pytorch_model.bin") == []
    assert leftovers(tmp_path) == []


def test_the_token_is_read_from_its_file_at_each_pull_and_sent_to_the_hub(fake_hub, tmp_path):
    fake_hub.push("org/private", {"m.gguf": GGUF}, token="hf_right")
    token_file = tmp_path / "hf.token"
    hubs = hub.Hub(fake_hub.url, token_file)
    m = Mirror(tmp_path / "mirror")
    token_file.write_text("hf_wrong\n")
    with pytest.raises(PullError) as e:
        m.pull_hub("hf://org/private/m.gguf", hubs, "p")
    assert (e.value.code, str(e.value)) == (
        "hub_unauthorized",
        f"weights of p: the hub refused the token in {token_file} (401): put a valid token in it",
    )
    token_file.write_text("hf_right\n")  # rotated: no restart, no new Hub
    files, _ = m.pull_hub("hf://org/private/m.gguf", hubs, "p")
    assert files[0].sha256 == sha(GGUF)
    assert {a for _, _, a in fake_hub.seen[1:]} == {"Bearer hf_right"}
    assert "hf_wrong" not in str(e.value) and "hf_right" not in str(e.value)


@pytest.mark.parametrize(
    "source, token, code, says",
    [
        ("hf://org/nothing", None, "hub_repo_not_found",
         "org/nothing is not on the hub at {url}, or it is private and no token is set"
         " (scheduler.hf_token_file): check ORG/REPO in the source"),
        ("hf://org/private", None, "hub_repo_not_found", "org/private is not on the hub"),
        ("hf://org/private", "hf_other", "hub_repo_not_found",
         "or it is private and the token in {token_file} cannot see it"),
        ("hf://org/tiny@v9", None, "hub_revision_not_found",
         "org/tiny has no revision 'v9': name a branch, tag or commit it has"),
        ("hf://org/tiny/x.gguf", None, "hub_file_not_found",
         "org/tiny has no file x.gguf (it holds m.gguf)"),
        ("hf://org/tiny/m.gguf", "", "hub_token_unreadable",
         "cannot read the hub token from scheduler.hf_token_file ({token_file}): No such file"),
    ],
)  # fmt: skip
def test_a_refused_pull_is_one_line_naming_the_model_and_leaves_nothing(
    fake_hub, tmp_path, source, token, code, says
):
    fake_hub.push("org/tiny", {"m.gguf": GGUF})
    fake_hub.push("org/private", {"m.gguf": GGUF}, token="hf_right")
    fake_hub.tokens.add("hf_other")  # a token the hub knows, of another account
    token_file = tmp_path / "hf.token"
    if token:
        token_file.write_text(token)
    hubs = hub.Hub(fake_hub.url, token_file if token is not None else None)
    m = Mirror(tmp_path / "mirror")
    with pytest.raises(PullError) as e:
        m.pull_hub(source, hubs, "model-x")
    message = str(e.value)
    assert e.value.code == code
    assert message.startswith("weights of model-x: ") and "\n" not in message
    assert says.format(url=fake_hub.url, token_file=token_file) in message
    assert not (tmp_path / "mirror" / "blobs").exists() and leftovers(tmp_path) == []


def test_bytes_other_than_the_hubs_sha256_are_not_kept(fake_hub, tmp_path, monkeypatch):
    fake_hub.push("org/tiny", {"m.gguf": GGUF})
    real = hub.Hub.resolve

    def lying(self, src, token):  # the hub's listing names other bytes than it serves
        snap = real(self, src, token)
        wrong = hub.Remote("m.gguf", len(GGUF), "f" * 64)
        return hub.Snapshot(snap.commit, {"m.gguf": wrong})

    monkeypatch.setattr(hub.Hub, "resolve", lying)
    with pytest.raises(PullError, match=f"m.gguf at .* gave sha256 {sha(GGUF)}, the hub says f"):
        Mirror(tmp_path / "mirror").pull_hub("hf://org/tiny/m.gguf", hub.Hub(fake_hub.url), "t")
    assert not (tmp_path / "mirror" / "blobs").exists() and leftovers(tmp_path) == []
