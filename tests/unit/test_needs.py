"""What the scheduler places a model by: the estimate from its weights, then measured use."""

import json

from llmgw import catalog, gguf
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.engines import vllm
from llmgw_scheduler.needs import Needs
from tests.unit.test_engines import SMOLLM2


def vllm_model(path, kv_cache_gib: int = 0) -> catalog.Model:
    profile = ProfileConfig(kv_cache_gib=kv_cache_gib)
    (m,) = catalog.load([ModelConfig("smollm2", source=str(path), engine="vllm", profile=profile)])
    return m


def test_a_vllm_models_need_is_estimated_from_its_config_then_corrected_by_use(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    needs = Needs(tmp_path / "weights")
    model = vllm_model(tmp_path, kv_cache_gib=2)
    assert needs.need(model).memory == vllm.estimate(SMOLLM2, 2)
    assert needs.need(model).gpus == 0 and needs.need(model).engine == "vllm-0.32.0"
    # Once a replica has run, what it used, plus 10%, as for a GGUF.
    needs._measured[(model.name, model.profile_hash())] = [2 * vllm.GiB]
    assert needs.need(model).memory == gguf.corrected(0, [2 * vllm.GiB]) > 2 * vllm.GiB


def test_a_directory_without_a_readable_config_waits_for_a_measurement(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert Needs(tmp_path / "weights").need(vllm_model(tmp_path)).memory == 0
