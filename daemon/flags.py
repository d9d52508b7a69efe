"""Engine flags checked against the engine's own parser before anything is stored or started."""

from __future__ import annotations

import argparse
import difflib

from ..engine import args as engine_args


class FlagError(ValueError):
    """Flags the engine would refuse; the message says what is wrong and what is allowed."""


def _raise(message: str) -> None:
    raise FlagError(message)


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


def known_flags() -> list[str]:
    return [f["flag"] for f in engine_args.describe_flags()]


def validate_flags(model: str, flags: list[str]) -> argparse.Namespace:
    """Parse `--model-path MODEL FLAGS` as `moelab serve` would; FlagError when it would refuse.

    The model is not one of the flags: a profile names it in its own field.
    """
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise FlagError('flags must be a list of strings, e.g. ["--moe-cache-rate", "0.5"]')
    for item in flags:
        name = item.split("=", 1)[0]
        if name == "--model-path":
            raise FlagError("give the checkpoint in the model field, not as --model-path")
        if name in ("-h", "--help"):
            raise FlagError(f"{name} is not an engine setting")
        if name.startswith("-") and name not in known_flags():
            close = difflib.get_close_matches(name, known_flags(), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FlagError(f"unknown flag {name}{hint} (GET /api/flags lists them all)")
    parser = engine_args.build_parser()
    # argparse reports errors by printing and exiting; here they become FlagError
    parser.error = _raise  # type: ignore[method-assign]
    parser.exit_on_error = False
    try:
        return parser.parse_args(["--model-path", model, *flags])
    except argparse.ArgumentError as err:
        raise FlagError(str(err)) from None
