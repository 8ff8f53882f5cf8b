"""What pass `lower` makes of a plan and `verify` and codegen read: the step's events per stream,
with their waits, and its static buffers (not the runtime's generated module, runtime/schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.ir.events import Buffer, Event


@dataclass(frozen=True, slots=True)
class Schedule:
    events: tuple[Event, ...]
    buffers: tuple[Buffer, ...]
    budget: int
    reserve: int = 0  # left free inside the budget for the allocator (NOTE: [Allocator reserve] in hardware/__init__.py)
