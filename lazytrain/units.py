"""Byte sizes as people write them ("24GiB", "1.5 GB") and as lazytrain prints them."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """`parse_size("24GiB") == 24 * 2**30`; plain numbers are bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with a unit, e.g. 24GiB, 512MiB, 1.5GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: float, round_up: bool = False) -> str:
    """`format_size(1782579) == "1.7 MiB"`: binary units, one decimal. `round_up` never prints less
    than `nbytes`, so a printed minimum can be passed back as a budget."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(value) if round_up else round(value):.0f} B"
            shown = math.ceil(value * 10) / 10 if round_up else value
            return f"{shown:.1f} {unit}"
        value /= 1024
