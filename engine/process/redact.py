"""Secret flag values (the engine's API key) kept out of logs, errors and pages.

A value is masked by its position: the item after a secret flag (`--api-key KEY`) or the text after
its `=` (`--api-key=KEY`). Never by looking for the value's text elsewhere: a short key (`a`) would
turn every letter a into the mask, and the gaps in the text would spell the key out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SECRET_FLAGS = ("--api-key",)
HIDDEN = "(hidden)"

# a secret flag as a word of a command line in free text, then its value: quoted or up to a blank
_SECRET_IN_TEXT = re.compile(
    r"(?<![\w-])(?P<flag>" + "|".join(re.escape(f) for f in SECRET_FLAGS) + r")"
    r"(?P<sep>=|[ \t]+)(?P<value>'[^'\n]*'|\"[^\"\n]*\"|[^\s'\"]+)"
)


def redact_flags(flags: Sequence[str]) -> list[str]:
    """A command line (or a flag list) with the values of secret flags replaced by `(hidden)`."""
    out = []
    hide_next = False
    for item in flags:
        name = item.split("=", 1)[0]
        if hide_next:
            out.append(HIDDEN)
        elif name in SECRET_FLAGS and "=" in item:
            out.append(f"{name}={HIDDEN}")
        else:
            out.append(item)
        hide_next = not hide_next and item in SECRET_FLAGS
    return out


def hide_secrets(text: str) -> str:
    """Free text (a log written before keys were kept out of it, an error) with secret values
    replaced where a command line in it gives them: after `--api-key ` or `--api-key=`."""
    return _SECRET_IN_TEXT.sub(lambda m: f"{m['flag']}{m['sep']}{HIDDEN}", text)
