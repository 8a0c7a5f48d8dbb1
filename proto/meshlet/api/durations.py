"""Durations as settings are written (`500ms`, `10s`, `2m`, `1h`, or plain seconds): the one
grammar for the proxy's environment and the controllers' flags."""

from __future__ import annotations

import re
from typing import Final

_DURATION: Final = re.compile(r"^(\d{1,9}(?:\.\d{1,9})?)(ms|s|m|h)?$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds; ValueError says what is expected."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError("expected a duration such as 500ms, 10s or 2m")
    return float(match[1]) * _UNITS[match[2]]
