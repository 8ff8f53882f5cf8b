"""Per-event printers: one line of Python per event, with a trailing comment for people.

Registered by event kind (STYLE.md point 7); the default prints the event's fields.
"""

from __future__ import annotations

from typing import Callable

from lazytrain.ir.events import Buffer, Event, Kind, Stream
from lazytrain.units import format_size

_STREAM = {Stream.COMPUTE: "C", Stream.H2D: "H2D", Stream.D2H: "D2H", Stream.CPU: "CPU", Stream.COMM: "COMM"}
PRINTERS: dict[Kind, Callable[[Event, dict, list[str]], str]] = {}


def printer(*kinds: Kind):
    def register(fn):
        for k in kinds:
            PRINTERS[k] = fn
        return fn
    return register


def _tuple(items) -> str:
    return repr(tuple(items))


def _fields(e: Event) -> str:
    parts = [str(e.id), _STREAM[e.stream], f"Kind.{e.kind.name}", str(e.stage)]
    if e.phase is not None:
        parts.append({"fwd": "FWD", "bwd": "BWD", "recompute": "RECOMPUTE"}[e.phase.value])
    for key in ("reads", "allocs", "frees", "waits", "writes"):
        val = getattr(e, key)
        if val:
            parts.append(f"{key}={_tuple(val)}")
    if e.workspace:
        parts.append(f"workspace={e.workspace}")
    if e.device:
        parts.append(f"device={e.device!r}")
    parts.append(f"start_s={e.start_s!r}, duration_s={e.duration_s!r}")
    return f"Event({', '.join(parts)}),"


def _when(e: Event) -> str:
    return f"t={e.start_s * 1e3:.3f}+{e.duration_s * 1e3:.3f}ms"


@printer(Kind.PREFETCH, Kind.OFFLOAD, Kind.RELOAD)
def _transfer(e: Event, buffers: dict[str, Buffer], names: list[str]) -> str:
    moved = (e.allocs or e.reads)[0]
    return f"{_fields(e)}  # {e.kind.value} {moved} ({names[e.stage]}) {format_size(buffers[moved].bytes)} {_when(e)}"


@printer(Kind.COMPUTE)
def _compute(e: Event, buffers, names) -> str:
    made = ", ".join(f"{a} {format_size(buffers[a].bytes)}" for a in e.allocs) or "-"
    return f"{_fields(e)}  # {names[e.stage]} {e.phase.value}; makes {made}; workspace {format_size(e.workspace)} {_when(e)}"


@printer(Kind.FREE)
def _free(e: Event, buffers, names) -> str:
    return f"{_fields(e)}  # free {e.frees[0]} {format_size(buffers[e.frees[0]].bytes)}"


@printer(Kind.OPT_STEP)
def _opt(e: Event, buffers, names) -> str:
    who = "shared parameters" if e.stage < 0 else names[e.stage]
    return f"{_fields(e)}  # AdamW on the {e.device} for {who} {_when(e)}"


@printer(Kind.REDUCE, Kind.GATHER)
def _collective(e: Event, buffers, names) -> str:
    who = "shared parameters" if e.stage < 0 else names[e.stage]
    what = (f"reduce-scatter of {e.reads[0]} into this rank's shard {e.allocs[0]}" if e.kind is Kind.REDUCE
            else f"all-gather of the {who} weights into {e.writes[0]}")
    return f"{_fields(e)}  # {what} ({who}); workspace {format_size(e.workspace)} {_when(e)}"


def print_event(e: Event, buffers: dict[str, Buffer], names: list[str]) -> str:
    fn = PRINTERS.get(e.kind)
    return fn(e, buffers, names) if fn else _fields(e)
