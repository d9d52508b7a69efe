"""Engine flags checked against the engine's own parser before anything is stored or started."""

from __future__ import annotations

import argparse

from ..profiles import flags as profile_flags
from ..profiles.flags import FlagError

__all__ = ["HIDDEN", "SECRET_FLAGS", "FlagError", "hide_secrets", "redact_flags", "validate_flags"]

SECRET_FLAGS = ("--api-key",)
HIDDEN = "(hidden)"


def redact_flags(flags: list[str]) -> list[str]:
    """Flags with secret values (the engine's API key) replaced, for viewers without the token."""
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


def hide_secrets(text: str, flags: list[str]) -> str:
    """`text` (a log, an error) with the values of the secret flags in `flags` replaced."""
    for item, shown in zip(flags, redact_flags(flags), strict=True):
        if item != shown:
            secret = item.split("=", 1)[1] if "=" in item else item
            text = text.replace(secret, HIDDEN)
    return text


def validate_flags(model: str, flags: list[str]) -> argparse.Namespace:
    """Parse `--model-path MODEL FLAGS` as `moelab serve` would; FlagError when it would refuse.

    The model is not one of the flags: a profile names it in its own field. The checks and their
    messages live in profiles/flags.py.
    """
    return profile_flags.validate_flags(flags, model)
