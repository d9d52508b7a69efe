"""Engine flags checked against `moelab serve`'s own parser, with messages that say what is allowed.

A profile keeps its flags as a command-line list (`["--moe-cache-rate", "0.5", "--no-cuda-graph"]`)
without `--model-path`: the model is a field of its own. Stored lists are canonical: each flag once,
its value as the next item (never `--flag=value`), in the order given.
"""

from __future__ import annotations

import argparse
import difflib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..engine.config import args as engine_args
from ..engine.config.config import ConfigError, EngineConfig
from ..engine.config.flag_list import FlagList, FlagSetting, read_items
from ..engine.text import Text, error_text

# the values the engine's own argparse types take, in words
_SHAPES: dict[Callable[[str], Any], Text] = {
    engine_args.parse_device: Text("auto, cpu, cuda or cuda:N"),
    engine_args.parse_bytes: Text("a size such as 24GiB, 512M, 1.5g or 1073741824, in bytes"),
    engine_args.parse_device_memory: Text(
        "a size such as 24GiB, 512M or 1073741824, or one per device of --devices, "
        "comma-separated (12GiB,8GiB)"
    ),
    engine_args.parse_origins: Text(
        "origins as a browser sends them, comma-separated (http://localhost:3000), or * for any"
    ),
    engine_args.parse_host_names: Text(
        "host names or addresses, comma-separated (llm.lan,gpu-box.example)"
    ),
    engine_args.parse_miss_policy: Text(
        "auto, gpu, cpu or split:F with F the fixed share of misses to fetch, in [0, 1]"
    ),
    engine_args.parse_devices: Text("two devices or more, comma-separated (cuda:0,cuda:1)"),
    engine_args.LayerSplit.parse: Text(
        "each device's layers, comma-separated: counts (20,20) or shares that add up to 1 (0.6,0.4)"
    ),
}


class FlagError(ValueError):
    """Flags the engine would refuse; `problems` holds one message per problem found. Its
    message (a Text, engine/text.py) is the first problem's, or all of them."""

    def __init__(self, problems: list[FlagProblem]) -> None:
        assert problems
        self.problems = problems
        text = problems[0].message
        if len(problems) > 1:
            text = Text(
                "{n} problems: {problems}", n=len(problems), problems=[p.message for p in problems]
            )
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class FlagProblem:
    """One thing wrong with a flag list: which flag (None when not about one flag) and why."""

    flag: str | None
    kind: str  # unknown, value, choice, missing_value, switch_value, exclusive, duplicate, ...
    message: Text | str


@dataclass(frozen=True, slots=True)
class FlagInfo:
    """One engine flag as the editor and the validator need it."""

    flag: str
    dest: str
    group: str
    help: str
    kind: str  # switch, int, float, bytes, str
    choices: tuple[str, ...] | None
    default: Any
    tunable: bool
    exclusive_with: tuple[str, ...]
    expects: Text  # what a value must look like, in words
    convert: Callable[[str], Any] | None

    @property
    def switch(self) -> bool:
        return self.kind == "switch"


@dataclass(frozen=True, slots=True)
class FlagChange:
    """Set a flag (a string), switch an on/off flag (True/False), or drop a flag (None)."""

    flag: str
    value: str | bool | None


def _accepts(convert: Callable[[str], Any], text: str) -> bool:
    try:
        convert(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def _expects(kind: str, choices: tuple[str, ...] | None, convert: Callable | None) -> Text:
    """A value's shape in words, read off the parser (number types are probed, not named)."""
    if kind == "switch":
        return Text("nothing: give the flag alone to switch it on, leave it out for off")
    if choices:
        return Text("one of {choices}", choices=", ".join(choices))
    if convert in _SHAPES:
        return _SHAPES[convert]
    if kind == "int" and convert is not None:
        if _accepts(convert, "-1"):
            return Text("a whole number")
        if _accepts(convert, "0"):
            return Text("a whole number, 0 or more")
        return Text("a whole number, 1 or more")
    if kind == "float" and convert is not None:
        if _accepts(convert, "1") and not _accepts(convert, "0") and not _accepts(convert, "1.5"):
            return Text("a number in (0, 1]")
        return Text("a number")
    return Text("text")


@functools.cache
def catalog() -> dict[str, FlagInfo]:
    """Every engine flag but --model-path (a profile's own field), in the parser's order."""
    parser = engine_args.build_parser()
    types = {a.option_strings[-1]: a.type for a in parser._actions if a.option_strings}
    out = {}
    for d in engine_args.describe_flags(parser):
        if d["flag"] == "--model-path":
            continue
        choices = tuple(d["choices"]) if d["choices"] else None
        convert = types.get(d["flag"])
        out[d["flag"]] = FlagInfo(
            flag=d["flag"],
            dest=d["dest"],
            group=d["group"],
            help=d["help"],
            kind=d["kind"],
            choices=choices,
            default=d["default"],
            tunable=d["tunable"],
            exclusive_with=tuple(d["exclusive_with"]),
            expects=_expects(d["kind"], choices, convert),
            convert=convert,
        )
    return out


def _unknown(name: str) -> FlagProblem:
    if name == "--model-path":
        return FlagProblem(
            name, "model", Text("give the checkpoint in the model field, not as --model-path")
        )
    if name in ("-h", "--help"):
        return FlagProblem(name, "unknown", Text("{name} is not an engine setting", name=name))
    known = ", ".join(catalog())
    close = difflib.get_close_matches(name, list(catalog()), n=1, cutoff=0.6)
    if close:
        return FlagProblem(
            name,
            "unknown",
            Text(
                "unknown flag {name}; did you mean {close}? The engine's flags: {known}",
                name=name,
                close=close[0],
                known=known,
            ),
        )
    return FlagProblem(
        name,
        "unknown",
        Text("unknown flag {name} The engine's flags: {known}", name=name, known=known),
    )


def check_value(flag: str, value: str | None) -> FlagProblem | None:
    """What is wrong with giving `value` to a known `flag`, or None (for the editor's inline
    messages as much as for validation)."""
    info = catalog()[flag]
    if info.switch:
        if value is None:
            return None
        return FlagProblem(
            flag,
            "switch_value",
            Text(
                "{flag} is an on/off flag and takes no value (got {value!r}); give it alone to "
                "switch it on, leave it out for off",
                flag=flag,
                value=value,
            ),
        )
    if value is None or value == "":
        return FlagProblem(
            flag,
            "missing_value",
            Text("{flag} needs a value: {expects}", flag=flag, expects=info.expects),
        )
    if info.choices is not None and value not in info.choices:
        close = difflib.get_close_matches(value, info.choices, n=1, cutoff=0.5)
        choices = ", ".join(info.choices)
        if close:
            return FlagProblem(
                flag,
                "choice",
                Text(
                    "{flag} {value} is not allowed; choose one of {choices} (did you mean "
                    "{close}?)",
                    flag=flag,
                    value=value,
                    choices=choices,
                    close=close[0],
                ),
            )
        return FlagProblem(
            flag,
            "choice",
            Text(
                "{flag} {value} is not allowed; choose one of {choices}",
                flag=flag,
                value=value,
                choices=choices,
            ),
        )
    if info.convert is not None:
        try:
            info.convert(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            detail = error_text(err) or Text("{value!r} is not valid", value=value)
            # the parser's own words name the allowed shape except for bare numbers
            if info.kind in ("int", "float"):
                detail = Text("{detail} (allowed: {expects})", detail=detail, expects=info.expects)
            return FlagProblem(
                flag,
                "value",
                Text("{flag} {value}: {detail}", flag=flag, value=value, detail=detail),
            )
    return None


def split_flags(flags: Iterable[str]) -> tuple[FlagList, list[FlagProblem]]:
    """A flag list's valid settings, in order, and its problems: unknown flags (a mistyped
    flag's value goes with it), missing or stray values, and values given to on/off flags.
    Duplicates are kept (see `find_problems`)."""
    settings: list[FlagSetting] = []
    problems: list[FlagProblem] = []
    previous: FlagSetting | str | None = None
    for item in read_items(flags):
        if isinstance(item, str) and isinstance(previous, FlagSetting) and previous.value is None:
            problem = check_value(previous.flag, item)  # a value given to an on/off flag
        elif isinstance(item, str):
            problem = _stray(item)
        elif item.flag not in catalog():
            problem = _unknown(item.flag)
        else:
            problem = check_value(item.flag, item.value)
            if problem is None:
                settings.append(item)
        if problem is not None:
            problems.append(problem)
        previous = item
    return FlagList(tuple(settings)), problems


def _stray(token: str) -> FlagProblem:
    return FlagProblem(
        None,
        "stray",
        Text(
            "{token!r} belongs to no flag; every value follows its flag (e.g. --moe-cache-rate "
            "0.5)",
            token=token,
        ),
    )


def find_problems(flags: Any) -> list[FlagProblem]:
    """Every reason the engine (or a profile) would refuse `flags`; empty when they are fine."""
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        return [
            FlagProblem(
                None,
                "not_strings",
                Text('flags must be a list of strings, e.g. ["--moe-cache-rate", "0.5"]'),
            )
        ]
    settings, problems = split_flags(flags)
    seen: dict[str, FlagSetting] = {}
    for s in settings:
        if s.flag in seen:
            before = seen[s.flag]
            twice = (
                Text("{flag} is given twice; keep one", flag=s.flag)
                if s.value is None
                else Text(
                    "{flag} is given twice ({first} and {second}); keep one",
                    flag=s.flag,
                    first=before.value,
                    second=s.value,
                )
            )
            problems.append(FlagProblem(s.flag, "duplicate", twice))
        seen[s.flag] = s
    for s in seen.values():
        for other in catalog()[s.flag].exclusive_with:
            if other in seen and s.flag < other:
                problems.append(
                    FlagProblem(
                        s.flag,
                        "exclusive",
                        Text(
                            "{flag} and {other} cannot both be given: they set the same thing; "
                            "keep one",
                            flag=s.flag,
                            other=other,
                        ),
                    )
                )
    return problems


def validate_flags(flags: Any, model: str = "MODEL") -> argparse.Namespace:
    """Check `flags` as `moelab serve --model-path MODEL FLAGS` would; FlagError when refused.

    Returns the parsed settings, defaults filled in.
    """
    problems = find_problems(flags)
    if problems:
        raise FlagError(problems)
    parser = engine_args.build_parser()

    def refuse(message: str) -> None:
        raise FlagError([FlagProblem(None, "engine", message)])  # argparse's own words

    # argparse reports errors by printing and exiting; here they become FlagError
    parser.error = refuse  # type: ignore[method-assign]
    parser.exit_on_error = False
    try:
        parsed = parser.parse_args(["--model-path", model, *flags])
    except argparse.ArgumentError as err:
        raise FlagError([FlagProblem(None, "engine", error_text(err))]) from None
    try:  # the rules between flags (--layer-split without --devices), as the engine's
        EngineConfig.from_args(parsed)
    except ConfigError as err:
        raise FlagError([FlagProblem(None, "engine", error_text(err))]) from None
    return parsed


def engine_config(flags: Any, model: str = "MODEL") -> EngineConfig:
    """The engine's settings of `moelab serve --model-path MODEL FLAGS` (FlagError when the
    engine would refuse the flags)."""
    return EngineConfig.from_args(validate_flags(flags, model))


def canonical(flags: list[str]) -> list[str]:
    """Valid flags in their stored form: `--flag value` pairs, each flag once (FlagError if not)."""
    validate_flags(flags)
    return FlagList.parse(flags).render()


def settings_of(flags: list[str]) -> dict[str, str | None]:
    """Valid flags as {flag: value} (None for an on/off flag that is on)."""
    validate_flags(flags)
    return FlagList.parse(flags).as_dict()


def last_wins(flags: list[str]) -> tuple[list[str], list[str]]:
    """Collapse flags given more than once to the last value, as the engine's parser would.

    Returns the flags and a note per collapsed flag. Other problems are left for validation.
    """
    given, _problems = split_flags(flags)
    kept = given.unique()
    notes = []
    for flag, value in kept:
        values = [v for f, v in given if f == flag]
        if len(values) > 1:
            shown = ", ".join("on" if v is None else v for v in values)
            last = "on" if value is None else value
            notes.append(f"{flag} was given {len(values)} times ({shown}); kept the last, {last}")
    return kept.render(), notes


def apply_changes(flags: list[str], changes: Iterable[FlagChange]) -> list[str]:
    """`flags` with each change made: a set value replaces the flag in place (or is added at the
    end) and drops flags exclusive with it; True switches an on/off flag on, False or None drops
    a flag. The result is validated (FlagError)."""
    given, problems = split_flags(flags)
    if problems:
        raise FlagError(problems)
    current = given.unique()
    for change in changes:
        info = catalog().get(change.flag)
        if info is None:
            raise FlagError([_unknown(change.flag)])
        value = change.value
        if value is None or value is False:
            current = current.drop(change.flag)
            continue
        if value is True:
            if not info.switch:
                raise FlagError(
                    [
                        FlagProblem(
                            change.flag,
                            "missing_value",
                            Text(
                                "{flag} needs a value ({expects}), not on/off",
                                flag=change.flag,
                                expects=info.expects,
                            ),
                        )
                    ]
                )
            text = None
        else:
            text = str(value)
            problem = check_value(change.flag, text)
            if problem is not None:
                raise FlagError([problem])
        current = current.set(change.flag, text)
    out = current.render()
    validate_flags(out)
    return out


def changes_from_json(items: Any) -> list[FlagChange]:
    """`[{"flag": "--x", "value": "1" | true | false | null}, ...]` as changes (FlagError)."""
    if not isinstance(items, list):
        items = [items]
    out = []
    for item in items:
        ok = isinstance(item, dict) and isinstance(item.get("flag"), str)
        value = item.get("value") if ok else None
        if not ok or not (value is None or isinstance(value, (str, bool))):
            raise FlagError(
                [
                    FlagProblem(
                        None,
                        "not_strings",
                        Text(
                            'a change is {{"flag": "--name", "value": "text" | true | false | '
                            "null}}"
                        ),
                    )
                ]
            )
        info = catalog().get(item["flag"])
        if info is not None and info.switch and value in ("true", "on", "false", "off"):
            value = value in ("true", "on")  # an on/off flag from a form field
        out.append(FlagChange(item["flag"], value))
    return out
