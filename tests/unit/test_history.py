"""Each model's history: a mark only when something changed, said as events, drawn as
spans of state, and bounded."""

from llmgw_scheduler.history import History, Look, changes

T0 = 1_800_000_000.0


def test_a_pass_that_changes_nothing_leaves_no_mark():
    h = History()
    for i in range(100):
        h.observe("m", Look("serving", 1, 1), T0 + i)
    assert len(h.marks["m"]) == 1
    assert h.events("m", 0) == [(T0, "first seen serving")]


def test_changes_are_said_as_events_with_the_reason_for_a_bad_state():
    before = Look("serving", 1, 1)
    assert changes(before, Look("serving", 2, 1)) == ("scaled 1 → 2",)
    assert changes(before, Look("parked", 1, 0, 5, 0, "engine said\nweights: no such file")) == (
        "serving → parked: weights: no such file", "start failed (5 in a row)", "ready 1 → 0",
    )  # fmt: skip
    assert changes(before, Look("serving", 1, 1, restarting=2)) == (
        "restart of 2 replica(s) queued",
    )
    assert changes(Look("serving", 1, 1, restarting=1), before) == ("restart finished",)
    assert changes(before, Look("serving", 1, 1, reason="new words")) == ()


def test_spans_cover_the_window_from_the_state_in_force_at_its_start():
    h = History()
    h.observe("m", Look("starting", 1, 0), T0 - 100)
    h.observe("m", Look("serving", 1, 1), T0 + 600)
    h.observe("m", Look("parked", 1, 0, 5), T0 + 1200)
    assert h.spans("m", T0, T0 + 3600) == [
        (T0, T0 + 600, "starting"), (T0 + 600, T0 + 1200, "serving"),
        (T0 + 1200, T0 + 3600, "parked"),
    ]  # fmt: skip
    assert h.steps("m", "ready", T0, T0 + 3600)[:4] == [
        (T0, 0.0), (T0 + 600, 0.0), (T0 + 600, 1.0), (T0 + 1200, 1.0)
    ]  # fmt: skip
    assert h.counts("m", T0) == {"scalings": 0, "failed starts": 1, "restarts": 0, "parks": 1}


def test_history_is_bounded_per_model_and_in_time_and_forgets_removed_models():
    h = History(keep_s=3600, per_model=10)
    for i in range(50):
        h.observe("m", Look("serving", 1 + i % 2, 1), T0 + i)
    assert len(h.marks["m"]) == 10
    h.observe("m", Look("serving", 7, 1), T0 + 7200)
    assert [m.look.desired for m in h.marks["m"]] == [2, 7], "the mark in force an hour ago stays"
    h.observe("gone", Look("serving", 1, 1), T0)
    h.forget_others({"m"})
    assert set(h.marks) == {"m"}
