import pytest

from llmgw import catalog
from llmgw.config import ModelConfig, ProfileConfig, ScalingConfig
from llmgw.errors import ConfigError


def model(**kw):
    base = {"name": "m", "source": "/models/m.gguf"}
    return ModelConfig(**{**base, **kw})


def test_a_valid_model_becomes_plain_data_with_its_engine_id():
    (m,) = catalog.load([model(profile=ProfileConfig(context=2048, parallel=2))])
    assert (m.engine_id, m.context, m.parallel, m.min, m.max) == ("llama.cpp-0.3.36", 2048, 2, 1, 1)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"name": ""}, "name"),
        ({"source": ""}, "source"),
        ({"source": "https://example.org/m.gguf"}, "sha256"),
        ({"source": "file:///m.gguf"}, "sha256"),
        ({"sha256": "ABC"}, "sha256"),
        ({"source": "http://example.org/m.gguf", "sha256": "a" * 64}, "source"),
        ({"engine": "tgi"}, "engine"),
        ({"profile": ProfileConfig(context=16)}, "profile.context"),
        ({"profile": ProfileConfig(parallel=0)}, "profile.parallel"),
        ({"engine": "vllm", "profile": ProfileConfig(kv_cache_gib=-1)}, "profile.kv_cache_gib"),
        ({"profile": ProfileConfig(kv_cache_gib=2)}, "profile.kv_cache_gib"),
        ({"scaling": ScalingConfig(min=2, max=1)}, "scaling"),
        ({"scaling": ScalingConfig(up_after_s=-1)}, "scaling.up_after_s"),
        ({"scaling": ScalingConfig(cooldown_s=-1)}, "scaling.cooldown_s"),
        ({"scaling": ScalingConfig(down_below=1.5)}, "scaling.down_below"),
    ],
)
def test_an_invalid_model_is_refused_naming_the_model_and_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        catalog.load([model(**kw)])
    assert f" {field} " in str(err.value)
    if kw.get("name", "m"):
        assert "model 'm'" in str(err.value)


def test_the_scaling_settings_reach_the_autoscaler():
    cfg = ScalingConfig(min=1, max=4, target_queue_wait_s=2.0, up_after_s=10.0,
                        down_below=0.2, down_after_s=60.0, cooldown_s=30.0)  # fmt: skip
    (m,) = catalog.load([model(scaling=cfg)])
    s = m.scaling()
    assert (s.min, s.max, s.target_queue_wait_s, s.up_after_s) == (1, 4, 2.0, 10.0)
    assert (s.down_below, s.down_after_s, s.cooldown_s) == (0.2, 60.0, 30.0)


def test_a_name_or_alias_used_twice_is_refused():
    with pytest.raises(ConfigError, match="'a' is already used by model 'm'"):
        catalog.load([model(aliases=["a"]), model(name="n", aliases=["a"])])


def test_a_fallback_must_name_a_model_in_the_catalog():
    with pytest.raises(ConfigError, match="fallbacks names unknown model 'x'"):
        catalog.load([model(fallbacks=["x"])])


def test_an_engine_an_agent_defines_is_accepted():
    (m,) = catalog.load([model(engine="fake", engine_version="1")], extra_engines={"fake"})
    assert m.engine_id == "fake-1"


def test_the_profile_hash_changes_with_what_changes_a_replica():
    (a,) = catalog.load([model()])
    (b,) = catalog.load([model(profile=ProfileConfig(context=8192))])
    (c,) = catalog.load([model(scaling=ScalingConfig(min=0, max=3))])
    assert a.profile_hash() != b.profile_hash()
    assert a.profile_hash() == c.profile_hash()


def test_a_vllm_model_without_gpus_is_a_cpu_model_with_its_kv_space_in_its_profile():
    cpu = ProfileConfig(kv_cache_gib=2)
    (m,) = catalog.load([model(source="/models/smollm2", engine="vllm", profile=cpu)])
    (d,) = catalog.load([model(source="/models/smollm2", engine="vllm")])
    assert (m.engine_id, m.gpus, m.kv_cache_gib) == ("vllm-0.32.0", 0, 2)
    assert m.to_json()["kv_cache_gib"] == 2
    assert m.profile_hash() != d.profile_hash()
    # Unset, it leaves the hash of every profile from before it as it was.
    (a,) = catalog.load([model()])
    assert a.profile_hash() == "e1b9292b8f463069"
