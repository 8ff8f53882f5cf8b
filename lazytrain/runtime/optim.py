"""AdamW stepped one stage at a time, with `torch.optim.AdamW`'s exact arithmetic.

The schedule runs each stage's optimizer step as soon as that stage's gradients are complete (an
OPT_STEP event), some on the CPU worker thread while others run on the main thread, so the
optimizer has one parameter group per stage and `step_group(i)` steps group i alone. It does so
through a per-group AdamW that shares the group's dict (so LR schedulers reach it) and the state
dict (so `state_dict()` sees everything), and never mutates shared structure, so steps of different
groups may run concurrently.
"""

from __future__ import annotations

import torch


class StagedAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views = self._make_views()

    def _make_views(self) -> list[torch.optim.AdamW]:
        views = []
        for group in self.param_groups:
            view = torch.optim.AdamW.__new__(torch.optim.AdamW)
            view.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_views"})  # hooks, defaults
            view.param_groups = [group]
            view.state = self.state
            views.append(view)
        return views

    def step_group(self, index: int) -> None:
        # the parent's instance `step` (LR schedulers wrap it to count calls) is not run here
        self._opt_called = True
        self._views[index].step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._views = self._make_views()
