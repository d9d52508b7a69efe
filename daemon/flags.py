"""Engine flags checked against the engine's own parser before anything is stored or started."""

from __future__ import annotations

import argparse

from ..engine.process.redact import HIDDEN, SECRET_FLAGS, hide_secrets, redact_flags
from ..profiles import flags as profile_flags
from ..profiles.flags import FlagError

__all__ = ["HIDDEN", "SECRET_FLAGS", "FlagError", "hide_secrets", "redact_flags", "validate_flags"]


def validate_flags(model: str, flags: list[str]) -> argparse.Namespace:
    """Parse `--model-path MODEL FLAGS` as `moelab serve` would; FlagError when it would refuse.

    The model is not one of the flags: a profile names it in its own field. The checks and their
    messages live in profiles/flags.py.
    """
    return profile_flags.validate_flags(flags, model)
