import dataclasses

import pytest

from llmgw import config
from llmgw.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "llmgw.toml"
    path.write_text(text)
    return path


def test_an_absent_default_config_means_every_default(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMGW_CONFIG")
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "missing.toml")
    cfg = config.load()
    assert cfg.router.listen == "127.0.0.1:8080"
    assert cfg.source == ""


def test_a_config_file_that_was_asked_for_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        config.load(tmp_path / "nope.toml")


def test_an_unknown_key_is_an_error_naming_the_key_and_the_file(tmp_path):
    path = write(tmp_path, "[router]\nlisten = '127.0.0.1:1'\nretires = 3\n")
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert "router.retires" in str(err.value)
    assert str(path) in str(err.value)


def test_an_unknown_key_inside_an_endpoint_table_is_named_with_its_index(tmp_path):
    path = write(tmp_path, "[[router.endpoints]]\nid='a'\nurl='http://x'\nmodel=['m']\n")
    with pytest.raises(ConfigError, match=r"router\.endpoints\[0\]\.model"):
        config.load(path)


def test_a_mistyped_value_says_what_type_it_wants(tmp_path):
    path = write(tmp_path, "[router]\nretries = 'two'\n")
    with pytest.raises(ConfigError, match="'router.retries' must be int, not str"):
        config.load(path)


def test_an_integer_is_accepted_where_seconds_are_a_float(tmp_path):
    cfg = config.load(write(tmp_path, "[router]\ncooldown_s = 7\n"))
    assert cfg.router.cooldown_s == 7.0


def test_a_secret_is_read_from_a_file_relative_to_the_config(tmp_path):
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "e.key").write_text("s3cret\n")
    path = write(tmp_path, "[[router.endpoints]]\nid='a'\nurl='http://x'\nkey='@secrets/e.key'\n")
    cfg = config.load(path)
    assert cfg.router.endpoints[0].key == "s3cret"
    assert "s3cret" not in repr(cfg)  # a config printed or logged does not carry it


def test_a_missing_secret_file_is_an_error_naming_the_key(tmp_path):
    path = write(tmp_path, "[[router.endpoints]]\nid='a'\nurl='http://x'\nkey='@nope.key'\n")
    with pytest.raises(ConfigError, match=r"router\.endpoints\[0\]\.key.*nope\.key"):
        config.load(path)


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMGW_STORE")
    cfg = config.load(write(tmp_path, "[paths]\nstate_dir = 'state'\n"))
    assert cfg.paths.state_dir == str(tmp_path / "state")
    assert cfg.store_url().startswith(f"sqlite://{tmp_path}/state/")


def test_llmgw_store_overrides_the_configured_store(tmp_path, monkeypatch):
    cfg = config.load(write(tmp_path, "[store]\nurl = 'sqlite:///a.db'\n"))
    monkeypatch.setenv("LLMGW_STORE", "postgresql://db/llmgw")
    assert cfg.store_url() == "postgresql://db/llmgw"


def test_the_example_config_loads_and_shows_every_key_with_its_default(tmp_path):
    text = config.example()
    cfg = config.load(write(tmp_path, text))
    defaults = config.Config()
    sections = ("log", "store", "router", "scheduler", "agent", "certmon", "backup", "usage")
    sections += ("oidc", "tracing")
    for section in sections:
        got, want = getattr(cfg, section), getattr(defaults, section)
        for f in dataclasses.fields(want):
            if f.name in ("endpoints", "engines"):
                continue
            assert f"\n{f.name} = " in text, f"{section}.{f.name} is missing from the example"
            assert getattr(got, f.name) == getattr(want, f.name), f"{section}.{f.name}"
    for cls in (
        config.EndpointConfig,
        config.EngineConfig,
        config.ModelConfig,
        config.ProfileConfig,
        config.ScalingConfig,
        config.PricingConfig,
    ):
        for f in dataclasses.fields(cls):
            if f.name not in ("profile", "profiles", "scaling", "pricing"):
                assert f"# {f.name} = " in text, f"{cls.__name__}.{f.name} is not shown"
    assert "# [[models.profiles]]\n" in text


def test_a_model_table_loads_with_its_profile_and_scaling(tmp_path):
    cfg = config.load(
        write(
            tmp_path,
            (
                "[[models]]\nname = 'm'\nsource = '/m.gguf'\n[models.profile]\ncontext = 2048\n"
                "[models.scaling]\nmin = 0\nmax = 3\n"
            ),
        )
    )
    (m,) = cfg.models
    assert (m.source, m.profile.context, m.scaling.max) == ("/m.gguf", 2048, 3)


def test_the_file_cannot_set_where_the_config_came_from(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'source'"):
        config.load(write(tmp_path, "source = 'elsewhere'\n"))
