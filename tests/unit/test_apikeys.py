import pytest

from llmgw import apikeys


def test_a_secret_is_long_random_and_recognisable():
    a, b = apikeys.new_secret(), apikeys.new_secret()
    assert a != b
    assert a.startswith("sk-llmgw-") and len(a) >= 50


def test_the_hash_is_stable_and_not_the_secret():
    s = apikeys.new_secret()
    assert apikeys.hash_secret(s) == apikeys.hash_secret(s)
    assert s not in apikeys.hash_secret(s)


@pytest.mark.parametrize(
    "text,seconds", [("90m", 5400), ("12h", 43200), ("30d", 2592000), ("2w", 1209600), ("45s", 45)]
)
def test_durations_read_as_people_write_them(text, seconds):
    assert apikeys.parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["30", "d", "-1d", "0d", "1y", "1.5d"])
def test_a_bad_duration_is_refused_with_examples(bad):
    with pytest.raises(ValueError, match="like 90m, 12h or 30d"):
        apikeys.parse_duration(bad)
