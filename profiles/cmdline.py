"""A profile as a `moelab serve ...` command line: paste one in, copy one out."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ..engine.text import Text
from .flags import FlagError, FlagProblem, find_problems, last_wins, validate_flags

PROGRAM = "moelab serve"
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass(frozen=True, slots=True)
class PastedCommand:
    """What a pasted command line holds: the model (when it names one), the flags, and notes on
    what was changed on the way in (flags given twice, environment variables left out)."""

    model: str | None
    flags: list[str]
    notes: list[str]


def to_command_line(model: str, flags: list[str], *, multiline: bool = False) -> str:
    """The shell command that serves `model` with `flags` (quoted for a POSIX shell).

    `multiline` puts each flag on its own line with a trailing backslash, for reading.
    """
    parts = [["--model-path", model]]
    for item in flags:
        if item.startswith("-") and not re.fullmatch(r"-[0-9.]+", item):
            parts.append([item])
        else:
            parts[-1].append(item)
    pieces = [" ".join(shlex.quote(x) for x in part) for part in parts]
    if multiline:
        return PROGRAM + " \\\n  " + " \\\n  ".join(pieces)
    return " ".join([PROGRAM, *pieces])


def _not_a_command(text: str) -> FlagError:
    example = "moelab serve --model-path ~/models/Qwen3-30B-A3B --kv-reserve-tokens 32768"
    message = (
        Text(
            "not a `moelab serve` command line: {line!r}; paste something like `{example}`",
            line=text.strip().splitlines()[0][:80],
            example=example,
        )
        if text.strip()
        else Text("the command line is empty; paste something like `{example}`", example=example)
    )
    return FlagError([FlagProblem(None, "command", message)])


def from_command_line(text: str) -> PastedCommand:
    """Read a pasted `moelab serve ...` line (or just its flags); FlagError when it is not one
    or its flags would be refused.

    Accepted: `moelab serve ...`, `python -m moelab.engine.cli serve ...`, a path to the moelab
    script, leading environment assignments (`CUDA_VISIBLE_DEVICES=1 moelab serve ...`, noted
    and left out), backslash line continuations and `#` comments. A flag given more than once
    keeps its last value, as the engine's parser does, and the notes say so.
    """
    joined = re.sub(r"\\\r?\n", " ", text)
    try:
        tokens = shlex.split(joined, comments=True)
    except ValueError as err:
        raise FlagError(
            [
                FlagProblem(
                    None,
                    "command",
                    Text("the command line cannot be read: {error}", error=str(err)),
                )
            ]
        ) from None
    notes = []
    env = []
    while tokens and _ENV_ASSIGNMENT.fullmatch(tokens[0]):
        env.append(tokens.pop(0))
    if env:
        notes.append(
            f"environment variables are not part of a profile and were left out: {' '.join(env)}"
        )
    if tokens and tokens[0].startswith("-"):
        flags = tokens
    elif "serve" in tokens and any("moelab" in t for t in tokens[: tokens.index("serve")]):
        flags = tokens[tokens.index("serve") + 1 :]
    else:
        raise _not_a_command(text)
    model = None
    rest = []
    i = 0
    while i < len(flags):
        item = flags[i]
        if item == "--model-path" and i + 1 < len(flags):
            model, i = flags[i + 1], i + 2
            continue
        if item.startswith("--model-path="):
            model = item.split("=", 1)[1]
        else:
            rest.append(item)
        i += 1
    problems = [p for p in find_problems(rest) if p.kind != "duplicate"]
    if problems:
        raise FlagError(problems)
    collapsed, duplicate_notes = last_wins(rest)
    validate_flags(collapsed)
    return PastedCommand(model=model, flags=collapsed, notes=notes + duplicate_notes)
