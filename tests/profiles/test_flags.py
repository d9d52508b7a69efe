"""Flag validation: every kind of bad flag is refused with a message that says what is allowed."""

from __future__ import annotations

import pytest

from moelab.engine.config.args import build_parser, describe_flags
from moelab.profiles.flags import (
    FlagChange,
    FlagError,
    apply_changes,
    canonical,
    catalog,
    check_value,
    find_problems,
    last_wins,
    validate_flags,
)


def only_problem(flags: list[str]) -> tuple[str, str]:
    problems = find_problems(flags)
    assert len(problems) == 1, problems
    return problems[0].kind, str(problems[0].message)


def test_a_typo_names_the_nearest_flag_and_lists_them_all() -> None:
    kind, message = only_problem(["--moe-cahce-rate", "0.5"])
    assert kind == "unknown"
    assert "unknown flag --moe-cahce-rate; did you mean --moe-cache-rate?" in message
    for flag in ("--kv-reserve-tokens", "--no-cuda-graph", "--log-level"):
        assert flag in message
    assert "--model-path" not in message.split("flags:")[1]  # a profile's own field
    # single dash, and no guess for something unlike any flag
    assert "did you mean --port?" in only_problem(["-port", "8000"])[1]
    assert "did you mean" not in only_problem(["--zzzzzzzz"])[1]


def test_an_abbreviation_is_not_a_flag() -> None:
    # the engine's parser has allow_abbrev off: --moe-cache would be refused at start
    kind, message = only_problem(["--moe-cache", "0.5"])
    assert kind == "unknown" and "did you mean --moe-cache-" in message


def test_wrong_types_say_what_the_flag_takes() -> None:
    assert only_problem(["--port", "abc"]) == (
        "value",
        "--port abc: 'abc' is not a whole number (allowed: a whole number, 1 or more)",
    )
    assert only_problem(["--moe-cache-size", "-3"])[1] == (
        "--moe-cache-size -3: -3 must be 0 or more (allowed: a whole number, 0 or more)"
    )
    assert only_problem(["--moe-cache-rate", "1.5"])[1] == (
        "--moe-cache-rate 1.5: 1.5 must be a share of all experts, in (0, 1] "
        "(allowed: a number in (0, 1])"
    )
    kind, message = only_problem(["--device-memory", "lots"])
    assert kind == "value" and "e.g. 24GiB, 512MiB, 8G" in message
    kind, message = only_problem(["--moe-miss-policy", "split:2"])
    assert kind == "value" and "use auto, gpu, cpu or split:F with F in [0, 1]" in message
    assert only_problem(["--device", "gpu"])[1] == (
        "--device gpu: not a device; use auto, cpu, cuda or cuda:N"
    )


def test_a_value_outside_the_choices_lists_them() -> None:
    assert only_problem(["--dtype", "bf16"]) == (
        "choice",
        "--dtype bf16 is not allowed; choose one of auto, bfloat16, float16, float32 "
        "(did you mean bfloat16?)",
    )
    assert "choose one of debug, info, warning, error" in only_problem(["--log-level", "loud"])[1]


def test_on_off_flags_take_no_value() -> None:
    for flags in (["--no-cuda-graph", "true"], ["--no-cuda-graph=1"]):
        kind, message = only_problem(flags)
        assert kind == "switch_value"
        assert message.startswith("--no-cuda-graph is an on/off flag and takes no value")
        assert "give it alone to switch it on, leave it out for off" in message


def test_missing_and_stray_values() -> None:
    assert only_problem(["--port"]) == (
        "missing_value",
        "--port needs a value: a whole number, 1 or more",
    )
    assert only_problem(["--port", "--no-stats"])[0] == "missing_value"
    assert only_problem(["--port="])[0] == "missing_value"
    kind, message = only_problem(["0.5"])
    assert kind == "stray" and "every value follows its flag" in message
    # a negative number is a value, not a flag
    assert find_problems(["--seed", "-1"]) == []


def test_twice_exclusive_model_path_and_shape() -> None:
    assert only_problem(["--port", "1", "--port=2"]) == (
        "duplicate",
        "--port is given twice (1 and 2); keep one",
    )
    kind, message = only_problem(["--moe-cache-size", "3", "--moe-cache-rate", "0.5"])
    assert kind == "exclusive" and "--moe-cache-rate and --moe-cache-size" in message
    assert only_problem(["--model-path", "/m"])[1] == (
        "give the checkpoint in the model field, not as --model-path"
    )
    assert only_problem(["--help"])[1] == "--help is not an engine setting"
    assert only_problem("--port 1")[0] == "not_strings"  # type: ignore[arg-type]
    assert only_problem(["--port", 1])[0] == "not_strings"  # type: ignore[list-item]


def test_several_problems_are_reported_together() -> None:
    with pytest.raises(FlagError) as err:
        validate_flags(["--dtype", "bf16", "--port", "x", "--moe-cahce-rate", "0.5"])
    assert str(err.value).startswith("3 problems: --dtype bf16 is not allowed")
    assert [p.flag for p in err.value.problems] == ["--dtype", "--port", "--moe-cahce-rate"]


def test_valid_flags_parse_as_the_engine_would() -> None:
    ns = validate_flags(
        ["--kv-reserve-tokens=65536", "--device-memory", "22GiB", "--no-cuda-graph", "--seed", "-1"]
    )
    assert ns.kv_reserve_tokens == 65536 and ns.device_memory == (22 * 1024**3,)
    assert ns.no_cuda_graph is True and ns.seed == -1 and ns.max_running_requests == 8
    assert canonical(["--kv-reserve-tokens=65536", "--no-cuda-graph"]) == [
        "--kv-reserve-tokens",
        "65536",
        "--no-cuda-graph",
    ]


def test_the_catalog_follows_the_parser() -> None:
    flags = [d["flag"] for d in describe_flags() if d["flag"] != "--model-path"]
    assert list(catalog()) == flags
    # every flag's expectation in words is one a value of its default type passes
    for info in catalog().values():
        if info.default not in (None, False) and not info.switch:
            assert check_value(info.flag, str(info.default)) is None, info.flag


def test_changes_set_switch_and_drop_flags() -> None:
    flags = ["--moe-cache-size", "300", "--port", "9000", "--no-stats"]
    out = apply_changes(
        flags,
        [
            FlagChange("--moe-cache-rate", "0.4"),  # replaces its exclusive partner
            FlagChange("--port", "9001"),  # in place
            FlagChange("--no-stats", False),
            FlagChange("--no-cuda-graph", True),
            FlagChange("--seed", None),  # absent already: nothing to drop
        ],
    )
    assert out == ["--port", "9001", "--moe-cache-rate", "0.4", "--no-cuda-graph"]
    with pytest.raises(FlagError, match="--port needs a value"):
        apply_changes(flags, [FlagChange("--port", True)])
    with pytest.raises(FlagError, match="takes no value"):
        apply_changes(flags, [FlagChange("--no-stats", "yes")])
    with pytest.raises(FlagError, match="did you mean --moe-cache-rate"):
        apply_changes(flags, [FlagChange("--moe-cache-rat", "0.4")])


def test_last_wins_collapses_repeats_like_the_engine() -> None:
    flags, notes = last_wins(["--port", "1", "--no-stats", "--port", "2", "--no-stats"])
    assert flags == ["--port", "2", "--no-stats"]
    assert notes == [
        "--port was given 2 times (1, 2); kept the last, 2",
        "--no-stats was given 2 times (on, on); kept the last, on",
    ]
    # the engine's own parser keeps the last value too
    engine = build_parser().parse_args(["--model-path", "m", "--port", "1", "--port", "2"])
    assert engine.port == 2


def test_a_profile_with_a_split_is_held_to_the_engines_device_rules() -> None:
    """A profile carries the devices and the split; one the engine would refuse at start is
    refused as it is saved, in the engine's words."""
    assert validate_flags(["--devices", "cuda:0,cuda:1", "--layer-split", "20,28"]).devices == (
        "cuda:0",
        "cuda:1",
    )
    with pytest.raises(FlagError) as err:
        validate_flags(["--layer-split", "20,28"])
    assert str(err.value).startswith("--layer-split 20,28 splits the layers across --devices")
    with pytest.raises(FlagError) as err:
        validate_flags(["--devices", "cuda:0,cuda:1", "--layer-split", "0.2,0.3,0.5"])
    assert "has 3 parts for 2 devices" in str(err.value)
    assert only_problem(["--devices", "cuda:0"])[1] == (
        "--devices cuda:0: a split needs two devices or more, e.g. cuda:0,cuda:1; for one, use "
        "--device"
    )
    assert "(0.6,0.4)" in str(catalog()["--layer-split"].expects)
    # micro-batches pipeline a split's decode step: refused without one
    flags = ["--devices", "cuda:0,cuda:1", "--split-microbatches", "2"]
    assert validate_flags(flags).split_microbatches == 2
    with pytest.raises(FlagError) as err:
        validate_flags(["--split-microbatches", "2"])
    assert str(err.value).startswith("--split-microbatches 2 pipelines a decode step across")
    assert only_problem(["--devices", "cuda:0,cuda:1", "--split-microbatches", "0"])[1] == (
        "--split-microbatches 0: 0 must be at least 1 (allowed: a whole number, 1 or more)"
    )
