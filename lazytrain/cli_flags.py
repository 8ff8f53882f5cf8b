"""The values `lazytrain`'s flags take (argparse `type=`s): each refuses what it cannot read with
the reason and the form it wants, so a typo stops at the command line, not in the run."""

from __future__ import annotations

import argparse
import math

from lazytrain.units import parse_size


def budget(text: str):
    """A GPU budget: a size with a unit, min or max. A bare number is refused: `--budget 1.5` meant
    1.5 GiB far more often than one byte."""
    if text in ("min", "max"):
        return text
    valid = "write a size with a unit such as 24GiB or 512MiB, or min (the smallest that fits) or max (the whole device)"
    try:
        float(text)
    except ValueError:
        pass
    else:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit; {valid}")
    try:
        size = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a budget; {valid}") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no memory at all; {valid}")
    return size


MAX_STEPS = 10**9  # a billion steps: more is a typo, not a run
MAX_SEED = 2**63 - 1  # torch's generators take a 64-bit seed


def at_least(low: int, high: int | None = None):
    """A whole number in [low, high]."""
    bounds = f">= {low}" + (f" and <= {high:,}" if high is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass an integer {bounds}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; pass an integer {bounds}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is above {high:,}; pass an integer {bounds}")
        return value
    return parse


def nonempty_path(text: str) -> str:
    """A path flag's value: not empty (`--checkpoint-dir ''` would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; pass a file or directory name")
    return text


def number(low: float, high: float = math.inf, low_open: bool = True):
    """A finite float in (low, high] (or [low, high] when not `low_open`)."""
    bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a number {bounds}") from None
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"{text} is out of range; pass a number {bounds}")
        return value
    return parse


def tile_bytes(text: str) -> int | None:
    """--tile-bytes: 'auto' (None), or a size as for --loss-chunk-bytes."""
    return None if text.strip().lower() == "auto" else chunk_bytes(text)


def chunk_bytes(text: str) -> int:
    """--loss-chunk-bytes: a size with a unit, or 0 / off for no chunking. A bare number other than 0
    is refused, as for --budget."""
    if text.strip().lower() == "off":
        return 0
    try:
        bare = float(text)
    except ValueError:
        bare = None
    if bare is not None and bare != 0:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit; write a size such as 1GiB or 256MiB, or 0 or 'off'")
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'off'") from None
