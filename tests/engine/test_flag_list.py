"""A flag list as profiles, the benchmark and the launcher keep one: read as the engine's parser
reads it, edited, and written back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from moelab.engine.config.args import describe_flags
from moelab.engine.config.flag_list import FlagList, FlagSetting, read_items
from moelab.engine.process.launch import flag_value

FLAGS = {f["flag"]: f for f in describe_flags()}
# a value as a command line gives one: a word, a size, a share, a negative number
VALUES = st.one_of(
    st.integers(-9, 99999).map(str),
    st.sampled_from(["0.5", "24GiB", "auto", "split:0.25", "http://localhost:3000", "a=b"]),
)


@st.composite
def a_setting(draw) -> FlagSetting:
    flag = draw(st.sampled_from(sorted(FLAGS)))
    return FlagSetting(flag, None if FLAGS[flag]["kind"] == "switch" else draw(VALUES))


SETTINGS = st.lists(a_setting(), max_size=8).map(tuple)


@given(SETTINGS)
def test_a_rendered_list_reads_back_as_it_was(given_settings):
    flags = FlagList(given_settings)
    assert FlagList.parse(flags.render()) == flags


@given(SETTINGS)
def test_a_value_after_its_flag_or_after_equals_reads_the_same(given_settings):
    spaced = [item for s in given_settings for item in s.argv]
    joined = [s.flag if s.value is None else f"{s.flag}={s.value}" for s in given_settings]
    assert FlagList.parse(joined) == FlagList.parse(spaced) == FlagList(given_settings)


@given(SETTINGS)
def test_the_last_value_wins_as_in_the_engines_parser(given_settings):
    flags = FlagList(given_settings)
    for flag, _value in given_settings:
        last = [v for f, v in given_settings if f == flag][-1]
        assert flags.get(flag) == last == flags.as_dict()[flag]
    unique = flags.unique()
    assert [s.flag for s in unique] == list(dict.fromkeys(s.flag for s in given_settings))
    assert unique.as_dict() == flags.as_dict()


@given(SETTINGS, a_setting())
def test_setting_a_flag_puts_it_in_place_once_and_drops_the_flags_it_excludes(
    given_settings, change
):
    excluded = FLAGS[change.flag]["exclusive_with"]
    kept = [s for s in given_settings if s.flag not in excluded]
    flags = [s.flag for s in kept]
    if change.flag in flags:  # where it was first given, later copies gone
        first = flags.index(change.flag)
        rest = [s for s in kept[first + 1 :] if s.flag != change.flag]
        expected = [*kept[:first], change, *rest]
    else:
        expected = [*kept, change]
    assert list(FlagList(given_settings).set(change.flag, change.value)) == expected


def test_on_off_flags_take_no_value_and_values_follow_their_flags():
    items = ["--no-cuda-graph", "--seed", "-1", "--port=8001", "--no-stats", "stray", "--host"]
    assert list(read_items(items)) == [
        FlagSetting("--no-cuda-graph", None),
        FlagSetting("--seed", "-1"),
        FlagSetting("--port", "8001"),
        FlagSetting("--no-stats", None),
        "stray",
        FlagSetting("--host", None),
    ]
    flags = FlagList.parse(items)
    assert flags.render() == [
        "--no-cuda-graph", "--seed", "-1", "--port", "8001", "--no-stats", "--host",
    ]  # fmt: skip
    assert flags.has("--no-stats") and not flags.has("--no-prefix-cache")


def test_what_is_in_force_falls_back_on_the_parsers_defaults():
    flags = FlagList.parse(["--kv-reserve-tokens", "4096", "--no-cuda-graph"])
    assert flags.in_force("--kv-reserve-tokens") == "4096"
    assert flags.in_force("--prefill-chunk-tokens") == "2048"
    assert flags.in_force("--max-context") is None
    assert flags.in_force("--no-cuda-graph") is True and flags.in_force("--no-stats") is False


def test_dropping_and_the_launchers_reading():
    flags = FlagList.parse(["--port", "1", "--host", "::1", "--port=2"])
    assert flags.drop("--port").render() == ["--host", "::1"]
    assert flag_value(flags.render(), "--port") == "2"
    assert flag_value(["--port=3"], "--port", "8000") == "3"
    assert flag_value([], "--port", "8000") == "8000"
