"""The autoscaler's decision (lib/llmgw/scaling.py), on a fake clock."""

from llmgw.scaling import DOWN, UP, Load, Settings, State, decide, initial

S = Settings(min=1, max=3, target_queue_wait_s=5.0, up_after_s=30.0, down_below=0.3,
             down_after_s=300.0, cooldown_s=120.0)  # fmt: skip
SATURATED = Load(replicas=2, busy=2, inflight=8, slots=8)
QUEUED = Load(replicas=2, busy=1, inflight=6, slots=8, queue_wait_p90_s=7.0)
MIDDLING = Load(replicas=2, busy=1, inflight=4, slots=8)
QUIET = Load(replicas=2, busy=0, inflight=1, slots=8)


def run(load, state, start, seconds, step=5.0, s=S):
    """Decide every `step` seconds from `start` for `seconds`; the states seen."""
    seen, t = [], start
    while t <= start + seconds:
        state = decide(s, load(t) if callable(load) else load, state, t)
        seen.append(state)
        t += step
    return seen


def test_a_model_saturated_for_up_after_s_gets_one_more_replica():
    seen = run(SATURATED, State(desired=2), 1000.0, 30.0)
    assert seen[-1].desired == 3 and seen[-1].direction == UP
    assert "2 of 2 replicas saturated 30 s" in seen[-1].reason


def test_a_model_saturated_for_less_than_up_after_s_keeps_its_count():
    seen = run(SATURATED, State(desired=2), 1000.0, 25.0)
    assert {s.desired for s in seen} == {2}


def test_a_queue_wait_over_target_counts_as_saturated():
    seen = run(QUEUED, State(desired=2), 1000.0, 30.0)
    assert seen[-1].desired == 3
    assert "queue wait p90 7.0 s over 5 s target" in seen[-1].reason


def test_a_quiet_model_gives_one_replica_back_after_down_after_s_not_before():
    seen = run(QUIET, State(desired=2), 1000.0, 300.0)
    assert [s.desired for s in seen[:-1]] == [2] * (len(seen) - 1)
    assert seen[-1].desired == 1 and seen[-1].direction == DOWN
    assert "utilisation 12% below 30%" in seen[-1].reason


def test_nothing_changes_during_the_cooldown_after_a_change():
    up = run(SATURATED, State(desired=1), 1000.0, 30.0)[-1]
    assert up.desired == 2
    during = run(SATURATED, up, 1035.0, 80.0)  # until 1115: cooldown ends at 1150
    assert {s.desired for s in during} == {2}
    after = run(SATURATED, during[-1], 1120.0, 40.0)
    assert after[-1].desired == 3


def test_never_above_max_nor_below_min():
    top = run(SATURATED, State(desired=3), 1000.0, 600.0)
    assert {s.desired for s in top} == {3}
    bottom = run(QUIET, State(desired=1), 1000.0, 1200.0)
    assert {s.desired for s in bottom} == {1}


def test_new_bounds_are_followed_at_once():
    s = Settings(min=2, max=2)
    assert decide(s, QUIET, State(desired=1), 1000.0).desired == 2
    assert decide(Settings(min=1, max=1), SATURATED, State(desired=3), 1000.0).desired == 1


def test_load_flapping_around_the_saturation_threshold_changes_nothing():
    flapping = lambda t: SATURATED if int(t / 5) % 4 else MIDDLING  # noqa: E731
    seen = run(flapping, State(desired=2), 1000.0, 1800.0)
    assert {s.desired for s in seen} == {2}


def test_load_flapping_around_down_below_changes_nothing():
    flapping = lambda t: QUIET if int(t / 5) % 10 else MIDDLING  # noqa: E731
    seen = run(flapping, State(desired=2), 1000.0, 1800.0)
    assert {s.desired for s in seen} == {2}


def test_no_load_reported_holds_the_count_and_restarts_the_windows():
    half = run(SATURATED, State(desired=2), 1000.0, 20.0)[-1]
    silent = decide(S, None, half, 1025.0)
    assert silent.desired == 2 and silent.saturated_since is None
    again = run(SATURATED, silent, 1030.0, 25.0)
    assert {s.desired for s in again} == {2}


def test_an_on_demand_model_is_left_to_demand():
    s = Settings(min=0, max=3)
    assert {st.desired for st in run(SATURATED, State(desired=1), 1000.0, 600.0, s=s)} == {1}
    assert {st.desired for st in run(QUIET, State(desired=0), 1000.0, 600.0, s=s)} == {0}


def test_a_starting_scheduler_keeps_what_runs_within_bounds():
    assert initial(S, 2).desired == 2
    assert initial(S, 0).desired == 1
    assert initial(S, 7).desired == 3


def test_a_scale_down_that_would_saturate_the_rest_is_not_made():
    lax = Settings(min=1, max=3, down_below=0.7, down_after_s=300.0)
    two_thirds_used = Load(replicas=2, busy=0, inflight=5, slots=8)  # 5 of 4 with one
    assert {s.desired for s in run(two_thirds_used, State(desired=2), 1000.0, 900.0, s=lax)} == {2}
    half_used = Load(replicas=3, busy=0, inflight=6, slots=12)  # 6 of 8 with one fewer
    assert run(half_used, State(desired=3), 1000.0, 300.0, s=lax)[-1].desired == 2
