"""bitsandbytes' blockwise 8-bit AdamW stepped one stage at a time (`staged_optimizer("8bit", ...)` in
optim.py): its groups marked `"states": "32bit"` (host-stepped stages, NOTE: [State precision per
stage] in solver/formulation.py) step with `torch.optim.AdamW`'s arithmetic, the others with
bitsandbytes', without its device-wide synchronisation. bitsandbytes is imported only here.

A data-parallel rank's piece of a parameter (NOTE: [Sharded state] in sharding.py) is whole
quantisation blocks (`QUANT_BLOCK`), so its 8-bit states are the whole tensor's states there; and it
keeps 8-bit or 32-bit states as its whole parameter would (`WholeSized`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from lazytrain.runtime.optim import _adamw_fresh_state, _Staged, _view, narrowed


def staged_adamw8bit(groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    # fp32 groups step through views of this AdamW (its hooks and defaults; never its params)
    fp32 = torch.optim.AdamW([torch.zeros(1)], **kwargs)
    fp32_attrs = {k: v for k, v in fp32.__dict__.items() if k not in ("param_groups", "state", "step")}

    class WholeSized(bnb.optim.AdamW8bit):
        def get_config(self, gindex, pindex, group):
            """bitsandbytes' configuration of a parameter. It keeps 32-bit states for a tensor
            below `min_8bit_size` elements, judged by the tensor it is given: a rank's piece of a
            parameter (NOTE: [Sharded state] in sharding.py) is judged by its whole parameter's
            size instead, so every rank keeps the states one process would."""
            config = super().get_config(gindex, pindex, group)
            whole = group.get("numels")
            if whole is not None:
                small = whole[pindex] < config["min_8bit_size"]
                config["min_8bit_size"] = group["params"][pindex].numel() + 1 if small else 0
            return config

    class StagedAdamW8bit(_Staged, WholeSized):  # the views (of __mro__[2]) size states as WholeSized does
        def _step(self, view) -> None:
            group = view.param_groups[0]
            if group.get("states") == "32bit":
                _view(torch.optim.AdamW, fp32_attrs, [{**fp32.defaults, **group}], view.state).step()
                return
            # bitsandbytes' own step synchronises the whole device after every parameter, which
            # stalls the copy streams the runtime overlaps with it; this is that step without it.
            _ready(view)
            with torch.no_grad():
                for gindex, group in enumerate(view.param_groups):
                    for pindex, p in enumerate(group["params"]):
                        if p.grad is None:
                            continue
                        if len(view.state[p]) == 0:
                            view.init_state(group, p, gindex, pindex)
                        if p.numel() == 0:  # a rank's empty piece (NOTE: [Sharded state] in sharding.py):
                            view.state[p]["step"] += 1  # its count as the other ranks', no kernel
                            continue
                        view.prefetch_state(p)
                        view.update_step(group, p, gindex, pindex)

        # NOTE: [Shared quantisation maps] bitsandbytes' `init_state` moves the optimizer's shared
        # quantisation maps to the device of the parameter it initialises, then puts them in that
        # parameter's state: the maps follow whichever parameter was initialised last. A disk job
        # (NOTE: [Disk-stepped stages] in solver/disk_model.py) makes a stage's first states for its
        # host master on the host worker while the main thread makes a GPU-stepped stage's on the
        # device; on the H200 the 32B plan with disk-stepped blocks stopped in its first steps with
        # a host map in a device step's state. `fresh_state` initialises on its own copy of the maps.
        def fresh_state(self, index: int, param: torch.Tensor, take, position: int | None = None) -> dict:
            group = self.param_groups[index]
            if group.get("states") == "32bit":
                return _adamw_fresh_state({**fp32.defaults, **group}, param, take)
            # bitsandbytes' own initialisation, its full-size buffers cut by `take`; the
            # absmax vectors (a 64th of the moments) are moved in after it. It runs on a copy
            # of the shared quantisation maps (NOTE: [Shared quantisation maps]).
            view = self._views[index]
            _ready(view)
            state: dict = {}
            init = _view(type(view), {**view.__dict__, "name2qmap": dict(view.name2qmap),
                                      "get_state_buffer": lambda p, dtype=torch.float32:
                                      take(p.shape, dtype).zero_()},
                         [narrowed(group, [param], [self._position(index, param, position)])],
                         defaultdict(dict, {param: state}))
            init.init_state(init.param_groups[0], param, 0, 0)
            for key in ("absmax1", "absmax2"):
                if key in state:
                    state[key] = take(state[key].shape, state[key].dtype).copy_(state[key])
            return state

    def _ready(view) -> None:
        """bitsandbytes' once-per-optimizer set-up before a first step."""
        if not view.initialized:
            view.check_overrides()
            view.to_gpu()
            view.initialized = True

    kwargs.pop("foreach", None)
    for group in groups:
        if group.get("states") != "32bit":
            group.pop("fused", None)
    return StagedAdamW8bit(groups, **kwargs)
