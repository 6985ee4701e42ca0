"""The status page's HTML, rendered from hand-made admin API shapes (no scheduler)."""

from llmgw_scheduler.page import render

GiB = 1 << 30
NOW = 1_800_000_000.0


def node(name="gpu-1", **kw) -> dict:
    return {
        "name": name, "state": "up", "cpus": 16, "memory_total": 64 * GiB,
        "memory_available": 48 * GiB, "gpus": [], "engines": {}, "replicas": 0,
        "last_seen": NOW - 2, **kw,
    }  # fmt: skip


def model(name="m", **kw) -> dict:
    return {
        "name": name, "aliases": [], "engine": "llama.cpp-1", "min": 1, "max": 2, "ready": 1,
        "replicas": 1, "state": "serving", "reason": "", "failures": 0, "retry_at": None,
        "memory": GiB, **kw,
    }  # fmt: skip


def replica(**kw) -> dict:
    return {
        "id": "r-1", "model": "m", "node": "gpu-1", "state": "ready", "endpoint": "",
        "since": NOW - 3 * 3600, "rss": 2 * GiB, "reason": "", **kw,
    }  # fmt: skip


def test_each_gpu_gets_a_bar_of_its_used_memory():
    gpus = [
        {"index": 0, "name": "H100", "memory_total": 80 * GiB, "memory_free": 20 * GiB},
        {"index": 1, "name": "H100", "memory_total": 80 * GiB, "memory_free": 80 * GiB},
    ]
    page = render([node(gpus=gpus)], [], [], NOW)
    assert "0 H100" in page and "1 H100" in page
    assert 'style="width:75.0%"' in page and "60 GiB / 80 GiB" in page
    assert 'style="width:0.0%"' in page and "0 MiB / 80 GiB" in page
    assert 'style="width:25.0%"' in page and "16 GiB / 64 GiB" in page, "node memory"


def test_a_gpu_without_memory_figures_and_a_node_never_seen_show_dashes_not_zero_bars():
    page = render(
        [
            node(gpus=[{"index": 0, "name": "T4"}]),
            node("new", state="never seen", memory_total=0, memory_available=0, last_seen=None),
        ],
        [],
        [],
        NOW,
    )
    assert page.count('class="bar"') == 1, "only gpu-1's memory has a bar"
    never = '<td>new</td><td><span class="state idle">never seen</span></td><td>-</td><td>-</td>'
    assert never in page, "no memory bar, no GPU bar"
    assert "<td>-</td></tr>" in page, "last seen"


def test_parked_and_unplaceable_models_come_first_with_what_to_do():
    page = render(
        [node()],
        [
            model("a-fine"),
            model("b-parked", state="parked", ready=0, failures=5, reason="load\nbad magic"),
            model("c-unfit", state="unplaceable", ready=0, reason="gpu-1: needs 90 GiB"),
        ],
        [replica()],
        NOW,
    )
    action = page.split("<h2>Needs action</h2>", 1)[1].split("<h2>", 1)[0]
    assert "llmgw retry b-parked" in action and "<pre>load\nbad magic</pre>" in action
    assert "llmgw explain-placement c-unfit" in action and "needs 90 GiB" in action
    models = page.split("<h2>Models</h2>", 1)[1]
    assert models.index("b-parked") < models.index("c-unfit") < models.index("a-fine")
    assert "<td>1 (1..2)</td>" in models and "<td>bad magic</td>" in models, (
        "the reason's last line"
    )
    assert "<td>3h</td>" in page, "the replica's age"


def test_nothing_from_operators_or_engines_reaches_the_page_as_html():
    bad = '<img src=x onerror="alert(1)">'
    gpu = {"index": 0, "name": bad, "memory_total": GiB, "memory_free": 0, "healthy": False,
           "health": bad, "model": bad, "replica": bad}  # fmt: skip
    page = render(
        [node(bad, gpus=[gpu])],
        [model(bad, aliases=[bad], engine=bad, state="parked", reason=bad)],
        [replica(id=bad, model=bad, node=bad, state=bad, reason=bad)],
        NOW,
    )
    assert "<img" not in page and 'onerror="' not in page
    shown = page.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;")
    # node and GPU name; the model in the action box (name, retry command, reason) and in
    # its table (name, alias, engine, reason); the replica's id, model, node, state, reason;
    # in the GPU map the node, the GPU's name, its health and the model and replica on it.
    assert shown == 19, shown


def test_the_gpu_map_shows_each_gpu_s_health_and_the_replica_assigned_it():
    gpus = [
        {"index": 1, "uuid": "GPU-a9e3b7c1-58d2", "name": "A100", "memory_total": 80 * GiB,
         "memory_free": 80 * GiB, "healthy": False, "health": "2 uncorrectable ECC errors",
         "replica": None, "model": None},
        {"index": 0, "uuid": "GPU-6d2f1a9e-c4b3", "name": "A100", "memory_total": 80 * GiB,
         "memory_free": 20 * GiB, "healthy": True, "health": "", "replica": "r-7f3a",
         "model": "llama-70b"},
    ]  # fmt: skip
    page = render([node(gpus=gpus), node("cpu-1")], [], [], NOW)
    gpu_map = page.split("<h2>GPUs</h2>", 1)[1].split("<h2>", 1)[0]
    rows = gpu_map.split("<tr>")[2:]  # after the head
    assert len(rows) == 2, "one row per GPU, none for a node without"
    assert "<td>gpu-1</td><td>0</td>" in rows[0] and "GPU-6d2f1a9e<" in rows[0]
    assert 'llama-70b <span class="muted">r-7f3a</span>' in rows[0]
    assert '<span class="state ok">ok</span>' in rows[0]
    assert '<span class="state bad">unhealthy</span> 2 uncorrectable ECC errors' in rows[1]
    assert '<span class="muted">none</span>' in rows[1]


def test_a_fleet_without_gpus_has_no_gpu_map():
    assert "<h2>GPUs</h2>" not in render([node()], [], [], NOW)


def test_each_replica_shows_the_profile_it_runs():
    page = render([node()], [model("m")], [replica(profile="1gpu"), replica(id="r-2")], NOW)
    replicas = page.split("<h2>Replicas</h2>", 1)[1]
    assert "<th>profile</th>" in replicas
    assert "<td>m</td><td>1gpu</td><td>gpu-1</td>" in replicas
    assert "<td>m</td><td>-</td><td>gpu-1</td>" in replicas, "a replica with none said"
