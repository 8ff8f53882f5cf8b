"""The runtime: replay a schedule's events to run forward, backward and the optimizer.

On the CPU (and in this first runtime on any device) events run one after another in schedule
order, which is a valid order for every stream; the semantics are those a multi-stream GPU run must
reproduce. Each event touches only the buffers it names, so a wrong schedule fails loudly here
instead of computing something else.

NOTE: [Streamed weights]
A streamed stage's parameters are persistent leaf tensors whose storage comes and goes: PREFETCH
sets `leaf.data` to a fresh copy of the master weights, FREE swaps in an empty tensor. Autograd saved
the leaf itself during forward, so backward (after the next PREFETCH) sees the same leaf with its
data back, and gradients accumulate on it, whatever the stage's recompute mode. Swapping `.data`
does not bump the version counter, so autograd accepts it.
"""

from __future__ import annotations

import time
from types import ModuleType

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Event, Kind, Phase
from lazytrain.runtime.optim import StagedAdamW

_EMPTY = torch.empty(0)


def _fmt(shape, dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


class Trainer:
    """`schedule.bind(model, lr=...)` returns one. `forward_backward(batch)` leaves each parameter's
    gradient in `.grad`; `step(batch)` also applies AdamW. `optimizer` is a `torch.optim.Optimizer`
    (LR schedulers attach to it), and `state_dict()` / `load_state_dict()` save and restore it."""

    def __init__(self, module: ModuleType, model: torch.nn.Module, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, foreach=None):
        self.m = module
        self.model = model
        self.stages = module.STAGES
        self.events: tuple[Event, ...] = module.EVENTS
        self._bind_tensors(model)
        self.device = next(iter(self.tensors.values())).device
        self.leaves = {  # see NOTE: [Streamed weights]
            s.index: {p: torch.nn.Parameter(_EMPTY.to(self.device, self.tensors[p].dtype)) for p in s.params}
            for s in self.stages if s.stream
        }
        groups = [{"params": [self.tensors[p] for p in s.params]} for s in self.stages]
        groups.append({"params": [self.tensors[p] for p in module.SHARED]})
        self.optimizer = StagedAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        self.record_timeline = False  # set True to time every event of each step
        self.timeline: list[tuple[int, float, float]] = []  # (event id, start s, end s) of the last step

    # ---- binding checks -----------------------------------------------------------------------
    def _bind_tensors(self, model):
        found = dict(model.named_parameters(remove_duplicate=False))  # tied weights answer to every name
        found.update(dict(model.named_buffers(remove_duplicate=False)))
        self.tensors: dict[str, torch.Tensor] = {}
        problems = []
        for name, (kind, target, shape, dtype) in self.m.PLACEHOLDERS.items():
            if kind == "input":
                continue
            t = found.get(target)
            if t is None:
                problems.append(f"it has no {kind} {target}")
            elif tuple(t.shape) != tuple(shape) or str(t.dtype).removeprefix("torch.") != dtype:
                problems.append(f"{target} is {_fmt(t.shape, t.dtype)}, compiled for {_fmt(shape, dtype)}")
            elif t.device.type == "meta":
                problems.append(f"{target} is on the meta device; load or initialise the weights first")
            else:
                self.tensors[name] = t
        bound = {id(t) for t in self.tensors.values()}
        extra = [n for n, p in model.named_parameters() if id(p) not in bound and p.requires_grad]
        if extra:
            problems.append(f"it has parameters the schedule does not know: {', '.join(extra[:3])}")
        if problems:
            raise ScheduleMismatch(
                f"schedule {self.m.SOURCE or ''} (fingerprint {self.m.FINGERPRINT}) does not fit this model: "
                + "; ".join(problems[:4]) + ". Recompile the schedule for this model with `lazytrain compile`")

    def _check_batch(self, batch: dict) -> dict:
        if set(batch) != set(self.m.BATCH):
            raise ScheduleMismatch(f"batch has inputs {sorted(batch)}, the schedule was compiled for {sorted(self.m.BATCH)}")
        for name, (shape, dtype) in self.m.BATCH.items():
            t = batch[name]
            if tuple(t.shape) != tuple(shape) or str(t.dtype).removeprefix("torch.") != dtype:
                raise ScheduleMismatch(
                    f"batch input {name} is {_fmt(t.shape, t.dtype)} but the schedule was compiled for "
                    f"{_fmt(shape, dtype)}; recompile with example_batch() returning that shape")
        return {k: v.to(self.device) for k, v in batch.items()}

    # ---- public API ---------------------------------------------------------------------------
    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Loss of `batch`; gradients accumulate into `.grad` as `loss.backward()` would."""
        return self._run(batch, optimize=False)

    def step(self, batch: dict) -> torch.Tensor:
        """One training step: fresh gradients, forward, backward, AdamW. Returns the loss."""
        self.zero_grad()
        return self._run(batch, optimize=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    # ---- replay -------------------------------------------------------------------------------
    def _run(self, batch: dict, optimize: bool) -> torch.Tensor:
        self.env = dict(self._check_batch(batch))  # placeholder/activation name -> tensor
        self.grads: dict[str, torch.Tensor] = {}
        self.saved: dict[int, tuple] = {}
        self.host: dict[str, torch.Tensor] = {}
        self.gbuf: dict[int, dict[str, torch.Tensor]] = {}
        self.loss = None
        handlers = {
            Kind.PREFETCH: self._prefetch, Kind.COMPUTE: self._compute, Kind.OFFLOAD: self._offload,
            Kind.RELOAD: self._reload, Kind.FREE: self._free,
            Kind.OPT_STEP: self._opt_step if optimize else (lambda e: None),
        }
        if self.record_timeline:
            self.timeline = []
            clock, t0 = time.perf_counter, time.perf_counter()
            for event in self.events:
                start = clock() - t0
                handlers[event.kind](event)
                self.timeline.append((event.id, start, clock() - t0))
        else:
            for event in self.events:
                handlers[event.kind](event)
        loss, self.loss = self.loss, None
        self.env = self.grads = self.saved = self.host = self.gbuf = None
        return loss

    def _weight(self, stage, name):
        if stage.stream and name in self.leaves[stage.index]:
            return self.leaves[stage.index][name]
        return self.tensors.get(name, None) if name in self.tensors else self.env[name]

    def _call(self, stage, grad: bool):
        """Run a stage's forward. With `grad`, inputs become fresh leaves and autograd records."""
        if grad:
            leaves = {x: self.env[x].detach().requires_grad_(x in stage.grad_inputs) for x in stage.inputs}
            args = [self._weight(stage, p) for p in stage.placeholders] + [leaves[x] for x in stage.inputs]
            with torch.enable_grad():
                outs = stage.fn(self.device, *args)
            return leaves, outs
        args = [self._weight(stage, p) for p in stage.placeholders] + [self.env[x] for x in stage.inputs]
        with torch.no_grad():
            return None, stage.fn(self.device, *args)

    def _publish(self, stage, outs):
        for name, t in zip(stage.outputs, outs):
            if name == self.m.LOSS:
                self.loss = t.detach()
            else:
                self.env[name] = t.detach()

    def _compute(self, e: Event):
        stage = self.stages[e.stage]
        if e.phase is Phase.FWD:
            leaves, outs = self._call(stage, grad=not stage.recompute)
            if not stage.recompute:
                self.saved[e.stage] = (leaves, outs)
            self._publish(stage, outs)
        elif e.phase is Phase.RECOMPUTE:
            self._publish(stage, self._call(stage, grad=False)[1])
        else:
            self._backward(stage)

    def _backward(self, stage):
        leaves, outs = self.saved.pop(stage.index) if not stage.recompute else self._call(stage, grad=True)
        tensors, grads = [], []
        for name, t in zip(stage.outputs, outs):
            g = torch.ones_like(t) if name == self.m.LOSS else self.grads.get(name)
            if g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for x in stage.grad_inputs:
            g = leaves[x].grad
            if g is not None:
                self.grads[x] = g if x not in self.grads else self.grads[x] + g
        if stage.stream:  # gradients of streamed weights wait in g:S for their offload
            self.gbuf[stage.index] = {p: leaf.grad for p, leaf in self.leaves[stage.index].items()}
            for leaf in self.leaves[stage.index].values():
                leaf.grad = None

    def _prefetch(self, e: Event):
        with torch.no_grad():
            for name, leaf in self.leaves[e.stage].items():
                leaf.data = self.tensors[name].detach().to(self.device, copy=True)

    def _offload(self, e: Event):
        buf = e.reads[0]
        if buf.startswith("g:"):  # gradients of streamed weights accumulate into the master's .grad
            for name, g in self.gbuf[e.stage].items():
                if g is None:
                    continue
                master = self.tensors[name]
                g = g.to(master.device, copy=True)
                master.grad = g if master.grad is None else master.grad + g
        else:
            for name in self.stages[e.stage].outputs:
                if name in self.env:
                    self.host[name] = self.env[name].to("cpu", copy=True)

    def _reload(self, e: Event):
        for name in self.stages[e.stage].outputs:
            if name in self.host:
                self.env[name] = self.host.pop(name).to(self.device)

    def _free(self, e: Event):
        kind, _, idx = e.frees[0].partition(":")
        stage = self.stages[int(idx)] if idx.lstrip("-").isdigit() else None
        if kind == "w":
            for leaf in self.leaves[stage.index].values():
                leaf.data = _EMPTY.to(self.device, leaf.dtype)
        elif kind == "g":
            self.gbuf.pop(stage.index, None)
        elif kind == "act":
            for name in stage.outputs:
                self.env.pop(name, None)
        elif kind == "saved":
            self.saved.pop(stage.index, None)
        elif kind == "grad":
            for name in stage.outputs:
                self.grads.pop(name, None)

    def _opt_step(self, e: Event):
        self.optimizer.step_group(e.stage if e.stage >= 0 else len(self.stages))
