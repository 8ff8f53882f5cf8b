"""What a generated schedule module imports: the event IR, `Stage`, `bind_module`, `check_integrity`.

NOTE: [Runtime imports]
This package imports torch, `lazytrain.ir.events`, `lazytrain.ir.placement` and `lazytrain.sizes`
(pure Python) only: never `lazytrain.passes`, `lazytrain.solver`, python-mip or networkx, so a
schedule compiled on a laptop runs where only torch is installed.

NOTE: [Schedule checksum]
A schedule records `CHECKSUM`, a hash of its whole text with that line's value left out, so any
edit or truncation anywhere is caught, however the module was loaded: the module checks its own
text as it is imported (`check_integrity(globals())`, below its CHECKSUM line; the text comes from
its loader, or from `linecache` where `load_source` registered it), `load_source` checks the text
it ran, and `bind_module` checks a module no check has passed yet (one whose import-time call was
deleted). This catches accidents, not malice: a schedule is Python code that has run by the time
any check does, so run only schedules you trust, as with any module.
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
from lazytrain.ir.placement import Internals, On, Outputs, Placement, Split, Step, Tier, Weights, When

__all__ = ["Buffer", "Event", "Internals", "Kind", "On", "Outputs", "Phase", "Placement", "Split", "Stage", "Step", "Stream", "Tier",
           "Weights", "When", "bind_module", "check_integrity", "load_schedule", "load_source"]

# 2: per-stage optimizer-state precision (`Stage.states`); 3: `Stage.skips` and `remat`; 4: `DEVICE`, the
# device type the stages were captured for (NOTE: [Capture on the target device] in ir/target.py),
# `Stage.random` (its recomputes replay its generator state), `Stage.limits`, and chunked loss
# stages cut along tokens with their whole part (`Stage.chunk_len`, `tokens`, `whole_fn`); 5: `WORLD_SIZE`, the
# data-parallel ranks it runs on (NOTE: [Data parallel] in data_parallel.py); 6: `SHARDED`, the COMM
# stream's REDUCE and GATHER events and `Event.writes` (NOTE: [Sharded state] in sharding.py); 7: `CLIPPING`,
# the gradient clipping planned for (NOTE: [Gradient clipping] in stepping.py); 8: `Stage.disk`, optimizer
# states kept on disk (NOTE: [Disk-resident states] in solver/disk_model.py); 9: `Stage.disk` with `gpu_step`,
# a stage stepped on the GPU by a job that reads its states from disk (OPT_STEP device "disk", the `dstep`
# buffer; NOTE: [Disk-stepped stages] there); 10: `Stage.backward_step`, GPU steps right after the stage's
# backward (NOTE: [Backward steps] in solver/step_model.py); 11: `Stage.from_master`, prefetches cast from the fp32 master
# (NOTE: [Weights from the master] in solver/footprint.py); 12: `Stage.grads_freed`, a resident stage's
# gradients dropped after B(s-2) (NOTE: [Resident gradients freed at their step] there), and
# `Stage.cast_weights`, a resident stage's weights cast from its master before each use (NOTE:
# [Resident weights cast on use] there); 13: `Stage.disk` with `backward_step`, a stage stepped in backward
# whose states pass through a ring of host buffers from the offload file (NOTE: [Backward steps from disk]
# in solver/disk_model.py); 14: `outputs_mode` "disk" with `Stage.out_bytes`, outputs kept in the offload file
# between forward and backward (NOTE: [Activations on disk] in solver/disk_model.py); 15: `Stage.master_disk`, a
# step in backward from disk whose fp32 master lives in the offload file too (NOTE: [Masters on disk] there); 16:
# `Stage.loss_sum` on a loss stage that returns its sum and count, by which data-parallel ranks weight their
# gradients (NOTE: [Data parallel] in data_parallel.py); 17: `Stage.placement`, each stage's decisions as one typed
# value (ir/placement.py), in place of the flags versions 8 to 15 added one at a time; 18: `SHARDED_WEIGHTS`,
# each rank's host keeps 1/N of the streamed weights, gathered at every prefetch (NOTE: [Sharded host weights]
# in host_weights.py): an older runtime would read a whole host copy that is not there; 19: `Placement.split`,
# offloaded outputs split by the tile between the device, host memory and disk (`part:S` buffers; NOTE:
# [Boundary tiles] in solver/boundary.py)
FORMAT_VERSION = 19


_CHECKSUM_LINE = re.compile(r'^CHECKSUM = ".*"$', re.MULTILINE)
_CHECKED = "__lazytrain_checked__"  # set in a module's namespace once its text matched its CHECKSUM


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
    placement: Placement = Placement()  # what the plan decided for it (ir/placement.py)
    kind: str = ""  # the block kind's letter: identical blocks share it (pass `blocks`)
    param_bytes: int = 0
    param_numel: int = 0
    chunks: int = 1  # >1: forward and backward run together over this many slices of the batch
    chunk_len: int = 0  # >0: the slices are pieces of one row, this many positions each (NOTE: [Chunked loss])
    loss_sum: bool = False  # `fn(..., loss_sum=True)` returns (sum of the losses, targets counted): NOTE: [Data parallel]
    tokens: tuple[int, ...] = ()  # with chunk_len: (rows, positions) of the batch the pieces cut
    whole_fn: Callable | None = None  # a chunked stage's part run once for the whole batch, before the slices
    whole_outputs: tuple[str, ...] = ()  # whole_fn's results, which the slices read
    states: str = "32bit"  # its optimizer states' precision (NOTE: [State precision per stage] in solver/formulation.py)
    skips: tuple[str, ...] = ()  # nodes `fn(..., remat=True)` leaves uncomputed (NOTE: [Skipped recompute] in analysis/remat.py)
    random: bool = False  # draws random numbers: recomputes replay its forward's generator state (NOTE: [RNG replay] in rng.py)
    limits: tuple[str, ...] = ()  # for people: decisions it can never take, and why (pass `limits`)
    from_master: bool = False  # prefetched from its fp32 master, no compute-dtype host copy (runtime/store.py)
    out_bytes: int = 0  # with outputs on disk: its outputs' bytes, which size its region of the offload file (runtime/disk_acts.py)


def load_source(text: str, name: str = "lazytrain_schedule", path: str | None = None) -> ModuleType:
    """Execute schedule source as a module; the source is registered with linecache so tracebacks
    show the schedule's own lines."""
    filename = path or f"<lazytrain schedule {name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(compile(text, filename, "exec"), module.__dict__)  # the module checks itself, from linecache
        _check_integrity(module.__dict__, text, filename)  # and so is a schedule without that check
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_schedule(path: str | Path) -> ModuleType:
    path = Path(path)
    if not path.is_file():
        raise ScheduleMismatch(f"schedule {path} does not exist; create it with `lazytrain compile model.py -o {path}`")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScheduleMismatch(f"schedule {path} cannot be read as a schedule ({type(exc).__name__}); pass a file "
                               "written by `lazytrain compile`") from None
    try:
        return load_source(text, f"lazytrain_schedule_{abs(hash(str(path.resolve())))}", str(path))
    except ScheduleMismatch:
        raise
    except Exception as exc:
        raise ScheduleMismatch(f"schedule {path} is corrupt ({type(exc).__name__}: {exc}); recompile it with `lazytrain compile`") from None


def check_integrity(namespace: dict) -> None:
    """A schedule module's own text against its CHECKSUM (NOTE: [Schedule checksum]); generated
    modules call it with `globals()` as they are imported. Raises `ScheduleMismatch`."""
    where = namespace.get("__file__") or namespace.get("__name__", "<unnamed module>")
    text = _own_text(namespace)
    if text is None:
        raise ScheduleMismatch(
            f"schedule {where}: its source text cannot be read, so its checksum cannot be checked; import it from "
            "its .py file, or load it with `lazytrain.runtime.schedule.load_schedule(path)` or `load_source(text)`")
    _check_integrity(namespace, text, where)


def _own_text(namespace: dict) -> str | None:
    """The text the module was executed from: its loader's source (a file: universal newlines, as
    Python read it), else the lines `load_source` registered with linecache."""
    get_source = getattr(namespace.get("__loader__"), "get_source", None)
    if get_source is not None:
        try:
            text = get_source(namespace.get("__name__"))
        except (ImportError, OSError):
            text = None
        if text is not None:
            return text
    filename = namespace.get("__file__")
    if filename:
        linecache.checkcache(filename)  # entries of real files are dropped if the file changed
        lines = linecache.getlines(filename)
        if lines:
            return "".join(lines)
    return None


def _check_integrity(namespace: dict, text: str, where: str) -> None:
    fmt = namespace.get("FORMAT")
    if fmt != FORMAT_VERSION:
        raise ScheduleMismatch(f"schedule {where} has format {fmt}, this lazytrain reads {FORMAT_VERSION}: it is stale; recompile it")
    if namespace.get("CHECKSUM") != checksum(text):
        model = namespace.get("SOURCE") or "model.py"
        out = f" -o {where}" if not where.startswith("<") else ""
        raise ScheduleMismatch(
            f"schedule {where} was edited or is corrupt (checksum mismatch); recompile it with "
            f"`lazytrain compile {model}{out}` and change the model or the budget, not the schedule")
    namespace[_CHECKED] = namespace["CHECKSUM"]


def bind_module(module: ModuleType, model, **optimizer_args):
    """A Trainer for `model`; a module no checksum check has passed yet is checked first."""
    from lazytrain.runtime.trainer import Trainer

    ns = vars(module)
    if _CHECKED not in ns or ns[_CHECKED] != ns.get("CHECKSUM"):
        check_integrity(ns)
    return Trainer(module, model, **optimizer_args)
