"""Engine flag lists as the benchmark edits them: read a flag's value, apply exactly one change.

A flag list is what a profile stores: `["--moe-cache-rate", "0.5", "--no-cuda-graph"]`. A change
sets a value (a string), switches an on/off flag (True / False), or drops a flag (None) so the
engine's default applies again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from ..engine.args import describe_flags
from ..engine.text import Text

ChangeValue = str | bool | None


@cache
def _described() -> dict[str, dict[str, Any]]:
    return {f["flag"]: f for f in describe_flags()}


def flag_info(flag: str) -> dict[str, Any] | None:
    """What the engine's parser says about `flag` (kind, default, exclusive flags), or None."""
    return _described().get(flag)


def is_switch(flag: str) -> bool:
    info = flag_info(flag)
    return info is not None and info["kind"] == "switch"


@dataclass(frozen=True, slots=True)
class Change:
    """One edit of a flag list: set `flag` to a value, switch it on or off, or drop it."""

    flag: str
    value: ChangeValue

    @property
    def key(self) -> str:
        """A stable name of the change, used to tell whether a later run tried it already."""
        if self.value is None:
            return f"{self.flag}=(default)"
        if isinstance(self.value, bool):
            return f"{self.flag}={'on' if self.value else 'off'}"
        return f"{self.flag}={self.value}"

    @property
    def label(self) -> Text:
        """How the change reads in the console and in notes."""
        if self.value is None:
            return Text("drop {flag}", flag=self.flag)
        if isinstance(self.value, bool):
            if self.value:
                return Text("{flag} on", flag=self.flag)
            return Text("{flag} off", flag=self.flag)
        return Text("{flag} {value}", flag=self.flag, value=self.value)

    def to_json(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Change:
        return cls(str(data["flag"]), data.get("value"))


def split_flags(flags: list[str]) -> list[tuple[str, str | None]]:
    """The list as (flag, value) pairs in order; on/off flags have the value None."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(flags):
        item = flags[i]
        if "=" in item and item.startswith("--"):
            name, value = item.split("=", 1)
            pairs.append((name, value))
            i += 1
        elif is_switch(item) or i + 1 >= len(flags) or flags[i + 1].startswith("--"):
            pairs.append((item, None))
            i += 1
        else:
            pairs.append((item, flags[i + 1]))
            i += 2
    return pairs


def join_flags(pairs: list[tuple[str, str | None]]) -> list[str]:
    out: list[str] = []
    for name, value in pairs:
        out.append(name)
        if value is not None:
            out.append(value)
    return out


def has_flag(flags: list[str], flag: str) -> bool:
    return any(name == flag for name, _value in split_flags(flags))


def value_of(flags: list[str], flag: str) -> str | None:
    """The value `flags` gives `flag` (the last one wins), else None."""
    value = None
    for name, given in split_flags(flags):
        if name == flag:
            value = given
    return value


def effective_value(flags: list[str], flag: str) -> str | bool | None:
    """What the engine will use for `flag`: the given value, else the parser's default.

    On/off flags answer True or False.
    """
    if is_switch(flag):
        return has_flag(flags, flag)
    given = value_of(flags, flag)
    if given is not None:
        return given
    info = flag_info(flag)
    default = info["default"] if info else None
    return None if default is None else str(default)


def apply_change(flags: list[str], change: Change) -> list[str]:
    """`flags` with `change` applied; setting a flag also drops the flags it excludes."""
    info = flag_info(change.flag)
    excluded = set(info["exclusive_with"]) if info else set()
    pairs = [(n, v) for n, v in split_flags(flags) if n not in excluded]
    present = any(n == change.flag for n, _v in pairs)
    if change.value is None or change.value is False:
        return join_flags([(n, v) for n, v in pairs if n != change.flag])
    if change.value is True:
        return join_flags(pairs if present else [*pairs, (change.flag, None)])
    if present:
        return join_flags([(n, change.value if n == change.flag else v) for n, v in pairs])
    return join_flags([*pairs, (change.flag, change.value)])


def without(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """`flags` less every flag in `names` (with its value)."""
    return join_flags([(n, v) for n, v in split_flags(flags) if n not in names])


def same_flags(a: list[str], b: list[str]) -> bool:
    """Whether two lists ask the engine for the same thing (order aside, last value wins)."""
    return dict(split_flags(a)) == dict(split_flags(b))
