"""Where parameters live while a schedule runs: fp32 masters, compute copies, weight slots.

NOTE: [Parameter homes]
Every parameter has a *master* (the model's own fp32 tensor, on the host), a *work* tensor the
stage functions compute with (in the schedule's dtype, on the compute device), and a *home*: the
fp32 tensor its optimizer updates.
  - resident stage: work is a persistent device tensor; home is the master when work *is* the
    master (CPU, fp32), else an fp32 copy beside work on the device (the GPU optimizer step).
  - streamed stage: work is a persistent leaf whose storage is a view into a weight *slot* while the
    stage is prefetched, and empty otherwise (NOTE: [Streamed weights] in trainer.py); home is the
    master on the host, stepped by the CPU optimizer; `source` is what PREFETCH copies from (the
    master, or a pinned copy in the compute dtype that each CPU step refreshes).
Slots are allocated once at bind: as many as the schedule ever has streamed stages live at once,
each as large as the largest streamed stage. Nothing is allocated per step for weights.
"""

from __future__ import annotations

import torch

from lazytrain.ir.events import Kind

_ALIGN = 256


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class ParamStore:
    def __init__(self, module, tensors: dict[str, torch.Tensor], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.master = {p: t for p, t in tensors.items() if module.PLACEHOLDERS[p][0] == "param"}
        self.buffers = {p: t.to(device) for p, t in tensors.items() if module.PLACEHOLDERS[p][0] == "buffer"}
        self.dtype = {p: _dtype(module.PLACEHOLDERS[p][3]) for p in self.master}
        self.work: dict[str, torch.Tensor] = {}
        self.home: dict[str, torch.Tensor] = {}
        self.source: dict[str, torch.Tensor] = {}
        streamed = {p for s in module.STAGES if s.stream for p in s.params}
        for p, master in self.master.items():
            if p in streamed:
                self.work[p] = torch.nn.Parameter(torch.empty(0, device=device, dtype=self.dtype[p]))
                self.home[p] = master
                same = master.dtype == self.dtype[p] and (not self.cuda or master.is_pinned())
                self.source[p] = master.detach() if same else self._host_copy(master, self.dtype[p])
            elif master.device == device and master.dtype == self.dtype[p]:
                self.work[p] = self.home[p] = master
            else:
                self.work[p] = torch.nn.Parameter(master.detach().to(device, self.dtype[p], copy=True))
                if master.device == device:
                    self.home[p] = master
                elif self.dtype[p] == torch.float32:
                    self.home[p] = self.work[p]
                else:
                    self.home[p] = torch.nn.Parameter(master.detach().to(device, torch.float32, copy=True))
        self._plan_slots(module)

    def _host_copy(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(master.shape, dtype=dtype, pin_memory=self.cuda)
        out.copy_(master.detach())
        return out

    def _plan_slots(self, module) -> None:
        """Replay the schedule's PREFETCH/FREE of weight buffers to size the slot pool."""
        self.layout: dict[int, dict[str, int]] = {}
        size = 0
        for s in module.STAGES:
            if s.stream:
                offset, layout = 0, {}
                for p in s.params:
                    layout[p] = offset
                    nbytes = self.master[p].numel() * torch.empty(0, dtype=self.dtype[p]).element_size()
                    offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
                self.layout[s.index] = layout
                size = max(size, offset)
        live, peak = 0, 0
        for e in module.EVENTS:
            if e.kind is Kind.PREFETCH:
                live += 1
                peak = max(peak, live)
            elif e.kind is Kind.FREE and e.frees[0].startswith("w:"):
                live -= 1
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(peak)]
        self.free_slots = list(range(peak))
        self.slot_of: dict[int, int] = {}
        self.slot_bytes = size * peak

    def take_slot(self, stage: int) -> int:
        slot = self.free_slots.pop(0)
        self.slot_of[stage] = slot
        return slot

    def release_slot(self, stage: int) -> int:
        slot = self.slot_of.pop(stage)
        self.free_slots.append(slot)
        return slot

    def slot_view(self, stage: int, p: str) -> torch.Tensor:
        buf = self.slots[self.slot_of[stage]]
        t = self.master[p]
        nbytes = t.numel() * torch.empty(0, dtype=self.dtype[p]).element_size()
        start = self.layout[stage][p]
        return buf[start:start + nbytes].view(self.dtype[p]).view(t.shape)

    def refresh_source(self, names) -> None:
        """After a host optimizer step: the prefetch copies of updated masters."""
        for p in names:
            if self.source[p] is not self.master[p] and self.source[p].data_ptr() != self.master[p].data_ptr():
                self.source[p].copy_(self.master[p].detach())

    def refresh_work(self, names) -> None:
        """After a device optimizer step: compute copies of updated fp32 homes."""
        with torch.no_grad():
            for p in names:
                if self.work[p] is not self.home[p]:
                    self.work[p].copy_(self.home[p])

    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.source.values() if t.is_pinned())
