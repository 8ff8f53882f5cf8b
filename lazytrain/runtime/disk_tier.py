"""The disk tier's parts a trainer binds, under `offload_dir` (default: the temp directory): the
optimizer states kept in the offload file (NOTE: [Disk-resident states] in solver/disk_model.py),
stepped there by jobs of their own (NOTE: [Disk-stepped stages]) or in backward through a ring
(NOTE: [Backward steps from disk]), and stage outputs through a ring of their own (NOTE:
[Activations on disk]); and the GPU slot the jobs take turns in."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from types import ModuleType

import torch

from lazytrain.ir.events import Kind
from lazytrain.ir.placement import Outputs, Tier
from lazytrain.runtime.disk_acts import DiskActivations
from lazytrain.runtime.disk_masters import DiskMasters
from lazytrain.runtime.disk_states import DiskStates
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.store import OPT_SLACK, ParamStore


@dataclass(frozen=True)
class DiskTier:
    states: DiskStates | None  # the optimizer states on disk, if any
    acts: DiskActivations | None  # the stage outputs on disk, if any
    stepped: dict  # stage -> its parameters: the stages stepped on the GPU by a job that reads their states from disk
    in_backward: frozenset  # the stages stepped in their backward
    slot: torch.Tensor | None  # the GPU slot the jobs take turns in (the schedule's `dstep` buffer)


def bind_disk_tier(module: ModuleType, stages, optimizer, store: ParamStore, pinned: PinnedArena,
                   device: torch.device, offload_dir: str | None, disk_masters: DiskMasters | None) -> DiskTier:
    directory = offload_dir or tempfile.gettempdir()
    on_disk = {s.index: [store.home[p] for p in s.params] for s in stages if s.placement.step.states is Tier.DISK}
    in_backward = frozenset(s.index for s in stages if s.placement.kind == "backward")
    stepped = {s: ps for s, ps in ((s.index, s.params) for s in stages if s.placement.step.states is Tier.DISK
                                   and s.placement.device_stepped) if s not in in_backward}
    states = DiskStates(optimizer, on_disk, directory, pinned, always_fresh=frozenset(stepped), ahead=frozenset(stepped),
                        ring=frozenset(on_disk) & in_backward, masters=disk_masters,
                        names={s.index: s.params for s in stages}) if on_disk else None
    if states is not None:  # NOTE: [Masters on disk] in solver/disk_model.py
        store.staged = states.staged
    outputs = [s for s in stages if s.placement.outputs is Outputs.DISK]
    outputs_on_disk = {s.index for s in outputs}
    reloads = [e.stage for e in module.EVENTS if e.kind is Kind.RELOAD and e.stage in outputs_on_disk]
    acts = DiskActivations(outputs, reloads, directory, pinned) if outputs else None
    dstep = [b.bytes for b in module.BUFFERS if b.name == "dstep"] if stepped else []
    slack = OPT_SLACK * 2  # one tensor's weights and optimizer slot at a time
    slot = torch.empty(dstep[0] + slack, dtype=torch.uint8, device=device) if dstep else None
    return DiskTier(states, acts, stepped, in_backward, slot)
