"""A `moelab serve` flag list as launch profiles, the benchmark and the launcher keep one:
`["--moe-cache-rate", "0.5", "--no-cuda-graph"]`.

Read as the engine's parser reads it: a value follows its flag (`--port 8000`) or its `=`
(`--port=8000`), an on/off flag takes none, and where a flag is given twice the last one wins.
Written back canonical: `--flag value` pairs, each flag once. Torch-free (the manager reads it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from .args import describe_flags


class FlagSetting(NamedTuple):
    """A flag and its value as text (None for an on/off flag, which is on when present)."""

    flag: str
    value: str | None

    @property
    def argv(self) -> list[str]:
        return [self.flag] if self.value is None else [self.flag, self.value]


@functools.cache
def described() -> dict[str, dict[str, Any]]:
    """What the engine's parser says of each flag (engine/config/args.py `describe_flags`), by
    flag."""
    return {f["flag"]: f for f in describe_flags()}


def is_switch(flag: str) -> bool:
    """Whether `flag` is one of the engine's on/off flags."""
    info = described().get(flag)
    return info is not None and info["kind"] == "switch"


def is_flag_item(item: str) -> bool:
    """Whether a command line's item names a flag (a negative number such as -1 is a value)."""
    return item.startswith("-") and not re.fullmatch(r"-[0-9.]+", item)


def read_items(items: Iterable[str]) -> Iterator[FlagSetting | str]:
    """Each flag of a command line with its value, in order. A flag that takes a value and is
    not followed by one comes with None; an item that follows no flag taking a value (a value
    given to an on/off flag, a stray one) comes as the item itself."""
    items = list(items)
    i = 0
    while i < len(items):
        item = items[i]
        i += 1
        if not is_flag_item(item):
            yield item
            continue
        name, eq, inline = item.partition("=")
        if eq:
            yield FlagSetting(name, inline)
        elif not is_switch(name) and i < len(items) and not is_flag_item(items[i]):
            yield FlagSetting(name, items[i])
            i += 1
        else:
            yield FlagSetting(name, None)


@dataclass(frozen=True, slots=True)
class FlagList:
    """A flag list's settings in order (a flag given twice is here twice: `get` and `unique`
    keep the last, as the engine does)."""

    settings: tuple[FlagSetting, ...] = ()

    @classmethod
    def parse(cls, items: Iterable[str]) -> FlagList:
        """The settings of a command line's items (stray values left out: profiles/flags.py
        reports them)."""
        return cls(tuple(s for s in read_items(items) if isinstance(s, FlagSetting)))

    def __iter__(self) -> Iterator[FlagSetting]:
        return iter(self.settings)

    def has(self, flag: str) -> bool:
        return any(s.flag == flag for s in self.settings)

    def get(self, flag: str, default: str | None = None) -> str | None:
        """The value given to `flag` (the last one wins), else `default`."""
        given = [s.value for s in self.settings if s.flag == flag]
        return given[-1] if given else default

    def in_force(self, flag: str) -> str | bool | None:
        """What the engine uses for `flag`: the value given, else the parser's default as text
        (None where it has none); an on/off flag answers True or False."""
        if is_switch(flag):
            return self.has(flag)
        given = self.get(flag)
        if given is not None:
            return given
        info = described().get(flag)
        default = info["default"] if info else None
        return None if default is None else str(default)

    def set(self, flag: str, value: str | None) -> FlagList:
        """This list with `flag` given `value` (None: an on/off flag switched on): in the place
        of its first setting, or at the end; the flags it excludes are dropped."""
        info = described().get(flag)
        excluded = set(info["exclusive_with"]) if info else set()
        out, placed = [], False
        for s in self.settings:
            if s.flag in excluded or (s.flag == flag and placed):
                continue
            if s.flag == flag:
                s, placed = FlagSetting(flag, value), True
            out.append(s)
        if not placed:
            out.append(FlagSetting(flag, value))
        return FlagList(tuple(out))

    def drop(self, *flags: str) -> FlagList:
        """This list without `flags` (the engine's defaults apply to them again)."""
        return FlagList(tuple(s for s in self.settings if s.flag not in flags))

    def unique(self) -> FlagList:
        """Each flag once, in the place it was first given, with the value it was last given."""
        last = {s.flag: s for s in self.settings}
        return FlagList(tuple(last.values()))

    def as_dict(self) -> dict[str, str | None]:
        """{flag: value}, the last value of each flag."""
        return {s.flag: s.value for s in self.settings}

    def render(self) -> list[str]:
        """The list as a command line's items, `--flag value` pairs."""
        return [item for s in self.settings for item in s.argv]
