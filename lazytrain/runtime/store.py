"""Where parameters live while a schedule runs: fp32 masters, compute copies, weight slots.

NOTE: [Parameter homes]
Every parameter has a *master* (the model's own tensor: fp32, or bf16 with `--master-weights
bf16`; on the host, or on the GPU for a resident stage: NOTE: [Resident masters on the device] in
solver/step_model.py), a *work* tensor the
stage functions compute with (in the schedule's dtype, on the compute device), and a *home*: the
tensor its optimizer updates (in the master's dtype).
  - resident stage: work is a persistent device tensor; home is the master itself, on the device
    (where the master stays on the host, sharded state, a copy in the master's dtype beside work);
    work *is* the master when it is in the compute dtype, else a compute-dtype copy of it.
  - streamed stage: work is a persistent leaf whose storage is a view into a weight *slot* while the
    stage is prefetched, and empty otherwise (NOTE: [Streamed weights] in replay.py); home is the
    master on the host (or its region of the offload file, mapped, where the plan keeps it on disk:
    NOTE: [Masters on disk] in solver/disk_model.py), stepped by the CPU optimizer or a GPU step's
    device twins; `source` is what
    PREFETCH copies from: the master (fp32 with 16-bit compute: cast on the device, NOTE: [Weights
    from the master] in solver/footprint.py), or a pinned copy in the compute dtype that each step
    refreshes.
NOTE: [Slots]
Weight slots (`w:S`) and optimizer slots (`opt:S`) come from PyTorch's caching allocator, from the
compute stream's pool, at their PREFETCH and go back at their FREE: slots and activations share one
pool exactly as the plan's windows count them, and after the first step the allocator serves them
from its cache. (A static arena holds optimizer slots through backward as well: measured on the
7B bench at 24 GiB, it put the peak 6 GiB over the budget.) H2D, which fills a slot, waits for
the compute work issued before it was made. Memory that D2H reads (slots, gradients, offloaded
activations) is not `record_stream`ed: its FREE event runs on the compute stream and waits for the
copy, so the allocator reuses it at once in compute order. (Recorded streams defer the reuse
instead, and the pool grows: 62 GiB reserved for 21 GiB allocated on that bench.)
"""

from __future__ import annotations

import torch

from lazytrain.runtime.carve import itemsize
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.sizes import aligned

OPT_SLACK = 16 << 10


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# NOTE: [Masters built in place] A resident parameter's master lives on the compute device for the
# whole run (its home: NOTE: [Parameter homes]). Loaded into host memory first, a 72B model's
# resident masters alone would outgrow a 125 GiB host before `bind` moved them: so `lazytrain
# train` loads each resident master straight onto the device, one tensor at a time, and only the
# streamed masters, which live on the host anyway, go through host memory. Not with sharded state,
# whose pieces are cut from host masters (NOTE: [Sharded state] in sharding.py). Bind then runs on
# the indexed device ("cuda:0", not "cuda"), so that such a master is its home, not copied again.
def streamed_params(module) -> set[str]:
    """The placeholders of a schedule's streamed stages' parameters."""
    return {p for s in module.STAGES if s.placement.streamed for p in s.params}


def resident_targets(module) -> set[str]:
    """The model's names of the parameters whose masters a schedule keeps on the compute device:
    those of resident stages, and the shared weights (NOTE: [Masters built in place])."""
    streamed = streamed_params(module)
    return {target for p, (kind, target, *_) in module.PLACEHOLDERS.items() if kind == "param" and p not in streamed}


class ParamStore:
    def __init__(self, module, tensors: dict[str, torch.Tensor], device: torch.device, pinned: PinnedArena,
                 layouts: dict | None = None, pieces: dict[str, torch.Tensor] | None = None, disk_masters=None,
                 held: dict[str, torch.Tensor] | None = None):
        self.device, self.pinned = device, pinned
        self.layouts = layouts or {}  # stage (-1: shared) -> ShardLayout, with sharded state
        self.layout_of = {p: lay for lay in self.layouts.values() for p in lay.numel}
        self.separate: set[str] = set()  # sharded: masters kept apart from the weights (mixed precision)
        # NOTE: [Sharded host weights] in host_weights.py: the prefetch copy is this rank's piece alone
        self.held = frozenset(held or ())
        self.cuda = device.type == "cuda"
        self.master = {p: t for p, t in tensors.items() if module.PLACEHOLDERS[p][0] == "param"}
        self.buffers = {p: t.to(device) for p, t in tensors.items() if module.PLACEHOLDERS[p][0] == "buffer"}
        self.dtype = {p: _dtype(module.PLACEHOLDERS[p][3]) for p in self.master}
        self.work: dict[str, torch.Tensor] = {}
        self.home: dict[str, torch.Tensor] = {}
        self.source: dict[str, torch.Tensor] = {}
        # masters on disk, while their stage's step in backward holds them in a ring buffer: name ->
        # that tensor (NOTE: [Masters on disk] in solver/disk_model.py; runtime/disk_states.py fills it)
        self.staged: dict[str, torch.Tensor] = {}
        streamed = streamed_params(module)
        # NOTE: [Weights from the master] in solver/footprint.py: prefetched through the slot's staging region
        self.from_master = {p for s in module.STAGES if s.from_master for p in s.params}
        # NOTE: [Resident weights cast on use] in solver/footprint.py: no compute copy between uses
        self.cast = {p for s in module.STAGES if s.placement.weights.cast_on_use for p in s.params}
        for p, master in self.master.items():
            if p in streamed:
                self.work[p] = torch.nn.Parameter(torch.empty(0, device=device, dtype=self.dtype[p]))
                self.home[p] = master
                same = master.dtype == self.dtype[p] and (not self.cuda or master.is_pinned()) or p in self.from_master
                if p in self.held:  # page-locked already (host_weights.hold)
                    self.source[p] = held[p]
                else:
                    self.source[p] = master.detach() if same else self._host_copy(master, self.dtype[p])
                if disk_masters is not None and p in disk_masters:  # NOTE: [Masters on disk] in solver/disk_model.py
                    disk_masters.adopt(p, master)  # now that its copy is made: one tensor at a time
            elif master.device == device and master.dtype == self.dtype[p]:
                self.work[p] = self.home[p] = master
            elif p in self.cast:  # the master is its home; the weights come into a slot before each use
                self.work[p] = torch.nn.Parameter(torch.empty(0, device=device, dtype=self.dtype[p]))
                self.home[p] = master if master.device == device else torch.nn.Parameter(
                    master.detach().to(device, copy=True))
            else:
                self.work[p] = torch.nn.Parameter(master.detach().to(device, self.dtype[p], copy=True))
                if master.device == device:
                    self.home[p] = master
                elif self.dtype[p] == master.dtype:  # fp32 compute, or bf16 masters
                    self.home[p] = self.work[p]
                else:
                    self.home[p] = torch.nn.Parameter(master.detach().to(device, master.dtype, copy=True))
        self.streamed = streamed
        if self.layouts:
            self._shard_homes(pieces or {})
        self._plan_slots(module)

    def _shard_homes(self, pieces: dict[str, torch.Tensor]) -> None:
        """NOTE: [Sharded state] in sharding.py: each home becomes this rank's piece, where its step
        runs: a view of the full weights (the master dtype is the compute dtype), or the piece of
        the mixed-precision master alone."""
        for p, lay in self.layout_of.items():
            streamed = p in self.streamed
            if p in pieces:
                piece = pieces[p]
                self.home[p] = self.pinned.copy_of(piece) if streamed else piece.to(self.device, copy=True)
                self.separate.add(p)
            else:
                self.home[p] = self.source_piece(p) if streamed else lay.own(p, self.work[p].detach())

    def offset(self, p: str) -> int:
        """Where the home's first element sits in its whole parameter (0 without sharding)."""
        return self.layout_of[p].span(p)[0] if p in self.layout_of else 0

    def source_piece(self, p: str) -> torch.Tensor:
        """This rank's piece of `p`'s prefetch copy: all of it with sharded host weights."""
        return self.source[p] if p in self.held else self.mine(p, self.source[p])

    def mine(self, p: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor of `p` (the whole of it without sharding)."""
        return self.layout_of[p].own(p, full) if p in self.layout_of else full

    def _host_copy(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.pinned.empty(master.shape, dtype).copy_(master.detach())

    def _plan_slots(self, module) -> None:
        """Sizes of the weight slots (per stage, its parameters in the compute dtype) and optimizer
        slots (the schedule's `opt:S` bytes); NOTE: [Slots]."""
        self.layout: dict[int, dict[str, int]] = {}
        self.staging_at: dict[int, int] = {}  # a stage's staging region's offset in its weight slot
        self.slot_sizes: dict[str, int] = {}
        for s in module.STAGES:
            if s.placement.streamed or s.placement.weights.cast_on_use:
                offset, layout = 0, {}
                for p in s.params:
                    layout[p] = offset
                    offset += aligned(self.master[p].numel() * itemsize(self.dtype[p]))
                if s.from_master:  # NOTE: [Weights from the master]: its largest tensor in fp32
                    self.staging_at[s.index] = offset
                    offset += aligned(max(self.master[p].numel() for p in s.params) * itemsize(torch.float32))
                self.layout[s.index] = layout
                self.slot_sizes[f"w:{s.index}"] = offset
        # the slack covers per-tensor alignment and the optimizer's small extras (8-bit quantisation
        # maps, absmax rounding)
        for b in module.BUFFERS:
            if b.name.startswith("opt:"):
                self.slot_sizes[b.name] = b.bytes + OPT_SLACK * len(module.STAGES[int(b.name[4:])].params)
        self.slots: dict[str, torch.Tensor] = {}
        live = peak = 0  # the most slot memory the schedule has live at once
        for e in module.EVENTS:
            live += sum(self.slot_sizes.get(a, 0) for a in e.allocs)
            peak = max(peak, live)
            live -= sum(self.slot_sizes.get(f, 0) for f in e.frees)
        self.slot_bytes = peak

    def take_slot(self, name: str, make) -> torch.Tensor:
        self.slots[name] = make(self.slot_sizes[name])
        return self.slots[name]

    def release_slot(self, name: str) -> None:
        del self.slots[name]

    def slot_view(self, stage: int, p: str) -> torch.Tensor:
        buf = self.slots[f"w:{stage}"]
        nbytes = self.master[p].numel() * itemsize(self.dtype[p])
        start = self.layout[stage][p]
        return buf[start:start + nbytes].view(self.dtype[p]).view(self.master[p].shape)

    def staging(self, stage: int, p: str) -> torch.Tensor:
        """Where `p`'s fp32 master lands before its cast into the weights (NOTE: [Weights from the
        master] in solver/footprint.py): the start of the slot's staging region, shared by its tensors
        in turn."""
        start = self.staging_at[stage]
        nbytes = self.master[p].numel() * itemsize(torch.float32)
        return self.slots[f"w:{stage}"][start:start + nbytes].view(torch.float32).view(self.master[p].shape)

    def source_is_master(self, p: str) -> bool:
        """Prefetches read the master itself (same dtype, page-locked where needed), or with sharded
        host weights this rank's piece of it, which is its home (NOTE: [Sharded host weights])."""
        if p in self.held:
            return p not in self.separate
        return self.source[p].data_ptr() == self.master[p].data_ptr()

    def refresh_source(self, names) -> None:
        """After a host optimizer step: the prefetch copies of updated masters (sharded: of this
        rank's piece; the rest comes from the other ranks at the next prefetch)."""
        for p in names:
            if p in self.separate:
                self.source_piece(p).copy_(self.home[p])
            elif p not in self.layout_of and not self.source_is_master(p):
                self.source[p].copy_(self.master[p].detach())

    def refresh_work(self, names) -> None:
        """After a device optimizer step: compute copies of updated homes (sharded: of this rank's
        piece, which the GATHER then sends to the other ranks)."""
        with torch.no_grad():
            for p in names:
                if p in self.separate:
                    self.mine(p, self.work[p].detach()).copy_(self.home[p])
                elif p not in self.layout_of and self.work[p] is not self.home[p] and p not in self.cast:
                    self.work[p].copy_(self.home[p])
