"""The engine's flags: torch-free, documented, validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.engine.config.args import (
    TUNABLE,
    build_parser,
    describe_flags,
    flags_markdown,
    parse_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def test_docs_flags_md_is_generated_from_the_parser():
    assert (ROOT / "docs" / "flags.md").read_text() == flags_markdown(), (
        "docs/flags.md is stale: run python -m moelab.engine.config.args > docs/flags.md"
    )


def test_every_flag_has_help_and_tunables_exist():
    flags = {f["flag"]: f for f in describe_flags()}
    assert all(f["help"] for f in flags.values())
    for tunable in TUNABLE:
        assert tunable.flag in flags and flags[tunable.flag]["tunable"]
    assert flags["--moe-cache-size"]["exclusive_with"] == ["--moe-cache-rate"]


def test_sizes_and_policies_parse():
    assert parse_bytes("24GiB") == 24 * 1024**3 and parse_bytes("1.5g") == int(1.5 * 1024**3)
    args = build_parser().parse_args(
        ["--model-path", "m", "--moe-miss-policy", "split:0.25", "--device-memory", "512MiB"]
    )
    assert args.moe_miss_policy == "split:0.25" and args.device_memory == (512 * 1024**2,)
    assert build_parser().parse_args(["--model-path", "m"]).moe_copy_ahead == 0.75
    assert (
        build_parser().parse_args(["--model-path", "m", "--moe-copy-ahead", "0"]).moe_copy_ahead
        == 0
    )
    for bad in (
        ["--moe-cache-rate", "1.5"],
        ["--moe-copy-ahead", "1.5"],
        ["--moe-copy-ahead", "some"],
        ["--moe-miss-policy", "split:2"],
        ["--device-memory", "lots"],
        ["--kv-reserve-tokens", "0"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model-path", "m", *bad])


def test_split_misses_is_the_default_and_the_old_flag_still_parses():
    parse = lambda *flags: build_parser().parse_args(["--model-path", "m", *flags])  # noqa: E731
    assert not parse().no_split_misses
    # launch profiles saved when the split was off by default name the old flag
    assert not parse("--split-misses").no_split_misses
    assert parse("--no-split-misses").no_split_misses
    with pytest.raises(SystemExit):
        parse("--split-misses", "--no-split-misses")
