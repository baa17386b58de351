"""Durations as Go writes them (``time.ParseDuration``, as client-go users do): ``250ms``,
``1.5s``, ``1m30s``, ``1h2m``, also ``us``/``µs``/``ns``, or plain seconds."""

from __future__ import annotations

import re
from decimal import Decimal

# Go's duration syntax: one or more <number><unit>; a lone number is seconds here.
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PART = re.compile(rf"({_NUMBER})(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_PARTS = re.compile(rf"(?:{_PART.pattern})+")
_PLAIN = re.compile(_NUMBER)
_UNITS = {"ns": Decimal("1e-9"), "us": Decimal("1e-6"), "\u00b5s": Decimal("1e-6"),
          "\u03bcs": Decimal("1e-6"), "ms": Decimal("0.001"), "s": Decimal(1),
          "m": Decimal(60), "h": Decimal(3600)}
# Far beyond any setting's bound; keeps every parsed value a finite float.
MAX_DURATION = Decimal(10**9)


def _quoted(text: str) -> str:
    """The user's text in an error, cut short (a value can be 400 characters of nines)."""
    return repr(text) if len(text) <= 24 else f"{text[:12]!r}… ({len(text)} characters)"


def parse_duration(text: str) -> float:
    """Go's duration syntax (``1m30s``, ``250ms``, ``1.5h``) or plain seconds → seconds."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ValueError(f"{_quoted(text)} is not a duration: it is negative")
    body = raw[1:] if raw.startswith("+") else raw
    if _PLAIN.fullmatch(body):
        total = Decimal(body)
    elif _PARTS.fullmatch(body):
        total = sum((Decimal(number) * _UNITS[unit] for number, unit in _PART.findall(body)),
                    Decimal(0))
    else:
        raise ValueError(f"{_quoted(text)} is not a duration (use 250ms, 1.5s, 1m30s, 2h or "
                         "plain seconds)")
    if total > MAX_DURATION:
        raise ValueError(f"{_quoted(text)} is too large (more than {MAX_DURATION} seconds)")
    return float(total)


def format_duration(seconds: float) -> str:
    """Seconds as Go would write them, shortest form: ``250ms``, ``1.5s``, ``1m30s``."""
    if seconds == 0:
        return "0s"
    if seconds < 0.001:
        return f"{round(seconds * 1e6, 3):g}\u00b5s"
    if seconds < 1:
        return f"{round(seconds * 1e3, 3):g}ms"
    hours, rest = divmod(round(seconds * 1000), 3_600_000)
    minutes, millis = divmod(rest, 60_000)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    if millis or not any(parts):
        parts.append(f"{millis / 1000:g}s")
    return "".join(parts)
