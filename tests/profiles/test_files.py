"""Command-line and TOML round trips: paste one in, copy one out, export, import."""

from __future__ import annotations

import shlex

import pytest
import tomllib

from moelab.profiles.cmdline import from_command_line, to_command_line
from moelab.profiles.flags import FlagError
from moelab.profiles.toml_file import ProfileFile, dumps, loads

FLAGS = [
    "--kv-reserve-tokens", "65536",
    "--moe-cache-rate", "0.35",
    "--no-cuda-graph",
    "--device-memory", "22GiB",
    "--moe-miss-policy", "split:0.25",
    "--seed", "-3",
    "--served-model-name", "qwen 30b 'a3b'",
    "--no-prefill-overlap",
    "--kv-block-size", "016",
]  # fmt: skip
MODEL = "/home/me/my models/Qwen3-30B-A3B"


@pytest.mark.parametrize("multiline", [False, True])
def test_command_line_round_trip(multiline: bool) -> None:
    line = to_command_line(MODEL, FLAGS, multiline=multiline)
    assert line.startswith("moelab serve --model-path" if not multiline else "moelab serve \\\n")
    pasted = from_command_line(line)
    assert (pasted.model, pasted.flags, pasted.notes) == (MODEL, FLAGS, [])
    # what a shell would run is exactly the flags, quoting included
    words = shlex.split(line.replace("\\\n", " "))
    assert words == ["moelab", "serve", "--model-path", MODEL, *FLAGS]


def test_pasting_keeps_the_last_of_a_flag_given_twice_and_says_so() -> None:
    pasted = from_command_line(
        "CUDA_VISIBLE_DEVICES=1 python -m moelab.engine.cli serve --model-path=/m \\\n"
        "  --port 8000 --no-stats --port=8001 --no-stats   # the second port wins"
    )
    assert pasted.model == "/m"
    assert pasted.flags == ["--port", "8001", "--no-stats"]
    assert pasted.notes == [
        "environment variables are not part of a profile and were left out: CUDA_VISIBLE_DEVICES=1",
        "--port was given 2 times (8000, 8001); kept the last, 8001",
        "--no-stats was given 2 times (on, on); kept the last, on",
    ]
    # copied out again, it is one flag each
    assert (
        to_command_line("/m", pasted.flags) == "moelab serve --model-path /m --port 8001 --no-stats"
    )


def test_pasting_flags_alone_and_refusals() -> None:
    pasted = from_command_line("--moe-cache-rate 0.5 --no-cuda-graph")
    assert pasted.model is None and pasted.flags == ["--moe-cache-rate", "0.5", "--no-cuda-graph"]
    for text, words in (
        ("ls -la", "not a `moelab serve` command line: 'ls -la'"),
        ("   ", "the command line is empty"),
        ("moelab serve --port 'x", "cannot be read: No closing quotation"),
        ("moelab serve --port x", "--port x: 'x' is not a whole number"),
        ("moelab serve --port 1 --no-stats true", "--no-stats is an on/off flag"),
        ("moelab serve --moe-cahce-rate 0.5", "did you mean --moe-cache-rate?"),
    ):
        with pytest.raises(FlagError, match=None) as err:
            from_command_line(text)
        assert words in str(err.value), (text, str(err.value))


def test_toml_round_trip_keeps_every_flag_exactly() -> None:
    profile = ProfileFile(
        name='long "chats"',
        model=MODEL,
        flags=FLAGS,
        origin="benchmark run 7",
        notes="line one\nline two\twith a tab and a \x7f",
    )
    text = dumps(profile)
    assert loads(text) == profile
    data = tomllib.loads(text)
    # numbers stay numbers, sizes and policies text, on/off flags true
    assert data["flags"]["kv-reserve-tokens"] == 65536
    assert data["flags"]["moe-cache-rate"] == 0.35
    assert data["flags"]["seed"] == -3
    assert data["flags"]["device-memory"] == "22GiB"
    assert data["flags"]["no-cuda-graph"] is True
    assert data["flags"]["kv-block-size"] == "016"  # as a number it would lose its zero
    assert list(data["flags"]) == [f[2:] for f in FLAGS if f.startswith("--")]  # order kept


def test_toml_written_by_hand() -> None:
    parsed = loads(
        """
        name = "by hand"
        model = "/m"
        [flags]
        "--port" = 8001
        no-cuda-graph = true
        no-stats = false
        moe-cache-rate = 0.5
        device-memory = "8GiB"
        """
    )
    assert parsed.flags == [
        "--port", "8001", "--no-cuda-graph", "--moe-cache-rate", "0.5", "--device-memory", "8GiB",
    ]  # fmt: skip
    assert parsed.origin is None and parsed.notes is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[flags]\nport = 1\nport = 2", "not valid TOML"),  # a flag given twice
        ('[flags]\nno-stats = "yes"', "no-stats is on/off: write no-stats = true"),
        ("[flags]\nport = true", "--port is not on/off; it takes a whole number, 1 or more"),
        ("[flags]\nmoe-cahce-rate = 0.5", "did you mean --moe-cache-rate?"),
        ('[flags]\ndtype = "bf16"', "choose one of auto, bfloat16, float16, float32"),
        ("[flags]\nport = [1]", "a flag's value is a string, a number or true/false"),
        ("flags = 3", "flags must be a table"),
        ("name = 1", "name must be a string"),
        ("gpu = 1", "unknown key(s) gpu; a profile file has name, model, origin, notes"),
    ],
)
def test_toml_refusals(text: str, words: str) -> None:
    with pytest.raises(FlagError) as err:
        loads(text)
    assert words in str(err.value)
