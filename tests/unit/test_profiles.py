"""Named profiles per model ([[models.profiles]]): parsed and checked as `profile` is,
tried in order by placement, and the one each replica got is the one it records."""

import dataclasses

import pytest

from llmgw import catalog, config, engines
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.engines import CPU
from llmgw.errors import ConfigError
from llmgw.placement import Fleet, GiB, Need, NodeView, first_fit, gpus_of
from llmgw.reconciler import Desired, reconcile
from tests import third_engine

LLAMA = "llama.cpp-0.3.36"
THREE = """
[[models]]
name = "m"
source = "/w/m.gguf"
[[models.profiles]]
name = "tp2"
gpus = 2
[[models.profiles]]
name = "1gpu"
gpus = 1
context = 2048
[[models.profiles]]
name = "cpu"
"""


def load_toml(tmp_path, text: str) -> list[catalog.Model]:
    file = tmp_path / "llmgw.toml"
    file.write_text(text)
    return catalog.from_config(config.load(file))


def test_profiles_load_in_order_and_the_model_reads_as_its_first(tmp_path):
    (m,) = load_toml(tmp_path, THREE)
    assert [o.profile_name for o in m.options()] == ["tp2", "1gpu", "cpu"]
    assert (m.profile_name, m.gpus, m.context) == ("tp2", 2, 4096)
    one = m.at("1gpu")
    assert (one.gpus, one.context, one.name) == (1, 2048, "m")
    assert m.at("cpu").gpus == 0 and m.at("nope") is None
    assert len({o.profile_hash() for o in m.options()}) == 3


def test_a_model_with_one_profile_is_named_default_and_hashes_as_before(tmp_path):
    (m,) = load_toml(tmp_path, '[[models]]\nname = "m"\nsource = "/w/m.gguf"\n'
                               "[models.profile]\ncontext = 2048\n")  # fmt: skip
    assert [o.profile_name for o in m.options()] == ["default"]
    assert m.at("default") is m and m.definition_hash() == m.profile_hash()
    plain = catalog.Model(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                             if f.name not in ("profile_name", "profiles")})  # fmt: skip
    assert plain.profile_hash() == m.profile_hash()


@pytest.mark.parametrize(
    "extra,error",
    [
        ("[models.profile]\ncontext = 2048\n",
         "model 'm': profiles and profile must not both be given"),
        ('[[models.profiles]]\nname = "cpu"\n',
         "model 'm': profiles[3].name 'cpu' is already the name of another profile"),
        ("[[models.profiles]]\ngpus = 1\n", "model 'm': profiles[3].name must be 1-64"),
        ('[[models.profiles]]\nname = "x"\ncontext = 16\n',
         "model 'm': profiles[3].context must be at least 256"),
        ('[[models.profiles]]\nname = "x"\nnodes = 2\n', "model 'm': profiles[3].nodes must be 1"),
    ],
)  # fmt: skip
def test_profiles_that_cannot_work_are_refused_in_one_line_naming_the_model(tmp_path, extra, error):
    with pytest.raises(ConfigError) as e:
        load_toml(tmp_path, THREE + extra)
    assert str(e.value).startswith(error)
    assert "\n" not in str(e.value)


def test_an_empty_profiles_list_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^model 'm': profiles must not be empty"):
        load_toml(tmp_path, '[[models]]\nname = "m"\nsource = "/w/m.gguf"\nprofiles = []\n')


def test_a_name_in_the_one_profile_is_refused():
    with pytest.raises(ConfigError, match=r"^model 'm': profile.name must not be set"):
        catalog.load([ModelConfig(name="m", source="/w/m.gguf",
                                  profile=ProfileConfig(name="x"))])  # fmt: skip


def test_a_gpu_profile_among_profiles_on_an_engine_that_never_uses_a_gpu_is_refused():
    cpu_only = dataclasses.replace(third_engine.ENGINE, name="cpuonly", needs_gpus=False,
                                   accelerators=frozenset({CPU}))  # fmt: skip
    engines.register(cpu_only)
    try:
        m = ModelConfig(name="big", source="/w/m.gguf", engine="cpuonly",
                        profiles=[ProfileConfig(name="cpu"),
                                  ProfileConfig(name="gpu", gpus=1)])  # fmt: skip
        with pytest.raises(ConfigError) as e:
            catalog.load([m])
    finally:
        engines.unregister("cpuonly")
    assert str(e.value) == ("model 'big': profiles[1].gpus must be 0: the cpuonly engine"
                            " cannot use a GPU (built for CPU only)")  # fmt: skip


def three_needs() -> tuple[Need, ...]:
    return (Need("m", 10 * GiB, 2, LLAMA, profile="tp2"),
            Need("m", 10 * GiB, 1, LLAMA, profile="1gpu"),
            Need("m", 4 * GiB, 0, LLAMA, profile="cpu"))  # fmt: skip


def gpu_node(*free_gib: int, memory_gib: int = 16) -> NodeView:
    return NodeView("a", memory_free=memory_gib * GiB, engines={LLAMA: "installed"},
                    gpus=gpus_of(*(g * GiB for g in free_gib)))  # fmt: skip


def test_a_node_with_one_free_gpu_gets_the_one_gpu_profile():
    needs = three_needs()
    d = reconcile([Desired("m", 1, 1, needs[0], needs)], [], [gpu_node(24)], {}, 0.0)
    assert d.starts == [("m", "a", False)]
    assert d.profiles == {"m": "1gpu"}


def test_a_node_without_gpus_gets_the_cpu_profile():
    needs = three_needs()
    d = reconcile([Desired("m", 1, 1, needs[0], needs)], [], [gpu_node()], {}, 0.0)
    assert (d.starts, d.profiles) == ([("m", "a", False)], {"m": "cpu"})


def test_the_first_profile_is_used_where_it_fits():
    needs = three_needs()
    d = reconcile([Desired("m", 1, 1, needs[0], needs)], [], [gpu_node(24, 24)], {}, 0.0)
    assert d.profiles == {"m": "tp2"}


def test_an_unplaceable_model_says_why_each_profile_did_not_fit_on_each_node():
    needs = three_needs()
    d = reconcile([Desired("m", 1, 1, needs[0], needs)], [],
                  [gpu_node(4, memory_gib=2), NodeView("b", lost=True)], {}, 0.0)  # fmt: skip
    assert d.starts == []
    assert dict(d.unplaceable["m"]) == {
        "a": "tp2: needs 2 GPUs, has 1 | 1gpu: needs 1 GPU with 10 GiB free, has 0"
             " | cpu: needs 4 GiB, 2 GiB free",
        "b": "lost",
    }  # fmt: skip


def test_first_fit_books_nothing_itself_and_later_needs_see_the_bookings():
    fleet = Fleet([gpu_node(24)])
    need, p = first_fit(fleet, three_needs())
    assert (need.profile, p.node) == ("1gpu", "a")
    fleet.take(need, "a")
    need, p = first_fit(fleet, three_needs())
    assert (need.profile, p.node) == ("cpu", "a")
