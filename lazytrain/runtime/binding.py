"""Binding a schedule to a model: the checks that it fits the model, the device and each batch, and
where the model's tensors go before the parameter store (store.py) adopts them."""

from __future__ import annotations

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.runtime.disk_masters import masters_on_disk
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.sharding import ShardLayout
from lazytrain.runtime.store import streamed_params
from lazytrain.sizes import QUANT_BLOCK


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current GPU. Masters already on a GPU (NOTE: [Masters
    built in place] in store.py) sit on "cuda:0", which is not equal to "cuda": compared with the
    bare name, each would get a second copy on the device beside it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _fmt(shape, dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def bind_tensors(module, model) -> dict[str, torch.Tensor]:
    """The model's tensors by the schedule's placeholder names; a model the schedule does not fit is refused."""
    found = dict(model.named_parameters(remove_duplicate=False))  # tied weights answer to every name
    found.update(dict(model.named_buffers(remove_duplicate=False)))
    tensors: dict[str, torch.Tensor] = {}
    problems = []
    for name, (kind, target, shape, dtype) in module.PLACEHOLDERS.items():
        if kind == "input":
            continue
        t = found.get(target)
        if t is None:
            problems.append(f"it has no {kind} {target}")
        elif tuple(t.shape) != tuple(shape):
            problems.append(f"{target} is {_fmt(t.shape, t.dtype)}, compiled for {_fmt(shape, dtype)}")
        elif t.device.type == "meta":
            problems.append(f"{target} is on the meta device; load or initialise the weights first")
        else:
            tensors[name] = t
    known = {target for kind, target, *_ in module.PLACEHOLDERS.values() if kind == "param"}
    known_ids = {id(found[t]) for t in known if t in found}
    extra = [n for n, p in model.named_parameters() if id(p) not in known_ids and p.requires_grad]
    if extra:
        problems.append(f"it has parameters the schedule does not know: {', '.join(extra[:3])}")
    if problems:
        raise ScheduleMismatch(
            f"schedule {module.SOURCE or '<in memory>'} (fingerprint {module.FINGERPRINT}) does not fit this model: "
            + "; ".join(problems[:4]) + ". Recompile the schedule for this model with `lazytrain compile`")
    return tensors


def schedule_name(module) -> str:
    """"schedule FILE" for a schedule loaded from a file, else "the schedule"."""
    file = getattr(module, "__file__", "") or ""
    return f"schedule {file}" if file and not file.startswith("<") else "the schedule"


def check_device(module, device: torch.device) -> None:
    """The stages run on the device type they were captured for (NOTE: [Capture on the target
    device] in ir/target.py): model code picks operators by device type."""
    where = (f"{schedule_name(module)} (of {module.SOURCE or 'an in-memory model'}) was compiled for {module.DEVICE} "
             f"(hardware {module.HARDWARE})")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScheduleMismatch(f"{where} and this machine has no usable GPU; recompile it with --hardware cpu to run here")
    if device.type != module.DEVICE:
        fix = "--hardware cpu" if device.type == "cpu" else "a hardware profile of this machine (`lazytrain profile`)"
        raise ScheduleMismatch(
            f"{where} and is bound on {device.type}: its operators were chosen for {module.DEVICE}. Recompile it with "
            f"{fix}, or bind it with device=\"{module.DEVICE}\"")


def shard(module, tensors: dict[str, torch.Tensor], dp) -> tuple[dict, dict]:
    """This rank's cut of every stage's parameters (NOTE: [Sharded state] in sharding.py), and
    the mixed-precision masters' pieces, taken before the model's parameters become the full
    weights in the compute dtype."""
    groups = [(s.index, s.params) for s in module.STAGES] + [(-1, module.SHARED)]
    # every stage has one, empty where all its parameters are shared (a prologue holding only a
    # tied embedding): its REDUCE and GATHER events then move nothing, on every rank alike
    # 8-bit states: pieces of whole quantisation blocks, so each rank quantises its blocks as one
    # process would (every parameter alike: a 32-bit state is elementwise, cut anywhere)
    align = QUANT_BLOCK if getattr(module, "OPTIMIZER_STATES", "32bit") == "8bit" else 1
    layouts = {i: ShardLayout({p: tensors[p].numel() for p in names}, dp.world, dp.rank, align)
               for i, names in groups}
    pieces = {}
    for lay in layouts.values():
        for p in lay.numel:
            t, dtype = tensors[p], getattr(torch, module.PLACEHOLDERS[p][3])
            if t.dtype != dtype:
                pieces[p] = lay.own(p, t.detach()).clone()
                t.data = t.data.to(dtype)
    return layouts, pieces


def pin_streamed_masters(module, tensors: dict[str, torch.Tensor], pinned: PinnedArena, skip=()) -> None:
    """Page-locked masters copy to and from the GPU at full speed (pageable: ~9x slower). The
    parameter's storage moves into the arena: no second host copy. Not those in `skip` (placeholders:
    NOTE: [Sharded host weights] in host_weights.py)."""
    for p in streamed_params(module) - set(masters_on_disk(module)) - set(skip):  # NOTE: [Masters on disk]: not those
        t = tensors[p]
        if t.device.type == "cpu" and not t.is_pinned():
            t.data = pinned.copy_of(t.data)


def place_resident_masters(module, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """NOTE: [Resident masters on the device] in solver/step_model.py: a resident master moves
    to its home on the device, and the model's parameter with it; the host copy is freed."""
    streamed = streamed_params(module)
    for p, t in tensors.items():
        if module.PLACEHOLDERS[p][0] == "param" and p not in streamed and t.device != device:
            t.data = t.data.to(device)


def check_batch(module, batch: dict, device: torch.device) -> dict:
    """`batch` on the device, if it has the inputs the schedule was compiled for."""
    if set(batch) != set(module.BATCH):
        raise ScheduleMismatch(f"batch has inputs {sorted(batch)}, the schedule was compiled for {sorted(module.BATCH)}")
    for name, (shape, dtype) in module.BATCH.items():
        t = batch[name]
        if tuple(t.shape) != tuple(shape) or str(t.dtype).removeprefix("torch.") != dtype:
            raise ScheduleMismatch(
                f"batch input {name} is {_fmt(t.shape, t.dtype)} but the schedule was compiled for "
                f"{_fmt(shape, dtype)}; recompile with example_batch() returning that shape")
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
