"""make bench's verdicts on issue #12's bars (bench/run.py's bar_check)."""

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


def measured(name: str, req: float, stream: float = 300.0, p50: float = 0.4):
    return run.Measured(name, name, cpu_req_us=req, cpu_stream_us=stream, p50_ms=p50)


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
