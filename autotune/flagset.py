"""Engine flag lists as the benchmark edits them: read a flag's value, apply exactly one change.

A flag list is what a profile stores: `["--moe-cache-rate", "0.5", "--no-cuda-graph"]`, read and
written by engine/config/flag_list.py. A change sets a value (a string), switches an on/off flag
(True / False), or drops a flag (None) so the engine's default applies again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.config.flag_list import FlagList, described
from ..engine.text import Text

ChangeValue = str | bool | None


def flag_info(flag: str) -> dict[str, Any] | None:
    """What the engine's parser says about `flag` (kind, default, exclusive flags), or None."""
    return described().get(flag)


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


def has_flag(flags: list[str], flag: str) -> bool:
    return FlagList.parse(flags).has(flag)


def value_of(flags: list[str], flag: str) -> str | None:
    """The value `flags` gives `flag` (the last one wins), else None."""
    return FlagList.parse(flags).get(flag)


def effective_value(flags: list[str], flag: str) -> str | bool | None:
    """What the engine will use for `flag`: the given value, else the parser's default.

    On/off flags answer True or False.
    """
    return FlagList.parse(flags).in_force(flag)


def apply_change(flags: list[str], change: Change) -> list[str]:
    """`flags` with `change` applied; setting or dropping a flag also drops the flags it
    excludes (they set the same thing)."""
    given = FlagList.parse(flags)
    if change.value is None or change.value is False:
        info = flag_info(change.flag)
        return given.drop(change.flag, *(info["exclusive_with"] if info else ())).render()
    return given.set(change.flag, None if change.value is True else change.value).render()


def without(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """`flags` less every flag in `names` (with its value)."""
    return FlagList.parse(flags).drop(*names).render()


def same_flags(a: list[str], b: list[str]) -> bool:
    """Whether two lists ask the engine for the same thing (order aside, last value wins)."""
    return FlagList.parse(a).as_dict() == FlagList.parse(b).as_dict()
