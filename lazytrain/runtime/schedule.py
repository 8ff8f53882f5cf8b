"""What a generated schedule module imports: the event IR, `Stage`, and `bind_module`.

NOTE: [Runtime imports]
This package imports torch and `lazytrain.ir.events` only: never `lazytrain.passes`, python-mip or
networkx, so a schedule compiled on a laptop runs where only torch is installed.
"""

from __future__ import annotations

import hashlib
import linecache
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Buffer, Event, Kind, Phase, Stream

__all__ = ["Buffer", "Event", "Kind", "Phase", "Stage", "Stream", "bind_module", "load_schedule", "load_source"]

FORMAT_VERSION = 4  # 2: per-stage optimizer-state precision (`Stage.states`); 3: `Stage.skips` and `remat`;
# 4: chunked loss stages cut along tokens and their whole part (`Stage.chunk_len`, `tokens`, `whole_fn`)


_CHECKSUM_LINE = re.compile(r'^CHECKSUM = ".*"$', re.MULTILINE)


def checksum(text: str) -> str:
    """Hash of the whole module with the CHECKSUM line's value left out: any edit or truncation
    anywhere is caught at load."""
    return hashlib.sha256(_CHECKSUM_LINE.sub('CHECKSUM = ""', text).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    fn: Callable
    placeholders: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    grad_inputs: tuple[str, ...] = ()
    grad_outputs: tuple[str, ...] = ()
    recompute: bool = False
    stream: bool = False
    outputs_mode: str = "keep"
    kind: str = ""
    param_bytes: int = 0
    param_numel: int = 0
    gpu_step: bool = False  # streamed, with its optimizer step on the GPU at the next prefetch
    chunks: int = 1  # >1: forward and backward run together over this many slices of the batch
    chunk_len: int = 0  # >0: the slices are pieces of one row, this many positions each (NOTE: [Chunked loss])
    tokens: tuple[int, ...] = ()  # with chunk_len: (rows, positions) of the batch the pieces cut
    whole_fn: Callable | None = None  # a chunked stage's part run once for the whole batch, before the slices
    whole_outputs: tuple[str, ...] = ()  # whole_fn's results, which the slices read
    states: str = "32bit"  # its optimizer states' precision (NOTE: [State precision per stage] in passes/solve.py)
    skips: tuple[str, ...] = ()  # nodes `fn(..., remat=True)` leaves uncomputed (NOTE: [Skipped recompute] in passes/remat.py)


def load_source(text: str, name: str = "lazytrain_schedule", path: str | None = None) -> ModuleType:
    """Execute schedule source as a module; the source is registered with linecache so tracebacks
    show the schedule's own lines."""
    filename = path or f"<lazytrain schedule {name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(text, filename, "exec"), module.__dict__)
    _check_integrity(module, text, filename)
    return module


def load_schedule(path: str | Path) -> ModuleType:
    path = Path(path)
    if not path.is_file():
        raise ScheduleMismatch(f"schedule {path} does not exist; create it with `lazytrain compile model.py -o {path}`")
    text = path.read_text()
    try:
        return load_source(text, f"lazytrain_schedule_{abs(hash(str(path.resolve())))}", str(path))
    except ScheduleMismatch:
        raise
    except Exception as exc:
        raise ScheduleMismatch(f"schedule {path} is corrupt ({type(exc).__name__}: {exc}); recompile it with `lazytrain compile`") from None


def _check_integrity(module: ModuleType, text: str, where: str) -> None:
    fmt = getattr(module, "FORMAT", None)
    if fmt != FORMAT_VERSION:
        raise ScheduleMismatch(f"schedule {where} has format {fmt}, this lazytrain reads {FORMAT_VERSION}: it is stale; recompile it")
    if getattr(module, "CHECKSUM", None) != checksum(text):
        raise ScheduleMismatch(f"schedule {where} was edited or is corrupt (checksum mismatch); recompile it with `lazytrain compile`")


def bind_module(module: ModuleType, model, **optimizer_args):
    from lazytrain.runtime.trainer import Trainer

    return Trainer(module, model, **optimizer_args)
