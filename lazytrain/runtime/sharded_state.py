"""The trainer's optimizer state as DTensors, for torch.distributed.checkpoint: `ShardedCheckpoint`,
the part of `Trainer` behind its `sharded_state_dict()` and `load_sharded_state_dict()`.

NOTE: [Sharded checkpoints]
`sharded_state_dict()` gives, per model parameter (by its name in the model), its master weights
and AdamW moments as DTensors of the whole flattened parameter on a 1-D DeviceMesh of the trainer's
process group: `Shard(0)` with sharded state (each rank's local tensor is its piece, NOTE: [Sharded
state] in sharding.py: torch.chunk's cut, which is `Shard(0)`'s), `Replicate()` otherwise; the step
count as a plain tensor, and each group's hyperparameters. torch.distributed.checkpoint saves each
rank's pieces and, loading into the state dict of a trainer on another number of ranks, reads each
rank's new pieces from whichever files hold them. `load_sharded_state_dict(sd)` copies the loaded
values in, rebuilds the full weights from the masters (a GATHER per stage: a collective) and lands
them in the model. In one process without torch.distributed, the entries are plain tensors (DCP
saves and loads those without a process group). Both calls are collectives: every rank makes them.
An entry may also be loaded whole (a plain tensor of the full flattened parameter, as one process
saves it, or read whole from any checkpoint): each rank takes its own piece of it.
`whole_state(optimizer_state, model_state)` turns torch.optim's format (one process's
`state_dict()`, by parameter index) into these entries, whole, for a trainer on any number of ranks.
Sharded 8-bit states are refused, saving and loading (`_refuse_blocks`): their pieces are whole
quantisation blocks, not torch.chunk's cut (a rank's piece of a 4640-element embedding at 2 ranks:
2560 elements, where `Shard(0)` says 2320), and their moments are bitsandbytes' quantised bytes and
absmax vectors, which these entries do not hold. Replicated 8-bit states checkpoint as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lazytrain.errors import CheckpointError
from lazytrain.runtime.optim import PER_PARAMETER

_MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedCheckpoint:
    """`state_dict()` and `load()` of NOTE: [Sharded checkpoints], over the optimizer's groups."""

    def __init__(self, groups, placeholders: dict, store, optimizer, dp, device: torch.device, sharded: bool):
        self.groups, self.placeholders, self.store, self.optimizer = groups, placeholders, store, optimizer
        self.dp, self.device, self.sharded = dp, device, sharded

    def _mesh(self):
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed.device_mesh import DeviceMesh

        group = self.dp.group if self.dp is not None else dist.group.WORLD
        return DeviceMesh.from_group(group, self.device.type)

    def _entries(self):
        """(name in the model, placeholder, group index, home) of every parameter the optimizer steps."""
        for s in self.groups.order:
            for p in self.groups.names(s):
                yield self.placeholders[p][1], p, self.groups.index(s), self.store.home[p]

    def _state_of(self, group: int, home: torch.Tensor) -> dict:
        """The optimizer's state of `home`, made as its first step would (zeroed) if it has none yet."""
        state = self.optimizer.state.get(home)
        if not state:
            state = self.optimizer.fresh_state(group, home, lambda shape, dtype: torch.empty(
                shape, dtype=dtype, device=home.device))
            self.optimizer.state[home] = state
        return state

    def _refuse_blocks(self) -> None:
        """Sharded 8-bit states are cut on quantisation blocks, not torch.chunk's cut (NOTE: [Sharded
        state] in sharding.py): a `Shard(0)` DTensor would place each rank's piece at the wrong
        offset, and the entries here hold no quantised moments. Refused rather than saved wrong."""
        if self.sharded and any(lay.align > 1 for lay in self.store.layouts.values()):
            raise CheckpointError(
                "this schedule shards 8-bit optimizer states over the ranks, in pieces of whole quantisation blocks, "
                "which lazytrain's distributed checkpoints cannot save or load yet (they hold AdamW's 32-bit moments "
                "in torch.chunk's cut). To checkpoint, recompile with --replicate-state (shard_state=False) to keep "
                "the 8-bit states whole on every rank, or with --optimizer-states 32bit to shard 32-bit states")

    def state_dict(self) -> dict:
        """NOTE: [Sharded checkpoints]. The trainer has finished every optimizer step first."""
        self._refuse_blocks()
        mesh = self._mesh()
        state = {}
        for name, p, group, home in self._entries():
            numel = self.store.master[p].numel()
            own = self._state_of(group, home)
            entry = {"master": self._dtensor(home, numel, mesh)}
            entry.update({k: self._dtensor(own[k], numel, mesh) for k in _MOMENTS if k in own})
            entry["step"] = own["step"] if torch.is_tensor(own["step"]) else torch.tensor(float(own["step"]))
            state[name] = entry
        groups = [{k: v for k, v in g.items() if k != "params" and k not in PER_PARAMETER} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def _dtensor(self, t: torch.Tensor, numel: int, mesh):
        flat = t.detach().reshape(-1)
        if mesh is None:
            return flat
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placement = Shard(0) if self.sharded else Replicate()
        return DTensor.from_local(flat, mesh, [placement], run_check=False, shape=torch.Size([numel]), stride=(1,))

    def load(self, sd: dict) -> None:
        """Load what `state_dict()` gave (here, or filled by torch.distributed.checkpoint from a save on
        any number of ranks) into the masters and states. The trainer has finished every optimizer
        step first, and rebuilds the weights from the masters after."""
        self._refuse_blocks()
        with torch.no_grad():
            for name, p, group, home in self._entries():
                entry = sd["state"][name]
                piece = lambda t: self._piece(p, _local(t), home)  # noqa: E731
                home.copy_(piece(entry["master"]).view(home.shape))
                own = self._state_of(group, home)
                for k in _MOMENTS:
                    if k in own:
                        own[k].copy_(piece(entry[k]).view(own[k].shape))
                if torch.is_tensor(own["step"]):
                    own["step"].copy_(entry["step"])
                else:
                    own["step"] = float(entry["step"])
        for g, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params" and k not in PER_PARAMETER})
        self.optimizer._sr_steps = {}  # bf16 masters' noise counters: read again from the loaded steps

    def _piece(self, p: str, t: torch.Tensor, home: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `t`: `t` itself when it is one, else cut from the whole parameter."""
        if t.numel() == home.numel() or not self.sharded:
            return t
        return self.store.mine(p, t.reshape(-1))

    def whole_state(self, optimizer_state: dict, model_state: dict) -> dict:
        """`load_sharded_state_dict`'s entries, whole, from torch.optim's format of a trainer of the same
        schedule's stages (one process, or ranks with replicated state) and the model's weights (the
        masters). Raises ValueError where the groups do not match this trainer's."""
        saved = optimizer_state["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"{len(saved)} parameter groups saved, this trainer has {len(self.optimizer.param_groups)}")
        state = {}
        for s in self.groups.order:
            names, group = self.groups.names(s), self.groups.index(s)
            indices = saved[group]["params"]
            if len(indices) != len(names):
                raise ValueError(f"group {group} saved {len(indices)} parameters, this trainer steps {len(names)} there")
            for p, index in zip(names, indices):
                name = self.placeholders[p][1]
                entry = {"master": model_state[name].reshape(-1)}
                own = optimizer_state["state"].get(index, {})
                entry.update({k: own[k].reshape(-1) for k in _MOMENTS if k in own})
                for k in _MOMENTS:  # never stepped: a first step's zeroed moments (fp32, as AdamW's)
                    entry.setdefault(k, torch.zeros(self.store.master[p].numel()))
                step = own.get("step", 0.0)
                entry["step"] = step if torch.is_tensor(step) else torch.tensor(float(step))
                state[name] = entry
        return {"state": state, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in saved]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t
