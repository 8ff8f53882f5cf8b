"""AdamW stepped one stage at a time, with `torch.optim.AdamW`'s exact arithmetic.

The schedule runs each stage's optimizer step as soon as that stage's gradients are complete (an
OPT_STEP event), so the optimizer has one parameter group per stage. `step_group(i)` runs AdamW's
own `step()` on group i alone; state lives in the usual per-parameter `state`, so `state_dict()`,
`load_state_dict()` and LR schedulers behave as with a plain `torch.optim.AdamW`.
"""

from __future__ import annotations

import torch


class StagedAdamW(torch.optim.AdamW):
    def step_group(self, index: int) -> None:
        groups = self.param_groups
        try:
            self.param_groups = [groups[index]]
            self.step()  # the instance's step: LR schedulers wrap it to count calls
        finally:
            self.param_groups = groups
