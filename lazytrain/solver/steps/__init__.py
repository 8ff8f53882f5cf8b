"""The optimizer step's kinds on the planner's side: one registered rule per kind (`RULES`, keyed by
`Step.kind`), each in a module of its own.

A kind's rule (`base.StepRule`) supplies
  - its MIP terms: `indicator`, the linear expression over the binaries of `formulation._vars` that is 1
    where a stage takes the kind, and the hooks the step model (solver/step_model.py) calls with it
    for every stage: its device memory, transfers, device, host and disk seconds and host bytes;
  - the predicted seconds of its OPT_STEP event (`step_seconds`, for pass `lower`'s durations);
  - its buffers and events in pass `lower` (passes/lower.py): hooks called at fixed points of the
    forward and backward walk with the walk's `Lowering` context.
What every kind shares stays in the walks: a stage's internals and outputs, a streamed stage's
weight slot and its prefetch traffic (with the master's tier, `mdisk`, and whether a device step's
prefetch reads the master), and the sharded data-parallel paths.

A new kind touches, besides a module here (imported below, in `KINDS` order): its shape in
ir/placement.py (`KINDS`, a named constructor on `Step`, its words in `describe`), its binaries in
solver/formulation.py (`_vars`, `_binaries`, `_placement`), and its handler in the runtime, which runs the
events and never imports these rules.
"""

from lazytrain.ir.placement import KINDS
# registers them, in this order
from lazytrain.solver.steps import resident, host, prefetch, job, backward  # noqa: F401, I001
from lazytrain.solver.steps.base import RULES, StageTerms, StepRule, StreamedRule

# the step model adds the kinds' terms in this order, the order of `KINDS`
if list(RULES) != list(dict.fromkeys(KINDS.values())):
    raise ImportError(f"step rules {list(RULES)}: one per kind of ir/placement.py KINDS, in its order")

__all__ = ["RULES", "StageTerms", "StepRule", "StreamedRule"]
