"""AdamW stepped one stage at a time, with the arithmetic of the optimizer it wraps.

The schedule runs each stage's optimizer step as soon as that stage's gradients are complete (an
OPT_STEP event), some on the CPU worker thread while others run on the main thread, so the
optimizer has one parameter group per stage and `step_group(i)` steps group i alone. It does so
through a per-group view of the optimizer that shares the group's dict (so LR schedulers reach it)
and the state dict (so `state_dict()` sees everything), and never mutates shared structure, so steps
of different groups may run concurrently.

Two precisions of state: "32bit" wraps `torch.optim.AdamW`; "8bit" wraps bitsandbytes'
`AdamW8bit` (blockwise-quantised moments; imported only when asked for).
"""

from __future__ import annotations

import torch


class _Staged:
    """Mixin over an optimizer class: per-group steps through views."""

    def _make_views(self) -> list:
        views = []
        for group in self.param_groups:
            view = type(self).__mro__[2].__new__(type(self).__mro__[2])
            # hooks and defaults as the parent's; not an instance-level `step` (LR schedulers patch one in)
            view.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_views", "step")})
            view.param_groups = [group]
            view.state = self.state
            views.append(view)
        return views

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views = self._make_views()

    def step_group(self, index: int) -> None:
        # the parent's instance `step` (LR schedulers wrap it to count calls) is not run here
        self._opt_called = True
        self._views[index].step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._views = self._make_views()


class StagedAdamW(_Staged, torch.optim.AdamW):
    pass


def staged_optimizer(states: str, groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    if states == "32bit":
        return StagedAdamW(groups, **kwargs)
    if states == "8bit":
        import bitsandbytes as bnb

        class StagedAdamW8bit(_Staged, bnb.optim.AdamW8bit):
            pass

        kwargs.pop("foreach", None)
        for group in groups:
            group.pop("fused", None)
        return StagedAdamW8bit(groups, **kwargs)
    raise ValueError(f"optimizer states {states!r}: use '32bit' or '8bit'")
