"""make bench's verdicts on its bars (bench/run.py's bar_check): issue #35's against the
baseline revision and vllm-router, issue #5's for limits."""

import importlib
import sys
from pathlib import Path

# bench/run.py imports its neighbours (loadgen, targets) as top-level modules: bench/ is
# on the path only while it loads, so no other test finds them.
_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, _BENCH)
try:
    run = importlib.import_module("run")
finally:
    sys.path.remove(_BENCH)


def measured(name: str, req: float, stream: float = 300.0, p50: float = 0.4,
             p99_c16: float = 10.0):  # fmt: skip
    return run.Measured(name, name, cpu_req_us=req, cpu_stream_us=stream, p50_ms=p50,
                        p99_c16_ms=p99_c16)  # fmt: skip


RESULTS = [measured("direct", None, None, 0.05), measured("llmgw", 90.0),
           measured("llmgw+limits", 99.0)]  # fmt: skip


def line(lines: list[str], words: str) -> str:
    found = [x for x in lines if words in x]
    assert len(found) == 1, lines
    return found[0]


def test_the_limits_bar_is_judged_on_the_median_of_the_side_by_side_pairs():
    over = run.bar_check(RESULTS, paired={"llmgw+limits": [1.10, 1.30, 1.25, 1.50, 1.05]})
    assert line(over, "side by side").endswith("+25%, the median of 5 pairs of windows "
                                               "(+5% to +50%) (bar ≤+20%): MISSES")  # fmt: skip
    under = run.bar_check(RESULTS, paired={"llmgw+limits": [1.35, 1.10, 1.15]})
    assert line(under, "side by side").endswith("(bar ≤+20%): meets")
    assert "+15%, the median of 3" in line(under, "side by side")


def test_the_one_after_the_other_figure_is_reported_without_a_verdict():
    lines = run.bar_check(RESULTS)
    sequential = line(lines, "one after the other")
    assert "99 µs against 90 µs without, +10%" in sequential
    assert "meets" not in sequential and "MISSES" not in sequential
    assert not [x for x in lines if "side by side" in x]


def test_every_level_limits_are_judged_by_their_own_pairs():
    lines = run.bar_check(RESULTS, paired={"llmgw+limits": [1.1], "llmgw+limits*5": [1.4]})
    assert line(lines, "limits on every level").endswith("(bar ≤+20%): MISSES")
    assert line(lines, "limits, budgets and a band, side by side").endswith("meets")


def test_cpu_per_stream_and_p99_at_16_are_judged_against_vllm_router_in_the_same_run():
    ours = measured("llmgw", 120.0, stream=200.0, p99_c16=7.6)
    lines = run.bar_check([RESULTS[0], ours, measured("vllm-router", 65.0, 215.0, p99_c16=5.9)])
    assert line(lines, "stream against vllm-router's").endswith(
        "200 µs against 215 µs, 0.93× (bar ≤1.00×): meets"
    )
    assert line(lines, "p99 at concurrency 16").endswith("7.60 ms against 5.90 ms, 1.29× "
                                                         "(bar ≤1.30×): meets")  # fmt: skip
    slower = measured("llmgw", 120.0, stream=220.0, p99_c16=7.8)
    lines = run.bar_check([RESULTS[0], slower, measured("vllm-router", 65.0, 215.0, p99_c16=5.9)])
    assert line(lines, "stream against vllm-router's").endswith("MISSES")
    assert line(lines, "p99 at concurrency 16").endswith("MISSES")
    assert "CPU per request against vllm-router's: 1.85×" in line(lines, "request against vllm")


def test_without_vllm_router_in_the_run_its_bars_are_not_judged():
    lines = run.bar_check(RESULTS)
    for words in ("stream against vllm-router's", "p99 at concurrency 16"):
        assert line(lines, words).endswith("n/a (not measured in this run)")


def test_cpu_per_request_is_judged_side_by_side_against_the_baseline_revision():
    lines = run.bar_check(RESULTS, baseline=("0ce0c46", [1.02, 1.10, 0.98, 1.04, 1.20]))
    assert line(lines, "against 0ce0c46").endswith(
        "1.04×, the median of 5 pairs of windows (0.98× to 1.20×) (bar ≤1.05×): meets"
    )
    lines = run.bar_check(RESULTS, baseline=("0ce0c46", [1.06, 1.10, 0.98]))
    assert line(lines, "against 0ce0c46").endswith("(bar ≤1.05×): MISSES")
    assert line(run.bar_check(RESULTS), "baseline revision").endswith(
        "n/a (run with --baseline REV)"
    )
