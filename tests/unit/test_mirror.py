"""The mirror's parts without a scheduler: manifests, pins, package and directory sources."""

import hashlib

import pytest

from llmgw import mirror
from llmgw.mirror import File, Mirror, PullError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_one_file_is_named_by_its_own_sha256_and_several_by_their_manifest():
    one = [File("m.gguf", "a" * 64, 3)]
    assert mirror.content_id(one) == "a" * 64
    two = [File("b", "b" * 64, 1), File("a", "a" * 64, 2)]
    assert mirror.content_id(two) == mirror.content_id(list(reversed(two)))
    assert mirror.content_id(two) not in ("a" * 64, "b" * 64)


def test_an_engine_is_pointed_at_the_file_the_first_split_part_or_the_directory():
    assert mirror.entry_file([File("m.gguf", "a" * 64, 1)]) == "m.gguf"
    split = [File(f"x-0000{i}-of-00002.gguf", str(i) * 64, 1) for i in (2, 1)]
    assert mirror.entry_file(split) == "x-00001-of-00002.gguf"
    assert mirror.entry_file([File("config.json", "a" * 64, 1), File("w.bin", "b" * 64, 1)]) == ""


def test_a_pin_refuses_other_content_naming_both_hashes():
    mirror.check_pin("m", "a" * 64, "", "")  # first pull: pinned to what it got
    mirror.check_pin("m", "a" * 64, "", "a" * 64)
    with pytest.raises(PullError, match=f"pinned to {'a' * 64}, the source now gives {'b' * 64}"):
        mirror.check_pin("m", "b" * 64, "", "a" * 64)
    with pytest.raises(PullError, match=f"the catalog says {'c' * 64}"):
        mirror.check_pin("m", "b" * 64, "c" * 64, "")


def test_a_directory_source_is_one_manifest_of_its_files(tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_bytes(b"{}")
    (src / "sub" / "w.bin").write_bytes(b"weights")
    m = Mirror(tmp_path / "mirror")
    files = m.pull(str(src))
    assert sorted((f.name, f.sha256) for f in files) == [
        ("config.json", sha(b"{}")), ("sub/w.bin", sha(b"weights"))]  # fmt: skip
    assert all(m.verify(f) == "ok" for f in files)


def test_a_package_source_is_assembled_on_the_control_plane(tmp_path, monkeypatch):
    pkg = tmp_path / "pkgs" / "tiny_mirror_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "MODEL_NAME = 'tiny.gguf'\n"
        "def assemble(path):\n"
        "    with open(path, 'wb') as f:\n"
        "        f.write(b'GGUF tiny')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    (f,) = Mirror(tmp_path / "mirror").pull("pypi:tiny-mirror-gguf")
    assert (f.name, f.sha256, f.size) == ("tiny.gguf", sha(b"GGUF tiny"), 9)
    with pytest.raises(PullError, match="not installed here"):
        Mirror(tmp_path / "mirror").pull("pypi:no-such-package-gguf")


def test_a_node_token_is_the_nodes_alone():
    t = mirror.node_token("secret", "gpu-01")
    assert mirror.node_token_ok("secret", "gpu-01", t)
    assert not mirror.node_token_ok("secret", "gpu-02", t)
    assert not mirror.node_token_ok("other", "gpu-01", t)
    assert not mirror.node_token_ok("secret", "gpu-01", "")
