"""A profile as a TOML file: export one, import one.

```toml
name = "qwen3-30b 24GB"
model = "/home/me/models/Qwen3-30B-A3B"
origin = "Recommended"
notes = "for long chats"

[flags]
kv-reserve-tokens = 40960
moe-miss-policy = "auto"
device-memory = "22GiB"
no-cuda-graph = true
```

Flags are keys without their leading dashes; a number is written as a TOML number when that
keeps its text exactly, else as a string; an on/off flag is `true` (false or absent: off). TOML
itself refuses a key given twice, so a file holds each flag once.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from ..engine.text import Text
from .flags import FlagError, FlagProblem, catalog, split_flags, validate_flags

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

FIELDS = ("name", "model", "origin", "notes")
_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


@dataclass(frozen=True, slots=True)
class ProfileFile:
    """The fields of a profile file: name, model, flags (a canonical list), origin and notes."""

    name: str | None
    model: str | None
    flags: list[str]
    origin: str | None = None
    notes: str | None = None


def _string(text: str) -> str:
    """A TOML basic string (control characters escaped, as TOML requires)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(kind: str, text: str | None) -> str:
    if text is None:
        return "true"
    if kind == "int" and re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
        return text
    if kind == "float" and re.fullmatch(r"-?(0|[1-9][0-9]*)\.[0-9]+", text):
        return text
    return _string(text)


def dumps(profile: ProfileFile) -> str:
    """The TOML text of a profile (flags validated first: FlagError)."""
    validate_flags(profile.flags)
    lines = ["# moelab launch profile (import it on the console's Profiles page)"]
    for field in FIELDS:
        value = getattr(profile, field)
        if value is not None:
            lines.append(f"{field} = {_string(value)}")
    lines += ["", "[flags]"]
    settings, _ = split_flags(profile.flags)
    for s in settings:
        lines.append(f"{s.flag[2:]} = {_value(catalog()[s.flag].kind, s.value)}")
    return "\n".join(lines) + "\n"


def _problem(message: Text) -> FlagError:
    return FlagError([FlagProblem(None, "toml", message)])


def loads(text: str) -> ProfileFile:
    """Read a profile file; FlagError naming what is wrong (bad TOML, unknown keys, bad flags)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise _problem(
            Text(
                "the file is not valid TOML: {error} (a key given twice is refused by TOML itself)",
                error=str(err),
            )
        ) from None
    unknown = sorted(set(data) - {*FIELDS, "flags"})
    if unknown:
        raise _problem(
            Text(
                "unknown key(s) {unknown}; a profile file has {fields} and a [flags] table",
                unknown=", ".join(unknown),
                fields=", ".join(FIELDS),
            )
        )
    for field in FIELDS:
        if field in data and not isinstance(data[field], str):
            raise _problem(Text("{field} must be a string", field=field))
    table = data.get("flags", {})
    if not isinstance(table, dict):
        raise _problem(Text("flags must be a table: [flags] with one key per flag"))
    flags: list[str] = []
    for key, value in table.items():
        flag = key if key.startswith("--") else f"--{key}"
        info = catalog().get(flag)
        if info is not None and info.switch and not isinstance(value, bool):
            raise _problem(
                Text("{key} is on/off: write {key} = true, or leave it out for off", key=key)
            )
        if isinstance(value, bool):
            if info is not None and not info.switch:
                raise _problem(
                    Text(
                        "{key} = {value}: {flag} is not on/off; it takes {expects}",
                        key=key,
                        value=str(value).lower(),
                        flag=flag,
                        expects=info.expects,
                    )
                )
            if value:
                flags.append(flag)
            continue
        if isinstance(value, (int, float, str)):
            flags += [flag, str(value)]
            continue
        raise _problem(Text("{key}: a flag's value is a string, a number or true/false", key=key))
    validate_flags(flags)
    return ProfileFile(
        name=data.get("name"),
        model=data.get("model"),
        flags=flags,
        origin=data.get("origin"),
        notes=data.get("notes"),
    )
