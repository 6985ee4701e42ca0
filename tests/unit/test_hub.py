"""hf:// sources without a hub: how they are read, which files of a repo a pull takes,
and how a moved revision is refused."""

import pytest

from llmgw import catalog, hub, mirror
from llmgw.config import model_from
from llmgw.errors import ConfigError
from llmgw.hub import HubError, HubSource, SourceError
from llmgw_ctl.weights import _progress

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    "source, repo, revision, file",
    [
        ("hf://org/repo", "org/repo", "", ""),
        ("hf://org/repo@main", "org/repo", "main", ""),
        ("hf://Org-1/Re.po_2@v1.0/model-Q4_K_M.gguf", "Org-1/Re.po_2", "v1.0", "model-Q4_K_M.gguf"),
        ("hf://org/repo/sub/dir/m.gguf", "org/repo", "", "sub/dir/m.gguf"),
        (f"hf://org/repo@{COMMIT}", "org/repo", COMMIT, ""),
        ("hf://org/repo@refs%2Fpr%2F1/m.gguf", "org/repo", "refs/pr/1", "m.gguf"),
    ],
)
def test_a_good_hf_source_gives_its_repo_revision_and_file(source, repo, revision, file):
    src = hub.parse(source)
    assert src == HubSource(repo, revision, file)
    assert src.at(src.revision) == source  # and it is written back the same
    assert catalog.source_kind(source) == "hf"


@pytest.mark.parametrize(
    "source, why",
    [
        ("hf://repo", "must name a repo as hf://ORG/REPO"),
        ("hf://org/", "must name a repo"),
        ("hf://-org/repo", "must name a repo"),
        ("hf://org/re po", "must name a repo"),
        ("hf://org/re--po", "must name a repo"),
        ("hf://org/repo@", "is not a branch, tag or commit"),
        ("hf://org/repo@a..b", "is not a branch, tag or commit"),
        ("hf://org/repo@a~1", "is not a branch, tag or commit"),
        ("hf://org/repo/", "FILE after ORG/REPO must be a path in the repo"),
        ("hf://org/repo@main/", "FILE after ORG/REPO must be a path"),
        ("hf://org/repo//m.gguf", "FILE after ORG/REPO must be a path"),
        ("hf://org/repo/../m.gguf", "FILE after ORG/REPO must be a path"),
        ("hf://org/repo/a/./m.gguf", "FILE after ORG/REPO must be a path"),
    ],
)
def test_a_bad_hf_source_is_refused_saying_what_is_wrong(source, why):
    with pytest.raises(SourceError, match=why):
        hub.parse(source)


def test_the_catalog_refuses_a_bad_hf_source_naming_the_model_and_needs_no_sha256():
    def model(source):
        return model_from({"name": "m", "source": source, "engine": "llama.cpp",
                           "engine_version": "1"})  # fmt: skip

    (m,) = catalog.load([model("hf://org/repo@main/m.gguf")])
    assert (m.source, m.sha256) == ("hf://org/repo@main/m.gguf", "")
    with pytest.raises(ConfigError, match=r"model 'm': source 'hf://org/' must name a repo"):
        catalog.load([model("hf://org/")])


REPO = [
    ".gitattributes", "README.md", "LICENSE", "assets/chart.png", ".github/workflow.yml",
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "tf_model.h5", "flax_model.msgpack", "onnx/model.onnx", "original/consolidated.00.pth",
    "original/params.json", "model-q4.gguf",
]  # fmt: skip


def test_a_whole_repo_keeps_what_a_server_reads_and_one_copy_of_the_weights():
    assert hub.choose(HubSource("o/r", "", ""), REPO) == [
        "LICENSE", "chat_template.jinja", "config.json", "generation_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "original/params.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip


def test_a_repo_without_safetensors_keeps_its_pytorch_weights():
    names = ["config.json", "pytorch_model.bin", "README.md", "tf_model.h5"]
    assert hub.choose(HubSource("o/r", "", ""), names) == ["config.json", "pytorch_model.bin"]


def test_a_repo_with_no_weights_or_many_ggufs_must_be_named_by_one_file():
    with pytest.raises(HubError, match="o/r holds no weights"):
        hub.choose(HubSource("o/r", "", ""), ["README.md", "config.json", "model.onnx"])
    ggufs = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "README.md"]
    with pytest.raises(HubError, match=r"holds 2 GGUF models: name one as hf://o/r@v1/FILE"):
        hub.choose(HubSource("o/r", "v1", ""), ggufs)
    split = ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    assert hub.choose(HubSource("o/r", "", ""), split) == split  # one model in two parts


def test_one_file_is_taken_alone_or_with_the_other_parts_of_its_split_gguf():
    names = ["a.gguf", "b.gguf", "q/x-00001-of-00002.gguf", "q/x-00002-of-00002.gguf"]
    assert hub.choose(HubSource("o/r", "", "b.gguf"), names) == ["b.gguf"]
    assert hub.choose(HubSource("o/r", "", "q/x-00001-of-00002.gguf"), names) == [
        "q/x-00001-of-00002.gguf", "q/x-00002-of-00002.gguf"]  # fmt: skip
    with pytest.raises(HubError, match=r"o/r has no file c.gguf \(it holds a.gguf, b.gguf,"):
        hub.choose(HubSource("o/r", "", "c.gguf"), names)
    with pytest.raises(HubError, match="is missing q/x-00002-of-00002.gguf"):
        hub.choose(HubSource("o/r", "", "q/x-00001-of-00002.gguf"), names[:3])


def test_a_file_name_that_leaves_the_repo_is_refused():
    with pytest.raises(HubError, match="outside the repo"):
        hub.choose(HubSource("o/r", "", ""), ["config.json", "../../etc/x.safetensors"])


def test_a_revision_that_moved_is_refused_naming_both_commits_and_the_source_to_set():
    old, new = "a" * 40, "b" * 40
    mirror.check_revision("m", "hf://o/r@main/m.gguf", "", old)  # first pull: pinned now
    mirror.check_revision("m", "hf://o/r@main/m.gguf", old, old)
    with pytest.raises(mirror.PullError) as e:
        mirror.check_revision("m", "hf://o/r@main/m.gguf", old, new)
    assert e.value.code == "changed_upstream"
    assert str(e.value) == (
        f"weights of m changed upstream: hf://o/r@main/m.gguf was pinned to commit {old} at"
        f" its first pull and now resolves to {new}; to take it, set source ="
        f' "hf://o/r@{new}/m.gguf"'
    )


def test_pull_progress_says_bytes_of_the_total_and_which_file_of_several():
    assert _progress({"model": "m", "done": 2048}) == "m: 2 KiB"
    one = {"model": "m", "done": 1024, "total": 4096, "file": "a", "file_index": 1, "files": 1}
    assert _progress(one) == "m: 1 KiB of 4 KiB"
    two = {**one, "file": "w-2.safetensors", "file_index": 2, "files": 3}
    assert _progress(two) == "m: 1 KiB of 4 KiB, file 2 of 3 (w-2.safetensors)"
