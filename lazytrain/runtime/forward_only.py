"""An evaluation's forward alone: the loss of a batch without backward (`Trainer.loss`).

NOTE: [Forward-only evaluation]
An evaluation needs the loss, not gradients, so `Trainer.loss` runs the stages' forwards one after
another without autograd, not the step's events: a streamed stage's weights fetched into its slot
(`fetch_stage`, as `synchronize` fetches them) and released after its forward, a cast-on-use
stage's cast from its master, the chunked loss stage's slices one by one (`chunked_forward`), and
each output dropped after its last reader. Its FLOPs are the step's forward, 2N of 6N a token (no
backward, no recompute) and it gives the step's loss: the same forwards, and for a chunked loss
the same sums in the same order. Its streamed weights come beside the forwards before them, as
the step's do (NOTE: [Evaluation fetches ahead]).
It keeps within the plan's memory: at stage s it holds a subset of what the step holds at its
forward F(s). The persistent state is the same, with no gradients (`zero_grad` first). The weight
slot is s's own, which F(s) holds too. The outputs are those a later stage reads, each on the
device from its stage's forward to its last reader's in the step as here (the runtime brings
nothing back during forward). And s's forward without autograd is the step's recomputed forward,
the least a forward of s holds. Nothing is saved for backward.
Only on one process without sharded state and with the masters off the disk, whose weights move by
paths of their own (collectives, the masters' disk reads): there an evaluation runs the whole step,
discarding its gradients (`whole_step_reason` says why). The disk tier's optimizer states and stage
outputs leave it alone: a forward reads no state, and an output offloaded to disk in the step is
one backward reads, which an evaluation never runs (its ring is reset by `begin`, as a step's is).
So an evaluation there costs its forwards, not a step (the 32B row with states on disk: a 7.40 s
step on the H200, 2026-12-04, of whose FLOPs the forwards are a third).

NOTE: [Evaluation fetches ahead]
A streamed stage's weights are fetched on the H2D stream beside the forwards before it, as the
step's prefetches are, not in series with compute: just before F(s) an evaluation starts the
fetch of every streamed stage whose forward prefetch the step issues before F(s)'s compute, in the
schedule's event order (`fetches_ahead`), and F(t)'s compute waits for t's. Memory stays within
the plan: the step holds those weight slots at F(s) too (`verify`'s trace counts a buffer from its
event to its FREE), and what the evaluation holds beside them is a subset of the step's (above). A
streamed stage no step prefetch precedes in forward (a chunked loss stage, whose forward runs inside
its backward) is fetched in series at its forward, as before. The copies are the step's
(`fetch_stage` without updates); on the CPU they run in order.
"""

from __future__ import annotations

import torch

from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.runtime.chunked import chunked_forward


def whole_step_reason(trainer) -> str | None:
    """Why `trainer`'s evaluations must run the whole step (NOTE: [Forward-only evaluation]), or None."""
    if trainer.dp is not None:
        return "data parallel: the loss is the global batch's"
    if trainer.disk_masters is not None:
        return "the disk tier holds the master weights"
    return None


def fetches_ahead(events, placements) -> dict[int, tuple[int, ...]]:
    """For each stage s, the streamed stages whose weights an evaluation fetches just before F(s),
    beside compute: those whose forward prefetch the step issues before F(s) (NOTE: [Evaluation
    fetches ahead])."""
    out, waiting, seen = {}, [], set()
    for e in events:
        if e.kind is Kind.COMPUTE and e.phase is Phase.BWD:
            break
        if e.kind is Kind.PREFETCH and e.stage not in seen:
            seen.add(e.stage)
            placement = placements[e.stage]
            if placement.streamed and not placement.weights.cast_on_use:
                waiting.append(e.stage)
        elif e.kind is Kind.COMPUTE and e.phase is Phase.FWD:
            out[e.stage], waiting = tuple(waiting), []
    return out


def _fetch_aside(replay, stage: int):
    """`stage`'s weights fetched on the H2D stream (in order on the CPU): the CUDA event of their
    arrival, or None."""
    if not replay.cuda:
        replay.fetch_stage(stage, update=False)
        return None
    h2d = replay.streams.stream(Stream.H2D)
    with torch.cuda.stream(h2d):  # its slot comes from the compute stream's pool (`streams.slot`)
        replay.fetch_stage(stage, update=False)
        arrived = torch.cuda.Event()
        arrived.record(h2d)
    return arrived


def forward_loss(replay) -> None:
    """Each stage's forward without autograd, in order; the loss lands where the step's does
    (`replay.end()` returns it). `replay.begin(batch)` has run, and no optimizer step is pending."""
    stages = replay.stages
    last = {x: s.index for s in stages for x in s.inputs}  # each input's last reader (stages run in order)
    made = {name for s in stages for name in s.outputs}  # activations, not batch inputs or buffers
    ahead = fetches_ahead(replay.events, [s.placement for s in stages])
    fetched: dict[int, object] = {}  # stage -> its weights' arrival (None: in order)
    for stage in stages:
        for t in ahead.get(stage.index, ()):  # NOTE: [Evaluation fetches ahead]
            fetched[t] = _fetch_aside(replay, t)
        weights = stage.placement.weights
        if weights.cast_on_use:  # NOTE: [Resident weights cast on use] in solver/footprint.py
            replay._cast_weights(stage.index)
        elif stage.placement.streamed and stage.index not in fetched:
            replay.fetch_stage(stage.index, update=False)
        elif fetched.get(stage.index) is not None:
            torch.cuda.current_stream(replay.device).wait_event(fetched[stage.index])
        if stage.chunks > 1:  # NOTE: [Chunked loss] in chunked.py
            outs = (chunked_forward(stage, replay.env, replay._weight, replay.m.PLACEHOLDERS, replay.device),)
        else:
            outs = replay._call(stage, grad=False)[1]
        if weights.cast_on_use or stage.placement.streamed:
            replay.release_weights(stage.index)
        replay._publish(stage, outs)
        for x in stage.inputs:
            if last[x] == stage.index and x in made:
                del replay.env[x]
